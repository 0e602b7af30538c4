//! Paged attention and slot writes on the host: against a float64 reference over random
//! batches (block sizes 1, 3 and 16, shuffled block ids, windows, grouped heads starting
//! mid-group, several sequences of uneven lengths, every float dtype), bitwise batch invariance,
//! and a typed error for every bad argument.

mod common;
use common::paged::{PagedCase, build, check_batch_invariance, check_paged_attention};
use tp_core::{DType, Device, Error, KvGroups, PagedAttentionSpec, PagedSeq, Tensor};

const CPU: Device = Device::Cpu;

/// Decodes, a prefill from scratch, chunks after a context, a sequence of one token.
const MIXED: [(usize, usize); 5] = [(9, 1), (0, 7), (20, 5), (0, 1), (33, 1)];

fn case(block_size: usize, heads: (usize, usize, usize), dtype: DType, seed: u64) -> PagedCase {
    PagedCase {
        seqs: MIXED.to_vec(),
        block_size,
        heads,
        window: None,
        groups: None,
        sinks: None,
        spare_blocks: 3,
        dtype,
        seed,
    }
}

#[test]
fn paged_attention_matches_f64_across_block_sizes_heads_and_dtypes() {
    for bs in [1, 3, 16] {
        // Head sizes on and off the 16 lanes of a vector; groups of 1, 2, 3, 4, 8 and 12 query
        // heads per KV head (more than one pass of the grouped rows).
        for heads in [(4, 4, 8), (6, 2, 16), (4, 1, 5), (16, 2, 72), (12, 1, 33), (6, 2, 256)] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                check_paged_attention(CPU, &case(bs, heads, dtype, bs as u64 * 31 + heads.0 as u64));
            }
        }
    }
}

#[test]
fn paged_attention_respects_windows_and_groups_starting_mid_group() {
    for bs in [1, 3, 16] {
        for w in [1, 4, 17] {
            check_paged_attention(CPU, &PagedCase { window: Some(w), ..case(bs, (4, 2, 8), DType::F32, w as u64) });
        }
        // 3 query heads of a model with 4 per KV head, starting at the third of a group: heads
        // 0 and 1 use KV head 0, head 2 uses KV head 1.
        let groups = Some(KvGroups { size: 4, offset: 2 });
        check_paged_attention(CPU, &PagedCase { groups, ..case(bs, (3, 2, 8), DType::F32, 90 + bs as u64) });
        check_paged_attention(CPU, &PagedCase { groups, ..case(bs, (3, 2, 8), DType::BF16, 91 + bs as u64) });
    }
}

/// Long prefill chunks (from scratch and after a context: 260 x 260 and 230 x 350 scores, past
/// the tiles' threshold) go through the score tiles of the single-sequence op, beside a short
/// chunk and decode rows that stay per row: the same float64 reference, with windows, grouped
/// heads starting mid-group and every float dtype; and with products made batch-invariant
/// (every row on the per-row path) too.
#[test]
fn prefill_chunks_through_score_tiles_match_f64() {
    // The tiles where the machine takes them (not on AVX-512), and on every machine here.
    prefill_chunks_match_f64();
    tp_core::cpu::set_prefill_attention_gemms(Some(true));
    prefill_chunks_match_f64();
    tp_core::cpu::set_prefill_attention_gemms(None);
}

fn prefill_chunks_match_f64() {
    let seqs = vec![(0, 260), (120, 230), (5, 9), (3, 1), (17, 1)];
    for bs in [1, 3, 16] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let c = PagedCase { seqs: seqs.clone(), ..case(bs, (4, 2, 8), dtype, 40 + bs as u64) };
            check_paged_attention(CPU, &c);
            check_batch_invariance(CPU, &c);
        }
        for w in [1, 17, 300] {
            let c = PagedCase { seqs: seqs.clone(), window: Some(w), ..case(bs, (4, 2, 8), DType::F32, w as u64) };
            check_paged_attention(CPU, &c);
        }
        let groups = Some(KvGroups { size: 4, offset: 2 });
        check_paged_attention(CPU, &PagedCase { seqs: seqs.clone(), groups, ..case(bs, (3, 2, 8), DType::BF16, 95) });
    }
    tp_core::cpu::set_batch_invariant(true);
    check_paged_attention(CPU, &PagedCase { seqs, ..case(3, (4, 2, 8), DType::F32, 77) });
    tp_core::cpu::set_batch_invariant(false);
}

