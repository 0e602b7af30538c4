//! Quantized weights in llama.cpp's ggml block formats ([`QuantType`]): [`dequantize`],
//! bit-exact with ggml.
//!
//! Files: `types` ([`QuantType`]), `blocks` (the byte layouts, a scalar block decoder),
//! `dequant` ([`dequantize`]).

mod blocks;
mod dequant;
mod types;

pub use dequant::dequantize;
pub use types::QuantType;
