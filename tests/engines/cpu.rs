//! The native CPU backend (`kiln_runtime::cpu`): golden outputs (f32 weights within 1e-4),
//! agreement with the reference interpreter on every spec of `models/` at random weights and at
//! several thread counts, the real models (MiniLM's embeddings, SmolLM2's quantized logits and
//! greedy continuation), cached decoding equal to recomputation, and artifacts compiled for wgpu
//! running unchanged.

use crate::common;

use common::{root, spec};

use kiln_compiler::graph::build::build_cached;
use kiln_compiler::lower::{Options, lower, lower_with};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{interp, optimize};
use kiln_runtime::CpuModel;
use kiln_runtime::Sampler;
use kiln_runtime::generate::{Session, generate};
use kiln_runtime::{CpuEngine, Request};
use std::collections::HashMap;

const TOLERANCE: f32 = 1e-4;

fn cpu(plan: kiln_compiler::lower::Plan, params: &HashMap<String, Tensor>, threads: usize) -> CpuModel {
    CpuModel::new(plan, params, &HashMap::new(), threads, &()).unwrap_or_else(|e| panic!("{e}"))
}

fn golden(name: &str) {
    let fe = spec(name);
    let dir = root().join("tests/fixtures").join(name);
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let optimized = optimize::optimize(&fe.graph).unwrap().0;
    for (label, graph) in [("unoptimized", &fe.graph), ("optimized", &optimized)] {
        let model = cpu(lower(graph), &params, 2);
        let outputs = model.run(&io).unwrap_or_else(|e| panic!("{e}"));
        assert!(!outputs.is_empty());
        for (out, got) in outputs {
            let err = got.max_abs_diff(&io[&out]);
            println!("{name}: {out} max abs error on cpu, {label} {err:e}");
            assert!(err <= TOLERANCE, "{name}: `{out}` differs by {err} on cpu ({label})");
        }
    }
}

/// The kernels' bounds (`debug_span` and `debug_assert!` beside each unsafe access) are checked
/// while these tests run: the test profile keeps debug assertions (`[profile.test]` in
/// Cargo.toml). A release build (`cargo test --release`) has none, and skips this.
#[test]
#[cfg_attr(not(debug_assertions), ignore = "a release build has no debug assertions")]
fn the_tests_check_the_kernel_bounds() {
    let (x, w) = ([1.0f32; 6], [1.0f32; 6]);
    let short = std::panic::catch_unwind(|| {
        kiln_runtime::cpu::linear::gemm_f32(2, 2, 3, &x[..5], &w, None, &mut [0.0; 4], 1);
    });
    assert!(cfg!(debug_assertions) && short.is_err(), "an input one element short of a projection's passed unchecked");
}

/// An encoder's mean pool on its native kernel equals the interpreter's bit for bit (the same
/// f64 sums in token order), on one thread and on three: fractional weights, a sequence with
/// every token masked (its count clamped, a zero mean), and a NaN under a masked token, which
/// the interpreter's sum carries (`0 * NaN`).
#[test]
fn mean_pool_equals_the_interpreter_bit_for_bit() {
    use kiln_compiler::graph::{Graph, Op};
    let (b, s, d) = (20, 9, 37);
    let mut g = Graph::new("pool");
    let x = g.param("x", &[b, s, d]);
    let mask = g.param("mask", &[b, s]);
    let y = g.add(Op::MeanPool, &[x, mask]).unwrap();
    g.outputs.push(("pooled".into(), y));
    let mut params = interp::random_params(&g, 5).unwrap();
    let mut m: Vec<f32> = (0..b * s).map(|i| [1.0, 0.0, 0.5, 1.0, 0.25][i % 5]).collect();
    m[s..2 * s].fill(0.0);
    params.insert("mask".into(), Tensor::f32(vec![b, s], m));
    let mut xs = params["x"].as_f32().unwrap().to_vec();
    xs[(3 * s + 1) * d + 4] = f32::NAN; // Row 3's second token: mask 0.0.
    params.insert("x".into(), Tensor::f32(vec![b, s, d], xs));
    let want = interp::run(&g, &params, &HashMap::new()).unwrap();
    let want = want[0].1.as_f32().unwrap();
    assert!(want[3 * d + 4].is_nan() && want[d..2 * d].iter().all(|&v| v == 0.0));
    let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
    for threads in [1, 3] {
        let got = cpu(plan.clone(), &params, threads).run(&HashMap::new()).unwrap();
        let got = got[0].1.as_f32().unwrap();
        let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{threads} threads: the pooled rows differ from the interpreter's");
    }
}

#[test]
fn gpt2_on_cpu() {
    golden("gpt2");
}

