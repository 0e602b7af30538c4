//! Shared by the engine tests: a fresh synthetic model folder per test, submitting requests and
//! collecting every event each one gets, and a clean stop.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_engine::Engine;
use tp_engine::api::{Event, Request};
use tp_testing::synthetic::SyntheticModel;

/// Writes `spec` to a folder of its own (`name` tells the tests apart: they run in parallel).
pub fn model_dir(name: &str, spec: &SyntheticModel) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    spec.write(&dir).expect("write the synthetic model");
    dir
}

/// Submits every request at once and returns each one's events, up to and including its
/// `Finished` (a `Failed` panics; every event arrives within 120 s).
pub fn run_all(engine: &Engine, requests: &[Request]) -> Vec<Vec<Event>> {
    let h = engine.handle();
    let rxs: Vec<_> = requests
        .iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            h.submit(r.clone(), Box::new(tx)).expect("submit");
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|rx| {
            let mut events = Vec::new();
            loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("an event within 120 s") {
                    Event::Failed(why) => panic!("a request failed: {why}"),
                    e @ Event::Finished { .. } => {
                        events.push(e);
                        return events;
                    }
                    e => events.push(e),
                }
            }
        })
        .collect()
}

/// The token ids among `events`.
pub fn tokens(events: &[Event]) -> Vec<i64> {
    events.iter().filter_map(|e| if let Event::Token { id, .. } = e { Some(*id) } else { None }).collect()
}

/// Asks the engine to stop and waits (60 s at most) for a clean stop.
pub fn stop(engine: Engine) {
    let h = engine.handle();
    h.begin_shutdown();
    drop(h);
    assert!(engine.join(Instant::now() + Duration::from_secs(60)).expect("clean stop"), "the engine did not stop");
}
