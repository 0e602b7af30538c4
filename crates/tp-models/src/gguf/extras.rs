//! Each family's extras in a GGUF file, as llama.cpp writes and reads them, into the
//! `config.json` keys of the Hugging Face original:
//!
//! * Gemma 3: the sliding layers (`attention.sliding_window`, 0 or absent: none; which layers:
//!   `attention.sliding_window_pattern`, a period `n` (every `n`-th layer full) or one bool per
//!   layer, absent: 6), the local rope base (`rope.freq_base_swa`, absent: 10000), the attention
//!   scale llama.cpp uses (`1/sqrt(head_dim)`; for the 62-layer 27B,
//!   `1/sqrt(embedding_length / head_count)`) as `query_pre_attn_scalar`, and
//!   `final_logit_softcapping`. `attn_logit_softcapping` is ignored, as llama.cpp and
//!   transformers ignore it for Gemma 3.
//! * Phi-3: `attention.sliding_window` (0: none; llama.cpp runs Phi-3 without it, Hugging
//!   Face's Phi-3 and tp within it), `rope.scaling.original_context_length`, and
//!   LongRoPE from the `rope_factors_long` / `rope_factors_short` tensors, with
//!   `rope.scaling.attn_factor` where it is not LongRoPE's own default.
//! * OLMo 2: a sliding window (OLMo 3's layers, same GGUF architecture) is refused.

use super::Meta;
use super::config::Dims;
use crate::arch::Architecture;
use crate::error::Result;
use serde_json::{Map, Value, json};
use tp_core::quant::{QuantType, dequantize};
use tp_gguf::{Array, Value as GgufValue};

/// Phi-3's LongRoPE factors for long sequences, one per rotated pair.
pub(crate) const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
/// Phi-3's LongRoPE factors for short sequences.
pub(crate) const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";

