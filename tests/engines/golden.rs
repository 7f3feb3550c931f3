//! Golden numerics: kiln's reference interpreter against the outputs of independent
//! implementations (HF transformers, torch.nn), stored under `tests/fixtures/` (see its README).

use crate::common;

use common::{root, spec};

use kiln_compiler::graph::{Op, PackedAttention};
use kiln_compiler::interp;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::path::Path;

/// The largest absolute error allowed against a golden output.
const TOLERANCE: f32 = 1e-4;

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    kiln_runtime::read_tensors(path).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs a synthetic fixture and checks every expected output it stores. Returns the max errors.
fn check_fixture(name: &str) -> Vec<(String, f32)> {
    let fe = spec(name);
    let dir = root().join("tests/fixtures").join(name);
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{e}"));
    let io = tensors(&dir.join("io.safetensors"));
    let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    let mut errors = Vec::new();
    for (label, graph) in [("unoptimized", &fe.graph), ("optimized", &optimized)] {
        let outputs = interp::run(graph, &params, &io).unwrap_or_else(|e| panic!("{e}"));
        for (out_name, got) in outputs {
            let Some(expected) = io.get(&out_name) else { continue };
            let err = got.max_abs_diff(expected);
            println!("{name}: {out_name} max abs error {err:e} ({label})");
            assert!(err <= TOLERANCE, "{name}: `{out_name}` differs by {err} (> {TOLERANCE}, {label})");
            errors.push((out_name, err));
        }
    }
    assert!(!errors.is_empty(), "{name}: no output was compared");
    errors
}

/// Greedy decoding by re-running the whole sequence at each step (no cache): the continuation of
/// `prompt_ids` must equal `greedy_ids`.
fn check_greedy(name: &str) {
    let fe = spec(name);
    let dir = root().join("tests/fixtures").join(name);
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors"))
        .unwrap_or_else(|e| panic!("{e}"));
    let io = tensors(&dir.join("io.safetensors"));
    let mut ids = io["prompt_ids"].as_i64().expect("ids are integers").to_vec();
    let expected = io["greedy_ids"].as_i64().expect("ids are integers").to_vec();
    let mut generated = Vec::new();
    for _ in 0..expected.len() {
        let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, ids.len()], ids.clone()))]);
        let outputs = interp::run(&fe.graph, &params, &inputs).unwrap_or_else(|e| panic!("{e}"));
        let logits = &outputs.iter().find(|(n, _)| n == "logits").expect("decoder has logits").1;
        let vocab = *logits.shape.last().expect("logits have a vocabulary axis");
        let last = &logits.as_f32().expect("f32 logits")[(ids.len() - 1) * vocab..ids.len() * vocab];
        let next = argmax(last);
        generated.push(next);
        ids.push(next);
    }
    assert_eq!(generated, expected, "{name}: greedy continuation");
}

fn argmax(v: &[f32]) -> i64 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as i64
}

#[test]
fn gpt2_logits() {
    check_fixture("gpt2");
}

#[test]
fn gpt2_greedy() {
    check_greedy("gpt2");
}

#[test]
fn llama_logits() {
    check_fixture("llama");
}

#[test]
fn llama_greedy() {
    check_greedy("llama");
}

/// T5 with the source mask in either polarity: `src_mask` (HF: 1 = token) or `src_padding`
/// (torch.nn: 1 = padding), or both (the fixture's file) when they agree; disagreeing ones are
/// refused.
#[test]
fn t5_logits_with_either_mask() {
    check_fixture("t5");
    let fe = spec("t5");
    let dir = root().join("tests/fixtures/t5");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = tensors(&dir.join("io.safetensors"));
    for mask in ["src_mask", "src_padding"] {
        let inputs: HashMap<String, Tensor> =
            ["src_ids", "tgt_ids", mask].iter().map(|&n| (n.to_string(), io[n].clone())).collect();
        let out = interp::run(&fe.graph, &params, &inputs).unwrap();
        for (name, got) in &out {
            let err = got.max_abs_diff(&io[name]);
            assert!(err <= TOLERANCE, "t5 with `{mask}`: `{name}` differs by {err}");
        }
    }
    let mut bad = io.clone();
    bad.insert("src_mask".into(), io["src_padding"].clone());
    let e = interp::run(&fe.graph, &params, &bad).unwrap_err().to_string();
    assert!(e.contains("disagree"), "{e}");
}

