//! Pipeline parallelism: schedules as data, checked by one validator and run by one executor
//! (torch.distributed.pipelining's design).
//!
//! * [`schedule`]: each pipeline rank's list of [`Action`]s (forward, backward, its input and
//!   weight halves, send, receive, optimizer step) for GPipe, 1F1B, interleaved 1F1B and
//!   zero-bubble ZB-H1;
//! * [`validate`](mod@validate): every backward after its forward, every send matched by a
//!   receive in order, no deadlock;
//! * [`simulate`](mod@simulate): the timeline of a schedule for given pass costs, and each
//!   schedule's bubble formula;
//! * [`exec`]: one rank's run of its list on its model chunks;
//! * [`trace`]: Chrome trace-event JSON and an SVG picture of a step's timeline.

pub mod exec;
pub mod schedule;
pub mod simulate;
pub mod trace;
pub mod validate;

pub use exec::{ModelChunk, StageRunner, StageStep, StageWork, TraceClock};
pub use schedule::{Action, Schedule, ScheduleError, ScheduleKind};
pub use simulate::{Costs, Timeline, TimelineEvent, bubble_formula, simulate};
pub use trace::{TraceEvent, chrome_trace_json, timeline_svg};
pub use validate::validate;
