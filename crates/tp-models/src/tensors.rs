//! Every tensor a config implies, checked against a checkpoint before anything is loaded:
//! present, of the implied shape, a float dtype; biases present exactly where the config says.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::moe_config::MoeSettings;
use tp_layers::{Checkpoint, FusedExperts, MlpNames, Projections, QkNormSpan};

/// Every `(name, shape)` of the model's parameters, in Hugging Face's order, and the names of
/// biases the config says the model has not (present, they are an error).
pub fn expected_tensors(c: &ModelConfig) -> (Vec<(String, Vec<usize>)>, Vec<String>) {
    let names = c.architecture.spec().names;
    let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (q, kv) = (c.num_attention_heads * d, c.num_key_value_heads * d);
    let mut want = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h])];
    let mut absent = Vec::new();
    let mut linear = |want: &mut Vec<(String, Vec<usize>)>, name: String, out: usize, inp: usize, bias: bool| {
        want.push((format!("{name}.weight"), vec![out, inp]));
        if bias {
            want.push((format!("{name}.bias"), vec![out]));
        } else {
            absent.push(format!("{name}.bias"));
        }
    };
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let n = names.norms;
        for norm in [n.attn_in, n.attn_out, n.mlp_in, n.mlp_out].into_iter().flatten() {
            want.push((format!("{p}.{norm}.weight"), vec![h]));
        }
        let attn = format!("{p}.{}", names.attn);
        let an = names.attn_names;
        match an.qkv {
            Projections::Separate([qn, kn, vn]) => {
                linear(&mut want, format!("{attn}.{qn}"), q, h, c.qkv_bias);
                linear(&mut want, format!("{attn}.{kn}"), kv, h, c.qkv_bias);
                linear(&mut want, format!("{attn}.{vn}"), kv, h, c.qkv_bias);
            }
            Projections::Fused(f) => linear(&mut want, format!("{attn}.{f}"), q + 2 * kv, h, c.qkv_bias),
        }
        linear(&mut want, format!("{attn}.{}", an.o), h, q, c.o_bias);
        match c.qk_norm {
            Some(QkNormSpan::PerHead) => {
                want.push((format!("{attn}.{}.weight", an.q_norm), vec![d]));
                want.push((format!("{attn}.{}.weight", an.k_norm), vec![d]));
            }
            Some(QkNormSpan::FullWidth) => {
                want.push((format!("{attn}.{}.weight", an.q_norm), vec![q]));
                want.push((format!("{attn}.{}.weight", an.k_norm), vec![kv]));
            }
            None => {}
        }
        if c.architecture.spec().sinks {
            want.push((format!("{attn}.{}", an.sinks), vec![c.num_attention_heads]));
        }
        if let (Some(moe), Some((prefixes, _))) = (c.moe.as_ref().filter(|m| m.is_sparse(l)), names.moe) {
            want.extend(moe_tensors(c, moe, &format!("{p}.{}", prefixes[0]), Experts::PerExpert));
            continue;
        }
        let mlp = format!("{p}.{}", names.mlp);
        match names.mlp_names.gate_up {
            Projections::Separate([g, u]) => {
                linear(&mut want, format!("{mlp}.{g}"), i, h, c.mlp_bias);
                linear(&mut want, format!("{mlp}.{u}"), i, h, c.mlp_bias);
            }
            Projections::Fused(f) => linear(&mut want, format!("{mlp}.{f}"), 2 * i, h, c.mlp_bias),
        }
        linear(&mut want, format!("{mlp}.{}", names.mlp_names.down), h, i, c.mlp_bias);
    }
    want.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        want.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    (want, absent)
}

/// How a checkpoint holds an MoE layer's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Experts {
    /// One tensor per expert and projection (the Hub's layout for most families; how tp names
    /// gpt-oss's experts read from a GGUF file's stacked tensors, with their biases).
    PerExpert,
    /// The family's fused tensors (transformers 5's, or gpt-oss's interleaved ones).
    Fused,
    /// gpt-oss's MXFP4 `*_blocks` and `*_scales` (`U8`, checked as they load) and the biases.
    Packed,
}

