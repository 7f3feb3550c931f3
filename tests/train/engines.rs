//! The training step of every model family on the CPU engine and on wgpu against the interpreter,
//! the oracle: the loss and every tensor's gradient of each `models/*.toml` with logits (the large
//! real-model specs aside), from its declared initialization, on sample inputs; and the same step
//! recomputing every block's activations in the backward.

use crate::common::root;
use kiln_compiler::autodiff::{blocks, gradients_recomputing};
use kiln_compiler::graph::Sym;
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::{LOSS, Objective, loss_graph, on_tensors, training_graph};
use kiln_runtime::Device;
use kiln_runtime::train::init;
use kiln_runtime::train::run::{StepOutput, StepRunner};
use std::collections::HashMap;

/// Specs too large for a test's training step (the real models' sizes).
const LARGE: [&str; 2] = ["gemma3-270m", "smollm2-135m"];

/// A model family's training step: its training graph, declared initialization, sample batch
/// and the interpreter's loss and gradients.
struct Case {
    name: String,
    graph: kiln_compiler::graph::Graph,
    /// The step recomputing every block.
    recomputed: kiln_compiler::graph::Graph,
    params: HashMap<String, Tensor>,
    batch: HashMap<String, Tensor>,
    want: StepOutput,
}

/// Every `models/*.toml` with logits but the [`LARGE`] ones, in name order.
fn cases() -> impl Iterator<Item = Case> {
    let mut specs: Vec<_> = std::fs::read_dir(root().join("models")).unwrap().map(|e| e.unwrap().path()).collect();
    specs.sort();
    specs.into_iter().filter_map(|path| {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if LARGE.contains(&name.as_str()) {
            return None;
        }
        let fe = kiln_compiler::front_end(&name, &std::fs::read_to_string(&path).unwrap()).unwrap();
        if !fe.graph.outputs.iter().any(|(n, _)| n == "logits") {
            return None;
        }
        let objective = Objective { label_smoothing: 0.1 };
        let (graph, _) =
            training_graph(&fe.graph, objective, &fe.spec.weights, &PackDims::of(&fe.spec), |_| true).unwrap();
        let (eval, _) =
            on_tensors(&loss_graph(&fe.graph, objective).unwrap(), &fe.spec.weights, &PackDims::of(&fe.spec)).unwrap();
        let recomputed = gradients_recomputing(&eval, LOSS, |_| true, &blocks(&eval)).unwrap();
        let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
        let vocab = fe.spec.spec.model.vocab as usize;
        let batch = kiln_compiler::interp::sample_inputs(&graph, vocab, 2, 8).unwrap();
        let want = StepRunner::new(&Device::Interp, graph.clone()).unwrap().run(&params, &batch, &()).unwrap();
        Some(Case { name, graph, recomputed, params, batch, want })
    })
}

/// `got` is the interpreter's step `want`: the loss within 1e-5, every gradient within 1e-4 of its
/// scale. Returns the largest difference relative to a gradient's scale.
fn assert_same(name: &str, want: &StepOutput, got: &StepOutput) -> f32 {
    assert!(
        (want.loss - got.loss).abs() <= 1e-5 * want.loss.abs().max(1.0),
        "{name}: loss {} vs {}",
        got.loss,
        want.loss
    );
    assert_eq!(want.grads.len(), got.grads.len(), "{name}");
    let mut worst = 0.0f32;
    for (tensor, w) in &want.grads {
        let g = &got.grads[tensor];
        let scale = w.to_f32_vec().iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let err = w.max_abs_diff(g);
        worst = worst.max(err / scale);
        assert!(err <= 1e-4 * scale, "{name}: grad.{tensor} differs by {err:e} (scale {scale:e})");
    }
    worst
}

