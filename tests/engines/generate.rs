//! Generation with a key/value cache: prefill then one-token steps must give the logits of
//! recomputing the whole sequence, and greedy decoding must reproduce the fixtures' `greedy_ids`,
//! on the interpreter and on wgpu, unoptimized and optimized.

use crate::common;

use common::{root, spec};

use kiln_compiler::graph::build::{build_cached, build_encoder};
use kiln_compiler::lower::lower;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, interp, optimize};
use kiln_runtime::GpuModel;
use kiln_runtime::generate::{Session, generate};
use kiln_runtime::{Engine, GpuEngine, InterpEngine, Request};
use kiln_runtime::{Memory, Sampler};
use std::collections::HashMap;

/// Sessions over the cached graph of `name`: (label, session), on every engine and both graphs.
fn sessions(fe: &FrontEnd, params: &HashMap<String, Tensor>) -> Vec<(String, Session)> {
    let cached = build_cached(&fe.spec).unwrap_or_else(|e| panic!("{e}"));
    let optimized = optimize::optimize(&cached).unwrap().0;
    let max = fe.spec.spec.model.max_positions as usize;
    let mut out = Vec::new();
    for (label, graph) in [("unoptimized", &cached), ("optimized", &optimized)] {
        let names: Vec<String> = graph.outputs.iter().map(|(n, _)| n.clone()).collect();
        let engine = Box::new(InterpEngine::new(graph.clone(), params.clone()));
        out.push((format!("interp, {label}"), Session::new(engine, &names, max).unwrap()));
        if let Some(gpu) = common::gpu() {
            let model = GpuModel::new(gpu, lower(graph), params).unwrap();
            out.push((format!("wgpu, {label}"), Session::new(Box::new(GpuEngine::new(model)), &names, max).unwrap()));
        }
    }
    out
}

/// Cached decoding equals recomputation (logits at every step within 1e-4) and reproduces the
/// fixture's greedy continuation.
fn check(name: &str) {
    let fe = spec(name);
    let dir = root().join("tests/fixtures").join(name);
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let prompt = io["prompt_ids"].as_i64().unwrap().to_vec();
    let expected = io["greedy_ids"].as_i64().unwrap().to_vec();
    for (label, mut session) in sessions(&fe, &params) {
        let (ids, stats) =
            generate(&mut session, &prompt, expected.len(), &mut Sampler::greedy(), &[], |_| true).unwrap();
        assert_eq!(ids, expected, "{name} ({label}): greedy continuation with the cache");
        assert_eq!(stats.new_tokens, expected.len());
        // Step by step against a full recomputation of the sequence so far.
        let mut fresh = sessions(&fe, &params).into_iter().find(|(l, _)| *l == label).unwrap().1;
        common::check_cached_steps(&format!("{name} ({label})"), &mut fresh, &fe.graph, &params, &prompt, &expected);
    }
}

