//! Pipeline schedules as data: every generated schedule passes the validator and keeps the
//! action rules; the validator refuses broken ones, naming the rank, the action and why; each
//! schedule's simulated bubble is its formula (GPipe and 1F1B `(p-1)/(m+p-1)`, interleaved
//! `(p-1)/(v·m+p-1)` = Megatron's `(p-1)/(v·m)` of the ideal time, ZB-H1 idle `(p-1)(F+B-W)`
//! per rank at equal costs and `m >= p`, below 1F1B's); the memory bounds hold; a simulated
//! step draws as Chrome trace JSON and as SVG.

use std::collections::HashMap;
use tp_train::pipeline::{
    Action, Costs, Schedule, ScheduleKind, TraceEvent, bubble_formula, chrome_trace_json, simulate, timeline_svg,
    validate,
};

const EQUAL: Costs = Costs { forward: 1.0, input_grad: 1.0, weight_grad: 1.0 };

/// Every schedule `Schedule::new` builds at p in {1,2,3,4,8}, m in 1..=16, v in {1,2,3}.
fn all_valid() -> Vec<Schedule> {
    let mut out = Vec::new();
    for kind in ScheduleKind::ALL {
        for p in [1, 2, 3, 4, 8] {
            for m in 1..=16 {
                for v in [1, 2, 3] {
                    if let Ok(s) = Schedule::new(kind, p, m, v) {
                        out.push(s);
                    }
                }
            }
        }
    }
    out
}

fn is_recv(a: &Action) -> bool {
    matches!(a, Action::RecvActivation { .. } | Action::RecvGrad { .. })
}

/// The compute that consumes a receive's message.
fn consumer(a: &Action) -> Option<(bool, usize, usize)> {
    match *a {
        Action::RecvActivation { mb, chunk, .. } => Some((true, mb, chunk)),
        Action::RecvGrad { mb, chunk, .. } => Some((false, mb, chunk)),
        _ => None,
    }
}

fn label(s: &Schedule) -> String {
    format!("{} p {} m {} v {}", s.kind.name(), s.stages, s.micro_batches, s.virtual_stages)
}

#[test]
fn every_generated_schedule_validates_and_keeps_the_action_rules() {
    let all = all_valid();
    for kind in ScheduleKind::ALL {
        assert!(all.iter().filter(|s| s.kind == kind).count() >= 20, "{}: too few schedules built", kind.name());
    }
    for s in &all {
        validate(s).unwrap();
        let (p, v) = (s.stages, s.virtual_stages);
        assert_eq!(s.actions.len(), p);
        for (rank, list) in s.actions.iter().enumerate() {
            let at = format!("{} rank {rank}", label(s));
            assert_eq!(s.rank_actions(rank), list.as_slice());
            let forwards = list.iter().filter(|a| matches!(a, Action::Forward { .. })).count();
            assert_eq!(forwards, s.micro_batches * v, "{at}");
            assert_eq!(list.last(), Some(&Action::OptimizerStep), "{at}");
            assert_eq!(list.iter().filter(|a| **a == Action::OptimizerStep).count(), 1, "{at}");
            let split = list.iter().any(|a| matches!(a, Action::BackwardInput { .. }));
            let whole = list.iter().any(|a| matches!(a, Action::Backward { .. }));
            assert_eq!((split, whole), (s.kind == ScheduleKind::ZeroBubbleH1, s.kind != ScheduleKind::ZeroBubbleH1));
            if p == 1 {
                assert!(list.iter().all(|a| a.compute_key().is_some() || *a == Action::OptimizerStep), "{at}");
            }
            for (i, a) in list.iter().enumerate() {
                match *a {
                    // Each send right after the compute that produced it.
                    Action::SendActivation { mb, chunk, .. } => {
                        assert_eq!(list[i - 1], Action::Forward { mb, chunk }, "{at} action {i}")
                    }
                    Action::SendGrad { mb, chunk, .. } => {
                        assert!(
                            list[i - 1] == Action::Backward { mb, chunk }
                                || list[i - 1] == Action::BackwardInput { mb, chunk },
                            "{at} action {i}"
                        );
                        assert!(chunk * p + rank > 0, "{at}: the first virtual stage sends no gradient");
                    }
                    Action::RecvGrad { chunk, .. } => {
                        assert!(chunk * p + rank < p * v - 1, "{at}: the last virtual stage receives no gradient")
                    }
                    _ => {}
                }
                // Each receive right before the compute that needs it (after any receives that
                // compute also needs).
                if let Some((activation, mb, chunk)) = consumer(a) {
                    let next = list[i..].iter().find(|b| !is_recv(b)).unwrap();
                    let want = if activation {
                        vec![Action::Forward { mb, chunk }]
                    } else {
                        vec![Action::Backward { mb, chunk }, Action::BackwardInput { mb, chunk }]
                    };
                    assert!(want.contains(next), "{at} action {i}: {a:?} is followed by {next:?}");
                }
            }
        }
    }
}

