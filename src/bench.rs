//! `kiln bench`: measurements, never tests. Every figure is taken side by side in one process
//! (variants interleaved run by run) and reported with the adapter it ran on; ratios between
//! variants are the numbers to quote, since absolute times on shared machines are noisy.

use crate::progress::Reporter;
use crate::storage::{Target, WeightArgs};
use anyhow::{Context, Result, bail};
use kiln_compiler::graph::build::build_cached;
use kiln_compiler::graph::{BlockPattern, Graph, InputRole, Op, Prologue, RopeCols, Scalar, ScoreMods, Sym};
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::{self, lower};
use kiln_compiler::optimize::{self, CostModel};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, interp};
use kiln_runtime::{GpuModel, QuantWeight};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// The specs `kiln bench` measures when none is named (the first by default, all three for
/// `--table`), by their paths in the repository; built into the binary so that it runs from any
/// directory.
pub const BUILT_IN: [(&str, &str); 3] = [
    ("benches/specs/gpt2-small.toml", include_str!("../benches/specs/gpt2-small.toml")),
    ("models/smollm2-135m.toml", include_str!("../models/smollm2-135m.toml")),
    ("models/minilm-l6.toml", include_str!("../models/minilm-l6.toml")),
];

/// A built-in spec's source and front end, by its name in [`BUILT_IN`].
pub fn built_in(name: &str) -> Result<(String, FrontEnd)> {
    let Some((_, source)) = BUILT_IN.iter().find(|(n, _)| *n == name) else {
        bail!("no built-in spec `{name}`");
    };
    Ok((source.to_string(), kiln_compiler::front_end(name, source)?))
}

/// No progress bars: a benchmark's output is its figures.
fn quiet() -> Reporter {
    Reporter::new(true)
}

/// Median of a few timings, in milliseconds.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_ms(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// One compiled variant of a model.
struct Variant {
    name: &'static str,
    model: kiln_runtime::Model,
    dispatches: usize,
    kernels: usize,
}

/// The parameters of `graph`: from a checkpoint (with the blocks of quantized ones, unless
/// `--dequantize`), or random (seeded) without one.
pub(crate) fn params_for(
    fe: &FrontEnd,
    graph: &Graph,
    weights: Option<&Path>,
    storage: WeightArgs,
) -> Result<kiln_runtime::weights::ParamsAndBlocks> {
    Ok(match weights {
        None => (interp::random_params(graph, 1)?, HashMap::new()),
        Some(path) => crate::storage::load(&fe.spec, graph, &kiln_runtime::Checkpoint::open(path)?, storage, &quiet())?,
    })
}

/// Forward time of a spec, unoptimized and optimized (or optimized only), at `batch` x `seq`,
/// with random weights unless `weights` are given; with sequences per second.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    fe: &FrontEnd,
    target: &Target,
    weights: Option<&Path>,
    storage: WeightArgs,
    batch: usize,
    seq: usize,
    runs: usize,
    optimized_only: bool,
    json: bool,
) -> Result<()> {
    let max = fe.spec.spec.model.max_positions;
    anyhow::ensure!(
        seq as u64 <= max,
        "--seq {seq} is more than `{}` holds (model.max_positions = {max})",
        fe.graph.name
    );
    anyhow::ensure!(seq > 0 && batch > 0, "--seq and --batch must be at least 1");
    let t = Instant::now();
    let (optimized, report) = optimize::optimize_for(&fe.graph, &target.optimizer())?;
    let optimize_ms = t.elapsed().as_secs_f64() * 1e3;
    let (params, blocks) = params_for(fe, &fe.graph, weights, storage)?;
    let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, batch, seq)?;
    let mut variants = Vec::new();
    let all = [("unoptimized", &fe.graph), ("optimized", &optimized)];
    for (name, graph) in all.into_iter().skip(usize::from(optimized_only)) {
        let model = target.model(graph, &params, &blocks, storage, &quiet())?;
        let (dispatches, kernels) = (model.plan().steps.len(), model.kernels());
        model.run(&inputs).with_context(|| format!("warm-up run of the {name} plan"))?;
        variants.push(Variant { name, model, dispatches, kernels });
    }
    // Interleave the variants so drift in the machine's speed affects both alike.
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for _ in 0..runs.max(1) {
        for (v, t) in variants.iter().zip(&mut times) {
            t.push(time_ms(|| v.model.run(&inputs).map(|_| ()).map_err(Into::into))?);
        }
    }
    let ms: Vec<f64> = times.into_iter().map(median).collect();
    let speedup = ms[0] / ms[ms.len() - 1];
    let per_s = |ms: f64| batch as f64 / (ms / 1e3);
    if json {
        let rows: Vec<serde_json::Value> = variants
            .iter()
            .zip(&ms)
            .map(|(v, &ms)| serde_json::json!({"variant": v.name, "dispatches": v.dispatches, "kernels": v.kernels, "forward_ms": ms, "sequences_per_s": per_s(ms), "weight_bytes": crate::storage::json(&v.model)}))
            .collect();
        let out = serde_json::json!({
            "model": fe.graph.name, "backend": target.backend(), "adapter": target.describe(), "batch": batch, "seq": seq, "runs": runs,
            "optimize_ms": optimize_ms, "egraph_nodes": report.egraph_nodes, "variants": rows, "speedup": speedup,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{} at batch {batch}, seq {seq} on {} (median of {runs})", fe.graph.name, target.describe());
        println!(
            "  {:<12} {:>10} {:>8} {:>12} {:>12}",
            "variant", "dispatches", "kernels", "forward ms", "sequences/s"
        );
        for (v, &ms) in variants.iter().zip(&ms) {
            println!("  {:<12} {:>10} {:>8} {:>12.2} {:>12.2}", v.name, v.dispatches, v.kernels, ms, per_s(ms));
        }
        if variants.len() > 1 {
            println!("  speedup {speedup:.2}x");
        }
        if let Some(v) = variants.last() {
            println!("  weights on the device: {}", crate::storage::describe(&v.model));
        }
        println!("  optimized in {optimize_ms:.1} ms");
    }
    Ok(())
}

/// `kiln bench --profile`: every step of each variant's plan (unoptimized and optimized, or the
/// optimized one only) timed by itself after a warm-up run, summed by op, largest first: on the
/// CPU by the host around each step, on wgpu as [`GpuModel::profile`] times each dispatch (device
/// timestamps where the adapter has them). Where the optimizer loses time, this says which ops.
#[allow(clippy::too_many_arguments)]
pub fn profile(
    fe: &FrontEnd,
    target: &Target,
    weights: Option<&Path>,
    storage: WeightArgs,
    batch: usize,
    seq: usize,
    optimized_only: bool,
) -> Result<()> {
    let optimized = optimize::optimize_for(&fe.graph, &target.optimizer())?.0;
    let (params, blocks) = params_for(fe, &fe.graph, weights, storage)?;
    let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, batch, seq)?;
    let all = [("unoptimized", &fe.graph), ("optimized", &optimized)];
    for (name, graph) in all.into_iter().skip(usize::from(optimized_only)) {
        let model = target.model(graph, &params, &blocks, storage, &quiet())?;
        model.run(&inputs).with_context(|| format!("warm-up run of the {name} plan"))?;
        let (times, clock) = step_seconds(&model, &inputs)?;
        let mut by_op: Vec<(String, f64, usize)> = Vec::new();
        for (step, t) in model.plan().steps.iter().zip(&times) {
            let name = step.op.name();
            match by_op.iter_mut().find(|(n, _, _)| *n == name) {
                Some((_, total, count)) => {
                    *total += t;
                    *count += 1;
                }
                None => by_op.push((name, *t, 1)),
            }
        }
        by_op.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = times.iter().sum();
        println!("  profile of the {name} plan (one run, {clock}, {:.2} ms in steps):", total * 1e3);
        for (name, t, count) in by_op {
            println!("    {:<32} {:>5} steps {:>10.3} ms {:>6.1}%", name, count, t * 1e3, 100.0 * t / total.max(1e-12));
        }
        let mut slowest: Vec<(usize, f64)> = times.iter().copied().enumerate().collect();
        slowest.sort_by(|a, b| b.1.total_cmp(&a.1));
        println!("    slowest steps:");
        for (i, t) in slowest.into_iter().take(5) {
            let step = &model.plan().steps[i];
            println!("      step {i:<5} {:<32} {:<24} {:>10.3} ms", step.op.name(), step.scope, t * 1e3);
        }
    }
    Ok(())
}

