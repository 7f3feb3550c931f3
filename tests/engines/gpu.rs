//! The WGSL kernels on wgpu (lavapipe in CI): golden outputs, and agreement with the reference
//! interpreter on every spec of `models/` at random weights.

use crate::common;

use common::{root, spec};

use kiln_compiler::interp;
use kiln_compiler::lower::lower;
use kiln_runtime::GpuModel;

const TOLERANCE: f32 = 1e-4;

fn golden(name: &str) {
    let Some(gpu) = common::gpu() else { return };
    golden_on(name, gpu);
}

fn golden_on(name: &str, gpu: std::sync::Arc<kiln_runtime::Gpu>) {
    let fe = spec(name);
    let dir = root().join("tests/fixtures").join(name);
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    for (label, graph) in [("unoptimized", &fe.graph), ("optimized", &optimized)] {
        let model = GpuModel::new(gpu.clone(), lower(graph), &params).unwrap();
        let outputs = model.run(&io).unwrap_or_else(|e| panic!("{e}"));
        for (out, got) in outputs {
            let err = got.max_abs_diff(&io[&out]);
            println!("{name}: {out} max abs error on wgpu, {label} {err:e}");
            assert!(err <= TOLERANCE, "{name}: `{out}` differs by {err} on wgpu ({label})");
        }
    }
}

#[test]
fn gpt2_on_wgpu() {
    golden("gpt2");
}

#[test]
fn llama_on_wgpu() {
    golden("llama");
}

#[test]
fn gemma3_on_wgpu() {
    golden("gemma3");
}

/// Soft-capped attention and final logits (the Gemma 3 spec with both caps, random weights) on
/// wgpu equal the interpreter's, both graphs.
#[test]
fn softcapped_logits_on_wgpu() {
    let Some(gpu) = common::gpu() else { return };
    let source = std::fs::read_to_string(root().join("models/gemma3.toml"))
        .unwrap()
        .replace("qk_norm = \"head\"\n", "qk_norm = \"head\"\nsoftcap = 0.5\n")
        .replace("[weights]", "[head]\nsoftcap = 2.0\n\n[weights]");
    let fe = kiln_compiler::front_end("gemma3.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = kiln_compiler::interp::random_params(&fe.graph, 3).unwrap();
    let inputs = kiln_compiler::interp::sample_inputs(&fe.graph, 128, 2, 9).unwrap();
    let reference = kiln_compiler::interp::run(&fe.graph, &params, &inputs).unwrap();
    let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    for graph in [&fe.graph, &optimized] {
        let got = GpuModel::new(gpu.clone(), lower(graph), &params).unwrap().run(&inputs).unwrap();
        let err = got[0].1.max_abs_diff(&reference[0].1);
        assert!(err <= 1e-4, "soft-capped logits on wgpu differ by {err}");
    }
}

#[test]
fn t5_on_wgpu() {
    golden("t5");
}

#[test]
fn linformer_on_wgpu() {
    golden("linformer");
}

#[test]
fn bigbird_on_wgpu() {
    golden("bigbird");
}

/// The WGSL block pattern (SplitMix64 in pairs of u32) equals the interpreter's beyond the
/// fixture: 32 blocks of 2, 3 random blocks each, a seed with high bits set, padded keys.
#[test]
fn block_sparse_pattern_on_wgpu_matches_the_interpreter() {
    let Some(gpu) = common::gpu() else { return };
    let source = std::fs::read_to_string(root().join("models/bigbird.toml"))
        .unwrap()
        .replace("block = 4\n", "block = 2\n")
        .replace("random = 1\n", "random = 3\n")
        .replace("seed = 7\n", "seed = 12345678901234567\n");
    let fe = kiln_compiler::front_end("bigbird.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = kiln_compiler::interp::random_params(&fe.graph, 5).unwrap();
    let inputs = kiln_compiler::interp::sample_inputs(&fe.graph, 128, 2, 64).unwrap();
    let reference = kiln_compiler::interp::run(&fe.graph, &params, &inputs).unwrap();
    let got = GpuModel::new(gpu, lower(&fe.graph), &params).unwrap().run(&inputs).unwrap();
    let err = got[0].1.max_abs_diff(&reference[0].1);
    assert!(err <= 1e-4, "block-sparse attention on wgpu differs by {err}");
}

#[test]
fn bloom_on_wgpu() {
    golden("bloom");
}

#[test]
fn mixtral_on_wgpu() {
    golden("mixtral");
}

#[test]
fn bert_on_wgpu() {
    golden("bert");
}

#[test]
fn vaswani_on_wgpu() {
    golden("vaswani");
}

#[test]
fn every_model_agrees_with_the_interpreter_at_random_weights() {
    let Some(gpu) = common::gpu() else { return };
    for entry in std::fs::read_dir(root().join("models")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let fe = spec(&name);
        let params = interp::random_params(&fe.graph, 11).unwrap();
        let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 2, 5).unwrap();
        let expected = interp::run(&fe.graph, &params, &inputs).unwrap();
        let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
        let model = GpuModel::new(gpu.clone(), lower(&optimized), &params).unwrap();
        let got = model.run(&inputs).unwrap_or_else(|e| panic!("{name}: {e}"));
        for ((n, a), (_, b)) in expected.iter().zip(&got) {
            let scale = a.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let err = a.max_abs_diff(b);
            println!("{name}: {n} optimized wgpu vs unoptimized interpreter {err:e} (max |x| {scale})");
            assert!(err <= 1e-4 * scale, "{name}: `{n}` differs by {err}");
        }
    }
}

#[test]
fn minilm_on_wgpu() {
    let Some(gpu) = common::gpu() else { return };
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let fe = spec("minilm-l6");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &weights).unwrap();
    let reference = kiln_runtime::read_tensors(&root().join("tests/fixtures/minilm-l6/reference.safetensors")).unwrap();
    let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    let model = GpuModel::new(gpu, lower(&optimized), &params).unwrap();
    let outputs = model.run(&reference).unwrap();
    assert_eq!(outputs.len(), 2);
    for (name, got) in outputs {
        let err = got.max_abs_diff(&reference[&name]);
        println!("minilm-l6: {name} max abs error on wgpu {err:e}");
        assert!(err <= TOLERANCE, "minilm-l6: `{name}` differs by {err} on wgpu");
    }
}