/// On wgpu the cache is appended in place too: the optimized cached step's `heads` steps write
/// only the new rows into a buffer with room for more (doubling when it runs out), which the
/// attentions read through row strides. Over up to 40 steps the device's logits and cache equal
/// the CPU engine's (which appends in place on the host), a cache's room doubles as it fills (16
/// -> 32 -> 64 rows), and a failed step leaves it as it was. Gemma 3's sliding-window layers keep
/// their latest rows in a contiguous buffer; the other layers' caches keep their room. The same
/// holds for the hardware program, whose cached attentions append to both caches themselves
/// (`fold_appends`, forced here): they then write only the new rows too; and with the
/// attentions in their workgroup form (`attention_workgroups`, forced too), which read the caches
/// in place the same way, folded or not, their keys split over workgroups every 16
/// (`attention_split_keys`, a second dispatch combining the parts) or not; and with a step's
/// dispatches split over several submissions (`submissions`).
#[test]
fn the_device_cache_is_appended_in_place() {
    let Some(gpu) = common::gpu() else { return };
    // (model, appends folded, attention in workgroups, submissions, keys split every)
    let cases = [
        ("llama", false, false, None, None),
        ("gpt2", false, false, Some(2), None),
        ("gemma3", false, false, None, None),
        ("llama", true, false, None, None),
        ("gpt2", true, false, None, None),
        ("llama", true, true, Some(3), Some(16)),
        ("gemma3", false, true, Some(8), Some(16)),
        ("gpt2", false, true, None, None),
    ];
    for (name, fold, workgroups, submissions, split) in cases {
        let fe = spec(name);
        let params = interp::random_params(&fe.graph, 7).unwrap();
        let optimized = optimize::optimize(&build_cached(&fe.spec).unwrap()).unwrap().0;
        let outputs: Vec<String> = optimized.outputs.iter().map(|(o, _)| o.clone()).collect();
        let links = kiln_runtime::generate::links(&outputs);
        let plan = lower(&optimized);
        let options = kiln_compiler::back::wgsl::Options {
            fold_appends: fold,
            attention_workgroups: workgroups,
            attention_split_keys: split,
            submissions,
            ..gpu.options()
        };
        let model = GpuModel::with_progress(gpu.clone(), &plan, &options, &params, &HashMap::new(), &()).unwrap();
        let folded = (model.plan().steps.iter())
            .filter(|s| {
                matches!(
                    s.op,
                    kiln_compiler::graph::Op::PackedAttention(kiln_compiler::graph::PackedAttention {
                        appends: true,
                        ..
                    })
                )
            })
            .count();
        assert_eq!(folded > 0, fold, "{name}: {folded} attentions appending themselves");
        let wide = model.program().kernels.iter().filter(|k| k.wgsl.contains("dim(7u) == 2u")).count();
        assert_eq!(wide > 0, workgroups, "{name}: {wide} attention kernels with the workgroup form");
        let partials = model.program().kernels.iter().filter(|k| k.partials).count();
        assert_eq!(partials > 0, split.is_some(), "{name}: {partials} attention kernels splitting keys");
        let name = &format!(
            "{name}{}{}{}, {} submissions",
            if fold { ", appends folded" } else { "" },
            if workgroups { ", attention in workgroups" } else { "" },
            if split.is_some() { ", keys split" } else { "" },
            options.submission_count(),
        );
        let mut engine = GpuEngine::new(model);
        let mut cpu =
            kiln_runtime::CpuEngine::new(kiln_runtime::CpuModel::new(plan, &params, &HashMap::new(), 2, &()).unwrap());
        let ids = |v: &[i64]| HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, v.len()], v.to_vec()))]);
        let logits = |out: HashMap<String, Tensor>| out["logits"].clone();
        let mut memory = Memory::default();
        let rooms =
            |e: &GpuEngine| -> Vec<Option<usize>> { links.iter().map(|(_, p)| e.buffers()[p].room()).collect() };
        engine.step(Request { inputs: ids(&[1, 2, 3, 4, 5]), memory: &mut memory, links: &links }).unwrap();
        cpu.step(Request { inputs: ids(&[1, 2, 3, 4, 5]), memory: &mut memory, links: &links }).unwrap();
        let steps = (fe.spec.spec.model.max_positions as i64 - 5).min(40);
        let mut growths = vec![0; links.len()];
        for step in 0..steps {
            let before = rooms(&engine);
            let got = logits(
                engine.step(Request { inputs: ids(&[step % 7 + 1]), memory: &mut memory, links: &links }).unwrap(),
            );
            let want =
                logits(cpu.step(Request { inputs: ids(&[step % 7 + 1]), memory: &mut memory, links: &links }).unwrap());
            let err = got.max_abs_diff(&want);
            assert!(err <= 1e-4, "{name}: logits at step {step} differ by {err}");
            let after = rooms(&engine);
            // Every cache appended in place (those of sliding layers are cut to their window).
            assert!(after.iter().filter(|r| r.is_some()).count() >= links.len() / 3, "{name}: {after:?}");
            for (c, (before, after)) in before.iter().zip(&after).enumerate() {
                if let (Some(b), Some(a)) = (before, after)
                    && a != b
                {
                    growths[c] += 1;
                    assert_eq!(*a, 2 * b, "{name}: the room doubles");
                }
            }
            if step == 10 {
                assert!(
                    engine.step(Request { inputs: ids(&[1_000_000]), memory: &mut memory, links: &links }).is_err()
                );
                assert_eq!(rooms(&engine), after, "{name}: a failed step left the cache as it was");
            }
        }
        // Room for 16 rows at the prompt, doubled whenever a step needs more.
        let (mut room, mut expected) = (16, 0);
        while room < 5 + steps {
            (room, expected) = (2 * room, expected + 1);
        }
        // The caches of global layers (those of sliding layers end without room, cut to their window).
        let global: Vec<usize> = (0..links.len()).filter(|&c| rooms(&engine)[c].is_some()).collect();
        assert!(!global.is_empty(), "{name}: no cache kept its room");
        for c in global {
            assert_eq!(growths[c], expected, "{name}: `{}`'s room over {} rows", links[c].1, 5 + steps);
        }
        // The caches read back (their rows only) equal the CPU's.
        let (device, host) = (engine.cache().unwrap(), cpu.cache().unwrap());
        for (_, past) in &links {
            assert_eq!(device[past].shape, host[past].shape, "{name}: `{past}`");
            assert!(device[past].max_abs_diff(&host[past]) <= 1e-4, "{name}: `{past}` differs");
        }
    }
}

#[test]
fn gpt2_cached_decoding() {
    check("gpt2");
}

#[test]
fn llama_cached_decoding() {
    check("llama");
}

#[test]
fn gemma3_cached_decoding() {
    check("gemma3");
}