/// The seconds each step of `model`'s plan takes, each timed by itself (0 for a step with nothing
/// to compute), and the clock read: on wgpu [`GpuModel::profile`]'s, on the CPU the host's
/// around each step.
fn step_seconds(model: &kiln_runtime::Model, inputs: &HashMap<String, Tensor>) -> Result<(Vec<f64>, &'static str)> {
    Ok(match model {
        kiln_runtime::Model::Gpu(m) => {
            let p = m.profile(inputs)?;
            let clock = match p.clock {
                kiln_runtime::gpu::Clock::Device => "device timestamps",
                kiln_runtime::gpu::Clock::Host => "host clock per dispatch",
            };
            (p.seconds.into_iter().map(|s| s.unwrap_or(0.0)).collect(), clock)
        }
        kiln_runtime::Model::Cpu(m) => (m.profile(inputs)?, "host clock per step"),
    })
}

/// Generation with the key/value cache on the device (optimized graph, greedy): a prompt of
/// `prompt` tokens, then `steps` decode steps; prefill and decode tokens per second, medians of
/// `runs` generations.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    fe: &FrontEnd,
    target: &Target,
    weights: Option<&Path>,
    storage: WeightArgs,
    prompt: usize,
    steps: usize,
    runs: usize,
    json: bool,
) -> Result<()> {
    use kiln_runtime::Sampler;
    use kiln_runtime::generate::{Session, generate};
    let cached = optimize::optimize_for(&build_cached(&fe.spec)?, &target.optimizer())?.0;
    let (params, blocks) = params_for(fe, &cached, weights, storage)?;
    let outputs: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let model = target.model(&cached, &params, &blocks, storage, &quiet())?;
    let dispatches = model.plan().steps.len();
    let device_weights = (crate::storage::describe(&model), crate::storage::json(&model));
    let mut session = Session::new(model.into(), &outputs, usize::MAX)?;
    let vocab = fe.spec.spec.model.vocab as i64;
    let ids: Vec<i64> = (0..prompt as i64).map(|i| (i * 7919 + 13) % vocab).collect();
    if prompt + steps > fe.spec.spec.model.max_positions as usize {
        bail!("{prompt} + {steps} tokens exceed the model's {} positions", fe.spec.spec.model.max_positions);
    }
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for _ in 0..runs.max(1) {
        // A fresh cache per run; the pipelines and weights are shared.
        let (_, stats) = generate(&mut session, &ids, steps + 1, &mut Sampler::greedy(), &[], |_| true)?;
        prefill.push(stats.prefill_tok_s());
        decode.push(stats.decode_tok_s());
        session.reset();
    }
    let (prefill, decode) = (median(prefill), median(decode));
    if json {
        let out = serde_json::json!({
            "model": fe.graph.name, "backend": target.backend(), "adapter": target.describe(), "prompt_tokens": prompt, "decode_steps": steps,
            "runs": runs, "dispatches_per_step": dispatches, "prefill_tok_s": prefill, "decode_tok_s": decode,
            "weights": weights.map(|w| w.display().to_string()), "weight_bytes": device_weights.1,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{} generating on {} (median of {runs}; {dispatches} dispatches per step)",
            fe.graph.name,
            target.describe()
        );
        println!("  prefill {prompt} tokens: {prefill:.1} tok/s");
        println!("  decode {steps} steps:    {decode:.2} tok/s");
        println!("  weights on the device: {}", device_weights.0);
    }
    Ok(())
}

/// Optimize time of a spec and of copies of it `layers` deep (the rest of the spec unchanged).
pub fn optimize_time(spec_source: &str, path: &str, depths: &[u32], json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for &layers in depths {
        let mut doc: toml::Table = toml::from_str(spec_source).context("the spec is not TOML")?;
        let Some(toml::Value::Table(model)) = doc.get_mut("model") else { bail!("the spec has no [model] table") };
        model.insert("layers".into(), toml::Value::Integer(layers.into()));
        let text = toml::to_string(&doc)?;
        let fe = kiln_compiler::front_end(path, &text)?;
        let t = Instant::now();
        let (_, report) = optimize::optimize(&fe.graph)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        rows.push((layers, ms, report.egraph_nodes, report.dispatches));
    }
    if json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|(l, ms, n, d)| serde_json::json!({"layers": l, "optimize_ms": ms, "egraph_nodes": n, "dispatches": {"unoptimized": d.0, "optimized": d.1}}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("  {:>6} {:>12} {:>12} {:>22}", "layers", "optimize ms", "e-nodes", "dispatches");
        for (l, ms, n, d) in rows {
            println!("  {l:>6} {ms:>12.1} {n:>12} {:>22}", format!("{} -> {}", d.0, d.1));
        }
    }
    Ok(())
}

/// A graph `ids -> gather -> op chain -> one column`, for timing one kind of kernel: the gather
/// and the final slice are the only other dispatches.
fn chain(d: usize, ops: &[(Op, Option<Vec<usize>>)]) -> Graph {
    let mut g = Graph::new("calibrate");
    let ids = g
        .add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[])
        .expect("an input has no operands");
    let table = g.param("table", &[16, d]);
    let mut x = g.add(Op::Gather, &[table, ids]).expect("gather types");
    for (k, (op, weight)) in ops.iter().enumerate() {
        let mut operands = vec![x];
        if let Some(shape) = weight {
            operands.push(g.param(&format!("w{k}"), shape));
        }
        x = g.add(op.clone(), &operands).expect("calibration ops type");
    }
    // Read back one column only, so the copy to the host does not enter the timings.
    let y = g.add(Op::Slice { axis: 2, start: 0, len: 1 }, &[x]).expect("slice types");
    g.outputs.push(("y".into(), y));
    g
}

