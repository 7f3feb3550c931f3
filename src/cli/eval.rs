//! `kiln eval`: a model's loss and perplexity on data, with no update — variants compared
//! without training, and a trained checkpoint measured on held-out batches.

use crate::exec::{Backend, training_device};
use crate::model_file::{load_spec, weights_for};
use crate::progress::Reporter;
use crate::report::print_json;
use anyhow::{Context, Result};
use kiln_compiler::spec::PackDims;
use kiln_compiler::train::{Objective, loss_graph, on_tensors};
use kiln_runtime::train::batches::Batches;
use kiln_runtime::train::run::StepRunner;
use kiln_runtime::train::trainer::counted;
use kiln_runtime::{Checkpoint, read_tensors};
use serde_json::json;
use std::path::{Path, PathBuf};

/// Arguments of `kiln eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// A spec (TOML), or a checkpoint (a Hugging Face model directory or a GGUF file).
    model: PathBuf,
    /// The weights (default: MODEL's, if a checkpoint).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Pre-batched data as `kiln train --batches` reads it; evaluated on its `eval_` batch, or
    /// with `--all` on every batch it holds.
    #[arg(long)]
    batches: PathBuf,
    /// Every batch of the file, not only the `eval_` one.
    #[arg(long)]
    all: bool,
    /// Label smoothing of the loss (default: the spec's `[train]`, else none).
    #[arg(long)]
    label_smoothing: Option<f64>,
    /// Where the loss runs: `cpu` (the default), `interp` or `wgpu`.
    #[arg(long, value_parser = crate::exec::BackendParser, default_value = "cpu")]
    backend: Backend,
    /// Threads of the CPU backend.
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

impl EvalArgs {
    /// The model file.
    pub fn model(&self) -> &Path {
        &self.model
    }
}

/// Runs `kiln eval`.
pub fn run(args: EvalArgs, reporter: &Reporter) -> Result<()> {
    let fe = load_spec(&args.model)?;
    let weights = weights_for(args.weights.clone(), &args.model)?;
    let tensors = Checkpoint::open(&weights)?.all()?;
    let batches =
        Batches::new(read_tensors(&args.batches)?).with_context(|| format!("batches `{}`", args.batches.display()))?;
    let smoothing =
        args.label_smoothing.or_else(|| fe.spec.spec.train.as_ref().and_then(|t| t.label_smoothing)).unwrap_or(0.0);
    let graph = loss_graph(&fe.graph, Objective { label_smoothing: smoothing })?;
    let (graph, _) = on_tensors(&graph, &fe.spec.weights, &PackDims::of(&fe.spec))?;
    let device = training_device(args.backend, args.threads)?;
    let mut runner = StepRunner::new(&device, graph)?;
    let mut sets: Vec<(String, std::collections::HashMap<String, kiln_compiler::tensor::Tensor>)> = Vec::new();
    if let Some(eval) = batches.eval() {
        sets.push(("eval".into(), eval.clone()));
    }
    if args.all || sets.is_empty() {
        sets.extend((0..batches.len()).filter_map(|s| Some((format!("batch {s}"), batches.step(s)?))));
    }
    let (mut sum, mut tokens) = (0.0f64, 0u64);
    for (name, batch) in &sets {
        let out = runner.run(&tensors, batch, reporter).with_context(|| format!("evaluating {name}"))?;
        let n = counted(batch);
        sum += out.loss * n as f64;
        tokens += n;
    }
    let loss = sum / tokens.max(1) as f64;
    if args.json {
        return print_json(&json!({
            "loss": loss, "perplexity": loss.exp(), "tokens": tokens, "batches": sets.len(), "backend": device.name()
        }));
    }
    println!("loss        {loss:.6}");
    println!("perplexity  {:.4}", loss.exp());
    println!("tokens      {tokens} (in {} batch{})", sets.len(), if sets.len() == 1 { "" } else { "es" });
    Ok(())
}
