//! `kiln embed` on a sentence-transformers or plain Hugging Face directory (the fetched
//! all-MiniLM-L6-v2, which has no `modules.json`): `--pooling`, `--normalize`, the config beside the
//! model, and the tokenizer beside the weights.

use crate::common::{fails_with, fetched, ok, scratch};
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const SENTENCES: [&str; 2] = ["The cat sits on the mat.", "A feline rests on a rug."];

/// The fetched MiniLM directory.
fn minilm() -> PathBuf {
    fetched("minilm", "minilm-l6", "tokenizer.json");
    fetched("minilm", "minilm-l6", "model.safetensors").parent().unwrap().to_path_buf()
}

/// `kiln embed MODEL SENTENCES... --json ARGS...`: each sentence's vector, and the JSON.
fn embed(model: &str, args: &[&str]) -> (Vec<Vec<f64>>, serde_json::Value) {
    let mut all = vec!["embed", model, "--json", "--backend", "cpu"];
    all.extend(SENTENCES);
    all.extend(args);
    let json: serde_json::Value = serde_json::from_str(&ok(&all)).unwrap();
    let vectors = json["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
        .collect();
    (vectors, json)
}

fn unit(v: &[f64]) -> Vec<f64> {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| x / n).collect()
}

fn close(a: &[Vec<f64>], b: &[Vec<f64>]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        let err = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        assert!(err < 1e-5, "max abs difference {err}");
    }
}

#[test]
fn embed_on_the_plain_minilm_directory_pools_the_mean() {
    let dir = minilm();
    // No modules.json: mean pooling (an encoder's default), not normalized.
    let (plain, json) = embed(s(&dir), &[]);
    assert_eq!((json["pooling"].as_str(), json["normalized"].as_bool()), (Some("mean"), Some(false)));
    // The spec's pipeline (normalized mean) is the same vector scaled.
    let (spec, json) = embed("minilm-l6", &[]);
    assert_eq!(json["normalized"].as_bool(), Some(true));
    close(&plain.iter().map(|v| unit(v)).collect::<Vec<_>>(), &spec);
    let (normalized, _) = embed(s(&dir), &["--normalize"]);
    close(&normalized, &spec);
    let (unnormalized, _) = embed("minilm-l6", &["--normalize=false"]);
    close(&unnormalized, &plain);
}

#[test]
fn embed_follows_the_sentence_transformers_config_beside_the_model() {
    let dir = minilm();
    let st = scratch("embed-st");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        let _ = std::fs::remove_file(st.join(file));
        std::os::unix::fs::symlink(dir.join(file), st.join(file)).unwrap();
    }
    std::fs::create_dir_all(st.join("1_Pooling")).unwrap();
    std::fs::write(
        st.join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 384, "pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#,
    )
    .unwrap();
    // No modules.json: the pooling config alone says CLS (the importer reads modules.json only).
    let (cls, json) = embed(s(&st), &[]);
    assert_eq!(json["pooling"].as_str(), Some("cls"));
    let (flagged, _) = embed(s(&dir), &["--pooling", "cls"]);
    close(&cls, &flagged);
    // With a modules.json naming the Pooling module: the importer leaves a CLS pooling to embed.
    let modules = r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]"#;
    std::fs::write(st.join("modules.json"), modules).unwrap();
    let (with_modules, json) = embed(s(&st), &[]);
    assert_eq!(json["pooling"].as_str(), Some("cls"));
    close(&with_modules.iter().map(|v| unit(v)).collect::<Vec<_>>(), &cls.iter().map(|v| unit(v)).collect::<Vec<_>>());
    std::fs::remove_file(st.join("modules.json")).unwrap();
    // A spec with --weights in that directory reads the same config, and finds its tokenizer.
    let weights = st.join("model.safetensors");
    let (spec_cls, json) = embed("models/minilm-l6.toml", &["--weights", s(&weights)]);
    assert_eq!((json["pooling"].as_str(), json["normalized"].as_bool()), (Some("cls"), Some(true)));
    close(&spec_cls, &cls.iter().map(|v| unit(v)).collect::<Vec<_>>());
    // --pooling overrides it; a pooling kiln does not do is refused, naming the flag.
    let (mean, _) = embed(s(&st), &["--pooling", "mean"]);
    let (plain, _) = embed(s(&dir), &[]);
    close(&mean, &plain);
    std::fs::write(st.join("1_Pooling/config.json"), r#"{"pooling_mode_max_tokens": true}"#).unwrap();
    fails_with(&["embed", s(&st), "x"], &["pooling_mode_max_tokens", "--pooling mean|cls|last|none"]);
    let (last, json) = embed(s(&st), &["--pooling", "last"]);
    assert_eq!(json["pooling"].as_str(), Some("last"));
    assert_ne!(last, mean);
}

#[test]
fn embed_with_a_spec_finds_the_tokenizer_beside_the_weights() {
    let dir = minilm();
    let weights = dir.join("model.safetensors");
    let (vectors, _) = embed("models/minilm-l6.toml", &["--weights", s(&weights)]);
    let (named, _) = embed("minilm-l6", &[]);
    close(&vectors, &named);
}

#[test]
fn pooling_none_gives_every_token_and_refuses_a_similarity() {
    let dir = minilm();
    let out = ok(&["embed", s(&dir), "--pooling", "none", "--json", "--backend", "cpu", "Hi there"]);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let tokens = json["embeddings"][0]["token_embeddings"].as_array().unwrap();
    assert_eq!(tokens.len(), json["embeddings"][0]["tokens"].as_u64().unwrap() as usize);
    assert_eq!(tokens[0].as_array().unwrap().len(), 384);
    fails_with(&["embed", s(&dir), "--pooling", "none", "--similarity", "a", "b"], &["--pooling mean, cls or last"]);
}
