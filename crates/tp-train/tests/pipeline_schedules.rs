//! Pipeline schedules as data: every generated schedule passes the validator, the validator
//! refuses broken ones (naming the rank and why), and each schedule's simulated bubble is its
//! formula: GPipe and 1F1B `(p-1)/(m+p-1)`, interleaved `(p-1)/(v·m + p-1)` (Megatron's
//! `(p-1)/(v·m)` of the ideal time), ZB-H1 `(p-1)(F+B-W)` idle, below 1F1B's.

use tp_train::pipeline::{
    Action, Costs, Schedule, ScheduleError, ScheduleKind, bubble_formula, chrome_trace_json, simulate, timeline_svg,
    validate,
};

const EQUAL: Costs = Costs { forward: 1.0, input_grad: 1.0, weight_grad: 1.0 };

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

#[test]
fn every_generated_schedule_validates_and_runs_every_micro_batch_once() {
    let all = all_valid();
    for kind in ScheduleKind::ALL {
        assert!(all.iter().filter(|s| s.kind == kind).count() >= 20, "{}: too few schedules built", kind.name());
    }
    for s in &all {
        validate(s).unwrap();
        for (rank, list) in s.actions.iter().enumerate() {
            let forwards = list.iter().filter(|a| matches!(a, Action::Forward { .. })).count();
            assert_eq!(forwards, s.micro_batches * s.virtual_stages, "{:?} rank {rank}", s.kind);
            assert_eq!(list.last(), Some(&Action::OptimizerStep));
            let split = list.iter().any(|a| matches!(a, Action::BackwardInput { .. }));
            assert_eq!(split, s.kind == ScheduleKind::ZeroBubbleH1);
            if s.stages == 1 {
                assert!(list.iter().all(|a| a.compute_key().is_some() || *a == Action::OptimizerStep));
            }
        }
    }
}

#[test]
fn arguments_a_schedule_cannot_take_are_refused() {
    let e = |k, p, m, v| Schedule::new(k, p, m, v).unwrap_err().to_string();
    assert!(e(ScheduleKind::OneFOneB, 0, 4, 1).contains("at least 1"));
    assert!(e(ScheduleKind::OneFOneB, 2, 0, 1).contains("at least 1"));
    assert!(e(ScheduleKind::OneFOneB, 2, 4, 2).contains("interleaved"));
    assert!(e(ScheduleKind::Interleaved1F1B, 4, 6, 2).contains("multiple of the pipeline stages"));
    assert!(e(ScheduleKind::Interleaved1F1B, 1, 4, 2).contains("at least 2"));
    assert_eq!(ScheduleKind::parse("ZB-H1").unwrap(), ScheduleKind::ZeroBubbleH1);
    assert!(ScheduleKind::parse("zero").unwrap_err().contains("gpipe, 1f1b, interleaved or zb-h1"));
}

/// `s` with rank `rank`'s list changed by `f`.
fn broken(s: &Schedule, rank: usize, f: impl FnOnce(&mut Vec<Action>)) -> Schedule {
    let mut s = s.clone();
    f(&mut s.actions[rank]);
    s
}

