//! The scheduler driven to completion by a simulated model, against each request run alone.
//!
//! The "model" reads its context back from a simulated KV cache (one value per slot, a hash of
//! the position's whole prefix, written at the slots the plan's block tables give), so a wrong
//! block table, a block shared without an equal prefix, or a write into someone else's block
//! changes the tokens it generates. Its next token is the last value modulo a small vocabulary;
//! token 0 is the end of sequence. Every request must get
//! exactly the tokens the plain loop in [`alone`] gives it, whatever the cache size, budget,
//! sequence cap, arrival order, preemptions and prefix hits.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

const VOCAB: u64 = 13;
const EOS: i64 = 0;

/// The simulated key/value of a position: FNV-1a chained over the previous position's value and
/// this position's token (so it depends on the whole prefix, as real keys and values do).
fn kv_value(prev: Option<u64>, token: i64) -> u64 {
    let mut h = prev.unwrap_or(0xcbf2_9ce4_8422_2325);
    for b in token.to_le_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The values of every prefix of `tokens`.
fn kv_values(tokens: &[i64]) -> Vec<u64> {
    tokens
        .iter()
        .scan(None, |prev, &t| {
            *prev = Some(kv_value(*prev, t));
            *prev
        })
        .collect()
}

/// The simulated model: the next token from the last position's value.
fn next_token(context: &[i64]) -> i64 {
    (kv_values(context).last().copied().unwrap_or(0) % VOCAB) as i64
}

/// What a request generates alone: until the end of sequence or `max_tokens`.
fn alone(prompt: &[i64], max_tokens: usize) -> Vec<i64> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let t = next_token(&seq);
        out.push(t);
        seq.push(t);
        if t == EOS {
            break;
        }
    }
    out
}

#[derive(Debug, Clone)]
struct ReqSpec {
    prompt: Vec<i64>,
    max_tokens: usize,
    arrive: usize,
    abort_at: Option<usize>,
}

#[derive(Debug, Clone)]
struct Workload {
    cfg: SchedulerConfig,
    reqs: Vec<ReqSpec>,
}

/// The driver's view of one request.
struct Live {
    prompt: Vec<i64>,
    max_tokens: usize,
    out: Vec<i64>,
    /// Positions the driver has seen computed since the last (re)admission.
    computed: usize,
}

/// What a run left: each completed request's output, and the scheduler's counters.
struct Outcome {
    done: HashMap<RequestId, Vec<i64>>,
    preemptions: u64,
    prefix_hit_tokens: u64,
}

