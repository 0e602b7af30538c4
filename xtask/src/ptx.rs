//! `cargo xtask ptx`: the `ptxas -v` resource report of every kernel for every target
//! architecture, failing if any kernel spills registers or uses a stack frame; then the SASS
//! (cuobjdump) of the GEMM kernels, failing unless each uses the instructions it exists for:
//! `HMMA` (mma.sync) and, on sm_90a, `HGMMA` (wgmma) with `UTMALDG` (TMA loads); and the SASS
//! of the quantized-weight kernels, failing on any 32-bit global load (ggml blocks are only
//! 2-byte aligned: a pair of 16-bit loads merged into one 32-bit load would fault).

use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;

/// Architectures checked, as the build compiles them.
const ARCHS: &[&str] = &["sm_80", "sm_90a"];

/// (kernel file stem, arch, SASS mnemonics that must appear).
const SASS_EXPECT: &[(&str, &str, &[&str])] = &[
    // LDSM.16.MT88: ldmatrix.trans, how the kn and tn layouts read their [K][rows] tiles.
    ("gemm_mma", "sm_80", &["HMMA.16816.F32.BF16", "LDSM", "LDSM.16.MT88", "LDGSTS"]),
    ("gemm_mma", "sm_90a", &["HMMA.16816.F32.BF16", "LDSM", "LDSM.16.MT88", "LDGSTS"]),
    ("gemm_wgmma", "sm_90a", &["HGMMA.64x128x16.F32.BF16", "UTMALDG.2D", "SYNCS", "USETMAXREG"]),
];

/// (kernel file stem, widest global load allowed in bits); 32-bit loads are refused in each.
/// The quant kernels read ggml blocks, which are only 2-byte aligned, with 8- and 16-bit loads:
/// `quant_dequant` loads nothing else; `quant_gemv` also loads 4 activations at a time (64 or
/// 128 bits, aligned), so there only 32-bit loads, which can only be weights, are refused.
const SASS_LOADS: &[(&str, u32)] = &[("quant_dequant", 16), ("quant_gemv", 128)];

/// One kernel's figures from ptxas.
#[derive(Debug, Default)]
struct Report {
    kernel: String,
    arch: String,
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    smem: u32,
}

pub fn run(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("cargo xtask ptx takes no arguments (got {a:?})");
    }
    let nvcc = crate::cuda::ensure_nvcc()?;
    check(&nvcc)
}

/// Prints the report and fails on spills or stack frames.
pub fn check(nvcc: &Path) -> Result<()> {
    let dir = crate::workspace_root().join("kernels");
    let mut sources: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let tmp = crate::workspace_root().join("target/ptx-check");
    std::fs::create_dir_all(&tmp)?;
    let mut reports = Vec::new();
    for src in &sources {
        for arch in ARCHS {
            let out = tmp.join(format!("{}.{arch}.cubin", src.file_stem().and_then(|s| s.to_str()).unwrap_or("k")));
            let o = Command::new(nvcc)
                .args(["-cubin", &format!("-arch={arch}"), "-O3", "-std=c++17", "-Xptxas", "-v", "-I"])
                .arg(&dir)
                .arg("-o")
                .arg(&out)
                .arg(src)
                .output()
                .with_context(|| format!("cannot run {}", nvcc.display()))?;
            let text = String::from_utf8_lossy(&o.stderr);
            if !o.status.success() {
                bail!("nvcc failed on {} for {arch}:\n{text}", src.display());
            }
            // ptxas's C7510: a function call made it serialise wgmma (the pipeline is lost).
            if let Some(line) = text.lines().find(|l| l.contains("C7510")) {
                bail!("{} for {arch}: {}", src.display(), line.trim());
            }
            reports.extend(parse(&text, arch));
        }
    }
    println!(
        "{:<36} {:<7} {:>5} {:>6} {:>7} {:>7} {:>7}",
        "kernel", "arch", "regs", "stack", "spill-st", "spill-ld", "smem"
    );
    let mut bad = Vec::new();
    for r in &reports {
        println!(
            "{:<36} {:<7} {:>5} {:>6} {:>7} {:>7} {:>7}",
            r.kernel, r.arch, r.registers, r.stack, r.spill_stores, r.spill_loads, r.smem
        );
        if r.stack > 0 || r.spill_stores > 0 || r.spill_loads > 0 {
            bad.push(format!("{} ({})", r.kernel, r.arch));
        }
    }
    if reports.is_empty() {
        bail!("ptxas reported no kernels in {}", dir.display());
    }
    if !bad.is_empty() {
        bail!("kernels with spills or a stack frame: {}", bad.join(", "));
    }
    println!("ptx: {} kernel builds, no spills, no stack frames", reports.len());
    check_register_split(&reports)?;
    check_sass(&tmp)
}

