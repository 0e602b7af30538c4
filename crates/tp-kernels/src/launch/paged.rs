//! Launchers of `kernels/paged_attention.cu`: attention over a paged KV cache and the scatter of
//! new key/value rows into cache slots. The block tables and slots arrive as host slices: the
//! launchers check every entry the kernels will read (block ids, positions, slots) before one
//! upload and one launch, so no table can make a kernel read or write outside its buffers.

use super::{ElemType, i64_of, invalid, require_float, span, unit_for};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Shape of one paged attention call: `tokens` query rows of `q_heads` heads over a cache of
/// `num_blocks` blocks of `block_size` positions of `kv_heads` heads of `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PagedShape {
    /// Query rows of the flat batch (every sequence's rows together).
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads in the cache.
    pub kv_heads: usize,
    /// Query heads per KV head in the model: query head `h` uses KV head
    /// `(h + group_offset) / group`.
    pub group: usize,
    /// Position of query head 0 within its group (`< group`).
    pub group_offset: usize,
    /// Features per head, at most `ATTENTION_MAX_HEAD_DIM`.
    pub head_dim: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Factor on the scores.
    pub scale: f32,
    /// Sliding window (most recent keys seen, its own included), or `None`.
    pub window: Option<usize>,
}

/// One sequence of the flat batch: query rows `q_start..q_start + q_len` are its last `q_len`
/// positions of `kv_len`, and position `p` lives in block `blocks[p / block_size]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedSequence<'a> {
    /// First query row of this sequence.
    pub q_start: usize,
    /// Its query rows.
    pub q_len: usize,
    /// Positions valid in its blocks (`q_len <= kv_len`).
    pub kv_len: usize,
    /// Its block table (at least `ceil(kv_len / block_size)` entries).
    pub blocks: &'a [u32],
}

/// Largest position the kernel indexes (it divides positions in 32 bits).
const MAX_POSITIONS: usize = i32::MAX as usize;

/// The kernel's `meta` buffer, checked: `pos[tokens]`, `tab[tokens]` (int64), then the block
/// tables (uint32). Every row is covered by exactly one sequence; every table entry a row can
/// read is `< num_blocks`.
fn paged_meta(k: &'static str, s: &PagedShape, seqs: &[PagedSequence<'_>]) -> Result<Vec<u8>> {
    let mut pos = vec![-1i64; s.tokens];
    let mut tab = vec![0i64; s.tokens];
    let mut tables: Vec<u32> = Vec::new();
    for (i, q) in seqs.iter().enumerate() {
        let end = q.q_start.checked_add(q.q_len).filter(|&e| e <= s.tokens);
        let Some(end) = end else {
            return Err(invalid(k, format!("sequence {i}: rows {}+{} pass the {} rows", q.q_start, q.q_len, s.tokens)));
        };
        if q.q_len > q.kv_len || q.kv_len > MAX_POSITIONS {
            return Err(invalid(k, format!("sequence {i}: {} query rows over {} positions", q.q_len, q.kv_len)));
        }
        let used = q.kv_len.div_ceil(s.block_size);
        if used > q.blocks.len() {
            return Err(invalid(
                k,
                format!("sequence {i}: {} positions need {used} blocks, its table has {}", q.kv_len, q.blocks.len()),
            ));
        }
        if let Some(&b) = q.blocks[..used].iter().find(|&&b| b as usize >= s.num_blocks) {
            return Err(invalid(k, format!("sequence {i}: block {b} is not among the cache's {}", s.num_blocks)));
        }
        let start = i64_of(k, tables.len())?;
        for (t, r) in (q.q_start..end).enumerate() {
            if pos[r] >= 0 {
                return Err(invalid(k, format!("row {r} belongs to two sequences")));
            }
            pos[r] = i64_of(k, q.kv_len - q.q_len + t)?;
            tab[r] = start;
        }
        tables.extend_from_slice(&q.blocks[..used]);
    }
    if let Some(r) = pos.iter().position(|&p| p < 0) {
        return Err(invalid(k, format!("row {r} belongs to no sequence")));
    }
    let mut meta = Vec::with_capacity(16 * s.tokens + 4 * tables.len());
    for v in pos.iter().chain(&tab) {
        meta.extend_from_slice(&v.to_ne_bytes());
    }
    for b in &tables {
        meta.extend_from_slice(&b.to_ne_bytes());
    }
    Ok(meta)
}