#[test]
fn llama_on_cpu() {
    golden("llama");
}

#[test]
fn gemma3_on_cpu() {
    golden("gemma3");
}

#[test]
fn t5_on_cpu() {
    golden("t5");
}

#[test]
fn linformer_on_cpu() {
    golden("linformer");
}

#[test]
fn bigbird_on_cpu() {
    golden("bigbird");
}

#[test]
fn bloom_on_cpu() {
    golden("bloom");
}

#[test]
fn mixtral_on_cpu() {
    golden("mixtral");
}

#[test]
fn bert_on_cpu() {
    golden("bert");
}

#[test]
fn vaswani_on_cpu() {
    golden("vaswani");
}

/// Every spec, optimized, on 1, 2 and 3 threads (3 splits rows unevenly on this 2-core
/// machine), against the unoptimized graph on the interpreter; odd batch and sequence sizes.
#[test]
fn every_model_agrees_with_the_interpreter_at_random_weights() {
    for entry in std::fs::read_dir(root().join("models")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let fe = spec(&name);
        let params = interp::random_params(&fe.graph, 11).unwrap();
        let optimized = optimize::optimize(&fe.graph).unwrap().0;
        for (batch, seq) in [(2, 5), (1, 1), (3, 17)] {
            let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, batch, seq).unwrap();
            let expected = interp::run(&fe.graph, &params, &inputs).unwrap();
            for threads in [1, 2, 3] {
                let model = cpu(lower(&optimized), &params, threads);
                let got = model.run(&inputs).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(got.len(), expected.len());
                for ((n, a), (m, b)) in expected.iter().zip(&got) {
                    assert_eq!(n, m);
                    let scale = a.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
                    let err = a.max_abs_diff(b);
                    assert!(
                        err <= 1e-4 * scale,
                        "{name} [{batch}x{seq}, {threads} threads]: `{n}` differs by {err} (max |x| {scale})"
                    );
                }
            }
        }
    }
}

/// The plan-level oracle: on every spec's optimized plan, the native kernels agree with the same
/// plan run step by step through the interpreter's op definitions (`CpuModel::reference`, what
/// `kiln run model.kiln --backend interp` runs), which in turn agrees with the unoptimized graph.
#[test]
fn native_kernels_agree_with_the_plans_reference() {
    for entry in std::fs::read_dir(root().join("models")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let fe = spec(&name);
        let params = interp::random_params(&fe.graph, 5).unwrap();
        let plan = lower(&optimize::optimize(&fe.graph).unwrap().0);
        let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 2, 7).unwrap();
        let graph = interp::run(&fe.graph, &params, &inputs).unwrap();
        let reference = CpuModel::reference(plan.clone(), params.clone(), &()).unwrap().run(&inputs).unwrap();
        let native = cpu(plan, &params, 2).run(&inputs).unwrap();
        for (((n, g), (_, r)), (_, x)) in graph.iter().zip(&reference).zip(&native) {
            let scale = g.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let (to_graph, to_native) = (g.max_abs_diff(r), r.max_abs_diff(x));
            assert!(to_graph <= 1e-4 * scale, "{name}: the plan's `{n}` differs from the graph's by {to_graph}");
            assert!(to_native <= 1e-4 * scale, "{name}: native `{n}` differs from the plan's reference by {to_native}");
        }
    }
}

