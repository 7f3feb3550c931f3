//! What `GET /metrics` reports, in Prometheus' text exposition format (version 0.0.4): counters
//! of requests and tokens, gauges of the queue, the running sequences and the key/value cache,
//! and histograms of the time to the first token, the time between tokens, the sequences each
//! scheduler step advanced and the embedding requests each forward pass embedded. Everything is
//! updated with atomics or a short lock, from the HTTP handlers and the model's thread alike.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A counter or gauge.
#[derive(Default)]
pub struct Value(AtomicU64);

impl Value {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A histogram over fixed bucket bounds (each bucket counts the observations at most its bound).
pub struct Histogram {
    bounds: &'static [f64],
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, state: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }

    pub fn observe(&self, v: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (count, &bound) in s.0.iter_mut().zip(self.bounds) {
            if v <= bound {
                *count += 1;
            }
        }
        s.1 += v;
        s.2 += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (count, bound) in s.0.iter().zip(self.bounds) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", s.2, s.1, s.2);
    }
}

const SECONDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const SEQUENCES: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// The server's metrics.
pub struct Metrics {
    /// Requests received, by endpoint.
    pub chat_requests: Value,
    pub completion_requests: Value,
    pub embedding_requests: Value,
    /// Requests refused for capacity (429/503).
    pub rejected: Value,
    /// Requests refused as malformed or too large (4xx).
    pub invalid: Value,
    /// Requests that failed after being accepted.
    pub failed: Value,
    /// Requests whose client went away before the answer was done.
    pub cancelled: Value,
    /// Tokens of the prompts run (an embedding's inputs included), and tokens generated.
    pub prompt_tokens: Value,
    pub generated_tokens: Value,
    /// Requests waiting for a sequence slot, and sequences running.
    pub queue_depth: Value,
    pub running: Value,
    /// Key/value cache bytes the running sequences reserve, and the budget.
    pub kv_cache_bytes: Value,
    pub kv_cache_budget_bytes: Value,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub batch_size: Histogram,
    /// Sequences one model step decoded together (1 for a sequence stepped alone).
    pub decode_batch_size: Histogram,
    /// Embedding requests with inputs in one forward pass.
    pub embedding_batch_requests: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            chat_requests: Value::default(),
            completion_requests: Value::default(),
            embedding_requests: Value::default(),
            rejected: Value::default(),
            invalid: Value::default(),
            failed: Value::default(),
            cancelled: Value::default(),
            prompt_tokens: Value::default(),
            generated_tokens: Value::default(),
            queue_depth: Value::default(),
            running: Value::default(),
            kv_cache_bytes: Value::default(),
            kv_cache_budget_bytes: Value::default(),
            time_to_first_token: Histogram::new(SECONDS),
            inter_token_latency: Histogram::new(SECONDS),
            batch_size: Histogram::new(SEQUENCES),
            decode_batch_size: Histogram::new(SEQUENCES),
            embedding_batch_requests: Histogram::new(SEQUENCES),
        }
    }
}

impl Metrics {
    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        one(
            "kiln_requests_total",
            "counter",
            "Requests received, by endpoint.",
            &[
                ("{endpoint=\"chat\"}", self.chat_requests.get()),
                ("{endpoint=\"completions\"}", self.completion_requests.get()),
                ("{endpoint=\"embeddings\"}", self.embedding_requests.get()),
            ],
        );
        one("kiln_requests_rejected_total", "counter", "Requests refused for capacity.", &[("", self.rejected.get())]);
        one("kiln_requests_invalid_total", "counter", "Requests refused as invalid.", &[("", self.invalid.get())]);
        one("kiln_requests_failed_total", "counter", "Accepted requests that failed.", &[("", self.failed.get())]);
        one(
            "kiln_requests_cancelled_total",
            "counter",
            "Requests whose client left before the end.",
            &[("", self.cancelled.get())],
        );
        one("kiln_prompt_tokens_total", "counter", "Prompt tokens run.", &[("", self.prompt_tokens.get())]);
        one("kiln_generated_tokens_total", "counter", "Tokens generated.", &[("", self.generated_tokens.get())]);
        one("kiln_queue_depth", "gauge", "Requests waiting for a sequence slot.", &[("", self.queue_depth.get())]);
        one("kiln_running_sequences", "gauge", "Sequences being generated.", &[("", self.running.get())]);
        one(
            "kiln_kv_cache_bytes",
            "gauge",
            "Key/value cache bytes reserved by the running sequences.",
            &[("", self.kv_cache_bytes.get())],
        );
        one(
            "kiln_kv_cache_budget_bytes",
            "gauge",
            "Key/value cache bytes the server admits sequences up to.",
            &[("", self.kv_cache_budget_bytes.get())],
        );
        self.time_to_first_token.render(
            "kiln_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            &mut out,
        );
        self.inter_token_latency.render(
            "kiln_inter_token_latency_seconds",
            "Between consecutive tokens of one sequence.",
            &mut out,
        );
        self.batch_size.render("kiln_batch_size", "Sequences advanced by one scheduler step.", &mut out);
        self.decode_batch_size.render(
            "kiln_decode_batch_size",
            "Sequences decoded together by one model step (1: a sequence stepped alone).",
            &mut out,
        );
        self.embedding_batch_requests.render(
            "kiln_embedding_batch_requests",
            "Embedding requests with inputs in one forward pass.",
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_count_each_observation_in_every_bucket_at_or_above_it() {
        let m = Metrics::default();
        m.batch_size.observe(3.0);
        m.batch_size.observe(1.0);
        m.prompt_tokens.add(7);
        let text = m.render();
        assert!(text.contains("kiln_batch_size_bucket{le=\"1\"} 1\n"), "{text}");
        assert!(text.contains("kiln_batch_size_bucket{le=\"4\"} 2\n"), "{text}");
        assert!(text.contains("kiln_batch_size_bucket{le=\"+Inf\"} 2\nkiln_batch_size_sum 4\n"), "{text}");
        assert!(text.contains("kiln_prompt_tokens_total 7\n"), "{text}");
    }
}