#[test]
fn every_model_trains_on_the_cpu_as_on_the_interpreter() {
    let mut checked = Vec::new();
    for Case { name, graph, recomputed, params, batch, want } in cases() {
        let got = StepRunner::new(&Device::Cpu { threads: 2 }, graph).unwrap().run(&params, &batch, &()).unwrap();
        assert_same(&name, &want, &got);
        // Recomputing every block: the same step, on the interpreter (to the bit: the same ops
        // on the same values) and on the CPU engine.
        let interp = StepRunner::new(&Device::Interp, recomputed.clone()).unwrap().run(&params, &batch, &()).unwrap();
        assert_eq!(interp.loss, want.loss, "{name}: recomputed, on the interpreter");
        for (tensor, w) in &want.grads {
            assert!(
                w.max_abs_diff(&interp.grads[tensor]) == 0.0,
                "{name}: recomputed grad.{tensor} on the interpreter"
            );
        }
        let cpu = StepRunner::new(&Device::Cpu { threads: 2 }, recomputed).unwrap().run(&params, &batch, &()).unwrap();
        assert_same(&format!("{name}, recomputed"), &want, &cpu);
        checked.push(name);
    }
    assert!(checked.len() >= 8, "only {checked:?}");
}

/// The training step of every model family on wgpu against the interpreter, as on the CPU above.
/// Each step runs twice, first on other values of the tensors, so the second compares a model
/// whose parameters were replaced (`GpuModel::set_params`: the tensors' load-time readings —
/// transposed, cut out of a pack — evaluated again on the new values).
#[test]
fn every_model_trains_on_wgpu_as_on_the_interpreter() {
    let Some(gpu) = crate::common::gpu() else { return };
    let device = Device::Gpu(gpu);
    let mut checked = Vec::new();
    for (i, Case { name, graph, recomputed, params, batch, want }) in cases().enumerate() {
        // One family recomputing its blocks (the `after` views and the copies' kernels), to keep
        // lavapipe's compile time down.
        if i == 0 {
            let got = StepRunner::new(&device, recomputed).unwrap().run(&params, &batch, &()).unwrap();
            assert_same(&format!("{name}, recomputed"), &want, &got);
        }
        let started = std::time::Instant::now();
        let mut runner = StepRunner::new(&device, graph).unwrap();
        let other: HashMap<String, Tensor> = params
            .iter()
            .map(|(n, t)| {
                (n.clone(), Tensor::f32(t.shape.clone(), t.to_f32_vec().iter().map(|x| 0.5 * x + 0.01).collect()))
            })
            .collect();
        let first = runner.run(&other, &batch, &()).unwrap();
        let got = runner.run(&params, &batch, &()).unwrap();
        assert!((first.loss - got.loss).abs() > 0.0, "{name}: the parameters were not replaced");
        let worst = assert_same(&name, &want, &got);
        eprintln!(
            "{name}: {:.1} s, largest difference {worst:e} of a gradient's scale",
            started.elapsed().as_secs_f64()
        );
        checked.push(name);
    }
    assert!(checked.len() >= 8, "only {checked:?}");
}

/// Labels the loss cannot take — one outside the vocabulary, or every one ignored — are refused
/// on wgpu as the interpreter refuses them (a kernel cannot), before anything runs.
#[test]
fn wgpu_refuses_the_labels_the_interpreter_refuses() {
    let Some(gpu) = crate::common::gpu() else { return };
    let text = std::fs::read_to_string(root().join("models/gpt2.toml")).unwrap();
    let fe = kiln_compiler::front_end("gpt2", &text).unwrap();
    let objective = Objective { label_smoothing: 0.0 };
    let (graph, _) = training_graph(&fe.graph, objective, &fe.spec.weights, &PackDims::of(&fe.spec), |_| true).unwrap();
    let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let vocab = fe.spec.spec.model.vocab as i64;
    let batch = kiln_compiler::interp::sample_inputs(&graph, vocab as usize, 2, 8).unwrap();
    let mut gpu = StepRunner::new(&Device::Gpu(gpu), graph.clone()).unwrap();
    let mut interp = StepRunner::new(&Device::Interp, graph).unwrap();
    for labels in [|t: i64, vocab: i64| if t == 5 { vocab } else { t }, |_, _| -100] {
        let mut batch = batch.clone();
        batch.insert("labels".into(), Tensor::i64(vec![2, 8], (0..16).map(|t| labels(t, vocab)).collect()));
        let want = interp.run(&params, &batch, &()).unwrap_err().to_string();
        let got = gpu.run(&params, &batch, &()).unwrap_err().to_string();
        assert_eq!(got, want);
    }
}