/// Soft-capping (`attention.softcap`, `head.softcap`; no fixture uses them): the Gemma 3 spec
/// with both caps, at random weights: every logit within the head's cap, the CPU backend (both
/// graphs) equal to the interpreter, and a cap too large to bind equal to none.
#[test]
fn softcapped_logits() {
    let base = std::fs::read_to_string(root().join("models/gemma3.toml")).unwrap();
    let with = |attn: f64, head: f64| {
        let source = base
            .replace("qk_norm = \"head\"\n", &format!("qk_norm = \"head\"\nsoftcap = {attn:?}\n"))
            .replace("[weights]", &format!("[head]\nsoftcap = {head:?}\n\n[weights]"));
        kiln_compiler::front_end("gemma3.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()))
    };
    let (capped, loose, plain) = (with(0.5, 2.0), with(1e6, 1e6), spec("gemma3"));
    let params = interp::random_params(&capped.graph, 3).unwrap();
    let inputs = interp::sample_inputs(&capped.graph, 128, 2, 9).unwrap();
    let logits = |g: &kiln_compiler::graph::Graph| interp::run(g, &params, &inputs).unwrap()[0].1.clone();
    let reference = logits(&capped.graph);
    assert!(reference.as_f32().unwrap().iter().all(|x| x.abs() < 2.0), "logits within the cap");
    assert!(logits(&loose.graph).max_abs_diff(&logits(&plain.graph)) <= 1e-4, "a cap that never binds");
    assert!(reference.max_abs_diff(&logits(&plain.graph)) > 0.1, "the caps change the logits");
    let optimized = optimize::optimize(&capped.graph).unwrap().0;
    for graph in [&capped.graph, &optimized] {
        let got = cpu(lower(graph), &params, 2).run(&inputs).unwrap();
        let err = got[0].1.max_abs_diff(&reference);
        assert!(err <= 1e-4, "soft-capped logits on cpu differ by {err}");
    }
}

/// The native permute (a strided copy per output row) equals the interpreter's for every
/// permutation of a rank-4 tensor of odd sizes, and at ranks 2 and 3.
#[test]
fn permutes_match_the_interpreter() {
    use kiln_compiler::graph::{Graph, Op};
    let mut cases: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
    let dims = [3usize, 5, 1, 7];
    for code in 0..256usize {
        let perm: Vec<usize> = (0..4).map(|i| code >> (2 * i) & 3).collect();
        if (0..4).all(|axis| perm.contains(&axis)) {
            cases.push((dims.to_vec(), perm));
        }
    }
    assert_eq!(cases.len(), 24);
    cases.push((vec![9, 4], vec![1, 0]));
    cases.push((vec![2, 3, 5], vec![2, 0, 1]));
    for (shape, perm) in cases {
        let mut g = Graph::new("permute");
        let x = g.param("x", &shape);
        let y = g.add(Op::Permute { perm: perm.clone() }, &[x]).unwrap();
        g.outputs.push(("y".into(), y));
        let params = interp::random_params(&g, 1).unwrap();
        let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
        let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
        let got = cpu(plan, &params, 2).run(&HashMap::new()).unwrap();
        assert_eq!(got[0].1, expected[0].1, "permute {perm:?} of {shape:?}");
    }
}

/// A weight stored `[in, out]` in a plan that folds nothing (a training step's): the projections
/// and products reading its transpose, or row slices of it (a packed weight's parts), read the
/// parameter in place, and the transposes and slices are not run — the outputs as the
/// interpreter's, at one and two threads, the parameters given at build and lent for a run.
#[test]
fn weights_stored_in_out_are_read_in_place() {
    use kiln_compiler::back::cpu::write;
    use kiln_compiler::graph::{Activation, Graph, InputRole, Op, Sym};
    let (d, parts) = (6usize, 3usize);
    let mut g = Graph::new("views");
    let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
    let table = g.param("table", &[16, d]);
    let x = g.add(Op::Gather, &[table, ids]).unwrap();
    // A packed [in, out * 3] weight read as three slices of its transpose, and a square one read
    // whole by a projection and by a product (an input's gradient).
    let packed = g.param("packed", &[d, parts * d]);
    let packed_t = g.add(Op::Permute { perm: vec![1, 0] }, &[packed]).unwrap();
    let mut ys = Vec::new();
    for i in 0..parts {
        let w = g.add(Op::Slice { axis: 0, start: i * d, len: d }, &[packed_t]).unwrap();
        let lin = Op::Linear {
            act: Some(Activation::Relu),
            bias: false,
            residual: false,
            norm: None,
            glu: false,
            rope: None,
        };
        ys.push(g.add(lin, &[x, w]).unwrap());
    }
    let square = g.param("square", &[d, d]);
    let square_t = g.add(Op::Permute { perm: vec![1, 0] }, &[square]).unwrap();
    let lin = Op::Linear { act: None, bias: false, residual: false, norm: None, glu: false, rope: None };
    let y = g.add(lin, &[ys[0], square_t]).unwrap();
    let back = g.add(Op::MatMul { transpose_b: false }, &[ys[1], square_t]).unwrap();
    let back_t = g.add(Op::MatMul { transpose_b: true }, &[ys[2], square_t]).unwrap();
    for (name, v) in [("y", y), ("back", back), ("back_t", back_t)] {
        g.outputs.push((name.into(), v));
    }
    let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
    let program = write(&plan);
    assert_eq!(program.weight_views.len(), 4, "{program:?}");
    // The two transposes and the three slices.
    assert_eq!(program.skipped.len(), 5, "{program:?}");
    let mut params = interp::random_params(&g, 7).unwrap();
    let inputs = HashMap::from([(
        "input_ids".to_string(),
        Tensor::i64(vec![2, 5], (0..10).map(|i| (i * 7 + 3) % 16).collect()),
    )]);
    let expected = interp::run(&g, &params, &inputs).unwrap();
    for threads in [1, 2] {
        let mut model = CpuModel::for_training(plan.clone(), params.clone(), threads, &()).unwrap();
        let built = model.run(&inputs).unwrap();
        let lent = model.run_lent(&mut params, &inputs).unwrap().expect("the parameters are lent");
        assert_eq!(params.len(), 3, "the parameters are given back");
        for got in [built, lent] {
            for ((name, a), (_, b)) in got.iter().zip(&expected) {
                let err = a.max_abs_diff(b);
                assert!(err <= 1e-5, "{name} at {threads} threads: {err}");
            }
        }
    }
}

#[test]
fn minilm_on_cpu() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let fe = spec("minilm-l6");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &weights).unwrap();
    let reference = kiln_runtime::read_tensors(&root().join("tests/fixtures/minilm-l6/reference.safetensors")).unwrap();
    let optimized = optimize::optimize(&fe.graph).unwrap().0;
    let outputs = cpu(lower(&optimized), &params, 2).run(&reference).unwrap();
    assert_eq!(outputs.len(), 2);
    for (name, got) in outputs {
        let err = got.max_abs_diff(&reference[&name]);
        println!("minilm-l6: {name} max abs error on cpu {err:e}");
        assert!(err <= TOLERANCE, "minilm-l6: `{name}` differs by {err} on cpu");
    }
}

