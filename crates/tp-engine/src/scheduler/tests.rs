//! Unit tests of the scheduler: limits, order, chunking, preemption, prefix hits, freeing.

use super::*;

fn cfg(num_blocks: usize, block_size: usize, budget: usize, max_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: max_seqs,
        max_num_batched_tokens: budget,
        max_model_len: 1000,
        block_size,
        num_blocks,
        enable_prefix_caching: true,
        max_waiting: 8,
        max_loras: usize::MAX,
    }
}

fn sched(num_blocks: usize, block_size: usize, budget: usize, max_seqs: usize) -> Scheduler {
    Scheduler::new(cfg(num_blocks, block_size, budget, max_seqs)).unwrap()
}

/// (id, context, tokens fed, sample) of each part of `plan`.
fn shape(plan: &StepPlan) -> Vec<(RequestId, usize, usize, bool)> {
    plan.seqs.iter().map(|s| (s.id, s.context, s.tokens.len(), s.sample)).collect()
}

/// Completes `plan`, sampling token `100 + id` for every part that samples.
fn complete(s: &mut Scheduler, plan: &StepPlan) {
    let sampled: Vec<_> = plan.seqs.iter().filter(|p| p.sample).map(|p| (p.id, 100 + p.id as i64)).collect();
    s.complete_step(plan, &sampled);
    s.check_invariants().unwrap();
}

#[test]
fn new_refuses_zero_limits() {
    let mut c = cfg(4, 4, 8, 2);
    c.max_num_batched_tokens = 0;
    assert!(Scheduler::new(c).unwrap_err().contains("max_num_batched_tokens"));
    let mut c = cfg(4, 4, 8, 2);
    c.block_size = 0;
    assert!(Scheduler::new(c).unwrap_err().contains("block_size"));
}

#[test]
fn add_refuses_what_can_never_run() {
    let mut s = sched(4, 4, 8, 2); // 16 positions in all
    match s.add(1, vec![1; 10], 7) {
        Err(SubmitError::TooLong(m)) => assert!(m.contains("17 positions") && m.contains("holds 4 blocks"), "{m}"),
        other => panic!("{other:?}"),
    }
    s.add(1, vec![1; 10], 6).unwrap();
    let mut c = cfg(100, 4, 8, 2);
    c.max_model_len = 12;
    let mut t = Scheduler::new(c).unwrap();
    assert!(matches!(t.add(1, vec![1; 10], 3), Err(SubmitError::TooLong(m)) if m.contains("12 tokens")));
    assert!(matches!(t.add(1, vec![], 3), Err(SubmitError::Invalid { param: "prompt", .. })));
    assert!(matches!(t.add(1, vec![1], 0), Err(SubmitError::Invalid { param: "max_tokens", .. })));
    t.add(1, vec![1], 1).unwrap();
    assert!(matches!(t.add(1, vec![1], 1), Err(SubmitError::Invalid { param: "id", .. })));
}

#[test]
fn a_full_queue_refuses_more() {
    let mut c = cfg(4, 4, 8, 2);
    c.max_waiting = 2;
    let mut s = Scheduler::new(c).unwrap();
    s.add(1, vec![1], 1).unwrap();
    s.add(2, vec![1], 1).unwrap();
    assert_eq!(s.add(3, vec![1], 1), Err(SubmitError::QueueFull(2)));
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn long_prompts_are_prefilled_in_chunks_and_decodes_go_first() {
    let mut s = sched(16, 4, 4, 4);
    s.add(1, (0..10).collect(), 5).unwrap();
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(1, 0, 4, false)]);
    assert_eq!(p.seqs[0].tokens, vec![0, 1, 2, 3]);
    assert_eq!(p.seqs[0].blocks.len(), 1);
    complete(&mut s, &p);
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(1, 4, 4, false)]);
    complete(&mut s, &p);
    s.add(2, (50..57).collect(), 5).unwrap();
    let p = s.schedule();
    // 1's last two prompt tokens, then 2's first chunk in the rest of the budget.
    assert_eq!(shape(&p), vec![(1, 8, 2, true), (2, 0, 2, false)]);
    assert_eq!(p.num_tokens(), 4);
    complete(&mut s, &p);
    let p = s.schedule();
    // 1 decodes its sampled token first; 2 continues.
    assert_eq!(shape(&p), vec![(1, 10, 1, true), (2, 2, 3, false)]);
    assert_eq!(p.seqs[0].tokens, vec![101]);
    assert_eq!(p.seqs[0].blocks.len(), 3);
    complete(&mut s, &p);
    s.finish(1);
    s.finish(2);
    assert_eq!((s.free_blocks(), s.kv_cache_usage(), s.num_running()), (16, 0.0, 0));
}