#[test]
fn arguments_a_schedule_cannot_take_are_refused_naming_the_argument() {
    let e = |k, p, m, v| Schedule::new(k, p, m, v).unwrap_err().to_string();
    assert_eq!(e(ScheduleKind::OneFOneB, 0, 4, 1), "stages must be at least 1 (got 0)");
    assert_eq!(e(ScheduleKind::GPipe, 2, 0, 1), "micro_batches must be at least 1 (got 0)");
    assert_eq!(e(ScheduleKind::Interleaved1F1B, 2, 4, 0), "virtual_stages must be at least 1 (got 0)");
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
        let msg = e(kind, 2, 4, 2);
        assert!(msg.contains("virtual_stages 2 needs the interleaved schedule"), "{msg}");
    }
    let msg = e(ScheduleKind::Interleaved1F1B, 4, 6, 2);
    assert!(msg.contains("micro_batches (6) to be a multiple of stages (4)") && msg.contains("Megatron-LM"), "{msg}");
    assert!(e(ScheduleKind::Interleaved1F1B, 1, 4, 2).contains("at least 2 stages"));
    for kind in ScheduleKind::ALL {
        assert_eq!(ScheduleKind::parse(kind.name()).unwrap(), kind);
    }
    assert_eq!(ScheduleKind::parse(" ZB-H1 ").unwrap(), ScheduleKind::ZeroBubbleH1);
    assert!(ScheduleKind::parse("zero").unwrap_err().contains("gpipe, 1f1b, interleaved or zb-h1"));
}

