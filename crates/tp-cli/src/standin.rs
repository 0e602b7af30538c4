//! STAND-IN ENGINE, for developing and testing the server until `tp_engine::start` lands; the
//! lead replaces its one call in `engine::start_engine` with the real engine.
//!
//! It runs no model: request `r`'s `k`-th generated id is `r.prompt[k % r.prompt.len()]` (it
//! echoes its prompt), one id per step for every running request, with made-up logprobs. It
//! reads `vocab_size`, `max_position_embeddings` and `eos_token_id` from the folder's
//! `config.json`, keeps `--max-num-seqs` running and the rest waiting, honours `max_tokens`,
//! stop ids, end-of-sequence ids, aborts and a sink that went away, and publishes its stats.
//! `TP_STANDIN_STEP_MS` (default 5) sets the time of one step.

use crate::args::EngineArgs;
use crate::engine::StartedEngine;
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};
use tp_engine::api::{
    Command, CommandReceiver, EngineHandle, Event, EventSink, FinishReason, Limits, Request, RequestId, SharedStats,
    Stats, TokenLogprobs, Usage,
};

/// Starts the stand-in engine thread for `args`.
pub fn start(args: &EngineArgs) -> Result<StartedEngine, String> {
    let path = args.model_dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let cfg: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let field = |k: &str| cfg.get(k).and_then(Value::as_u64).and_then(|v| usize::try_from(v).ok());
    let vocab_size = field("vocab_size").ok_or_else(|| format!("{}: no vocab_size", path.display()))?;
    let model_len = field("max_position_embeddings").unwrap_or(usize::MAX);
    let max_model_len = match args.max_model_len {
        Some(m) if m > model_len => {
            return Err(format!("--max-model-len {m} is beyond the model's max_position_embeddings {model_len}"));
        }
        Some(m) => m,
        None if model_len == usize::MAX => return Err(format!("{}: no max_position_embeddings", path.display())),
        None => model_len,
    };
    let eos_token_ids = match cfg.get("eos_token_id") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
        Some(v) => v.as_i64().into_iter().collect(),
        None => Vec::new(),
    };
    let limits = Limits { max_model_len, vocab_size, eos_token_ids, max_waiting: args.max_waiting };
    let stats = Arc::new(SharedStats::default());
    let (handle, rx) = EngineHandle::channel(limits.clone(), stats.clone());
    let quit = Arc::new(AtomicBool::new(false));
    let step = std::env::var("TP_STANDIN_STEP_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let mut engine = StandIn {
        rx,
        stats,
        limits,
        max_num_seqs: args.max_num_seqs,
        step: Duration::from_millis(step),
        running: Vec::new(),
        waiting: VecDeque::new(),
        totals: Stats::default(),
        quit: quit.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("tp-standin-engine".into())
        .spawn(move || engine.run())
        .map_err(|e| format!("cannot start the engine thread: {e}"))?;
    let join = Box::new(move |deadline: Instant| {
        quit.store(true, Ordering::Relaxed);
        while !thread.is_finished() {
            if Instant::now() >= deadline {
                return Err("the engine thread did not stop by the deadline".to_string());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        thread.join().map_err(|_| "the engine thread panicked".to_string())
    });
    Ok(StartedEngine { handle, join })
}

struct Active {
    id: RequestId,
    request: Request,
    sink: Box<dyn EventSink>,
    generated: usize,
}

struct StandIn {
    rx: CommandReceiver,
    stats: Arc<SharedStats>,
    limits: Limits,
    max_num_seqs: usize,
    step: Duration,
    running: Vec<Active>,
    waiting: VecDeque<Active>,
    totals: Stats,
    quit: Arc<AtomicBool>,
}

impl StandIn {
    fn run(&mut self) {
        loop {
            if self.quit.load(Ordering::Relaxed) {
                self.stats.set_stopped("the engine stopped".into());
                for mut a in self.running.drain(..).chain(self.waiting.drain(..)) {
                    a.sink.send(Event::Failed("the engine stopped before the request finished".into()));
                }
                return;
            }
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                self.rx.recv_timeout(Duration::from_millis(20)).map_err(|e| e == RecvTimeoutError::Disconnected)
            } else {
                self.rx.try_recv().map_err(|e| e == TryRecvError::Disconnected)
            };
            let mut next = first;
            loop {
                match next {
                    Ok(c) => self.command(c),
                    Err(true) if idle => return,
                    Err(_) => break,
                }
                next = self.rx.try_recv().map_err(|e| e == TryRecvError::Disconnected);
            }
            while self.running.len() < self.max_num_seqs
                && let Some(a) = self.waiting.pop_front()
            {
                self.totals.prompt_tokens += a.request.prompt.len() as u64;
                self.running.push(a);
            }
            if !self.running.is_empty() {
                std::thread::sleep(self.step);
                self.step_all();
            }
            self.publish();
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Add { id, request, sink } => self.waiting.push_back(Active { id, request, sink, generated: 0 }),
            Command::Abort(id) => {
                let pos = self.running.iter().position(|a| a.id == id);
                let a = match pos {
                    Some(i) => Some(self.running.swap_remove(i)),
                    None => self.waiting.iter().position(|a| a.id == id).and_then(|i| self.waiting.remove(i)),
                };
                if let Some(mut a) = a {
                    let usage = Usage {
                        prompt_tokens: a.request.prompt.len(),
                        completion_tokens: a.generated,
                        cached_prompt_tokens: 0,
                    };
                    a.sink.send(Event::Finished { reason: FinishReason::Abort, usage });
                }
            }
        }
    }

    fn step_all(&mut self) {
        let mut keep = Vec::with_capacity(self.running.len());
        for mut a in self.running.drain(..) {
            let p = &a.request.prompt;
            let id = p[a.generated % p.len()];
            a.generated += 1;
            self.totals.generation_tokens += 1;
            let logprobs = a.request.params.logprobs.map(|n| TokenLogprobs {
                logprob: -0.5,
                top: (0..n as i64).map(|k| ((id + k) % self.limits.vocab_size as i64, -0.5 - k as f32)).collect(),
            });
            if !a.sink.send(Event::Token { id, logprobs }) {
                continue;
            }
            let eos = !a.request.ignore_eos && self.limits.eos_token_ids.contains(&id);
            let reason = if eos || a.request.stop_token_ids.contains(&id) {
                Some(FinishReason::Stop)
            } else if a.generated >= a.request.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    let usage =
                        Usage { prompt_tokens: p.len(), completion_tokens: a.generated, cached_prompt_tokens: 0 };
                    a.sink.send(Event::Finished { reason, usage });
                }
                None => keep.push(a),
            }
        }
        self.running = keep;
    }

    fn publish(&mut self) {
        self.totals.running = self.running.len();
        self.totals.waiting = self.waiting.len();
        self.totals.kv_cache_usage = self.running.len() as f64 / self.max_num_seqs as f64;
        self.stats.publish(self.totals);
    }
}
