//! The book (`docs/`, an mdBook): `cargo xtask test` builds it into `target/book/` with the
//! pinned `mdbook`, installed from crates.io into `target/mdbook/` the first time (a few
//! minutes, once), and checks that `cargo doc` documents every public item without a warning.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// The `mdbook` release the book is built with.
const MDBOOK_VERSION: &str = "0.4.40";

/// The pinned `mdbook` binary, installed when missing.
fn ensure_mdbook(cargo: &str) -> Result<PathBuf> {
    let root = crate::workspace_root().join("target/mdbook");
    let bin = root.join("bin/mdbook");
    let version_ok = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(MDBOOK_VERSION));
    if version_ok {
        return Ok(bin);
    }
    let root_arg = root.to_string_lossy().into_owned();
    crate::run_step(
        cargo,
        &[
            "install",
            "mdbook",
            "--version",
            MDBOOK_VERSION,
            "--locked",
            "--no-default-features",
            "--features",
            "search",
            "--root",
            &root_arg,
        ],
    )
    .context("installing mdbook")?;
    Ok(bin)
}

/// Builds the book (its HTML goes to `target/book/`) and runs `cargo doc --no-deps` with every
/// warning an error (broken intra-doc links, missing docs where a crate asks for them).
pub fn check(cargo: &str) -> Result<()> {
    let mdbook = ensure_mdbook(cargo)?;
    let docs = crate::workspace_root().join("docs").to_string_lossy().into_owned();
    crate::run_step(&mdbook.to_string_lossy(), &["build", &docs])?;
    if !crate::workspace_root().join("target/book/index.html").exists() {
        bail!("mdbook build wrote no target/book/index.html");
    }
    println!("\n==> RUSTDOCFLAGS=-D warnings {cargo} doc --workspace --no-deps");
    let status = crate::command(cargo, &["doc", "--workspace", "--no-deps", "--locked"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .status()
        .context("cannot start cargo doc")?;
    if !status.success() {
        bail!("cargo doc --no-deps found warnings ({status})");
    }
    Ok(())
}
