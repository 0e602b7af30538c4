//! A software model of the AMX instructions the kernel uses, following the Intel SDM
//! (`LDTILECFG`, `TILELOADD`, `TILESTORED`, `TILEZERO`, `TDPBF16PS`, `TDPFP16PS`,
//! `TILERELEASE`), so the AMX kernel's tile configuration, strides and VNNI layout are tested on
//! CPUs without AMX. Where the hardware would fault (`#GP` on a bad configuration, `#UD` on
//! unconfigured tiles or mismatched shapes), the model panics.
//!
//! Arithmetic, per the SDM's pseudocode: for each output row `m`, two `f32` partial sums per
//! output column (even and odd element of each pair), each accumulated over `k` with a fused
//! multiply-add rounded to nearest even; then their sum is added to the destination. `bf16`
//! inputs that are denormal read as zero (DAZ); `f16` denormal inputs are honoured; denormal
//! results are flushed to zero (FTZ). MXCSR plays no part.

use super::tiles::{TileConfig, TileOps};

/// Bytes per tile row and rows per tile (palette 1).
const ROW_BYTES: usize = 64;
const MAX_ROWS: usize = 16;

/// Eight tile registers of 16 rows x 64 bytes, and the loaded configuration.
pub(crate) struct Model {
    config: Option<TileConfig>,
    tiles: [[u8; ROW_BYTES * MAX_ROWS]; 8],
}

impl Default for Model {
    fn default() -> Self {
        Model { config: None, tiles: [[0; ROW_BYTES * MAX_ROWS]; 8] }
    }
}

impl Model {
    /// `(rows, colsb)` of a configured tile; `#UD` (panic) otherwise.
    fn shape(&self, t: u8) -> (usize, usize) {
        let cfg = self.config.as_ref().expect("AMX model: tile instruction before ldtilecfg (#UD)");
        let t = usize::from(t);
        assert!(t < 8, "AMX model: tmm{t} does not exist (#UD)");
        let (rows, colsb) = (usize::from(cfg.rows[t]), usize::from(cfg.colsb[t]));
        assert!(rows > 0 && colsb > 0, "AMX model: tmm{t} is not configured (#UD)");
        (rows, colsb)
    }

    fn f32_at(&self, t: usize, row: usize, i: usize) -> f32 {
        let o = row * ROW_BYTES + 4 * i;
        let b = &self.tiles[t][o..o + 4];
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    fn half_at(&self, t: usize, row: usize, i: usize) -> u16 {
        let o = row * ROW_BYTES + 2 * i;
        u16::from_le_bytes([self.tiles[t][o], self.tiles[t][o + 1]])
    }
}

/// `bf16` bits as `f32`, denormals read as zero.
fn bf16_daz(bits: u16) -> f32 {
    let v = f32::from_bits(u32::from(bits) << 16);
    if v.is_subnormal() { 0f32.copysign(v) } else { v }
}

/// `f16` bits as `f32` (exact, denormals honoured).
fn f16_exact(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Flush a denormal result to zero.
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() { 0f32.copysign(v) } else { v }
}

// SAFETY: each method follows the instruction's documented effect on the model's registers;
// memory is touched only by `load` and `store`, at exactly the configured rows and bytes.
unsafe impl TileOps for Model {
    fn configure(&mut self, cfg: &TileConfig) {
        match cfg.palette {
            0 => {
                // Palette 0 is the initial state: like TILERELEASE.
                self.release();
                return;
            }
            1 => {}
            p => panic!("AMX model: ldtilecfg with palette {p} (#GP)"),
        }
        assert!(cfg.reserved.iter().all(|&b| b == 0), "AMX model: reserved config bytes set (#GP)");
        assert!(cfg.start_row == 0, "AMX model: start_row {} in a fresh config", cfg.start_row);
        for t in 0..16 {
            let (rows, colsb) = (usize::from(cfg.rows[t]), usize::from(cfg.colsb[t]));
            if t >= 8 {
                assert!(rows == 0 && colsb == 0, "AMX model: palette 1 has 8 tiles, tmm{t} configured (#GP)");
            }
            assert!(rows <= MAX_ROWS && colsb <= ROW_BYTES, "AMX model: tmm{t} {rows} x {colsb} B too big (#GP)");
            assert!((rows == 0) == (colsb == 0), "AMX model: tmm{t} half configured ({rows} x {colsb} B) (#GP)");
        }
        self.config = Some(*cfg);
        self.tiles = [[0; ROW_BYTES * MAX_ROWS]; 8];
    }