#[test]
fn bloom_cached_decoding() {
    check("bloom");
}

#[test]
fn mixtral_cached_decoding() {
    check("mixtral");
}

/// An encoder-decoder (the original Transformer): the encoder runs once and its keys and values
/// are the decoder's cross-attention inputs at every step. Cached greedy decoding of a padded
/// source row gives the logits of recomputing the whole model (encoder included) on the target
/// so far, at every step, on every engine and both graphs.
#[test]
fn vaswani_cached_decoding_with_encoder_memory() {
    let fe = spec("vaswani");
    let dir = root().join("tests/fixtures/vaswani");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    // Row 1 of the fixture: 8 source tokens and 4 of padding.
    let src_len = io["src_ids"].shape[1];
    let row = |name: &str| -> Tensor {
        let all = io[name].to_f32_vec();
        let v: Vec<i64> = all[src_len..2 * src_len].iter().map(|&x| x as i64).collect();
        Tensor::i64(vec![1, src_len], v)
    };
    let source =
        HashMap::from([("src_ids".to_string(), row("src_ids")), ("src_padding".to_string(), row("src_padding"))]);
    let steps = 6;
    let start = 1i64;

    // Greedy by full recomputation: the reference.
    let mut seq = vec![start];
    let mut full_logits = Vec::new();
    for _ in 0..steps {
        let mut inputs = source.clone();
        inputs.insert("tgt_ids".into(), Tensor::i64(vec![1, seq.len()], seq.clone()));
        let out = interp::run(&fe.graph, &params, &inputs).unwrap();
        let logits = &out.iter().find(|(n, _)| n == "logits").unwrap().1;
        let vocab = *logits.shape.last().unwrap();
        let last = logits.as_f32().unwrap()[(seq.len() - 1) * vocab..].to_vec();
        seq.push(Sampler::greedy().sample(&last, &[]));
        full_logits.push(last);
    }
    let expected = seq[1..].to_vec();
    assert!(expected.iter().collect::<std::collections::HashSet<_>>().len() > 1, "a varied continuation: {expected:?}");

    let max = fe.spec.spec.model.max_positions as usize;
    let decoder = build_cached(&fe.spec).unwrap();
    let encoder = build_encoder(&fe.spec).unwrap();
    for optimized in [false, true] {
        let prepare =
            |g: &kiln_compiler::graph::Graph| if optimized { optimize::optimize(g).unwrap().0 } else { g.clone() };
        let (decoder, encoder) = (prepare(&decoder), prepare(&encoder));
        let names: Vec<String> = decoder.outputs.iter().map(|(n, _)| n.clone()).collect();
        // (label, decoder engine, encoder engine)
        type Pair = (&'static str, Box<dyn Engine>, Box<dyn Engine>);
        let mut engines: Vec<Pair> = vec![(
            "interp",
            Box::new(InterpEngine::new(decoder.clone(), params.clone())),
            Box::new(InterpEngine::new(encoder.clone(), params.clone())),
        )];
        if let Some(gpu) = common::gpu() {
            engines.push((
                "wgpu",
                Box::new(GpuEngine::new(GpuModel::new(gpu.clone(), lower(&decoder), &params).unwrap())),
                Box::new(GpuEngine::new(GpuModel::new(gpu, lower(&encoder), &params).unwrap())),
            ));
        }
        for (engine, dec, enc) in engines {
            let label = format!("{engine}, optimized {optimized}");
            let memory = Memory::encode(enc.as_ref(), &source).unwrap();
            let mut session = Session::new(dec, &names, max).unwrap().with_memory(memory);
            let (ids, _) = generate(&mut session, &[start], steps, &mut Sampler::greedy(), &[], |_| true).unwrap();
            assert_eq!(ids, expected, "vaswani ({label}): greedy continuation with the cache");
            // Logits step by step.
            let memory = Memory::encode(enc.as_ref(), &source).unwrap();
            let engine = session_engine(&decoder, &params, engine == "wgpu");
            let mut fresh = Session::new(engine, &names, max).unwrap().with_memory(memory);
            for (i, reference) in full_logits.iter().enumerate() {
                let token = if i == 0 { start } else { expected[i - 1] };
                let cached = fresh.forward(&[token]).unwrap();
                let err = reference.iter().zip(&cached).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(err <= 1e-4, "vaswani ({label}): cached logits at step {i} differ by {err}");
            }
        }
    }
}

/// T5: greedy decoding of the first source row from the decoder start id 0 with the cache (the
/// decoder's relative bias computed for the cached positions) and the encoder run once, on the
/// interpreter, the CPU backend and wgpu, reproduces the fixture's `greedy_ids`.
#[test]
fn t5_greedy_with_cache() {
    let fe = spec("t5");
    let dir = root().join("tests/fixtures/t5");
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let expected = io["greedy_ids"].as_i64().unwrap().to_vec();
    let src_len = io["src_ids"].shape[1];
    let row = |name: &str| -> Tensor {
        let v: Vec<i64> = io[name].to_f32_vec()[..src_len].iter().map(|&x| x as i64).collect();
        Tensor::i64(vec![1, src_len], v)
    };
    let source = HashMap::from([("src_ids".to_string(), row("src_ids")), ("src_mask".to_string(), row("src_mask"))]);
    let max = fe.spec.spec.model.max_positions as usize;
    let decoder = optimize::optimize(&build_cached(&fe.spec).unwrap()).unwrap().0;
    let encoder = optimize::optimize(&build_encoder(&fe.spec).unwrap()).unwrap().0;
    let names: Vec<String> = decoder.outputs.iter().map(|(n, _)| n.clone()).collect();
    let cpu = |g: &kiln_compiler::graph::Graph| {
        kiln_runtime::CpuModel::new(lower(g), &params, &HashMap::new(), 2, &()).unwrap()
    };
    type Pair = (&'static str, Box<dyn Engine>, Box<dyn Engine>);
    let mut engines: Vec<Pair> = vec![
        (
            "interp",
            Box::new(InterpEngine::new(decoder.clone(), params.clone())),
            Box::new(InterpEngine::new(encoder.clone(), params.clone())),
        ),
        (
            "cpu",
            Box::new(kiln_runtime::CpuEngine::new(cpu(&decoder))),
            Box::new(kiln_runtime::CpuEngine::new(cpu(&encoder))),
        ),
    ];
    if let Some(gpu) = common::gpu() {
        engines.push((
            "wgpu",
            Box::new(GpuEngine::new(GpuModel::new(gpu.clone(), lower(&decoder), &params).unwrap())),
            Box::new(GpuEngine::new(GpuModel::new(gpu, lower(&encoder), &params).unwrap())),
        ));
    }
    for (label, dec, enc) in engines {
        let memory = Memory::encode(enc.as_ref(), &source).unwrap();
        let mut session = Session::new(dec, &names, max).unwrap().with_memory(memory);
        let (ids, _) = generate(&mut session, &[0], expected.len(), &mut Sampler::greedy(), &[], |_| true).unwrap();
        assert_eq!(ids, expected, "t5 ({label}): greedy continuation with the cache");
    }
}

/// A decoder engine on the interpreter or on wgpu.
fn session_engine(graph: &kiln_compiler::graph::Graph, params: &HashMap<String, Tensor>, gpu: bool) -> Box<dyn Engine> {
    match common::gpu().filter(|_| gpu) {
        Some(gpu) => Box::new(GpuEngine::new(GpuModel::new(gpu, lower(graph), params).unwrap())),
        None => Box::new(InterpEngine::new(graph.clone(), params.clone())),
    }
}

#[test]
fn sampling_is_seeded_and_bounded() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let draw = |seed| {
        let mut s = Sampler::new(0.8, 10, 0.9, 1.3, seed).unwrap();
        (0..20).map(|_| s.sample(&logits, &[3, 4])).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7), "the same seed gives the same tokens");
    assert_ne!(draw(7), draw(8), "another seed gives other tokens");
    // top-k = 1 is greedy whatever the temperature.
    let mut one = Sampler::new(5.0, 1, 1.0, 1.0, 1).unwrap();
    let best = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as i64;
    assert!((0..10).all(|_| one.sample(&logits, &[]) == best));
    // Every draw is among the 10 most likely.
    let mut top: Vec<usize> = (0..logits.len()).collect();
    top.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let allowed: Vec<i64> = top[..10].iter().map(|&i| i as i64).collect();
    let mut s = Sampler::new(0.8, 10, 1.0, 1.0, 9).unwrap();
    assert!((0..50).all(|_| allowed.contains(&s.sample(&logits, &[]))));
    // The repetition penalty lowers a seen token's chance: greedy picks another.
    let mut penalised = Sampler::new(0.0, 0, 1.0, 100.0, 0).unwrap();
    assert_ne!(penalised.sample(&logits, &[best]), best);
    assert!(Sampler::new(-1.0, 0, 1.0, 1.0, 0).is_err());
    assert!(Sampler::new(1.0, 0, 0.0, 1.0, 0).is_err());
}

