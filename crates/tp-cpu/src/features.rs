//! What the CPU and the OS offer the kernels, detected once: AVX2/FMA/F16C, AVX-512 (F, BW, VL,
//! DQ), AVX512-BF16, AVX512-VNNI, and Intel AMX (CPUID, the OS's tile state in XCR0, and Linux's
//! permission to use it, requested here).

use std::sync::OnceLock;

/// What the CPU and OS offer, detected once.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Features {
    pub(crate) avx2: bool,
    pub(crate) avx512: bool,
    pub(crate) avx512bf16: bool,
    /// AVX512-VNNI (`vpdpbusd`, `vpdpwssd`), with AVX-512 F/BW/VL.
    pub(crate) avx512vnni: bool,
    /// AMX-TILE + AMX-BF16 per CPUID, OS state enabled and permission granted.
    pub(crate) amx_bf16: bool,
    /// AMX-BF16 per CPUID alone (to explain a refused permission).
    pub(crate) amx_bf16_cpu: bool,
    /// AMX-FP16 usable (implies `amx_bf16`).
    pub(crate) amx_fp16: bool,
}

/// The features of this machine (detected on the first call; AMX's permission requested then).
pub(crate) fn features() -> Features {
    static F: OnceLock<Features> = OnceLock::new();
    *F.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Features {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq");
    let avx512bf16 = avx512 && has!("avx512bf16");
    let avx512vnni = avx512 && has!("avx512vnni");
    let amx = detect_amx();
    Features {
        avx2,
        avx512,
        avx512bf16,
        avx512vnni,
        amx_bf16: amx.usable,
        amx_bf16_cpu: amx.cpu_bf16,
        amx_fp16: amx.usable && amx.cpu_fp16,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Features {
    Features::default()
}

/// What CPUID and the OS say about AMX.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, Default)]
struct Detected {
    /// AMX-TILE and AMX-BF16 present, tile state enabled by the OS, permission granted.
    usable: bool,
    cpu_bf16: bool,
    cpu_fp16: bool,
}

/// Detects AMX and, when the CPU has it, asks Linux for permission to use the tile data state
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; without it the first tile
/// instruction faults). Called once, from [`features`].
#[cfg(target_arch = "x86_64")]
fn detect_amx() -> Detected {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // `__cpuid` is a safe function in newer Rust and an unsafe one in older releases.
    // SAFETY: CPUID exists on every x86_64 CPU; leaves above the maximum are never queried.
    #[allow(unused_unsafe)]
    let (max_leaf, l1) = unsafe { (__cpuid(0).eax, __cpuid(1)) };
    if max_leaf < 7 {
        return Detected::default();
    }
    // SAFETY: as above (leaf 7 is at most the maximum leaf).
    #[allow(unused_unsafe)]
    let (l7, l7_1) = unsafe { (__cpuid_count(7, 0), __cpuid_count(7, 1)) };
    let cpu_tile = (l7.edx >> 24) & 1 == 1; // AMX-TILE
    let cpu_bf16 = (l7.edx >> 22) & 1 == 1; // AMX-BF16
    let cpu_fp16 = (l7_1.eax >> 21) & 1 == 1; // AMX-FP16
    let osxsave = (l1.ecx >> 27) & 1 == 1;
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves and restores the tile state.
    // SAFETY: OSXSAVE (checked first) means XGETBV is enabled and XCR0 readable.
    let os_tiles = osxsave && (unsafe { xcr0() } >> 17) & 0b11 == 0b11;
    let usable = cpu_tile && cpu_bf16 && os_tiles && request_permission();
    Detected { usable, cpu_bf16: cpu_tile && cpu_bf16, cpu_fp16: cpu_tile && cpu_fp16 }
}

/// # Safety
/// The CPU must have OSXSAVE set (XGETBV enabled).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller checked OSXSAVE; XCR0 (index 0) is always readable then.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_permission() -> bool {
    const SYS_ARCH_PRCTL: isize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) takes two integers, touches no
    // user memory, and only extends this process's permitted XSAVE features; the `syscall`
    // instruction clobbers rcx and r11, declared here.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack, preserves_flags)
        );
    }
    ret == 0
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_permission() -> bool {
    false
}