/// SmolLM2 from its GGUF with the Q4_1/Q8_0 blocks kept (int8 dot products): the first prompt
/// logits against the reference, and the greedy continuation with the cache equal to the
/// reference's ids.
#[test]
fn smollm2_quantized_logits_and_greedy_continuation() {
    let common::Smollm2 { weights, fe, prompt, expected, reference } = common::smollm2();

    let graph = optimize::optimize(&fe.graph).unwrap().0;
    let (params, blocks) = kiln_runtime::load_params_with_blocks(&fe.spec, &graph, &weights).unwrap();
    let formats = blocks.iter().map(|(n, q)| (n.clone(), q.format)).collect();
    let plan = lower_with(&graph, Options { formats, ..Options::default() });
    assert!(plan.values.iter().any(|v| v.format.quantized()), "no quantized weight in the plan");
    let n = 4;
    let io = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, n], prompt[..n].to_vec()))]);
    let expected_first = &reference["first_logits"];
    let scale = expected_first.as_f32().unwrap().iter().fold(0f32, |m, x| m.max(x.abs()));
    for int8 in [false, true] {
        let model = CpuModel::new(plan.clone(), &params, &blocks, 2, &()).unwrap().with_int8_activations(int8);
        let logits = model.run(&io).unwrap().into_iter().find(|(n, _)| n == "logits").unwrap().1;
        let first = Tensor::f32(vec![49152], logits.as_f32().unwrap()[..49152].to_vec());
        let abs = first.max_abs_diff(expected_first);
        println!("smollm2 on cpu (int8 activations: {int8}): first logits vs the reference: max abs {abs:e}");
        // f32 activations: the reference's products on the dequantized weights (as on wgpu). Int8
        // activations (llama.cpp's scheme) move the logits by about 1% of their scale.
        let tolerance = if int8 { 2.5e-2 * scale } else { 1e-3 };
        assert!(abs <= tolerance, "smollm2 on cpu (int8 activations: {int8}): first logits differ by {abs}");
    }

    let cached = optimize::optimize(&build_cached(&fe.spec).unwrap()).unwrap().0;
    let (params, blocks) = kiln_runtime::load_params_with_blocks(&fe.spec, &cached, &weights).unwrap();
    let formats = blocks.iter().map(|(n, q)| (n.clone(), q.format)).collect();
    let plan = lower_with(&cached, Options { formats, ..Options::default() });
    let outputs: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    // Only what the CPU reads in f32 is given (as `kiln generate` loads it): no quantized weight,
    // not even the embedding table, which gathers read from its Q8_0 blocks.
    let quantized: std::collections::HashSet<String> = blocks.keys().cloned().collect();
    let wanted = CpuModel::f32_params(&plan, &quantized);
    assert!(!wanted.iter().any(|n| quantized.contains(n)), "{wanted:?}");
    let params: HashMap<String, Tensor> = params.into_iter().filter(|(n, _)| wanted.contains(n)).collect();
    let block_bytes: u64 = blocks.values().map(kiln_runtime::QuantWeight::bytes).sum();
    let model = CpuModel::from_owned(plan, params, blocks, 2, &()).unwrap();
    let held: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
    println!("smollm2 on cpu: {held} weight bytes held, {block_bytes} in blocks");
    assert!(held <= block_bytes + block_bytes / 50, "{held} bytes held for {block_bytes} bytes of blocks");
    let engine = Box::new(CpuEngine::new(model));
    let mut session = Session::new(engine, &outputs, 8192).unwrap();
    let stop = [*expected.last().unwrap()];
    let (ids, stats) =
        generate(&mut session, &prompt, expected.len() + 4, &mut Sampler::greedy(), &stop, |_| true).unwrap();
    println!("smollm2 on cpu: prefill {:.1} tok/s, decode {:.1} tok/s", stats.prefill_tok_s(), stats.decode_tok_s());
    assert_eq!(ids, expected, "smollm2-135m on cpu: greedy continuation");
}