/// Linformer at the full length and at a shorter one (the first rows of its projections).
#[test]
fn linformer_logits_at_two_lengths() {
    check_fixture("linformer");
    let fe = spec("linformer");
    let dir = root().join("tests/fixtures/linformer");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = tensors(&dir.join("io.safetensors"));
    let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    for graph in [&fe.graph, &optimized] {
        let inputs = HashMap::from([("input_ids".to_string(), io["short_input_ids"].clone())]);
        let out = interp::run(graph, &params, &inputs).unwrap();
        let err = out[0].1.max_abs_diff(&io["short_logits"]);
        assert!(err <= TOLERANCE, "linformer, 20 tokens: logits differ by {err}");
    }
    // A longer input than the projections have rows is an error, not a read past them.
    let long = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, 40], vec![1; 40]))]);
    assert!(interp::run(&fe.graph, &params, &long).is_err());
}

/// Two parameters may read one tensor: Linformer with `proj_v` mapped to each layer's `proj_k`
/// tensor is Linformer with one shared projection (`low_rank_shared`, whose graph has no `proj_v`).
#[test]
fn two_parameters_may_map_to_one_tensor() {
    let source = std::fs::read_to_string(root().join("models/linformer.toml")).unwrap();
    let proj_v = "\"layers.{i}.attn.proj_v\" = \"linformer.net.layers.{i}.0.fn.proj_v\"";
    assert!(source.contains(proj_v));
    let mapped = source.replace(proj_v, "\"layers.{i}.attn.proj_v\" = \"linformer.net.layers.{i}.0.fn.proj_k\"");
    let shared =
        source.replace(&format!("{proj_v}\n"), "").replace("low_rank = 8", "low_rank = 8\nlow_rank_shared = true");
    let weights = root().join("tests/fixtures/linformer/model.safetensors");
    let io = tensors(&root().join("tests/fixtures/linformer/io.safetensors"));
    let inputs = HashMap::from([("input_ids".to_string(), io["input_ids"].clone())]);
    let logits = |text: &str| {
        let fe = kiln_compiler::front_end("linformer.toml", text).unwrap_or_else(|e| panic!("{}", e.render()));
        let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &weights).unwrap_or_else(|e| panic!("{e}"));
        (params.len(), interp::run(&fe.graph, &params, &inputs).unwrap().remove(0).1)
    };
    let ((mapped_params, a), (shared_params, b)) = (logits(&mapped), logits(&shared));
    assert_eq!(a, b);
    assert_eq!(mapped_params, shared_params + 2, "one `proj_v` per layer more, read from `proj_k`");
    let (_, original) = logits(&source);
    assert_ne!(a, original, "the fixture's `proj_v` differs from its `proj_k`");
}

/// Linformer's attention holds no n x n matrix, even unfused: the intermediates of its plan grow
/// linearly with the sequence (4x the tokens, at most ~4x the bytes live at once), where dense
/// attention's grow quadratically.
#[test]
fn linformer_intermediates_grow_linearly() {
    let source = std::fs::read_to_string(root().join("models/linformer.toml"))
        .unwrap()
        .replace("max_positions = 32", "max_positions = 4096");
    let dense_source = source
        .lines()
        .filter(|l| !l.contains("low_rank") && !l.contains("proj_"))
        .map(|l| format!("{l}\n"))
        .collect::<String>();
    // Unoptimized graphs: dense attention's scores are a matrix there (the fused kernel would hide
    // them); Linformer's are `n x 8`.
    let bytes = |source: &str, seq: usize| {
        let fe = kiln_compiler::front_end("linformer.toml", source).unwrap_or_else(|e| panic!("{}", e.render()));
        let plan = kiln_compiler::lower::lower(&fe.graph);
        let syms = HashMap::from([(kiln_compiler::graph::Sym::Batch, 1), (kiln_compiler::graph::Sym::Seq, seq)]);
        plan.peak_live(&syms) as f64
    };
    let (low, dense) =
        (bytes(&source, 4096) / bytes(&source, 1024), bytes(&dense_source, 4096) / bytes(&dense_source, 1024));
    assert!(low <= 4.1, "linformer: 4x the tokens, {low:.2}x the live bytes");
    assert!(dense > 4.5, "dense attention grows faster: {dense:.2}x");
}

