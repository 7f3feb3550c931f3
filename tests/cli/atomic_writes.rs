//! Files kiln writes are whole or absent: a writer killed at any moment leaves the previous file
//! (or the new one) at the path, never a part of one (`kiln_compiler::file::write_atomic`).

use crate::common;
use kiln_compiler::file::write_atomic;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Set in the child process the kill test spawns: the path it writes to.
const CHILD: &str = "KILN_ATOMIC_WRITE_CHILD";
/// The child's file: large enough that writing and flushing it takes a while.
const LEN: usize = 96 << 20;

fn new_contents() -> Vec<u8> {
    (0..LEN).map(|i| (i % 251) as u8).collect()
}

/// The child's side of `a_writer_killed_mid_write_leaves_the_old_file`: it writes the new
/// contents and exits. In the ordinary test run (no `CHILD` variable) it does nothing.
#[test]
fn child_writer() {
    if let Some(path) = std::env::var_os(CHILD) {
        write_atomic(Path::new(&path), &new_contents()).unwrap();
    }
}

/// `child_writer`'s name in this test binary: its module path without the crate's name.
fn child_test_name() -> String {
    match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::child_writer"),
        None => "child_writer".to_string(),
    }
}

/// Runs `child_writer` in a new process writing to `path`. With `kill_at`, kills it (SIGKILL: no
/// destructor or cleanup runs) as soon as its temporary file holds that many bytes; returns
/// whether it was killed so, before the rename.
fn run_child(path: &Path, kill_at: Option<u64>) -> bool {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &child_test_name(), "--test-threads=1", "--quiet"])
        .env(CHILD, path)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let Some(kill_at) = kill_at else {
        assert!(child.wait().unwrap().success());
        return false;
    };
    let dir = path.parent().unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        let written = temporaries(dir).first().and_then(|t| std::fs::metadata(t).ok()).map(|m| m.len());
        if written.is_some_and(|n| n >= kill_at) {
            let _ = child.kill();
            child.wait().unwrap();
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn temporaries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(".out.bin.tmp-")))
        .collect()
}

/// Kills a writer while its temporary file grows (and, past the last byte, while it is flushed).
/// After each kill the path holds the old contents, untouched; an unkilled writer replaces them
/// whole. Most kills must land mid-write, or the test did not test anything.
#[test]
fn a_writer_killed_mid_write_leaves_the_old_file() {
    let dir = std::env::temp_dir().join(format!("kiln-atomic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("out.bin");
    let new = new_contents();

    let mut mid_write = 0;
    for tenth in 0..=10 {
        std::fs::write(&path, b"old").unwrap();
        let killed = run_child(&path, Some(LEN as u64 * tenth / 10));
        let found = std::fs::read(&path).unwrap();
        if killed {
            mid_write += 1;
            assert!(found == b"old", "a kill at {tenth}/10 of the write left {} bytes", found.len());
        } else {
            assert!(found == new, "the writer finished but left {} bytes", found.len());
        }
        for t in temporaries(&dir) {
            std::fs::remove_file(t).unwrap();
        }
    }
    println!("{mid_write} of 11 kills landed mid-write");
    assert!(mid_write >= 6, "only {mid_write} of 11 kills landed while the file was being written");

    std::fs::write(&path, b"old").unwrap();
    run_child(&path, None);
    assert!(std::fs::read(&path).unwrap() == new, "an unkilled writer writes everything");
    assert!(temporaries(&dir).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every file the sources write goes through `write_atomic`.
#[test]
fn nothing_else_writes_files() {
    let mut offenders = Vec::new();
    for (path, source) in common::sources(&["src", "compiler/src", "runtime/src"]) {
        if path.ends_with("compiler/src/file.rs") {
            continue;
        }
        for needle in ["fs::write(", "File::create(", "OpenOptions"] {
            if source.contains(needle) {
                offenders.push(format!("{}: {needle}", path.display()));
            }
        }
    }
    assert!(offenders.is_empty(), "files written without write_atomic: {offenders:?}");
}
