//! The `sh` blocks of README.md and the book (`docs/src/*.md`) run as written against a real
//! `tp serve` (a small random model with a tool-call template), with `localhost:8000` pointed at
//! it: every one must exit 0. Blocks marked `sh no-run` (builds, launches, GPU work, servers)
//! are shown, not run; a block that starts `cargo`, `tp serve` or a launcher without that mark
//! fails the test, and so does a book with fewer runnable blocks than it had.

mod common;

use common::{Server, TOOLS_TEMPLATE, model_dir_with_len};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fenced block: its file, first line and text.
struct Block {
    file: PathBuf,
    line: usize,
    text: String,
}

/// The blocks whose info string is exactly `sh`, and how many are marked `sh no-run`.
fn sh_blocks(file: &Path) -> (Vec<Block>, usize) {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let (mut out, mut skipped) = (Vec::new(), 0);
    let mut open: Option<(String, usize, Vec<&str>)> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        match &mut open {
            None if t.starts_with("```") => open = Some((t[3..].trim().to_string(), i + 1, Vec::new())),
            None => {}
            Some((info, at, body)) if t.starts_with("```") => {
                if info == "sh" {
                    out.push(Block { file: file.to_path_buf(), line: *at, text: body.join("\n") });
                } else if info == "sh no-run" {
                    skipped += 1;
                }
                open = None;
            }
            Some((_, _, body)) => body.push(line),
        }
    }
    (out, skipped)
}

#[test]
fn every_runnable_sh_block_of_the_docs_works_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![root.join("README.md")];
    let mut book: Vec<PathBuf> = std::fs::read_dir(root.join("docs/src"))
        .expect("docs/src")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    book.sort();
    files.extend(book);
    let (mut blocks, mut skipped) = (Vec::new(), 0);
    for f in &files {
        let (b, s) = sh_blocks(f);
        blocks.extend(b);
        skipped += s;
    }
    for b in &blocks {
        for word in ["cargo ", "tp serve", "tp train", "torchrun", "srun ", "mpirun"] {
            assert!(
                !b.text.contains(word),
                "{}:{}: a runnable sh block runs `{word}`: mark it `sh no-run`",
                b.file.display(),
                b.line
            );
        }
    }
    assert!(blocks.len() >= 13, "only {} runnable sh blocks (and {skipped} not run)", blocks.len());
    let dir = model_dir_with_len(2048);
    let template = dir.join("tools.jinja");
    std::fs::write(&template, TOOLS_TEMPLATE).expect("template");
    let template = template.to_string_lossy().into_owned();
    let s = Server::start_in(&dir, &["--chat-template", &template, "-tp", "2"], &[]);
    for b in &blocks {
        let script = b.text.replace("localhost:8000", &s.addr).replace("127.0.0.1:8000", &s.addr);
        let out = Command::new("bash").args(["-eo", "pipefail", "-c", &script]).output().expect("run bash");
        assert!(
            out.status.success(),
            "{}:{} failed ({}):\n{script}\nstdout: {}\nstderr: {}",
            b.file.display(),
            b.line,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