/// Tensors larger than the adapter can bind are split into chunk buffers and the kernels read them
/// through chunk-selecting accessors. A 4 KiB cap forces that on almost every tensor of the fixtures.
#[test]
fn tensors_over_the_buffer_limit_are_split_not_refused() {
    let Some(gpu) = common::gpu_with_buffer_limit(4096) else { return };
    assert_eq!(gpu.chunk_bytes(), 4096);
    for name in ["gpt2", "llama", "bert", "vaswani", "mixtral", "bloom"] {
        golden_on(name, gpu.clone());
    }
}

/// Building a model reports each phase from 0 to its total, in order: one pipeline per kernel,
/// one fold per load-time fold, one upload per constant a dispatch reads; the model built with
/// progress runs as one built without.
#[test]
fn building_a_model_reports_every_pipeline_fold_and_upload() {
    use kiln_compiler::lower::Storage;
    use kiln_runtime::Phase;
    let Some(gpu) = common::gpu() else { return };
    let fe = spec("gpt2");
    let dir = root().join("tests/fixtures/gpt2");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let neutral = lower(&kiln_compiler::optimize::optimize(&fe.graph).unwrap().0);
    // What the GPU engine loads: the plan legalized for its kernels (transposed weights as folds).
    let program = kiln_compiler::back::wgsl::compile(&neutral, &Default::default()).unwrap();
    let plan = &program.plan;
    let root_of = |mut v: usize| {
        while let Storage::Alias(a) = plan.values[v].storage {
            v = a;
        }
        v
    };
    let read: std::collections::HashSet<usize> = plan
        .steps
        .iter()
        .flat_map(|s| s.operands.iter().map(|&o| root_of(o)))
        .chain(plan.outputs.iter().map(|&(_, v)| root_of(v)))
        .filter(|&v| matches!(plan.values[v].storage, Storage::Param(_) | Storage::Const))
        .collect();
    let expected =
        [(Phase::Pipelines, program.kernels.len()), (Phase::Fold, plan.folds.len()), (Phase::Upload, read.len())];
    assert!(expected.iter().all(|&(_, n)| n > 0), "{expected:?}");

    let seen = std::cell::RefCell::new(Vec::new());
    let record = |phase: Phase, done: usize, total: usize| seen.borrow_mut().push((phase, done, total));
    let model = GpuModel::with_progress(
        gpu,
        &neutral,
        &Default::default(),
        &params,
        &std::collections::HashMap::new(),
        &record,
    )
    .unwrap();
    let counted: Vec<_> = expected.iter().flat_map(|&(phase, n)| (0..=n).map(move |done| (phase, done, n))).collect();
    assert_eq!(seen.into_inner(), counted);
    let outputs = model.run(&io).unwrap();
    let (_, logits) = outputs.iter().find(|(name, _)| name == "logits").unwrap();
    assert!(logits.max_abs_diff(&io["logits"]) <= TOLERANCE);
}