/// Runs `w` to the end, checking every step.
fn run(w: &Workload) -> Result<Outcome, String> {
    let mut s = Scheduler::new(w.cfg.clone())?;
    let (bs, nb) = (w.cfg.block_size, w.cfg.num_blocks);
    let mut kv: Vec<Option<u64>> = vec![None; nb * bs];
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut done = HashMap::new();
    let last_arrival = w.reqs.iter().map(|r| r.arrive).max().unwrap_or(0);
    for step in 0..10_000 {
        for (id, r) in w.reqs.iter().enumerate().filter(|(_, r)| r.arrive == step) {
            let id = id as RequestId;
            let fits = (r.prompt.len() + r.max_tokens).div_ceil(bs) <= nb;
            match s.add(id, r.prompt.clone(), r.max_tokens) {
                Ok(()) if fits => {
                    live.insert(
                        id,
                        Live { prompt: r.prompt.clone(), max_tokens: r.max_tokens, out: vec![], computed: 0 },
                    );
                }
                Err(SubmitError::TooLong(_)) if !fits => {}
                other => return Err(format!("add {id} (fits: {fits}): {other:?}")),
            }
        }
        let plan = s.schedule();
        s.check_invariants()?;
        if plan.num_tokens() > w.cfg.max_num_batched_tokens || plan.seqs.len() > w.cfg.max_num_seqs {
            return Err(format!("step {step} plans {} tokens of {} sequences", plan.num_tokens(), plan.seqs.len()));
        }
        if plan.seqs.is_empty() && plan.preempted.is_empty() && s.num_running() + s.num_waiting() > 0 {
            return Err(format!("step {step}: nothing planned with work left"));
        }
        for id in &plan.preempted {
            live.get_mut(id).ok_or("preempted an unknown request")?.computed = 0;
        }
        let mut sampled = Vec::new();
        for part in &plan.seqs {
            let r = live.get_mut(&part.id).ok_or(format!("planned unknown request {}", part.id))?;
            let full: Vec<i64> = r.prompt.iter().chain(&r.out).copied().collect();
            let end = part.context + part.tokens.len();
            let fresh = r.computed == 0 && part.context == part.cached_tokens && part.context % bs == 0;
            if (part.context != r.computed && !fresh) || part.tokens.is_empty() || end > full.len() {
                return Err(format!("request {}: context {} after {} computed", part.id, part.context, r.computed));
            }
            if part.tokens[..] != full[part.context..end] || part.sample != (end == full.len()) {
                return Err(format!("request {}: wrong tokens or sample flag at {}", part.id, part.context));
            }
            if part.blocks.len() != end.div_ceil(bs) {
                return Err(format!("request {}: {} blocks for {end} positions", part.id, part.blocks.len()));
            }
            let slot = |p: usize| part.blocks[p / bs] as usize * bs + p % bs;
            // The context in the cache (prefix hits included) is exactly this request's prefix.
            let want = kv_values(&full);
            if let Some(p) = (0..part.context).find(|&p| kv[slot(p)] != Some(want[p])) {
                return Err(format!("request {}: position {p} holds another prefix", part.id));
            }
            for (i, &t) in part.tokens.iter().enumerate() {
                let b = part.blocks[(part.context + i) / bs];
                if s.pool.refs(b) != 1 || s.pool.is_cached(b) {
                    return Err(format!("request {}: writes into shared or cached block {b}", part.id));
                }
                let p = part.context + i;
                let prev = if p == 0 { None } else { kv[slot(p - 1)] };
                kv[slot(p)] = Some(kv_value(prev, t));
            }
            r.computed = end;
            if part.sample {
                sampled.push((part.id, (kv[slot(end - 1)].unwrap_or(0) % VOCAB) as i64));
            }
        }
        // Aborts arrive while the step runs.
        for (id, r) in w.reqs.iter().enumerate() {
            if r.abort_at == Some(step) && live.remove(&(id as RequestId)).is_some() {
                s.abort(id as RequestId);
            }
        }
        s.complete_step(&plan, &sampled);
        s.check_invariants()?;
        for (id, t) in sampled {
            let Some(r) = live.get_mut(&id) else { continue };
            r.out.push(t);
            if t == EOS || r.out.len() == r.max_tokens {
                s.finish(id);
                done.insert(id, live.remove(&id).map(|r| r.out).unwrap_or_default());
            }
        }
        if step > last_arrival && live.is_empty() {
            if s.num_running() + s.num_waiting() != 0 || s.free_blocks() != nb || s.kv_cache_usage() != 0.0 {
                return Err(format!("all done, but {} free of {nb}, usage {}", s.free_blocks(), s.kv_cache_usage()));
            }
            return Ok(Outcome { done, preemptions: s.preemptions(), prefix_hit_tokens: s.prefix_hit_tokens() });
        }
    }
    Err("no end after 10000 steps".into())
}

/// Checks every completed request against [`alone`] and that nothing unaborted went missing.
fn check_outputs(w: &Workload, done: &HashMap<RequestId, Vec<i64>>) -> Result<(), String> {
    for (id, r) in w.reqs.iter().enumerate() {
        let fits = (r.prompt.len() + r.max_tokens).div_ceil(w.cfg.block_size) <= w.cfg.num_blocks;
        match done.get(&(id as RequestId)) {
            Some(out) if *out != alone(&r.prompt, r.max_tokens) => return Err(format!("request {id}: {out:?}")),
            None if fits && r.abort_at.is_none() => return Err(format!("request {id} never finished")),
            _ => {}
        }
    }
    Ok(())
}

