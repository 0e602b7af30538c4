//! Sampling exact under vocab parallelism (the sampler is filled in by the sampling work).

mod params;

pub use params::{MAX_TOP_LOGPROBS, SamplingParams};
