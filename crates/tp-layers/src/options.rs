//! [`LoadOptions`]: how a layer's parameters are read from a checkpoint, beyond the group that
//! fixes rank, world size and device.

use tp_core::DType;

/// Options every layer's `load` takes. Build with [`LoadOptions::new`] and the `with_*`
/// methods; fields may be added later without breaking callers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadOptions {
    /// Convert every parameter to this dtype (`None`: keep the checkpoint's).
    pub dtype: Option<DType>,
    /// Keep a GGUF checkpoint's linear weights as its quantized blocks (multiplied without
    /// being dequantized) instead of dequantizing them to `dtype`. No effect on safetensors.
    pub quantized: bool,
}

impl LoadOptions {
    /// The defaults: parameters keep the checkpoint's dtype.
    pub fn new() -> LoadOptions {
        LoadOptions::default()
    }

    /// Parameters converted to `dtype` (round to nearest even when narrowing).
    pub fn with_dtype(mut self, dtype: DType) -> LoadOptions {
        self.dtype = Some(dtype);
        self
    }

    /// Linear weights of a GGUF checkpoint kept as quantized blocks (`true`) or dequantized.
    pub fn with_quantized(mut self, yes: bool) -> LoadOptions {
        self.quantized = yes;
        self
    }
}
