//! `tp-bench --only pipeline`: the measured bubble of each pipeline schedule beside its formula,
//! on the thread backend, and a picture of one step's timeline per schedule.
//!
//! Each of `p` stages is a thread of one process running tp-train's executor (the same code as
//! `tp train`: the schedule's actions, real sends and receives of `[64, 64]` tensors over a
//! `LocalGroup`), with stand-in chunks of known cost: a forward sleeps `F`, an input gradient
//! `B`, a weight gradient `W` (a fused backward `B + W`). Sleeping rather than computing keeps
//! the stages from competing for this machine's two cores, so the figure is the schedule's and
//! the executor's, not the scheduler's. The bubble is `1 - Σ busy / (p × T)` with `T` the
//! longest stage's time through its list (as `tp train` logs it), the median of 3 steps; the
//! formula ([`bubble_formula`]) is the schedule's on paper for the same `F`, `B`, `W`.
//!
//! Also printed: the on-paper step of Llama-3-70B at TP 8 x PP 4 on H200s for each schedule.

use crate::{Args, Row};
use anyhow::{Context, Result};
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_models::Handoff;
use tp_train::pipeline::{Schedule, ScheduleKind, StageRunner, StageWork, TraceClock, bubble_formula, timeline_svg};

/// Costs of the stand-in chunks: forward, input gradient, weight gradient.
const F: Duration = Duration::from_millis(4);
const B: Duration = Duration::from_millis(4);
const W: Duration = Duration::from_millis(4);
/// Rows and columns of the tensors sent between stages.
const DIMS: [usize; 2] = [64, 64];

/// A chunk whose passes take a known time.
struct Sleeper {
    /// Whether it is the first and the last virtual stage.
    first: bool,
    last: bool,
    /// Weight gradients deferred and not yet run.
    deferred: usize,
}

impl StageWork for Sleeper {
    type Saved = ();
    fn forward(&mut self, _mb: usize, input: Option<Handoff>) -> tp_train::Result<(Option<Handoff>, f64, ())> {
        std::thread::sleep(F);
        let out = if self.last { None } else { Some(input.map_or_else(zeros, Ok)?) };
        Ok((out, 0.0, ()))
    }
    fn backward(&mut self, _mb: usize, _: (), dy: Option<Handoff>, defer: bool) -> tp_train::Result<Option<Handoff>> {
        std::thread::sleep(if defer { B } else { B + W });
        self.deferred += usize::from(defer);
        if self.first { Ok(None) } else { Ok(Some(dy.map_or_else(zeros, Ok)?)) }
    }
    fn backward_weight(&mut self) -> tp_train::Result<()> {
        self.deferred = self.deferred.saturating_sub(1);
        std::thread::sleep(W);
        Ok(())
    }
    fn activation(&self, _mb: usize) -> tp_train::Result<(Vec<usize>, DType)> {
        Ok((DIMS.to_vec(), DType::F32))
    }
}

fn zeros() -> tp_train::Result<Handoff> {
    Ok(Handoff { hidden: Tensor::zeros(&DIMS, DType::F32, &Device::Cpu)?, router_sums: None })
}

/// One step of `schedule` on `p` threads: the measured bubble and every rank's trace events.
fn step(schedule: &Schedule) -> Result<(f64, Vec<tp_train::pipeline::TraceEvent>)> {
    let p = schedule.stages;
    let v = schedule.virtual_stages;
    let groups = DeviceGroup::local(p, Duration::from_secs(60), |_| Device::Cpu)?;
    let origin = Instant::now();
    let results: Vec<tp_train::Result<tp_train::pipeline::StageStep>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let r = g.rank();
                    let mut chunks: Vec<Sleeper> = (0..v)
                        .map(|c| Sleeper { first: c == 0 && r == 0, last: c == v - 1 && r == p - 1, deferred: 0 })
                        .collect();
                    let trace = Some(TraceClock { rank: r, origin });
                    let out = StageRunner { chunks: &mut chunks, pp: &g, schedule, trace }.run(schedule.micro_batches);
                    if out.is_err() {
                        g.abort("this stage failed");
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a stage thread panicked")).collect()
    });
    let mut busy = 0.0;
    let mut wall: f64 = 0.0;
    let mut events = Vec::new();
    for r in results {
        let r = r.map_err(|e| anyhow::anyhow!("{e}"))?;
        busy += r.busy_secs();
        wall = wall.max(r.wall_secs);
        events.extend(r.events);
    }
    Ok((1.0 - busy / (p as f64 * wall), events))
}

