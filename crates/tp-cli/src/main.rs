//! `tp`: tensor-parallel LLM serving. `tp serve MODEL_DIR` serves a Hugging Face model folder
//! over OpenAI's HTTP API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
//! `/metrics`). `tp train MODEL_DIR --data FILE.jsonl` fine-tunes it.

mod args;
mod detok;
mod engine;
mod error;
mod harmony;
mod launch;
mod lora_serve;
mod markers;
mod merge;
mod metrics;
mod peak;
mod reasoning;
mod request;
mod run;
mod serve;
mod server;
mod structured;
mod template;
mod text;
mod tools;
mod train;
mod train_lora;

use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match args::parse_cli(std::env::args_os()) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_target(false).with_ansi(false).init();
    match cli.command {
        args::Command::Serve(a) => match serve::serve(*a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tp serve: {e}");
                ExitCode::FAILURE
            }
        },
        args::Command::Train(a) => match train::train(*a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tp train: {e}");
                ExitCode::FAILURE
            }
        },
        args::Command::Merge(a) => match merge::merge_command(*a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tp merge: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