/// Steps of AdamW on wgpu, where the parameters, their gradients and the moments stay on the
/// device between steps, against the same steps on the CPU, the host's AdamW: each step's loss
/// and gradient norm (clipped from the second step on), then the tensors and the optimizer's
/// state read back after the last (and once midway, as a checkpoint reads them). Twice: as a
/// recipe of one micro-batch a step runs, the whole step's graph with its optimizer
/// (`kiln_compiler::train::update`: the norms, the clipping factor and the updates on the
/// device, in place), its first step of two micro-batches through the host's optimizer; and as
/// a recipe accumulating micro-batches runs, the gradients' graph and `DeviceOptimizer` (the
/// first step's two micro-batches averaged on the device). Also on buffers of 2 048 floats,
/// where the larger tensors (the embedding's 8 192 elements, the MLP's 11 264) are split over
/// several and the update and the norm run chunk by chunk.
#[test]
fn adamw_on_the_device_trains_as_on_the_host() {
    // A clipping norm the first step's gradients pass under and the later ones exceed; decay.
    device_optimizer_trains_as_on_the_host(
        r#"{"steps": 4, "lr": 0.01, "warmup_steps": 1, "clip": 0.3, "weight_decay": 0.1, "betas": [0.9, 0.95]}"#,
    );
}

/// The same steps with SGD on the device: with momentum (its buffer started at each tensor's
/// first step, read back midway and continued from) and coupled weight decay, and plain.
#[test]
fn sgd_on_the_device_trains_as_on_the_host() {
    device_optimizer_trains_as_on_the_host(
        r#"{"steps": 4, "lr": 0.05, "warmup_steps": 1, "clip": 0.3, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.1}"#,
    );
    device_optimizer_trains_as_on_the_host(r#"{"steps": 4, "lr": 0.05, "clip": 0.3, "optimizer": "sgd"}"#);
}

/// AdamW on the device with a tensor frozen (the norms and updates over the others only),
/// vectors decaying too, and smoothed labels.
#[test]
fn adamw_on_the_device_trains_a_frozen_tensor_as_on_the_host() {
    device_optimizer_trains_as_on_the_host(
        r#"{"steps": 4, "lr": 0.01, "clip": 0.3, "weight_decay": 0.5, "decay_1d": true,
            "frozen": ["model.embed_tokens.weight"], "label_smoothing": 0.1}"#,
    );
}