/// Megatron-LM's interleaved order, Qi et al.'s ZB-H1 order, and the virtual-stage mapping of
/// the messages, written out.
#[test]
fn the_orders_and_the_virtual_stage_mapping_are_the_published_ones() {
    let computes = |s: &Schedule, rank: usize| -> Vec<Action> {
        s.rank_actions(rank).iter().copied().filter(|a| a.compute_key().is_some()).collect()
    };
    let (f, b) = (|mb, chunk| Action::Forward { mb, chunk }, |mb, chunk| Action::Backward { mb, chunk });
    // p = 2, v = 2, m = 4, rank 0: warm-up 2(p-1) + (v-1)p = 4 forwards in groups of p
    // micro-batches per chunk, then one forward one backward, backwards with chunks reversed.
    let s = Schedule::new(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap();
    let want = [
        f(0, 0),
        f(1, 0),
        f(0, 1),
        f(1, 1),
        f(2, 0),
        b(0, 1),
        f(3, 0),
        b(1, 1),
        f(2, 1),
        b(0, 0),
        f(3, 1),
        b(1, 0),
        b(2, 1),
        b(3, 1),
        b(2, 0),
        b(3, 0),
    ];
    assert_eq!(computes(&s, 0), want);
    // Rank 1's chunk 0 (virtual stage 1) feeds rank 0's chunk 1 (virtual stage 2); rank 0's
    // chunk 1 sends its input gradient back to rank 1's chunk 0; rank 1's chunk 1 is the last
    // stage (no gradient received), rank 0's chunk 0 the first (no gradient sent).
    let r1 = s.rank_actions(1);
    assert!(r1.contains(&Action::SendActivation { mb: 0, chunk: 0, peer: 0 }));
    assert!(s.rank_actions(0).contains(&Action::RecvActivation { mb: 0, chunk: 1, peer: 1 }));
    assert!(s.rank_actions(0).contains(&Action::SendGrad { mb: 0, chunk: 1, peer: 1 }));
    assert!(r1.contains(&Action::RecvGrad { mb: 0, chunk: 0, peer: 0 }));
    assert!(
        !r1.iter().any(|a| matches!(a, Action::RecvGrad { chunk: 1, .. } | Action::SendActivation { chunk: 1, .. }))
    );
    assert!(!s.rank_actions(0).iter().any(|a| matches!(a, Action::SendGrad { chunk: 0, .. })));

    // ZB-H1, p = 4, m = 6: 1F1B's forwards and input gradients; rank s holds back s weight
    // gradients (rank 0 none, the last rank p - 1).
    let s = Schedule::new(ScheduleKind::ZeroBubbleH1, 4, 6, 1).unwrap();
    let short = |a: &Action| match *a {
        Action::Forward { mb, .. } => format!("F{mb}"),
        Action::BackwardInput { mb, .. } => format!("B{mb}"),
        Action::BackwardWeight { mb, .. } => format!("W{mb}"),
        other => panic!("{other:?}"),
    };
    let order = |rank| computes(&s, rank).iter().map(short).collect::<Vec<_>>().join(" ");
    assert_eq!(order(0), "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5");
    assert_eq!(order(1), "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5");
    assert_eq!(order(3), "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5");
}

/// `s` with rank `rank`'s list changed by `f`.
fn broken(s: &Schedule, rank: usize, f: impl FnOnce(&mut Vec<Action>)) -> Schedule {
    let mut s = s.clone();
    f(&mut s.actions[rank]);
    s
}

fn pos(list: &[Action], a: Action) -> usize {
    list.iter().position(|x| *x == a).unwrap_or_else(|| panic!("{a:?} not in {list:?}"))
}

fn refusal(s: &Schedule) -> String {
    validate(s).unwrap_err().to_string()
}

#[test]
fn the_validator_refuses_broken_schedules_naming_the_rank_the_action_and_why() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();

    // A missing receive: rank 1's forward of micro-batch 0 runs without its input.
    let b = broken(&s, 1, |l| {
        l.remove(pos(l, Action::RecvActivation { mb: 0, chunk: 0, peer: 0 }));
    });
    let e = refusal(&b);
    assert!(e.starts_with("rank 1, action 0 (Forward { mb: 0, chunk: 0 })") && e.contains("input activation"), "{e}");

    // Two receives swapped: first in, first out broken.
    let b = broken(&s, 2, |l| {
        let (i, j) = (
            pos(l, Action::RecvActivation { mb: 0, chunk: 0, peer: 1 }),
            pos(l, Action::RecvActivation { mb: 1, chunk: 0, peer: 1 }),
        );
        l.swap(i, j);
    });
    let e = refusal(&b);
    assert!(
        e.starts_with("rank 2, action 0 (RecvActivation { mb: 1, chunk: 0, peer: 1 })")
            && e.contains("the next message from rank 1 is the activation of micro-batch 0")
            && e.contains("first in, first out"),
        "{e}"
    );

    // A backward before its forward.
    let b = broken(&s, 0, |l| {
        let a = l.remove(pos(l, Action::Backward { mb: 0, chunk: 0 }));
        l.insert(0, a);
    });
    let e = refusal(&b);
    assert!(e.starts_with("rank 0, action 0 (Backward { mb: 0, chunk: 0 }): a backward before its forward"), "{e}");

    // A send before the compute that produces it.
    let b = broken(&s, 0, |l| {
        let a = l.remove(pos(l, Action::SendActivation { mb: 1, chunk: 0, peer: 1 }));
        l.insert(0, a);
    });
    let e = refusal(&b);
    assert!(e.starts_with("rank 0, action 0") && e.contains("before the forward that produces it"), "{e}");

    // A deadlock cycle: with GPipe at p = 2, rank 0 waits for micro-batch 0's gradient before
    // its forward of micro-batch 1, whose activation rank 1 needs before it can run any
    // backward.
    let g = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    let b = broken(&g, 0, |l| {
        let a = l.remove(pos(l, Action::RecvGrad { mb: 0, chunk: 0, peer: 1 }));
        l.insert(pos(l, Action::Forward { mb: 1, chunk: 0 }), a);
    });
    let e = refusal(&b);
    assert!(
        e.starts_with(concat!(
            "deadlock: rank 0 waits at action 2 (RecvGrad { mb: 0, chunk: 0, peer: 1 }); ",
            "rank 1 waits at action 2 (RecvActivation { mb: 1, chunk: 0, peer: 0 })"
        )),
        "{e}"
    );

    // A send to the wrong peer; one past the last virtual stage; one the receiver never takes.
    let b = broken(&s, 0, |l| {
        let i = pos(l, Action::SendActivation { mb: 0, chunk: 0, peer: 1 });
        l[i] = Action::SendActivation { mb: 0, chunk: 0, peer: 2 };
    });
    assert!(refusal(&b).contains("sends an activation to rank 2, but that stage's peer is rank 1"));
    let b = broken(&s, 2, |l| l.insert(1, Action::SendActivation { mb: 0, chunk: 0, peer: 0 }));
    assert!(refusal(&b).contains("virtual stage 2 has no such neighbour"), "{}", refusal(&b));
    let b = broken(&s, 2, |l| {
        let i = pos(l, Action::Backward { mb: 3, chunk: 0 });
        l.insert(i + 1, Action::SendGrad { mb: 3, chunk: 0, peer: 1 });
    });
    let e = refusal(&b);
    assert!(
        e.contains("rank 2, action") && e.contains("sends the gradient of micro-batch 3 for chunk 0 that rank 1"),
        "{e}"
    );

    // Out of range, run twice, never run, split in the wrong kind, the optimizer step not last.
    let b = broken(&s, 0, |l| l.insert(0, Action::Forward { mb: 4, chunk: 0 }));
    assert!(refusal(&b).contains("micro-batch 4 is out of range (there are 4)"));
    let b = broken(&s, 0, |l| l.insert(0, Action::Forward { mb: 0, chunk: 1 }));
    assert!(refusal(&b).contains("chunk 1 is out of range (there are 1 per rank)"));
    let b = broken(&s, 0, |l| l.insert(1, Action::Forward { mb: 0, chunk: 0 }));
    assert!(refusal(&b).starts_with("rank 0, action 1 (Forward { mb: 0, chunk: 0 }): runs twice"));
    let b = broken(&s, 2, |l| l.retain(|a| *a != Action::Backward { mb: 3, chunk: 0 }));
    assert!(refusal(&b).contains("micro-batch 3 of chunk 0 has no backward"));
    let b = broken(&s, 2, |l| {
        let i = pos(l, Action::Backward { mb: 3, chunk: 0 });
        l[i] = Action::BackwardInput { mb: 3, chunk: 0 };
    });
    assert!(refusal(&b).contains("a split backward in 1f1b"));
    let b = broken(&s, 1, |l| {
        let last = l.pop().unwrap();
        l.insert(0, last);
    });
    assert!(refusal(&b).contains("comes after the optimizer step"));

    // ZB-H1: a weight gradient before its input gradient; one missing.
    let z = Schedule::new(ScheduleKind::ZeroBubbleH1, 2, 2, 1).unwrap();
    let b = broken(&z, 1, |l| {
        let a = l.remove(pos(l, Action::BackwardWeight { mb: 0, chunk: 0 }));
        l.insert(pos(l, Action::BackwardInput { mb: 0, chunk: 0 }), a);
    });
    assert!(refusal(&b).contains("a weight gradient before its input gradient"));
    let b = broken(&z, 1, |l| l.retain(|a| *a != Action::BackwardWeight { mb: 1, chunk: 0 }));
    assert!(refusal(&b).contains("micro-batch 1 of chunk 0 has no weight gradient"));

    // Interleaved: a receive naming the sender's chunk instead of its own.
    let s = Schedule::new(ScheduleKind::Interleaved1F1B, 2, 2, 2).unwrap();
    let b = broken(&s, 0, |l| {
        let i = pos(l, Action::RecvActivation { mb: 0, chunk: 1, peer: 1 });
        l[i] = Action::RecvActivation { mb: 0, chunk: 0, peer: 1 };
    });
    assert!(refusal(&b).contains("receives an activation from rank 1, but virtual stage 0 has no such neighbour"));
    let mut b = s.clone();
    b.actions.pop();
    assert!(refusal(&b).contains("1 ranks' lists for 2 stages"));
}

