//! The `--logits-out` file: safetensors written into one temporary file beside the target
//! (`.NAME.tmp-PID`) and renamed over it, so the target is whole or absent; SIGINT or SIGTERM
//! during the write removes the temporary file (see `signals.rs`).
//!
//! The format, as the safetensors crate writes it (byte for byte: the tests compare): the
//! header's length as a little-endian u64, the header (compact JSON mapping each name to its
//! `dtype`, `shape` and `data_offsets`, padded with spaces to a multiple of 8 bytes), then the
//! tensors' little-endian bytes back to back, in the header's order.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use tp_core::{DType, Device, Tensor};
use tp_models::Generation;

/// Writes `tokens`, `prefill_logits` and `decode_logits` (f32) of `out` to `path`, whole or not
/// at all.
pub fn write_logits(path: &Path, out: &Generation) -> Result<(), String> {
    let f32s = |t: &Option<Tensor>| -> Result<Tensor, String> {
        let t = t.as_ref().ok_or("internal: logits were not kept")?;
        t.to_dtype(DType::F32).and_then(|t| t.to_device(&Device::Cpu)).map_err(|e| e.to_string())
    };
    let tokens = Tensor::from_vec(out.tokens.clone(), &[out.tokens.len()], &Device::Cpu).map_err(|e| e.to_string())?;
    let (prefill, decode) = (f32s(&out.prefill_logits)?, f32s(&out.decode_logits)?);
    let name = path.file_name().ok_or_else(|| format!("--logits-out {}: not a file name", path.display()))?;
    // The file is replaced by a rename: never do that to a device, a pipe or a directory.
    if let Ok(meta) = std::fs::metadata(path)
        && !meta.is_file()
    {
        return Err(format!("--logits-out {}: exists and is not a regular file", path.display()));
    }
    // safetensors' order: the widest alignment first (i64 before f32), then by name.
    let tensors = [("tokens", &tokens), ("decode_logits", &decode), ("prefill_logits", &prefill)];
    let fail = |e: String| format!("cannot write --logits-out {}: {e}", path.display());
    let head = header(&tensors).map_err(fail)?;
    let mut tmp_name = OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    // Before the file exists, so that no moment leaves it behind.
    #[cfg(unix)]
    let on_signal = crate::signals::RemoveOnSignal::install(&tmp).map_err(fail)?;
    let written =
        write_file(&tmp, &head, &tensors).and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    #[cfg(unix)]
    drop(on_signal); // the previous handlers, now that the target is complete (or untouched)
    written.map_err(fail)
}

/// safetensors' dtype name of `dtype`.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::I32 => "I32",
        DType::I64 => "I64",
    }
}

/// Everything before the data: the header's length (u64, little-endian) and the header, padded
/// with spaces to a multiple of 8 bytes.
fn header(tensors: &[(&str, &Tensor)]) -> Result<Vec<u8>, String> {
    let mut json = String::from("{");
    let mut offset = 0usize;
    for (i, (name, t)) in tensors.iter().enumerate() {
        let end = offset.checked_add(t.size_in_bytes()).ok_or("the tensors exceed the address space")?;
        let name = serde_json::to_string(name).map_err(|e| e.to_string())?;
        let shape = serde_json::to_string(t.dims()).map_err(|e| e.to_string())?;
        let comma = if i == 0 { "" } else { "," };
        let dtype = dtype_name(t.dtype());
        let _ = write!(json, r#"{comma}{name}:{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{offset},{end}]}}"#);
        offset = end;
    }
    json.push('}');
    let mut json = json.into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    Ok(bytes)
}

/// Creates `tmp` (removing a stale one of this process's name first; never following a link)
/// and writes the header and the tensors' bytes into it.
fn write_file(tmp: &Path, head: &[u8], tensors: &[(&str, &Tensor)]) -> Result<(), String> {
    let io = |e: std::io::Error| format!("{}: {e}", tmp.display());
    match std::fs::remove_file(tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
        _ => {}
    }
    let file = std::fs::OpenOptions::new().write(true).create_new(true).open(tmp).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(head).map_err(io)?;
    for (_, t) in tensors {
        w.write_all(t.as_bytes().map_err(|e| e.to_string())?).map_err(io)?;
    }
    w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
}
