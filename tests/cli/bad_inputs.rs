//! Bad run-time inputs given to `kiln run` on BERT (token types, padding mask) and GPT-2 (learned
//! positions), on the interpreter, the CPU backend and wgpu: each is refused before anything
//! runs, with a message naming the input and what is wrong, exit code 1 and no panic.

use crate::common;

use common::root;
use kiln_compiler::tensor::Tensor;
use std::process::Command;

fn backends() -> Vec<&'static str> {
    match common::gpu() {
        Some(_) => vec!["interp", "cpu", "wgpu"],
        None => vec!["interp", "cpu"],
    }
}

/// Runs `model` (a name in models/ and tests/fixtures/) on `inputs` on every backend and expects
/// a clean failure whose message has every needle.
fn refused(model: &str, case: &str, inputs: &[(&str, Tensor)], needles: &[&str]) {
    let dir = std::env::temp_dir().join(format!("kiln-bad-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{model}-{case}.safetensors"));
    let tensors: Vec<(String, Tensor)> = inputs.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
    kiln_runtime::write_tensors(&path, &tensors).unwrap();
    for backend in backends() {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["run", &format!("models/{model}.toml"), "--backend", backend, "--output", "/dev/null"])
            .args(["--weights", &format!("tests/fixtures/{model}/model.safetensors"), "--inputs"])
            .arg(&path)
            .current_dir(root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{model} {case} on {backend}: expected a clean failure:\n{err}");
        assert!(!err.contains("panicked"), "{model} {case} on {backend} panicked:\n{err}");
        for needle in needles {
            assert!(err.contains(needle), "{model} {case} on {backend}: the message lacks {needle:?}:\n{err}");
        }
    }
}

fn ids(shape: Vec<usize>, v: Vec<i64>) -> Tensor {
    Tensor::i64(shape, v)
}

#[test]
fn token_ids_outside_the_vocabulary() {
    refused(
        "bert",
        "big-id",
        &[("input_ids", ids(vec![1, 3], vec![1, 128, 2]))],
        &["token id 128 is out of range for `embed.tokens` (128 rows)"],
    );
    refused(
        "bert",
        "negative-id",
        &[("input_ids", ids(vec![1, 3], vec![1, -2, 3]))],
        &["token id -2 is out of range for `embed.tokens` (128 rows)"],
    );
    refused(
        "bert",
        "token-type",
        &[("input_ids", ids(vec![1, 3], vec![1, 2, 3])), ("token_type_ids", ids(vec![1, 3], vec![0, 5, 0]))],
        &["token type id 5 is out of range for `embed.token_types` (2 rows)"],
    );
}

#[test]
fn sequences_longer_than_the_positions() {
    refused(
        "gpt2",
        "long",
        &[("input_ids", ids(vec![1, 33], vec![1; 33]))],
        &["input `input_ids` has 33 tokens per sequence, more than the model's `max_positions` = 32"],
    );
    refused(
        "bert",
        "long",
        &[("input_ids", ids(vec![2, 65], vec![1; 130]))],
        &["input `input_ids` has 65 tokens per sequence, more than the model's `max_positions` = 64"],
    );
    // RoPE has no table to run out of: `max_positions` is enforced all the same.
    refused(
        "llama",
        "long",
        &[("input_ids", ids(vec![1, 65], vec![1; 65]))],
        &["input `input_ids` has 65 tokens per sequence, more than the model's `max_positions` = 64"],
    );
}

#[test]
fn inputs_of_the_wrong_shape_or_type() {
    refused(
        "bert",
        "mask-shape",
        &[("input_ids", ids(vec![1, 3], vec![1, 2, 3])), ("attention_mask", ids(vec![1, 4], vec![1; 4]))],
        &["input `attention_mask`: seq is 4 here but 3 in another input"],
    );
    refused(
        "bert",
        "mask-batch",
        &[("input_ids", ids(vec![1, 3], vec![1, 2, 3])), ("attention_mask", ids(vec![2, 3], vec![1; 6]))],
        &["input `attention_mask`: batch is 2 here but 1 in another input"],
    );
    refused(
        "bert",
        "mask-fraction",
        &[
            ("input_ids", ids(vec![1, 3], vec![1, 2, 3])),
            ("attention_mask", Tensor::f32(vec![1, 3], vec![1.0, 0.5, 0.0])),
        ],
        &["input `attention_mask`: a mask holds only 0 and 1 (1 = attend, 0 = padding); found 0.5 at element 1"],
    );
    refused(
        "bert",
        "mask-two",
        &[("input_ids", ids(vec![1, 3], vec![1, 2, 3])), ("attention_mask", ids(vec![1, 3], vec![1, 2, 1]))],
        &["found 2 at element 1"],
    );
    refused(
        "bert",
        "float-ids",
        &[("input_ids", Tensor::f32(vec![1, 3], vec![1.0, 2.0, 3.0]))],
        &["input `input_ids`: expected integer ids, got f32"],
    );
    refused(
        "bert",
        "rank-1",
        &[("input_ids", ids(vec![3], vec![1, 2, 3]))],
        &["input `input_ids`: expected [batch, seq], got shape [3]"],
    );
    refused(
        "bert",
        "empty",
        &[("input_ids", ids(vec![1, 0], vec![]))],
        &["input `input_ids`: empty input of shape [1, 0]"],
    );
    refused(
        "gpt2",
        "no-batch",
        &[("input_ids", ids(vec![0, 3], vec![]))],
        &["input `input_ids`: empty input of shape [0, 3]"],
    );
    refused("gpt2", "missing", &[("token_ids", ids(vec![1, 3], vec![1, 2, 3]))], &["missing input `input_ids`"]);
}