/// The Hopper GEMM's setmaxnreg split (launch_config.cuh) against the registers ptxas gave it:
/// the producer warpgroup may only shrink (`P <= R`), the consumers only grow (`C >= R`), and
/// what they end with must fit what the block was launched with (`128 P + 256 C <= 384 R`,
/// itself at most the SM's 65536);
/// setmaxnreg counts are multiples of 8 in 24..=256.
fn check_register_split(reports: &[Report]) -> Result<()> {
    let header = crate::workspace_root().join("kernels/launch_config.cuh");
    let text = std::fs::read_to_string(&header).with_context(|| format!("cannot read {}", header.display()))?;
    let consts = crate::launch_consts::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", header.display()))?;
    let get = |name: &str| {
        consts
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .with_context(|| format!("{name} missing from {}", header.display()))
    };
    let (p, c, threads) = (get("WGMMA_PRODUCER_REGS")?, get("WGMMA_CONSUMER_REGS")?, get("WGMMA_THREADS")?);
    let kernels: Vec<&Report> =
        reports.iter().filter(|r| r.arch == "sm_90a" && r.kernel.starts_with("tp_gemm_wgmma")).collect();
    if kernels.is_empty() {
        bail!("ptxas reported no tp_gemm_wgmma kernel for sm_90a");
    }
    for r in kernels {
        let regs = r.registers;
        let problems = split_problems(p, c, threads, regs);
        if !problems.is_empty() {
            bail!(
                "{}: setmaxnreg {p}/{c} does not fit the {regs} registers ptxas reports: {}",
                r.kernel,
                problems.join("; ")
            );
        }
        println!(
            "setmaxnreg {}: producer {p} <= {regs} <= consumers {c}, 128x{p} + 256x{c} <= {threads}x{regs}",
            r.kernel
        );
    }
    Ok(())
}

/// What is wrong with a producer/consumer split of `p`/`c` registers for a block of `threads`
/// launched with `regs` per thread (empty when it is sound).
fn split_problems(p: u32, c: u32, threads: u32, regs: u32) -> Vec<String> {
    let mut v = Vec::new();
    for (what, n) in [("producer", p), ("consumer", c)] {
        if n % 8 != 0 || !(24..=256).contains(&n) {
            v.push(format!("the {what} count {n} is not a multiple of 8 in 24..=256"));
        }
    }
    if p > regs {
        v.push(format!("the producer cannot shrink to {p} from {regs}"));
    }
    if c < regs {
        v.push(format!("the consumers cannot grow to {c} from {regs}"));
    }
    if threads * regs > 65536 {
        v.push(format!("{threads}x{regs} registers exceed the 65536 of an SM"));
    }
    if threads != 384 || 128 * p + 256 * c > threads * regs {
        v.push(format!("128x{p} + 256x{c} = {} exceeds {threads}x{regs} = {}", 128 * p + 256 * c, threads * regs));
    }
    v
}

/// Disassembles the GEMM cubins and checks each uses its instructions, then the quant kernels'
/// global load widths.
fn check_sass(cubins: &Path) -> Result<()> {
    let tools = crate::cuda::ensure_sass_tools()?;
    let path = format!("{}:{}", tools.display(), std::env::var("PATH").unwrap_or_default());
    let disassemble = |stem: &str, arch: &str| -> Result<String> {
        let cubin = cubins.join(format!("{stem}.{arch}.cubin"));
        let out = Command::new(tools.join("cuobjdump"))
            .arg("-sass")
            .arg(&cubin)
            .env("PATH", &path)
            .output()
            .with_context(|| format!("cannot run cuobjdump on {}", cubin.display()))?;
        let sass = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() || sass.trim().is_empty() {
            bail!("cuobjdump failed on {}: {}", cubin.display(), String::from_utf8_lossy(&out.stderr));
        }
        Ok(sass)
    };
    for (stem, arch, needles) in SASS_EXPECT {
        let sass = disassemble(stem, arch)?;
        let counts: Vec<String> = needles.iter().map(|n| format!("{n} x{}", sass.matches(n).count())).collect();
        println!("sass {stem} {arch}: {}", counts.join(", "));
        if let Some(missing) = needles.iter().find(|n| !sass.contains(**n)) {
            bail!("{stem} for {arch} has no {missing} in its SASS");
        }
    }
    for &(stem, widest) in SASS_LOADS {
        for arch in ARCHS {
            let widths = global_load_widths(&disassemble(stem, arch)?);
            let mut counts: Vec<(u32, usize)> = Vec::new();
            for &w in &widths {
                match counts.iter_mut().find(|(x, _)| *x == w) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((w, 1)),
                }
            }
            counts.sort();
            let shown: Vec<String> = counts.iter().map(|(w, n)| format!("{w}-bit x{n}")).collect();
            println!("sass {stem} {arch}: global loads {}", shown.join(", "));
            if widths.is_empty() {
                bail!("{stem} for {arch}: no global loads found in its SASS (did the disassembly change?)");
            }
            if let Some(w) = widths.iter().find(|&&w| w > widest || w == 32) {
                bail!("{stem} for {arch} has a {w}-bit global load: its ggml blocks are only 2-byte aligned");
            }
        }
    }
    Ok(())
}

