//! The portable integer dot products: each weight block decoded once ([`Decoded`]: signed codes,
//! integer group scales), then dotted with every row of quantized `x` in `i32`:
//!
//! `y += (d dx) * Σ_g sc_g Σ_{e in g} q_e x_e - (dmin dx) * Σ_g mn_g Σ_{e in g} x_e`
//!
//! where the second sum comes from the activations' block sums (Q8_0 blocks keep `dx Σ x_e`
//! ready-made as `sx`).

use super::act::XRow;
use super::blocks::Decoded;
use super::types::QuantType;

/// `out[i] = Σ_e w[e] x_i[e]` for one weight row `w` (whole blocks of `t`, a quantized type) and
/// the rows `xs` of quantized activations (Q8_0 for the legacy types, Q8_K for the K-quants).
fn row_dots(t: QuantType, w: &[u8], xs: &[XRow<'_>], out: &mut [f32]) {
    let (bb, be) = (t.block_bytes(), t.block_elems());
    assert!(xs.len() == out.len() && xs.iter().all(|x| x.qs.len() * bb == w.len() * be), "row_dots: operands");
    out.fill(0.0);
    let mut dec = Decoded::new();
    for (b, block) in w.chunks_exact(bb).enumerate() {
        dec.decode(t, block);
        let groups = be / dec.group;
        for (x, acc) in xs.iter().zip(out.iter_mut()) {
            let xq = &x.qs[b * be..][..be];
            let mut isum = 0i32;
            for g in 0..groups {
                let range = g * dec.group..(g + 1) * dec.group;
                let dot: i32 =
                    dec.q[range.clone()].iter().zip(&xq[range]).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum();
                isum += i32::from(dec.sc[g]) * dot;
            }
            let dx = x.d[b];
            let min_term = if be == 32 {
                dec.dmin * f32::from(dec.mn[0]) * x.sx[b]
            } else {
                let sums = &x.bsums[b * 16..][..16];
                let per = dec.group / 16;
                let msum: i32 = (0..groups)
                    .map(|g| i32::from(dec.mn[g]) * sums[g * per..][..per].iter().map(|&s| i32::from(s)).sum::<i32>())
                    .sum();
                dec.dmin * dx * msum as f32
            };
            *acc += dec.d * dx * isum as f32 - min_term;
        }
    }
}

/// [`row_dots`] for each row of `w` (`row_bytes` each): `out[r * m + i]` for weight row `r` and
/// activation row `i`.
pub(crate) fn rows_dots(t: QuantType, w: &[u8], row_bytes: usize, xs: &[XRow<'_>], out: &mut [f32]) {
    for (row, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(xs.len())) {
        row_dots(t, row, xs, out);
    }
}
