//! A corpus of malformed weight files, each given to `kiln run` for the GPT-2 spec: every one must
//! be refused with a message naming the file and what is wrong with it, exit code 1, no panic, and
//! no allocation sized by a lying header.

use crate::common;

use common::{root, scratch};
use kiln_compiler::tensor::Tensor;
use std::path::Path;
use std::process::Command;

/// A safetensors file from a header (JSON text, written as is) and a data section.
fn safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The GPT-2 fixture's tensors, sorted by name, with `edit` applied.
fn fixture_with(edit: impl Fn(&mut Vec<(String, Tensor)>)) -> Vec<(String, Tensor)> {
    let mut all: Vec<(String, Tensor)> =
        kiln_runtime::read_tensors(&root().join("tests/fixtures/gpt2/model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut all);
    all
}

fn encoded(tensors: &[(String, Tensor)]) -> Vec<u8> {
    let path = scratch("bad-weights").join(format!("encode-{}.safetensors", tensors.len()));
    kiln_runtime::write_tensors(&path, tensors).unwrap();
    std::fs::read(path).unwrap()
}

fn set_f32(all: &mut [(String, Tensor)], name: &str, index: usize, value: f32) {
    let (_, t) = all.iter_mut().find(|(n, _)| n == name).unwrap();
    let mut v = t.as_f32().unwrap().to_vec();
    v[index] = value;
    *t = Tensor::f32(t.shape.clone(), v);
}

/// Runs `kiln run models/gpt2.toml` with `bytes` as the weights (in a file called `name`) and
/// expects a clean failure whose message has every needle.
fn refused(name: &str, bytes: &[u8], needles: &[&str]) {
    let path = scratch("bad-weights").join(name);
    std::fs::write(&path, bytes).unwrap();
    refused_path(&path, needles);
}

fn refused_path(path: &Path, needles: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["run", "models/gpt2.toml", "--backend", "interp", "--inputs", "tests/fixtures/gpt2/io.safetensors"])
        .args(["--output", "/dev/null", "--weights"])
        .arg(path)
        .current_dir(root())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}: expected a clean failure, got:\n{err}", path.display());
    assert!(!err.contains("panicked"), "{}: panicked:\n{err}", path.display());
    for needle in needles {
        assert!(err.contains(needle), "{}: the message lacks {needle:?}:\n{err}", path.display());
    }
}