#[test]
fn cached_graphs_reject_what_they_cannot_do() {
    let fe = spec("bert");
    let err = build_cached(&fe.spec).unwrap_err().to_string();
    assert!(err.contains("needs a decoder"), "{err}");
}

/// SmolLM2-135M (GGUF, Q4_1): greedy decoding with the cache reproduces the reference
/// continuation, on wgpu with the optimized graph and the Q4_1/Q8_0 blocks kept on the device (the
/// path `kiln generate` takes).
#[test]
fn smollm2_greedy_with_cache() {
    let common::Smollm2 { weights, fe, prompt, expected, .. } = common::smollm2();
    let cached = optimize::optimize(&build_cached(&fe.spec).unwrap()).unwrap().0;
    let (params, blocks) = kiln_runtime::load_params_with_blocks(&fe.spec, &cached, &weights).unwrap();
    let outputs: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let engine: Box<dyn Engine> = match common::gpu() {
        Some(gpu) => {
            let formats = blocks.iter().map(|(n, q)| (n.clone(), q.format)).collect();
            let options = kiln_compiler::lower::Options { formats, ..Default::default() };
            let plan = kiln_compiler::lower::lower_with(&cached, options);
            assert!(plan.values.iter().any(|v| v.format.quantized()), "no quantized weight in the plan");
            Box::new(GpuEngine::new(GpuModel::with_blocks(gpu, plan, &params, &blocks).unwrap()))
        }
        None => Box::new(InterpEngine::new(cached.clone(), params)),
    };
    let mut session = Session::new(engine, &outputs, 8192).unwrap();
    // The reference stops at <|im_end|>, its last id.
    let stop = [*expected.last().unwrap()];
    let (ids, stats) =
        generate(&mut session, &prompt, expected.len() + 4, &mut Sampler::greedy(), &stop, |_| true).unwrap();
    println!("smollm2-135m: prefill {:.1} tok/s, decode {:.1} tok/s", stats.prefill_tok_s(), stats.decode_tok_s());
    assert_eq!(ids, expected, "smollm2-135m: greedy continuation");
    assert_eq!(stats.stop, kiln_runtime::Stop::StopId);
}