/// Deterministic costs in [0.1, 3.1).
fn costs(seed: u64, n: usize) -> Vec<(f64, f64, f64)> {
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        0.1 + (x >> 33) as f64 / (1u64 << 31) as f64 * 3.0
    };
    (0..n).map(|_| (next(), next(), next())).collect()
}

/// The simulated bubble of `s` with costs `(f, b, w)` per layer group (each of `v` chunks costs
/// `1/v` of them), and its formula.
fn simulated_and_formula(s: &Schedule, (f, b, w): (f64, f64, f64)) -> (f64, f64) {
    let v = s.virtual_stages as f64;
    let c = Costs { forward: f / v, input_grad: b / v, weight_grad: w / v };
    let got = simulate(s, c).bubble();
    (got, bubble_formula(s.kind, s.stages, s.micro_batches, s.virtual_stages, c.forward, c.input_grad, c.weight_grad))
}

#[test]
fn simulated_bubbles_equal_their_formulas_at_equal_costs() {
    let all = all_valid();
    for s in &all {
        let (got, want) = simulated_and_formula(s, (1.0, 1.0, 1.0));
        assert!((got - want).abs() < 1e-9, "{}: simulated {got} vs formula {want}", label(s));
    }
    // The formulas at equal costs, written out.
    let (p, m) = (4.0, 8.0);
    assert!((bubble_formula(ScheduleKind::GPipe, 4, 8, 1, 1.0, 1.0, 1.0) - (p - 1.0) / (m + p - 1.0)).abs() < 1e-12);
    let megatron = (p - 1.0) / (2.0 * m);
    assert!(
        (bubble_formula(ScheduleKind::Interleaved1F1B, 4, 8, 2, 1.0, 1.0, 1.0) - megatron / (1.0 + megatron)).abs()
            < 1e-12
    );
    let (idle, busy) = ((p - 1.0) * (1.0 + 1.0 - 1.0), m * 3.0);
    assert!((bubble_formula(ScheduleKind::ZeroBubbleH1, 4, 8, 1, 1.0, 1.0, 1.0) - idle / (idle + busy)).abs() < 1e-12);
}