/// Numerics at the edges, end to end on the fused kernels: a padding mask that hides every key
/// (every attention row fully masked) gives finite outputs, and so does an attention scale of
/// 1000 (scores in the thousands, which a softmax without its max subtracted overflows); both
/// agree with the interpreter, which `compiler/tests/features.rs` checks the same way.
#[test]
fn fully_masked_rows_and_large_logits_stay_finite_on_wgpu() {
    let Some(gpu) = common::gpu() else { return };
    let base = "[model]\nvocab = 50\nd_model = 32\nlayers = 2\nmax_positions = 16\n";
    let masked = format!(
        "{base}kind = \"encoder\"\n[attention]\nheads = 4\npadding_mask = true\n[outputs]\nhidden_states = true\npooling = \"mean\"\n"
    );
    let large = format!("{base}kind = \"decoder\"\n[attention]\nheads = 4\nscale = 1000.0\n");
    let ids = kiln_compiler::tensor::Tensor::i64(vec![2, 5], (0..10).map(|i| i * 7 % 50).collect());
    let no_keys = kiln_compiler::tensor::Tensor::i64(vec![2, 5], vec![0; 10]);
    let cases = [
        ("every key masked", masked, vec![("input_ids", ids.clone()), ("attention_mask", no_keys)]),
        ("scale 1000", large, vec![("input_ids", ids)]),
    ];
    for (label, source, inputs) in cases {
        let fe = kiln_compiler::front_end("edge.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
        let params = interp::random_params(&fe.graph, 12).unwrap();
        let inputs = inputs.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
        let expected = interp::run(&fe.graph, &params, &inputs).unwrap();
        let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
        let got = GpuModel::new(gpu.clone(), lower(&optimized), &params).unwrap().run(&inputs).unwrap();
        for ((n, a), (_, b)) in expected.iter().zip(&got) {
            assert!(b.as_f32().unwrap().iter().all(|v| v.is_finite()), "{label}: `{n}` is not finite on wgpu");
            let scale = a.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let err = a.max_abs_diff(b);
            println!("{label}: {n} wgpu vs interpreter {err:e} (max |x| {scale})");
            assert!(err <= 1e-4 * scale, "{label}: `{n}` differs by {err}");
        }
    }
}

/// BERT's masked-LM head (`head.transform`: dense, GELU, LayerNorm, then the tied decoder and its
/// bias) on wgpu: the interpreter's logits, both graphs, and so transformers' loss.
#[test]
fn bert_masked_lm_on_wgpu() {
    let Some(gpu) = common::gpu() else { return };
    let case = crate::golden::masked_lm();
    let reference = interp::run(&case.fe.graph, &case.params, &case.inputs).unwrap();
    let optimized = kiln_compiler::optimize::optimize(&case.fe.graph).unwrap().0;
    for (label, graph) in [("unoptimized", &case.fe.graph), ("optimized", &optimized)] {
        let got = GpuModel::new(gpu.clone(), lower(graph), &case.params).unwrap().run(&case.inputs).unwrap();
        let err = got[0].1.max_abs_diff(&reference[0].1);
        println!("train_bert_mlm: logits max abs error on wgpu against the interpreter, {label} {err:e}");
        assert!(err <= TOLERANCE, "masked-LM logits on wgpu differ by {err} ({label})");
        let loss = crate::golden::masked_lm_loss(&got[0].1, &case.labels);
        let err = (loss - case.loss).abs();
        assert!(err <= crate::golden::MASKED_LM_LOSS_TOLERANCE, "wgpu ({label}): loss {loss} differs by {err}");
    }
}

/// Issue 32: a tied head is held once on wgpu too. The projection reads the table transposed
/// (padded to whole `vec4`s where the vocabulary is not a multiple of 4), and the gather reads
/// that copy's columns, so the weight bytes on the device are one f32 copy of the parameters
/// plus any padding columns: `kiln new decoder`'s 38.5M parameters were 209.5 MiB with the table
/// held both ways. The logits of a tied GPT-2 with a padded vocabulary agree with the
/// interpreter, and an id past the vocabulary (inside the padding) is still refused. Where the
/// adapter's bindings are too small for the head (GPT-2's 154 MB table on lavapipe's 128 MiB),
/// the projection runs in pieces and the gather reads the same pieces: still one copy (here
/// with bindings of 16 KiB, the tiny table's in 3 pieces).
#[test]
fn tied_weights_are_held_once_on_wgpu() {
    let Some(gpu) = common::gpu() else { return };
    let small = common::gpu_with_buffer_limit(16 * 1024).expect("a GPU with small bindings");
    let gpt2 = std::fs::read_to_string(root().join("models/gpt2.toml")).unwrap().replace("vocab = 128", "vocab = 131");
    let template = std::fs::read_to_string(root().join("src/templates/decoder.toml")).unwrap();
    for (name, source, run, gpu) in [
        ("gpt2, 131 tokens", gpt2.clone(), true, gpu.clone()),
        ("gpt2, 131 tokens, bindings of 16 KiB", gpt2, true, small),
        ("kiln new decoder", template, false, gpu),
    ] {
        let fe = kiln_compiler::front_end("tied.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
        let spec = &fe.spec.spec;
        assert!(spec.head.tied, "{name} is no longer tied");
        let (vocab, d) = (spec.model.vocab as u64, spec.model.d_model as u64);
        let parameters = kiln_compiler::graph::print::summary(&fe.graph, 1).parameters;
        let params = interp::random_params(&fe.graph, 5).unwrap();
        let graph = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
        let model = GpuModel::new(gpu, lower(&graph), &params).unwrap();
        let held: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
        let pieces = model.plan().steps.iter().find_map(|s| match &s.op {
            kiln_compiler::graph::Op::GatherColumns { splits } => Some(splits.len()),
            _ => None,
        });
        assert!(pieces.is_some(), "{name}: the gather reads the projection's copy");
        if name.contains("16 KiB") {
            assert!(pieces > Some(1), "{name}: the table in pieces");
        }
        let padding = 4 * d * (vocab.next_multiple_of(4) - vocab);
        println!("{name}: {parameters} parameters, {held} weight bytes held on wgpu");
        assert_eq!(held, 4 * parameters + padding, "{name}: a tied spec's f32 weights are held as one copy");
        if !run {
            continue;
        }
        let ids = |ids: Vec<i64>| {
            let n = ids.len();
            std::collections::HashMap::from([(
                "input_ids".to_string(),
                kiln_compiler::tensor::Tensor::i64(vec![1, n], ids),
            )])
        };
        let inputs = ids(vec![1, 130, 3]);
        let want = interp::run(&fe.graph, &params, &inputs).unwrap();
        for ((out, want), (_, got)) in want.iter().zip(&model.run(&inputs).unwrap()) {
            let err = got.max_abs_diff(want);
            assert!(err <= TOLERANCE, "{name}: `{out}` differs by {err} with the table held once");
        }
        let e = model.run(&ids(vec![1, 131])).unwrap_err().to_string();
        assert!(e.contains("131") && e.contains("embed.tokens"), "{name}: {e}");
    }
}