impl Gpu {
    /// Paged causal GQA attention (`tp_paged_attention_T`): `q, out: [tokens, q_heads,
    /// head_dim]`, `k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]`; each row of
    /// `seqs` attends over its own blocks. Every row must belong to exactly one sequence.
    /// `sinks`, if any: `q_heads` f32 attention-sink logits, as [`Gpu::attention`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        out: &mut CudaSlice<u8>,
        q: &CudaSlice<u8>,
        k_cache: &CudaSlice<u8>,
        v_cache: &CudaSlice<u8>,
        s: PagedShape,
        seqs: &[PagedSequence<'_>],
        sinks: Option<&CudaSlice<u8>>,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "paged_attention";
        require_float(K, ty)?;
        super::decoder::check_sinks(K, sinks, s.q_heads)?;
        if s.head_dim > consts::ATTENTION_MAX_HEAD_DIM as usize {
            return Err(invalid(K, format!("head_dim {} exceeds {}", s.head_dim, consts::ATTENTION_MAX_HEAD_DIM)));
        }
        let groups_fit = s.group > 0
            && s.group_offset < s.group
            && (s.q_heads == 0 || (s.group_offset + s.q_heads - 1) / s.group < s.kv_heads);
        if !groups_fit || s.block_size == 0 || s.block_size > MAX_POSITIONS || s.window == Some(0) {
            return Err(invalid(K, format!("inconsistent shape {s:?}")));
        }
        let bytes = |rows: usize, heads: usize| {
            span(K, rows, heads, 0).and_then(|r| span(K, r, s.head_dim, 0)).and_then(|n| span(K, n, ty.size(), 0))
        };
        let q_bytes = bytes(s.tokens, s.q_heads)?;
        let kv_bytes = bytes(span(K, s.num_blocks, s.block_size, 0)?, s.kv_heads)?;
        if q_bytes > q.len() || q_bytes > out.len() || kv_bytes > k_cache.len() || kv_bytes > v_cache.len() {
            return Err(invalid(K, format!("{s:?} does not fit the buffers")));
        }
        let meta = paged_meta(K, &s, seqs)?;
        if q_bytes == 0 {
            return Ok(());
        }
        let meta = self.htod(&meta)?;
        let f = self.function(&format!("tp_paged_attention_{}", ty.name()), 0)?;
        let [t, hq, hkv, g, go, d, bs] =
            [s.tokens, s.q_heads, s.kv_heads, s.group, s.group_offset, s.head_dim, s.block_size].map(|v| i64_of(K, v));
        let (t, hq, hkv, g, go, d, bs) = (t?, hq?, hkv?, g?, go?, d?, bs?);
        let window = i64_of(K, s.window.unwrap_or(0))?;
        let rows = (s.tokens * s.q_heads) as u64;
        let blocks = rows.clamp(1, u64::from(self.sm_count()) * 32);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (consts::ATTENTION_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(q).arg(k_cache).arg(v_cache).arg(&meta);
        b.arg(&t).arg(&hq).arg(&hkv).arg(&g).arg(&go).arg(&d).arg(&bs).arg(&s.scale).arg(&window);
        let null: u64 = 0;
        match sinks {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        // SAFETY: matches tp_paged_attention_T(T* out, const T* q, const T* k_cache, const T*
        // v_cache, const int64* meta, int64 tokens, hq, hkv, group, group_offset, d, block_size,
        // float scale, int64 window, const float* sinks): sinks a zero pointer or q_heads floats
        // (checked). q and out hold tokens*hq*d elements and each cache
        // num_blocks*block_size*hkv*d (checked above). meta is paged_meta's buffer: every row has a
        // position p < kv_len <= 2^31 - 1 of exactly one sequence, whose table entries for
        // positions <= p are all < num_blocks, so every key row read lies in the caches; KV heads
        // (h + group_offset) / group < hkv for every h < hq; head_dim <= 256 fits the kernel's
        // shared arrays; q_len <= kv_len, so every query sees at least its own key. 128 threads is
        // its launch bound. Only out is written, borrowed mutably; meta lives until the launch is
        // queued and cudarc keeps it alive on the stream.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_paged_attention)"))
    }

    /// Writes row `t` of `src` (`slots.len()` rows of `row_bytes` bytes) to slot `slots[t]` of
    /// `cache` (`num_slots` slots of `row_bytes`; slot = block * block_size + offset)
    /// (`tp_write_slots_uN`). Slots must be distinct and `< num_slots`.
    pub fn write_slots(
        &self,
        cache: &mut CudaSlice<u8>,
        src: &CudaSlice<u8>,
        slots: &[usize],
        row_bytes: usize,
        num_slots: usize,
    ) -> Result<()> {
        const K: &str = "write_slots";
        if span(K, num_slots, row_bytes, 0)? > cache.len() || span(K, slots.len(), row_bytes, 0)? > src.len() {
            return Err(invalid(
                K,
                format!("{} rows of {row_bytes} bytes into {num_slots} slots do not fit", slots.len()),
            ));
        }
        if let Some(&bad) = slots.iter().find(|&&s| s >= num_slots) {
            return Err(invalid(K, format!("slot {bad} is not among the cache's {num_slots}")));
        }
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(K, format!("slot {} is written twice", w[0])));
        }
        let mut wide = Vec::with_capacity(8 * slots.len());
        for &s in slots {
            wide.extend_from_slice(&i64_of(K, s)?.to_ne_bytes());
        }
        if slots.is_empty() || row_bytes == 0 {
            return Ok(());
        }
        let unit = unit_for(&[row_bytes]);
        let slots_dev = self.htod(&wide)?;
        let f = self.function(&format!("tp_write_slots_u{unit}"), 0)?;
        let (t, units) = (i64_of(K, slots.len())?, i64_of(K, row_bytes / unit)?);
        let cfg = self.grid_stride((slots.len() as u64).saturating_mul(units as u64));
        let mut b = self.stream().launch_builder(f);
        b.arg(cache).arg(src).arg(&slots_dev).arg(&t).arg(&units);
        // SAFETY: matches tp_write_slots_uN(U* cache, const U* src, const int64* slots, int64
        // tokens, row_units). src holds tokens rows and cache num_slots rows of row_units units
        // (checked above); every slot is < num_slots and distinct, so writes stay in the cache
        // and no two threads write one unit. row_bytes is a multiple of the unit and allocations
        // are 256-byte aligned, so every access is aligned. cache is borrowed mutably, src shared.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_write_slots)"))
    }
}

