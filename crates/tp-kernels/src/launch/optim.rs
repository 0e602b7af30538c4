//! Launcher of `kernels/optim.cu`: the multi-tensor AdamW step over f32 master weights, up to
//! `ADAMW_MAX_TENSORS` tensors per launch, their pointers passed in a kernel-parameter table (no
//! upload, no host synchronisation).

use super::invalid;
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};

const MAX: usize = consts::ADAMW_MAX_TENSORS as usize;

/// The f32 factors of one AdamW step, as `kernels/optim.cu` applies them (tp-train's
/// `optim.rs` formulas; each computed in f64 and rounded to f32 by the caller, as torch does with
/// Python floats).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamwFactors {
    /// `1 − lr·weight_decay`, the decoupled decay of parameters that take it.
    pub keep: f32,
    /// `1 − beta1` (torch's `lerp` weight for the first moment).
    pub w1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `1 − beta2`.
    pub w2: f32,
    /// `lr / (1 − beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 − beta2^t)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// The gradient-clipping coefficient every gradient is multiplied by first (1: none).
    pub clip: f32,
}

// SAFETY: a #[repr(C)] struct of eight f32, the layout of the kernel's `AdamwFactors` (32 bytes,
// static_assert there); any bit pattern is a valid value.
unsafe impl DeviceRepr for AdamwFactors {}

/// One parameter of an AdamW step: its f32 master weights, gradient and moments, `n` elements
/// each, updated in place (`param`, `m`, `v`); `decay` says whether it takes weight decay.
#[derive(Debug)]
pub struct AdamwTensor<'a> {
    /// The f32 weights, updated in place.
    pub param: &'a mut CudaSlice<u8>,
    /// The f32 gradient (read; multiplied by the clip coefficient on the fly).
    pub grad: &'a CudaSlice<u8>,
    /// The first moment, f32, updated in place.
    pub m: &'a mut CudaSlice<u8>,
    /// The second moment, f32, updated in place.
    pub v: &'a mut CudaSlice<u8>,
    /// Elements.
    pub n: usize,
    /// Whether `keep` multiplies the weights first (transformers: not biases and norm weights).
    pub decay: bool,
}

/// The kernel's `AdamwTable` (a kernel parameter): four pointers, the length, the first chunk
/// and the decay flag of each tensor.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamwTable {
    p: [u64; MAX],
    g: [u64; MAX],
    m: [u64; MAX],
    v: [u64; MAX],
    n: [i64; MAX],
    first_chunk: [i64; MAX + 1],
    decay: [i32; MAX],
    count: i32,
}

const _: () = assert!(std::mem::size_of::<AdamwTable>() == consts::ADAMW_TABLE_BYTES as usize);
const _: () = assert!(std::mem::size_of::<AdamwFactors>() == 32);

// SAFETY: #[repr(C)] with the field order, types and size (ADAMW_TABLE_BYTES, asserted on both
// sides) of the kernel's struct; plain integers, any bit pattern valid.
unsafe impl DeviceRepr for AdamwTable {}

impl Gpu {
    /// One AdamW step over `tensors` (`kernels/optim.cu`, `tp_adamw`), in launches of up to
    /// `ADAMW_MAX_TENSORS` tensors: per element, `g = grad·clip`, `p = p·keep` (where `decay`),
    /// `m += (g − m)·w1`, `v = v·b2 + (w2·g)·g`, `p −= (step_size·m) / (sqrt(v)/bc2_sqrt + eps)`,
    /// all in f32 with each rounding in that order. Every buffer is checked before anything runs.
    pub fn adamw(&self, tensors: &mut [AdamwTensor<'_>], f: AdamwFactors) -> Result<()> {
        const K: &str = "adamw";
        for (i, t) in tensors.iter().enumerate() {
            let bytes = t.n.checked_mul(4).ok_or_else(|| invalid(K, "size overflows usize"))?;
            if bytes > t.param.len() || bytes > t.grad.len() || bytes > t.m.len() || bytes > t.v.len() {
                return Err(invalid(K, format!("tensor {i}: {} f32 elements do not fit its buffers", t.n)));
            }
            i64::try_from(t.n).map_err(|_| invalid(K, format!("tensor {i}: {} elements exceed i64", t.n)))?;
        }
        let chunk = consts::ADAMW_CHUNK as usize;
        for group in tensors.chunks_mut(MAX) {
            let count = group.len();
            let mut table = AdamwTable {
                p: [0; MAX],
                g: [0; MAX],
                m: [0; MAX],
                v: [0; MAX],
                n: [0; MAX],
                first_chunk: [0; MAX + 1],
                decay: [0; MAX],
                count: count as i32,
            };
            let stream = self.stream();
            let mut guards = Vec::with_capacity(4 * count);
            let mut chunks = 0i64;
            for (k, t) in group.iter_mut().enumerate() {
                table.n[k] = t.n as i64;
                table.decay[k] = i32::from(t.decay);
                table.first_chunk[k] = chunks;
                chunks += t.n.div_ceil(chunk) as i64;
                let (p, gp) = t.param.device_ptr_mut(stream);
                let (g, gg) = t.grad.device_ptr(stream);
                let (m, gm) = t.m.device_ptr_mut(stream);
                let (v, gv) = t.v.device_ptr_mut(stream);
                (table.p[k], table.g[k], table.m[k], table.v[k]) = (p, g, m, v);
                guards.extend([gp, gg, gm, gv]);
            }
            table.first_chunk[count] = chunks;
            if chunks == 0 {
                continue;
            }
            let func = self.function("tp_adamw", 0)?;
            let mut l = stream.launch_builder(func);
            l.arg(&table).arg(&f);
            // SAFETY: matches tp_adamw(AdamwTable t, AdamwFactors f), both passed by value with
            // the kernel's layouts (sizes asserted on both sides). Each tensor's four pointers
            // address buffers of at least n[k] f32 (checked above); the kernel touches elements
            // below n[k] only (chunk ranges clipped to n[k]; first_chunk holds the prefix sums
            // of ceil(n / ADAMW_CHUNK), so every chunk belongs to one tensor). param, m and v
            // are `&mut` borrows, so no two written buffers alias each other or any gradient.
            // The guards record these uses on the stream when dropped, after the launch.
            unsafe { l.launch(self.grid_rows(chunks as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_adamw)"))?;
            drop(guards);
        }
        Ok(())
    }
}