/// [`adamw_on_the_device_trains_as_on_the_host`] for the recipe `recipe` (JSON).
fn device_optimizer_trains_as_on_the_host(recipe: &str) {
    use kiln_compiler::train::recipe::{Format, RecipeFile};
    use kiln_runtime::train::Trainer;
    let Some(gpu) = crate::common::gpu() else { return };
    let name = "llama";
    let path = root().join(format!("models/{name}.toml"));
    let fe = kiln_compiler::front_end(name, &std::fs::read_to_string(&path).unwrap()).unwrap();
    let parsed = RecipeFile::parse(recipe, Format::Json, "recipe.json").unwrap().resolve().unwrap();
    let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let vocab = fe.spec.spec.model.vocab as usize;
    let dims = PackDims::of(&fe.spec);
    let trainer = |device: Device, accumulate: usize| {
        let recipe = kiln_compiler::train::Recipe { accumulate, ..parsed.clone() };
        Trainer::new(device, &fe.graph, &fe.spec.weights, &dims, recipe, params.clone()).unwrap()
    };
    let batches: Vec<HashMap<String, Tensor>> = (0..4)
        .map(|i| {
            let mut b = kiln_compiler::interp::sample_inputs(&fe.graph, vocab, 2, 8 + i).unwrap();
            let ids = b["input_ids"].as_i64().unwrap().to_vec();
            b.insert("labels".into(), Tensor::i64(b["input_ids"].shape.clone(), ids.iter().rev().copied().collect()));
            b
        })
        .collect();
    // A step of two micro-batches (their gradients averaged), then each batch a step. (Last, the
    // averaged step's norm drifted 2.4e-4 from the host's after four steps at this learning rate;
    // first, it is within 1e-4 as every other.)
    let steps: Vec<&[HashMap<String, Tensor>]> =
        [&batches[1..3]].into_iter().chain(batches.iter().map(std::slice::from_ref)).collect();
    let mut host = trainer(Device::Cpu { threads: 2 }, 1);
    let logs: Vec<_> = steps.iter().map(|micro| host.step(micro).unwrap()).collect();
    assert!(logs.iter().any(|l| l.grad_norm > 0.3) && logs[0].grad_norm > 0.0, "{logs:?}");
    let want = host.tensors().unwrap().clone();
    let want_state: HashMap<String, Tensor> = host.state().unwrap().into_iter().collect();
    let chunked = crate::common::gpu_with_buffer_limit(8192);
    let runs = [("wgpu", Some(gpu)), ("wgpu, chunked", chunked)]
        .into_iter()
        .flat_map(|(what, gpu)| [((what, "one graph"), gpu.clone(), 1), ((what, "device optimizer"), gpu, 2)]);
    for (what, gpu, accumulate) in runs {
        let Some(gpu) = gpu else { continue };
        let mut device = trainer(Device::Gpu(gpu), accumulate);
        for (i, (micro, want)) in steps.iter().zip(&logs).enumerate() {
            if i == 2 {
                // Read back mid-run (a checkpoint): the steps after go on from the device's.
                assert!(device.tensors().unwrap().values().all(|t| t.to_f32_vec().iter().all(|x| x.is_finite())));
            }
            let got = device.step(micro).unwrap();
            assert_eq!(got.tokens, want.tokens, "{what:?}");
            assert!((got.loss - want.loss).abs() < 1e-4 * want.loss.abs().max(1.0), "{what:?}: {got:?} vs {want:?}");
            assert!((got.grad_norm - want.grad_norm).abs() < 1e-4 * want.grad_norm, "{what:?}: {got:?} vs {want:?}");
        }
        let state: HashMap<String, Tensor> = device.state().unwrap().into_iter().collect();
        // AdamW's step is `lr * m / (sqrt(v) + eps)`, about `lr` whatever the gradient's size,
        // so an element whose gradient is near zero can move by a good part of `lr` on a
        // difference in its last bits: on an H100 (2026-11-28) one weight of the chunked
        // graph's ended 1.2e-4 off the host's after four steps at `lr` 0.01, the losses and
        // norms within 1e-4 throughout. Each tensor is held to 1e-3 (a tenth of `lr`) at any
        // element and 1e-5 on average, which a missing decay or a wrong bias correction exceeds
        // (the moments, compared below, are what a wrong clipping factor changes).
        for (tensor, t) in device.tensors().unwrap() {
            let err = want[tensor].max_abs_diff(t);
            assert!(err < 1e-3, "{what:?}: `{tensor}` is {err:e} off the host's");
            let (a, b) = (want[tensor].to_f32_vec(), t.to_f32_vec());
            let mean = a.iter().zip(&b).map(|(x, y)| f64::from((x - y).abs())).sum::<f64>() / a.len().max(1) as f64;
            assert!(mean < 1e-5, "{what:?}: `{tensor}` is {mean:e} off the host's on average");
        }
        assert_eq!(state.len(), want_state.len(), "{what:?}");
        for (key, t) in &want_state {
            match t.as_f32() {
                Some(_) => {
                    let scale = t.to_f32_vec().iter().fold(1e-6f32, |m, x| m.max(x.abs()));
                    let err = t.max_abs_diff(&state[key]);
                    assert!(err <= 1e-3 * scale, "{what:?}: `{key}` is {err:e} off the host's (scale {scale:e})");
                }
                None => assert_eq!(t, &state[key], "{what:?}: `{key}`"),
            }
        }
    }
}