#[cfg(test)]
mod tests {
    use super::{PagedSequence, PagedShape, paged_meta};

    fn shape(tokens: usize, num_blocks: usize, block_size: usize) -> PagedShape {
        PagedShape {
            tokens,
            q_heads: 2,
            kv_heads: 1,
            group: 2,
            group_offset: 0,
            head_dim: 8,
            num_blocks,
            block_size,
            scale: 1.0,
            window: None,
        }
    }

    fn words(meta: &[u8], tokens: usize) -> (Vec<i64>, Vec<u32>) {
        let (head, tail) = meta.split_at(16 * tokens);
        let longs = head.chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().unwrap())).collect();
        (longs, tail.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect())
    }

    #[test]
    fn meta_holds_positions_table_starts_and_the_used_blocks() {
        let (a, b) = ([7u32, 2, 9], [4u32, 5]);
        let seqs = [
            PagedSequence { q_start: 0, q_len: 1, kv_len: 5, blocks: &a }, // decode at position 4
            PagedSequence { q_start: 1, q_len: 3, kv_len: 3, blocks: &b }, // prefill, one block used
        ];
        let meta = paged_meta("t", &shape(4, 10, 2), &seqs).unwrap();
        let (longs, tables) = words(&meta, 4);
        assert_eq!(longs, [4, 0, 1, 2, 0, 3, 3, 3]);
        assert_eq!(tables, [7, 2, 9, 4, 5]);
    }

    #[test]
    fn meta_refuses_what_would_read_outside_the_cache_or_leave_rows_unset() {
        let t = [1u32, 2];
        let seq = |q_start, q_len, kv_len, blocks| PagedSequence { q_start, q_len, kv_len, blocks };
        let s = shape(2, 3, 4);
        let err = |seqs: &[PagedSequence<'_>]| paged_meta("t", &s, seqs).unwrap_err().to_string();
        assert!(err(&[seq(0, 1, 1, &t)]).contains("row 1 belongs to no sequence"));
        assert!(err(&[seq(0, 2, 2, &t), seq(1, 1, 1, &t)]).contains("row 1 belongs to two sequences"));
        assert!(err(&[seq(0, 2, 9, &t)]).contains("need 3 blocks, its table has 2"));
        assert!(err(&[seq(0, 2, 2, &[3])]).contains("block 3 is not among the cache's 3"));
        assert!(err(&[seq(1, 2, 2, &t)]).contains("pass the 2 rows"));
        assert!(err(&[seq(0, 2, 1, &t)]).contains("2 query rows over 1 positions"));
        // An unused table entry may be anything.
        assert!(paged_meta("t", &s, &[seq(0, 2, 4, &[0, 99])]).is_ok());
    }
}