/// A plan loaded on `target` (weights f32, or the given blocks).
fn load(
    target: &Target,
    plan: lower::Plan,
    params: &HashMap<String, Tensor>,
    blocks: &HashMap<String, QuantWeight>,
) -> Result<kiln_runtime::Model> {
    Ok(match target {
        Target::Gpu(gpu) => {
            kiln_runtime::Model::Gpu(Box::new(GpuModel::with_blocks(gpu.clone(), plan, params, blocks)?))
        }
        Target::Cpu { threads } => {
            kiln_runtime::Model::Cpu(Box::new(kiln_runtime::CpuModel::new(plan, params, blocks, *threads, &())?))
        }
    })
}

/// Times the forward of `g` at `seq` tokens (median of `runs`), in milliseconds.
fn time_graph(target: &Target, g: &Graph, seq: usize, runs: usize) -> Result<f64> {
    let params = interp::random_params(g, 2)?;
    let ids = Tensor::i64(vec![1, seq], (0..seq as i64).map(|i| i % 16).collect());
    let inputs = HashMap::from([("input_ids".to_string(), ids)]);
    let model = load(target, lower(g), &params, &HashMap::new())?;
    model.run(&inputs)?;
    let mut t = Vec::new();
    for _ in 0..runs {
        t.push(time_ms(|| model.run(&inputs).map(|_| ()).map_err(Into::into))?);
    }
    Ok(median(t))
}

/// The time per unit of work of `g` (ms), from runs at growing sizes: `sizes[0]` is the base,
/// and the first larger size at which the extra work takes at least half of the run's time (so
/// the difference stands clear of the fixed costs and their noise) gives the time difference over
/// the work difference. A fast device needs sizes a slow one would take seconds over; the last
/// size is used if none qualifies, and a difference that is not positive there is an error, not a
/// constant.
fn slope(
    target: &Target,
    g: &Graph,
    sizes: &[usize],
    work: impl Fn(usize) -> f64,
    runs: usize,
    what: &str,
) -> Result<f64> {
    let (&base, larger) = sizes.split_first().context("no sizes")?;
    let t0 = time_graph(target, g, base, runs)?;
    let mut last = (base, t0);
    for &size in larger {
        let t = time_graph(target, g, size, runs)?;
        last = (size, t);
        if t - t0 >= 0.5 * t {
            break;
        }
    }
    let (size, t) = last;
    anyhow::ensure!(
        t > t0,
        "{what} is not measurable on {}: {t:.4} ms at size {size} vs {t0:.4} ms at {base}",
        target.describe()
    );
    Ok((t - t0) / (work(size) - work(base)))
}

