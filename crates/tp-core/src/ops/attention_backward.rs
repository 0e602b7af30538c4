//! The backward of [`Tensor::attention`] on the host (training): gradients of the queries,
//! keys and values from the gradient of the output, in f32.
//!
//! Per KV head `g` and the query heads `h` that use it, with the visible keys of each query
//! (causal, within the sliding window) and `P = softmax(scale · Q_h K_g^T)` recomputed from the
//! inputs (nothing of the forward is saved but `q`, `k`, `v`: the scores are never stored):
//!
//! * `dV_g = Σ_h P^T dO_h`
//! * `dP = dO_h V_g^T`, `dS = P ⊙ (dP - rowsum(P ⊙ dP))` (the softmax's Jacobian)
//! * `dQ_h = scale · dS K_g`, `dK_g = Σ_h scale · dS^T Q_h`
//!
//! With attention sinks (a zero-valued virtual key of logit `σ_h` in every row's softmax), `P`
//! is the softmax with the sink counted, the formulas above are unchanged (the sink's `dP` is
//! 0), and `dσ_h = -Σ_rows p_σ · rowsum(P ⊙ dP)` with `p_σ = 1 - rowsum(P)` (summed in f64).
//!
//! The query heads of a group are stacked into one matrix per tile of tokens, so every product
//! is one host GEMM, as in the forward.

use super::attention::{AttentionSpec, softmax_rows};
use super::grad::f32_host;
use crate::{Device, Error, Result, Tensor};

/// Score elements one tile may hold (16 MiB of f32), as the forward.
const SCORE_TILE: usize = 1 << 22;

impl Tensor {
    /// Gradients `(dq, dk, dv)` of [`attention`](Tensor::attention)`(self, k, v, spec)` given
    /// the output's gradient `dout: [T, Hq, D]`: `dq: [T, Hq, D]` and `dk, dv: [kv_len, Hkv, D]`
    /// (the cache's valid rows), all f32 on the host.
    ///
    /// Errors: as [`attention`](Tensor::attention), plus [`Error::ShapeMismatch`] for a `dout`
    /// not shaped as the queries, [`Error::UnsupportedDevice`] off the host.
    pub fn attention_backward(
        &self,
        k: &Tensor,
        v: &Tensor,
        dout: &Tensor,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (dq, dk, dv, _) = self.attention_backward_sinks(k, v, dout, spec)?;
        Ok((dq, dk, dv))
    }