/// [`Stats::stop`](kiln_runtime::Stats::stop) says why generation stopped: the token budget, a
/// stop id, the caller, or a full context.
#[test]
fn generation_says_why_it_stopped() {
    use kiln_runtime::Stop;
    let fe = spec("llama");
    let params =
        kiln_runtime::load_params(&fe.spec, &fe.graph, &root().join("tests/fixtures/llama/model.safetensors")).unwrap();
    let cached = build_cached(&fe.spec).unwrap();
    let names: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let session =
        |max: usize| Session::new(Box::new(InterpEngine::new(cached.clone(), params.clone())), &names, max).unwrap();
    let prompt = [1, 2, 3];
    let greedy = |s: &mut Session, max_new: usize, stop: &[i64], on_token: &mut dyn FnMut(i64) -> bool| {
        generate(s, &prompt, max_new, &mut Sampler::greedy(), stop, on_token).unwrap()
    };
    let (ids, stats) = greedy(&mut session(64), 4, &[], &mut |_| true);
    assert_eq!((ids.len(), stats.stop), (4, Stop::MaxNewTokens));
    let at = ids.iter().position(|&t| t == ids[1]).unwrap();
    let (stopped, stats) = greedy(&mut session(64), 4, &[ids[1]], &mut |_| true);
    assert_eq!((&stopped[..], stats.stop), (&ids[..=at], Stop::StopId));
    let mut left = 2;
    let (stopped, stats) = greedy(&mut session(64), 4, &[], &mut |_| {
        left -= 1;
        left > 0
    });
    assert_eq!((&stopped[..], stats.stop), (&ids[..2], Stop::Caller));
    // Three prompt tokens in a context of five: room for two steps after the prefill.
    let (stopped, stats) = greedy(&mut session(5), 10, &[], &mut |_| true);
    assert_eq!((&stopped[..], stats.stop), (&ids[..3], Stop::ContextFull));
}