#[test]
fn the_sequence_cap_holds_the_rest_in_order() {
    let mut s = sched(16, 4, 64, 2);
    for id in 1..=3 {
        s.add(id, vec![id as i64; 3], 4).unwrap();
    }
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(1, 0, 3, true), (2, 0, 3, true)]);
    complete(&mut s, &p);
    s.finish(1);
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(2, 3, 1, true), (3, 0, 3, true)]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 0));
}

#[test]
fn out_of_blocks_the_newest_is_preempted_and_recomputed_with_its_output() {
    // 3 blocks of 2: two sequences of 2 prompt tokens fill 2 blocks; growing both needs 4.
    let mut s = sched(3, 2, 64, 4);
    s.add(1, vec![1, 2], 4).unwrap();
    s.add(2, vec![3, 4], 4).unwrap();
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(1, 0, 2, true), (2, 0, 2, true)]);
    complete(&mut s, &p); // 1: [1,2,101], 2: [3,4,102]
    let p = s.schedule();
    // 1 takes the third block; 2 finds none and is preempted (back to the queue, no admission).
    assert_eq!(shape(&p), vec![(1, 2, 1, true)]);
    assert_eq!(p.preempted, vec![2]);
    assert_eq!((s.num_running(), s.num_waiting(), s.preemptions()), (1, 1, 1));
    complete(&mut s, &p);
    s.finish(1);
    let p = s.schedule();
    // 2 is recomputed from its prompt and its generated token; its first block is a prefix hit.
    assert_eq!(shape(&p), vec![(2, 2, 1, true)]);
    assert_eq!(p.seqs[0].tokens, vec![102]);
    assert_eq!(p.seqs[0].cached_tokens, 2);
    complete(&mut s, &p);
    s.finish(2);
    assert_eq!(s.free_blocks(), 3);
}

#[test]
fn a_preempted_sequence_goes_back_ahead_of_later_requests() {
    let mut s = sched(3, 2, 64, 2);
    for id in 1..=3 {
        s.add(id, vec![2 * id as i64 - 1, 2 * id as i64], 4).unwrap();
    }
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(1, 0, 2, true), (2, 0, 2, true)]);
    complete(&mut s, &p);
    let p = s.schedule();
    assert_eq!((shape(&p), p.preempted.clone()), (vec![(1, 2, 1, true)], vec![2]));
    complete(&mut s, &p);
    s.finish(1);
    // 2 (preempted) is admitted before 3 (queued earlier than 2's preemption).
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(2, 2, 1, true), (3, 0, 2, true)]);
}

#[test]
fn prefix_hits_reuse_full_blocks_but_always_compute_the_last_token() {
    let mut s = sched(16, 4, 64, 4);
    s.add(1, (0..9).collect(), 1).unwrap();
    let p = s.schedule();
    complete(&mut s, &p);
    s.finish(1);
    // 8 equal tokens: both blocks hit; exactly 8 tokens: only the first (the last token is fed).
    s.add(2, (0..8).chain([40, 41]).collect(), 1).unwrap();
    s.add(3, (0..8).collect(), 1).unwrap();
    s.add(4, (0..3).chain([9]).collect(), 1).unwrap();
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(2, 8, 2, true), (3, 4, 4, true), (4, 0, 4, true)]);
    assert_eq!(p.seqs.iter().map(|x| x.cached_tokens).collect::<Vec<_>>(), vec![8, 4, 0]);
    assert_eq!(p.seqs[0].blocks[0], p.seqs[1].blocks[0]);
    assert_eq!(s.prefix_hit_tokens(), 12);
    complete(&mut s, &p);
    for id in 2..=4 {
        s.finish(id);
    }
    assert_eq!((s.free_blocks(), s.kv_cache_usage()), (16, 0.0));
}

