//! Starting the engine: [`start_engine`] is the only place that does (today the stand-in; the
//! real `tp_engine::start` replaces that one call).

use crate::args::EngineArgs;
use crate::error::CliError;
use std::time::Instant;
use tp_engine::api::EngineHandle;

/// Stops a started engine: asks it to end and waits until the deadline.
pub type Join = Box<dyn FnOnce(Instant) -> Result<(), String> + Send>;

/// A running engine: the server's handle and how to stop it.
pub struct StartedEngine {
    /// Submit, abort, stats, limits, begin_shutdown.
    pub handle: EngineHandle,
    /// Ends the engine (failing what still runs) and waits for it until the deadline.
    pub join: Join,
}

/// Loads the model and starts the engine with `args`.
pub fn start_engine(args: &EngineArgs) -> Result<StartedEngine, CliError> {
    crate::standin::start(args).map_err(CliError::Engine)
}
