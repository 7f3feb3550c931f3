//! The training differential target: a spec drawn as the differential target draws one (see
//! [`crate::differential`]), its training step — loss, backward, every tensor's gradient — built
//! as `kiln train` builds it, and every engine held to the reference interpreter on one drawn
//! batch: the CPU back end at 1 and 3 threads, its step optimized for short and for long
//! sequences (the e-graph picks other backward forms at each) and not optimized, the step
//! recomputing every block's activations, and wgpu one case in eight. One case in three then
//! trains three steps of a drawn recipe (AdamW or SGD, clipping, decay, warm-up) with the
//! interpreter and with the CPU back end, whose step is one plan updating the tensors in place.
//!
//! A spec the front end accepts and whose model has logits must also be trainable: a refusal to
//! build its training graph, or an engine refusing a step the interpreter runs, is a finding.

use super::differential::{
    REFERENCE_SLACK, SplitMix, TOLERANCE, WGPU_DRIFT, against_exact, begin, distance, nudges, run_exact,
};
use arbitrary::Unstructured;
use kiln_compiler::autodiff::{blocks, gradients_recomputing};
use kiln_compiler::graph::Graph;
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::{LOSS, Objective, loss_graph, on_tensors, training_graph};
use kiln_runtime::Device;
use kiln_runtime::train::init;
use kiln_runtime::train::run::{StepOutput, StepRunner};
use std::collections::HashMap;

/// How a training case went, for a campaign's counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainTally {
    /// The spec drawn.
    pub spec: String,
    /// Whether the front end accepted it and its model has logits (a step to train).
    pub trainable: bool,
    /// Whether the interpreter ran the step (it refuses some drawn batches: every label
    /// ignored).
    pub ran: bool,
    /// The engines' steps compared with the interpreter's.
    pub compared: usize,
}

/// The step of one engine, or why it refused.
type Outcome = Result<StepOutput, String>;

