//! Runs a tensor-parallel SwiGLU MLP from a safetensors checkpoint.
//!
//! `cargo run --release -p tp-layers --example mlp -- --checkpoint PATH --prefix PREFIX --input X
//! --world-size N [--backend local|nccl] [--device cpu|cuda] [--dtype f32|f16|bf16] --output Y`
//!
//! See `run.rs` for what each flag does.

mod run;

fn main() {
    let result = run::utf8_args().and_then(|args| run::run(&args));
    if let Err(e) = result {
        // One write for the whole line, so the lines of ranks sharing a terminal never mix.
        let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("mlp: {e}\n").as_bytes());
        std::process::exit(1);
    }
}
