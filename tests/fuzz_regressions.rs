//! The fuzz targets' inputs that matter, replayed by `cargo test`: every seed of `fuzz/seeds/`
//! and every input that once crashed a target (`fuzz/regressions/`, one file per crash, kept
//! after the fix). The targets' bodies are included from `fuzz/src/lib.rs`, so this runs exactly
//! what the fuzzer ran; each must return normally.

#[allow(dead_code, unreachable_pub)]
#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::path::Path;

/// Runs `target` on every file under `fuzz/{dir}/{name}/`; returns how many.
fn replay(dir: &str, name: &str, target: fn(&[u8])) -> usize {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join(dir).join(name);
    let mut files: Vec<_> = match std::fs::read_dir(&folder) {
        Ok(entries) => entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect(),
        Err(_) => return 0,
    };
    files.sort();
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let outcome = std::panic::catch_unwind(|| target(&data));
        assert!(outcome.is_ok(), "fuzz target `{name}` panicked on {}", file.display());
    }
    files.len()
}

#[test]
fn seeds_run_cleanly() {
    for (name, target) in targets::TARGETS {
        let n = replay("seeds", name, target);
        assert!(n > 0, "fuzz/seeds/{name} is empty: every target keeps a seed corpus");
    }
}

#[test]
fn past_crashes_stay_fixed() {
    for (name, target) in targets::TARGETS {
        replay("regressions", name, target);
    }
}