/// The tensors of MoE layer under `prefix` (`model.layers.N.mlp`): the router `gate` `[E, H]`,
/// each expert's gated MLP (one tensor per expert as on the Hub; `Fused`: transformers 5's
/// `experts.gate_up_proj: [E, 2I, H]` and `experts.down_proj: [E, H, I]`), and Qwen2-MoE's
/// shared expert and its gate `[1, H]`; gpt-oss's router bias and experts with biases (its
/// interleaved fused tensors, or their MXFP4 blocks, which are checked as they load).
fn moe_tensors(c: &ModelConfig, moe: &MoeSettings, prefix: &str, layout: Experts) -> Vec<(String, Vec<usize>)> {
    let Some((_, n)) = c.architecture.spec().names.moe else { return Vec::new() };
    let (h, e, i) = (c.hidden_size, moe.num_experts, moe.expert_intermediate_size);
    let mut want = vec![(format!("{prefix}.{}.weight", n.router), vec![e, h])];
    if n.fused == FusedExperts::Interleaved {
        let x = format!("{prefix}.{}", n.experts);
        want.push((format!("{prefix}.{}.bias", n.router), vec![e]));
        if layout == Experts::PerExpert {
            let Projections::Separate([g, u]) = n.expert.gate_up else { return want };
            for k in 0..e {
                for (proj, dims) in [(g, [i, h]), (u, [i, h]), (n.expert.down, [h, i])] {
                    want.push((format!("{x}.{k}.{proj}.weight"), dims.to_vec()));
                    want.push((format!("{x}.{k}.{proj}.bias"), vec![dims[0]]));
                }
            }
            return want;
        }
        want.push((format!("{x}.gate_up_proj_bias"), vec![e, 2 * i]));
        want.push((format!("{x}.down_proj_bias"), vec![e, h]));
        if layout == Experts::Fused {
            want.push((format!("{x}.gate_up_proj"), vec![e, h, 2 * i]));
            want.push((format!("{x}.down_proj"), vec![e, i, h]));
        }
        return want;
    }
    let fused = layout == Experts::Fused;
    let mlp = |want: &mut Vec<(String, Vec<usize>)>, p: String, names: MlpNames, i: usize| match names.gate_up {
        Projections::Separate([g, u]) => {
            want.push((format!("{p}.{g}.weight"), vec![i, h]));
            want.push((format!("{p}.{u}.weight"), vec![i, h]));
            want.push((format!("{p}.{}.weight", names.down), vec![h, i]));
        }
        Projections::Fused(f) => {
            want.push((format!("{p}.{f}.weight"), vec![2 * i, h]));
            want.push((format!("{p}.{}.weight", names.down), vec![h, i]));
        }
    };
    if fused {
        want.push((format!("{prefix}.{}.gate_up_proj", n.experts), vec![e, 2 * i, h]));
        want.push((format!("{prefix}.{}.down_proj", n.experts), vec![e, h, i]));
    } else {
        for x in 0..e {
            mlp(&mut want, format!("{prefix}.{}.{x}", n.experts), n.expert, i);
        }
    }
    if let (Some((shared, gate)), Some(si)) = (n.shared, moe.shared_expert_intermediate_size) {
        mlp(&mut want, format!("{prefix}.{shared}"), MlpNames::default(), si);
        want.push((format!("{prefix}.{gate}.weight"), vec![1, h]));
    }
    want
}

/// Checks every tensor the config implies against the checkpoint (an MoE layer's experts in
/// whichever layout the checkpoint holds them).
pub(crate) fn check_tensors(ckpt: &Checkpoint, c: &ModelConfig) -> Result<()> {
    let (mut want, absent) = expected_tensors(c);
    if let (Some(moe), Some((prefixes, n))) = (&c.moe, c.architecture.spec().names.moe) {
        for l in (0..c.num_hidden_layers).filter(|&l| moe.is_sparse(l)) {
            let layer = format!("model.layers.{l}");
            // The prefix the checkpoint uses (Mixtral's `block_sparse_moe`, or `mlp`).
            let prefix = prefixes
                .iter()
                .map(|p| format!("{layer}.{p}"))
                .find(|p| ckpt.contains(&format!("{p}.{}.weight", n.router)))
                .unwrap_or_else(|| format!("{layer}.{}", prefixes[0]));
            let layout = if ckpt.contains(&format!("{prefix}.{}.gate_up_proj", n.experts)) {
                Experts::Fused
            } else if ckpt.contains(&format!("{prefix}.{}.gate_up_proj_blocks", n.experts)) {
                Experts::Packed
            } else {
                Experts::PerExpert
            };
            let default = format!("{layer}.{}", prefixes[0]);
            want.retain(|(name, _)| !name.starts_with(&format!("{default}.")));
            want.extend(moe_tensors(c, moe, &prefix, layout));
        }
    }
    for (name, dims) in want {
        ckpt.param_info(&name)?;
        ckpt.expect(&name, &dims, None)?;
    }
    if let Some(name) = absent.into_iter().find(|n| ckpt.contains(n)) {
        return Err(ModelError::Unsupported {
            field: "checkpoint".into(),
            value: format!("{name:?}"),
            why: format!(
                "a {:?} model with this config has no such bias (attention_bias / mlp_bias say so)",
                c.architecture
            ),
        });
    }
    Ok(())
}