/// Measures the cost model's constants on an adapter: the time of one dispatch, of one byte
/// moved by a memory-bound kernel, and of one FLOP of a projection, each as the difference
/// between runs that differ only in that quantity (grown until the difference is clear of noise:
/// see [`slope`]). Prints them in the cost model's unit (one byte moved) next to the defaults.
pub fn calibrate(target: &Target, json: bool) -> Result<()> {
    let runs = 5;
    let (t_dispatch, t_byte, t_flop) = constants(target, runs)?;
    let dispatch = t_dispatch / t_byte;
    let flop = t_flop / t_byte;
    let scalar_projection = scalar_projection(target, runs)?;
    let default = kiln_compiler::target::Target::named(target.backend()).map_or_else(CostModel::default, |t| t.cost);
    // A GPU adapter's constants are kept for the optimizer (see `costs`).
    let saved = match target {
        Target::Gpu(gpu) => Some(crate::costs::save(
            gpu.adapter_name(),
            &CostModel { dispatch, flop, scalar_projection, ..CostModel::default() },
        )?),
        Target::Cpu { .. } => None,
    };
    if json {
        let out = serde_json::json!({
            "backend": target.backend(),
            "adapter": target.describe(),
            "dispatch_us": t_dispatch * 1e3, "byte_ns": t_byte * 1e6, "gflops": 1e-6 / t_flop,
            "measured": {"dispatch": dispatch, "flop": flop, "scalar_projection": scalar_projection},
            "default": {"dispatch": default.dispatch, "flop": default.flop, "scalar_projection": default.scalar_projection},
            "saved": saved,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("cost model calibration on {} (medians of {runs})", target.describe());
        println!("  one dispatch      {:>10.1} us", t_dispatch * 1e3);
        println!("  one byte moved    {:>10.4} ns   ({:.2} GB/s)", t_byte * 1e6, 1e-6 / t_byte);
        println!("  one matmul FLOP   {:>10.4} ns   ({:.2} GFLOPS)", t_flop * 1e6, 1e-6 / t_flop);
        println!("  scalar projection {scalar_projection:>10.2} x the vec4 form's time");
        println!("  in bytes:  dispatch = {dispatch:.0}  flop = {flop:.3}  scalar projection = {scalar_projection:.2}");
        println!(
            "  defaults:  dispatch = {:.0}  flop = {:.3}  scalar projection = {:.2}",
            default.dispatch, default.flop, default.scalar_projection
        );
        if let Some(path) = saved {
            println!("  saved as this adapter's cost model: {}", path.display());
        }
    }
    Ok(())
}

/// The cost model measured on `target` (see [`calibrate`]), as the optimizer takes it.
pub fn measure(target: &Target) -> Result<CostModel> {
    let (t_dispatch, t_byte, t_flop) = constants(target, 3)?;
    let scalar_projection = scalar_projection(target, 3)?;
    Ok(CostModel { dispatch: t_dispatch / t_byte, flop: t_flop / t_byte, scalar_projection, ..CostModel::default() })
}

/// [`CostModel::scalar_projection`] on `target`: the time of a projection with a RoPE epilogue
/// in the scalar form over that in the `vec4` form (SmolLM2's packed QKV at 128 rows; the rotated
/// columns start at column 4 or 0, see [`fusion_graph`]), at least 1; 1 on the CPU, whose kernels
/// do not have the two forms.
fn scalar_projection(target: &Target, runs: usize) -> Result<f64> {
    if matches!(target, Target::Cpu { .. }) {
        return Ok(1.0);
    }
    let time = |start| {
        time_kernel(
            target,
            &fusion_graph(576, 960, true, Some(start)),
            &lower::Options::default(),
            WeightFormat::F32,
            128,
            runs,
        )
    };
    Ok((time(4)? / time(0)?.max(1e-9)).max(1.0))
}

/// The time (ms) of one dispatch, of one byte moved and of one projection FLOP on `target`,
/// medians of `runs`.
fn constants(target: &Target, runs: usize) -> Result<(f64, f64, f64)> {
    let scale = || (Op::Scale { factor: Scalar(1.0001) }, None);
    // Dispatch: 201 vs 1 scale of 64 floats.
    let small = |n: usize| chain(64, &vec![scale(); n]);
    let t_dispatch = (time_graph(target, &small(201), 1, runs)? - time_graph(target, &small(1), 1, runs)?) / 200.0;
    // Bytes: 8 scales of rows x 1024 floats (8 B moved per element), from 64 rows up.
    let wide = chain(1024, &vec![scale(); 8]);
    let t_byte =
        slope(target, &wide, &[64, 4096, 16384, 65536], |rows| 8.0 * 8.0 * 1024.0 * rows as f64, runs, "a byte moved")?;
    // FLOPs: a projection 1024 -> 1024, from 32 rows up.
    let lin = chain(1024, &[(Op::linear(None, false, false), Some(vec![1024, 1024]))]);
    let t_flop = slope(
        target,
        &lin,
        &[32, 256, 2048, 16384],
        |rows| 2.0 * 1024.0 * 1024.0 * rows as f64,
        runs,
        "a matmul FLOP",
    )?;
    Ok((t_dispatch, t_byte, t_flop))
}

/// One projection shape of `kiln bench --kernels`.
struct Projection {
    what: &'static str,
    rows: usize,
    k: usize,
    n: usize,
}

/// A graph `ids -> gather (x [1, rows, k]) -> rms_norm -> x @ w^T -> one column`, with the norm
/// in the projection's prologue when `fused`, and with a RoPE epilogue (heads of 64 from column
/// `rope`, over all but the last `n / 5` columns: the queries and keys of a packed QKV
/// projection; a column not a multiple of 8 takes the scalar form) when `rope` is given: the
/// prologue and epilogue of a decoder's attention input, for `kiln bench --kernels`.
fn fusion_graph(k: usize, n: usize, fused: bool, rope: Option<usize>) -> Graph {
    let mut g = Graph::new("fusion");
    let ids = g
        .add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[])
        .expect("an input has no operands");
    let table = g.param("table", &[16, k]);
    let x = g.add(Op::Gather, &[table, ids]).expect("gather types");
    let gain = g.param("gain", &[k]);
    let w = g.param("w0", &[n, k]);
    let eps = Scalar(1e-5);
    let rotated = n - n / 5;
    let cols = RopeCols {
        theta: Scalar(10000.0),
        rotary_dim: 64,
        style: kiln_compiler::spec::PairStyle::RotateHalf,
        head_dim: 64,
        start: rope.unwrap_or(0),
        len: rotated - rotated % 64 - 64,
    };
    let linear = |norm, rope| Op::Linear { act: None, bias: false, residual: false, norm, glu: false, rope };
    let rope = rope.map(|_| cols);
    let y = if fused {
        let prologue = Some(Prologue { rms: true, eps, bias: false });
        g.add(linear(prologue, rope), &[x, gain, w]).expect("projection types")
    } else {
        let normed = g.add(Op::RmsNorm { eps }, &[x, gain]).expect("norm types");
        g.add(linear(None, rope), &[normed, w]).expect("projection types")
    };
    let y = g.add(Op::Slice { axis: 2, start: 0, len: 1 }, &[y]).expect("slice types");
    g.outputs.push(("y".into(), y));
    g
}

/// A graph `ids -> gather (x [1, rows, k]) -> x @ w^T -> one column`, or without the projection
/// (`n = None`).
fn projection_graph(k: usize, n: Option<usize>) -> Graph {
    let projection = n.map(|n| (Op::MatMul { transpose_b: true }, Some(vec![n, k])));
    chain(k, projection.as_slice())
}

/// The time (ms, median of `runs`) of the kernels of a [`chain`] graph's measured ops alone — its
/// steps but the gather and the slice that frame them — each step timed by itself: on wgpu
/// between timestamps the device writes where it has them, else by the host around that step's
/// submission alone (see [`GpuModel::profile`]); on the CPU by the host around the step. A
/// kernel's own time, never the difference of two runs (which load can make negative).
fn time_kernel(
    target: &Target,
    g: &Graph,
    options: &lower::Options,
    format: WeightFormat,
    seq: usize,
    runs: usize,
) -> Result<f64> {
    let (model, inputs) = chain_model(target, g, options, format, seq)?;
    model.run(&inputs)?;
    let measured: Vec<usize> = (model.plan().steps.iter().enumerate())
        .filter(|(_, step)| !matches!(step.op, Op::Gather | Op::Slice { .. }))
        .map(|(i, _)| i)
        .collect();
    let mut t = Vec::new();
    for _ in 0..runs.max(1) {
        let seconds = step_seconds(&model, &inputs)?.0;
        t.push(measured.iter().map(|&i| seconds.get(i).copied().unwrap_or(0.0)).sum::<f64>() * 1e3);
    }
    Ok(median(t))
}

/// A [`chain`] graph loaded on `target` with random weights (projection weights `w*` stored in
/// `format`), and its input of `seq` ids.
fn chain_model(
    target: &Target,
    g: &Graph,
    options: &lower::Options,
    format: WeightFormat,
    seq: usize,
) -> Result<(kiln_runtime::Model, HashMap<String, Tensor>)> {
    let mut params = interp::random_params(g, 2)?;
    let mut blocks = HashMap::new();
    let mut options = options.clone();
    for (name, t) in params.iter_mut().filter(|(n, _)| n.starts_with('w')) {
        if let Some(q) = QuantWeight::quantize(format, t) {
            *t = q.dequantize();
            options.formats.insert(name.clone(), format);
            blocks.insert(name.clone(), q);
        }
    }
    let ids = Tensor::i64(vec![1, seq], (0..seq as i64).map(|i| i % 16).collect());
    let inputs = HashMap::from([("input_ids".to_string(), ids)]);
    let plan = lower::lower_with(g, options);
    let model = match target {
        Target::Gpu(gpu) => {
            let wgsl = kiln_compiler::back::wgsl::Options { f16_weights: format == WeightFormat::F16, ..gpu.options() };
            let model = GpuModel::with_progress(gpu.clone(), &plan, &wgsl, &params, &blocks, &())?;
            kiln_runtime::Model::Gpu(Box::new(model))
        }
        Target::Cpu { threads } => {
            kiln_runtime::Model::Cpu(Box::new(kiln_runtime::CpuModel::new(plan, &params, &blocks, *threads, &())?))
        }
    };
    Ok((model, inputs))
}

/// `kiln bench --kernels`: GFLOPS of the projection kernel against the reference
/// one-thread-per-output kernel (`matmul_t` over `[out, in]` weights), same shapes, same run: a
/// prefill GEMM and decode GEMVs. Each time is the projection's kernel alone (see [`time_kernel`]).
pub fn kernels(target: &Target, runs: usize, json: bool) -> Result<()> {
    let shapes = [
        Projection { what: "prefill GEMM", rows: 1024, k: 1024, n: 1024 },
        Projection { what: "prefill GEMM (gpt2 mlp)", rows: 128, k: 768, n: 3072 },
        Projection { what: "decode GEMV", rows: 1, k: 576, n: 1536 },
        Projection { what: "decode GEMV (gpt2 qkv)", rows: 1, k: 768, n: 2304 },
    ];
    let reference = lower::Options { fast_projections: false, ..lower::Options::default() };
    let fast = lower::Options::default();
    let f32 = WeightFormat::F32;
    let mut rows = Vec::new();
    for s in &shapes {
        let g = projection_graph(s.k, Some(s.n));
        let old = time_kernel(target, &g, &reference, f32, s.rows, runs)?;
        let new = time_kernel(target, &g, &fast, f32, s.rows, runs)?;
        let gflops = |ms: f64| 2.0 * (s.rows * s.k * s.n) as f64 / (ms.max(1e-6) * 1e6);
        rows.push((s, old, new, gflops(old), gflops(new)));
    }
    // The norm prologue and the RoPE epilogue at SmolLM2's packed QKV projection (576 -> 960):
    // the norm as its own kernel, then in the projection's prologue, then with the rotation too.
    let mut fusions = Vec::new();
    for m in [1, 16, 128] {
        let (k, n) = (576, 960);
        let time = |fused, rope| time_kernel(target, &fusion_graph(k, n, fused, rope), &fast, f32, m, runs);
        let scalar_rope = time(true, Some(4))?;
        fusions.push((m, k, n, time(false, None)?, time(true, None)?, time(true, Some(0))?, scalar_rope));
    }
    // Weight formats at the decode GEMV and a prefill GEMM of SmolLM2's MLP (576 -> 1536): GB/s
    // counts the weight's bytes on the device (what a GEMV is bound by).
    let mut by_format = Vec::new();
    for (what, m) in [("decode GEMV", 1), ("prefill GEMM", 128)] {
        let (k, n) = (576, 1536);
        let g = projection_graph(k, Some(n));
        for format in crate::storage::formats(target) {
            let ms = time_kernel(target, &g, &fast, format, m, runs)?;
            let bytes = format.bytes(n, k);
            let gb_s = bytes as f64 / (ms.max(1e-6) * 1e6);
            let gflops = 2.0 * (m * k * n) as f64 / (ms.max(1e-6) * 1e6);
            by_format.push((what, m, k, n, format, ms, bytes, gb_s, gflops));
        }
    }
    if json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|(s, old, new, go, gn)| {
                serde_json::json!({"shape": s.what, "m": s.rows, "k": s.k, "n": s.n,
                    "reference_ms": old, "fast_ms": new, "reference_gflops": go, "fast_gflops": gn})
            })
            .collect();
        let formats: Vec<serde_json::Value> = by_format
            .iter()
            .map(|(what, m, k, n, f, ms, bytes, gb_s, gflops)| {
                serde_json::json!({"shape": what, "m": m, "k": k, "n": n, "format": f.name(), "ms": ms,
                    "weight_bytes": bytes, "weight_gb_s": gb_s, "gflops": gflops})
            })
            .collect();
        let fusions: Vec<serde_json::Value> = fusions
            .iter()
            .map(|(m, k, n, apart, prologue, rope, scalar)| {
                serde_json::json!({"m": m, "k": k, "n": n, "norm_then_projection_ms": apart,
                    "prologue_ms": prologue, "prologue_rope_ms": rope, "prologue_rope_scalar_ms": scalar})
            })
            .collect();
        let out = serde_json::json!({"adapter": target.describe(), "runs": runs, "projections": rows,
            "weight_formats": formats, "fusions": fusions});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("projection kernels on {} (median of {runs}; GFLOPS = 2 m k n / time)", target.describe());
        println!(
            "  {:<24} {:>5} {:>5} {:>5} {:>12} {:>10} {:>12} {:>10} {:>8}",
            "shape", "m", "k", "n", "reference ms", "GFLOPS", "fast ms", "GFLOPS", "speedup"
        );
        for (s, old, new, go, gn) in &rows {
            println!(
                "  {:<24} {:>5} {:>5} {:>5} {:>12.2} {:>10.2} {:>12.2} {:>10.2} {:>7.1}x",
                s.what,
                s.rows,
                s.k,
                s.n,
                old,
                go,
                new,
                gn,
                old / new
            );
        }
        println!("norm prologue and RoPE epilogue (fast kernel; ms of every kernel between input and output)");
        println!(
            "  {:>5} {:>5} {:>5} {:>15} {:>12} {:>9} {:>16} {:>14}",
            "m", "k", "n", "norm + proj ms", "prologue ms", "+rope ms", "+rope scalar ms", "prologue gain"
        );
        for (m, k, n, apart, prologue, rope, scalar) in &fusions {
            println!(
                "  {m:>5} {k:>5} {n:>5} {apart:>15.3} {prologue:>12.3} {rope:>9.3} {scalar:>16.3} {:>13.2}x",
                apart / prologue
            );
        }
        println!("weight formats (fast kernel; GB/s = weight bytes / time)");
        println!(
            "  {:<24} {:>5} {:>5} {:>5} {:>6} {:>10} {:>12} {:>8} {:>10} {:>9}",
            "shape", "m", "k", "n", "format", "ms", "weight bytes", "GB/s", "GFLOPS", "vs f32"
        );
        for (what, m, k, n, f, ms, bytes, gb_s, gflops) in &by_format {
            let f32_ms = by_format.iter().find(|r| r.0 == *what && r.4 == WeightFormat::F32).map_or(*ms, |r| r.5);
            println!(
                "  {what:<24} {m:>5} {k:>5} {n:>5} {:>6} {ms:>10.3} {bytes:>12} {gb_s:>8.2} {gflops:>10.2} {:>8.2}x",
                f.name(),
                f32_ms / ms
            );
        }
    }
    Ok(())
}