/// BigBird's fused attention visits only the attended blocks and holds no score matrix: the
/// optimized plan's intermediates grow linearly with the sequence (4x the tokens, at most ~4x the
/// bytes live at once), where the unoptimized graph's block-sparse mask over a dense score matrix
/// grows quadratically.
#[test]
fn bigbird_intermediates_grow_linearly() {
    let source = std::fs::read_to_string(root().join("models/bigbird.toml"))
        .unwrap()
        .replace("max_positions = 64", "max_positions = 4096")
        .replace("block = 4", "block = 64");
    let fe = kiln_compiler::front_end("bigbird.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    let bytes = |graph: &kiln_compiler::graph::Graph, seq: usize| {
        let plan = kiln_compiler::lower::lower(graph);
        let syms = HashMap::from([(kiln_compiler::graph::Sym::Batch, 1), (kiln_compiler::graph::Sym::Seq, seq)]);
        plan.peak_live(&syms) as f64
    };
    let fused = bytes(&optimized, 4096) / bytes(&optimized, 1024);
    let dense = bytes(&fe.graph, 4096) / bytes(&fe.graph, 1024);
    assert!(fused <= 4.1, "bigbird, fused: 4x the tokens, {fused:.2}x the live bytes");
    assert!(dense > 8.0, "the unfused score matrix grows quadratically: {dense:.2}x");
    assert!(
        optimized.g.node_weights().any(
            |n| matches!(&n.op, Op::PackedAttention(PackedAttention { mods, .. }) | Op::Attention { mods, .. } if mods.sparse.is_some())
        ),
        "the block pattern is not fused into the attention"
    );
}

/// The BigBird-style encoder, and its block pattern equal to the fixture's `allowed_blocks`.
#[test]
fn bigbird_hidden_state_and_pattern() {
    check_fixture("bigbird");
    let io = tensors(&root().join("tests/fixtures/bigbird/io.safetensors"));
    let expected: Vec<bool> = io["allowed_blocks"].to_f32_vec().iter().map(|&x| x != 0.0).collect();
    assert_eq!(kiln_compiler::semantics::block_pattern(8, 1, 1, 1, 7), expected);
}

#[test]
fn gemma3_logits() {
    check_fixture("gemma3");
}

#[test]
fn gemma3_greedy() {
    check_greedy("gemma3");
}

#[test]
fn bloom_logits() {
    check_fixture("bloom");
}

#[test]
fn bloom_greedy() {
    check_greedy("bloom");
}

#[test]
fn mixtral_logits() {
    check_fixture("mixtral");
}

#[test]
fn mixtral_greedy() {
    check_greedy("mixtral");
}

#[test]
fn bert_last_hidden_state_with_padding() {
    check_fixture("bert");
}

#[test]
fn vaswani_encoder_decoder_logits() {
    check_fixture("vaswani");
}

#[test]
fn minilm_matches_sentence_transformers() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let fe = spec("minilm-l6");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &weights).unwrap_or_else(|e| panic!("{e}"));
    let reference = tensors(&root().join("tests/fixtures/minilm-l6/reference.safetensors"));
    let outputs = interp::run(&fe.graph, &params, &reference).unwrap_or_else(|e| panic!("{e}"));
    let mut compared = 0;
    for (name, got) in &outputs {
        let expected = &reference[name];
        let err = got.max_abs_diff(expected);
        println!("minilm-l6: {name} max abs error {err:e}");
        assert!(err <= TOLERANCE, "minilm-l6: `{name}` differs by {err}");
        compared += 1;
    }
    assert_eq!(compared, 2, "last_hidden_state and sentence_embedding are both compared");
}

