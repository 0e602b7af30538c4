//! Which host kernel family runs: CPU detection, the `TP_CPU_KERNEL` setting, and a per-call
//! override for tests and benchmarks.
//!
//! The families form a ladder, best first: [`CpuKernel::Amx`] > [`CpuKernel::Avx512Bf16`] >
//! [`CpuKernel::Avx512`] > [`CpuKernel::Avx2`] > [`CpuKernel::Portable`]. Choosing one caps every
//! operation at that rung: each dtype runs the best code at or below it (AMX has no `f32`
//! instruction, so `f32` products under `Amx` run the AVX-512 kernel; `bf16` under `Avx512`
//! widens to `f32` and runs the AVX-512 `f32` kernel). [`CpuKernel::AmxEmulated`] is the AMX
//! path driven through a software model of the tile instructions; it is never chosen
//! automatically and exists so that machines without AMX test the AMX code's tiling.
//!
//! The integer dot products of quantized weights ([`crate::quant`]) map onto the same ladder:
//! AVX512-VNNI from the AVX-512 rung up (where the CPU has VNNI; else AVX2), AVX2 on the AVX2
//! rung, plain Rust on the portable one.

use crate::element::FloatKind;
use crate::error::Error;
use crate::features::features;
use crate::tiles::Tiles;
use std::cell::Cell;
use std::sync::OnceLock;

/// A family of host kernels. See the module docs for how each dtype maps onto it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuKernel {
    /// Plain Rust, no instruction-set assumption beyond the target's baseline.
    Portable,
    /// AVX2 + FMA + F16C: the portable kernels compiled for them.
    Avx2,
    /// AVX-512 F/BW/VL + FMA + F16C: hand-written `f32` micro-kernels; `f16`/`bf16` widened to `f32`
    /// while packing.
    Avx512,
    /// AVX-512 plus AVX512-BF16: `bf16` products with `vdpbf16ps` (pairs of `bf16` multiplied
    /// exactly and added into `f32`).
    Avx512Bf16,
    /// Intel AMX tiles: `bf16` with `tdpbf16ps`, `f16` with `tdpfp16ps` where the CPU has AMX-FP16.
    Amx,
    /// The AMX code path over a software model of the tile instructions (slow; for tests).
    AmxEmulated,
}

impl CpuKernel {
    /// Every family, best first (the emulation last).
    pub const ALL: [CpuKernel; 6] = [
        CpuKernel::Amx,
        CpuKernel::Avx512Bf16,
        CpuKernel::Avx512,
        CpuKernel::Avx2,
        CpuKernel::Portable,
        CpuKernel::AmxEmulated,
    ];

    /// The name `TP_CPU_KERNEL` accepts.
    pub const fn as_str(self) -> &'static str {
        match self {
            CpuKernel::Portable => "portable",
            CpuKernel::Avx2 => "avx2",
            CpuKernel::Avx512 => "avx512",
            CpuKernel::Avx512Bf16 => "avx512bf16",
            CpuKernel::Amx => "amx",
            CpuKernel::AmxEmulated => "amx-emulated",
        }
    }

    /// Position on the ladder (higher is better). The emulation has none of its own: see
    /// [`CpuKernel::base`].
    const fn rung(self) -> u8 {
        match self {
            CpuKernel::Portable => 0,
            CpuKernel::Avx2 => 1,
            CpuKernel::Avx512 => 2,
            CpuKernel::Avx512Bf16 | CpuKernel::AmxEmulated => 3,
            CpuKernel::Amx => 4,
        }
    }

    /// The family that runs what this one has no tiles for: itself, except for the emulation,
    /// which runs everything else on the best real family up to AVX512-BF16.
    fn base(self) -> CpuKernel {
        match self {
            CpuKernel::AmxEmulated => [CpuKernel::Avx512Bf16, CpuKernel::Avx512, CpuKernel::Avx2]
                .into_iter()
                .find(|k| k.is_available())
                .unwrap_or(CpuKernel::Portable),
            k => k,
        }
    }

    /// Whether this CPU (and OS) can run the family. For [`CpuKernel::Amx`] this includes the
    /// Linux permission to use the tile state, requested once.
    pub fn is_available(self) -> bool {
        let f = features();
        match self {
            CpuKernel::Portable | CpuKernel::AmxEmulated => true,
            CpuKernel::Avx2 => f.avx2,
            CpuKernel::Avx512 => f.avx512,
            CpuKernel::Avx512Bf16 => f.avx512 && f.avx512bf16,
            CpuKernel::Amx => f.avx512 && f.avx512bf16 && f.amx_bf16,
        }
    }

    /// The families this machine can run, best first (the emulation, always available, last).
    pub fn available() -> Vec<CpuKernel> {
        Self::ALL.into_iter().filter(|k| k.is_available()).collect()
    }

    /// The best family available.
    pub fn best() -> CpuKernel {
        Self::ALL.into_iter().find(|k| k.is_available()).unwrap_or(CpuKernel::Portable)
    }

    /// The kernel that runs in the calling thread: a [`with_kernel`] override if one is active,
    /// else `TP_CPU_KERNEL` (read once), else [`CpuKernel::best`].
    pub fn current() -> CpuKernel {
        OVERRIDE.with(Cell::get).unwrap_or_else(configured)
    }

    /// `f32` micro-kernels: AVX-512 from the AVX-512 rung up.
    pub(crate) fn f32_isa(self) -> Isa {
        match self.base().rung() {
            0 => Isa::Portable,
            1 => Isa::Avx2,
            _ => Isa::Avx512,
        }
    }

    /// Whether `bf16` products use `vdpbf16ps` (AVX512-BF16 and above; the AMX paths use it for
    /// the decode-shaped products AMX tiles do not suit).
    pub(crate) fn has_bf16_dot(self) -> bool {
        self.base().rung() >= 3
    }

    /// The integer kernels of quantized products ([`crate::quant`]): AVX512-VNNI from the AVX-512
    /// rung up where the CPU has it, else AVX2 from the AVX2 rung up, else portable.
    pub(crate) fn int8_isa(self) -> Int8Isa {
        match self.base().rung() {
            0 => Int8Isa::Portable,
            1 => Int8Isa::Avx2,
            _ if features().avx512vnni => Int8Isa::Avx512Vnni,
            _ => Int8Isa::Avx2,
        }
    }

    /// Which tile engine runs products of `kind`, if any.
    pub(crate) fn tiles_for(self, kind: FloatKind) -> Option<Tiles> {
        match (self, kind) {
            (CpuKernel::Amx, FloatKind::BF16) => Some(Tiles::Hardware),
            (CpuKernel::Amx, FloatKind::F16) if features().amx_fp16 => Some(Tiles::Hardware),
            (CpuKernel::AmxEmulated, FloatKind::BF16 | FloatKind::F16) => Some(Tiles::Emulated),
            _ => None,
        }
    }
}

