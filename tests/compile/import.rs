//! `kiln import`: specs written from checkpoints, checked by the oracle. Each golden case's
//! directory (its `config.json` and weights) is imported, and the imported spec, run on the
//! interpreter, must reproduce the case's reference outputs, as `tests/engines/golden.rs` checks the
//! hand-written specs; so must the close relatives in `tests/fixtures/import/` (tiny random
//! transformers models with their logits, made by its `generate.py`). The real models' files are
//! imported to the same resolved spec as their hand-written ones. Unsupported configurations are
//! refused by name. The imported specs are snapshotted (`snapshots/import@*.snap`).

use crate::common;

use common::root;
use kiln_compiler::interp;
use kiln_compiler::spec::LayerKind;
use kiln_compiler::spec::import::{Hints, MetaValue, gguf, hf_config};
use std::collections::BTreeMap;
use std::path::Path;

/// The largest absolute error allowed against a reference output (as in `tests/engines/golden.rs`).
const TOLERANCE: f32 = 1e-4;

/// Imports the checkpoint directory `dir`, snapshots the spec as `import@{name}`, and returns it.
fn import(dir: &Path, name: &str) -> kiln_runtime::import::Checkpointed {
    let imported = kiln_runtime::import::import(dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"));
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| insta::assert_snapshot!(format!("import@{name}"), imported.imported.text));
    imported
}

/// Imports `dir`, checks every parameter against its weights, and runs the imported spec on the
/// interpreter against every output `io.safetensors` holds.
fn check_case(dir: &Path, name: &str) {
    let imported = import(dir, name);
    let text = &imported.imported.text;
    let report = kiln_runtime::import::check(text, &imported.checkpoint).unwrap();
    assert!(
        report.problems.is_empty(),
        "{name}: {:?}",
        report.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>()
    );
    let fe = kiln_compiler::front_end(name, text).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &imported.weights).unwrap_or_else(|e| panic!("{e}"));
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let outputs = interp::run(&fe.graph, &params, &io).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut compared = 0;
    for (out_name, got) in outputs {
        let Some(expected) = io.get(&out_name) else { continue };
        let err = got.max_abs_diff(expected);
        println!("{name}: {out_name} max abs error {err:e}");
        assert!(err <= TOLERANCE, "{name}: `{out_name}` differs by {err}");
        compared += 1;
    }
    assert!(compared > 0, "{name}: no output was compared");
}

fn golden(name: &str) {
    check_case(&root().join("tests/fixtures").join(name), name);
}

#[test]
fn golden_cases_from_their_configs() {
    for name in ["gpt2", "llama", "bloom", "mixtral", "bert", "gemma3", "t5", "vaswani", "linformer", "bigbird"] {
        golden(name);
    }
}

#[test]
fn close_relatives_match_transformers() {
    for name in
        ["mistral", "qwen2", "qwen3", "phi3", "olmo2", "starcoder2", "gemma2", "gpt_neox", "gpt_bigcode", "falcon"]
    {
        check_case(&root().join("tests/fixtures/import").join(name), name);
    }
}

/// The resolved spec of `text` with `model.name` blanked (names differ; nothing else may).
fn resolved(text: &str) -> kiln_compiler::spec::Resolved {
    let mut r = kiln_compiler::spec::load("spec", text).unwrap_or_else(|e| panic!("{}", e.render()));
    r.spec.model.name = String::new();
    r
}

/// A cached real model's file, or `None` (the test is skipped) when `scripts/fetch-models` has not
/// fetched it.
fn cached(dir: &str, file: &str) -> Option<std::path::PathBuf> {
    let path = common::data_dir().join(dir).join(file);
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipping: {} is not fetched (scripts/fetch-models)", path.display());
        None
    }
}

