//! Runs a tensor-parallel SwiGLU MLP from a safetensors checkpoint; see
//! `tp_layers::example_mlp` for the flags.
//!
//! `cargo run --release -p tp-layers --example mlp -- --checkpoint PATH --prefix PREFIX --input X
//! --world-size N [--backend local|nccl] [--device cpu|cuda] [--dtype f32|f16|bf16] --output Y`

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = tp_layers::example_mlp::run(&args) {
        // One write for the whole line, so the lines of ranks sharing a terminal never mix.
        let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("mlp: {e}\n").as_bytes());
        std::process::exit(1);
    }
}