impl std::fmt::Display for CpuKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for CpuKernel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CpuKernel::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            let names: Vec<_> = CpuKernel::ALL.iter().map(|k| k.as_str()).collect();
            format!("unknown CPU kernel {s:?}; expected auto or one of {}", names.join(", "))
        })
    }
}

/// The instruction set a portable-or-vector kernel body is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    Portable,
    Avx2,
    Avx512,
}

/// The instruction set of the integer (8-bit) dot products of quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int8Isa {
    /// Plain Rust.
    Portable,
    /// AVX2: `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// AVX512-VNNI (256-bit forms): `vpdpbusd`.
    Avx512Vnni,
}

thread_local! {
    static OVERRIDE: Cell<Option<CpuKernel>> = const { Cell::new(None) };
}

/// Runs `f` with `kernel` as this thread's host kernel family (the threads a product fans out to
/// follow the calling thread's choice). For tests and benchmarks that compare paths.
///
/// Errors: [`Error::KernelUnavailable`] if this CPU cannot run `kernel`.
pub fn with_kernel<R>(kernel: CpuKernel, f: impl FnOnce() -> R) -> crate::Result<R> {
    if !kernel.is_available() {
        return Err(Error::KernelUnavailable { kernel: kernel.as_str(), why: unavailable_reason(kernel) });
    }
    struct Restore(Option<CpuKernel>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(kernel))));
    Ok(f())
}

fn unavailable_reason(kernel: CpuKernel) -> String {
    let f = features();
    match kernel {
        CpuKernel::Amx if f.amx_bf16_cpu && !f.amx_bf16 => {
            "the CPU has AMX-BF16 but the OS refused the tile-data permission (arch_prctl)".into()
        }
        _ => format!("this CPU lacks the instructions {} needs", kernel.as_str()),
    }
}

/// `TP_CPU_KERNEL` (`auto` or a family name), read once; an unavailable family falls back to the
/// best available one below it, with a warning on stderr.
fn configured() -> CpuKernel {
    static K: OnceLock<CpuKernel> = OnceLock::new();
    *K.get_or_init(|| {
        let best = CpuKernel::best();
        let Ok(v) = std::env::var("TP_CPU_KERNEL") else { return best };
        if v.is_empty() || v == "auto" {
            return best;
        }
        match v.parse::<CpuKernel>() {
            Ok(k) if k.is_available() => k,
            Ok(k) => {
                let below = CpuKernel::ALL
                    .into_iter()
                    .find(|c| c.is_available() && c.rung() <= k.rung() && *c != CpuKernel::AmxEmulated)
                    .unwrap_or(CpuKernel::Portable);
                eprintln!("tp-core: TP_CPU_KERNEL={v}: {}; using {below}", unavailable_reason(k));
                below
            }
            Err(e) => {
                eprintln!("tp-core: TP_CPU_KERNEL: {e}; using {best}");
                best
            }
        }
    })
}