    fn zero<const T: u8>(&mut self) {
        self.shape(T);
        self.tiles[usize::from(T)] = [0; ROW_BYTES * MAX_ROWS];
    }

    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        let tile = &mut self.tiles[usize::from(T)];
        *tile = [0; ROW_BYTES * MAX_ROWS];
        for r in 0..rows {
            // SAFETY: the caller guarantees `colsb` readable bytes at `base + r * stride` for
            // every configured row (the trait's contract).
            let src = unsafe { std::slice::from_raw_parts(base.wrapping_add(r * stride), colsb) };
            tile[r * ROW_BYTES..r * ROW_BYTES + colsb].copy_from_slice(src);
        }
    }

    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        let tile = &self.tiles[usize::from(T)];
        for r in 0..rows {
            // SAFETY: the caller guarantees `colsb` writable bytes at `base + r * stride`.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.wrapping_add(r * stride), colsb) };
            dst.copy_from_slice(&tile[r * ROW_BYTES..r * ROW_BYTES + colsb]);
        }
    }

    fn dot<const FP16: bool, const C: u8, const A: u8, const B: u8>(&mut self) {
        let ((c_rows, c_colsb), (a_rows, a_colsb), (b_rows, b_colsb)) = (self.shape(C), self.shape(A), self.shape(B));
        assert!(C != A && C != B && A != B, "AMX model: tdp with repeated tiles (#UD)");
        assert!(
            c_rows == a_rows && c_colsb == b_colsb && a_colsb == 4 * b_rows && c_colsb % 4 == 0 && a_colsb % 4 == 0,
            "AMX model: tdp shapes C {c_rows}x{c_colsb} A {a_rows}x{a_colsb} B {b_rows}x{b_colsb} (#UD)"
        );
        let read = |bits: u16| if FP16 { f16_exact(bits) } else { bf16_daz(bits) };
        let (c, a, b) = (usize::from(C), usize::from(A), usize::from(B));
        let (pairs, cols) = (a_colsb / 4, c_colsb / 4);
        let mut out = [0u8; ROW_BYTES * MAX_ROWS];
        for m in 0..c_rows {
            let mut temp = [0f32; 2 * ROW_BYTES / 4];
            for k in 0..pairs {
                let (a0, a1) = (read(self.half_at(a, m, 2 * k)), read(self.half_at(a, m, 2 * k + 1)));
                for n in 0..cols {
                    let (b0, b1) = (read(self.half_at(b, k, 2 * n)), read(self.half_at(b, k, 2 * n + 1)));
                    temp[2 * n] = ftz(a0.mul_add(b0, temp[2 * n]));
                    temp[2 * n + 1] = ftz(a1.mul_add(b1, temp[2 * n + 1]));
                }
            }
            for n in 0..cols {
                let v = ftz(self.f32_at(c, m, n) + ftz(temp[2 * n] + temp[2 * n + 1]));
                out[m * ROW_BYTES + 4 * n..][..4].copy_from_slice(&v.to_le_bytes());
            }
        }
        // Bytes past colsb in each row, and rows past `rows`, are zeroed (write_row_and_zero,
        // zero_upper_rows): `out` started zeroed.
        self.tiles[c] = out;
    }

    fn release(&mut self) {
        self.config = None;
        self.tiles = [[0; ROW_BYTES * MAX_ROWS]; 8];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One 16 x 16 x 32 `tdpbf16ps` through the model against a plain triple loop, with the
    /// operands laid out as the instruction defines: A row-major, B in VNNI pairs.
    #[test]
    fn dot_matches_the_definition_of_a_vnni_product() {
        // Integers in [-8, 8] / 4 from a fixed LCG (every product and sum exact in f32).
        let mut state = 3u64;
        let mut next = || {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % 17) as f32 - 8.0
        };
        for fp16 in [false, true] {
            let to_bits =
                |v: f32| if fp16 { half::f16::from_f32(v).to_bits() } else { half::bf16::from_f32(v).to_bits() };
            let from_bits = |b: u16| if fp16 { f16_exact(b) } else { bf16_daz(b) };
            // A: 16 x 32 elements; B: 32 x 16 elements (k x n).
            let a: Vec<u16> = (0..16 * 32).map(|_| to_bits(next() / 4.0)).collect();
            let b: Vec<u16> = (0..32 * 16).map(|_| to_bits(next() / 4.0)).collect();
            // VNNI: row k/2 holds (b[k][n], b[k+1][n]) for each n.
            let mut b_vnni = vec![0u16; 32 * 16];
            for k in 0..32 {
                for n in 0..16 {
                    b_vnni[(k / 2) * 32 + 2 * n + (k % 2)] = b[k * 16 + n];
                }
            }
            let mut m = Model::default();
            m.configure(&TileConfig::KERNEL);
            let mut c = vec![1f32; 16 * 16];
            // SAFETY: 16 rows of 64 bytes at stride 64 in each buffer.
            unsafe {
                m.load::<0>(c.as_ptr().cast(), 64);
                m.load::<4>(a.as_ptr().cast(), 64);
                m.load::<6>(b_vnni.as_ptr().cast(), 64);
            }
            if fp16 {
                m.dot::<true, 0, 4, 6>();
            } else {
                m.dot::<false, 0, 4, 6>();
            }
            // SAFETY: as above.
            unsafe { m.store::<0>(c.as_mut_ptr().cast(), 64) };
            for i in 0..16 {
                for j in 0..16 {
                    let want: f32 =
                        1.0 + (0..32).map(|k| from_bits(a[i * 32 + k]) * from_bits(b[k * 16 + j])).sum::<f32>();
                    assert_eq!(c[i * 16 + j], want, "fp16 {fp16} ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn denormals_follow_each_instruction() {
        assert_eq!(bf16_daz(0x0001), 0.0); // bf16 denormal input reads as zero
        assert_eq!(f16_exact(0x0001), 2f32.powi(-24)); // f16 denormal input honoured
        assert_eq!(ftz(f32::MIN_POSITIVE / 2.0), 0.0);
        assert_eq!(ftz(-f32::MIN_POSITIVE), -f32::MIN_POSITIVE);
    }

    #[test]
    #[should_panic(expected = "#UD")]
    fn mismatched_shapes_fault() {
        let mut cfg = TileConfig::KERNEL;
        cfg.rows[6] = 8; // B with 8 pair rows against A's 16 pairs
        let mut m = Model::default();
        m.configure(&cfg);
        m.dot::<false, 0, 4, 6>();
    }

    #[test]
    #[should_panic(expected = "before ldtilecfg")]
    fn unconfigured_use_faults() {
        Model::default().zero::<0>();
    }
}