/// A step's graph ending with the optimizer's update (`kiln_compiler::train::update`) on the
/// CPU, its update written in place of the tensors it lends (`CpuModel::run_lent`), equals the
/// same graph's pure form (the update's result as outputs) and the interpreter's, for AdamW and
/// SGD with clipping (and a step it refuses, its loss not finite, leaves everything as it was);
/// and on wgpu, its plan's optimizer writing in place of the model's parameters.
#[test]
fn the_step_graph_updates_in_place_as_its_pure_form_and_the_interpreter() {
    use kiln_compiler::train::recipe::{Format, RecipeFile};
    use kiln_compiler::train::update::{self, GRAD_SUMS, STEP_CONSTANTS};
    let name = "llama";
    let path = root().join(format!("models/{name}.toml"));
    let fe = kiln_compiler::front_end(name, &std::fs::read_to_string(&path).unwrap()).unwrap();
    let objective = Objective { label_smoothing: 0.0 };
    let (graph, uses) =
        training_graph(&fe.graph, objective, &fe.spec.weights, &PackDims::of(&fe.spec), |_| true).unwrap();
    let mut trained: Vec<String> = uses.iter().map(|u| u.tensor.clone()).collect();
    trained.dedup();
    let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let vocab = fe.spec.spec.model.vocab as usize;
    let batch = kiln_compiler::interp::sample_inputs(&graph, vocab, 2, 8).unwrap();
    for recipe in [
        r#"{"steps": 2, "lr": 0.01, "clip": 0.05, "weight_decay": 0.1, "betas": [0.9, 0.95]}"#,
        r#"{"steps": 2, "lr": 0.05, "clip": 0.05, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.1}"#,
        r#"{"steps": 2, "lr": 0.05, "optimizer": "sgd"}"#,
    ] {
        let recipe = RecipeFile::parse(recipe, Format::Json, "recipe.json").unwrap().resolve().unwrap();
        let whole = update::with_update(&graph, &trained, &recipe).unwrap();
        // The updates are written in place, so the plan's memory counts none of their results:
        // the whole step needs what its gradients' graph needs, but for the norms' few floats.
        let syms = HashMap::from([(Sym::Batch, 2), (Sym::Seq, 8), (Sym::SrcSeq, 8), (Sym::Past, 0), (Sym::Ctx, 8)]);
        let (step_plan, whole_plan) = (kiln_compiler::lower::lower(&graph), kiln_compiler::lower::lower(&whole));
        let norms = 4 * (trained.len() as u64 + 1);
        assert!(whole_plan.peak_live(&syms) <= step_plan.peak_live(&syms) + norms);
        assert!(whole_plan.memory(&syms).0 <= step_plan.memory(&syms).0 + norms);
        // The tensors, a state of a later step's sizes (first moments and momentum of 1e-3,
        // second moments 1e-4 to 2e-4) and the second step's constants.
        let mut given = params.clone();
        for t in &trained {
            for (i, s) in update::state_names(&recipe, t).into_iter().enumerate() {
                let n = params[t].len();
                let v = (0..n)
                    .map(|j| (1.0 + i as f32) * 1e-4 * ((j * 7 + i) % 13) as f32 / 12.0 + i as f32 * 1e-4)
                    .collect();
                given.insert(s, Tensor::f32(params[t].shape.clone(), v));
            }
        }
        let constants = update::step_constants(&recipe, recipe.lr, 2);
        given.insert(STEP_CONSTANTS.into(), Tensor::f32(vec![constants.len()], constants));
        let want = StepRunner::new(&Device::Interp, whole.clone()).unwrap().run(&given, &batch, &()).unwrap();
        let sums = want.grad_sums.clone().unwrap();
        assert_eq!(sums.len(), trained.len());
        let norm = sums.iter().map(|&s| f64::from(s)).sum::<f64>().sqrt();
        assert!(recipe.clip.is_none() || norm > 0.05, "the clipping is exercised: norm {norm}");
        let mut cpu = StepRunner::new(&Device::Cpu { threads: 2 }, whole.clone()).unwrap();
        let pure = cpu.run(&given, &batch, &()).unwrap();
        assert!((pure.loss - want.loss).abs() < 1e-5, "{} vs {}", pure.loss, want.loss);
        let mut lent = given.clone();
        let in_place = cpu.run_lent(&mut lent, &batch, &()).unwrap();
        assert!(in_place.updates.is_empty(), "the CPU writes the update in place");
        assert!(in_place.grads.is_empty() && !in_place.loss.is_nan());
        for t in &trained {
            let mut names = vec![t.clone()];
            names.extend(update::state_names(&recipe, t));
            let (w, p) = (want.updates[t].to_f32_vec(), pure.updates[t].to_f32_vec());
            let n = w.len() / names.len();
            for (k, name) in names.iter().enumerate() {
                let scale = w[k * n..][..n].iter().fold(1e-6f32, |m, x| m.max(x.abs()));
                let (w, p, l) = (&w[k * n..][..n], &p[k * n..][..n], lent[name].to_f32_vec());
                let moved = w.iter().zip(given[name].to_f32_vec()).any(|(a, b)| a != &b);
                assert!(moved, "`{name}` was updated");
                for (what, got) in [("pure", p), ("in place", l.as_slice())] {
                    let err = w.iter().zip(got).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(err <= 1e-4 * scale, "{what}: `{name}` is {err:e} off the interpreter's (scale {scale:e})");
                }
            }
        }
        // Labels the loss cannot take (all ignored): the interpreter refuses the batch, so use a
        // non-finite loss instead — a parameter of infinities in the embedding's first row makes
        // the loss NaN: nothing is written.
        let mut broken = given.clone();
        let emb = trained.iter().find(|t| t.contains("embed")).unwrap().clone();
        let mut e = broken[&emb].to_f32_vec();
        e.iter_mut().for_each(|x| *x = f32::INFINITY);
        broken.insert(emb.clone(), Tensor::f32(broken[&emb].shape.clone(), e));
        let before = broken.clone();
        let out = cpu.run_lent(&mut broken, &batch, &()).unwrap();
        assert!(!out.loss.is_finite());
        for (name, t) in &before {
            assert_eq!(t.to_f32_vec(), broken[name].to_f32_vec(), "`{name}` was written by a refused step");
        }
        let _ = GRAD_SUMS;

        // On wgpu (and on buffers of 2 048 floats, the larger tensors split over several): the
        // plan's optimizer — the norms, the clipping factor and every update, on the device —
        // writes the tensors and their state in place of the model's parameters, as the
        // interpreter computes them; a refused step writes nothing there either.
        let gpus = [crate::common::gpu(), crate::common::gpu_with_buffer_limit(8192)];
        for (what, gpu) in ["wgpu", "wgpu, chunked"].into_iter().zip(gpus) {
            let Some(gpu) = gpu else { continue };
            let mut runner = StepRunner::new(&Device::Gpu(gpu), whole.clone()).unwrap();
            let out = runner.run_whole_on_device(&given, &batch, true, &()).unwrap();
            assert!((out.loss - want.loss).abs() < 1e-4, "{what}: {} vs {}", out.loss, want.loss);
            assert!(out.updates.is_empty(), "{what}: the update is in place");
            for (got, want) in out.grad_sums.unwrap().iter().zip(&sums) {
                assert!((got - want).abs() <= 1e-4 * want.abs().max(1e-6), "{what}: a squared norm {got} vs {want}");
            }
            let model = runner.gpu_model().unwrap();
            for t in &trained {
                let mut names = vec![t.clone()];
                names.extend(update::state_names(&recipe, t));
                let w = want.updates[t].to_f32_vec();
                let n = w.len() / names.len();
                for (k, name) in names.iter().enumerate() {
                    let w = &w[k * n..][..n];
                    let scale = w.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
                    let got = model.read_param(name).unwrap().unwrap().to_f32_vec();
                    let err = w.iter().zip(&got).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(err <= 1e-4 * scale, "{what}: `{name}` is {err:e} off the interpreter's (scale {scale:e})");
                }
            }
            let out = runner.run_whole_on_device(&before, &batch, true, &()).unwrap();
            assert!(!out.loss.is_finite(), "{what}");
            let model = runner.gpu_model().unwrap();
            for (name, t) in before.iter().filter(|(name, _)| *name != STEP_CONSTANTS) {
                let got = model.read_param(name).unwrap().unwrap();
                assert_eq!(t.to_f32_vec(), got.to_f32_vec(), "{what}: `{name}` was written by a refused step");
            }
        }
    }
}

