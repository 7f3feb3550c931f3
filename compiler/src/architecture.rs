//! **Architecture invariants** of the compiler's module graph, checked on the source text: the
//! compiler is one-way (IR ← shared semantics ← middle end ← back ends), so
//!
//! - the optimizer (`optimize/`) names no back end (`back::`): a back end's facts reach it as
//!   data, a [`Target`](crate::target::Target);
//! - the IR (`graph/`) never calls the interpreter (`interp`): what both need is in
//!   [`semantics`](crate::semantics);
//! - the spec (`spec/`) never builds the next stage (`graph::build`): the checks on a built
//!   graph are the front end's ([`front_end`](crate::front_end)).

use std::path::{Path, PathBuf};

/// The Rust files under `compiler/src/{dir}`, recursively.
fn sources(dir: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(dir), &mut out);
    assert!(!out.is_empty(), "no sources under {dir}");
    out
}

/// Fails naming every line of a file under `dir` that contains one of `forbidden`.
fn check_absent(dir: &str, forbidden: &[&str], why: &str) {
    let mut found = Vec::new();
    for path in sources(dir) {
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            if forbidden.iter().any(|f| line.contains(f)) {
                found.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "{why}:\n{}", found.join("\n"));
}

#[test]
fn the_optimizer_names_no_back_end() {
    check_absent("optimize", &["back::"], "the optimizer reads a back end's facts from its Target, never its module");
}

#[test]
fn the_ir_never_calls_the_interpreter() {
    check_absent("graph", &["interp::", "crate::interp"], "the IR's shared op semantics live in `semantics`");
}

#[test]
fn the_spec_never_builds_the_graph() {
    check_absent("spec", &["graph::build", "build::"], "checks on a built graph are the front end's, not validation's");
}