/// Gemma 3 270M from its Q4_K_M GGUF on the CPU backend, computing from the blocks as `kiln
/// generate` loads them: the prompt's last logits against transformers', and the greedy
/// continuation with the cache (its sliding layers bounded by the window) equal to the reference
/// (with f32 activations, the default; llama.cpp's int8 activations are checked on the logits).
#[test]
fn gemma3_270m_quantized_logits_and_greedy_continuation() {
    let weights = common::fetched("gemma3", "gemma3-270m", "gemma-3-270m-q4_k_m.gguf");
    let fe = spec("gemma3-270m");
    let reference =
        kiln_runtime::read_tensors(&root().join("tests/fixtures/gemma3-270m/reference.safetensors")).unwrap();
    let prompt = reference["prompt_ids"].as_i64().unwrap().to_vec();
    let expected = reference["greedy_ids"].as_i64().unwrap().to_vec();
    let vocab = fe.spec.spec.model.vocab as usize;
    let expected_last = Tensor::f32(vec![vocab], reference["last_logits"].as_f32().unwrap().to_vec());
    let scale = expected_last.as_f32().unwrap().iter().fold(0f32, |m, x| m.max(x.abs()));

    let cached = optimize::optimize(&build_cached(&fe.spec).unwrap()).unwrap().0;
    let (params, blocks) = kiln_runtime::load_params_with_blocks(&fe.spec, &cached, &weights).unwrap();
    let formats = blocks.iter().map(|(n, q)| (n.clone(), q.format)).collect();
    let plan = lower_with(&cached, Options { formats, ..Options::default() });
    assert!(plan.values.iter().any(|v| v.format.quantized()), "no quantized weight in the plan");
    let outputs: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    for int8 in [false, true] {
        let model = CpuModel::new(plan.clone(), &params, &blocks, 2, &()).unwrap().with_int8_activations(int8);
        let mut session = Session::new(Box::new(CpuEngine::new(model)), &outputs, 32768).unwrap();
        let last = Tensor::f32(vec![vocab], session.forward(&prompt).unwrap());
        let abs = last.max_abs_diff(&expected_last);
        println!("gemma3-270m on cpu (int8 activations: {int8}): last prompt logits vs the reference: max abs {abs:e}");
        // f32 activations: the reference's products on the dequantized weights. Int8 activations
        // (llama.cpp's scheme) move the logits by a few percent of their scale.
        let tolerance = if int8 { 5e-2 * scale } else { 1e-3 };
        assert!(abs <= tolerance, "gemma3-270m on cpu (int8 activations: {int8}): last logits differ by {abs}");
        if int8 {
            // Int8 activations change the 12th token (a near tie): the reference is f32's.
            continue;
        }
        session.reset();
        let (ids, stats) =
            generate(&mut session, &prompt, expected.len(), &mut Sampler::greedy(), &[], |_| true).unwrap();
        println!(
            "gemma3-270m on cpu: prefill {:.1} tok/s, decode {:.1} tok/s",
            stats.prefill_tok_s(),
            stats.decode_tok_s()
        );
        assert_eq!(ids, expected, "gemma3-270m on cpu: greedy continuation");
    }
}

/// Cached decoding on the CPU backend equals recomputation on the interpreter and reproduces the
/// fixtures' greedy ids, for every decoder fixture, unoptimized and optimized.
#[test]
fn cached_decoding_equals_recomputation() {
    for name in ["gpt2", "llama", "bloom", "mixtral", "gemma3"] {
        let fe = spec(name);
        let dir = root().join("tests/fixtures").join(name);
        let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
        let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
        let prompt = io["prompt_ids"].as_i64().unwrap().to_vec();
        let expected = io["greedy_ids"].as_i64().unwrap().to_vec();
        let cached = build_cached(&fe.spec).unwrap();
        let optimized = optimize::optimize(&cached).unwrap().0;
        let max = fe.spec.spec.model.max_positions as usize;
        for (label, graph) in [("unoptimized", &cached), ("optimized", &optimized)] {
            let names: Vec<String> = graph.outputs.iter().map(|(n, _)| n.clone()).collect();
            let session = || {
                let engine = Box::new(CpuEngine::new(cpu(lower(graph), &params, 2)));
                Session::new(engine, &names, max).unwrap()
            };
            let (ids, _) =
                generate(&mut session(), &prompt, expected.len(), &mut Sampler::greedy(), &[], |_| true).unwrap();
            assert_eq!(ids, expected, "{name} ({label}): greedy continuation on cpu");
            common::check_cached_steps(
                &format!("{name} ({label})"),
                &mut session(),
                &fe.graph,
                &params,
                &prompt,
                &expected,
            );
        }
    }
}