#[test]
fn simulated_bubbles_equal_their_formulas_at_unequal_costs() {
    let all = all_valid();
    for (k, c) in costs(7, 12).into_iter().chain([(1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (1.0, 1.0, 2.0)]).enumerate() {
        for s in &all {
            let (got, want) = simulated_and_formula(s, c);
            assert!((got - want).abs() < 1e-9, "{} costs #{k} {c:?}: simulated {got} vs formula {want}", label(s));
        }
    }
    // ZB-H1 over more costs (its formula's terms change with their order).
    for c in costs(99, 200) {
        for p in [2, 3, 4, 8] {
            for m in 1..=16 {
                let s = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1).unwrap();
                let (got, want) = simulated_and_formula(&s, c);
                assert!((got - want).abs() < 1e-9, "{} {c:?}: simulated {got} vs formula {want}", label(&s));
            }
        }
    }
}

#[test]
fn zero_bubble_idles_less_than_1f1b_and_interleaved_finishes_first() {
    for p in [2usize, 3, 4, 8] {
        for m in 1..=16usize {
            let one = simulate(&Schedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap(), EQUAL);
            let zb = simulate(&Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1).unwrap(), EQUAL);
            assert!(zb.bubble() < one.bubble(), "p {p} m {m}: zb-h1 {} vs 1f1b {}", zb.bubble(), one.bubble());
            assert!(zb.makespan() < one.makespan());
            if m >= p {
                // A third of 1F1B's idle time per rank.
                let idle = |t: &tp_train::pipeline::Timeline| t.makespan() - 3.0 * m as f64;
                assert!((3.0 * idle(&zb) - idle(&one)).abs() < 1e-9, "p {p} m {m}");
            }
            if m % p != 0 {
                continue;
            }
            for v in [2usize, 3] {
                // Each chunk is 1/v of the rank's layers.
                let s = Schedule::new(ScheduleKind::Interleaved1F1B, p, m, v).unwrap();
                let c = 1.0 / v as f64;
                let inter = simulate(&s, Costs { forward: c, input_grad: c, weight_grad: c }).makespan();
                assert!(inter < one.makespan(), "p {p} m {m} v {v}: {inter} not below {}", one.makespan());
                assert!(((one.makespan() - 3.0 * m as f64) / v as f64 - (inter - 3.0 * m as f64)).abs() < 1e-9);
            }
        }
    }
    // With one stage nothing idles.
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
        assert_eq!(simulate(&Schedule::new(kind, 1, 5, 1).unwrap(), EQUAL).bubble(), 0.0);
    }
}