/// The largest absolute error allowed against transformers on the GGUF model: both sides
/// dequantize the same blocks to f32, but 30 layers of f32 arithmetic in a different order add up.
const SMOLLM2_TOLERANCE: f32 = 1e-3;

/// The same for Gemma 3 270M: 18 layers, logits of scale ~30 over a vocabulary of 262144.
const GEMMA3_270M_TOLERANCE: f32 = 2e-4;

/// A real model's GGUF (`file` in the cache's `dir`, fetched as `model`) against transformers'
/// GGUF loader, on the interpreter: logits at the first and the last prompt position within
/// `tolerance`.
fn check_gguf_logits(model: &str, dir: &str, file: &str, tolerance: f32) {
    let weights = common::fetched(model, dir, file);
    let fe = spec(dir);
    let start = std::time::Instant::now();
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &weights).unwrap_or_else(|e| panic!("{e}"));
    println!("{dir}: weights loaded in {:.1?}", start.elapsed());
    let reference = tensors(&root().join(format!("tests/fixtures/{dir}/reference.safetensors")));
    let ids = &reference["prompt_ids"];
    let start = std::time::Instant::now();
    let inputs = HashMap::from([("input_ids".to_string(), ids.clone())]);
    let outputs = interp::run(&fe.graph, &params, &inputs).unwrap_or_else(|e| panic!("{e}"));
    println!("{dir}: {} positions in {:.1?}", ids.len(), start.elapsed());
    let logits = &outputs.iter().find(|(n, _)| n == "logits").expect("decoder has logits").1;
    let values = logits.as_f32().expect("f32 logits");
    let vocab = *logits.shape.last().expect("logits have a vocabulary axis");
    let positions = values.len() / vocab;
    for (name, position) in [("first_logits", 0), ("last_logits", positions - 1)] {
        let got = Tensor::f32(vec![vocab], values[position * vocab..(position + 1) * vocab].to_vec());
        // The references store `[vocab]` (SmolLM2) or `[1, vocab]` (Gemma 3).
        let expected = Tensor::f32(vec![vocab], reference[name].as_f32().expect("f32 logits").to_vec());
        let err = got.max_abs_diff(&expected);
        println!("{dir}: {name} max abs error {err:e}");
        assert!(err <= tolerance, "{dir}: `{name}` differs by {err}");
    }
}

/// Gemma 3 270M from llama.cpp's Q4_K_M GGUF (Q5_0, Q4_K, Q6_K and Q8_0 matrices, tied head).
#[test]
fn gemma3_270m_gguf_matches_transformers() {
    check_gguf_logits("gemma3", "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", GEMMA3_270M_TOLERANCE);
}

/// SmolLM2-135M-Instruct from llama.cpp's GGUF (Q4_1 matrices, Q8_0 embedding, tied head).
#[test]
fn smollm2_gguf_matches_transformers() {
    check_gguf_logits("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", SMOLLM2_TOLERANCE);
}

/// The masked-LM case `train_bert_mlm` (HF `BertForMaskedLM`, imported from its directory) at its
/// initial weights: the front end, the parameters, batch 0 of `data.safetensors` as inputs, and its
/// labels (-100 where no loss is taken).
pub(crate) struct MaskedLm {
    pub fe: kiln_compiler::FrontEnd,
    pub params: HashMap<String, Tensor>,
    pub inputs: HashMap<String, Tensor>,
    pub labels: Vec<i64>,
    /// transformers' loss on the batch (`expected.safetensors`: `loss[0]`).
    pub loss: f64,
}