/// The cache is appended in place: the optimized cached step of a decoder appends every key and
/// value with a `heads` step, so each is a buffer that grows by doubling, not a tensor copied per
/// token; between growths a step writes into the same memory. A failed step leaves the cache as
/// it was, and decoding goes on equal to a session that never failed.
#[test]
fn the_cache_is_appended_in_place() {
    use kiln_runtime::Engine;
    use kiln_runtime::cpu::cache::append_sites;
    for name in ["llama", "gpt2"] {
        let fe = spec(name);
        let params = interp::random_params(&fe.graph, 7).unwrap();
        let cached = build_cached(&fe.spec).unwrap();
        let optimized = optimize::optimize(&cached).unwrap().0;
        let outputs: Vec<String> = optimized.outputs.iter().map(|(o, _)| o.clone()).collect();
        let links = kiln_runtime::generate::links(&outputs);
        let plan = lower(&optimized);
        assert_eq!(append_sites(&plan).len(), links.len(), "{name}: every cached tensor appended in place");
        assert!(append_sites(&lower(&cached)).is_empty(), "{name}: the unoptimized step concatenates");
        let ids = |v: &[i64]| HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, v.len()], v.to_vec()))]);
        let logits = |out: HashMap<String, Tensor>| out["logits"].as_f32().unwrap().to_vec();
        let mut memory = kiln_runtime::Memory::default();
        let mut engine = CpuEngine::new(cpu(plan.clone(), &params, 2));
        let mut other = CpuEngine::new(cpu(plan, &params, 2));
        engine.step(Request { inputs: ids(&[1, 2, 3, 4, 5]), memory: &mut memory, links: &links }).unwrap();
        other.step(Request { inputs: ids(&[1, 2, 3, 4, 5]), memory: &mut memory, links: &links }).unwrap();
        let first = &links[0].1;
        let mut moved = 0;
        for step in 0..20i64 {
            let b = &engine.buffers()[first];
            let (len, cap, at) = (b.len(), b.capacity(), b.data().as_ptr());
            let got = logits(
                engine.step(Request { inputs: ids(&[step % 7 + 1]), memory: &mut memory, links: &links }).unwrap(),
            );
            let want = logits(
                other.step(Request { inputs: ids(&[step % 7 + 1]), memory: &mut memory, links: &links }).unwrap(),
            );
            assert_eq!(got, want, "{name}: the engines agree at step {step}");
            let after = &engine.buffers()[first];
            assert_eq!(after.len(), len + 1);
            if after.capacity() == cap {
                assert_eq!(after.data().as_ptr(), at, "{name}: step {step} reallocated");
            } else {
                moved += 1;
                assert!(after.capacity() >= 2 * cap, "{name}: the capacity doubles");
            }
            // A failing step (an id outside the vocabulary) changes nothing.
            if step == 10 {
                let held: Vec<(usize, usize)> = engine.buffers().values().map(|b| (b.len(), b.capacity())).collect();
                assert!(
                    engine.step(Request { inputs: ids(&[1_000_000]), memory: &mut memory, links: &links }).is_err()
                );
                let now: Vec<(usize, usize)> = engine.buffers().values().map(|b| (b.len(), b.capacity())).collect();
                assert_eq!(held, now, "{name}: a failed step left the cache as it was");
            }
        }
        assert!((1..=2).contains(&moved), "{name}: {moved} growths over 20 steps");
        // The cache read back equals the tensors the interpreter's step would have returned.
        let host = engine.cache().unwrap();
        assert_eq!(host[first].shape[2], 25);
    }
}

/// An artifact's plan (compiled once, for any backend) runs on the CPU as it runs on wgpu.
#[test]
fn an_artifact_plan_runs_on_the_cpu() {
    let fe = spec("llama");
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    let mut optimized = fe.clone();
    optimized.graph = optimize::optimize(&fe.graph).unwrap().0;
    let art = kiln_compiler::artifact::compile("models/llama.toml", &source, &optimized).unwrap();
    let bytes = art.to_bytes();
    let read = kiln_compiler::artifact::Artifact::from_bytes(std::path::Path::new("llama.kiln"), &bytes).unwrap();
    let dir = root().join("tests/fixtures/llama");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let got = cpu(read.plan, &params, 2).run(&io).unwrap();
    let err = got[0].1.max_abs_diff(&io["logits"]);
    assert!(err <= TOLERANCE, "llama artifact on cpu: {err}");
}