#[test]
fn a_rows_result_does_not_depend_on_the_rest_of_the_batch() {
    for bs in [1, 3, 16] {
        check_batch_invariance(CPU, &case(bs, (6, 2, 16), DType::F32, 7));
        check_batch_invariance(CPU, &PagedCase { window: Some(5), ..case(bs, (4, 4, 8), DType::BF16, 8) });
    }
    // Large enough that the batch is split over threads while each sequence alone is not.
    let big = PagedCase { seqs: vec![(300, 1), (0, 40), (250, 9), (120, 1)], ..case(16, (8, 2, 64), DType::F32, 9) };
    check_paged_attention(CPU, &big);
    check_batch_invariance(CPU, &big);
    // GQA groups of 8 heads cut by the threads' chunks at various points.
    let wide = PagedCase { seqs: vec![(200, 1), (0, 30), (90, 3), (310, 1)], ..case(3, (16, 2, 72), DType::BF16, 10) };
    check_paged_attention(CPU, &wide);
    check_batch_invariance(CPU, &wide);
}

/// gpt-oss's attention sinks: each query head's sink logit joins its softmax (large ones take
/// most of the weight, very negative ones none), on every host path (the grouped AVX-512 rows,
/// the portable rows, score tiles for long prefill chunks), alone and in a batch, with windows
/// and groups starting mid-group; a row's bits still do not depend on its batch.
#[test]
fn attention_sinks_join_each_heads_softmax() {
    let sinks = |hq: usize| Some((0..hq).map(|h| [2.5f32, -0.7, 0.0, -30.0, 6.0][h % 5]).collect::<Vec<_>>());
    let long = vec![(0, 40), (5, 1), (200, 12), (31, 3)];
    for bs in [1, 4, 16] {
        for dtype in [DType::F32, DType::BF16] {
            let c = PagedCase { sinks: sinks(6), ..case(bs, (6, 2, 24), dtype, 60 + bs as u64) };
            check_paged_attention(CPU, &c);
            check_paged_attention(CPU, &PagedCase { window: Some(5), ..c.clone() });
            let groups = Some(KvGroups { size: 3, offset: 2 });
            check_paged_attention(CPU, &PagedCase { groups, sinks: sinks(5), heads: (5, 3, 24), ..c.clone() });
            for gemms in [Some(true), Some(false)] {
                tp_core::cpu::set_prefill_attention_gemms(gemms);
                check_paged_attention(CPU, &PagedCase { seqs: long.clone(), ..c.clone() });
            }
            tp_core::cpu::set_prefill_attention_gemms(None);
            check_batch_invariance(CPU, &c);
        }
    }
    // A sink per head or none: any other count is refused by name.
    let mut b = build(&case(4, (4, 2, 8), DType::F32, 3));
    b.spec.sinks = Some(vec![0.0f32; 3].into());
    let all: Vec<usize> = (0..b.seqs.len()).collect();
    let err = b.q.paged_attention(&b.k, &b.v, &b.paged(&all), &b.spec).unwrap_err();
    assert!(err.to_string().contains("sinks"), "{err}");
}

#[test]
fn write_slots_writes_each_row_at_its_slot_and_nothing_else() {
    let (nb, bs, h, d) = (5, 3, 2, 4);
    for dtype in [DType::F32, DType::BF16] {
        let mut cache = Tensor::zeros(&[nb, bs, h, d], dtype, &CPU).unwrap();
        let src = Tensor::randn(&[4, h, d], dtype, 3, &CPU).unwrap();
        let slots = [14, 0, 7, 8];
        cache.write_slots(&src, &slots).unwrap();
        let (got, rows) = (cache.to_f64_vec().unwrap(), src.to_f64_vec().unwrap());
        let row = h * d;
        for slot in 0..nb * bs {
            let want = match slots.iter().position(|&s| s == slot) {
                Some(t) => rows[t * row..(t + 1) * row].to_vec(),
                None => vec![0.0; row],
            };
            assert_eq!(&got[slot * row..(slot + 1) * row], &want[..], "{dtype} slot {slot}");
        }
    }
}

#[test]
fn bad_slot_writes_are_typed_errors_and_leave_the_cache_unchanged() {
    let mut cache = Tensor::zeros(&[2, 4, 2, 3], DType::F32, &CPU).unwrap();
    let before = cache.clone().to_f64_vec().unwrap();
    let src = Tensor::randn(&[2, 2, 3], DType::F32, 1, &CPU).unwrap();
    let invalid = |r: tp_core::Result<()>, what: &str| match r {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains(what), "{why}"),
        other => panic!("expected InvalidArgument naming {what:?}, got {other:?}"),
    };
    invalid(cache.write_slots(&src, &[1, 8]), "slot 8 of row 1 is past the cache's 8 slots");
    invalid(cache.write_slots(&src, &[3, 3]), "slot 3 is written by two rows");
    invalid(cache.write_slots(&src, &[3]), "1 slots given for 2 source rows");
    let wide = Tensor::randn(&[2, 3, 3], DType::F32, 1, &CPU).unwrap();
    assert!(matches!(cache.write_slots(&wide, &[0, 1]), Err(Error::ShapeMismatch { .. })));
    let half = src.to_dtype(DType::BF16).unwrap();
    assert!(matches!(cache.write_slots(&half, &[0, 1]), Err(Error::DTypeMismatch { .. })));
    assert!(matches!(cache.write_slots(&src.reshape(&[2, 6]).unwrap(), &[0, 1]), Err(Error::RankMismatch { .. })));
    let mut flat = Tensor::zeros(&[8, 2, 3], DType::F32, &CPU).unwrap();
    assert!(matches!(flat.write_slots(&src, &[0, 1]), Err(Error::RankMismatch { .. })));
    assert_eq!(cache.to_f64_vec().unwrap(), before, "nothing written on error");
}