#[test]
fn malformed_safetensors_headers_are_refused() {
    refused("empty.safetensors", b"", &["empty.safetensors` is not a valid safetensors file: header too small"]);
    refused(
        "short.safetensors",
        b"\x08\0\0",
        &["short.safetensors` is not a valid safetensors file: header too small"],
    );
    // The header claims more bytes than the file has, or more than any file could.
    refused(
        "long-header.safetensors",
        &[&64u64.to_le_bytes()[..], b"{}"].concat(),
        &["long-header.safetensors", "invalid header length"],
    );
    refused(
        "huge-header.safetensors",
        &[&u64::MAX.to_le_bytes()[..], b"{}"].concat(),
        &["huge-header.safetensors", "header too large"],
    );
    refused(
        "not-json.safetensors",
        &safetensors("this is not JSON", b""),
        &["not-json.safetensors", "invalid JSON in header"],
    );
    refused(
        "json-array.safetensors",
        &safetensors("[1, 2, 3]", b""),
        &["json-array.safetensors", "invalid JSON in header"],
    );
    refused(
        "unknown-dtype.safetensors",
        &safetensors(r#"{"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}"#, &[0; 4]),
        &["unknown-dtype.safetensors", "unknown variant `F99`"],
    );
}

#[test]
fn tensor_offsets_that_do_not_fit_are_refused() {
    let header = |offsets: &str| format!(r#"{{"a":{{"dtype":"F32","shape":[2],"data_offsets":{offsets}}}}}"#);
    // Past the end of the data.
    refused(
        "past-end.safetensors",
        &safetensors(&header("[0,8]"), &[0; 4]),
        &["past-end.safetensors", "file not fully covered"],
    );
    // Not the size the shape and dtype give.
    refused(
        "wrong-size.safetensors",
        &safetensors(&header("[0,4]"), &[0; 4]),
        &["wrong-size.safetensors", "invalid shape, data type, or offset for tensor"],
    );
    // Backwards.
    refused(
        "backwards.safetensors",
        &safetensors(&header("[8,0]"), &[0; 8]),
        &["backwards.safetensors", "invalid offset for tensor `a`"],
    );
    // Two tensors over the same bytes (which of the two is blamed depends on the header's map
    // order, so the message is checked up to the name).
    let overlap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    refused(
        "overlap.safetensors",
        &safetensors(overlap, &[0; 8]),
        &["overlap.safetensors", "invalid offset for tensor `"],
    );
    // A shape whose element count overflows.
    let huge = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}"#;
    refused(
        "overflow.safetensors",
        &safetensors(huge, &[0; 4]),
        &["overflow.safetensors", "overflow computing buffer size"],
    );
}

#[test]
fn wrong_tensors_are_named() {
    let missing = fixture_with(|all| all.retain(|(n, _)| n != "transformer.h.1.ln_2.weight"));
    refused(
        "missing.safetensors",
        &encoded(&missing),
        &["tensor `transformer.h.1.ln_2.weight` (for parameter `layers.1.ffn_norm.weight`) is not in"],
    );
    let shape = fixture_with(|all| {
        let (_, t) = all.iter_mut().find(|(n, _)| n == "transformer.wpe.weight").unwrap();
        *t = Tensor::f32(vec![16, 64], vec![0.0; 16 * 64]);
    });
    refused(
        "shape.safetensors",
        &encoded(&shape),
        &["transformer.wpe.weight", "expected shape [32, 64]", "found [16, 64]"],
    );
    let dtype = fixture_with(|all| {
        let (_, t) = all.iter_mut().find(|(n, _)| n == "transformer.h.0.ln_1.bias").unwrap();
        *t = Tensor::i64(t.shape.clone(), vec![1; t.len()]);
    });
    refused("dtype.safetensors", &encoded(&dtype), &["transformer.h.0.ln_1.bias", "expected a float type"]);
    let nan = fixture_with(|all| set_f32(all, "transformer.h.0.attn.c_attn.weight", 17, f32::NAN));
    refused("nan.safetensors", &encoded(&nan), &["transformer.h.0.attn.c_attn.weight", "non-finite value (NaN)"]);
    let inf = fixture_with(|all| set_f32(all, "transformer.wte.weight", 5, f32::NEG_INFINITY));
    refused("inf.safetensors", &encoded(&inf), &["transformer.wte.weight", "non-finite value (-inf)"]);
}

#[test]
fn files_of_another_kind_are_refused() {
    let gpt2 = std::fs::read(root().join("tests/fixtures/gpt2/model.safetensors")).unwrap();
    // Truncated in the data section: the header's offsets run past the end.
    refused("truncated.safetensors", &gpt2[..gpt2.len() - 1000], &["truncated.safetensors", "file not fully covered"]);
    // A GGUF by its name, but not by its content.
    refused("renamed.gguf", &gpt2, &["renamed.gguf", "a GGUF file starts with \"GGUF\""]);
    // A GGUF by its magic, cut after the version.
    refused("cut.gguf", b"GGUF\x03\0\0\0", &["cut.gguf", "truncated file"]);
    // An artifact given as weights.
    let artifact = std::fs::read(root().join("fuzz/seeds/artifact/gpt2.kiln")).unwrap();
    refused("artifact.safetensors", &artifact, &["artifact.safetensors` is not a valid safetensors file"]);
    // A directory.
    refused_path(&scratch("bad-weights"), &["cannot read"]);
}