/// Bad inputs are refused by name, as on the other engines: an id outside the vocabulary, a
/// missing input, a sequence longer than the positions.
#[test]
fn bad_inputs_are_errors() {
    let fe = spec("gpt2");
    let params = interp::random_params(&fe.graph, 3).unwrap();
    let model = cpu(lower(&optimize::optimize(&fe.graph).unwrap().0), &params, 2);
    let ids = |v: Vec<i64>| HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, v.len()], v))]);
    let e = model.run(&ids(vec![1, 2, 100_000])).unwrap_err().to_string();
    assert!(e.contains("100000"), "{e}");
    let e = model.run(&HashMap::new()).unwrap_err().to_string();
    assert!(e.contains("input_ids"), "{e}");
    let e = model.run(&ids((0..10_000).map(|i| i % 7).collect())).unwrap_err().to_string();
    assert!(e.contains("position"), "{e}");
    // A good run after the failures still agrees with the interpreter.
    let good = ids(vec![1, 2, 3]);
    let expected = interp::run(&fe.graph, &params, &good).unwrap();
    assert!(model.run(&good).unwrap()[0].1.max_abs_diff(&expected[0].1) <= 1e-4);
}

/// Issue 32: a tied head is held once. The embedding table a gather reads and the output
/// projection reads too is kept in one layout (not also transposed for the GEMM), so the weight
/// bytes a tied spec reports are one f32 copy of its parameters: `kiln new decoder`'s 38.5M
/// parameters (a 32000 x 512 table) held as 147.0 MiB, where the table's transposed copy made
/// them 209.5 MiB. The logits still agree with the interpreter.
#[test]
fn tied_weights_are_held_once() {
    let source = std::fs::read_to_string(root().join("src/templates/decoder.toml")).unwrap();
    for (name, fe) in [
        ("gpt2", spec("gpt2")),
        (
            "kiln new decoder",
            kiln_compiler::front_end("decoder.toml", &source).unwrap_or_else(|e| panic!("{}", e.render())),
        ),
    ] {
        assert!(fe.spec.spec.head.tied, "{name} is no longer tied");
        let parameters = kiln_compiler::graph::print::summary(&fe.graph, 1).parameters;
        let params = interp::random_params(&fe.graph, 5).unwrap();
        let graph = optimize::optimize(&fe.graph).unwrap().0;
        let model = cpu(lower(&graph), &params, 2);
        let held: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
        println!("{name}: {parameters} parameters, {held} weight bytes held");
        assert_eq!(held, 4 * parameters, "{name}: a tied spec's f32 weights are held as one copy");
        if name == "gpt2" {
            let ids = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, 3], vec![1, 2, 3]))]);
            let want: HashMap<String, Tensor> = interp::run(&fe.graph, &params, &ids).unwrap().into_iter().collect();
            for (out, got) in model.run(&ids).unwrap() {
                let err = got.max_abs_diff(&want[&out]);
                assert!(err <= TOLERANCE, "{name}: `{out}` differs by {err} with the table held once");
            }
        }
    }
}

/// `CpuModel::profile` times every step once (debug aid for the per-op figures in BENCHMARKS.md).
#[test]
fn profile_times_every_step() {
    let fe = spec("gpt2");
    let params = interp::random_params(&fe.graph, 3).unwrap();
    let model = cpu(lower(&optimize::optimize(&fe.graph).unwrap().0), &params, 2);
    let ids = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, 3], vec![1, 2, 3]))]);
    let times = model.profile(&ids).unwrap();
    assert_eq!(times.len(), model.plan().steps.len());
    assert!(times.iter().all(|t| t.is_finite() && *t >= 0.0));
    if std::env::var_os("KILN_PROFILE_PRINT").is_some() {
        for (step, t) in model.plan().steps.iter().zip(&times) {
            println!("{:>10.3} ms  {} {}", t * 1e3, step.op.name(), step.scope);
        }
    }
}