/// The training target's body: panics on a finding (an engine's loss or gradient off the
/// interpreter's, a refusal the interpreter does not make, a trainable spec refused).
pub fn run(data: &[u8]) -> TrainTally {
    let mut u = Unstructured::new(data);
    let (mut d, spec) = begin(&mut u);
    let mut tally = TrainTally { spec: spec.clone(), ..TrainTally::default() };
    let Ok(fe) = kiln_compiler::front_end("train.toml", &spec) else { return tally };
    if !fe.spec.logits {
        return tally;
    }
    tally.trainable = true;
    let fail = |what: String| -> ! { panic!("training differential: {what}\n--- spec ---\n{spec}") };
    let objective = Objective { label_smoothing: if d.chance(1, 2) { 0.0 } else { 0.1 } };
    let dims = PackDims::of(&fe.spec);
    let graph = match training_graph(&fe.graph, objective, &fe.spec.weights, &dims, |_| true) {
        Ok((graph, _)) => graph,
        Err(e) => fail(format!("the training graph of an accepted spec was refused: {e}")),
    };
    let mut rng = SplitMix(d.tame(0, u64::MAX));
    let params: HashMap<String, Tensor> = match init::initialize(&fe.spec, &fe.graph) {
        Ok(p) => p.into_iter().collect(),
        Err(e) => fail(format!("the declared initialization failed: {e}")),
    };
    // Declared initializations are small; a drawn scale makes the activations larger (sharper
    // attention, saturated activations) one case in three.
    let scale = if d.chance(1, 3) { 1.0 + 7.0 * (rng.next_u64() % 1000) as f32 / 1000.0 } else { 1.0 };
    let params: HashMap<String, Tensor> = params
        .into_iter()
        .map(|(n, t)| {
            let v: Vec<f32> = t.to_f32_vec().iter().map(|x| x * scale).collect();
            (n, Tensor::f32(t.shape.clone(), v))
        })
        .collect();
    let vocab = fe.spec.spec.model.vocab as usize;
    let positions = fe.spec.spec.model.max_positions.max(1) as usize;
    let batch_size = d.tame(1, 3) as usize;
    let seq = d.tame(2, positions.clamp(2, 24) as u64) as usize;
    let Ok(batch) = kiln_compiler::interp::sample_inputs(&graph, vocab, batch_size, seq) else { return tally };
    if std::env::var("KILN_FUZZ_VERBOSE").is_ok_and(|v| v == "1") {
        eprintln!("batch {batch_size} x {seq}, parameters x {scale}, label smoothing {}", objective.label_smoothing);
    }
    let want = step(&Device::Interp, &graph, true, seq, &params, &batch);
    let mut runs: Vec<(String, Outcome)> = Vec::new();
    for threads in [1, 3] {
        let cpu = Device::Cpu { threads };
        runs.push((format!("cpu x{threads}"), step(&cpu, &graph, true, seq, &params, &batch)));
    }
    let cpu = Device::Cpu { threads: 2 };
    runs.push(("cpu, optimized for 512 tokens".into(), step(&cpu, &graph, true, 512, &params, &batch)));
    runs.push(("cpu, unoptimized".into(), step(&cpu, &graph, false, seq, &params, &batch)));
    if d.chance(1, 2) {
        match recomputing(&fe, objective, &dims) {
            Ok(recomputed) => {
                runs.push(("cpu, recomputing".into(), step(&cpu, &recomputed, true, seq, &params, &batch)));
            }
            Err(e) => fail(format!("the recomputing step was refused: {e}")),
        }
    }
    // Drawn whether or not there is an adapter, so a replay takes the same decisions anywhere.
    let on_gpu = d.chance(1, 8) || std::env::var("KILN_FUZZ_GPU").is_ok_and(|v| v == "always");
    if let Some(gpu) = super::differential::gpu().filter(|_| on_gpu) {
        runs.push(("wgpu".into(), step(&Device::Gpu(gpu.clone()), &graph, true, seq, &params, &batch)));
    }
    let want = match want {
        Ok(w) => w,
        Err(e) => {
            for (label, got) in &runs {
                if got.is_ok() {
                    fail(format!("{label} ran a step the interpreter refused ({e})"));
                }
            }
            return tally;
        }
    };
    tally.ran = true;
    // How far this model's step moves when every parameter moves by a few ulps (the
    // interpreter's own, on nudged parameters): what rounding in another order may move it by.
    let sensitivity: Vec<StepOutput> = nudges(&params, rng.next_u64())
        .iter()
        .filter_map(|nudged| step(&Device::Interp, &graph, true, seq, nudged, &batch).ok())
        .collect();
    // wgpu may drift further than the CPU back end, as in the differential target: up to
    // `WGPU_DRIFT` times the CPU's largest difference on each gradient.
    let mut cpu_drift: HashMap<String, f32> = HashMap::new();
    for (_, got) in runs.iter().filter(|(label, _)| label.starts_with("cpu")) {
        let Ok(got) = got else { continue };
        for (name, w) in &want.grads {
            if let Some(g) = got.grads.get(name) {
                let e = distance(&w.to_f32_vec(), &g.to_f32_vec());
                let d = cpu_drift.entry(name.clone()).or_default();
                *d = d.max(e);
            }
        }
    }
    // The step in f64, made only where an engine is off the f32 interpreter: the judge of
    // whether the engine or the reference is the one f32 rounding carried off.
    let exact = std::cell::OnceCell::new();
    let exact = || exact.get_or_init(|| exact_step(&graph, &params, &batch)).as_ref();
    for (label, got) in &runs {
        let allowed = |name: &str| match label.starts_with("wgpu") {
            true => WGPU_DRIFT * cpu_drift.get(name).copied().unwrap_or(0.0),
            false => 0.0,
        };
        match got {
            Ok(got) => {
                if let Some(why) = differs(&want, got, &sensitivity, allowed, &exact) {
                    fail(format!("{label} on batch {batch_size} x {seq}: {why}"));
                }
                tally.compared += 1;
            }
            Err(e) => fail(format!("{label} refused a step the interpreter ran: {e}")),
        }
    }
    if d.chance(1, 3) {
        let recipe = draw_recipe(&mut d, objective);
        if let Err(why) = optimizer_steps(&fe, &dims, &recipe, &params, &batch) {
            fail(format!("{why} (recipe {recipe})"));
        }
        tally.compared += 1;
    }
    tally
}

