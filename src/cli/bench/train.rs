//! `kiln bench train`: the time of a training step (loss, gradients, clipping, AdamW) on random
//! token batches, per backend, interleaved run by run; tokens per second of the step alone (no
//! data loading, no evaluation, no checkpoint) — the figure `scripts/bench-torch`'s `train` row
//! gives for PyTorch eager on the same shapes.

use crate::exec::{open, threads_or_default};
use crate::model_file::load_spec;
use crate::progress::Reporter;
use anyhow::{Result, bail};
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::RecipeFile;
use kiln_runtime::train::{Trainer, init};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `kiln bench train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// A decoder spec, initialized as its `[init]` says.
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
    /// Backends, side by side: `cpu`, `interp`.
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    backends: Vec<String>,
    /// Threads of the CPU backend.
    #[arg(long)]
    threads: Option<usize>,
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
        ..Default::default()
    };
    let recipe = recipe.merge(overrides).resolve()?;
    let threads = threads_or_default(args.threads)?;
    let mut trainers = Vec::new();
    for name in &args.backends {
        let backend = match name.as_str() {
            "cpu" => crate::exec::Backend::Cpu,
            "interp" => crate::exec::Backend::Interp,
            other => bail!("--backends: `{other}` does not train (cpu, interp)"),
        };
        let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph)?.into_iter().collect();
        let dims = PackDims::of(&fe.spec);
        let device = open(backend, None, threads)?;
        let trainer =
            Trainer::new(device, &fe.graph, &fe.spec.weights, &dims, recipe.clone(), params).map_err(Box::new)?;
        trainers.push((name.clone(), trainer));
    }
    // Random ids, the next id as each label (a fixed batch: the step's time does not depend on
    // the values).
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab as u64) as i64
    };
    let row: Vec<Vec<i64>> = (0..args.batch).map(|_| (0..=args.seq).map(|_| next()).collect()).collect();
    let take = |from: usize| -> Vec<i64> { row.iter().flat_map(|r| r[from..from + args.seq].to_vec()).collect() };
    let batch = HashMap::from([
        ("input_ids".to_string(), Tensor::i64(vec![args.batch, args.seq], take(0))),
        ("labels".to_string(), Tensor::i64(vec![args.batch, args.seq], take(1))),
    ]);
    let tokens = (args.batch * args.seq) as f64;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); trainers.len()];
    for (_, t) in trainers.iter_mut() {
        t.step(std::slice::from_ref(&batch)).map_err(Box::new)?;
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
    reporter.info(format_args!(
        "{}: batch {} x {} tokens, {} steps x {} runs (median), {threads} threads",
        args.spec.display(),
        args.batch,
        args.seq,
        args.steps,
        args.runs
    ));
    for ((name, _), mut t) in trainers.iter().zip(times) {
        t.sort_by(f64::total_cmp);
        let median = t[t.len() / 2];
        println!("{name:8} {:8.2} ms/step  {:9.0} tokens/s", median * 1e3, tokens / median);
    }
    Ok(())
}