#[test]
fn the_validator_refuses_broken_schedules_naming_the_rank_and_why() {
    let s = Schedule::new(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();
    let pos = |list: &[Action], a: Action| list.iter().position(|x| *x == a).unwrap();
    let msg = |r: Result<(), ScheduleError>| r.unwrap_err().to_string();

    // A missing receive: rank 1's forward of micro-batch 0 without its input.
    let b = broken(&s, 1, |l| {
        let i = pos(l, Action::RecvActivation { mb: 0, chunk: 0, peer: 0 });
        l.remove(i);
    });
    let e = msg(validate(&b));
    assert!(e.contains("rank 1"), "{e}");

    // Two receives swapped: FIFO order broken.
    let b = broken(&s, 2, |l| {
        let i = pos(l, Action::RecvActivation { mb: 0, chunk: 0, peer: 1 });
        let j = pos(l, Action::RecvActivation { mb: 1, chunk: 0, peer: 1 });
        l.swap(i, j);
    });
    let e = msg(validate(&b));
    assert!(e.contains("rank 2") && (e.contains("first in, first out") || e.contains("before")), "{e}");

    // A backward before its forward.
    let b = broken(&s, 0, |l| {
        let i = pos(l, Action::Backward { mb: 0, chunk: 0 });
        let a = l.remove(i);
        l.insert(0, a);
    });
    assert!(msg(validate(&b)).contains("backward before its forward"));

    // A send to the wrong peer.
    let b = broken(&s, 0, |l| {
        let i = pos(l, Action::SendActivation { mb: 0, chunk: 0, peer: 1 });
        l[i] = Action::SendActivation { mb: 0, chunk: 0, peer: 2 };
    });
    assert!(msg(validate(&b)).contains("peer is rank 1"));

    // A deadlock: rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's
    // activations... that rank 1 needs first (rank 1's warm-up takes two forwards).
    let s4 = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    let b = broken(&s4, 0, |l| {
        // Move rank 0's receive of mb 0's gradient before its forward of mb 1 (and its send).
        let r = pos(l, Action::RecvGrad { mb: 0, chunk: 0, peer: 1 });
        let a = l.remove(r);
        let f = pos(l, Action::Forward { mb: 1, chunk: 0 });
        l.insert(f, a);
    });
    assert!(msg(validate(&b)).contains("deadlock"), "{}", msg(validate(&b)));

    // A micro-batch never run; the optimizer step not last.
    let b = broken(&s, 2, |l| l.retain(|a| *a != Action::Backward { mb: 3, chunk: 0 }));
    assert!(msg(validate(&b)).contains("lacks"));
    let b = broken(&s, 1, |l| {
        let last = l.pop().unwrap();
        l.insert(0, last);
    });
    assert!(msg(validate(&b)).contains("after the optimizer step"));
}

#[test]
fn simulated_bubbles_equal_their_formulas() {
    for p in [1usize, 2, 3, 4, 8] {
        for m in 1..=16usize {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let s = Schedule::new(kind, p, m, 1).unwrap();
                let got = simulate(&s, EQUAL).bubble();
                let want = bubble_formula(kind, p, m, 1, 1.0, 1.0, 1.0);
                assert!((got - want).abs() < 1e-9, "{} p {p} m {m}: {got} vs {want}", kind.name());
            }
            // ZB-H1's formula holds for m >= p with equal costs.
            if m >= p {
                let s = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1).unwrap();
                let got = simulate(&s, EQUAL).bubble();
                let want = bubble_formula(ScheduleKind::ZeroBubbleH1, p, m, 1, 1.0, 1.0, 1.0);
                assert!((got - want).abs() < 1e-9, "zb-h1 p {p} m {m}: {got} vs {want}");
                if p > 1 {
                    let one = simulate(&Schedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap(), EQUAL).bubble();
                    assert!(got < one, "zb-h1 p {p} m {m}: {got} not below 1f1b's {one}");
                }
            }
            for v in [2usize, 3] {
                if p < 2 || m % p != 0 {
                    continue;
                }
                let s = Schedule::new(ScheduleKind::Interleaved1F1B, p, m, v).unwrap();
                let t = simulate(&s, EQUAL);
                let want = bubble_formula(ScheduleKind::Interleaved1F1B, p, m, v, 1.0, 1.0, 1.0);
                assert!((t.bubble() - want).abs() < 1e-9, "interleaved p {p} m {m} v {v}: {} vs {want}", t.bubble());
                // Each chunk is 1/v of the model: against 1F1B on the same model it is faster.
                let per_chunk =
                    Costs { forward: 1.0 / v as f64, input_grad: 1.0 / v as f64, weight_grad: 1.0 / v as f64 };
                let inter = simulate(&s, per_chunk).makespan();
                let one = simulate(&Schedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap(), EQUAL).makespan();
                assert!(inter < one, "interleaved p {p} m {m} v {v}: {inter} not below {one}");
            }
        }
    }
    // Unequal costs: 1F1B's bubble does not depend on them; ZB-H1's idle is (p-1)(F+B-W).
    let costs = Costs { forward: 1.0, input_grad: 1.5, weight_grad: 0.5 };
    let s = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
    let want = bubble_formula(ScheduleKind::OneFOneB, 4, 8, 1, 1.0, 1.5, 0.5);
    assert!((simulate(&s, costs).bubble() - want).abs() < 1e-9);
}

#[test]
fn one_f_one_b_keeps_at_most_p_minus_s_micro_batches_in_flight() {
    for p in [2, 3, 4, 8] {
        for m in [1, 4, 16] {
            for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
                let s = Schedule::new(kind, p, m, 1).unwrap();
                for (rank, list) in s.actions.iter().enumerate() {
                    let mut live = 0usize;
                    let mut peak = 0usize;
                    for a in list {
                        match a {
                            Action::Forward { .. } => live += 1,
                            Action::Backward { .. } | Action::BackwardInput { .. } => live -= 1,
                            _ => {}
                        }
                        peak = peak.max(live);
                    }
                    assert!(peak <= p - rank, "{} p {p} m {m} rank {rank}: {peak} in flight", kind.name());
                }
            }
            let g = Schedule::new(ScheduleKind::GPipe, p, m, 1).unwrap();
            let f = g.actions[0].iter().take_while(|a| !matches!(a, Action::Backward { .. }));
            assert_eq!(f.filter(|a| matches!(a, Action::Forward { .. })).count(), m, "gpipe runs every forward first");
        }
    }
}

#[test]
fn a_simulated_step_draws_as_a_trace_and_a_picture() {
    let s = Schedule::new(ScheduleKind::ZeroBubbleH1, 4, 8, 1).unwrap();
    let events = simulate(&s, EQUAL).to_trace();
    assert_eq!(events.len(), 4 * 8 * 3);
    let json: serde_json::Value = serde_json::from_str(&chrome_trace_json(&events)).unwrap();
    let list = json["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = list.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), events.len());
    assert_eq!(list.iter().filter(|e| e["ph"] == "M").count(), 4, "a process name per rank");
    for name in ["forward", "backward-input", "backward-weight"] {
        assert_eq!(complete.iter().filter(|e| e["name"] == name && e["pid"] == 3).count(), 8);
    }
    let svg = timeline_svg(&events, "zb-h1 <p=4> & m=8");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("&lt;p=4&gt; &amp; m=8"), "the title is escaped");
    // One rectangle per event plus the legend's six swatches; tags balanced.
    assert_eq!(svg.matches("<rect").count(), events.len() + 6);
    assert_eq!(svg.matches("<rect").count(), svg.matches("</rect>").count() + 6);
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
}