/// The time (ms) and GFLOPS of causal packed attention at shape `s`, its kernel alone (see
/// [`time_kernel`]). GFLOPS count the `q k` and `p v` products of the attended (query, key) pairs
/// only: `4 d` per pair and head.
fn attention_time(target: &Target, s: &AttentionShape, runs: usize) -> Result<(f64, f64)> {
    let width = (s.heads + 2 * s.kv_heads) * s.head_dim;
    let attention = Op::PackedAttention {
        scale: Scalar(1.0 / (s.head_dim as f32).sqrt()),
        alibi: false,
        causal: true,
        window: None,
        mods: Default::default(),
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        q: 0,
        k: s.heads * s.head_dim,
        v: (s.heads + s.kv_heads) * s.head_dim,
        cached: false,
        appends: false,
    };
    let options = lower::Options::default();
    let ms = time_kernel(target, &chain(width, &[(attention, None)]), &options, WeightFormat::F32, s.seq, runs)?;
    let pairs = s.seq * (s.seq + 1) / 2;
    Ok((ms, 4.0 * (s.heads * s.head_dim * pairs) as f64 / (ms.max(1e-6) * 1e6)))
}

/// The BigBird pattern `kiln bench --attention` times: BigBird-base's blocks of 64 with three
/// random blocks, one global block and one neighbour on each side.
const BIGBIRD: BlockPattern = BlockPattern { block: 64, global: 1, window: 1, random: 3, seed: 7 };

