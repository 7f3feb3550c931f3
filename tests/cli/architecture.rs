//! **Architecture invariants** of the `kiln` binary, checked on the source text: the pipeline is
//! the runtime's. A command opens a `Device` and loads through it; it never builds a model or an
//! engine itself, and the commands that run models never reach into the benchmarks.

use crate::common;

/// The lines of `source` that are code, not comments.
fn code(source: &str) -> impl Iterator<Item = &str> {
    source.lines().filter(|l| !l.trim_start().starts_with("//"))
}

/// No command constructs a model, an engine or a device by hand: `kiln_runtime::Device` does.
#[test]
fn commands_load_models_through_the_device() {
    let needles = [
        "GpuModel::new",
        "GpuModel::with",
        "CpuModel::new",
        "InterpEngine::new",
        "CpuEngine::new",
        "GpuEngine::new",
        "Gpu::new(",
    ];
    let mut offenders = Vec::new();
    for (path, source) in common::sources(&["src"]) {
        for line in code(&source) {
            offenders.extend(needles.iter().filter(|n| line.contains(*n)).map(|n| format!("{}: {n}", path.display())));
        }
    }
    assert!(offenders.is_empty(), "the CLI assembles models itself: {offenders:?}");
}

/// The commands that run models depend on no benchmark code (`cli::bench`); only `main.rs`, which
/// dispatches to every command, names it.
#[test]
fn running_never_reaches_into_the_benchmarks() {
    let mut offenders = Vec::new();
    for (path, source) in common::sources(&["src"]) {
        if path.ends_with("src/main.rs") || path.components().any(|c| c.as_os_str() == "bench") {
            continue;
        }
        for line in code(&source) {
            if line.contains("bench::") {
                offenders.push(format!("{}: {}", path.display(), line.trim()));
            }
        }
    }
    assert!(offenders.is_empty(), "production code names the benchmarks: {offenders:?}");
}
