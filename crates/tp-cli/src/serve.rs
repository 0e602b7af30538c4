//! `tp serve`: binds the port, starts the engine, serves until SIGTERM or SIGINT, then stops
//! accepting, lets in-flight requests finish until `--shutdown-timeout` (aborting what is left
//! then), stops the engine and returns.

use crate::args::ServeArgs;
use crate::engine::start_engine;

use crate::error::CliError;
use crate::server::{AppState, router};
use crate::text::TextModel;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long aborted requests get to end after the shutdown deadline.
const ABORT_GRACE: Duration = Duration::from_secs(5);
/// How long the engine gets to stop.
const ENGINE_STOP: Duration = Duration::from_secs(30);

/// Runs the server for `args` until a signal; `Ok` after a clean shutdown.
pub fn serve(args: ServeArgs) -> Result<(), CliError> {
    let (engine_args, mut args) = args.split()?;
    // A rank other than 0 of a `--backend nccl` job serves no HTTP: it runs its part of the
    // engine until rank 0 stops it.
    if let Some(r) = crate::engine::nccl_follower(&engine_args) {
        return r;
    }
    // The model's files opened once: the tokenizer, the template and every rank read them.
    let source = tp_models::ModelSource::open(&args.model_dir).map_err(|e| CliError::Model(e.to_string()))?;
    let mut text = TextModel::from_source(&source)?;
    args.lora.num_layers = source.config().map_err(|e| CliError::Model(e.to_string()))?.num_hidden_layers;
    if let Some(path) = &args.chat_template {
        text.replace_template(path)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tp-http")
        .build()
        .map_err(|e| CliError::Io(format!("cannot start the async runtime: {e}")))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind((args.host.as_str(), args.port)))
        .map_err(|e| CliError::Io(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
    let addr = listener.local_addr().map_err(|e| CliError::Io(e.to_string()))?;
    let started = start_engine(&engine_args, Some(source))?;
    let handle = started.handle.clone();
    let state = Arc::new(AppState::new(started.handle, text, &args));
    tracing::info!("serving {} on http://{addr}", args.served_model_name);
    // The line tests and scripts wait for.
    eprintln!("tp serve: listening on http://{addr}");
    // Why the engine stopped by itself, if it did (set by the watcher below).
    let failed = Arc::new(std::sync::Mutex::new(None::<String>));
    let served = rt.block_on(async {
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let mut graceful = stop_rx.clone();
        let app = router(state.clone());
        let mut server = tokio::spawn(
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = graceful.wait_for(|s| *s).await;
                })
                .into_future(),
        );
        let stop_on_signal = stop_tx.clone();
        tokio::spawn(async move {
            let why = signal().await;
            tracing::info!("{why}: shutting down");
            let _ = stop_on_signal.send(true);
        });
        // An engine that stops by itself (a rank died or hung past TP_TIMEOUT_SECS: its
        // requests have failed) ends the server too, rather than leaving it answering 503.
        let (watch_handle, watch_failed, mut watch_stop) = (handle.clone(), failed.clone(), stop_rx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = watch_stop.wait_for(|s| *s) => return,
                }
                if let Some(why) = watch_handle.stopped() {
                    tracing::error!("{why}: shutting down");
                    if let Ok(mut f) = watch_failed.lock() {
                        *f = Some(why);
                    }
                    let _ = stop_tx.send(true);
                    return;
                }
            }
        });
        tokio::select! {
            r = &mut server => return r.map_err(|e| CliError::Io(e.to_string()))?.map_err(|e| CliError::Io(e.to_string())),
            _ = stop_rx.wait_for(|s| *s) => {}
        }
        handle.begin_shutdown();
        // After an engine failure every request has already failed: drain briefly.
        let engine_failed = failed.lock().map(|f| f.is_some()).unwrap_or(true);
        let drain = if engine_failed { ABORT_GRACE.min(args.shutdown_timeout) } else { args.shutdown_timeout };
        if tokio::time::timeout(drain, &mut server).await.is_err() {
            let left = state.inflight();
            tracing::warn!("{} requests still running at the shutdown deadline: aborting them", left.len());
            for id in left {
                handle.abort(id);
            }
            if tokio::time::timeout(ABORT_GRACE, &mut server).await.is_err() {
                server.abort();
            }
        }
        match failed.lock().ok().and_then(|f| f.clone()) {
            Some(why) => Err(CliError::Stopped(why)),
            None => Ok(()),
        }
    });
    // The engine failed (its ranks may still hang), whichever way the server loop ended: leave
    // without waiting for the ranks, and for the runtime's tasks at most a second.
    if let Some(why) = failed.lock().ok().and_then(|f| f.clone()) {
        rt.shutdown_timeout(Duration::from_secs(1));
        return Err(CliError::Stopped(why));
    }
    if let Err(e) = served {
        rt.shutdown_timeout(Duration::from_secs(1));
        return Err(e);
    }
    drop(state);
    (started.join)(Instant::now() + ENGINE_STOP).map_err(CliError::Stopped)?;
    rt.shutdown_timeout(Duration::from_secs(1));
    tracing::info!("stopped");
    if engine_args.backend == crate::args::BackendArg::Mpi {
        crate::launch::mpi_finalize()?;
    }
    Ok(())
}

/// Waits for SIGTERM or SIGINT; names the one that came.
async fn signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::warn!("cannot install the signal handlers; stop the server with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
