//! The names of every kernel function tp launches, built from the same helpers the launchers
//! call, and the index of each: a [`Gpu`](crate::Gpu) keeps one lazily loaded slot per index,
//! so a launch looks its function up without a lock or a driver call after the first time.

use crate::elem::ElemType;
use crate::quant::{QUANT_FORMATS, QuantFormat};
use std::collections::HashMap;
use std::sync::LazyLock;

const FLOATS: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];
const HALVES: [ElemType; 2] = [ElemType::F16, ElemType::BF16];
const UNITS: [usize; 5] = [1, 2, 4, 8, 16];

/// `(module, function)` of every kernel, in a fixed order.
pub(crate) static ALL: LazyLock<Vec<(&'static str, String)>> = LazyLock::new(|| {
    let mut v: Vec<(&'static str, String)> = Vec::new();
    for u in UNITS {
        v.push(("shard_copy", format!("tp_row_copy_u{u}")));
        v.push(("shard_copy", format!("tp_gather_u{u}")));
        v.push(("paged_attention", format!("tp_write_slots_u{u}")));
    }
    for from in FLOATS {
        for to in FLOATS.into_iter().filter(|&t| t != from) {
            v.push(("cast", cast(from, to)));
        }
    }
    for t in FLOATS {
        v.push(("elementwise", format!("tp_glu_{}", t.name())));
        v.push(("elementwise", format!("tp_scale_{}", t.name())));
        v.push(("elementwise", format!("tp_softcap_{}", t.name())));
        v.push(("norm", format!("tp_sum_squares_{}", t.name())));
        v.push(("elementwise", format!("tp_add_row_{}", t.name())));
        v.push(("elementwise", format!("tp_add_{}", t.name())));
        v.push(("norm", format!("tp_rms_norm_{}", t.name())));
        v.push(("rope", format!("tp_rope_{}", t.name())));
        v.push(("attention", format!("tp_attention_{}", t.name())));
        v.push(("paged_attention", format!("tp_paged_attention_{}", t.name())));
        v.push(("sampling", format!("tp_penalize_{}", t.name())));
        v.push(("sampling", format!("tp_top_k_{}", t.name())));
        v.push(("sampling", format!("tp_row_max_sum_exp_{}", t.name())));
        v.push(("tokens", format!("tp_max_index_{}", t.name())));
        for id in [ElemType::I32, ElemType::I64] {
            v.push(("tokens", format!("tp_embedding_{}_{}", t.name(), id.name())));
        }
        for vec in [true, false] {
            v.push(("gemm_small_m", small_m(t, vec)));
        }
        // Training: the backward kernels, the cross-entropy pieces.
        for k in ["rms_norm_grad_dot", "rms_norm_backward", "col_sum", "rope_backward", "glu_backward"] {
            v.push(("grad", format!("tp_{k}_{}", t.name())));
        }
        v.push(("grad", format!("tp_softcap_backward_{}", t.name())));
        v.push(("grad", format!("tp_transpose_{}", t.name())));
        for id in [ElemType::I32, ElemType::I64] {
            v.push(("grad", format!("tp_embedding_backward_{}_{}", t.name(), id.name())));
        }
        for k in ["row_max", "cross_entropy_parts", "cross_entropy_backward"] {
            v.push(("loss", format!("tp_{k}_{}", t.name())));
        }
        v.push(("moe", format!("tp_moe_route_{}", t.name())));
        v.push(("moe", format!("tp_moe_combine_{}", t.name())));
        v.push(("lora", format!("tp_lora_shrink_{}", t.name())));
        v.push(("lora", format!("tp_lora_expand_{}", t.name())));
    }
    v.push(("grad", "tp_col_sum_finish".to_string()));
    v.push(("optim", "tp_adamw".to_string()));
    for nk in [true, false] {
        v.push(("gemm_simt", simt(nk)));
    }
    v.push(("gemm_simt", SIMT_TN.to_string()));
    for t in HALVES {
        for aligned in [true, false] {
            v.push(("gemm_mma", mma(t, aligned)));
            for layout in [MmaLayout::Kn, MmaLayout::Tn] {
                v.push(("gemm_mma", mma_layout(t, layout, aligned)));
            }
        }
        v.push(("gemm_wgmma", format!("tp_gemm_wgmma_{}", t.name())));
        for aligned in [true, false] {
            v.push(("gemm_mma", mma_grouped(t, aligned)));
        }
    }
    for q in QUANT_FORMATS {
        for t in [ElemType::F32, ElemType::BF16] {
            v.push(("quant_dequant", dequant(q, t)));
            v.push(("quant_gemv", quant_gemv(q, t)));
        }
    }
    v
});