/// A sliding-window layer's cache holds at most `window - 1` tokens however long the context:
/// Gemma 3's spec (window 4, every fourth layer global) decoded 4x past its window on every
/// engine and both graphs, with each step's logits equal to recomputing the whole sequence, its
/// sliding caches at `min(tokens, window - 1)` rows and its global caches at every token.
#[test]
fn sliding_window_caches_stay_within_the_window() {
    use kiln_compiler::graph::InputRole;
    let fe = spec("gemma3");
    let window = fe.spec.spec.attention.window.expect("a window") as usize;
    let params = interp::random_params(&fe.graph, 11).unwrap();
    let cached = build_cached(&fe.spec).unwrap();
    let sliding: Vec<String> = cached
        .inputs()
        .into_iter()
        .filter(|(_, _, role)| matches!(role, InputRole::Cache { window: Some(_), .. }))
        .map(|(_, name, _)| name.to_string())
        .collect();
    assert_eq!(sliding.len(), 2 * 3, "three sliding layers of four, keys and values");
    let mut all = sessions(&fe, &params);
    let optimized = optimize::optimize(&cached).unwrap().0;
    let max = fe.spec.spec.model.max_positions as usize;
    for (label, graph) in [("unoptimized", &cached), ("optimized", &optimized)] {
        let names: Vec<String> = graph.outputs.iter().map(|(n, _)| n.clone()).collect();
        let model = kiln_runtime::CpuModel::new(lower(graph), &params, &HashMap::new(), 2, &()).unwrap();
        let engine = Box::new(kiln_runtime::CpuEngine::new(model));
        all.push((format!("cpu, {label}"), Session::new(engine, &names, max).unwrap()));
    }
    let tokens: Vec<i64> = (0..4 * window as i64 + 3).map(|i| (i * 37 + 5) % 128).collect();
    for (label, mut session) in all {
        // A prompt longer than the window, then one token at a time.
        let prompt = window + 2;
        let mut logits = session.forward(&tokens[..prompt]).unwrap();
        for n in prompt..=tokens.len() {
            let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, n], tokens[..n].to_vec()))]);
            let full = interp::run(&fe.graph, &params, &inputs).unwrap();
            let all = &full.iter().find(|(name, _)| name == "logits").unwrap().1;
            let vocab = *all.shape.last().unwrap();
            let last = &all.as_f32().unwrap()[(n - 1) * vocab..];
            let err = last.iter().zip(&logits).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= 1e-4, "{label}: logits after {n} tokens differ by {err}");
            for (name, t) in session.cache().unwrap() {
                let held = if sliding.contains(&name) { n.min(window - 1) } else { n };
                assert_eq!(t.shape[2], held, "{label}: `{name}` after {n} tokens");
            }
            if n < tokens.len() {
                logits = session.forward(&tokens[n..=n]).unwrap();
            }
        }
    }
}

/// A step whose every cache is a sliding window's cannot tell where positions start once the
/// caches are full: it must be given `past_len`, and a `past_len` that contradicts the caches is
/// refused by name.
#[test]
fn sliding_caches_need_the_position_once_full() {
    let source = std::fs::read_to_string(root().join("models/gemma3.toml")).unwrap();
    let source = source.replace("global_every = 4\n", "").replace("global_theta = 1000000.0\n", "");
    let fe = kiln_compiler::front_end("gemma3.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = interp::random_params(&fe.graph, 3).unwrap();
    let cached = build_cached(&fe.spec).unwrap();
    let names: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let mut session = Session::new(Box::new(InterpEngine::new(cached.clone(), params.clone())), &names, 64).unwrap();
    session.forward(&[1, 2, 3, 4, 5, 6]).unwrap();
    let cache = session.cache().unwrap();
    let ids = Tensor::i64(vec![1, 1], vec![7]);
    let mut inputs: HashMap<String, Tensor> = cache.clone();
    inputs.insert("input_ids".into(), ids.clone());
    let err = interp::run(&cached, &params, &inputs).unwrap_err().to_string();
    assert!(err.contains("past_len") && err.contains("must be given"), "{err}");
    inputs.insert(interp::PAST_LEN.into(), Tensor::i64(vec![1], vec![2]));
    let err = interp::run(&cached, &params, &inputs).unwrap_err().to_string();
    assert!(err.contains("past_len") && err.contains("hold 3 tokens"), "{err}");
    inputs.insert(interp::PAST_LEN.into(), Tensor::i64(vec![1], vec![6]));
    let stepped = interp::run(&cached, &params, &inputs).unwrap();
    let from_session = session.forward(&[7]).unwrap();
    let logits = &stepped.iter().find(|(n, _)| n == "logits").unwrap().1;
    assert_eq!(logits.as_f32().unwrap(), from_session.as_slice());
}

/// A sampled generation picks the same tokens whether the next token is picked on the device
/// (the default on wgpu: one id read back per step), on the host from the device's logits, or
/// on the CPU backend, for every seed; a step returns its logits only when asked for, equal to
/// the host-sampled step's.
#[test]
fn sampling_on_the_device_gives_the_host_tokens() {
    use kiln_runtime::{CpuEngine, CpuModel, Pick};
    let Some(gpu) = common::gpu() else { return };
    let fe = spec("llama");
    let params =
        kiln_runtime::load_params(&fe.spec, &fe.graph, &root().join("tests/fixtures/llama/model.safetensors")).unwrap();
    let cached = optimize::optimize(&build_cached(&fe.spec).unwrap()).unwrap().0;
    let names: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let max = fe.spec.spec.model.max_positions as usize;
    let gpu_engine = || GpuEngine::new(GpuModel::new(gpu.clone(), lower(&cached), &params).unwrap());
    let engines: [(&str, Box<dyn Engine>); 3] = [
        ("wgpu, device sampling", Box::new(gpu_engine())),
        ("wgpu, host sampling", Box::new(gpu_engine().sample_on_host())),
        ("cpu", Box::new(CpuEngine::new(CpuModel::new(lower(&cached), &params, &HashMap::new(), 2, &()).unwrap()))),
    ];
    let mut sessions: Vec<(&str, Session)> =
        engines.into_iter().map(|(label, e)| (label, Session::new(e, &names, max).unwrap())).collect();
    let prompt = [1, 2, 3];
    for seed in 0..4 {
        let mut runs = Vec::new();
        for (label, session) in &mut sessions {
            session.reset();
            let mut sampler = Sampler::new(0.9, 20, 0.95, 1.2, seed).unwrap();
            let (ids, _) = generate(session, &prompt, 24, &mut sampler, &[], |_| true).unwrap();
            runs.push((*label, ids));
        }
        let (_, first) = &runs[0];
        assert!(first.iter().collect::<std::collections::HashSet<_>>().len() > 4, "a varied sample: {first:?}");
        for (label, ids) in &runs[1..] {
            assert_eq!(ids, first, "seed {seed}: {label} against {}", runs[0].0);
        }
    }
    // The logits, only when asked for.
    let step = |session: &mut Session, logits: bool| {
        session.reset();
        let mut sampler = Sampler::new(0.9, 20, 0.95, 1.2, 7).unwrap();
        session.sample(&prompt, Pick { sampler: &mut sampler, seen: &prompt, logits }).unwrap()
    };
    let (device, host) = sessions.split_at_mut(1);
    assert_eq!(step(&mut device[0].1, false).logits, None);
    let (on_device, on_host) = (step(&mut device[0].1, true), step(&mut host[0].1, true));
    assert_eq!(on_device, on_host);
    assert_eq!(on_device.logits.map(|l| l.len()), Some(fe.spec.spec.model.vocab as usize));
}

/// Found by the differential fuzzer (issue 28): a decoder with a bidirectional mask was cached as
/// if causal, and its cached steps differed from recomputation (an earlier position attends to
/// later tokens, so it changes as tokens are added). Generation refuses it, saying why; the
/// forward pass still runs it.
#[test]
fn cached_decoder_with_bidirectional_mask_is_refused() {
    let source = "[model]\nkind = \"decoder\"\nvocab = 8\nd_model = 8\nlayers = 2\nmax_positions = 8\n\n\
                  [attention]\nheads = 1\nmask = \"bidirectional\"\n";
    let fe =
        kiln_compiler::front_end("bidirectional-decoder.toml", source).unwrap_or_else(|e| panic!("{}", e.render()));
    let err = build_cached(&fe.spec).expect_err("a bidirectional decoder has no cached form");
    assert!(err.to_string().contains("needs a causal or sliding-window mask"), "{err}");
    let params = interp::random_params(&fe.graph, 1).unwrap();
    let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, 3], vec![1, 2, 3]))]);
    assert!(interp::run(&fe.graph, &params, &inputs).is_ok());
}

