//! From tp's parameter names to a family's own checkpoint layout, for the tensors tp writes
//! (checkpoints, dumped gradients).
//!
//! tp names each expert's projections apart (`mlp.experts.{e}.gate_proj.weight: [I, H]`, its
//! `up_proj` and `down_proj: [H, I]`, with their biases), as most Hub checkpoints of mixtures do.
//! gpt-oss's checkpoints hold every layer's experts fused and interleaved instead, and that is
//! the layout transformers loads:
//!
//! * `experts.gate_up_proj: [E, H, 2I]`, column `2j` gate feature `j`, column `2j + 1` up
//!   feature `j` (so `gate_up_proj[e] = interleave(gate_e, up_e)^T`);
//! * `experts.gate_up_proj_bias: [E, 2I]`, interleaved the same way;
//! * `experts.down_proj: [E, I, H]` (`down_e^T`) and `experts.down_proj_bias: [E, H]`.
//!
//! The loader reads that layout back (`tp-layers`' interleaved experts), so a checkpoint tp
//! writes loads in tp and in transformers.

use crate::arch::Architecture;
use crate::error::{ModelError, Result};
use std::collections::BTreeMap;
use tp_core::{DType, Device, Tensor};

/// The per-expert projections of one expert: `[gate, up, down]` weights then biases.
const PARTS: [&str; 6] =
    ["gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_proj.bias", "up_proj.bias", "down_proj.bias"];

/// `tensors` (full tensors under tp's parameter names) in `arch`'s checkpoint layout: gpt-oss's
/// experts fused and interleaved (see the module docs); every other family unchanged.
///
/// Errors: a gpt-oss layer whose experts are incomplete (an expert without one of its six
/// tensors, or of other shapes than the first's).
pub fn to_checkpoint_layout(
    arch: Architecture,
    mut tensors: BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    if arch != Architecture::GptOss {
        return Ok(tensors);
    }
    // Each `...mlp.experts` prefix and its largest expert index.
    let mut layers: BTreeMap<String, usize> = BTreeMap::new();
    for name in tensors.keys() {
        if let Some((prefix, e)) = expert_of(name) {
            let n = layers.entry(prefix.to_string()).or_insert(0);
            *n = (*n).max(e + 1);
        }
    }
    for (prefix, experts) in layers {
        let mut parts: Vec<[Tensor; 6]> = Vec::with_capacity(experts);
        for e in 0..experts {
            let mut six = Vec::with_capacity(6);
            for part in PARTS {
                let name = format!("{prefix}.{e}.{part}");
                six.push(tensors.remove(&name).ok_or_else(|| {
                    ModelError::Request(format!(
                        "{name} is missing: gpt-oss's experts are written fused, every one whole"
                    ))
                })?);
            }
            parts.push(six.try_into().map_err(|_| ModelError::Request("six expert tensors".into()))?);
        }
        for (name, t) in fuse(&prefix, &parts)? {
            tensors.insert(name, t);
        }
    }
    Ok(tensors)
}

/// `(prefix, e)` of a per-expert tensor name `{prefix}.{e}.{part}`, `prefix` ending in
/// `.experts`.
fn expert_of(name: &str) -> Option<(&str, usize)> {
    let part = PARTS.iter().find(|p| name.ends_with(&format!(".{p}")))?;
    let rest = &name[..name.len() - part.len() - 1];
    let (prefix, e) = rest.rsplit_once('.')?;
    prefix.ends_with(".experts").then_some(())?;
    Some((prefix, e.parse().ok()?))
}