/// The most micro-batches between `opened` and `closed` on one rank's list.
fn peak(list: &[Action], opened: impl Fn(&Action) -> bool, closed: impl Fn(&Action) -> bool) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for a in list {
        if opened(a) {
            live += 1;
        }
        if closed(a) {
            live -= 1;
        }
        peak = peak.max(live);
    }
    peak
}

#[test]
fn the_memory_bounds_hold() {
    let fwd = |a: &Action| matches!(a, Action::Forward { .. });
    let bwd = |a: &Action| matches!(a, Action::Backward { .. } | Action::BackwardInput { .. });
    let wgt = |a: &Action| matches!(a, Action::Backward { .. } | Action::BackwardWeight { .. });
    for p in [1usize, 2, 3, 4, 8] {
        for m in 1..=16usize {
            let one = Schedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap();
            let zb = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1).unwrap();
            let g = Schedule::new(ScheduleKind::GPipe, p, m, 1).unwrap();
            for s in 0..p {
                // 1F1B: at most p - s micro-batches in flight on rank s.
                assert_eq!(peak(one.rank_actions(s), fwd, bwd), (p - s).min(m), "1f1b p {p} m {m} rank {s}");
                // ZB-H1: 1F1B's between forward and input gradient; up to p (1F1B's peak, rank
                // 0's) until the weight gradient.
                assert!(peak(zb.rank_actions(s), fwd, bwd) <= p - s, "zb-h1 p {p} m {m} rank {s}");
                assert_eq!(peak(zb.rank_actions(s), fwd, wgt), p.min(m), "zb-h1 p {p} m {m} rank {s}");
                // The weight gradients in the input gradients' micro-batch order.
                let order =
                    |pick: fn(&Action) -> Option<usize>| zb.rank_actions(s).iter().filter_map(pick).collect::<Vec<_>>();
                let bs = order(|a| if let Action::BackwardInput { mb, .. } = a { Some(*mb) } else { None });
                let ws = order(|a| if let Action::BackwardWeight { mb, .. } = a { Some(*mb) } else { None });
                assert_eq!(bs, ws);
                // GPipe holds every micro-batch.
                assert_eq!(peak(g.rank_actions(s), fwd, bwd), m);
            }
            if m % p == 0 && p > 1 {
                for v in [2usize, 3] {
                    let s = Schedule::new(ScheduleKind::Interleaved1F1B, p, m, v).unwrap();
                    for r in 0..p {
                        let warm = (2 * (p - r - 1) + (v - 1) * p).min(m * v);
                        assert!(
                            peak(s.rank_actions(r), fwd, bwd) <= warm + 1,
                            "interleaved p {p} m {m} v {v} rank {r}"
                        );
                    }
                }
            }
        }
    }
}

/// Checks that `svg` is well-formed XML as far as tags go (every opened tag closed in order,
/// attributes quoted, no stray `<` or `&`), and returns each element's count by name.
fn xml_elements(svg: &str) -> HashMap<String, usize> {
    let mut stack: Vec<String> = Vec::new();
    let mut counts = HashMap::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        let text = &rest[..open];
        for (i, _) in text.match_indices('&') {
            let entity = &text[i..];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].iter().any(|e| entity.starts_with(e)),
                "bare & in {text:?}"
            );
        }
        let close = rest[open..].find('>').expect("unclosed tag") + open;
        let tag = &rest[open + 1..close];
        assert!(!tag.contains('<'), "stray < in {tag:?}");
        assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes in {tag:?}");
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop().as_deref(), Some(name.trim()), "mismatched </{name}>");
        } else if !tag.starts_with('?') && !tag.starts_with('!') {
            let name = tag.split(|c: char| c.is_whitespace() || c == '/').next().unwrap().to_string();
            *counts.entry(name.clone()).or_insert(0) += 1;
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
        rest = &rest[close + 1..];
    }
    assert!(stack.is_empty(), "unclosed {stack:?}");
    assert!(rest.trim().is_empty());
    counts
}