/// The trainer's step of one micro-batch — the whole step as one graph, its update in the graph
/// — on the CPU and on the interpreter, against the optimizer on the host (what a step of two
/// micro-batches runs: their mean gradient, here of one batch twice, is that batch's bit for
/// bit): the same losses, norms, tensors and optimizer state over three steps, for AdamW and SGD
/// with clipping, decay and momentum, and plain SGD.
#[test]
fn a_step_in_one_graph_trains_as_the_host_optimizer() {
    use kiln_compiler::train::recipe::{Format, RecipeFile};
    use kiln_runtime::train::Trainer;
    let name = "gpt2";
    let path = root().join(format!("models/{name}.toml"));
    let fe = kiln_compiler::front_end(name, &std::fs::read_to_string(&path).unwrap()).unwrap();
    let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let vocab = fe.spec.spec.model.vocab as usize;
    let dims = PackDims::of(&fe.spec);
    let batches: Vec<HashMap<String, Tensor>> = (0..3)
        .map(|i| {
            let mut b = kiln_compiler::interp::sample_inputs(&fe.graph, vocab, 2, 8 + i).unwrap();
            let ids = b["input_ids"].as_i64().unwrap().to_vec();
            b.insert("labels".into(), Tensor::i64(b["input_ids"].shape.clone(), ids.iter().rev().copied().collect()));
            b
        })
        .collect();
    for recipe in [
        r#"{"steps": 3, "lr": 0.01, "warmup_steps": 1, "clip": 0.3, "weight_decay": 1.0, "betas": [0.9, 0.95]}"#,
        r#"{"steps": 3, "lr": 0.05, "clip": 0.3, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.1}"#,
        r#"{"steps": 3, "lr": 0.05, "optimizer": "sgd"}"#,
        // A tensor frozen (the norms and updates over the others), vectors decaying, smoothed labels.
        r#"{"steps": 3, "lr": 0.01, "clip": 0.3, "weight_decay": 0.5, "decay_1d": true,
            "frozen": ["transformer.wpe.weight"], "label_smoothing": 0.1}"#,
    ] {
        let recipe = RecipeFile::parse(recipe, Format::Json, "recipe.json").unwrap().resolve().unwrap();
        let trainer = |device: Device| {
            Trainer::new(device, &fe.graph, &fe.spec.weights, &dims, recipe.clone(), params.clone()).unwrap()
        };
        // Each engine against its own host path (the same engine's gradients).
        for (what, interp) in [("cpu", false), ("interpreter", true)] {
            let device = || if interp { Device::Interp } else { Device::Cpu { threads: 2 } };
            let mut host = trainer(device());
            let logs: Vec<_> = batches.iter().map(|b| host.step(&[b.clone(), b.clone()]).unwrap()).collect();
            assert!(recipe.clip.is_none() || logs.iter().any(|l| l.grad_norm > 0.3), "{logs:?}");
            let want = host.tensors().unwrap().clone();
            let want_state: HashMap<String, Tensor> = host.state().unwrap().into_iter().collect();
            let mut one = trainer(device());
            for (b, want) in batches.iter().zip(&logs) {
                let got = one.step(std::slice::from_ref(b)).unwrap();
                assert_eq!((got.step, got.tokens, got.lr), (want.step, want.tokens / 2, want.lr), "{what}");
                assert!((got.loss - want.loss).abs() < 1e-5 * want.loss.abs(), "{what}: {got:?} vs {want:?}");
                assert!((got.grad_norm - want.grad_norm).abs() < 1e-5 * want.grad_norm, "{what}: {got:?} vs {want:?}");
            }
            // The tensors within 2e-5 (each step moves an element by up to about `lr`; measured
            // 8e-6), the state within 1e-5 of its scale (measured 5e-7): the gradients are the
            // same batch's, on the CPU computed by two graphs the optimizer extracts apart (one
            // has the update in it), and clipping reads the norm from each gradient's f32 sum of
            // squares rather than one f64 sum, which AdamW amplifies where a gradient is near 0.
            let state: HashMap<String, Tensor> = one.state().unwrap().into_iter().collect();
            assert_eq!(state.len(), want_state.len(), "{what}");
            let mut worst = (0.0f32, 0.0f32);
            for (key, t) in one.tensors().unwrap().iter().chain(&state) {
                let (w, tensor) = match want.get(key) {
                    Some(w) => (w, true),
                    None => (&want_state[key], false),
                };
                match t.as_f32() {
                    Some(_) => {
                        let scale = w.to_f32_vec().iter().fold(1e-6f32, |m, x| m.max(x.abs()));
                        let err = w.max_abs_diff(t);
                        match tensor {
                            true => worst.0 = worst.0.max(err),
                            false => worst.1 = worst.1.max(err / scale),
                        }
                        let bound = if tensor { 2e-5 } else { 1e-5 * scale };
                        assert!(err <= bound, "{what}: `{key}` is {err:e} off the host's (scale {scale:e})");
                    }
                    None => assert_eq!(t, w, "{what}: `{key}`"),
                }
            }
            eprintln!("{what}: tensors within {:e}, state within {:e} of its scale", worst.0, worst.1);
        }
    }
}