/// Continuous batching's step (`Session::forward_batch` on the CPU engine): sequences at
/// different positions, decoded together, get the logits each gets decoded alone (within 1e-4 of
/// their scale) and the same greedy tokens, while sequences leave and join between steps. On
/// every fixture decoder (learned positions, RoPE with grouped heads, sliding-window layers past
/// their window beside global ones, ALiBi, experts), its plan unoptimized and optimized, and on
/// the reference form that runs every op through the interpreter (whose caches are concatenated,
/// not appended in place). A batched step that fails (one sequence's token outside the
/// vocabulary) leaves every sequence as it was: the steps after it still agree.
#[test]
fn sequences_decoded_together_equal_each_decoded_alone() {
    use kiln_runtime::{CpuEngine, CpuModel};
    for name in ["gpt2", "llama", "gemma3", "bloom", "mixtral"] {
        let fe = spec(name);
        let params = fixture_params(&fe, name);
        let cached = build_cached(&fe.spec).unwrap();
        let optimized = optimize::optimize(&cached).unwrap().0;
        let mut forms = vec![("unoptimized", lower(&cached), false), ("optimized", lower(&optimized), false)];
        if name == "gpt2" {
            forms.push(("reference", lower(&cached), true));
        }
        for (label, plan, reference) in forms {
            let engine = || -> Box<dyn Engine> {
                Box::new(CpuEngine::new(match reference {
                    true => CpuModel::reference(plan.clone(), params.clone(), &()).unwrap(),
                    false => CpuModel::new(plan.clone(), &params, &HashMap::new(), 2, &()).unwrap(),
                }))
            };
            decode_together_and_alone(&format!("{name} ({label})"), &fe, &plan, engine);
        }
    }
}

