//! `kiln embed` end to end on all-MiniLM-L6-v2: the sentences of the fixture give
//! sentence-transformers' embeddings on wgpu and on the interpreter, and bad input (a missing
//! tokenizer, a GGUF without one, a spec that does not pool) is a specific message and a non-zero
//! exit, never a panic.

mod common;

use common::root;

use std::path::Path;
use std::process::{Command, Output};

/// The largest absolute error allowed against sentence-transformers.
const TOLERANCE: f32 = 1e-4;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).current_dir(root()).output().expect("kiln runs")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

fn sentences() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("tests/fixtures/minilm-l6/sentences.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `kiln embed` on MiniLM with extra arguments and the fixture's sentences.
fn embed(extra: &[&str]) -> Output {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let tokenizer = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    let sentences = sentences();
    let mut args = vec!["embed", "models/minilm-l6.toml", "--weights", s(&weights), "--tokenizer", s(&tokenizer)];
    args.extend(extra);
    args.extend(sentences.iter().map(String::as_str));
    let o = kiln(&args);
    assert!(o.status.success(), "kiln embed failed:\n{}", String::from_utf8_lossy(&o.stderr));
    o
}

/// The max abs error of `kiln embed --json` against the reference embeddings.
fn json_error(o: &Output) -> f32 {
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON output");
    assert_eq!(json["dimensions"], 384);
    let reference = kiln_runtime::read_tensors(&root().join("tests/fixtures/minilm-l6/reference.safetensors")).unwrap();
    let expected = reference["sentence_embedding"].as_f32().expect("f32 embeddings");
    let items = json["embeddings"].as_array().expect("an embedding per sentence");
    assert_eq!(items.len(), 4);
    let mut err = 0.0f32;
    for (i, (item, text)) in items.iter().zip(sentences()).enumerate() {
        assert_eq!(item["text"], text.as_str());
        let got: Vec<f32> =
            item["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().expect("numbers") as f32).collect();
        assert_eq!(got.len(), 384);
        for (g, e) in got.iter().zip(&expected[i * 384..(i + 1) * 384]) {
            err = err.max((g - e).abs());
        }
    }
    err
}

#[test]
fn embed_matches_sentence_transformers_on_wgpu() {
    if common::gpu().is_none() {
        return;
    }
    let err = json_error(&embed(&["--json"]));
    println!("minilm-l6: kiln embed (wgpu) max abs error {err:e}");
    assert!(err <= TOLERANCE, "kiln embed on wgpu differs by {err}");
}

#[test]
fn embed_matches_sentence_transformers_on_the_interpreter() {
    let err = json_error(&embed(&["--json", "--backend", "interp"]));
    println!("minilm-l6: kiln embed (interp) max abs error {err:e}");
    assert!(err <= TOLERANCE, "kiln embed on the interpreter differs by {err}");
}

#[test]
fn text_output_has_one_line_per_sentence() {
    let out = String::from_utf8(embed(&["--backend", "interp", "--normalize"]).stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    for (line, sentence) in lines.iter().zip(sentences()) {
        assert!(line.starts_with("norm 1.000000  [0.") || line.starts_with("norm 1.000000  [-0."), "{line}");
        assert!(line.contains(", …] (384 dims)") && line.ends_with(&format!("{sentence:?}")), "{line}");
    }
}

/// Runs kiln and expects failure with a message containing `needle`.
fn fails_with(args: &[&str], needle: &str) {
    let o = kiln(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "kiln {args:?} should fail");
    assert!(!err.contains("panicked"), "kiln {args:?} panicked:\n{err}");
    assert!(err.contains(needle), "kiln {args:?}: stderr lacks {needle:?}:\n{err}");
}

#[test]
fn bad_tokenizers_and_specs_are_reported() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let tokenizer = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    let (w, t) = (s(&weights), s(&tokenizer));
    let dir = std::env::temp_dir().join(format!("kiln-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = "models/minilm-l6.toml";

    let missing = dir.join("missing.json");
    fails_with(&["embed", spec, "--weights", w, "--tokenizer", s(&missing), "hi"], "cannot read tokenizer");

    // A valid GGUF file (header only: no tensors, no metadata) that carries no tokenizer.
    let bare = dir.join("bare.gguf");
    let mut header = b"GGUF".to_vec();
    header.extend(3u32.to_le_bytes());
    header.extend([0u8; 16]);
    std::fs::write(&bare, header).unwrap();
    fails_with(&["embed", spec, "--weights", w, "--tokenizer", s(&bare), "hi"], "no `tokenizer.ggml.model` metadata");

    fails_with(&["embed", "models/bert.toml", "--weights", w, "--tokenizer", t, "hi"], "has no `sentence_embedding`");
    fails_with(&["embed", spec, "--weights", w, "--tokenizer", t], "<SENTENCES>");
}
