//! # tp-testing
//!
//! Dev-only test support for the tp workspace, used only as a dev-dependency (tests,
//! examples, benchmarks), never by a library's normal dependencies:
//!
//! * [`reference`](mod@reference): the one float64 reference decoder, from single ops to whole models, that
//!   the test suites compare tp against.
//! * [`synthetic`]: random checkpoints in Hugging Face's layout.
//! * [`ranks`]: ranks as threads of a `LocalGroup` or as processes of an NCCL job.

pub mod launch;
pub mod ranks;
pub mod reference;
pub mod synthetic;