    /// [`attention_backward`](Self::attention_backward), also returning the gradient of the
    /// sink logits, one per query head (zeros when `spec` has no sinks).
    pub fn attention_backward_sinks(
        &self,
        k: &Tensor,
        v: &Tensor,
        dout: &Tensor,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor, Vec<f32>)> {
        const OP: &str = "attention_backward";
        if dout.dims() != self.dims() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: dout.dims().to_vec(),
                why: "the output's gradient must have the queries' shape",
            });
        }
        let (&[t, hq, d], &[c, hkv, dk]) = (self.dims(), k.dims()) else {
            return Err(Error::RankMismatch {
                op: OP,
                expected: "3 ([tokens, heads, head_dim])",
                dims: k.dims().to_vec(),
            });
        };
        let bad = |why| Error::ShapeMismatch { op: OP, lhs: self.dims().to_vec(), rhs: k.dims().to_vec(), why };
        if k.dims() != v.dims() || dk != d {
            return Err(bad("keys and values must share one shape and the queries' head_dim"));
        }
        let groups = spec.groups(hq, hkv).ok_or_else(|| bad("each query head needs a KV head"))?;
        spec.check_sinks(OP, hq)?;
        if spec.kv_len > c || spec.kv_len < t || spec.sliding_window == Some(0) || !spec.scale.is_finite() {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!(
                    "kv_len {} must lie between {t} and {c}, the window be >= 1, the scale finite",
                    spec.kv_len
                ),
            });
        }
        let (q, kf, vf, dof) = (f32_host(OP, self)?, f32_host(OP, k)?, f32_host(OP, v)?, f32_host(OP, dout)?);
        let (q, kf, vf, dof) =
            (q.as_slice::<f32>()?, kf.as_slice::<f32>()?, vf.as_slice::<f32>()?, dof.as_slice::<f32>()?);
        let l = spec.kv_len;
        let cpu = Device::Cpu;
        let first_pos = l - t;
        let (mut dq, mut dkv) = (vec![0f32; t * hq * d], [vec![0f32; l * hkv * d], vec![0f32; l * hkv * d]]);
        let mut dsinks = vec![0f64; hq];
        let tile = (SCORE_TILE / (groups.size.min(hq.max(1)) * l).max(1)).clamp(1, t.max(1));
        for g in 0..hkv {
            let h0 = (g * groups.size).saturating_sub(groups.offset).min(hq);
            let h1 = ((g + 1) * groups.size).saturating_sub(groups.offset).min(hq);
            let group = h1 - h0;
            if group == 0 || d == 0 {
                continue;
            }
            // Rows `lo..hi` of KV head g of a `[L, Hkv, D]` buffer, as `[hi - lo, D]`.
            let kv_rows = |src: &[f32], lo: usize, hi: usize| -> Result<Tensor> {
                let mut m = Vec::with_capacity((hi - lo) * d);
                for j in lo..hi {
                    m.extend_from_slice(&src[(j * hkv + g) * d..(j * hkv + g + 1) * d]);
                }
                Tensor::from_vec(m, &[hi - lo, d], &cpu)
            };
            // Tokens t0..t0+tn of the group's query heads of a `[T, Hq, D]` buffer, as
            // `[tn·group, D]` (row `(tok - t0)·group + hh`).
            let q_rows = |src: &[f32], t0: usize, tn: usize| -> Result<Tensor> {
                let mut m = Vec::with_capacity(tn * group * d);
                for tok in t0..t0 + tn {
                    let at = (tok * hq + h0) * d;
                    m.extend_from_slice(&src[at..at + group * d]);
                }
                Tensor::from_vec(m, &[tn * group, d], &cpu)
            };
            for t0 in (0..t).step_by(tile) {
                let tn = tile.min(t - t0);
                let keys = first_pos + t0 + tn;
                let (lo_tile, _) = spec.key_range(first_pos + t0);
                let width = keys - lo_tile;
                let (kg, vg) = (kv_rows(kf, lo_tile, keys)?, kv_rows(vf, lo_tile, keys)?);
                let (qg, dog) = (q_rows(q, t0, tn)?, q_rows(dof, t0, tn)?);
                let mut p = qg.matmul_t(&kg)?; // scores, then probabilities: [tn·group, width]
                softmax_rows(
                    p.as_mut_slice::<f32>()?,
                    width,
                    |row| {
                        let (lo, hi) = spec.key_range(first_pos + t0 + row / group);
                        (lo - lo_tile, hi + 1 - lo_tile)
                    },
                    |row| spec.sink(h0 + row % group),
                    spec.scale,
                );
                let mut ds = dog.matmul_t(&vg)?; // dP, then dS
                {
                    let (ps, dss) = (p.as_slice::<f32>()?, ds.as_mut_slice::<f32>()?);
                    for (r, (prow, drow)) in ps.chunks_exact(width).zip(dss.chunks_exact_mut(width)).enumerate() {
                        let dot: f32 = prow.iter().zip(drow.iter()).map(|(a, b)| a * b).sum();
                        if spec.sinks.is_some() {
                            let p_sink = 1.0 - prow.iter().map(|&x| f64::from(x)).sum::<f64>();
                            dsinks[h0 + r % group] -= p_sink * f64::from(dot);
                        }
                        for (dv, &pv) in drow.iter_mut().zip(prow) {
                            *dv = pv * (*dv - dot) * spec.scale;
                        }
                    }
                }
                let dqg = ds.matmul(&kg)?; // [tn·group, D]
                for (r, row) in dqg.as_slice::<f32>()?.chunks_exact(d).enumerate() {
                    let at = ((t0 + r / group) * hq + h0 + r % group) * d;
                    dq[at..at + d].copy_from_slice(row);
                }
                for (buf, grad) in dkv.iter_mut().zip([ds.t_matmul(&qg)?, p.t_matmul(&dog)?]) {
                    for (j, row) in grad.as_slice::<f32>()?.chunks_exact(d).enumerate() {
                        let at = ((lo_tile + j) * hkv + g) * d;
                        buf[at..at + d].iter_mut().zip(row).for_each(|(a, &b)| *a += b);
                    }
                }
            }
        }
        let [dk, dv] = dkv;
        Ok((
            Tensor::from_vec(dq, &[t, hq, d], &cpu)?,
            Tensor::from_vec(dk, &[l, hkv, d], &cpu)?,
            Tensor::from_vec(dv, &[l, hkv, d], &cpu)?,
            dsinks.into_iter().map(|x| x as f32).collect(),
        ))
    }
}
