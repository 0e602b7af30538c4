//! Hugging Face tensor names to llama.cpp's, by the role each tensor plays in the family's
//! block (the architecture table's [`tp_layers::DecoderNames`]), as llama.cpp's converter
//! names them:
//!
//! * norms: before attention `attn_norm`, after it `post_attention_norm`, before the MLP
//!   `ffn_norm`, after it `post_ffw_norm` (Llama's `post_attention_layernorm` is its MLP's input
//!   norm, `ffn_norm`; Gemma 3's and OLMo 2's is `post_attention_norm`);
//! * attention: `attn_q`, `attn_k`, `attn_v`, or fused `attn_qkv` (Phi-3's `qkv_proj`, rows in
//!   the same order); `attn_output`; `attn_q_norm`, `attn_k_norm`;
//! * MLP: `ffn_gate`, `ffn_up`, or fused gate and up rows in `ffn_up` (Phi-3's `gate_up_proj`,
//!   gate first, as Hugging Face stacks them); `ffn_down`.
//!
//! gpt-oss's converter names its MLP's input norm (`post_attention_layernorm`)
//! `post_attention_norm`, its sinks `attn_sinks`, and splits its interleaved experts into
//! `ffn_{gate,up,down}_exps` with their biases `ffn_*_exps.bias: [E, rows]` and the router's
//! `ffn_gate_inp.bias`.
//!
//! What llama.cpp changed in a tensor is read back: Q and K rows of `llama` in its rotary
//! layout ([`RowOrder::Rotary`]), and Gemma's norms, stored as `1 + w`, shifted by `-1`.

use super::config::{GgufArch, gguf_arch};
use crate::arch::Architecture;
use crate::config::ModelConfig;
use crate::error::Result;
use std::collections::HashSet;
use std::path::Path;
use tp_core::NormStyle;
use tp_gguf::GgufFile;
use tp_layers::{GgufPart, GgufTensor, Projections, RowOrder};

/// A block tensor's Hugging Face module (under `model.layers.N`) and llama.cpp name.
struct LayerName {
    hf: String,
    gguf: &'static str,
    norm: bool,
}

/// Every block tensor of `family` under its llama.cpp name.
fn layer_names(family: Architecture) -> Vec<LayerName> {
    let n = family.decoder_names();
    let mut v = Vec::new();
    let mut push = |hf: String, gguf: &'static str, norm: bool| v.push(LayerName { hf, gguf, norm });
    let b = n.norms;
    let mlp_in = if family == Architecture::GptOss { "post_attention_norm" } else { "ffn_norm" };
    for (hf, gguf) in [
        (b.attn_in, "attn_norm"),
        (b.attn_out, "post_attention_norm"),
        (b.mlp_in, mlp_in),
        (b.mlp_out, "post_ffw_norm"),
    ] {
        if let Some(hf) = hf {
            push(hf.to_string(), gguf, true);
        }
    }
    let (attn, a) = (n.attn, n.attn_names);
    match a.qkv {
        Projections::Separate([q, k, v]) => {
            push(format!("{attn}.{q}"), "attn_q", false);
            push(format!("{attn}.{k}"), "attn_k", false);
            push(format!("{attn}.{v}"), "attn_v", false);
        }
        Projections::Fused(f) => push(format!("{attn}.{f}"), "attn_qkv", false),
    }
    push(format!("{attn}.{}", a.o), "attn_output", false);
    push(format!("{attn}.{}", a.q_norm), "attn_q_norm", true);
    push(format!("{attn}.{}", a.k_norm), "attn_k_norm", true);
    let (mlp, f) = (n.mlp, n.mlp_names);
    match f.gate_up {
        Projections::Separate([g, u]) => {
            push(format!("{mlp}.{g}"), "ffn_gate", false);
            push(format!("{mlp}.{u}"), "ffn_up", false);
        }
        Projections::Fused(gu) => push(format!("{mlp}.{gu}"), "ffn_up", false),
    }
    push(format!("{mlp}.{}", f.down), "ffn_down", false);
    v
}

