//! `kiln bench forward` and `kiln bench profile`: the forward time of a spec unoptimized and
//! optimized, side by side (variants interleaved run by run), and where each plan spends it.

use super::{DeviceArgs, SpecArgs, Spread, at_least_one, bench_target, weight_bytes, weight_bytes_json};
use crate::exec::{WeightArgs, params_for};
use crate::progress::Reporter;
use anyhow::{Context, Result};
use kiln_compiler::{FrontEnd, interp, optimize};
use kiln_runtime::measure::{step_seconds, time_ms};
use kiln_runtime::{Device, Weights};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `kiln bench forward` and `kiln bench profile`.
#[derive(clap::Args)]
pub struct ForwardArgs {
    #[command(flatten)]
    spec: SpecArgs,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed runs per variant (the median is reported, with the fastest and slowest).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Time the optimized graph only (no unoptimized run beside it).
    #[arg(long)]
    optimized_only: bool,
    /// Real weights (safetensors or GGUF) instead of random ones.
    #[arg(long)]
    weights: Option<PathBuf>,
    #[command(flatten)]
    storage: WeightArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

impl ForwardArgs {
    /// The spec file, if one is named.
    pub fn spec(&self) -> Option<&std::path::Path> {
        self.spec.path()
    }
}

/// Runs `kiln bench forward`, and with `profile`, `kiln bench profile` (the forward's figures,
/// then each plan's profile).
pub fn run(args: ForwardArgs, profile_too: bool, reporter: &Reporter) -> Result<()> {
    at_least_one(&[("--runs", args.runs), ("--seq", args.seq), ("--batch", args.batch)])?;
    let device = args.device.open(reporter, args.json)?;
    let (_, fe) = args.spec.read()?;
    forward(&fe, &device, &args)?;
    if profile_too {
        profile(&fe, &device, &args)?;
    }
    Ok(())
}

/// One compiled variant of a model.
struct Variant {
    name: &'static str,
    model: kiln_runtime::Model,
    dispatches: usize,
    kernels: usize,
}

/// Forward time of a spec, unoptimized and optimized (or optimized only), at `batch` x `seq`,
/// with random weights unless `weights` are given; with sequences per second.
fn forward(fe: &FrontEnd, device: &Device, args: &ForwardArgs) -> Result<()> {
    let ForwardArgs { batch, seq, runs, optimized_only, json, storage, .. } = *args;
    let weights = args.weights.as_deref();
    let max = fe.spec.spec.model.max_positions;
    anyhow::ensure!(
        seq as u64 <= max,
        "--seq {seq} is more than `{}` holds (model.max_positions = {max})",
        fe.graph.name
    );
    let t = Instant::now();
    let (optimized, report) = optimize::optimize_for(&fe.graph, &bench_target(device))?;
    let optimize_ms = t.elapsed().as_secs_f64() * 1e3;
    let (params, blocks) = params_for(fe, &fe.graph, weights, storage.storage())?;
    let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, batch, seq)?;
    let mut variants = Vec::new();
    let all = [("unoptimized", &fe.graph), ("optimized", &optimized)];
    for (name, graph) in all.into_iter().skip(usize::from(optimized_only)) {
        let model = device.model(graph, Weights::Given { params: &params, blocks: &blocks }, storage.storage(), &())?;
        let (dispatches, kernels) = (model.plan().steps.len(), model.kernels());
        model.run(&inputs).with_context(|| format!("warm-up run of the {name} plan"))?;
        variants.push(Variant { name, model, dispatches, kernels });
    }
    // Interleave the variants so drift in the machine's speed affects both alike.
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for _ in 0..runs {
        for (v, t) in variants.iter().zip(&mut times) {
            t.push(time_ms(|| v.model.run(&inputs).map(drop))?);
        }
    }
    let spreads: Vec<Spread> = times.iter().map(|t| Spread::of(t)).collect();
    let ms: Vec<f64> = spreads.iter().map(|s| s.median).collect();
    let speedup = ms[0] / ms[ms.len() - 1];
    let per_s = |ms: f64| batch as f64 / (ms / 1e3);
    if json {
        let rows: Vec<serde_json::Value> = variants
            .iter()
            .zip(&spreads)
            .map(|(v, s)| serde_json::json!({"variant": v.name, "dispatches": v.dispatches, "kernels": v.kernels, "forward_ms": s.median, "forward_ms_min": s.min, "forward_ms_max": s.max, "sequences_per_s": per_s(s.median), "weight_bytes": weight_bytes_json(&v.model)}))
            .collect();
        let out = serde_json::json!({
            "model": fe.graph.name, "backend": device.name(), "adapter": device.describe(), "batch": batch, "seq": seq, "runs": runs,
            "optimize_ms": optimize_ms, "egraph_nodes": report.egraph_nodes, "variants": rows, "speedup": speedup,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{} at batch {batch}, seq {seq} on {} (median of {}, and its fastest..slowest)",
            fe.graph.name,
            device.describe(),
            crate::report::count(runs, "run")
        );
        println!(
            "  {:<12} {:>10} {:>8} {:>12} {:>17} {:>12}",
            "variant", "dispatches", "kernels", "forward ms", "min..max ms", "sequences/s"
        );
        for (v, s) in variants.iter().zip(&spreads) {
            println!(
                "  {:<12} {:>10} {:>8} {:>12.2} {:>17} {:>12.2}",
                v.name,
                v.dispatches,
                v.kernels,
                s.median,
                s.range(2),
                per_s(s.median)
            );
        }
        if variants.len() > 1 {
            println!("  speedup {speedup:.2}x");
        }
        if let Some(v) = variants.last() {
            println!("  weights on the device: {}", weight_bytes(&v.model));
        }
        println!("  optimized in {optimize_ms:.1} ms");
    }
    Ok(())
}

/// `kiln bench profile`: every step of each variant's plan (unoptimized and optimized, or the
/// optimized one only) timed by itself after a warm-up run, summed by op, largest first: on the
/// CPU by the host around each step, on wgpu as [`kiln_runtime::GpuModel::profile`] times each dispatch (device
/// timestamps where the adapter has them). Where the optimizer loses time, this says which ops.
fn profile(fe: &FrontEnd, device: &Device, args: &ForwardArgs) -> Result<()> {
    let ForwardArgs { batch, seq, optimized_only, storage, .. } = *args;
    let weights = args.weights.as_deref();
    let optimized = optimize::optimize_for(&fe.graph, &bench_target(device))?.0;
    let (params, blocks) = params_for(fe, &fe.graph, weights, storage.storage())?;
    let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, batch, seq)?;
    let all = [("unoptimized", &fe.graph), ("optimized", &optimized)];
    for (name, graph) in all.into_iter().skip(usize::from(optimized_only)) {
        let model = device.model(graph, Weights::Given { params: &params, blocks: &blocks }, storage.storage(), &())?;
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