/// The time (ms) of bidirectional packed attention (12 heads of 64) over `seq` tokens, block-sparse
/// with [`BIGBIRD`]'s pattern or dense, its kernel alone (see [`time_kernel`]).
fn bidirectional_attention_time(target: &Target, seq: usize, sparse: bool, runs: usize) -> Result<f64> {
    let (heads, head_dim) = (12, 64);
    let width = 3 * heads * head_dim;
    let mods = ScoreMods { sparse: sparse.then_some(BIGBIRD), ..ScoreMods::default() };
    let attention = Op::PackedAttention {
        scale: Scalar(1.0 / (head_dim as f32).sqrt()),
        alibi: false,
        causal: false,
        window: None,
        mods,
        heads,
        kv_heads: heads,
        head_dim,
        q: 0,
        k: heads * head_dim,
        v: 2 * heads * head_dim,
        cached: false,
        appends: false,
    };
    let options = lower::Options::default();
    time_kernel(target, &chain(width, &[(attention, None)]), &options, WeightFormat::F32, seq, runs)
}

/// One attention shape of `kiln bench --kernels`.
struct AttentionShape {
    what: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seq: usize,
}

/// `kiln bench --attention`: the fused causal attention kernel reading its heads from packed
/// `qkv` rows (as a prefill runs it), MHA and grouped-query, sequences 128 to 1024 (see
/// [`attention_time`]).
pub fn attention_kernels(target: &Target, runs: usize, json: bool) -> Result<()> {
    let shapes = [
        AttentionShape { what: "gpt2 (MHA)", heads: 12, kv_heads: 12, head_dim: 64, seq: 128 },
        AttentionShape { what: "gpt2 (MHA)", heads: 12, kv_heads: 12, head_dim: 64, seq: 512 },
        AttentionShape { what: "smollm2 (GQA 3:1)", heads: 9, kv_heads: 3, head_dim: 64, seq: 128 },
        AttentionShape { what: "smollm2 (GQA 3:1)", heads: 9, kv_heads: 3, head_dim: 64, seq: 512 },
        AttentionShape { what: "smollm2 (GQA 3:1)", heads: 9, kv_heads: 3, head_dim: 64, seq: 1024 },
    ];
    let mut rows = Vec::new();
    for s in &shapes {
        let (ms, gflops) = attention_time(target, s, runs)?;
        rows.push((s, ms, gflops));
    }
    // Block-sparse against dense: time per token flat against growing linearly.
    let mut sparse_rows = Vec::new();
    for seq in [256, 512, 1024, 2048, 4096] {
        let sparse = bidirectional_attention_time(target, seq, true, runs)?;
        let dense = bidirectional_attention_time(target, seq, false, runs)?;
        sparse_rows.push((seq, sparse, dense));
    }
    if json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|(s, ms, gflops)| {
                serde_json::json!({"shape": s.what, "heads": s.heads, "kv_heads": s.kv_heads,
                    "head_dim": s.head_dim, "seq": s.seq, "causal": true, "ms": ms, "gflops": gflops})
            })
            .collect();
        let sparse: Vec<serde_json::Value> = sparse_rows
            .iter()
            .map(|(seq, sparse, dense)| {
                serde_json::json!({"seq": seq, "heads": 12, "head_dim": 64, "block": BIGBIRD.block,
                    "global": BIGBIRD.global, "window": BIGBIRD.window, "random": BIGBIRD.random,
                    "sparse_ms": sparse, "dense_ms": dense,
                    "sparse_us_per_token": sparse * 1e3 / *seq as f64, "dense_us_per_token": dense * 1e3 / *seq as f64})
            })
            .collect();
        let out =
            serde_json::json!({"adapter": target.describe(), "runs": runs, "attention": rows, "block_sparse": sparse});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "causal attention kernel on {} (median of {runs}; GFLOPS = 4 d heads pairs / time)",
            target.describe()
        );
        println!("  {:<20} {:>6} {:>4} {:>4} {:>6} {:>10} {:>8}", "shape", "heads", "kv", "d", "seq", "ms", "GFLOPS");
        for (s, ms, gflops) in &rows {
            println!(
                "  {:<20} {:>6} {:>4} {:>4} {:>6} {:>10.2} {:>8.2}",
                s.what, s.heads, s.kv_heads, s.head_dim, s.seq, ms, gflops
            );
        }
        println!(
            "block-sparse (BigBird: blocks of {}, {} global, window {}, {} random) vs dense bidirectional attention, 12 heads of 64",
            BIGBIRD.block, BIGBIRD.global, BIGBIRD.window, BIGBIRD.random
        );
        println!(
            "  {:>6} {:>10} {:>10} {:>12} {:>12}",
            "seq", "sparse ms", "dense ms", "sparse µs/tok", "dense µs/tok"
        );
        for (seq, sparse, dense) in &sparse_rows {
            let per = |ms: f64| ms * 1e3 / *seq as f64;
            println!("  {seq:>6} {sparse:>10.2} {dense:>10.2} {:>12.2} {:>12.2}", per(*sparse), per(*dense));
        }
    }
    Ok(())
}