/// Every tensor `c` implies, Hugging Face name to GGUF name (`arch`: the file's
/// `general.architecture`, one [`super::config::ARCHS`] names).
pub(crate) fn tensor_map(c: &ModelConfig, arch: &str) -> Vec<GgufTensor> {
    let (want, _) = crate::tensors::expected_tensors(c);
    let rotary = gguf_arch(arch).is_some_and(|a| a.rotary_qk);
    let shift = if c.norm_style == NormStyle::OnePlusWeight { -1.0 } else { 0.0 };
    let layer = layer_names(c.architecture);
    want.into_iter()
        .filter_map(|(name, _)| {
            let top = match name.as_str() {
                "model.embed_tokens.weight" => Some(("token_embd.weight", 0.0)),
                "model.norm.weight" => Some(("output_norm.weight", shift)),
                "lm_head.weight" => Some(("output.weight", 0.0)),
                _ => None,
            };
            if let Some((g, shift)) = top {
                return Some(GgufTensor { shift, ..GgufTensor::new(name, g.to_string()) });
            }
            let (l, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
            if let Some(t) = moe_tensor(c, l, rest, &name) {
                return Some(t);
            }
            let n = c.architecture.decoder_names();
            if rest == format!("{}.{}", n.attn, n.attn_names.sinks) {
                let gguf_name = format!("blk.{l}.attn_sinks.weight");
                return Some(GgufTensor::new(name, gguf_name));
            }
            let (module, param) = rest.rsplit_once('.')?;
            let entry = layer.iter().find(|e| e.hf == module)?;
            let rows = match entry.gguf {
                "attn_q" if rotary => RowOrder::Rotary { heads: c.num_attention_heads },
                "attn_k" if rotary => RowOrder::Rotary { heads: c.num_key_value_heads },
                _ => RowOrder::Stored,
            };
            let gguf_name = format!("blk.{l}.{}.{param}", entry.gguf);
            Some(GgufTensor { rows, shift: if entry.norm { shift } else { 0.0 }, ..GgufTensor::new(name, gguf_name) })
        })
        .collect()
}

/// The llama.cpp tensor of an MoE layer's `rest` (the name under `model.layers.{l}`), if it is
/// one: the router `ffn_gate_inp`; expert `e`'s projections as slice `e` of the stacked
/// `ffn_{gate,up,down}_exps`; the shared expert's `ffn_{gate,up,down}_shexp` and its gate
/// `ffn_gate_inp_shexp` (a vector for the `[1, H]` weight).
fn moe_tensor(c: &ModelConfig, l: &str, rest: &str, name: &str) -> Option<GgufTensor> {
    let (prefixes, n) = c.architecture.decoder_names().moe?;
    let rest = prefixes.iter().find_map(|p| rest.strip_prefix(p)?.strip_prefix('.'))?;
    let param = if rest.ends_with(".bias") { "bias" } else { "weight" };
    let tensor = |gguf: &str, part: GgufPart| {
        Some(GgufTensor { part, ..GgufTensor::new(name.to_string(), format!("blk.{l}.{gguf}.{param}")) })
    };
    if rest == format!("{}.{param}", n.router) {
        return tensor("ffn_gate_inp", GgufPart::Whole);
    }
    if let Some((shared, gate)) = n.shared {
        if rest == format!("{gate}.weight") {
            return tensor("ffn_gate_inp_shexp", GgufPart::Row);
        }
        if let Some(proj) = rest.strip_prefix(shared).and_then(|r| r.strip_prefix('.')) {
            let role = ["gate_proj", "up_proj", "down_proj"].iter().position(|p| proj == format!("{p}.weight"))?;
            return tensor(["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"][role], GgufPart::Whole);
        }
    }
    let (e, proj) = rest.strip_prefix(n.experts)?.strip_prefix('.')?.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let Projections::Separate([g, u]) = n.expert.gate_up else { return None };
    let gguf = [(g, "ffn_gate_exps"), (u, "ffn_up_exps"), (n.expert.down, "ffn_down_exps")]
        .into_iter()
        .find(|(hf, _)| proj == format!("{hf}.{param}"))?
        .1;
    tensor(gguf, GgufPart::Expert(e))
}

/// Fails on the first tensor of `file` that is neither in `mapped` nor read into the config:
/// a tensor tp would otherwise ignore (a bias the family has no place for, separate Q/K/V in
/// a file whose family fuses them, ...).
pub(crate) fn check_all_mapped(file: &GgufFile, path: &Path, spec: &GgufArch, mapped: &[GgufTensor]) -> Result<()> {
    let known: HashSet<&str> =
        mapped.iter().map(|t| t.gguf_name.as_str()).chain(spec.config_tensors.iter().copied()).collect();
    match file.tensors().iter().find(|t| !known.contains(t.name.as_str())) {
        None => Ok(()),
        Some(t) => Err(super::file_err(
            path,
            format!(
                "holds tensor {}, which a {} model with this config has no place for (tp would ignore it)",
                tp_layers::quote_text(&t.name),
                spec.name
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names llama.cpp's converter gives (gguf-py's tensor map for each architecture).
    #[test]
    fn block_names_follow_llama_cpp() {
        let find =
            |family: Architecture, hf: &str| layer_names(family).into_iter().find(|e| e.hf == hf).map(|e| e.gguf);
        assert_eq!(find(Architecture::Llama, "post_attention_layernorm"), Some("ffn_norm"));
        assert_eq!(find(Architecture::Gemma3, "post_attention_layernorm"), Some("post_attention_norm"));
        assert_eq!(find(Architecture::Gemma3, "pre_feedforward_layernorm"), Some("ffn_norm"));
        assert_eq!(find(Architecture::Gemma3, "post_feedforward_layernorm"), Some("post_ffw_norm"));
        assert_eq!(find(Architecture::Olmo2, "post_attention_layernorm"), Some("post_attention_norm"));
        assert_eq!(find(Architecture::Olmo2, "input_layernorm"), None);
        assert_eq!(find(Architecture::Phi3, "self_attn.qkv_proj"), Some("attn_qkv"));
        assert_eq!(find(Architecture::Phi3, "mlp.gate_up_proj"), Some("ffn_up"));
        assert_eq!(find(Architecture::Phi3, "post_attention_layernorm"), Some("ffn_norm"));
    }
}
