//! [`lora_product`]: LoRA's batched multi-adapter product (Punica's BGMV shape): every row of a
//! flat batch through the adapter of its own slot, `y[t] + s · (x[t] A^T) B^T`, rows of no
//! adapter left as they are. On a GPU two launches (`tp_lora_shrink`, `tp_lora_expand` of
//! `kernels/lora.cu`) whatever the mix of adapters; on the host the same arithmetic row by
//! row (the reference the GPU suite compares with; tp-layers' host layers gather each
//! adapter's rows for one GEMM instead).

use super::cuda;
use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};

const OP: &str = "lora_product";

/// One slot's adapter: `A: [r, in]`, `B: [out, r]` (f32, on the batch's device) and its scale.
#[derive(Debug, Clone, Copy)]
pub struct LoraFactors<'a> {
    /// `A`.
    pub a: &'a Tensor,
    /// `B`.
    pub b: &'a Tensor,
    /// `s = alpha / r` (or rsLoRA's).
    pub scale: f32,
}

/// `y[t] + s_k · (x[t] A_k^T) B_k^T` for each row `t` whose slot `k = slots[t]` holds an
/// adapter (`adapters[k]`; `None`, a negative slot or one past the table: `y[t]` as it is):
/// `x: [T, in]`, `y: [T, out]` of any float dtypes, the result in `y`'s dtype. `u = x A^T` and
/// `u B^T` are summed in f32, the scaled product added to `y` in f32 and rounded once.
///
/// Errors: shapes that disagree (`x`, `y`, `slots` not `T` rows; a factor not `[r, in]` /
/// `[out, r]` of one rank `r <= 128`, or not f32), operands on different devices.
pub fn lora_product(x: &Tensor, y: &Tensor, adapters: &[Option<LoraFactors<'_>>], slots: &[i32]) -> Result<Tensor> {
    let (&[t, width], &[ty, out]) = (x.dims(), y.dims()) else {
        return Err(Error::RankMismatch { op: OP, expected: "2 ([rows, features])", dims: x.dims().to_vec() });
    };
    let bad = |why: String| Error::InvalidArgument { op: OP, why };
    if ty != t || slots.len() != t {
        return Err(bad(format!("{t} rows of x, {ty} of y and {} slots", slots.len())));
    }
    let mut rank = None;
    for (k, f) in adapters.iter().enumerate() {
        let Some(f) = f else { continue };
        let &[r, w] = f.a.dims() else { return Err(bad(format!("slot {k}'s A is {:?}", f.a.dims()))) };
        if w != width || f.b.dims() != [out, r] || rank.is_some_and(|x| x != r) || r == 0 || r > 128 {
            return Err(bad(format!(
                "slot {k}: A {:?} and B {:?} do not fit x [{t}, {width}] -> y [{t}, {out}] at one rank <= 128",
                f.a.dims(),
                f.b.dims()
            )));
        }
        if f.a.dtype() != DType::F32 || f.b.dtype() != DType::F32 {
            return Err(bad(format!("slot {k}'s factors must be f32")));
        }
        if f.a.device() != x.device() || f.b.device() != x.device() || y.device() != x.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: x.device(), rhs: f.a.device() });
        }
        rank = Some(r);
    }
    let Some(r) = rank else { return Ok(y.clone()) };
    if let (Storage::Cuda(xs), Storage::Cuda(ys)) = (x.storage(), y.storage()) {
        fn cuda_of(t: &Tensor) -> Option<&crate::storage::CudaStorage> {
            match t.storage() {
                Storage::Cuda(s) => Some(s),
                _ => None,
            }
        }
        let factors: Vec<Option<cuda::LoraDeviceFactors<'_>>> =
            adapters.iter().map(|f| f.and_then(|f| Some((cuda_of(f.a)?, cuda_of(f.b)?, f.scale)))).collect();
        let out_s = cuda::lora_product(xs, ys, &factors, slots, (t, width, out, r))?;
        return Ok(Tensor::from_cuda(Shape::new(&[t, out])?, out_s));
    }
    let xv = x.to_dtype(DType::F32)?.to_vec::<f32>()?;
    let mut yv = y.to_dtype(DType::F32)?.to_vec::<f32>()?;
    // Each slot's (A, B, scale) on the host.
    type HostFactors = Option<(Vec<f32>, Vec<f32>, f32)>;
    let hosts: Vec<HostFactors> = adapters
        .iter()
        .map(|f| f.map(|f| Ok::<_, Error>((f.a.to_vec::<f32>()?, f.b.to_vec::<f32>()?, f.scale))).transpose())
        .collect::<Result<_>>()?;
    let mut u = vec![0f32; r];
    for (row, &k) in slots.iter().enumerate() {
        let Some(Some((a, b, s))) = usize::try_from(k).ok().and_then(|k| hosts.get(k)) else { continue };
        let xr = &xv[row * width..(row + 1) * width];
        for (i, ui) in u.iter_mut().enumerate() {
            *ui = xr.iter().zip(&a[i * width..(i + 1) * width]).fold(0f32, |acc, (&p, &q)| p.mul_add(q, acc));
        }
        for (c, yc) in yv[row * out..(row + 1) * out].iter_mut().enumerate() {
            let d = u.iter().zip(&b[c * r..(c + 1) * r]).fold(0f32, |acc, (&p, &q)| p.mul_add(q, acc));
            *yc += s * d;
        }
    }
    Tensor::from_vec(yv, &[t, out], &Device::Cpu)?.to_dtype(y.dtype())
}
