//! `kiln init`: weights drawn from a spec's `[init]`, under the checkpoint's tensor names, that
//! `kiln run` and `kiln train` read.

use crate::common::{fails_with, kiln, ok, root, scratch, stderr};
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn init_writes_the_checkpoint_layout_that_run_reads() {
    let dir = scratch("init-run");
    let w = dir.join("w.safetensors");
    let said = ok(&["init", "models/gpt2.toml", "-o", s(&w)]);
    assert!(said.contains("28 tensors"), "{said}");
    assert!(said.contains("residual projections scaled by 1/sqrt(2*2)"), "{said}");
    let tensors = kiln_runtime::read_tensors(&w).unwrap();
    let fixture = kiln_runtime::read_tensors(&root().join("tests/fixtures/gpt2/model.safetensors")).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    let mut expected: Vec<&String> = fixture.keys().collect();
    names.sort();
    expected.sort();
    assert_eq!(names, expected);
    assert_eq!(tensors["transformer.h.0.attn.c_attn.weight"].shape, vec![64, 192]);

    let out = dir.join("out.safetensors");
    ok(&[
        "run",
        "models/gpt2.toml",
        "--weights",
        s(&w),
        "--input-ids",
        "1,2,3",
        "--output",
        s(&out),
        "--backend",
        "interp",
    ]);
    let logits = &kiln_runtime::read_tensors(&out).unwrap()["logits"];
    assert_eq!(logits.shape, vec![1, 3, 128]);
    assert!(logits.as_f32().unwrap().iter().all(|x| x.is_finite()));

    // The same seed draws the same weights; another seed others.
    let again = dir.join("again.safetensors");
    ok(&["init", "models/gpt2.toml", "-o", s(&again)]);
    assert_eq!(std::fs::read(&w).unwrap(), std::fs::read(&again).unwrap());
    ok(&["init", "models/gpt2.toml", "-o", s(&again), "--seed", "7", "--force"]);
    assert_ne!(std::fs::read(&w).unwrap(), std::fs::read(&again).unwrap());
}

#[test]
fn train_starts_from_initialized_weights() {
    let dir = scratch("init-train");
    let w = dir.join("w.safetensors");
    ok(&["init", "tests/fixtures/train_gpt2", "-o", s(&w)]);
    let out = dir.join("trained.safetensors");
    let o = kiln(&[
        "train",
        "tests/fixtures/train_gpt2",
        "--weights",
        s(&w),
        "--batches",
        "tests/fixtures/train_gpt2/data.safetensors",
        "--steps",
        "2",
        "-o",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let trained = kiln_runtime::read_tensors(&out).unwrap();
    let drawn = kiln_runtime::read_tensors(&w).unwrap();
    let mut a: Vec<&String> = trained.keys().collect();
    let mut b: Vec<&String> = drawn.keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
}

#[test]
fn init_refuses_a_bad_init_section_at_its_line() {
    fails_with(
        &["init", "tests/invalid/init-std-negative.toml", "-o", "/tmp/kiln-never-written.safetensors"],
        &["`init.std` = -0.02 must be a positive finite number", "init-std-negative.toml:12"],
    );
    fails_with(
        &["init", "tests/invalid/init-unknown-key.toml", "-o", "/tmp/kiln-never-written.safetensors"],
        &["stdev", "init-unknown-key.toml:12"],
    );
    assert!(!Path::new("/tmp/kiln-never-written.safetensors").exists());
}
