//! `GET /metrics`: the engine's figures, the server's time-to-first-token histogram and the
//! structured-output mask time per token, in Prometheus' text format.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use tp_engine::api::Stats;

/// Upper bounds of the time-to-first-token buckets, in seconds (vLLM's).
const TTFT_BUCKETS: [f64; 18] =
    [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0];

/// Upper bounds of the mask-time buckets, in seconds.
const MASK_BUCKETS: [f64; 18] =
    [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5];

/// A cumulative histogram over `N` bucket bounds.
#[derive(Debug)]
struct Histogram<const N: usize> {
    bounds: [f64; N],
    counts: [u64; N],
    count: u64,
    sum: f64,
}

impl<const N: usize> Histogram<N> {
    fn new(bounds: [f64; N]) -> Self {
        Histogram { bounds, counts: [0; N], count: 0, sum: 0.0 }
    }

    fn observe(&mut self, v: f64) {
        for (c, b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    /// Prometheus lines of the histogram `name` with labels `label`.
    fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{label}}} {}\n{name}_count{{{label}}} {}", self.sum, self.count);
    }
}

/// The server's own metrics.
#[derive(Debug)]
pub struct Metrics {
    ttft: Mutex<Histogram<{ TTFT_BUCKETS.len() }>>,
    mask: Mutex<Histogram<{ MASK_BUCKETS.len() }>>,
    success: [AtomicU64; 3],
    failed: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            mask: Mutex::new(Histogram::new(MASK_BUCKETS)),
            success: Default::default(),
            failed: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Records one request's time to its first token.
    pub fn observe_ttft(&self, secs: f64) {
        if let Ok(mut h) = self.ttft.lock() {
            h.observe(secs);
        }
    }

    /// Records the time one structured-output mask took.
    pub fn observe_mask(&self, secs: f64) {
        if let Ok(mut h) = self.mask.lock() {
            h.observe(secs);
        }
    }

    /// Counts a finished choice by its finish reason (`stop`, `length`, `abort`).
    pub fn finished(&self, reason: &str) {
        let i = match reason {
            "stop" => 0,
            "length" => 1,
            _ => 2,
        };
        self.success[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a choice the engine failed.
    pub fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text of `s` and the server's own figures, for model `model`.
    pub fn render(&self, s: &Stats, routed: &[u64], stages: &[f64], model: &str) -> String {
        let label = format!("model_name=\"{}\"", escape(model));
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{label}}} {value}");
        };
        one("tp_num_requests_running", "gauge", "Requests being prefilled or decoded.", s.running.to_string());
        one("tp_num_requests_waiting", "gauge", "Requests queued, preempted ones included.", s.waiting.to_string());
        one(
            "tp_kv_cache_usage_perc",
            "gauge",
            "Fraction of KV-cache blocks in use (0 to 1).",
            s.kv_cache_usage.to_string(),
        );
        one(
            "tp_prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            s.prefix_cache_hits.to_string(),
        );
        one("tp_prompt_tokens_total", "counter", "Prompt tokens processed.", s.prompt_tokens.to_string());
        one("tp_generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens.to_string());
        one("tp_num_preemptions_total", "counter", "Sequences preempted to be recomputed.", s.preemptions.to_string());
        one(
            "tp_spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative draft tokens proposed.",
            s.spec_draft_tokens.to_string(),
        );
        one(
            "tp_spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative draft tokens accepted.",
            s.spec_accepted_tokens.to_string(),
        );
        one("tp_steps_total", "counter", "Engine steps run (those with sequences).", s.phases.steps.to_string());
        let _ = writeln!(
            out,
            "# HELP tp_step_phase_seconds_total Seconds the steps spent, by phase (rank 0): gemm, attention \
             (with cache writes), elementwise (the rest of the forward pass), sampling, scheduler (the \
             leader's own work around each step).\n# TYPE tp_step_phase_seconds_total counter"
        );
        for (phase, secs) in s.phases.named() {
            let _ = writeln!(out, "tp_step_phase_seconds_total{{{label},phase=\"{phase}\"}} {secs}");
        }
        let _ = writeln!(
            out,
            "# HELP tp_request_success_total Choices finished, by finish reason.\n# TYPE tp_request_success_total counter"
        );
        for (i, reason) in ["stop", "length", "abort"].iter().enumerate() {
            let n = self.success[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "tp_request_success_total{{{label},finished_reason=\"{reason}\"}} {n}");
        }
        let failed = self.failed.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP tp_request_failure_total Choices the engine failed.\n# TYPE tp_request_failure_total counter\n\
             tp_request_failure_total{{{label}}} {failed}"
        );
        if !stages.is_empty() {
            let _ = writeln!(
                out,
                "# HELP tp_stage_busy_seconds_total Seconds each pipeline stage computed (its first rank's forward \
                 passes and sampling); against the wall clock, how much the stages overlap.\n\
                 # TYPE tp_stage_busy_seconds_total counter"
            );
            for (stage, secs) in stages.iter().enumerate() {
                let _ = writeln!(out, "tp_stage_busy_seconds_total{{{label},stage=\"{stage}\"}} {secs}");
            }
        }
        if !routed.is_empty() {
            let _ = writeln!(
                out,
                "# HELP tp_moe_routed_tokens_total Tokens the router sent to each expert, summed over the \
                 mixture-of-experts layers (rank 0's forward passes).\n# TYPE tp_moe_routed_tokens_total counter"
            );
            for (e, n) in routed.iter().enumerate() {
                let _ = writeln!(out, "tp_moe_routed_tokens_total{{{label},expert=\"{e}\"}} {n}");
            }
        }
        if let Ok(h) = self.ttft.lock() {
            let help = "Time from a request's arrival to its first token.";
            h.render(&mut out, "tp_time_to_first_token_seconds", help, &label);
        }
        if let Ok(h) = self.mask.lock() {
            let help = "Time to compute one structured-output token mask (on rank 0, beside the forward pass).";
            h.render(&mut out, "tp_structured_output_mask_seconds", help, &label);
        }
        out
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample line starting with `prefix`.
    fn value(text: &str, prefix: &str) -> f64 {
        let line = text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{prefix} in {text}"));
        line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap()
    }