/// One model of `kiln bench --table`.
struct TableRow {
    model: String,
    seq: usize,
    forward_ms: f64,
    dispatches: usize,
    weight_bytes: u64,
    intermediate_bytes: u64,
    /// Decode tokens per second after a prompt of `seq` tokens (decoders only).
    decode_tok_s: Option<f64>,
}

/// `kiln bench --table`: one summary of kiln on an adapter. For each spec (random seeded
/// weights) and sequence length: the optimized forward time, tokens per second, dispatches,
/// device memory (weights, and intermediates as placed at that length), and for decoders the
/// decode rate with the device-resident cache; then the kernels' GFLOPS (the projection at a
/// prefill and a decode shape, causal attention). Every figure is a median of `runs`.
pub fn table(specs: &[(String, FrontEnd)], target: &Target, seqs: &[usize], runs: usize, json: bool) -> Result<()> {
    use kiln_runtime::Sampler;
    use kiln_runtime::generate::{Session, generate};
    let decode_steps = 8;
    let mut rows = Vec::new();
    for (path, fe) in specs {
        let optimized = optimize::optimize_for(&fe.graph, &target.optimizer())?.0;
        let (params, blocks) = params_for(fe, &optimized, None, WeightArgs::default())?;
        let model = target.model(&optimized, &params, &blocks, WeightArgs::default(), &quiet())?;
        let weight_bytes: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
        let plan = model.plan();
        let dispatches = plan.steps.len();
        let slots = |seq: usize| -> u64 {
            let syms = HashMap::from([(Sym::Batch, 1), (Sym::Seq, seq), (Sym::Past, 0), (Sym::SrcSeq, seq)]);
            plan.slot_sizes(&syms).iter().sum()
        };
        let intermediate: Vec<u64> = seqs.iter().map(|&s| slots(s)).collect();
        let decoder = fe.spec.spec.model.kind == kiln_compiler::spec::BlockKind::Decoder;
        let cached = if decoder {
            let g = optimize::optimize_for(&build_cached(&fe.spec)?, &target.optimizer())?.0;
            let outputs: Vec<String> = g.outputs.iter().map(|(n, _)| n.clone()).collect();
            let step = target.model(
                &g,
                &params_for(fe, &g, None, WeightArgs::default())?.0,
                &HashMap::new(),
                WeightArgs::default(),
                &quiet(),
            )?;
            Some(Session::new(step.into(), &outputs, usize::MAX)?)
        } else {
            None
        };
        let mut session = cached;
        for (&seq, &intermediate_bytes) in seqs.iter().zip(&intermediate) {
            if seq + decode_steps > fe.spec.spec.model.max_positions as usize {
                bail!("{path}: {seq} tokens exceed the model's {} positions", fe.spec.spec.model.max_positions);
            }
            let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 1, seq)?;
            model.run(&inputs).with_context(|| format!("{path}: warm-up run at {seq} tokens"))?;
            let mut t = Vec::new();
            for _ in 0..runs.max(1) {
                t.push(time_ms(|| model.run(&inputs).map(|_| ()).map_err(Into::into))?);
            }
            let decode_tok_s = match &mut session {
                Some(session) => {
                    let vocab = fe.spec.spec.model.vocab as i64;
                    let ids: Vec<i64> = (0..seq as i64).map(|i| (i * 7919 + 13) % vocab).collect();
                    let mut rates = Vec::new();
                    for _ in 0..runs.max(1) {
                        let (_, stats) =
                            generate(session, &ids, decode_steps + 1, &mut Sampler::greedy(), &[], |_| true)?;
                        rates.push(stats.decode_tok_s());
                        session.reset();
                    }
                    Some(median(rates))
                }
                None => None,
            };
            rows.push(TableRow {
                model: fe.graph.name.clone(),
                seq,
                forward_ms: median(t),
                dispatches,
                weight_bytes,
                intermediate_bytes,
                decode_tok_s,
            });
        }
    }
    // Kernels: the fast projection at a prefill and a decode shape, causal attention (GQA 3:1).
    let gqa = AttentionShape { what: "smollm2", heads: 9, kv_heads: 3, head_dim: 64, seq: 512 };
    let fast = lower::Options::default();
    let projection = |rows: usize, k: usize, n: usize| -> Result<f64> {
        let ms = time_kernel(target, &projection_graph(k, Some(n)), &fast, WeightFormat::F32, rows, runs)?;
        Ok(2.0 * (rows * k * n) as f64 / (ms.max(1e-6) * 1e6))
    };
    let (gemm, gemv) = (projection(1024, 1024, 1024)?, projection(1, 576, 1536)?);
    let attention = attention_time(target, &gqa, runs)?.1;
    let tok_s = |r: &TableRow| r.seq as f64 / (r.forward_ms / 1e3);
    if json {
        let models: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"model": r.model, "seq": r.seq, "forward_ms": r.forward_ms, "prefill_tok_s": tok_s(r),
                    "decode_tok_s": r.decode_tok_s, "dispatches": r.dispatches, "weight_bytes": r.weight_bytes,
                    "intermediate_bytes": r.intermediate_bytes})
            })
            .collect();
        let out = serde_json::json!({
            "backend": target.backend(), "adapter": target.describe(), "runs": runs, "batch": 1, "decode_steps": decode_steps, "models": models,
            "kernels_gflops": {"projection_gemm_1024": gemm, "projection_gemv_576x1536": gemv, "attention_causal_gqa_512": attention},
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("kiln on {} (optimized graphs, random weights, batch 1, median of {runs})", target.describe());
    println!(
        "  {:<7} {:<14} {:>5} {:>11} {:>10} {:>11} {:>10} {:>9} {:>13}",
        "backend", "model", "seq", "forward ms", "tok/s", "decode t/s", "dispatch", "weights", "intermediates"
    );
    for r in &rows {
        let decode = r.decode_tok_s.map_or("-".to_string(), |d| format!("{d:.2}"));
        println!(
            "  {:<7} {:<14} {:>5} {:>11.1} {:>10.1} {:>11} {:>10} {:>9} {:>13}",
            target.backend(),
            r.model,
            r.seq,
            r.forward_ms,
            tok_s(r),
            decode,
            r.dispatches,
            format!("{}B", crate::report::human(r.weight_bytes as f64)),
            format!("{}B", crate::report::human(r.intermediate_bytes as f64)),
        );
    }
    println!("  kernels: projection 1024x1024x1024 {gemm:.2} GFLOPS, decode GEMV 576x1536 {gemv:.2} GFLOPS,");
    println!("           causal attention (9 heads, 3 kv, d 64, seq 512) {attention:.2} GFLOPS");
    Ok(())
}
