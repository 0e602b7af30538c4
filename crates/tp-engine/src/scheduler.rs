//! Continuous batching (filled in by the scheduler work).
