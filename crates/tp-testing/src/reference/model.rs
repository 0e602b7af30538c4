//! A whole causal LM in float64, straight from a checkpoint folder's files and its config,
//! following the architecture table ([`tp_models::Architecture::decoder_names`]) and
//! [`ModelConfig`], built from [`super::ops`].

use super::block::f64s;
use super::ops::{Attn, attention_f64, attention_factor_f64, glu_f64, inv_freq_f64_at, lin, rms, rotate};
use std::path::Path;
use tp_core::Device;
use tp_layers::{Checkpoint, Projections};
use tp_models::ModelConfig;

/// The checkpoint's tensor `name` as f64 (whole), or `None` if absent.
fn get(ckpt: &Checkpoint, name: &str) -> Option<Vec<f64>> {
    ckpt.contains(name).then(|| f64s(&ckpt.load(name, None, &Device::Cpu).expect("a listed tensor loads")))
}

/// Rows `start..start + len` of a row-major `[rows, k]` matrix.
fn rows(w: &[f64], k: usize, start: usize, len: usize) -> Vec<f64> {
    w[start * k..(start + len) * k].to_vec()
}

/// The projections `parts` (rows of each) of `x: [t, k]` under `prefix`: separate tensors, or
/// consecutive row ranges of one fused tensor.
fn project<const N: usize>(
    x: &[f64],
    k: usize,
    names: Projections<N>,
    lens: [usize; N],
    prefix: &str,
    w: &dyn Fn(&str) -> Vec<f64>,
    b: &dyn Fn(&str) -> Option<Vec<f64>>,
) -> [Vec<f64>; N] {
    match names {
        Projections::Separate(ns) => ns.map(|n| {
            let name = format!("{prefix}.{n}");
            lin(x, &w(&name), b(&name).as_deref(), k)
        }),
        Projections::Fused(f) => {
            let name = format!("{prefix}.{f}");
            let (wf, bf) = (w(&name), b(&name));
            let mut start = 0;
            lens.map(|len| {
                let bias = bf.as_ref().map(|bf| bf[start..start + len].to_vec());
                let y = lin(x, &rows(&wf, k, start, len), bias.as_deref(), k);
                start += len;
                y
            })
        }
    }
}

/// The logits `[T, V]` of the whole sequence `ids` (positions 0..T) in float64, straight from
/// the files and the config, for every family of the architecture table: embedding (scaled
/// where the family scales it), every block (its norms before and/or after attention and the
/// MLP, q/k norms, fused or separate projections, rope and window per layer, the family's
/// attention scale and activation), final norm, LM head (tied or not, soft-capped where the
/// config says). Panics on a folder that does not load (tests only).
pub fn reference_logits(dir: &Path, ids: &[i64]) -> Vec<f64> {
    let c = ModelConfig::from_dir(dir).expect("a valid config");
    let names = c.architecture.decoder_names();
    let ckpt = Checkpoint::open(dir).expect("a readable checkpoint");
    let (h, d, nq, nkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
    let t = ids.len();
    let positions: Vec<usize> = (0..t).collect();
    let norm = |x: &[f64], w: &[f64]| rms(x, w, c.rms_norm_eps, c.norm_style);
    let emb = get(&ckpt, "model.embed_tokens.weight").expect("the embedding");
    let mut x: Vec<f64> = ids.iter().flat_map(|&i| emb[i as usize * h..(i as usize + 1) * h].to_vec()).collect();
    if let Some(s) = c.embedding_scale {
        x.iter_mut().for_each(|v| *v *= s);
    }
    let scale = c.attention_scale.unwrap_or(1.0 / (d as f64).sqrt());
    for l in 0..c.num_hidden_layers {
        let window = c.window_of(l);
        let (theta, scaling) = match (window, c.local_rope.clone()) {
            (Some(_), Some(local)) => local,
            _ => (c.rope_theta, c.rope_scaling.clone()),
        };
        let (freq, m) = (inv_freq_f64_at(c.rotary_dim, theta, &scaling, t), attention_factor_f64(&scaling));
        let p = format!("model.layers.{l}");
        let w = |n: &str| get(&ckpt, &format!("{p}.{n}.weight")).expect("a block weight");
        let b = |n: &str| get(&ckpt, &format!("{p}.{n}.bias"));
        let opt_norm = |n: Option<&str>, v: Vec<f64>| match n {
            Some(n) => norm(&v, &w(n)),
            None => v,
        };
        let (attn, an) = (names.attn, names.attn_names);
        let a_in = opt_norm(names.norms.attn_in, x.clone());
        let [mut q, mut k, v] = project(&a_in, h, an.qkv, [nq * d, nkv * d, nkv * d], attn, &w, &b);
        // Per head or over the full width: RMSNorm's rows are the weight's length either way.
        if c.qk_norm.is_some() {
            q = norm(&q, &w(&format!("{attn}.{}", an.q_norm)));
            k = norm(&k, &w(&format!("{attn}.{}", an.k_norm)));
        }
        rotate(&mut q, &positions, (nq, d), &freq, m);
        rotate(&mut k, &positions, (nkv, d), &freq, m);
        let o = attention_f64(&q, &k, &v, &Attn { scale, window, ..Attn::causal(t, (nq, nkv, d)) });
        let on = format!("{attn}.{}", an.o);
        let a = opt_norm(names.norms.attn_out, lin(&o, &w(&on), b(&on).as_deref(), nq * d));
        x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
        let m_in = opt_norm(names.norms.mlp_in, x.clone());
        let inter = c.intermediate_size;
        let [gate, up] = project(&m_in, h, names.mlp_names.gate_up, [inter, inter], names.mlp, &w, &b);
        let dn = format!("{}.{}", names.mlp, names.mlp_names.down);
        let act = glu_f64(&gate, &up, c.hidden_act);
        let m = opt_norm(names.norms.mlp_out, lin(&act, &w(&dn), b(&dn).as_deref(), inter));
        x.iter_mut().zip(&m).for_each(|(x, m)| *x += m);
    }
    let xn = norm(&x, &get(&ckpt, "model.norm.weight").expect("the final norm"));
    let head = if c.tie_word_embeddings { emb } else { get(&ckpt, "lm_head.weight").expect("the LM head") };
    let logits = lin(&xn, &head, None, h);
    match c.final_logit_softcapping {
        Some(cap) => logits.iter().map(|l| cap * (l / cap).tanh()).collect(),
        None => logits,
    }
}