/// The width in bits of every global load (`LDG...`) of a SASS listing: the opcode's `U8`/`S8`,
/// `U16`/`S16`, `64` or `128` part, 32 when it has none.
fn global_load_widths(sass: &str) -> Vec<u32> {
    sass.split_whitespace()
        .filter(|t| *t == "LDG" || t.starts_with("LDG."))
        .map(|t| {
            let parts: Vec<&str> = t.split('.').collect();
            let has = |p: &str| parts.contains(&p);
            if has("U8") || has("S8") {
                8
            } else if has("U16") || has("S16") {
                16
            } else if has("64") {
                64
            } else if has("128") {
                128
            } else {
                32
            }
        })
        .collect()
}

/// Parses `ptxas -v` output: "Compiling entry function 'X' for 'sm_90a'", then "N bytes stack
/// frame, N bytes spill stores, N bytes spill loads", then "Used N registers, ... N bytes smem".
fn parse(text: &str, arch: &str) -> Vec<Report> {
    let num_before = |line: &str, label: &str| -> u32 {
        line.split(',')
            .find(|p| p.contains(label))
            .and_then(|p| p.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    let mut out: Vec<Report> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or("?").to_string();
            out.push(Report { kernel, arch: arch.into(), ..Default::default() });
        } else if let Some(r) = out.last_mut() {
            if line.contains("stack frame") {
                r.stack = num_before(line, "stack frame");
                r.spill_stores = num_before(line, "spill stores");
                r.spill_loads = num_before(line, "spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                r.registers = line
                    .split("Used")
                    .nth(1)
                    .and_then(|s| s.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                r.smem = num_before(line, "smem");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn register_split_rules() {
        assert!(super::split_problems(40, 232, 384, 168).is_empty(), "today's split");
        assert!(!super::split_problems(40, 232, 384, 176).is_empty(), "a block that cannot launch");
        assert!(!super::split_problems(40, 240, 384, 168).is_empty(), "consumers ending with more than the block has");
        assert!(!super::split_problems(40, 160, 384, 168).is_empty(), "consumers below the launch count");
        assert!(!super::split_problems(180, 232, 384, 168).is_empty(), "producer above it");
        assert!(!super::split_problems(41, 232, 384, 168).is_empty(), "not a multiple of 8");
    }

    #[test]
    fn reads_global_load_widths_from_sass() {
        let sass = "/*0040*/ LDG.E.U16.CONSTANT R2, desc[UR4][R2.64] ;\n\
                    /*0050*/ LDG.E.128.CONSTANT R4, desc[UR4][R6.64] ;\n\
                    /*0060*/ @P0 LDG.E R9, desc[UR4][R10.64] ;\n\
                    /*0070*/ LDG.E.S8 R1, desc[UR4][R12.64] ;\n\
                    /*0080*/ LDG.E.64.CONSTANT R2, desc[UR4][R2.64] ;\n\
                    /*0090*/ STG.E.128 desc[UR4][R2.64], R4 ; LDS.U16 R0, [R1] ;";
        assert_eq!(super::global_load_widths(sass), vec![16, 128, 32, 8, 64]);
    }

    #[test]
    fn parses_ptxas_output() {
        let text = "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n\
                    ptxas info    : Function properties for k1\n    \
                    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                    ptxas info    : Used 141 registers, used 1 barriers, 16384 bytes smem, 408 bytes cmem[0]\n\
                    ptxas info    : Compiling entry function 'k2' for 'sm_90a'\n\
                    ptxas info    : Function properties for k2\n    \
                    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                    ptxas info    : Used 10 registers, used 0 barriers\n";
        let r = super::parse(text, "sm_90a");
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].kernel.as_str(), r[0].stack, r[0].spill_stores, r[0].spill_loads), ("k1", 8, 4, 12));
        assert_eq!((r[0].registers, r[0].smem), (141, 16384));
        assert_eq!((r[1].kernel.as_str(), r[1].registers, r[1].stack, r[1].smem), ("k2", 10, 0, 0));
    }
}
