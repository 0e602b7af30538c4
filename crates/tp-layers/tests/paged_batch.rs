//! [`TokenBatch`]'s rows, positions and slots worked out by hand, and typed errors for bad
//! batches and paged caches.

use tp_core::{DType, Device, PagedSeq};
use tp_layers::{BatchSeq, LayerError, PagedKvCache, TokenBatch};

#[test]
fn positions_slots_and_rows_follow_the_block_tables() {
    // Blocks of 4: a 3-token chunk after 5 cached positions in blocks [7, 2], a decode at
    // position 8 (block 5, row 0 of the third block), a 2-token prompt in block 0.
    let seqs = vec![
        BatchSeq { tokens: 3, context: 5, blocks: vec![7, 2] },
        BatchSeq { tokens: 1, context: 8, blocks: vec![1, 3, 5] },
        BatchSeq { tokens: 2, context: 0, blocks: vec![0, 9] },
    ];
    let b = TokenBatch::new(seqs, 4).unwrap();
    assert_eq!(b.num_tokens(), 6);
    assert_eq!(b.positions(), &[5, 6, 7, 8, 0, 1]);
    assert_eq!(b.slots(), &[9, 10, 11, 20, 0, 1]);
    assert_eq!((b.rows(0), b.rows(1), b.rows(2), b.rows(3)), (0..3, 3..4, 4..6, 0..0));
    assert_eq!(b.last_rows(), vec![2, 3, 5]);
    let p = b.paged_seqs();
    assert_eq!(p[0], PagedSeq { q_start: 0, q_len: 3, kv_len: 8, blocks: &[7, 2] });
    assert_eq!(p[1], PagedSeq { q_start: 3, q_len: 1, kv_len: 9, blocks: &[1, 3, 5] });
    assert_eq!(p[2], PagedSeq { q_start: 4, q_len: 2, kv_len: 2, blocks: &[0, 9] });
}

#[test]
fn bad_batches_and_caches_are_typed_errors() {
    let config = |r: tp_layers::Result<TokenBatch>, what: &str| match r {
        Err(LayerError::Config(why)) => assert!(why.contains(what), "{why}"),
        other => panic!("expected a Config error naming {what:?}, got {other:?}"),
    };
    let seq = |tokens, context, blocks: &[u32]| BatchSeq { tokens, context, blocks: blocks.to_vec() };
    config(TokenBatch::new(vec![], 4), "no sequences");
    config(TokenBatch::new(vec![seq(1, 0, &[0])], 0), "block size must be at least 1");
    config(TokenBatch::new(vec![seq(1, 0, &[0]), seq(0, 3, &[1])], 4), "sequence 1 feeds 0 tokens after 3");
    config(TokenBatch::new(vec![seq(2, 7, &[0, 1])], 4), "sequence 0: 2 blocks of 4 cannot hold its 9 positions");
    config(TokenBatch::new(vec![seq(1, usize::MAX, &[0])], 4), "sequence 0 feeds 1 tokens after");
    for dims in [(0, 4, 2, 8), (3, 0, 2, 8), (3, 4, 0, 8), (3, 4, 2, 0)] {
        let r = PagedKvCache::new(dims.0, dims.1, dims.2, dims.3, DType::F32, &Device::Cpu);
        assert!(matches!(r, Err(LayerError::Config(_))), "{dims:?}");
    }
    let huge = PagedKvCache::new(1 << 40, 1 << 20, 8, 128, DType::F32, &Device::Cpu);
    assert!(matches!(huge, Err(LayerError::CacheAlloc { .. })), "{huge:?}");
    let c = PagedKvCache::new(3, 4, 2, 8, DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(
        (c.num_blocks(), c.block_size(), c.head_shape(), c.bytes_per_block()),
        (3, 4, (2, 8), 2 * 4 * 2 * 8 * 2)
    );
}

#[test]
fn eight_bit_caches_cost_a_byte_per_element_and_refuse_what_they_cannot_hold() {
    use tp_core::KvQuant;
    let fp8 = PagedKvCache::new_quantized(3, 4, 2, 64, KvQuant::Fp8E4M3, DType::BF16, &Device::Cpu).unwrap();
    let bf16 = PagedKvCache::new(3, 4, 2, 64, DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(fp8.bytes_per_block() * 2, bf16.bytes_per_block());
    assert_eq!((fp8.quant(), fp8.dtype(), bf16.quant()), (Some(KvQuant::Fp8E4M3), DType::BF16, None));
    // Q8_0: 34 bytes per 32 elements.
    let q8 = PagedKvCache::new_quantized(3, 4, 2, 64, KvQuant::Q8_0, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(q8.bytes_per_block(), 2 * 4 * 2 * (64 / 32 * 34));
    assert_eq!(PagedKvCache::block_bytes(4, 2, 64, DType::F32, Some(KvQuant::Q8_0)), Some(q8.bytes_per_block()));
    assert_eq!(PagedKvCache::block_bytes(4, 2, 48, DType::F32, Some(KvQuant::Q8_0)), None);
    let config = |r: tp_layers::Result<PagedKvCache>, what: &str| match r {
        Err(LayerError::Config(why)) => assert!(why.contains(what), "{why}"),
        other => panic!("expected a Config error naming {what:?}, got {other:?}"),
    };
    config(PagedKvCache::new_quantized(3, 4, 2, 48, KvQuant::Q8_0, DType::F32, &Device::Cpu), "multiple of 32");
    config(PagedKvCache::new_quantized(0, 4, 2, 64, KvQuant::Fp8E4M3, DType::F32, &Device::Cpu), "0 x 4 x 2 x 64");
    config(PagedKvCache::new_quantized(3, 4, 2, 64, KvQuant::Fp8E4M3, DType::F32, &Device::Cuda(0)), "host memory");
    let huge = PagedKvCache::new_quantized(1 << 40, 1 << 20, 8, 128, KvQuant::Fp8E4M3, DType::F32, &Device::Cpu);
    assert!(matches!(huge, Err(LayerError::CacheAlloc { .. })), "{huge:?}");
}