/// Adds the extras of `family` to `c`.
pub(crate) fn family_extras(m: &Meta<'_>, family: Architecture, dims: Dims, c: &mut Map<String, Value>) -> Result<()> {
    match family {
        Architecture::Gemma3 => gemma3(m, dims, c),
        Architecture::Phi3 => phi3(m, dims, c),
        Architecture::GptOss => gpt_oss(m, c),
        Architecture::Olmo2 => match window(m)? {
            Some(w) => Err(m.err(
                "attention.sliding_window",
                format!(
                    "({w}): sliding-window layers (OLMo 3's) are not read; an OLMo 2 layer attends to every position"
                ),
            )),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// gpt-oss: its window (every even layer slides, as in llama.cpp and transformers; absent, the
/// config class's 128), and its
/// YaRN as transformers reads gpt-oss's config: `truncate: false` (llama.cpp's file has no such
/// key; every gpt-oss config sets it).
fn gpt_oss(m: &Meta<'_>, c: &mut Map<String, Value>) -> Result<()> {
    if let Some(w) = window(m)? {
        c.insert("sliding_window".into(), json!(w));
    }
    if let Some(Value::Object(s)) = c.get_mut("rope_scaling")
        && s.get("rope_type").and_then(Value::as_str) == Some("yarn")
    {
        s.insert("truncate".into(), json!(false));
    }
    Ok(())
}

/// `attention.sliding_window`, if positive.
fn window(m: &Meta<'_>) -> Result<Option<u64>> {
    Ok(m.u64("attention.sliding_window")?.filter(|&w| w > 0))
}

fn gemma3(m: &Meta<'_>, d: Dims, c: &mut Map<String, Value>) -> Result<()> {
    let sliding = match window(m)? {
        Some(w) => {
            c.insert("sliding_window".into(), json!(w));
            sliding_layers(m, d.layers, 6)?
        }
        None => vec![false; usize::try_from(d.layers).unwrap_or(0)],
    };
    let types: Vec<&str> = sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
    c.insert("layer_types".into(), json!(types));
    if let Some(b) = m.decimal("rope.freq_base_swa")? {
        c.insert("rope_local_base_freq".into(), json!(b));
    }
    // llama.cpp's rule (after gemma_pytorch): 27B scales by its embedding per head.
    let scalar = if d.layers == 62 { d.hidden / d.heads.max(1) } else { d.head_dim };
    c.insert("query_pre_attn_scalar".into(), json!(scalar));
    if let Some(cap) = m.decimal("final_logit_softcapping")?.filter(|&x| x != 0.0) {
        c.insert("final_logit_softcapping".into(), json!(cap));
    }
    // `attn_logit_softcapping` is ignored, as llama.cpp's and transformers' Gemma 3 ignore it
    // (read only to check its type).
    let _ = m.f32("attn_logit_softcapping")?;
    Ok(())
}

/// Which of `layers` layers are sliding, as llama.cpp reads `attention.sliding_window_pattern`:
/// one bool per layer, or a period `n` (layer `i` slides unless `i % n == n - 1`; 0: every
/// layer slides), absent: `default`.
fn sliding_layers(m: &Meta<'_>, layers: u64, default: u64) -> Result<Vec<bool>> {
    let k = "attention.sliding_window_pattern";
    let period = match m.file.get(&m.key(k)) {
        None => default,
        Some(GgufValue::Array(Array::Bool(v))) if v.len() as u64 == layers => return Ok(v.clone()),
        Some(GgufValue::Array(a)) => {
            return Err(
                m.err(k, format!("must hold one bool per layer ({layers}), got {} of {}", a.len(), a.type_name()))
            );
        }
        Some(_) => m.need(k)?,
    };
    Ok((0..layers).map(|i| period == 0 || i % period < period - 1).collect())
}

fn phi3(m: &Meta<'_>, d: Dims, c: &mut Map<String, Value>) -> Result<()> {
    if let Some(w) = window(m)? {
        c.insert("sliding_window".into(), json!(w));
    }
    let original = m.u64("rope.scaling.original_context_length")?;
    if let Some(n) = original {
        c.insert("original_max_position_embeddings".into(), json!(n));
    }
    let (long, short) = (factors(m, ROPE_FACTORS_LONG)?, factors(m, ROPE_FACTORS_SHORT)?);
    let (long, short) = match (long, short) {
        (None, None) => return Ok(()),
        (Some(l), Some(s)) => (l, s),
        _ => {
            return Err(
                m.file_err(format!("holds one of {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT}; LongRoPE needs both"))
            );
        }
    };
    let mut s = json!({"rope_type": "longrope", "long_factor": long, "short_factor": short});
    // LongRoPE's own attention factor (Phi3Config's, with its default original length of 4096)
    // is what llama.cpp's converter stores for `longrope`, rounded to f32: then it is left to
    // the config reader in full precision. Another value (its `yarn` rule) is passed on.
    if let Some(stored) = m.f32("rope.scaling.attn_factor")? {
        let orig = original.unwrap_or(4096) as f64;
        let factor = d.max_positions as f64 / orig;
        let own = if factor <= 1.0 { 1.0 } else { (1.0 + factor.ln() / orig.ln()).sqrt() };
        if stored != own as f32 {
            s["attention_factor"] = json!(m.decimal("rope.scaling.attn_factor")?);
        }
    }
    c.insert("rope_scaling".into(), s);
    Ok(())
}

/// The values of the 1-D tensor `name`, if the file has it.
fn factors(m: &Meta<'_>, name: &str) -> Result<Option<Vec<f64>>> {
    let Some(t) = m.file.tensor(name) else { return Ok(None) };
    let bad = |why: String| m.file_err(format!("tensor {name}: {why}"));
    let [n] = t.dims[..] else { return Err(bad(format!("has {} dims; rotary factors have 1", t.dims.len()))) };
    let q = QuantType::from_ggml_id(t.ggml_type.0)
        .ok_or_else(|| bad(format!("GGML type {} is not one tp reads", t.ggml_type.0)))?;
    let mut out = vec![0f32; usize::try_from(n).map_err(|_| bad("is too long".into()))?];
    dequantize(q, m.file.tensor_data(t), &mut out).map_err(|e| bad(e.to_string()))?;
    if let Some(x) = out.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        return Err(bad(format!("holds {x}; rotary factors are positive")));
    }
    Ok(Some(out.into_iter().map(f64::from).collect()))
}