/// The four fused tensors of one layer's experts `parts[e] = [gate, up, down, gate bias,
/// up bias, down bias]`, in the first gate weight's dtype.
fn fuse(prefix: &str, parts: &[[Tensor; 6]]) -> Result<Vec<(String, Tensor)>> {
    let first = &parts[0];
    let (&[inter, hidden], dtype) = (first[0].dims(), first[0].dtype()) else {
        return Err(ModelError::Request(format!("{prefix}.0.gate_proj.weight is not a matrix")));
    };
    let want: [&[usize]; 6] = [&[inter, hidden], &[inter, hidden], &[hidden, inter], &[inter], &[inter], &[hidden]];
    let e = parts.len();
    let (mut gate_up, mut gate_up_bias) =
        (Vec::with_capacity(e * hidden * 2 * inter), Vec::with_capacity(e * 2 * inter));
    let (mut down, mut down_bias) = (Vec::with_capacity(e * inter * hidden), Vec::with_capacity(e * hidden));
    for (x, six) in parts.iter().enumerate() {
        let mut v = Vec::with_capacity(6);
        for ((t, dims), part) in six.iter().zip(want).zip(PARTS) {
            if t.dims() != dims {
                return Err(ModelError::Request(format!(
                    "{prefix}.{x}.{part} has shape {:?}; {dims:?} expected (as expert 0's)",
                    t.dims()
                )));
            }
            v.push(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?);
        }
        let [g, u, d, gb, ub, db]: [Vec<f32>; 6] = v.try_into().map_err(|_| ModelError::Request("six".into()))?;
        for h in 0..hidden {
            for j in 0..inter {
                gate_up.push(g[j * hidden + h]);
                gate_up.push(u[j * hidden + h]);
            }
        }
        for j in 0..inter {
            gate_up_bias.extend([gb[j], ub[j]]);
            down.extend((0..hidden).map(|h| d[h * inter + j]));
        }
        down_bias.extend(db);
    }
    let cpu = Device::Cpu;
    let t = |v: Vec<f32>, dims: &[usize]| -> Result<Tensor> { Ok(Tensor::from_vec(v, dims, &cpu)?.to_dtype(dtype)?) };
    Ok(vec![
        (format!("{prefix}.gate_up_proj"), t(gate_up, &[e, hidden, 2 * inter])?),
        (format!("{prefix}.gate_up_proj_bias"), t(gate_up_bias, &[e, 2 * inter])?),
        (format!("{prefix}.down_proj"), t(down, &[e, inter, hidden])?),
        (format!("{prefix}.down_proj_bias"), t(down_bias, &[e, hidden])?),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, dims: &[usize], base: f32) -> Tensor {
        Tensor::from_vec((0..n).map(|i| base + i as f32).collect(), dims, &Device::Cpu).unwrap()
    }

    /// Every element lands where gpt-oss's layout puts it; other names and families pass
    /// through; an incomplete expert is refused by name.
    #[test]
    fn gpt_oss_experts_are_fused_and_interleaved() {
        let (e, i, h) = (2, 3, 4);
        let p = "model.layers.0.mlp.experts";
        let mut m = BTreeMap::new();
        for x in 0..e {
            let b = 1000.0 * x as f32;
            m.insert(format!("{p}.{x}.gate_proj.weight"), seq(i * h, &[i, h], b));
            m.insert(format!("{p}.{x}.up_proj.weight"), seq(i * h, &[i, h], b + 100.0));
            m.insert(format!("{p}.{x}.down_proj.weight"), seq(h * i, &[h, i], b + 200.0));
            m.insert(format!("{p}.{x}.gate_proj.bias"), seq(i, &[i], b + 300.0));
            m.insert(format!("{p}.{x}.up_proj.bias"), seq(i, &[i], b + 400.0));
            m.insert(format!("{p}.{x}.down_proj.bias"), seq(h, &[h], b + 500.0));
        }
        m.insert("model.norm.weight".into(), seq(h, &[h], 0.0));
        assert_eq!(to_checkpoint_layout(Architecture::Llama, m.clone()).unwrap().len(), m.len());
        let out = to_checkpoint_layout(Architecture::GptOss, m.clone()).unwrap();
        assert_eq!(out.len(), 5);
        let v = |n: &str| out[&format!("{p}.{n}")].to_vec::<f32>().unwrap();
        let gu = v("gate_up_proj");
        assert_eq!(out[&format!("{p}.gate_up_proj")].dims(), &[e, h, 2 * i]);
        for x in 0..e {
            let b = 1000.0 * x as f32;
            for hh in 0..h {
                for j in 0..i {
                    let at = (x * h + hh) * 2 * i;
                    assert_eq!(gu[at + 2 * j], b + (j * h + hh) as f32);
                    assert_eq!(gu[at + 2 * j + 1], b + 100.0 + (j * h + hh) as f32);
                    assert_eq!(v("down_proj")[(x * i + j) * h + hh], b + 200.0 + (hh * i + j) as f32);
                }
                assert_eq!(v("down_proj_bias")[x * h + hh], b + 500.0 + hh as f32);
            }
            for j in 0..i {
                assert_eq!(v("gate_up_proj_bias")[x * 2 * i + 2 * j], b + 300.0 + j as f32);
                assert_eq!(v("gate_up_proj_bias")[x * 2 * i + 2 * j + 1], b + 400.0 + j as f32);
            }
        }
        m.remove(&format!("{p}.1.up_proj.bias"));
        let err = to_checkpoint_layout(Architecture::GptOss, m).unwrap_err().to_string();
        assert!(err.contains("experts.1.up_proj.bias"), "{err}");
    }
}
