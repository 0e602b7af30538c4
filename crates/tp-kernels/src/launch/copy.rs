//! Launchers of `kernels/shard_copy.cu` (strided row copies, the all-gather interleave) and
//! `kernels/cast.cu` (dtype conversion).

use super::{ElemType, RowCopy, i64_of, invalid, require_float, span, unit_for};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, PushKernelArg};

impl Gpu {
    /// Strided row copy from `src` to `dst` (`kernels/shard_copy.cu`, `tp_row_copy_uN`): narrow
    /// into a contiguous shard, or scatter a shard into its slot of a full tensor.
    pub fn row_copy(&self, dst: &mut CudaSlice<u8>, src: &CudaSlice<u8>, c: RowCopy) -> Result<()> {
        const K: &str = "row_copy";
        if c.rows == 0 || c.row_bytes == 0 {
            return Ok(());
        }
        let over = || invalid(K, "offset + row bytes overflows usize");
        let src_end = span(K, c.rows - 1, c.src_pitch, c.src_off.checked_add(c.row_bytes).ok_or_else(over)?)?;
        let dst_end = span(K, c.rows - 1, c.dst_pitch, c.dst_off.checked_add(c.row_bytes).ok_or_else(over)?)?;
        if src_end > src.len() || dst_end > dst.len() {
            return Err(invalid(
                K,
                format!("copy reaches byte {src_end} of src ({}) / {dst_end} of dst ({})", src.len(), dst.len()),
            ));
        }
        if c.rows > 1 && (c.src_pitch < c.row_bytes || c.dst_pitch < c.row_bytes) {
            return Err(invalid(K, "pitches shorter than a row would overlap rows"));
        }
        let (sp, dp) = if c.rows == 1 { (c.row_bytes, c.row_bytes) } else { (c.src_pitch, c.dst_pitch) };
        let unit = unit_for(&[c.row_bytes, sp, dp, c.src_off, c.dst_off]);
        let name = format!("tp_row_copy_u{unit}");
        let f = self.function(&name, 0)?;
        let (rows, units) = (i64_of(K, c.rows)?, i64_of(K, c.row_bytes / unit)?);
        let (sp, so) = (i64_of(K, sp / unit)?, i64_of(K, c.src_off / unit)?);
        let (dp, doff) = (i64_of(K, dp / unit)?, i64_of(K, c.dst_off / unit)?);
        let cfg = self.grid_stride((c.rows as u64).saturating_mul(units as u64));
        let mut b = self.stream().launch_builder(f);
        b.arg(dst).arg(src).arg(&rows).arg(&units).arg(&sp).arg(&so).arg(&dp).arg(&doff);
        // SAFETY: argument order and types match tp_row_copy_uN(U* dst, const U* src, int64 rows,
        // row_units, src_pitch, src_off, dst_pitch, dst_off). Every unit read lies below
        // `src_end <= src.len()` and every write below `dst_end <= dst.len()` (checked above),
        // and all offsets and pitches are multiples of `unit` while allocations are 256-byte
        // aligned, so each `U` access is aligned. `dst` is borrowed mutably and `src` shared,
        // so the two buffers are distinct. The buffers outlive the launch: cudarc records their
        // use on the stream.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_row_copy)"))
    }

    /// Gather-interleave (`tp_gather_uN`): `src` is a rank-major all-gather buffer
    /// `(world, rows, cols_r)` of `elem` bytes per element, `cols_r` the balanced split of `cols`;
    /// `dst` receives `(rows, cols)` row-major.
    pub fn gather_interleave(
        &self,
        dst: &mut CudaSlice<u8>,
        src: &CudaSlice<u8>,
        rows: usize,
        cols: usize,
        world: usize,
        elem: usize,
    ) -> Result<()> {
        const K: &str = "gather_interleave";
        if world == 0 || elem == 0 {
            return Err(invalid(K, "world size and element size must be positive"));
        }
        let bytes = span(K, rows, cols, 0)?.checked_mul(elem).ok_or_else(|| invalid(K, "size overflows"))?;
        if bytes > src.len() || bytes > dst.len() {
            return Err(invalid(K, format!("needs {bytes} bytes; src has {}, dst {}", src.len(), dst.len())));
        }
        if bytes == 0 {
            return Ok(());
        }
        // Even shards may move in wide units: every shard width, in bytes, must be a multiple.
        // (For power-of-two `elem`, `elem` divides `q * elem`, so the unit is never narrower.)
        let unit = if cols % world == 0 { unit_for(&[(cols / world) * elem]) } else { elem };
        if ![1, 2, 4, 8, 16].contains(&unit) || unit % elem != 0 {
            return Err(invalid(K, format!("no gather kernel for {elem}-byte elements")));
        }
        let cols_u = cols * elem / unit;
        let (q, r) = (cols_u / world, cols_u % world);
        let f = self.function(&format!("tp_gather_u{unit}"), 0)?;
        let [rows_i, cols_i, q_i, r_i] = [i64_of(K, rows)?, i64_of(K, cols_u)?, i64_of(K, q)?, i64_of(K, r)?];
        let cfg = self.grid_stride((rows as u64).saturating_mul(cols_u as u64));
        let mut b = self.stream().launch_builder(f);
        b.arg(dst).arg(src).arg(&rows_i).arg(&cols_i).arg(&q_i).arg(&r_i);
        // SAFETY: matches tp_gather_uN(U* dst, const U* src, int64 rows, cols, q, r). The kernel
        // writes dst[0 .. rows*cols_u) and reads src at gather_src(), a permutation of the same
        // range (index_math.cuh; checked on the host by tp-core's tests), and rows*cols_u*unit =
        // `bytes` fits both buffers (checked above). Units are 1 byte or divide every shard's
        // byte width, and the buffers are 256-byte aligned, so accesses are aligned.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gather)"))
    }

    /// `dst[i] = src[i]` converted from `from` to `to` (`kernels/cast.cu`), `n` elements.
    pub fn cast(
        &self,
        dst: &mut CudaSlice<u8>,
        src: &CudaSlice<u8>,
        n: usize,
        from: ElemType,
        to: ElemType,
    ) -> Result<()> {
        const K: &str = "cast";
        require_float(K, from)?;
        require_float(K, to)?;
        if from == to {
            return Err(invalid(K, "source and destination types are equal; copy instead"));
        }
        if span(K, n, from.size(), 0)? > src.len() || span(K, n, to.size(), 0)? > dst.len() {
            return Err(invalid(K, format!("{n} elements do not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&crate::kernels::cast(from, to), 0)?;
        let n_i = i64_of(K, n)?;
        let mut b = self.stream().launch_builder(f);
        b.arg(dst).arg(src).arg(&n_i);
        // SAFETY: matches tp_cast_S_D(D* dst, const S* src, int64 n); n elements of each type fit
        // the buffers (checked above), which are 256-byte aligned and distinct (& vs &mut).
        unsafe { b.launch(self.grid_stride(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_cast)"))
    }
}
