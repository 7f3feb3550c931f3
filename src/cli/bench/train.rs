//! `kiln bench train`: the time of a training step (loss, gradients, clipping, AdamW) on random
//! token batches, per backend, interleaved run by run; tokens per second of the step alone (no
//! data loading, no evaluation, no checkpoint) — the figure `scripts/bench-torch`'s `train` row
//! gives for PyTorch eager on the same shapes.

use crate::exec::{Backend, threads_or_default, training_device};
use crate::model_file::load_spec;
use crate::progress::Reporter;
use anyhow::{Result, bail};
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::{Bytes, RecipeFile, Recompute};
use kiln_runtime::train::data::SplitMix64;
use kiln_runtime::train::{Trainer, init};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `kiln bench train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// A spec with logits (a decoder, an encoder-decoder, an encoder with a head), initialized as
    /// its `[init]` says; or a checkpoint or GGUF file standing for its spec.
    spec: PathBuf,
    /// Sequences per step.
    #[arg(long, default_value_t = 12)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Steps timed per run (after one untimed).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Runs; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Backends, side by side: `cpu`, `interp`, `wgpu` (comma-separated, or the flag repeated).
    #[arg(long, value_parser = crate::exec::BackendParser, value_delimiter = ',', default_value = "cpu")]
    backend: Vec<Backend>,
    /// Threads of the CPU backend.
    #[arg(long)]
    threads: Option<usize>,
    /// Also time each backend's step unoptimized (the graph as autodiff builds it, lowered as
    /// is), a row beside each: what the e-graph's rewrites of the step are worth.
    #[arg(long)]
    unoptimized: bool,
    /// Also print where each backend's step goes (the CPU's by the host's clock, a device's by its
    /// timestamps; not the interpreter's): its graph's time by op (the sum over the plan's steps
    /// of each op, the median of `--runs` profiled runs), largest first.
    #[arg(long)]
    profile: bool,
    /// Recompute the activations of blocks in the backward instead of keeping them: `all`, or a
    /// number of blocks (the recipe's `recompute`).
    #[arg(long)]
    recompute: Option<Recompute>,
    /// Recompute the fewest blocks that bring the step's memory within this (`4GiB`, `800MB`;
    /// the recipe's `memory_budget`).
    #[arg(long, conflicts_with = "recompute")]
    memory_budget: Option<Bytes>,
    /// Print one JSON document on stdout: `tokens_per_s`, `ms_per_step` and the peak resident
    /// memory (`peak_rss_mb` in decimal megabytes, `peak_rss_mib` in MiB) of the first backend at the top level, and every backend's in `rows` (with the fastest and slowest
    /// runs' `ms_per_step_min`/`_max` and `tokens_per_s_min`/`_max`).
    #[arg(long)]
    json: bool,
}

impl TrainArgs {
    /// The spec file.
    pub fn spec(&self) -> &Path {
        &self.spec
    }
}

/// Runs `kiln bench train`.
pub fn run(args: TrainArgs, reporter: &Reporter) -> Result<()> {
    if args.batch == 0 || args.seq == 0 || args.steps == 0 || args.runs == 0 {
        bail!("--batch, --seq, --steps and --runs must be at least 1");
    }
    let fe = load_spec(&args.spec)?;
    let vocab = fe.spec.spec.model.vocab as usize;
    let recipe = fe.spec.spec.train.clone().unwrap_or_default();
    let overrides = RecipeFile {
        steps: Some(args.steps + 1),
        warmup_steps: Some(0),
        batch: Some(args.batch),
        seq: Some(args.seq),
        recompute: args.recompute,
        memory_budget: args.memory_budget,
        ..Default::default()
    };
    let recipe = recipe.merge(overrides).resolve()?;
    let threads = threads_or_default(args.threads)?;
    let mut trainers = Vec::new();
    let mut runs = Vec::new();
    for &backend in &args.backend {
        for optimize in [true, false] {
            let device = training_device(backend, Some(threads))?;
            // The interpreter runs the graph as built either way.
            if optimize || (args.unoptimized && !matches!(device, kiln_runtime::Device::Interp)) {
                runs.push((device, optimize));
            }
        }
    }
    let mut params: Option<HashMap<String, Tensor>> =
        Some(init::initialize(&fe.spec, &fe.graph)?.into_iter().collect());
    let dims = PackDims::of(&fe.spec);
    let last = runs.len().saturating_sub(1);
    for (i, (device, optimize)) in runs.into_iter().enumerate() {
        let name = format!("{}{}", device.name(), if optimize { "" } else { " (unoptimized)" });
        // The last trainer takes the weights (the others a copy): the process holds no more
        // weights than its trainers do, so the peak memory is theirs.
        let weights = if i == last { params.take() } else { params.clone() }.unwrap_or_default();
        let (map, recipe) = (&fe.spec.weights, recipe.clone());
        let trainer =
            Trainer::with_optimization(device, &fe.graph, map, &dims, recipe, weights, optimize).map_err(Box::new)?;
        trainers.push((name, trainer));
    }
    // Random ids, the next id as each label (a fixed batch: the step's time does not depend on
    // the values).
    let mut bits = SplitMix64(0x2545_F491_4F6C_DD1D);
    let mut next = || bits.below(vocab as u64) as i64;
    let row: Vec<Vec<i64>> = (0..args.batch).map(|_| (0..=args.seq).map(|_| next()).collect()).collect();
    let take = |from: usize| -> Vec<i64> { row.iter().flat_map(|r| r[from..from + args.seq].to_vec()).collect() };
    // The model's other inputs (an encoder-decoder's target ids, token types, key masks) as the
    // differential tests make them, each `[batch, seq]`.
    let mut batch = kiln_compiler::interp::sample_inputs(&fe.graph, vocab, args.batch, args.seq)?;
    batch.insert("input_ids".to_string(), Tensor::i64(vec![args.batch, args.seq], take(0)));
    batch.insert("labels".to_string(), Tensor::i64(vec![args.batch, args.seq], take(1)));
    let tokens = (args.batch * args.seq) as f64;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); trainers.len()];
    // The process's peak resident memory after each backend's first step (every backend's
    // trainer is built by then, so the later figures include the earlier backends' memory).
    let mut peaks: Vec<Option<f64>> = Vec::new();
    for (_, t) in trainers.iter_mut() {
        t.step(std::slice::from_ref(&batch)).map_err(Box::new)?;
        peaks.push(peak_rss_mib());
    }
    for _ in 0..args.runs {
        for ((_, t), times) in trainers.iter_mut().zip(times.iter_mut()) {
            let start = Instant::now();
            for _ in 0..args.steps {
                t.step(std::slice::from_ref(&batch)).map_err(Box::new)?;
            }
            times.push(start.elapsed().as_secs_f64() / args.steps as f64);
        }
    }
    // Each op's time summed over the plan's steps, per run; the median over the runs.
    let mut profiles: Vec<(String, Vec<OpTime>)> = Vec::new();
    if args.profile {
        for (name, t) in trainers.iter_mut() {
            let mut runs: Vec<Vec<(String, f64)>> = Vec::new();
            for _ in 0..args.runs {
                match t.profile(&batch).map_err(Box::new)? {
                    Some(steps) => runs.push(steps),
                    None => break,
                }
            }
            let Some(first) = runs.first() else { continue };
            let mut by_op: Vec<OpTime> = Vec::new();
            for (i, (op, _)) in first.iter().enumerate() {
                let mut times: Vec<f64> = runs.iter().filter_map(|r| r.get(i).map(|s| s.1)).collect();
                times.sort_by(f64::total_cmp);
                let median = times.get(times.len() / 2).copied().unwrap_or(0.0);
                match by_op.iter_mut().find(|(o, _, _)| o == op) {
                    Some(e) => (e.1, e.2) = (e.1 + 1, e.2 + median),
                    None => by_op.push((op.clone(), 1, median)),
                }
            }
            by_op.sort_by(|a, b| b.2.total_cmp(&a.2));
            profiles.push((name.clone(), by_op));
        }
    }
    let rows: Vec<serde_json::Value> = trainers
        .iter()
        .zip(times)
        .zip(&peaks)
        .map(|(((name, trainer), t), peak)| {
            let s = super::Spread::of(&t);
            let (recomputed, blocks) = trainer.recomputed();
            serde_json::json!({
                "backend": name, "ms_per_step": s.median * 1e3, "tokens_per_s": tokens / s.median,
                "peak_rss_mb": peak.map(|mib| mib * MIB_IN_MB), "peak_rss_mib": peak,
                "ms_per_step_min": s.min * 1e3, "ms_per_step_max": s.max * 1e3,
                "tokens_per_s_min": tokens / s.max, "tokens_per_s_max": tokens / s.min,
                "recomputed_blocks": recomputed, "blocks": blocks,
            })
        })
        .collect();
    if args.json {
        let first = rows.first().cloned().unwrap_or_default();
        let profiles: serde_json::Map<String, serde_json::Value> = profiles
            .iter()
            .map(|(name, ops)| {
                let ops: Vec<serde_json::Value> =
                    ops.iter().map(|(op, n, s)| serde_json::json!({"op": op, "steps": n, "ms": s * 1e3})).collect();
                (name.clone(), serde_json::Value::Array(ops))
            })
            .collect();
        return crate::report::print_json(&serde_json::json!({
            "spec": args.spec.display().to_string(), "batch": args.batch, "seq": args.seq, "threads": threads,
            "steps": args.steps, "runs": args.runs,
            "tokens_per_s": first["tokens_per_s"], "ms_per_step": first["ms_per_step"],
            "peak_rss_mb": first["peak_rss_mb"], "peak_rss_mib": first["peak_rss_mib"],
            "rows": rows,
            "profile": profiles,
        }));
    }
    reporter.info(format_args!(
        "{}: batch {} x {} tokens, {} steps x {} runs (median, fastest..slowest), {threads} threads",
        args.spec.display(),
        args.batch,
        args.seq,
        args.steps,
        args.runs
    ));
    if let Some((_, t)) = trainers.first()
        && t.recomputed().0 > 0
    {
        let (recomputed, blocks) = t.recomputed();
        reporter.info(format_args!("recomputing the activations of {recomputed} of {blocks} blocks in the backward"));
    }
    for row in &rows {
        let peak = row["peak_rss_mib"].as_f64().map_or("?".to_string(), |p| format!("{p:.0}"));
        let f = |key: &str| row[key].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:18} {:8.2} ms/step ({:.2}..{:.2})  {:9.0} tokens/s  peak {peak} MiB",
            row["backend"].as_str().unwrap_or("?"),
            f("ms_per_step"),
            f("ms_per_step_min"),
            f("ms_per_step_max"),
            f("tokens_per_s")
        );
    }
    for (name, ops) in &profiles {
        let total: f64 = ops.iter().map(|(_, _, s)| s).sum();
        println!("{name}: the graph's {:.2} ms by op (plan steps, median of {} runs)", total * 1e3, args.runs);
        for (op, n, s) in ops {
            println!("  {:24} {:5} steps {:9.2} ms {:5.1}%", op, n, s * 1e3, 100.0 * s / total.max(f64::MIN_POSITIVE));
        }
    }
    Ok(())
}

/// Decimal megabytes in a mebibyte: `peak_rss_mb` is the same peak in the unit its name says
/// (the key independent checks read), beside `peak_rss_mib`, the unit kiln prints.
const MIB_IN_MB: f64 = 1.048_576;

/// An op's share of a profiled step: its name, the plan steps it ran as, their seconds.
type OpTime = (String, usize, f64);

/// The process's peak resident set so far, in MiB (`VmHWM` of `/proc/self/status`; `None` where
/// the system has no such file).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
