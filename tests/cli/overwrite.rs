//! What a command writes never replaces what it reads (the spec, the weights, the inputs, a
//! checkpoint's files), however the path is spelled, and an existing file only with `--force`.

use crate::common::{fails_with, ok, root, scratch};
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of `models/gpt2.toml` in `dir`.
fn victim(dir: &Path) -> PathBuf {
    let spec = dir.join("victim.toml");
    std::fs::copy(root().join("models/gpt2.toml"), &spec).unwrap();
    spec
}

/// A copy of the llama fixture's checkpoint directory (config and weights) in `dir`.
fn checkpoint(dir: &Path) -> PathBuf {
    let ckpt = dir.join("llama");
    std::fs::create_dir_all(&ckpt).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(root().join("tests/fixtures/llama").join(file), ckpt.join(file)).unwrap();
    }
    ckpt
}

/// `kiln run victim.toml ... --output victim.toml` and its kin are refused, naming both paths,
/// and leave the input as it was.
#[test]
fn an_output_never_replaces_an_input() {
    let dir = scratch("overwrite-input");
    let spec = victim(&dir);
    let before = std::fs::read(&spec).unwrap();
    let dotted = dir.join(".").join("victim.toml");
    let run = ["run", s(&spec), "--random-weights", "--input-ids", "1,2", "--backend", "interp"];
    for out in [&spec, &dotted] {
        fails_with(
            &[&run[..], &["--output", s(out), "--force"]].concat(),
            &["--output `", "is the model `", "victim.toml", "would destroy an input"],
        );
    }
    let weights = dir.join("w.safetensors");
    std::fs::copy(root().join("tests/fixtures/gpt2/model.safetensors"), &weights).unwrap();
    let inputs = dir.join("io.safetensors");
    std::fs::copy(root().join("tests/fixtures/gpt2/io.safetensors"), &inputs).unwrap();
    let real = ["run", s(&spec), "--weights", s(&weights), "--inputs", s(&inputs), "--backend", "interp"];
    fails_with(&[&real[..], &["--output", s(&weights), "--force"]].concat(), &["is --weights `"]);
    fails_with(&[&real[..], &["--output", s(&inputs), "--force"]].concat(), &["is --inputs `"]);
    fails_with(&["compile", s(&spec), "-o", s(&dotted), "--force"], &["is the spec `"]);
    fails_with(&["init", s(&spec), "-o", s(&spec), "--force"], &["is the spec `"]);
    fails_with(&["inspect", s(&spec), "-o", s(&spec), "--force"], &["--output `", "is the spec `"]);
    fails_with(&["inspect", s(&spec), "--html", s(&spec), "--force"], &["--html `", "is the spec `"]);
    fails_with(&["diff", "models/gpt2.toml", s(&spec), "--html", s(&spec), "--force"], &["--html `", "is B `"]);
    assert_eq!(std::fs::read(&spec).unwrap(), before, "the spec is untouched");
    // A checkpoint's weights, found inside the directory given.
    let ckpt = checkpoint(&dir);
    let w = ckpt.join("model.safetensors");
    let weights_before = std::fs::read(&w).unwrap();
    fails_with(&["import", s(&ckpt), "-o", s(&w), "--force"], &["is the checkpoint's weights `"]);
    fails_with(
        &["run", s(&ckpt), "--input-ids", "1,2", "--backend", "interp", "--output", s(&w), "--force"],
        &["is --weights `"],
    );
    assert_eq!(std::fs::read(&w).unwrap(), weights_before, "the weights are untouched");
}

/// An output file that exists is replaced only with `--force` (cargo's and llama.cpp's
/// convention), `import -o` over a spec edited by hand included.
#[test]
fn an_existing_output_needs_force() {
    let dir = scratch("overwrite-existing");
    let out = dir.join("out.safetensors");
    let run = ["run", "models/llama.toml", "--random-weights", "--input-ids", "1,2", "--backend", "interp"];
    ok(&[&run[..], &["--output", s(&out)]].concat());
    let first = std::fs::read(&out).unwrap();
    let exists = format!("--output `{}` exists; pass --force to replace it", out.display());
    fails_with(&[&run[..], &["--output", s(&out), "--seed", "2"]].concat(), &[&exists]);
    assert_eq!(std::fs::read(&out).unwrap(), first, "the refused run wrote nothing");
    ok(&[&run[..], &["--output", s(&out), "--seed", "2", "--force"]].concat());
    assert_ne!(std::fs::read(&out).unwrap(), first, "--force replaced it");

    let spec = dir.join("spec.toml");
    let ckpt = checkpoint(&dir);
    ok(&["import", s(&ckpt), "-o", s(&spec), "-q"]);
    let edited = format!("# tuned by hand\n{}", std::fs::read_to_string(&spec).unwrap());
    std::fs::write(&spec, &edited).unwrap();
    fails_with(&["import", s(&ckpt), "-o", s(&spec)], &["exists; pass --force to replace it"]);
    assert_eq!(std::fs::read_to_string(&spec).unwrap(), edited, "the hand-edited spec is kept");
    ok(&["import", s(&ckpt), "-o", s(&spec), "-q", "--force"]);
    assert!(!std::fs::read_to_string(&spec).unwrap().contains("tuned by hand"));

    let art = dir.join("llama.kiln");
    ok(&["compile", "models/llama.toml", "-o", s(&art)]);
    fails_with(&["compile", "models/llama.toml", "-o", s(&art)], &["exists; pass --force"]);
    ok(&["compile", "models/llama.toml", "-o", s(&art), "--force"]);
    let html = dir.join("diff.html");
    ok(&["diff", "models/llama.toml", "models/gpt2.toml", "--html", s(&html)]);
    fails_with(&["diff", "models/llama.toml", "models/gpt2.toml", "--html", s(&html)], &["exists; pass --force"]);
    // A device is not a file that exists: writing to it replaces nothing.
    ok(&[&run[..], &["--output", "/dev/null"]].concat());
}