/// The bubble rows, and one SVG timeline per schedule in `args.out`.
pub fn rows(args: &Args) -> Result<Vec<Row>> {
    let (f, b, w) = (F.as_secs_f64(), B.as_secs_f64(), W.as_secs_f64());
    let mut rows = Vec::new();
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    println!("pipeline bubble, thread backend, F = B = W = {:.0} ms (sleeping stand-in chunks):", 1e3 * f);
    println!("{:<12} {:>2} {:>3} {:>2} {:>10} {:>10} {:>7}", "schedule", "p", "m", "v", "measured", "formula", "diff");
    let kinds = [
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved1F1B, 2),
        (ScheduleKind::ZeroBubbleH1, 1),
    ];
    for (kind, v) in kinds {
        for p in [2, 4] {
            for m in [4, 8, 16] {
                let schedule = Schedule::new(kind, p, m, v).map_err(|e| anyhow::anyhow!("{e}"))?;
                let mut runs = Vec::new();
                let mut picture = None;
                for _ in 0..if args.quick { 1 } else { 3 } {
                    let (bubble, events) = step(&schedule)?;
                    runs.push(bubble);
                    picture.get_or_insert(events);
                }
                runs.sort_by(f64::total_cmp);
                let measured = runs[runs.len() / 2];
                let formula = bubble_formula(kind, p, m, v, f, b, w);
                println!(
                    "{:<12} {p:>2} {m:>3} {v:>2} {:>9.1}% {:>9.1}% {:>+6.1}",
                    kind.name(),
                    100.0 * measured,
                    100.0 * formula,
                    100.0 * (measured - formula)
                );
                if p == 4 && m == 8 {
                    let title = format!("{} p={p} m={m} v={v}: measured bubble {:.1}%", kind.name(), 100.0 * measured);
                    let path = args.out.join(format!("pipeline-{}.svg", kind.name()));
                    std::fs::write(&path, timeline_svg(picture.as_deref().unwrap_or(&[]), &title))
                        .with_context(|| format!("cannot write {}", path.display()))?;
                }
                rows.push(Row {
                    kind: "bubble",
                    name: format!("{} p={p} m={m} v={v}", kind.name()),
                    shape: format!("F=B=W={:.0}ms", 1e3 * f),
                    dtype: "-".into(),
                    ours: 100.0 * measured,
                    unit: "%",
                    baseline_name: "formula",
                    baseline: Some(100.0 * formula),
                    matched: Some((measured - formula).abs() <= 0.05),
                    roofline: None,
                    bound: None,
                });
            }
        }
    }
    on_paper_llama70b();
    Ok(rows)
}

/// Llama-3-70B at TP 8 x PP 4 on H200s, on paper: 80 layers (20 a stage), micro-batches of one
/// 4096-token sequence, 2·params·tokens FLOPs forward and twice that backward (split evenly
/// into input and weight gradients), at 40% of an H200's 989 dense bf16 TFLOP/s.
fn on_paper_llama70b() {
    let (params, tokens, tp, pp) = (70.6e9, 4096.0, 8.0, 4usize);
    let per_gpu = 0.40 * 989e12;
    let f = 2.0 * params * tokens / (tp * pp as f64) / per_gpu;
    let (b, w) = (f, f);
    println!("\nLlama-3-70B, TP 8 x PP 4 on H200s, on paper (F = {:.0} ms, B = W = F, 40% MFU):", 1e3 * f);
    for m in [8, 16, 32] {
        for (kind, v) in [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved1F1B, 5),
            (ScheduleKind::ZeroBubbleH1, 1),
        ] {
            let bubble = bubble_formula(kind, pp, m, v, f, b, w);
            let busy = m as f64 * (f + b + w);
            let step = busy / (1.0 - bubble);
            println!(
                "  m={m:>2} {:<12} v={v} bubble {:>5.1}%  step {:>6.2} s  {:>6.0} tokens/s per pipeline",
                kind.name(),
                100.0 * bubble,
                step,
                m as f64 * tokens / step
            );
        }
    }
}
