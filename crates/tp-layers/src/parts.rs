//! [`Projections`]: where the rows of several projections of one input come from, in a
//! checkpoint: one tensor each (Llama's `q_proj`, `k_proj`, `v_proj`), or one fused tensor whose
//! rows are the projections stacked in order (Phi-3's `qkv_proj` = `[q; k; v]`, `gate_up_proj` =
//! `[gate; up]`). Either way each projection is sharded on its own, and a rank reads only its
//! rows of each part: part `i` of a fused tensor starts at the sum of the earlier parts' rows.

use crate::error::{LayerError, Result};
use crate::grad::Placement;
use crate::loader::Loader;
use crate::weight::Weight;
use tp_core::Tensor;

/// The checkpoint names of `N` projections of one input (relative to a [`Loader`]'s prefix,
/// without `.weight`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projections<const N: usize> {
    /// `{name_i}.weight` (and optional `{name_i}.bias`) per projection.
    Separate([&'static str; N]),
    /// `{name}.weight` (and optional `{name}.bias`) holding the projections' rows stacked.
    Fused(&'static str),
}

/// Hugging Face's separate attention projections: `q_proj`, `k_proj`, `v_proj`.
impl Default for Projections<3> {
    fn default() -> Self {
        Projections::Separate(["q_proj", "k_proj", "v_proj"])
    }
}

/// Hugging Face's separate MLP input projections: `gate_proj`, `up_proj`.
impl Default for Projections<2> {
    fn default() -> Self {
        Projections::Separate(["gate_proj", "up_proj"])
    }
}

impl<const N: usize> Projections<N> {
    /// The tensor holding part `i` and the row where that part starts in it, given every
    /// part's row count.
    fn locate(&self, i: usize, rows: &[usize; N]) -> (&'static str, usize) {
        match self {
            Projections::Separate(names) => (names[i], 0),
            Projections::Fused(name) => (name, rows[..i].iter().sum()),
        }
    }

    /// Checks the weights' shapes: part `i` has `rows[i]` rows of `width` columns (`width`:
    /// `None` takes the first part's). Returns the width.
    pub(crate) fn check(&self, ld: &Loader<'_>, rows: &[usize; N], width: Option<usize>) -> Result<usize> {
        let mut width = width;
        let mut check_one = |name: &str, want_rows: usize| -> Result<()> {
            let t = format!("{name}.weight");
            let (r, c) = ld.dims2(&t)?;
            let w = *width.get_or_insert(c);
            if (r, c) != (want_rows, w) {
                return Err(LayerError::WrongShape {
                    name: ld.name(&t),
                    found: vec![r, c],
                    expected: vec![want_rows, w],
                });
            }
            Ok(())
        };
        match self {
            Projections::Separate(names) => {
                for (name, &r) in names.iter().zip(rows) {
                    check_one(name, r)?;
                }
            }
            Projections::Fused(name) => check_one(name, rows.iter().sum())?,
        }
        Ok(width.unwrap_or(0))
    }

    /// Whether the projections carry biases: all of them, or none (a mix is an error).
    pub(crate) fn has_bias(&self, ld: &Loader<'_>) -> Result<bool> {
        let names: Vec<&str> = match self {
            Projections::Separate(names) => names.to_vec(),
            Projections::Fused(name) => vec![name],
        };
        let with: Vec<bool> = names.iter().map(|n| ld.contains(&format!("{n}.bias"))).collect();
        if with.iter().all(|&b| b) {
            Ok(true)
        } else if with.iter().any(|&b| b) {
            Err(LayerError::Config(format!("{}: some of {names:?} have a bias and some do not", ld.prefix())))
        } else {
            Ok(false)
        }
    }

    /// Rows `start..start + len` of part `i` (weight, and bias when `bias`), reading only those.
    pub(crate) fn read(
        &self,
        ld: &Loader<'_>,
        i: usize,
        rows: &[usize; N],
        (start, len): (usize, usize),
        bias: bool,
    ) -> Result<(Weight, Option<Tensor>)> {
        let (name, base) = self.locate(i, rows);
        let w = ld.linear_rows(&format!("{name}.weight"), base + start, len)?;
        let b = if bias {
            let t = format!("{name}.bias");
            let want = match self {
                Projections::Separate(_) => rows[i],
                Projections::Fused(_) => rows.iter().sum(),
            };
            ld.expect(&t, &[want])?;
            Some(ld.rows(&t, base + start, len)?)
        } else {
            None
        };
        Ok((w, b))
    }
}

/// `prefix.name`, or `name` under an empty prefix.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() { name.to_string() } else { format!("{prefix}.{name}") }
}

/// A block of a rank's stacked rows (training): `len` rows of part `part`, starting at row
/// `start` of that part, held at row `local` of the stacked local weight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowBlock {
    pub part: usize,
    pub local: usize,
    pub start: usize,
    pub len: usize,
    pub owned: bool,
    pub partial: bool,
}

impl<const N: usize> Projections<N> {
    /// Where each block of a rank's stacked weight (`[rows, width]`) and bias sits in the
    /// checkpoint's tensors under `prefix`: `(weight placements, bias placements)`.
    pub(crate) fn placements(
        &self,
        prefix: &str,
        rows: &[usize; N],
        width: usize,
        blocks: &[RowBlock],
    ) -> (Vec<Placement>, Vec<Placement>) {
        let (mut w, mut b) = (Vec::new(), Vec::new());
        for blk in blocks {
            let (name, base) = self.locate(blk.part, rows);
            let total = match self {
                Projections::Separate(_) => rows[blk.part],
                Projections::Fused(_) => rows.iter().sum(),
            };
            let at = |suffix: &str, dims: &[usize]| Placement {
                name: join(prefix, &format!("{name}.{suffix}")),
                full_dims: dims.to_vec(),
                dim: 0,
                local_start: blk.local,
                full_start: base + blk.start,
                len: blk.len,
                owned: blk.owned,
                partial: blk.partial,
            };
            w.push(at("weight", &[total, width]));
            b.push(at("bias", &[total]));
        }
        (w, b)
    }
}