/// Prompts drawn from three shared stems (so prefix hits happen; each stem is the one before
/// shifted by three, so equal blocks also sit at different positions) plus a random tail.
fn workload() -> impl Strategy<Value = Workload> {
    let req = (
        0usize..3,
        0usize..14,
        prop::collection::vec(1i64..4, 0..6),
        1usize..10,
        0usize..12,
        prop::option::weighted(0.15, 0usize..30),
    );
    (1usize..5, 1usize..25, 1usize..20, 1usize..6, any::<bool>(), prop::collection::vec(req, 1..10)).prop_map(
        |(bs, nb, budget, seqs, caching, reqs)| Workload {
            cfg: SchedulerConfig {
                max_num_seqs: seqs,
                max_num_batched_tokens: budget,
                max_model_len: 1000,
                block_size: bs,
                num_blocks: nb,
                enable_prefix_caching: caching,
                max_waiting: 1000,
                max_loras: usize::MAX,
            },
            reqs: reqs
                .into_iter()
                .map(|(stem, stem_len, tail, max_tokens, arrive, abort_at)| {
                    let stem = (0..stem_len as i64).map(|i| 1 + ((i + 3 * stem as i64) * 7) % 12);
                    let mut prompt: Vec<i64> = stem.chain(tail).collect();
                    if prompt.is_empty() {
                        prompt.push(3);
                    }
                    ReqSpec { prompt, max_tokens, arrive, abort_at }
                })
                .collect(),
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_request_gets_what_it_gets_alone(w in workload()) {
        let o = run(&w).map_err(TestCaseError::fail)?;
        check_outputs(&w, &o.done).map_err(TestCaseError::fail)?;
    }
}

fn fixed(
    nb: usize,
    bs: usize,
    budget: usize,
    seqs: usize,
    caching: bool,
    prompts: &[Vec<i64>],
    max_tokens: usize,
) -> Workload {
    Workload {
        cfg: SchedulerConfig {
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            max_model_len: 1000,
            block_size: bs,
            num_blocks: nb,
            enable_prefix_caching: caching,
            max_waiting: 1000,
            max_loras: usize::MAX,
        },
        reqs: prompts.iter().map(|p| ReqSpec { prompt: p.clone(), max_tokens, arrive: 0, abort_at: None }).collect(),
    }
}

#[test]
fn a_tiny_cache_preempts_and_still_gives_every_request_its_tokens() {
    // Prompts whose generations avoid the end of sequence for 12 tokens, 6 of them in 8 blocks of 2.
    let prompts: Vec<Vec<i64>> =
        (0..200i64).map(|i| vec![i % 12 + 1, i / 12 + 1]).filter(|p| !alone(p, 12).contains(&EOS)).take(6).collect();
    assert_eq!(prompts.len(), 6);
    let w = fixed(8, 2, 16, 6, true, &prompts, 12);
    let o = run(&w).unwrap();
    check_outputs(&w, &o.done).unwrap();
    assert_eq!(o.done.len(), 6);
    assert!(o.preemptions > 0, "8 blocks for 6 sequences of 14 positions must preempt");
}

#[test]
fn shared_prefixes_hit_the_cache_and_give_the_same_tokens() {
    let stem: Vec<i64> = (1..=12).collect();
    let prompts: Vec<Vec<i64>> = (0..4).map(|i| stem.iter().copied().chain([i + 1]).collect()).collect();
    let mut w = fixed(64, 4, 64, 4, true, &prompts, 4);
    for (i, r) in w.reqs.iter_mut().enumerate() {
        r.arrive = i * 20; // one after another, so each finds the stem cached
    }
    let o = run(&w).unwrap();
    check_outputs(&w, &o.done).unwrap();
    assert_eq!(o.done.len(), 4);
    assert_eq!(o.prefix_hit_tokens, 3 * 12);
}