/// [`sequences_decoded_together_equal_each_decoded_alone`] on wgpu: the batched step's
/// projections run once over the batch on the device, each sequence's attention and appends over
/// its own cache on the device (appended in place, grown as it fills), each row's part of the
/// batch's values bound in place and, again, copied. On the fixtures whose
/// positions are learned (gpt2) and rotated (llama, with grouped heads), and with sliding-window
/// layers (gemma3); each plan optimized for the WGSL target, and llama's also unoptimized.
#[test]
fn sequences_decoded_together_on_wgpu_equal_each_decoded_alone() {
    use kiln_compiler::target::Target;
    let Some(gpu) = common::gpu() else { return };
    for name in ["gpt2", "llama", "gemma3"] {
        let fe = spec(name);
        let params = fixture_params(&fe, name);
        let cached = build_cached(&fe.spec).unwrap();
        let optimized = optimize::optimize_for(&cached, &Target::wgpu()).unwrap().0;
        let mut forms = vec![("optimized", lower(&optimized))];
        if name == "llama" {
            forms.push(("unoptimized", lower(&cached)));
        }
        for (label, plan) in forms {
            // Each row's part of the batch's values bound in place (where aligned, as here), and
            // copied in and out of the row's own buffers (as where a part is not aligned).
            for copies in [false, true] {
                let engine = || -> Box<dyn Engine> {
                    let model = GpuModel::new(gpu.clone(), plan.clone(), &params).unwrap();
                    model.copy_batched_rows(copies).unwrap();
                    Box::new(GpuEngine::new(model))
                };
                let what = format!("{name} (wgpu, {label}, rows {})", if copies { "copied" } else { "in place" });
                decode_together_and_alone(&what, &fe, &plan, engine);
            }
        }
    }
}

/// A fixture's parameters.
fn fixture_params(fe: &FrontEnd, name: &str) -> HashMap<String, Tensor> {
    let dir = root().join("tests/fixtures").join(name);
    kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap()
}

/// Sequences decoded together through one session of `engine` against each decoded alone
/// through another (see [`sequences_decoded_together_equal_each_decoded_alone`]).
fn decode_together_and_alone(
    what: &str,
    fe: &FrontEnd,
    plan: &kiln_compiler::lower::Plan,
    engine: impl Fn() -> Box<dyn Engine>,
) {
    use kiln_runtime::generate::ParkedSequence;
    let argmax = |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as i64;
    let vocab = fe.spec.spec.model.vocab as i64;
    let max = fe.spec.spec.model.max_positions as usize;
    let names: Vec<String> = plan.outputs.iter().map(|(n, _)| n.clone()).collect();
    let mut together = Session::new(engine(), &names, max).unwrap();
    let mut alone = Session::new(engine(), &names, max).unwrap();
    // A sequence in both sessions: parked in each, with its next token.
    struct Seq {
        together: ParkedSequence,
        alone: ParkedSequence,
        next: i64,
    }
    let start = |prompt: Vec<i64>, together: &mut Session, alone: &mut Session| {
        let logits = together.forward(&prompt).unwrap();
        let reference = alone.forward(&prompt).unwrap();
        assert_eq!(logits, reference, "{what}: the same prefill");
        Seq { together: together.park(), alone: alone.park(), next: argmax(&logits) }
    };
    let prompt = |len: usize, seed: i64| (0..len as i64).map(|t| (t * 7 + seed * 13 + 1) % vocab).collect();
    let mut seqs: Vec<Seq> =
        [(1, 1), (6, 2), (3, 3), (9, 4)].map(|(len, seed)| start(prompt(len, seed), &mut together, &mut alone)).into();
    for step in 0..8 {
        if step == 3 {
            // One leaves, one joins.
            seqs.remove(1);
            seqs.push(start(prompt(5, 5), &mut together, &mut alone));
        }
        if step == 5 {
            let mut batch: Vec<(&mut ParkedSequence, i64)> = seqs
                .iter_mut()
                .enumerate()
                .map(|(i, s)| (&mut s.together, if i == 1 { vocab } else { s.next }))
                .collect();
            assert!(together.forward_batch(&mut batch).is_err(), "{what}: a token outside the vocabulary");
        }
        let positions: Vec<usize> = seqs.iter().map(|s| s.together.position()).collect();
        let mut batch: Vec<(&mut ParkedSequence, i64)> = seqs.iter_mut().map(|s| (&mut s.together, s.next)).collect();
        let rows = together.forward_batch(&mut batch).unwrap().unwrap_or_else(|| panic!("{what}: not batched"));
        assert_eq!(rows.len(), seqs.len());
        for (i, (seq, logits)) in seqs.iter_mut().zip(rows).enumerate() {
            let empty = alone.park();
            alone.resume(std::mem::replace(&mut seq.alone, empty)).unwrap();
            let reference = alone.forward(&[seq.next]).unwrap();
            seq.alone = alone.park();
            let scale = reference.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let err = logits.iter().zip(&reference).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 1e-4 * scale,
                "{what}: sequence {i} at position {} differs by {err} at step {step}",
                positions[i]
            );
            assert_eq!(seq.together.position(), positions[i] + 1);
            seq.next = argmax(&logits);
            assert_eq!(seq.next, argmax(&reference), "{what}: greedy token of sequence {i} at step {step}");
        }
    }
}
