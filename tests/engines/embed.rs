//! `kiln embed` end to end on all-MiniLM-L6-v2: the sentences of the fixture give
//! sentence-transformers' embeddings on wgpu and on the interpreter, and bad input (a missing
//! tokenizer, a GGUF without one, a spec that does not pool) is a specific message and a non-zero
//! exit, never a panic.

use crate::common;

use common::{kiln, root};

use std::path::Path;
use std::process::{Command, Output};

/// The largest absolute error allowed against sentence-transformers.
const TOLERANCE: f32 = 1e-4;

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

#[test]
fn bad_tokenizers_and_specs_are_reported() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let tokenizer = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    let (w, t) = (s(&weights), s(&tokenizer));
    let dir = std::env::temp_dir().join(format!("kiln-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = "models/minilm-l6.toml";

    let missing = dir.join("missing.json");
    common::failure(&["embed", spec, "--weights", w, "--tokenizer", s(&missing), "hi"], &["cannot read tokenizer"]);

    // A valid GGUF file (header only: no tensors, no metadata) that carries no tokenizer.
    let bare = dir.join("bare.gguf");
    let mut header = b"GGUF".to_vec();
    header.extend(3u32.to_le_bytes());
    header.extend([0u8; 16]);
    std::fs::write(&bare, header).unwrap();
    common::failure(
        &["embed", spec, "--weights", w, "--tokenizer", s(&bare), "hi"],
        &["no `tokenizer.ggml.model` metadata"],
    );

    // Any encoder embeds (its states pooled by kiln), but not with another model's tokenizer.
    common::failure(
        &["embed", "models/bert.toml", "--weights", w, "--tokenizer", t, "hi"],
        &["outside the model's vocabulary of 128"],
    );
    common::failure(&["embed", "models/t5.toml", "--weights", w, "--tokenizer", t, "hi"], &["is an encoder-decoder"]);
    common::failure(&["embed", spec, "--weights", w, "--tokenizer", t], &["<SENTENCES>"]);
}

/// The sentences come from a file or stdin (`-`) as from arguments; `--similarity` adds the
/// cosine-similarity matrix (text and JSON); an artifact of the spec embeds the same.
#[test]
fn sentences_from_a_file_or_stdin_and_the_similarity_matrix() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let tokenizer = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    let dir = std::env::temp_dir().join(format!("kiln-embed-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sentences.txt");
    std::fs::write(&file, sentences().join("\n\n") + "\n").unwrap();
    let base = ["embed", "models/minilm-l6.toml", "--weights", s(&weights), "--tokenizer", s(&tokenizer)];
    let args = [&base[..], &["--backend", "cpu", "--json", "--similarity"]].concat();
    let from_file = kiln(&[&args[..], &["--file", s(&file)]].concat());
    assert!(from_file.status.success(), "{}", String::from_utf8_lossy(&from_file.stderr));
    assert!(json_error(&from_file) <= TOLERANCE);
    let v: serde_json::Value = serde_json::from_slice(&from_file.stdout).unwrap();
    let m = v["similarity"].as_array().expect("a similarity matrix");
    assert_eq!(m.len(), 4);
    assert!((m[0][0].as_f64().unwrap() - 1.0).abs() < 1e-5, "{m:?}");
    assert_eq!(m[0][1], m[1][0]);

    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(&args)
        .args(["--file", "-"])
        .current_dir(root())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(std::fs::read(&file).unwrap().as_slice()).unwrap();
    let from_stdin = child.wait_with_output().unwrap();
    assert_eq!(from_stdin.stdout, from_file.stdout, "{}", String::from_utf8_lossy(&from_stdin.stderr));

    let text = kiln(&[&base[..], &["--backend", "cpu", "--similarity", "--file", s(&file)]].concat());
    let out = String::from_utf8(text.stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[4], "cosine similarity", "{out}");
    assert!(lines[6].starts_with("   1  1.0000 "), "{out}");
    assert_eq!(lines.len(), 10, "{out}");

    let art = dir.join("minilm.kiln");
    assert!(kiln(&["compile", "models/minilm-l6.toml", "-o", s(&art), "--for", "cpu"]).status.success());
    let from_artifact = kiln(
        &[&["embed", s(&art)][..], &base[2..], &["--backend", "cpu", "--json", "--similarity", "--file", s(&file)]]
            .concat(),
    );
    assert!(from_artifact.status.success(), "{}", String::from_utf8_lossy(&from_artifact.stderr));
    assert!(json_error(&from_artifact) <= TOLERANCE);

    common::failure(&[&base[..], &["--file", s(&dir.join("none.txt"))]].concat(), &["cannot read the sentences in"]);
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    common::failure(&[&base[..], &["--file", s(&empty)]].concat(), &["holds no sentences"]);
}

/// A text longer than the model's pipeline takes is truncated where sentence-transformers
/// truncates all-MiniLM-L6-v2 (`outputs.max_seq_length` = 256, not its 512 positions), and kiln
/// says so.
#[test]
fn long_sentences_are_truncated_where_the_pipeline_truncates_and_said_so() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let tokenizer = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    let long = "word ".repeat(300);
    let base = ["embed", "models/minilm-l6.toml", "--weights", s(&weights), "--tokenizer", s(&tokenizer)];
    let o = kiln(&[&base[..], &["--backend", "cpu", "short one", &long]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("note: sentence 2 has 302 tokens; embedded its first 256 (the spec's `outputs.max_seq_length`)"),
        "{err}"
    );
    assert!(!err.contains("sentence 1"), "{err}");
    let o = kiln(&[&base[..], &["--backend", "cpu", "--json", "short one", &long]].concat());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(o.stderr.is_empty(), "--json says it in the document: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(v["max_tokens"], 256);
    assert_eq!((&v["embeddings"][1]["tokens"], &v["embeddings"][1]["truncated_from"]), (&256.into(), &302.into()));
    assert_eq!(v["embeddings"][0]["truncated_from"], serde_json::Value::Null);

    // Without --tokenizer the one beside the weights is used: the `tokenizer.json` in a
    // safetensors checkpoint's directory, or the weights' own when they are GGUF (as `generate`
    // does); a safetensors file alone has none.
    let o = kiln(&["embed", "models/minilm-l6.toml", "--weights", s(&weights), "hi", "--backend", "cpu"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let alone = std::env::temp_dir().join(format!("kiln-embed-alone-{}", std::process::id()));
    std::fs::create_dir_all(&alone).unwrap();
    let _ = std::fs::remove_file(alone.join("model.safetensors"));
    std::os::unix::fs::symlink(&weights, alone.join("model.safetensors")).unwrap();
    common::failure(
        &["embed", "models/minilm-l6.toml", "--weights", s(&alone.join("model.safetensors")), "hi"],
        &["needs a tokenizer: give --tokenizer"],
    );
    let gguf = common::fetched("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let o = kiln(&["embed", "models/minilm-l6.toml", "--weights", s(&gguf), "hi", "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && !err.contains("needs a tokenizer"), "{err}");
    assert!(err.contains("is not in") || err.contains("outside the model's vocabulary"), "{err}");
}