/// The real GGUF models import to their hand-written specs.
#[test]
fn real_gguf_models_import_to_their_specs() {
    for (dir, file) in
        [("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"), ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf")]
    {
        let Some(path) = cached(dir, file) else { continue };
        let imported = import(&path, dir);
        let report = kiln_runtime::import::check(&imported.imported.text, &imported.checkpoint).unwrap();
        assert!(report.problems.is_empty(), "{dir}: {:?}", report.problems);
        let hand = std::fs::read_to_string(root().join(format!("models/{dir}.toml"))).unwrap();
        assert_eq!(resolved(&imported.imported.text), resolved(&hand), "{dir}");
    }
}

/// all-MiniLM-L6-v2 as a sentence-transformers directory (its cached files, with the pipeline's
/// `modules.json`): the spec of `models/minilm-l6.toml`, reproducing sentence-transformers.
#[test]
fn sentence_transformers_directory() {
    let (Some(config), Some(weights)) = (cached("minilm-l6", "config.json"), cached("minilm-l6", "model.safetensors"))
    else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kiln-import-minilm-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::copy(&config, dir.join("config.json")).unwrap();
    #[cfg(unix)]
    {
        let _ = std::fs::remove_file(dir.join("model.safetensors"));
        std::os::unix::fs::symlink(&weights, dir.join("model.safetensors")).unwrap();
    }
    #[cfg(not(unix))]
    std::fs::copy(&weights, dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("modules.json"),
        r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#,
    )
    .unwrap();
    std::fs::write(dir.join("sentence_bert_config.json"), r#"{"max_seq_length": 256, "do_lower_case": false}"#)
        .unwrap();
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 384, "pooling_mode_cls_token": false, "pooling_mode_mean_tokens": true}"#,
    )
    .unwrap();
    let imported = kiln_runtime::import::import(&dir).unwrap();
    let hand = std::fs::read_to_string(root().join("models/minilm-l6.toml")).unwrap();
    assert_eq!(resolved(&imported.imported.text), resolved(&hand));

    let fe = kiln_compiler::front_end("minilm", &imported.imported.text).unwrap();
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &imported.weights).unwrap();
    let reference = kiln_runtime::read_tensors(&root().join("tests/fixtures/minilm-l6/reference.safetensors")).unwrap();
    let outputs = interp::run(&fe.graph, &params, &reference).unwrap();
    for (name, got) in &outputs {
        let err = got.max_abs_diff(&reference[name]);
        assert!(err <= TOLERANCE, "minilm-l6: `{name}` differs by {err}");
    }
    assert_eq!(outputs.len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The error of importing `config` (a JSON object's text).
fn refusal(config: &str) -> String {
    match hf_config(config, &Hints::default()) {
        Ok(imported) => panic!("imported:\n{}", imported.text),
        Err(e) => e.to_string(),
    }
}

const LLAMA: &str = r#""model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 96"#;

#[test]
fn unsupported_configurations_are_refused_by_name() {
    let cases = [
        (
            format!(r#"{{{LLAMA}, "rope_scaling": {{"type": "yarn", "factor": 4.0}}}}"#),
            "`rope_scaling.type = \"yarn\"` is not supported",
        ),
        (
            format!(r#"{{{LLAMA}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 5e5}}}}"#),
            "`rope_parameters.rope_type = \"llama3\"` is not supported",
        ),
        (format!(r#"{{{LLAMA}, "hidden_act": "gelu_10"}}"#), "`hidden_act = \"gelu_10\"` is not supported"),
        (r#"{"model_type": "mamba", "vocab_size": 128}"#.into(), "`model_type = \"mamba\"` is not supported"),
        (
            r#"{"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": true}"#.into(),
            "`scale_attn_by_inverse_layer_idx = true` is not supported",
        ),
        (
            r#"{"model_type": "falcon", "new_decoder_architecture": true}"#.into(),
            "`new_decoder_architecture = true` is not supported",
        ),
        (r#"{"model_type": "falcon", "alibi": true}"#.into(), "`alibi = true` is not supported"),
        (
            r#"{"model_type": "bloom", "apply_residual_connection_post_layernorm": true}"#.into(),
            "`apply_residual_connection_post_layernorm = true` is not supported",
        ),
        (
            r#"{"model_type": "bert", "position_embedding_type": "relative_key"}"#.into(),
            "`position_embedding_type = \"relative_key\"` is not supported",
        ),
        (
            format!(
                r#"{{{}, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}}"#,
                LLAMA.replace("llama", "mistral")
            ),
            "",
        ),
        (r#"{"model_type": "gemma3", "text_config": {}}"#.into(), "vision tower"),
        (r#"[1, 2]"#.into(), "config.json is not a JSON object"),
        (r#"{"model_type": "llama", "vocab_size": -3}"#.into(), "`vocab_size` = -3 is not a non-negative integer"),
        (r#"{"model_type": "llama", "vocab_size": 128}"#.into(), "config.json has no `hidden_size`"),
    ];
    for (config, expected) in cases {
        if expected.is_empty() {
            // An alternating pattern is expressible: it imports.
            hf_config(&config, &Hints::default()).unwrap_or_else(|e| panic!("{e}"));
            continue;
        }
        let error = refusal(&config);
        assert!(error.contains(expected), "{config}\ngave: {error}\nexpected: {expected}");
    }
}

/// A layer pattern no period gives is imported as the list `attention.layer_types`: a config's
/// `layer_types`, or Qwen's full attention below `max_window_layers` and a window above.
#[test]
fn layer_patterns_import_as_lists() {
    let cases = [
        (
            r#"{"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3,
               "num_attention_heads": 4, "intermediate_size": 96, "sliding_window": 4,
               "layer_types": ["sliding_attention", "full_attention", "full_attention"]}"#
                .to_string(),
            r#"layer_types = ["sliding-window", "global", "global"] # config.json: layer_types"#,
            vec![LayerKind::SlidingWindow, LayerKind::Global, LayerKind::Global],
        ),
        (
            format!(
                r#"{{{}, "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1}}"#,
                LLAMA.replace("llama", "qwen2")
            ),
            r#"layer_types = ["global", "sliding-window"] # config.json: use_sliding_window, max_window_layers"#,
            vec![LayerKind::Global, LayerKind::SlidingWindow],
        ),
        (
            // A periodic list stays the period.
            format!(
                r#"{{{}, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}}"#,
                LLAMA.replace("llama", "mistral")
            ),
            "global_every = 2                 # config.json: layer_types",
            vec![LayerKind::SlidingWindow, LayerKind::Global],
        ),
    ];
    for (config, line, kinds) in cases {
        let text = hf_config(&config, &Hints::default()).unwrap_or_else(|e| panic!("{e}")).text;
        assert!(text.lines().any(|l| l.split_whitespace().eq(line.split_whitespace())), "{line}\nnot in:\n{text}");
        assert_eq!(resolved(&text).layer_kinds, kinds, "{text}");
    }
}

#[test]
fn unsupported_gguf_architectures_and_options_are_refused() {
    let meta = |pairs: &[(&str, MetaValue)]| -> BTreeMap<String, MetaValue> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    };
    let tensors = BTreeMap::from([("token_embd.weight".to_string(), vec![128, 64])]);
    let e = gguf(&meta(&[("general.architecture", MetaValue::Str("mamba".into()))]), &tensors, &Hints::default())
        .unwrap_err();
    assert!(e.to_string().contains("`general.architecture = \"mamba\"` is not supported"), "{e}");
    let llama = [
        ("general.architecture", MetaValue::Str("llama".into())),
        ("llama.embedding_length", MetaValue::Uint(64)),
        ("llama.block_count", MetaValue::Uint(2)),
        ("llama.attention.head_count", MetaValue::Uint(4)),
        ("llama.feed_forward_length", MetaValue::Uint(96)),
    ];
    gguf(&meta(&llama), &tensors, &Hints::default()).unwrap();
    let mut scaled = llama.to_vec();
    scaled.push(("llama.rope.scaling.type", MetaValue::Str("yarn".into())));
    let e = gguf(&meta(&scaled), &tensors, &Hints::default()).unwrap_err();
    assert!(e.to_string().contains("`llama.rope.scaling.type = \"yarn\"` is not supported"), "{e}");
    let mut moe = llama.to_vec();
    moe.push(("llama.expert_count", MetaValue::Uint(8)));
    assert!(gguf(&meta(&moe), &tensors, &Hints::default()).unwrap_err().to_string().contains("expert_count"));
    let mut per_layer = llama.to_vec();
    per_layer.push(("llama.attention.head_count_kv", MetaValue::Array(2)));
    assert!(gguf(&meta(&per_layer), &tensors, &Hints::default()).unwrap_err().to_string().contains("one per layer"));
}

/// A checkpoint whose tensors carry a prefix the family's names lack (`bert.` in a task model)
/// gets explicit entries with it.
#[test]
fn a_tensor_prefix_is_written_out() {
    let config = std::fs::read_to_string(root().join("tests/fixtures/bert/config.json")).unwrap();
    let checkpoint = kiln_runtime::Checkpoint::open(&root().join("tests/fixtures/bert/model.safetensors")).unwrap();
    let tensors = checkpoint.names().into_iter().map(|n| format!("bert.{n}")).collect();
    let hints = Hints { tensors: Some(tensors), ..Hints::default() };
    let text = hf_config(&config, &hints).unwrap().text;
    assert!(!text.contains("preset ="), "{text}");
    assert!(text.contains(r#""embed.tokens" = "bert.embeddings.word_embeddings.weight""#), "{text}");
    // Without a preset the entries stand alone: no empty `[weights]` table before them.
    assert!(!text.contains("[weights]"), "{text}");
    assert!(text.contains("\n[weights.tensors]\n"), "{text}");
}

/// The masked-LM head of a task checkpoint (`BertForMaskedLM`, `tests/fixtures/train_bert_mlm`:
/// `bert.` encoder, `cls.predictions` head, `architectures: null`): seen from its tensors, imported
/// as logits over the vocabulary through the transform, tied, with the head's bias, and every
/// head parameter read from its `cls.` tensor (no `bert.` before it).
#[test]
fn a_masked_lm_head_is_imported_from_its_tensors() {
    let dir = root().join("tests/fixtures/train_bert_mlm");
    let imported = import(&dir, "train_bert_mlm");
    let text = &imported.imported.text;
    let report = kiln_runtime::import::check(text, &imported.checkpoint).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>());
    let fe = kiln_compiler::front_end("train_bert_mlm", text).unwrap_or_else(|e| panic!("{}", e.render()));
    let head = &fe.spec.spec.head;
    assert!(head.transform && head.tied && head.bias, "{head:?}");
    assert_eq!(fe.graph.outputs.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["logits"]);
    let logits = fe.graph.outputs[0].1;
    assert_eq!(fe.graph.g[logits].shape.last(), Some(&kiln_compiler::graph::Dim::Fixed(96)));
    for (param, tensor) in [
        ("head.transform.weight", "cls.predictions.transform.dense.weight"),
        ("head.transform.bias", "cls.predictions.transform.dense.bias"),
        ("head.transform_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
        ("head.transform_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
        ("head.bias", "cls.predictions.bias"),
        ("embed.tokens", "bert.embeddings.word_embeddings.weight"),
    ] {
        assert!(fe.graph.params().iter().any(|(_, n)| *n == param), "no parameter `{param}`");
        assert_eq!(fe.spec.weights.resolve(param).map(|r| r.tensor).as_deref(), Some(tensor), "{param}");
    }
    // Tied: the decoder is the word embedding, no weight of its own.
    assert!(!fe.graph.params().iter().any(|(_, n)| *n == "head.weight"));
}

/// Without tensor names, the architecture says whether the masked-LM head is there: its `cls.`
/// entries stay unprefixed beside the `bert.` encoder; an untied decoder is read from
/// `cls.predictions.decoder.weight`; other task models keep the encoder's output.
#[test]
fn a_masked_lm_head_is_imported_from_the_architecture() {
    let config = std::fs::read_to_string(root().join("tests/fixtures/train_bert_mlm/config.json")).unwrap();
    let with = |replace: &str| {
        let config = config.replace(r#""architectures": null"#, replace);
        let text = hf_config(&config, &Hints::default()).unwrap().text;
        kiln_compiler::front_end("bert", &text).unwrap_or_else(|e| panic!("{}\n{text}", e.render()))
    };
    for arch in ["BertForMaskedLM", "BertForPreTraining"] {
        let fe = with(&format!(r#""architectures": ["{arch}"]"#));
        assert!(fe.spec.spec.head.transform, "{arch}");
        let tensor = |p: &str| fe.spec.weights.resolve(p).map(|r| r.tensor);
        assert_eq!(tensor("head.transform.weight").as_deref(), Some("cls.predictions.transform.dense.weight"));
        assert_eq!(tensor("head.bias").as_deref(), Some("cls.predictions.bias"));
        assert_eq!(tensor("embed.tokens").as_deref(), Some("bert.embeddings.word_embeddings.weight"));
    }
    let untied = with(r#""architectures": ["BertForMaskedLM"], "tie_word_embeddings": false"#);
    let tensor = untied.spec.weights.resolve("head.weight").map(|r| r.tensor);
    assert_eq!(tensor.as_deref(), Some("cls.predictions.decoder.weight"));
    let classifier = with(r#""architectures": ["BertForSequenceClassification"]"#);
    assert!(!classifier.spec.spec.head.transform);
    assert_eq!(classifier.graph.outputs.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["last_hidden_state"]);
}

/// `kiln import` writes the spec and reports the check; `kiln run` takes the directory itself.
#[test]
fn cli_imports_and_runs_a_checkpoint_directory() {
    let kiln = env!("CARGO_BIN_EXE_kiln");
    let dir = root().join("tests/fixtures/llama");
    let out = std::process::Command::new(kiln).args(["import"]).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let spec = String::from_utf8(out.stdout).unwrap();
    assert!(spec.contains("# config.json: rope_parameters.rope_theta"), "{spec}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("all 21 parameters found"), "{stderr}");

    let output = std::env::temp_dir().join(format!("kiln-import-run-{}.safetensors", std::process::id()));
    let out = std::process::Command::new(kiln)
        .arg("run")
        .arg(&dir)
        .arg("--inputs")
        .arg(dir.join("io.safetensors"))
        .arg("--output")
        .arg(&output)
        .args(["--backend", "interp", "--print-spec", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kind = \"decoder\""), "--print-spec shows the spec");
    let got = kiln_runtime::read_tensors(&output).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let err = got["logits"].max_abs_diff(&io["logits"]);
    assert!(err <= TOLERANCE, "logits differ by {err}");
    std::fs::remove_file(&output).unwrap();

    // A refusal is an error naming the option, exit code 1.
    let bad = std::env::temp_dir().join(format!("kiln-import-bad-{}", std::process::id()));
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("config.json"), format!(r#"{{{LLAMA}, "rope_scaling": {{"rope_type": "yarn"}}}}"#))
        .unwrap();
    std::fs::copy(dir.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
    let out = std::process::Command::new(kiln).arg("import").arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("`rope_scaling.rope_type = \"yarn\"` is not supported"), "{stderr}");
    std::fs::remove_dir_all(&bad).unwrap();
}

/// A small deterministic generator of weights in [-0.5, 0.5) (SplitMix64).
fn random_values(count: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// Writes `tensors` (name, shape) as an f32 safetensors file of random values.
fn write_random_checkpoint(path: &Path, tensors: &[(String, Vec<usize>)]) -> BTreeMap<String, Vec<f32>> {
    let values: BTreeMap<String, Vec<f32>> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| (name.clone(), random_values(shape.iter().product(), i as u64 + 1)))
        .collect();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape)| (name.clone(), shape.clone(), values[name].iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views = bytes.iter().map(|(name, shape, data)| {
        (name.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap())
    });
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    values
}

/// Regression (issue 28): an original T5 (v1.0, `feed_forward_proj = "relu"`) stores one input
/// projection per feed-forward, `DenseReluDense.wi`, not v1.1's `wi_0`/`wi_1`; its import must
/// read it (the `t5` preset's feed-forward names follow `ffn.gated`) and the spec must run.
#[test]
fn import_relu_t5_v1_0() {
    let (vocab, d, d_kv, heads, d_ff, buckets, layers) = (64, 32, 8, 4, 48, 32, 2);
    let config = format!(
        r#"{{"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": {vocab},
            "d_model": {d}, "d_kv": {d_kv}, "d_ff": {d_ff}, "num_layers": {layers}, "num_heads": {heads},
            "relative_attention_num_buckets": {buckets}, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-06,
            "initializer_factor": 1.0, "feed_forward_proj": "relu", "is_gated_act": false,
            "is_encoder_decoder": true, "n_positions": 512, "pad_token_id": 0, "eos_token_id": 1,
            "decoder_start_token_id": 0}}"#
    );
    let mut tensors = vec![("shared.weight".to_string(), vec![vocab, d])];
    let inner = heads * d_kv;
    for (stack, ffn_layer) in [("encoder", 1), ("decoder", 2)] {
        tensors.push((
            format!("{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
            vec![buckets, heads],
        ));
        tensors.push((format!("{stack}.final_layer_norm.weight"), vec![d]));
        for i in 0..layers {
            let block = format!("{stack}.block.{i}");
            let mut attention = vec![("layer.0", "SelfAttention")];
            if stack == "decoder" {
                attention.push(("layer.1", "EncDecAttention"));
            }
            for (layer, module) in attention {
                tensors.push((format!("{block}.{layer}.layer_norm.weight"), vec![d]));
                for p in ["q", "k", "v"] {
                    tensors.push((format!("{block}.{layer}.{module}.{p}.weight"), vec![inner, d]));
                }
                tensors.push((format!("{block}.{layer}.{module}.o.weight"), vec![d, inner]));
            }
            tensors.push((format!("{block}.layer.{ffn_layer}.layer_norm.weight"), vec![d]));
            tensors.push((format!("{block}.layer.{ffn_layer}.DenseReluDense.wi.weight"), vec![d_ff, d]));
            tensors.push((format!("{block}.layer.{ffn_layer}.DenseReluDense.wo.weight"), vec![d, d_ff]));
        }
    }
    // The directory's name is the spec's `model.name`.
    let parent = std::env::temp_dir().join(format!("kiln-import-t5-{}", std::process::id()));
    let dir = parent.join("t5-v1_0");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let values = write_random_checkpoint(&dir.join("model.safetensors"), &tensors);

    let imported = import(&dir, "t5-v1_0");
    let text = &imported.imported.text;
    assert!(text.contains("activation = \"relu\"") && text.contains("gated = false"), "{text}");
    let report = kiln_runtime::import::check(text, &imported.checkpoint).unwrap();
    let problems: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert!(problems.is_empty(), "{problems:?}");
    assert!(report.unused.is_empty(), "every tensor is read: {:?}", report.unused);

    let fe = kiln_compiler::front_end("t5-v1_0", text).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &imported.weights).unwrap_or_else(|e| panic!("{e}"));
    for (param, tensor) in [
        ("encoder.layers.1.ffn.up.weight", "encoder.block.1.layer.1.DenseReluDense.wi.weight"),
        ("decoder.layers.0.ffn.up.weight", "decoder.block.0.layer.2.DenseReluDense.wi.weight"),
    ] {
        assert_eq!(params[param].as_f32().unwrap(), values[tensor].as_slice(), "{param}");
    }
    let (batch, src, tgt) = (2, 7, 5);
    let ids = |len: usize, salt: i64| {
        kiln_compiler::tensor::Tensor::i64(
            vec![batch, len],
            (0..(batch * len) as i64).map(|i| (i * 5 + salt) % 64).collect(),
        )
    };
    let padding = kiln_compiler::tensor::Tensor::i64(vec![batch, src], vec![0; batch * src]);
    let inputs = std::collections::HashMap::from([
        ("src_ids".to_string(), ids(src, 3)),
        ("tgt_ids".to_string(), ids(tgt, 1)),
        ("src_padding".to_string(), padding),
    ]);
    let outputs: BTreeMap<String, kiln_compiler::tensor::Tensor> =
        interp::run(&fe.graph, &params, &inputs).unwrap_or_else(|e| panic!("{e}")).into_iter().collect();
    assert_eq!(outputs["logits"].shape, vec![batch, tgt, vocab]);
    assert_eq!(outputs["encoder_hidden_state"].shape, vec![batch, src, d]);
    for (name, t) in &outputs {
        assert!(t.as_f32().unwrap().iter().all(|v| v.is_finite()), "{name} is not finite");
    }
    std::fs::remove_dir_all(&parent).unwrap();
}
