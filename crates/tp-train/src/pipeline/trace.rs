//! A step's timeline as Chrome's trace-event JSON ([`chrome_trace_json`], for Perfetto or
//! chrome://tracing) and as an SVG picture ([`timeline_svg`]).

use serde_json::{Value, json};
use std::fmt::Write as _;

/// One thing a rank did, for the trace: a forward, a backward (or its halves), a wait for a
/// receive or for a send to be taken, an optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    /// The global rank (the trace's process).
    pub rank: usize,
    /// The pipeline stage (rank in the pipeline group).
    pub stage: usize,
    /// `forward`, `backward`, `backward-input`, `backward-weight`, `recv-wait`, `send-wait` or
    /// `optimizer`.
    pub name: String,
    /// The micro-batch, if the event has one.
    pub mb: Option<usize>,
    /// The model chunk on the rank, if the event has one.
    pub chunk: Option<usize>,
    /// Start, microseconds from the trace's origin.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

/// Chrome's trace-event format: `{"traceEvents": [...], "displayTimeUnit": "ms"}`, one complete
/// event (`ph: "X"`, `ts` and `dur` in microseconds, `pid` the rank, `args` with the stage,
/// micro-batch and chunk) per [`TraceEvent`], and a `process_name` metadata event per rank.
pub fn chrome_trace_json(events: &[TraceEvent]) -> String {
    let mut ranks: Vec<(usize, usize)> = events.iter().map(|e| (e.rank, e.stage)).collect();
    ranks.sort_unstable();
    ranks.dedup_by_key(|r| r.0);
    let mut out: Vec<Value> = ranks
        .iter()
        .map(|&(rank, stage)| {
            json!({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                   "args": {"name": format!("rank {rank} (stage {stage})")}})
        })
        .collect();
    out.extend(events.iter().map(|e| {
        json!({
            "name": e.name, "cat": "pipeline", "ph": "X", "ts": e.start_us, "dur": e.dur_us, "pid": e.rank, "tid": 0,
            "args": {"stage": e.stage, "mb": e.mb, "chunk": e.chunk},
        })
    }));
    json!({"traceEvents": out, "displayTimeUnit": "ms"}).to_string()
}

/// The fill colour of an event kind.
fn colour(name: &str) -> &'static str {
    match name {
        "forward" => "#4e79a7",
        "backward" => "#e15759",
        "backward-input" => "#f28e2b",
        "backward-weight" => "#59a14f",
        "optimizer" => "#b07aa1",
        _ => "#c8c8c8",
    }
}

/// `s` with XML's special characters escaped.
fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A self-contained SVG of `events`: one row per rank, a rectangle per event coloured by kind
/// (forward, backward, its input and weight halves, optimizer; waits in grey) with the
/// micro-batch written inside when it fits, a time axis in milliseconds and a legend.
pub fn timeline_svg(events: &[TraceEvent], title: &str) -> String {
    let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let t0 = events.iter().map(|e| e.start_us).fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let t1 = events.iter().map(|e| e.start_us + e.dur_us).fold(t0, f64::max);
    let span = (t1 - t0).max(1.0);
    let (left, width, row, top) = (90.0, 1000.0, 28.0, 40.0);
    let height = top + row * ranks.len() as f64 + 70.0;
    let x = |us: f64| left + (us - t0) / span * width;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
        left + width + 20.0
    );
    let _ = write!(s, r#"<text x="{left}" y="20" font-size="14">{}</text>"#, xml(title));
    for (i, r) in ranks.iter().enumerate() {
        let y = top + row * i as f64;
        let stage = events.iter().find(|e| e.rank == *r).map_or(0, |e| e.stage);
        let _ = write!(s, r#"<text x="4" y="{}">rank {r} (stage {stage})</text>"#, y + row * 0.6);
        for e in events.iter().filter(|e| e.rank == *r) {
            let (x0, w) = (x(e.start_us), (e.dur_us / span * width).max(0.5));
            let wait = e.name.ends_with("-wait");
            let (h, dy) = if wait { (row * 0.3, row * 0.55) } else { (row * 0.8, row * 0.05) };
            let _ = write!(
                s,
                r#"<rect x="{x0:.2}" y="{:.2}" width="{w:.2}" height="{h:.2}" fill="{}" stroke="white" stroke-width="0.5"><title>{}</title></rect>"#,
                y + dy,
                colour(&e.name),
                xml(&format!("{} mb {:?} chunk {:?}: {:.0} us", e.name, e.mb, e.chunk, e.dur_us))
            );
            if let (Some(mb), false) = (e.mb, wait)
                && w >= 14.0
            {
                let _ = write!(
                    s,
                    r#"<text x="{:.2}" y="{:.2}" fill="white" text-anchor="middle">{mb}</text>"#,
                    x0 + w / 2.0,
                    y + row * 0.6
                );
            }
        }
    }
    // Time axis.
    let axis_y = top + row * ranks.len() as f64 + 10.0;
    let _ = write!(s, r#"<line x1="{left}" y1="{axis_y}" x2="{}" y2="{axis_y}" stroke="black"/>"#, left + width);
    for k in 0..=5 {
        let us = t0 + span * f64::from(k) / 5.0;
        let xx = x(us);
        let _ = write!(
            s,
            r#"<line x1="{xx:.2}" y1="{axis_y}" x2="{xx:.2}" y2="{}" stroke="black"/><text x="{xx:.2}" y="{}" text-anchor="middle">{:.1} ms</text>"#,
            axis_y + 4.0,
            axis_y + 16.0,
            (us - t0) / 1e3
        );
    }
    // Legend.
    let ly = axis_y + 34.0;
    for (i, name) in
        ["forward", "backward", "backward-input", "backward-weight", "optimizer", "wait"].iter().enumerate()
    {
        let lx = left + 150.0 * i as f64;
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{name}</text>"#,
            ly - 10.0,
            colour(name),
            lx + 16.0,
            ly
        );
    }
    s.push_str("</svg>\n");
    s
}