/// A CPU trainer's profile times the optimizer's updates as a step runs them — in place — on
/// copies: every update step has a time, and the tensors and the optimizer's state after the
/// profile and two steps are those of two steps alone, bit for bit.
#[test]
fn profiling_a_cpu_step_times_its_updates_and_changes_nothing() {
    use kiln_compiler::train::recipe::{Format, RecipeFile};
    use kiln_runtime::train::Trainer;
    let path = root().join("models/llama.toml");
    let fe = kiln_compiler::front_end("llama", &std::fs::read_to_string(&path).unwrap()).unwrap();
    let recipe = RecipeFile::parse(r#"{"steps": 2, "lr": 0.01, "clip": 1.0}"#, Format::Json, "recipe.json")
        .unwrap()
        .resolve()
        .unwrap();
    let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let vocab = fe.spec.spec.model.vocab as usize;
    let dims = PackDims::of(&fe.spec);
    let mut batch = kiln_compiler::interp::sample_inputs(&fe.graph, vocab, 2, 8).unwrap();
    let ids = batch["input_ids"].as_i64().unwrap().to_vec();
    batch.insert("labels".into(), Tensor::i64(batch["input_ids"].shape.clone(), ids.iter().rev().copied().collect()));
    let trainer = || {
        let device = Device::Cpu { threads: 2 };
        Trainer::new(device, &fe.graph, &fe.spec.weights, &dims, recipe.clone(), params.clone()).unwrap()
    };
    let (mut plain, mut profiled) = (trainer(), trainer());
    for t in [&mut plain, &mut profiled] {
        t.step(std::slice::from_ref(&batch)).unwrap();
    }
    let times = profiled.profile(&batch).unwrap().expect("the CPU profiles its steps");
    let updates: Vec<f64> = times.iter().filter(|(op, _)| op == "adamw").map(|&(_, s)| s).collect();
    assert!(!updates.is_empty() && updates.iter().all(|&s| s > 0.0), "{times:?}");
    for t in [&mut plain, &mut profiled] {
        t.step(std::slice::from_ref(&batch)).unwrap();
    }
    let bits = |t: &Tensor| t.to_f32_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (want, got) = (plain.tensors().unwrap().clone(), profiled.tensors().unwrap().clone());
    assert_eq!(want.len(), got.len());
    for (name, t) in &want {
        assert_eq!(bits(t), bits(&got[name]), "`{name}` after a profile");
    }
    let (want, got): (HashMap<String, Tensor>, HashMap<String, Tensor>) =
        (plain.state().unwrap().into_iter().collect(), profiled.state().unwrap().into_iter().collect());
    assert_eq!(want.len(), got.len());
    for (name, t) in &want {
        assert_eq!(bits(t), bits(&got[name]), "optimizer state `{name}` after a profile");
    }
}