pub(crate) fn masked_lm() -> MaskedLm {
    let dir = root().join("tests/fixtures/train_bert_mlm");
    let imported = kiln_runtime::import::import(&dir).unwrap_or_else(|e| panic!("{e}"));
    let fe = kiln_compiler::front_end("train_bert_mlm", &imported.imported.text)
        .unwrap_or_else(|e| panic!("{}", e.render()));
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &imported.weights).unwrap_or_else(|e| panic!("{e}"));
    let data = tensors(&dir.join("data.safetensors"));
    // Batch 0 of the `[steps, batch, seq]` tensors.
    let batch0 = |name: &str| {
        let t = &data[name];
        let (rows, seq) = (t.shape[1], t.shape[2]);
        Tensor::i64(vec![rows, seq], t.as_i64().expect("ids are integers")[..rows * seq].to_vec())
    };
    let inputs = ["input_ids", "attention_mask", "token_type_ids"].map(|n| (n.to_string(), batch0(n))).into();
    let labels = batch0("labels").as_i64().expect("labels are integers").to_vec();
    // Read as stored, f64 (kiln's tensors would make it f32).
    let expected = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let expected = safetensors::SafeTensors::deserialize(&expected).unwrap();
    let losses = expected.tensor("loss").unwrap();
    assert_eq!(losses.dtype(), safetensors::Dtype::F64);
    let loss = f64::from_le_bytes(losses.data()[..8].try_into().unwrap());
    MaskedLm { fe, params, inputs, labels, loss }
}

/// The mean cross-entropy of `logits` (`[.., vocab]`) against `labels` over the positions whose
/// label is not -100, with the log-softmax in f64 (transformers' masked-LM loss).
pub(crate) fn masked_lm_loss(logits: &Tensor, labels: &[i64]) -> f64 {
    let vocab = *logits.shape.last().expect("logits have a vocabulary axis");
    let values = logits.as_f32().expect("f32 logits");
    assert_eq!(values.len(), labels.len() * vocab);
    let (mut total, mut count) = (0.0, 0);
    for (row, &label) in values.chunks(vocab).zip(labels) {
        if label == -100 {
            continue;
        }
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let log_sum = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
        total += log_sum - row[label as usize] as f64;
        count += 1;
    }
    assert!(count > 0, "no position is labelled");
    total / count as f64
}

/// The allowed difference of the loss from transformers'.
pub(crate) const MASKED_LM_LOSS_TOLERANCE: f64 = 1e-4;

/// BERT's masked-LM head (`head.transform`, tied decoder, its own bias): the loss of the initial
/// model on batch 0 equals transformers', on the interpreter (both graphs) and the CPU back end.
#[test]
fn bert_masked_lm_loss_matches_transformers() {
    let case = masked_lm();
    let optimized = kiln_compiler::optimize::optimize(&case.fe.graph).unwrap().0;
    let mut runs = Vec::new();
    for (label, graph) in [("interpreter", &case.fe.graph), ("interpreter, optimized", &optimized)] {
        runs.push((label, interp::run(graph, &case.params, &case.inputs).unwrap_or_else(|e| panic!("{e}"))));
    }
    let cpu =
        kiln_runtime::CpuModel::new(kiln_compiler::lower::lower(&optimized), &case.params, &HashMap::new(), 2, &())
            .unwrap_or_else(|e| panic!("{e}"));
    runs.push(("cpu", cpu.run(&case.inputs).unwrap_or_else(|e| panic!("{e}"))));
    for (label, outputs) in runs {
        let logits = &outputs.iter().find(|(n, _)| n == "logits").expect("the model has logits").1;
        assert_eq!(logits.shape, [4, 32, 96], "{label}");
        let loss = masked_lm_loss(logits, &case.labels);
        let err = (loss - case.loss).abs();
        println!("train_bert_mlm: loss {loss} on the {label}, transformers {} (error {err:e})", case.loss);
        assert!(err <= MASKED_LM_LOSS_TOLERANCE, "{label}: loss {loss} differs from {} by {err}", case.loss);
    }
}
