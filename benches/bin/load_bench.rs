//! `tp-load-bench`: checkpoint loading time against the number of tensors, to show that
//! opening a checkpoint and loading its tensors costs the same per tensor at any count.
//!
//! For each count N of `--sizes` it writes N small f32 tensors (4 elements each) once as one
//! `model.safetensors` and once over `--files` shard files with a `model.safetensors.index.json`,
//! then times `Checkpoint::open` and a `Checkpoint::load` of every tensor (or of `--sample`
//! tensors spread evenly over the names), checking each loaded value. It prints the time per
//! tensor of each step: flat across N means linear in the tensor count.
//!
//! Usage: `tp-load-bench [--sizes 1000,10000,100000] [--files 100] [--sample N] [--dir DIR]`.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tp_core::{Device, Tensor};
use tp_layers::{Checkpoint, save};

fn main() {
    if let Err(e) = run() {
        eprintln!("tp-load-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let (mut sizes, mut files, mut sample, mut dir) = (vec![1_000, 10_000, 100_000], 100usize, None, None);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().context("flag needs a value");
        match a.as_str() {
            "--sizes" => sizes = val()?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?,
            "--files" => files = val()?.parse()?,
            "--sample" => sample = Some(val()?.parse::<usize>()?),
            "--dir" => dir = Some(PathBuf::from(val()?)),
            other => bail!("unknown argument {other:?}"),
        }
    }
    if files == 0 || sizes.contains(&0) || sample == Some(0) {
        bail!("--sizes, --files and --sample must be positive");
    }
    let root = dir.unwrap_or_else(|| std::env::temp_dir().join(format!("tp-load-bench-{}", std::process::id())));
    println!(
        "{:<7} {:>8} {:>6} {:>10} {:>14} {:>8} {:>10} {:>14}",
        "layout", "tensors", "files", "open (ms)", "open us/tensor", "loaded", "load (ms)", "load us/tensor"
    );
    for &n in &sizes {
        let at = root.join(n.to_string());
        std::fs::create_dir_all(&at).with_context(|| format!("creating {}", at.display()))?;
        let (single, index) = write_checkpoints(&at, n, files)?;
        for (layout, path, nfiles) in [("single", &single, 1), ("index", &index, files.min(n))] {
            let (open, load, loaded) = time_load(path, n, sample)?;
            println!(
                "{:<7} {:>8} {:>6} {:>10.1} {:>14.2} {:>8} {:>10.1} {:>14.2}",
                layout,
                n,
                nfiles,
                open * 1e3,
                open * 1e6 / n as f64,
                loaded,
                load * 1e3,
                load * 1e6 / loaded as f64
            );
        }
        std::fs::remove_dir_all(&at).with_context(|| format!("removing {}", at.display()))?;
    }
    Ok(())
}

/// Name of tensor `i`, in the shape of a Hugging Face name.
fn name(i: usize) -> String {
    format!("model.layers.{}.block{}.weight", i / 16, i % 16)
}

/// Writes tensors `0..n` (tensor `i` holds `[i; 4]`) as `dir/model.safetensors` and over `files`
/// shards in `dir/sharded/` with an index; returns the file and the index.
fn write_checkpoints(dir: &Path, n: usize, files: usize) -> Result<(PathBuf, PathBuf)> {
    let cpu = Device::Cpu;
    let tensors: Vec<(String, Tensor)> =
        (0..n).map(|i| Ok((name(i), Tensor::from_vec(vec![i as f32; 4], &[4], &cpu)?))).collect::<Result<_>>()?;
    let single = dir.join("model.safetensors");
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    save(&single, &refs)?;
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded)?;
    let files = files.min(n);
    let mut weight_map = Vec::with_capacity(n);
    for f in 0..files {
        let file = format!("model-{:05}-of-{files:05}.safetensors", f + 1);
        let part: Vec<(&str, &Tensor)> = refs.iter().skip(f).step_by(files).copied().collect();
        save(sharded.join(&file), &part)?;
        // Plain ASCII names: no JSON escaping needed.
        weight_map.extend(part.iter().map(|(n, _)| format!("\"{n}\":\"{file}\"")));
    }
    let index = sharded.join("model.safetensors.index.json");
    std::fs::write(&index, format!("{{\"metadata\":{{}},\"weight_map\":{{{}}}}}", weight_map.join(",")))?;
    Ok((single, index))
}

/// Seconds to open `path`, seconds to load the sampled tensors, and how many were loaded.
fn time_load(path: &Path, n: usize, sample: Option<usize>) -> Result<(f64, f64, usize)> {
    let t = Instant::now();
    let ckpt = Checkpoint::open(path)?;
    let open = t.elapsed().as_secs_f64();
    let take = sample.unwrap_or(n).min(n);
    let picked: Vec<usize> = (0..take).map(|k| k * n / take).collect();
    let names: Vec<String> = picked.iter().map(|&i| name(i)).collect();
    let t = Instant::now();
    let mut loaded = Vec::with_capacity(take);
    for name in &names {
        loaded.push(ckpt.load(name, None, &Device::Cpu)?);
    }
    let load = t.elapsed().as_secs_f64();
    for (&i, t) in picked.iter().zip(&loaded) {
        if t.to_vec::<f32>()? != vec![i as f32; 4] {
            bail!("{} loaded wrong values", name(i));
        }
    }
    Ok((open, load, take))
}