    #[test]
    fn histogram_is_cumulative_and_stats_are_shown() {
        let m = Metrics::default();
        for s in [0.003, 0.05, 0.3, 100.0] {
            m.observe_ttft(s);
        }
        m.finished("length");
        let stats = Stats { running: 2, waiting: 5, kv_cache_usage: 0.25, generation_tokens: 9, ..Stats::default() };
        let t = m.render(&stats, &[3, 0, 5], &[], "a\"b");
        assert_eq!(value(&t, "tp_moe_routed_tokens_total{model_name=\"a\\\"b\",expert=\"2\"}"), 5.0);
        assert!(!m.render(&stats, &[], &[], "m").contains("tp_moe_routed"));
        let staged = m.render(&stats, &[], &[1.5, 0.25], "m");
        assert_eq!(value(&staged, "tp_stage_busy_seconds_total{model_name=\"m\",stage=\"1\"}"), 0.25);
        assert_eq!(value(&t, "tp_num_requests_running{"), 2.0);
        assert_eq!(value(&t, "tp_num_requests_waiting{"), 5.0);
        assert_eq!(value(&t, "tp_kv_cache_usage_perc{"), 0.25);
        assert_eq!(value(&t, "tp_generation_tokens_total{"), 9.0);
        assert_eq!(value(&t, "tp_time_to_first_token_seconds_bucket{model_name=\"a\\\"b\",le=\"0.001\"}"), 0.0);
        assert_eq!(value(&t, "tp_time_to_first_token_seconds_bucket{model_name=\"a\\\"b\",le=\"0.005\"}"), 1.0);
        assert_eq!(value(&t, "tp_time_to_first_token_seconds_bucket{model_name=\"a\\\"b\",le=\"0.06\"}"), 2.0);
        assert_eq!(value(&t, "tp_time_to_first_token_seconds_bucket{model_name=\"a\\\"b\",le=\"40\"}"), 3.0);
        assert_eq!(value(&t, "tp_time_to_first_token_seconds_bucket{model_name=\"a\\\"b\",le=\"+Inf\"}"), 4.0);
        assert_eq!(value(&t, "tp_time_to_first_token_seconds_count"), 4.0);
        assert!((value(&t, "tp_time_to_first_token_seconds_sum") - 100.353).abs() < 1e-9);
        assert_eq!(value(&t, "tp_request_success_total{model_name=\"a\\\"b\",finished_reason=\"length\"}"), 1.0);
        m.observe_mask(2e-4);
        let t = m.render(&stats, &[], &[], "m");
        assert_eq!(value(&t, "tp_structured_output_mask_seconds_bucket{model_name=\"m\",le=\"0.0001\"}"), 0.0);
        assert_eq!(value(&t, "tp_structured_output_mask_seconds_bucket{model_name=\"m\",le=\"0.0002\"}"), 1.0);
        assert_eq!(value(&t, "tp_structured_output_mask_seconds_count"), 1.0);
    }
}