/// `seqs` with sequence `i` replaced by `s`.
fn with<'a>(seqs: &[PagedSeq<'a>], i: usize, s: PagedSeq<'a>) -> Vec<PagedSeq<'a>> {
    let mut v = seqs.to_vec();
    v[i] = s;
    v
}

#[test]
fn bad_batches_are_typed_errors_naming_the_problem() {
    let b = build(&case(4, (4, 2, 8), DType::F32, 5));
    let spec = b.spec.clone();
    let all: Vec<usize> = (0..b.seqs.len()).collect();
    let good = b.paged(&all);
    assert!(b.q.paged_attention(&b.k, &b.v, &good, &spec).is_ok());
    let run = |seqs: &[PagedSeq<'_>], spec: &PagedAttentionSpec| b.q.paged_attention(&b.k, &b.v, seqs, spec);
    let invalid = |r: tp_core::Result<Tensor>, what: &str| match r {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains(what), "{why}"),
        other => panic!("expected InvalidArgument naming {what:?}, got {:?}", other.map(|t| t.dims().to_vec())),
    };
    invalid(run(&good[1..], &spec), "row 0 of q belongs to no sequence");
    invalid(run(&with(&good, 1, PagedSeq { q_start: 0, ..good[1] }), &spec), "row 0 of q also belongs to sequence 0");
    invalid(run(&with(&good, 0, PagedSeq { q_len: 0, ..good[0] }), &spec), "sequence 0: 0 query rows");
    invalid(run(&with(&good, 3, PagedSeq { kv_len: 0, ..good[3] }), &spec), "sequence 3: 1 query rows for 0 positions");
    invalid(
        run(&with(&good, 4, PagedSeq { q_start: 15, ..good[4] }), &spec),
        "sequence 4: rows 15..+1 pass the 15 rows of q",
    );
    let short = [7u32, 1];
    invalid(
        run(&with(&good, 2, PagedSeq { blocks: &short, ..good[2] }), &spec),
        "sequence 2: 2 blocks of 4 cannot hold its 25 positions",
    );
    let past = [0u32, 1, 2, 3, 4, 5, 999];
    invalid(
        run(&with(&good, 2, PagedSeq { blocks: &past, ..good[2] }), &spec),
        "sequence 2: block 999 is past the cache's",
    );
    let window0 = PagedAttentionSpec { sliding_window: Some(0), ..spec.clone() };
    invalid(run(&good, &window0), "window");
    let nan = PagedAttentionSpec { scale: f32::NAN, ..spec.clone() };
    invalid(run(&good, &nan), "scale");
    // Shapes, dtypes, ranks.
    let q3 = Tensor::randn(&[15, 3, 8], DType::F32, 1, &CPU).unwrap(); // 2 KV heads do not divide 3
    assert!(matches!(q3.paged_attention(&b.k, &b.v, &good, &spec), Err(Error::ShapeMismatch { .. })));
    let v_short = b.v.narrow(3, 0, 4).unwrap();
    assert!(matches!(b.q.paged_attention(&b.k, &v_short, &good, &spec), Err(Error::ShapeMismatch { .. })));
    let flat = b.k.reshape(&[b.k.dims()[0] * 4, 2, 8]).unwrap();
    assert!(matches!(b.q.paged_attention(&flat, &flat, &good, &spec), Err(Error::RankMismatch { .. })));
    let half = b.q.to_dtype(DType::F16).unwrap();
    assert!(matches!(half.paged_attention(&b.k, &b.v, &good, &spec), Err(Error::DTypeMismatch { .. })));
    let ids = Tensor::from_vec(vec![1i64; 15 * 4 * 8], &[15, 4, 8], &CPU).unwrap();
    assert!(matches!(ids.paged_attention(&b.k, &b.v, &good, &spec), Err(Error::NotFloat { .. })));
}
