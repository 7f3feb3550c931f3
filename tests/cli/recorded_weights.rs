//! An imported spec remembers its checkpoint (`weights.path`): the commands that read weights use
//! it without `--weights`, `--weights` overrides it, and a recorded path that is gone is an error
//! naming it.

use crate::common::{fails_with, ok, root, scratch};
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn an_imported_spec_remembers_its_checkpoint() {
    let dir = scratch("recorded-import");
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(root().join("tests/fixtures/llama").join(file), ckpt.join(file)).unwrap();
    }
    let spec = dir.join("llama.toml");
    let _ = std::fs::remove_file(&spec);
    ok(&["import", s(&ckpt), "-o", s(&spec)]);
    let text = std::fs::read_to_string(&spec).unwrap();
    assert!(text.contains("path = \"ckpt/model.safetensors\""), "{text}");

    let out = dir.join("out.safetensors");
    let run = ["run", s(&spec), "--input-ids", "1,2,3", "--output", s(&out), "--force", "--backend", "interp"];
    ok(&run);
    let said = ok(&["check", s(&spec)]);
    assert!(said.contains("parameters from") && said.contains("ckpt/model.safetensors"), "{said}");

    // Gone: an error naming the recorded path, and --weights still overrides it.
    let moved = dir.join("moved");
    let _ = std::fs::remove_dir_all(&moved);
    std::fs::rename(&ckpt, &moved).unwrap();
    fails_with(&run, &["records its weights at `ckpt/model.safetensors`", "--weights"]);
    fails_with(&["check", s(&spec)], &["`weights.path`", "does not exist"]);
    let weights = moved.join("model.safetensors");
    ok(&[&run[..], &["--weights", s(&weights)]].concat());
}

#[test]
fn an_empty_recorded_path_is_a_spec_error_at_its_line() {
    let dir = scratch("recorded-empty");
    let spec = dir.join("s.toml");
    let source = std::fs::read_to_string(root().join("models/gpt2.toml")).unwrap();
    std::fs::write(&spec, source.replace("[weights]\n", "[weights]\npath = \"\"\n")).unwrap();
    fails_with(&["check", s(&spec)], &["`weights.path` is empty", "s.toml:", "= key: weights.path"]);
}