/// A recipe of three optimizer steps: AdamW (clipping, decay of matrices or of every tensor,
/// warm-up) or SGD (momentum, decay), each drawn.
fn draw_recipe(d: &mut super::differential::Draw<'_, '_>, objective: Objective) -> String {
    let mut r = format!(r#"{{"steps": 3, "label_smoothing": {}"#, objective.label_smoothing);
    if d.chance(1, 3) {
        r += r#", "optimizer": "sgd", "lr": 0.01"#;
        if d.chance(1, 2) {
            r += r#", "momentum": 0.9"#;
        }
    } else {
        r += r#", "lr": 0.001, "betas": [0.9, 0.95]"#;
        if d.chance(1, 2) {
            r += r#", "decay_1d": true"#;
        }
    }
    if d.chance(1, 2) {
        r += r#", "weight_decay": 0.1"#;
    }
    if d.chance(1, 2) {
        r += r#", "warmup_steps": 1"#;
    }
    if d.chance(1, 2) {
        r += r#", "clip": 0.05"#;
    }
    r + "}"
}

/// Three steps of `recipe` on `batch` by trainers ([`kiln_runtime::train::Trainer`]) on the
/// interpreter and on the CPU back end (whose step is one plan with the update in place): each
/// step's loss and gradient norm within [`TOLERANCE`] of the interpreter's (the norm within ten
/// times it), the optimizer's moments after within a hundredth of their scale, and the tensors
/// within the optimizer's reach of rounding: an AdamW update moves an element by about the
/// learning rate whatever its gradient's size, so one whose gradient is zero but for rounding (a
/// key projection's bias) may move either way — every element within twice the steps' learning
/// rates. Each also passes within 16 times how far the interpreter's own steps move from
/// parameters nudged by a few ulps.
fn optimizer_steps(
    fe: &kiln_compiler::FrontEnd,
    dims: &PackDims,
    recipe: &str,
    params: &HashMap<String, Tensor>,
    batch: &HashMap<String, Tensor>,
) -> Result<(), String> {
    use kiln_compiler::train::recipe::{Format, RecipeFile};
    use kiln_runtime::train::Trainer;
    const DRIFT: f64 = 16.0;
    let recipe = RecipeFile::parse(recipe, Format::Json, "recipe.json")
        .and_then(|r| r.resolve())
        .map_err(|e| format!("the recipe was refused: {e:?}"))?;
    let lr = recipe.lr;
    let trainer = |device, params: &HashMap<String, Tensor>| {
        Trainer::new(device, &fe.graph, &fe.spec.weights, dims, recipe.clone(), params.clone())
            .map_err(|e| e.to_string())
    };
    let nudged = nudges(params, 0x5eed).swap_remove(0);
    let mut want = trainer(Device::Interp, params).map_err(|e| format!("the interpreter's trainer refused: {e}"))?;
    let mut near = trainer(Device::Interp, &nudged).map_err(|e| format!("the interpreter's trainer refused: {e}"))?;
    let mut got = trainer(Device::Cpu { threads: 2 }, params).map_err(|e| format!("the CPU's trainer refused: {e}"))?;
    let batch = std::slice::from_ref(batch);
    for step in 0..3 {
        let (w, n) = match (want.step(batch), near.step(batch)) {
            (Ok(w), Ok(n)) => (w, n),
            // A step the interpreter refuses (every label ignored) the CPU must refuse too.
            (Err(e), _) | (_, Err(e)) => {
                return got
                    .step(batch)
                    .map_or(Ok(()), |_| Err(format!("the CPU ran a step the interpreter refused: {e}")));
            }
        };
        let g = got.step(batch).map_err(|e| format!("the CPU refused optimizer step {step}: {e}"))?;
        if std::env::var("KILN_FUZZ_VERBOSE").is_ok_and(|v| v == "1") {
            eprintln!(
                "optimizer step {step}: loss {} / {} / {} (nudged), gradient norm {} / {} / {}",
                g.loss, w.loss, n.loss, g.grad_norm, w.grad_norm, n.grad_norm
            );
        }
        // A model whose gradient norm moves by a thousandth on parameters nudged by a few ulps
        // (scaled parameters, norms in the hundreds or thousands) is chaotic under the updates:
        // one nudge's steps no longer bound how far rounding takes it (on two such models the
        // CPU's later norms were 1 046 and 692 where the interpreter's were 19 and 254 and the
        // nudged one's 15 and 233; on two others, whose first steps were not yet chaotic, the
        // third step's norm moved 0.4% under the nudge and the CPU's loss 1e-4 of its size where
        // the nudged one's moved 2e-6, and the second step's norms were 255 / 1 378 / 102 — the
        // same figures on the build before the products' threads changed). From the first step
        // where it shows nothing more is compared, but the first step always is.
        let chaotic = (w.grad_norm - n.grad_norm).abs() > 1e-3 * w.grad_norm.abs();
        if chaotic && step > 0 {
            return Ok(());
        }
        // Within the tolerance, or as far as the interpreter's own steps move from parameters
        // nudged by a few ulps (a sensitive model's later steps move far on rounding).
        let close = |a: f64, b: f64, moved: f64, t: f32| {
            (a - b).abs() <= (f64::from(t) * a.abs().max(1.0)).max(DRIFT * (a - moved).abs())
        };
        // The norm sums every gradient: held as they are, to ten times the loss's tolerance.
        if !close(w.loss, g.loss, n.loss, TOLERANCE) || !close(w.grad_norm, g.grad_norm, n.grad_norm, 10.0 * TOLERANCE)
        {
            return Err(format!(
                "optimizer step {step}: loss {} and gradient norm {} against {} and {} (nudged: {} and {})",
                g.loss, g.grad_norm, w.loss, w.grad_norm, n.loss, n.grad_norm
            ));
        }
        if chaotic {
            return Ok(());
        }
    }
    let state = |t: &mut Trainer| -> Result<HashMap<String, Tensor>, String> {
        Ok(t.state().map_err(|e| e.to_string())?.into_iter().collect())
    };
    let (want_state, near_state, got_state) = (state(&mut want)?, state(&mut near)?, state(&mut got)?);
    let want = want.tensors().map_err(|e| e.to_string())?.clone();
    let near = near.tensors().map_err(|e| e.to_string())?.clone();
    let got = got.tensors().map_err(|e| e.to_string())?;
    let drift = |a: Option<&Tensor>, b: &Tensor| a.map_or(0.0, |a| distance(&a.to_f32_vec(), &b.to_f32_vec()));
    let reach = 2.0 * 3.0 * lr as f32;
    for (name, w) in &want {
        let g = got.get(name).ok_or_else(|| format!("the CPU's trainer lost {name}"))?;
        let worst = distance(&w.to_f32_vec(), &g.to_f32_vec());
        if worst > reach.max(DRIFT as f32 * drift(near.get(name), w)) {
            return Err(format!("after three steps {name} is {worst:e} off the interpreter's"));
        }
    }
    // The optimizer's moments follow the gradients, not the updates' directions: each within a
    // hundredth of its largest magnitude (or of a thousandth of the largest moment's).
    let largest = |t: &Tensor| t.to_f32_vec().iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let floor = 1e-3 * want_state.values().map(largest).fold(0.0f32, f32::max);
    for (name, w) in &want_state {
        let g = got_state.get(name).ok_or_else(|| format!("the CPU's optimizer has no {name}"))?;
        let err = distance(&w.to_f32_vec(), &g.to_f32_vec());
        if err > (1e-2 * largest(w).max(floor)).max(DRIFT as f32 * drift(near_state.get(name), w)) {
            return Err(format!("after three steps the optimizer's {name} is {err:e} off the interpreter's"));
        }
    }
    Ok(())
}

/// The step recomputing every block's activations in the backward.
fn recomputing(fe: &kiln_compiler::FrontEnd, objective: Objective, dims: &PackDims) -> Result<Graph, String> {
    let eval = loss_graph(&fe.graph, objective).map_err(|e| e.to_string())?;
    let (eval, _) = on_tensors(&eval, &fe.spec.weights, dims).map_err(|e| e.to_string())?;
    gradients_recomputing(&eval, LOSS, |_| true, &blocks(&eval)).map_err(|e| e.to_string())
}

/// One step of `graph` on `device`, optimized for `seq` tokens or not.
fn step(
    device: &Device,
    graph: &Graph,
    optimize: bool,
    seq: usize,
    params: &HashMap<String, Tensor>,
    batch: &HashMap<String, Tensor>,
) -> Outcome {
    let mut runner = StepRunner::with_optimization(device, graph.clone(), optimize, seq).map_err(|e| e.to_string())?;
    runner.run(params, batch, &()).map_err(|e| e.to_string())
}

/// The training step evaluated in f64 ([`kiln_compiler::interp::run_f64`]), its loss and
/// gradients: the step's exact values to f64's rounding, where the f32 interpreter carries f32's.
struct Exact {
    loss: f64,
    grads: HashMap<String, Vec<f32>>,
}

/// [`Exact`] for `graph` at `params` on `batch`; `None` where the f64 evaluation refuses it (it
/// evaluates what the f32 one does, so only memory limits would).
fn exact_step(graph: &Graph, params: &HashMap<String, Tensor>, batch: &HashMap<String, Tensor>) -> Option<Exact> {
    let outputs = run_exact(graph, params, batch)?;
    let mut exact = Exact { loss: f64::NAN, grads: HashMap::new() };
    for (name, t) in outputs {
        if name == LOSS {
            exact.loss = t.data.first().copied().unwrap_or(f64::NAN);
        } else if let Some(tensor) = name.strip_prefix("grad.") {
            // Rounded once to f32, the nearest an f32 engine could come.
            exact.grads.insert(tensor.to_string(), t.data.iter().map(|&x| x as f32).collect());
        }
    }
    Some(exact)
}

/// Where `got` is not the interpreter's step `want`: the loss off by more than
/// [`TOLERANCE`] of its size, a gradient missing, or one off by more than `10 · TOLERANCE` of the
/// largest magnitude of that gradient (a gradient sums more products than an output) — or of a
/// thousandth of the largest of any gradient, for a gradient that is zero but for rounding (a
/// key norm's bias, which the softmax does not see); or, on a model that amplifies rounding,
/// by more than `DRIFT` times as far as the interpreter's own step moves on `nudged` parameters;
/// or by more than `allowed(gradient)`.
///
/// A loss or gradient off by more than that is then held to the step in f64 (`exact`): it is
/// not a finding where it is no further from the exact value than [`REFERENCE_SLACK`] times the
/// interpreter's own f32 step is. Where f32 cannot resolve a value (a gradient through
/// saturated softmaxes, cancelling to near zero: `fuzz/README.md`, the train target's
/// findings), the interpreter is as far from it as the engine, and the engine is not the one in
/// error; a kernel computing something else is far from both.
fn differs<'e>(
    want: &StepOutput,
    got: &StepOutput,
    nudged: &[StepOutput],
    allowed: impl Fn(&str) -> f32,
    exact: &impl Fn() -> Option<&'e Exact>,
) -> Option<String> {
    const DRIFT: f32 = 16.0;
    let loss_drift = nudged.iter().fold(0.0f64, |m, n| m.max((n.loss - want.loss).abs()));
    let loss_tolerance = (f64::from(TOLERANCE) * want.loss.abs().max(1.0)).max(f64::from(DRIFT) * loss_drift);
    let off = (want.loss - got.loss).abs();
    if off.is_nan() || off > loss_tolerance {
        let as_near = exact()
            .is_some_and(|e| (got.loss - e.loss).abs() <= f64::from(REFERENCE_SLACK) * (want.loss - e.loss).abs());
        if !as_near {
            return Some(format!("loss {} against {}", got.loss, want.loss));
        }
    }
    let largest = |t: &Tensor| t.to_f32_vec().iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let floor = 1e-3 * want.grads.values().map(largest).fold(0.0f32, f32::max);
    let mut names: Vec<&String> = want.grads.keys().collect();
    names.sort();
    for name in names {
        let w = &want.grads[name];
        let Some(g) = got.grads.get(name) else { return Some(format!("no gradient of {name}")) };
        if g.shape != w.shape {
            return Some(format!("the gradient of {name} is {:?}, not {:?}", g.shape, w.shape));
        }
        let (w, g) = (w.to_f32_vec(), g.to_f32_vec());
        let drift = (nudged.iter().filter_map(|n| n.grads.get(name)))
            .map(|n| distance(&w, &n.to_f32_vec()))
            .fold(0.0f32, f32::max);
        let scale = w.iter().fold(floor.max(1e-6), |m, x| m.max(x.abs()));
        let err = distance(&w, &g);
        // (`distance` is never NaN: a NaN against a number is infinitely far.)
        if err > (10.0 * TOLERANCE * scale).max(DRIFT * drift).max(allowed(name))
            && let Err(why) = against_exact(exact().and_then(|e| e.grads.get(name)).map(Vec::as_slice), &w, &g)
        {
            return Some(format!(
                "the gradient of {name} differs by {err:e} (its scale {scale:e}, nudged {drift:e}{why})"
            ));
        }
    }
    None
}