#[test]
fn a_simulated_step_draws_as_chrome_trace_json_and_as_svg() {
    let s = Schedule::new(ScheduleKind::ZeroBubbleH1, 4, 8, 1).unwrap();
    let events = simulate(&s, EQUAL).to_trace();
    let waits = events.iter().filter(|e| e.name == "recv-wait").count();
    assert_eq!(events.len() - waits, 4 * 8 * 3, "a forward, input and weight gradient per micro-batch and rank");
    assert!(waits > 0 && events.iter().filter(|e| e.name == "recv-wait").all(|e| e.dur_us > 0.0));
    // The equal-cost step: F = B = W = 1 "ms"; the first forward of rank 3 starts at 3 ms.
    let first = events.iter().find(|e| e.rank == 3 && e.name == "forward").unwrap();
    assert_eq!((first.start_us, first.dur_us, first.mb, first.chunk), (3000.0, 1000.0, Some(0), Some(0)));

    let json: serde_json::Value = serde_json::from_str(&chrome_trace_json(&events)).unwrap();
    assert_eq!(json["displayTimeUnit"], "ms");
    let list = json["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = list.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), events.len());
    for (e, t) in complete.iter().zip(&events) {
        assert_eq!(e["name"], t.name.as_str());
        assert_eq!((e["ts"].as_f64(), e["dur"].as_f64()), (Some(t.start_us), Some(t.dur_us)));
        assert_eq!((e["pid"].as_u64(), e["tid"].as_u64()), (Some(t.rank as u64), Some(0)));
        assert_eq!(e["args"]["stage"].as_u64(), Some(t.stage as u64));
        assert_eq!(e["args"]["mb"].as_u64(), t.mb.map(|x| x as u64));
        assert_eq!(e["args"]["chunk"].as_u64(), t.chunk.map(|x| x as u64));
    }
    let names: Vec<_> = list.iter().filter(|e| e["ph"] == "M").map(|e| e["args"]["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["rank 0 (stage 0)", "rank 1 (stage 1)", "rank 2 (stage 2)", "rank 3 (stage 3)"]);
    for name in ["forward", "backward-input", "backward-weight"] {
        assert_eq!(complete.iter().filter(|e| e["name"] == name && e["pid"] == 3).count(), 8);
    }

    // Names that need escaping, and events without a micro-batch.
    let odd = TraceEvent {
        rank: 9,
        stage: 1,
        name: "opt \"x\" \\ <&>\n".into(),
        mb: None,
        chunk: None,
        start_us: 1.5,
        dur_us: 2.0,
    };
    let json: serde_json::Value = serde_json::from_str(&chrome_trace_json(std::slice::from_ref(&odd))).unwrap();
    let x = json["traceEvents"].as_array().unwrap().iter().find(|e| e["ph"] == "X").unwrap().clone();
    assert_eq!(x["name"], odd.name.as_str());
    assert!(x["args"]["mb"].is_null() && x["args"]["chunk"].is_null());

    let svg = timeline_svg(&events, "zb-h1 <p=4> & m=8");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("&lt;p=4&gt; &amp; m=8"), "the title is escaped");
    let counts = xml_elements(&svg);
    // One rectangle per event plus the legend's six swatches.
    assert_eq!(counts["rect"], events.len() + 6);
    assert_eq!(counts["svg"], 1);
    for kind in ["forward", "backward-input", "backward-weight", "wait", " ms<"] {
        assert!(svg.contains(kind), "{kind}");
    }
    let mut with_odd = events.clone();
    with_odd.push(odd);
    let counts = xml_elements(&timeline_svg(&with_odd, ""));
    assert_eq!(counts["rect"], with_odd.len() + 6);
    xml_elements(&timeline_svg(&[], "empty"));
}