#[test]
fn without_prefix_caching_nothing_is_shared() {
    let mut c = cfg(16, 4, 64, 4);
    c.enable_prefix_caching = false;
    let mut s = Scheduler::new(c).unwrap();
    s.add(1, (0..9).collect(), 1).unwrap();
    let p = s.schedule();
    complete(&mut s, &p);
    s.finish(1);
    s.add(2, (0..9).collect(), 1).unwrap();
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(2, 0, 9, true)]);
    assert_eq!(s.prefix_hit_tokens(), 0);
}

#[test]
fn abort_frees_at_once_and_skips_the_stale_plan() {
    let mut s = sched(8, 4, 64, 4);
    s.add(1, (0..6).collect(), 4).unwrap();
    s.add(2, (0..6).collect(), 4).unwrap();
    let p = s.schedule();
    assert!(s.kv_cache_usage() > 0.0);
    assert!(s.abort(1));
    assert!(!s.abort(1));
    assert!(s.abort(2));
    complete(&mut s, &p);
    assert_eq!((s.free_blocks(), s.kv_cache_usage(), s.num_running()), (8, 0.0, 0));
    assert!(s.schedule().seqs.is_empty());
    s.add(3, vec![1], 1).unwrap();
    assert!(s.abort(3)); // a waiting one too
    assert_eq!(s.num_waiting(), 0);
}

#[test]
fn a_missing_sample_feeds_the_last_token_again() {
    let mut s = sched(8, 4, 64, 4);
    s.add(1, (0..5).collect(), 4).unwrap();
    let p = s.schedule();
    s.complete_step(&p, &[]);
    s.check_invariants().unwrap();
    let p = s.schedule();
    assert_eq!(shape(&p), vec![(1, 4, 1, true)]);
    assert_eq!(p.seqs[0].tokens, vec![4]);
}

#[test]
fn max_loras_holds_back_a_third_adapter_and_lets_later_requests_pass() {
    let mut c = cfg(64, 4, 64, 8);
    c.max_loras = 2;
    let mut s = Scheduler::new(c).unwrap();
    s.add_adapted(1, vec![1; 3], 2, true, 1).unwrap();
    s.add_adapted(2, vec![2; 3], 2, true, 2).unwrap();
    s.add_adapted(3, vec![3; 3], 2, true, 3).unwrap(); // a third adapter: waits
    s.add_adapted(4, vec![4; 3], 2, true, 1).unwrap(); // adapter 1 again: goes ahead
    s.add_adapted(5, vec![5; 3], 2, true, 0).unwrap(); // the base: goes ahead
    let plan = s.schedule();
    assert_eq!(plan.seqs.iter().map(|p| p.id).collect::<Vec<_>>(), vec![1, 2, 4, 5]);
    complete(&mut s, &plan);
    s.finish(2);
    let plan = s.schedule();
    assert!(plan.seqs.iter().any(|p| p.id == 3), "adapter 3 runs once adapter 2 is gone");
}

#[test]
fn cached_blocks_are_shared_within_an_adapter_only() {
    let mut s = sched(64, 4, 64, 8);
    let prompt: Vec<i64> = (0..9).collect();
    s.add_adapted(1, prompt.clone(), 2, true, 1).unwrap();
    let plan = s.schedule();
    complete(&mut s, &plan);
    s.add_adapted(2, prompt.clone(), 2, true, 2).unwrap(); // another adapter: no hit
    s.add_adapted(3, prompt.clone(), 2, true, 0).unwrap(); // the base: no hit
    s.add_adapted(4, prompt, 2, true, 1).unwrap(); // the same adapter: two blocks hit
    let plan = s.schedule();
    let context = |id| plan.seqs.iter().find(|p| p.id == id).unwrap().context;
    assert_eq!((context(2), context(3), context(4)), (0, 0, 8));
}