/// Function name -> its index in [`ALL`].
pub(crate) static INDEX: LazyLock<HashMap<String, usize>> =
    LazyLock::new(|| ALL.iter().enumerate().map(|(i, (_, name))| (name.clone(), i)).collect());

pub(crate) fn cast(from: ElemType, to: ElemType) -> String {
    format!("tp_cast_{}_{}", from.name(), to.name())
}
pub(crate) fn small_m(t: ElemType, vec: bool) -> String {
    format!("tp_gemm_small_m_{}{}", t.name(), if vec { "" } else { "_unaligned" })
}
pub(crate) fn simt(nk: bool) -> String {
    (if nk { "tp_gemm_simt_f32_nk" } else { "tp_gemm_simt_f32_kn" }).to_string()
}
pub(crate) fn dequant(q: QuantFormat, t: ElemType) -> String {
    format!("tp_dequant_{}_{}", q.kernel_name(), t.name())
}
pub(crate) fn quant_gemv(q: QuantFormat, t: ElemType) -> String {
    format!("tp_quant_gemv_{}_{}", q.kernel_name(), t.name())
}
pub(crate) fn mma_grouped(t: ElemType, aligned: bool) -> String {
    format!("tp_gemm_mma_{}_grouped{}", t.name(), if aligned { "" } else { "_unaligned" })
}
pub(crate) fn mma(t: ElemType, aligned: bool) -> String {
    mma_layout(t, MmaLayout::Nk, aligned)
}

/// The SIMT GEMM's `C (+)= A^T B` kernel.
pub(crate) const SIMT_TN: &str = "tp_gemm_simt_f32_tn";

/// The layouts of `kernels/gemm_mma.cu`: `C = A B^T` (nk), `C = A B` (kn), `C (+)= A^T B` (tn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MmaLayout {
    Nk,
    Kn,
    Tn,
}

pub(crate) fn mma_layout(t: ElemType, layout: MmaLayout, aligned: bool) -> String {
    let l = match layout {
        MmaLayout::Nk => "nk",
        MmaLayout::Kn => "kn",
        MmaLayout::Tn => "tn",
    };
    format!("tp_gemm_mma_{}_{l}{}", t.name(), if aligned { "" } else { "_unaligned" })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_name_is_unique_and_in_a_compiled_module() {
        let names: std::collections::HashSet<&str> = super::ALL.iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(names.len(), super::ALL.len());
        let sources: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "cu"))
            .map(|e| e.path().file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        for (module, name) in super::ALL.iter() {
            assert!(sources.iter().any(|s| s == module), "{name}: no kernels/{module}.cu");
            // With nvcc present, the function's symbol is in the module's (uncompressed) fatbin.
            if let Some(m) = crate::modules::module(module) {
                let sym = format!(".text.{name}\0");
                assert!(m.fatbin.windows(sym.len()).any(|w| w == sym.as_bytes()), "{name} is not in {module}'s fatbin");
            }
        }
        if crate::modules::NOT_COMPILED.is_some() {
            eprintln!("note: built without nvcc; kernel symbols were not checked against the fatbins");
        }
    }
}