/// Issue 28: a BigBird block pattern at sequences its block size does not divide (the last block
/// is shorter: README, `attention.block_sparse`), with more random blocks than are left to draw
/// (a query block then attends all of them), padded, agrees on every engine: the interpreter, the
/// CPU back end at 1 and 3 threads and wgpu, unoptimized and optimized, at 1 to 13 tokens.
#[test]
fn block_pattern_edges_agree_on_every_engine() {
    let source = r#"
[model]
kind = "encoder"
vocab = 64
d_model = 32
layers = 2
max_positions = 16

[attention]
heads = 2
padding_mask = true

[attention.block_sparse]
block = 4
global = 1
window = 0
random = 8
seed = 3

[outputs]
hidden_states = true
"#;
    let fe = kiln_compiler::front_end("block-edges.toml", source).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = interp::random_params(&fe.graph, 5).unwrap();
    let optimized = optimize::optimize(&fe.graph).unwrap().0;
    for seq in [1, 3, 5, 10, 13] {
        let mut inputs = interp::sample_inputs(&fe.graph, 64, 2, seq).unwrap();
        // The second sequence's last two positions are padding.
        let mask: Vec<f32> =
            (0..2 * seq).map(|i| if i >= seq && i + 2 >= 2 * seq && seq > 2 { 0.0 } else { 1.0 }).collect();
        inputs.insert("attention_mask".into(), Tensor::f32(vec![2, seq], mask));
        let expected = interp::run(&fe.graph, &params, &inputs).unwrap();
        for (label, graph) in [("unoptimized", &fe.graph), ("optimized", &optimized)] {
            let mut runs: Vec<(String, Vec<(String, Tensor)>)> = Vec::new();
            for threads in [1, 3] {
                let got = cpu(lower(graph), &params, threads).run(&inputs).unwrap_or_else(|e| panic!("{e}"));
                runs.push((format!("cpu, {threads} threads"), got));
            }
            if let Some(gpu) = common::gpu() {
                let model = kiln_runtime::GpuModel::new(gpu, lower(graph), &params).unwrap();
                runs.push(("wgpu".into(), model.run(&inputs).unwrap_or_else(|e| panic!("{e}"))));
            }
            for (engine, got) in runs {
                for ((n, a), (m, b)) in expected.iter().zip(&got) {
                    assert_eq!(n, m);
                    let err = a.max_abs_diff(b);
                    assert!(err <= 1e-4, "{engine}, {label}, {seq} tokens: `{n}` differs by {err}");
                }
            }
        }
    }
}

/// `attention.layer_types` on the CPU backend: Gemma 3's pattern spelled as a list (three
/// sliding-window layers, then a global one) is `global_every = 4`, on the golden fixture's
/// weights, exactly; a pattern no period gives decodes with its cache (each sliding layer's
/// bounded by the window) as the interpreter recomputes it.
#[test]
fn layer_types_on_cpu() {
    let source = std::fs::read_to_string(root().join("models/gemma3.toml")).unwrap();
    let listed = |kinds: &str| {
        let text = source.replace("global_every = 4", &format!("layer_types = {kinds}"));
        assert_ne!(text, source);
        kiln_compiler::front_end("gemma3-listed.toml", &text).unwrap_or_else(|e| panic!("{}", e.render()))
    };
    let periodic = spec("gemma3");
    let same = listed(r#"["sliding-window", "sliding-window", "sliding-window", "global"]"#);
    let dir = root().join("tests/fixtures/gemma3");
    let params = kiln_runtime::load_params(&periodic.spec, &periodic.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let a = cpu(lower(&periodic.graph), &params, 2).run(&io).unwrap();
    let b = cpu(lower(&same.graph), &params, 2).run(&io).unwrap();
    assert_eq!(a, b);
    let (_, logits) = b.iter().find(|(n, _)| n == "logits").unwrap();
    let err = logits.max_abs_diff(&io["logits"]);
    assert!(err <= TOLERANCE, "listed gemma3: logits differ by {err}");

    let other = listed(r#"["global", "sliding-window", "global", "sliding-window"]"#);
    let cached = build_cached(&other.spec).unwrap();
    let names: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let max = other.spec.spec.model.max_positions as usize;
    let engine = Box::new(CpuEngine::new(cpu(lower(&cached), &params, 2)));
    let mut session = Session::new(engine, &names, max).unwrap();
    let mut seq: Vec<i64> = vec![3, 17, 9, 40, 2, 77];
    let mut logits = session.forward(&seq).unwrap();
    for step in 0..6 {
        let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, seq.len()], seq.clone()))]);
        let full = interp::run(&other.graph, &params, &inputs).unwrap();
        let all = &full.iter().find(|(n, _)| n == "logits").unwrap().1;
        let vocab = *all.shape.last().unwrap();
        let last = &all.as_f32().unwrap()[(seq.len() - 1) * vocab..];
        let err = last.iter().zip(&logits).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-4, "cached logits at {} differ by {err}", seq.len() - 1);
        let next = (step * 13 + 5) % vocab as i64;
        seq.push(next);
        logits = session.forward(&[next]).unwrap();
    }
}
