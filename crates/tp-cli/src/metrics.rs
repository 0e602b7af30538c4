//! `GET /metrics`: the engine's figures and the server's time-to-first-token histogram in
//! Prometheus' text format.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use tp_engine::api::Stats;

/// Upper bounds of the time-to-first-token buckets, in seconds (vLLM's).
const TTFT_BUCKETS: [f64; 18] =
    [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0];

/// A cumulative histogram.
#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; TTFT_BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// The server's own metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    ttft: Mutex<Histogram>,
    success: [AtomicU64; 3],
    failed: AtomicU64,
}

impl Metrics {
    /// Records one request's time to its first token.
    pub fn observe_ttft(&self, secs: f64) {
        if let Ok(mut h) = self.ttft.lock() {
            for (c, b) in h.counts.iter_mut().zip(TTFT_BUCKETS) {
                if secs <= b {
                    *c += 1;
                }
            }
            h.count += 1;
            h.sum += secs;
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
    pub fn render(&self, s: &Stats, model: &str) -> String {
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
        let name = "tp_time_to_first_token_seconds";
        let _ =
            writeln!(out, "# HELP {name} Time from a request's arrival to its first token.\n# TYPE {name} histogram");
        let h = self.ttft.lock().map(|h| (h.counts, h.count, h.sum)).unwrap_or(([0; TTFT_BUCKETS.len()], 0, 0.0));
        for (c, b) in h.0.iter().zip(TTFT_BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{{label},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {}", h.1);
        let _ = writeln!(out, "{name}_sum{{{label}}} {}\n{name}_count{{{label}}} {}", h.2, h.1);
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
        let t = m.render(&stats, "a\"b");
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
    }
}
