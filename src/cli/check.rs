//! `kiln check`: a spec validated and summarized (parameters, FLOPs per token, graph size), and
//! with `--weights`, every parameter read from a checkpoint as a run would read it.

use crate::progress::Reporter;
use crate::report::{count, human, print_json};
use anyhow::{Result, bail};
use kiln_compiler::FrontEnd;
use kiln_compiler::graph::print;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Arguments of `kiln check`.
#[derive(clap::Args)]
pub struct CheckArgs {
    /// The spec (TOML), or an artifact from `kiln compile` (the spec it stores).
    spec: PathBuf,
    /// Sequence length at which FLOPs per token are counted (1 to `max_positions`; default
    /// 128, or `max_positions` if smaller).
    #[arg(long)]
    seq: Option<usize>,
    /// Also read every parameter from this checkpoint (safetensors or GGUF) through the weight
    /// map and check it as a run would, without running; warn about the checkpoint's tensors
    /// the spec never reads (default: the checkpoint the spec records as `weights.path`, if any).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

impl CheckArgs {
    /// The spec file, where a weight error is shown (its weights are read with `--weights` or
    /// when it records them).
    pub fn weighed_spec(&self) -> Option<&Path> {
        Some(self.spec.as_path())
    }
}

/// Runs `kiln check`.
pub fn run(args: CheckArgs, reporter: &Reporter) -> Result<()> {
    let fe = crate::model_file::load_spec(&args.spec)?;
    let seq = check_seq(&fe, args.seq)?;
    let weights = match args.weights {
        Some(w) => Some(w),
        None => crate::model_file::recorded_weights(&args.spec)?,
    };
    let weights = weights.map(|w| check_weights(&fe, &w, reporter)).transpose()?;
    let training = training_memory(&fe)?;
    print(&args.spec, &fe, seq, weights.as_ref(), training.as_ref(), args.json)
}

/// What a training step of the spec's recipe needs in memory (`None` for a model without logits,
/// which does not train).
struct TrainingMemory {
    batch: usize,
    seq: usize,
    optimizer: &'static str,
    memory: kiln_compiler::train::StepMemory,
    /// Blocks the recipe recomputes, of the model's.
    recomputed: (usize, usize),
    /// The step's memory with every block recomputed.
    recomputing_all: kiln_compiler::train::StepMemory,
}

fn training_memory(fe: &FrontEnd) -> Result<Option<TrainingMemory>> {
    use kiln_compiler::autodiff::gradients_recomputing;
    use kiln_compiler::train::recompute::memory_of;
    use kiln_compiler::train::{LOSS, OptimizerKind};
    if !fe.graph.outputs.iter().any(|(n, _)| n == "logits") {
        return Ok(None);
    }
    let (t, recipe) = crate::model_file::training_graph(fe)?;
    let max = fe.spec.spec.model.max_positions as usize;
    let (batch, seq) = (recipe.batch, recipe.seq.unwrap_or(max.min(128)));
    let optimizer = match recipe.optimizer {
        OptimizerKind::AdamW => "AdamW",
        OptimizerKind::Sgd if recipe.momentum != 0.0 => "SGD with momentum",
        OptimizerKind::Sgd => "SGD",
    };
    let memory = memory_of(&t.step, &t.uses, &t.frozen, &recipe, seq);
    // The same step recomputing every block: the least its activations can hold.
    let every = kiln_compiler::autodiff::blocks(&t.eval);
    let least = match t.recomputed.len() == every.len() {
        true => memory,
        false => {
            let wants = |n: &str| !t.frozen.iter().any(|f| f == n);
            let step = gradients_recomputing(&t.eval, LOSS, wants, &every)?;
            memory_of(&step, &t.uses, &t.frozen, &recipe, seq)
        }
    };
    Ok(Some(TrainingMemory {
        batch,
        seq,
        optimizer,
        memory,
        recomputed: (t.recomputed.len(), t.blocks),
        recomputing_all: least,
    }))
}

/// `kiln check`: the summary of a valid spec, FLOPs counted at sequence length `seq`. JSON:
/// `spec`, `model`, `kind`, `layers`, `d_model`, `vocab`, `parameters`, `flops_per_token`, `seq`,
/// `graph` (`nodes`, `compute_nodes`, `edges`), `inputs`, `outputs`, `weight_map` (`preset`,
/// `null` without one, and `entries`).
/// `training` (`null` for a model without logits): what a training step of the spec's recipe
/// (`[train]`, or the defaults) needs — `batch`, `seq`, `optimizer`, `bytes` in all, and its
/// `weights`, `gradients`, `optimizer_state` and `activations` (the training graph's values live at
/// once at most, before fusion), `recomputed_blocks` of `blocks` (the recipe's `recompute` or
/// `memory_budget`), and `recompute_all` (`bytes` and `activations` with every block recomputed).
/// With `--weights`, also `weights` (`path`, `parameters`, `tensors_read`, `unused`: the
/// checkpoint's tensors the spec never reads), which text mode gives as a warning on stderr.
fn print(
    path: &Path,
    fe: &FrontEnd,
    seq: usize,
    weights: Option<&WeightCheck>,
    training: Option<&TrainingMemory>,
    json: bool,
) -> Result<()> {
    let s = print::summary(&fe.graph, seq);
    let m = &fe.spec.spec.model;
    let inputs: Vec<&str> = fe.graph.inputs().iter().map(|(_, n, _)| *n).collect();
    let outputs: Vec<&str> = fe.graph.outputs.iter().map(|(n, _)| n.as_str()).collect();
    let preset = fe.spec.weights.preset.as_deref();
    if json {
        return print_json(&json!({
            "spec": path.display().to_string(),
            "model": m.name,
            "kind": m.kind,
            "layers": fe.spec.layers(),
            "d_model": m.d_model,
            "vocab": m.vocab,
            "parameters": s.parameters,
            "flops_per_token": s.flops_per_token,
            "seq": s.seq,
            "graph": { "nodes": s.nodes, "compute_nodes": s.compute_nodes, "edges": s.edges },
            "inputs": inputs,
            "outputs": outputs,
            "weight_map": { "preset": preset, "entries": fe.spec.weights.entries.len() },
            "training": training.map(|t| json!({
                "batch": t.batch,
                "seq": t.seq,
                "optimizer": t.optimizer,
                "bytes": t.memory.total(),
                "weights": t.memory.weights,
                "gradients": t.memory.gradients,
                "optimizer_state": t.memory.optimizer,
                "activations": t.memory.activations,
                "recomputed_blocks": t.recomputed.0,
                "blocks": t.recomputed.1,
                "recompute_all": {
                    "bytes": t.recomputing_all.total(),
                    "activations": t.recomputing_all.activations,
                },
            })),
            "weights": weights.map(|w| json!({
                "path": w.path.display().to_string(),
                "parameters": w.parameters,
                "tensors_read": w.tensors_read,
                "unused": w.unused,
            })),
        }));
    }
    println!("{}: ok", path.display());
    println!(
        "  model        {} ({:?}, {}, d_model {}, vocab {})",
        m.name,
        m.kind,
        count(fe.spec.layers() as usize, "layer"),
        m.d_model,
        m.vocab
    );
    println!("  parameters   {} ({})", s.parameters, human(s.parameters as f64));
    println!("  FLOPs/token  {} (matmuls, forward at seq {})", human(s.flops_per_token), s.seq);
    println!("  graph        {} nodes ({} compute), {} edges", s.nodes, s.compute_nodes, s.edges);
    println!("  inputs       {}", inputs.join(", "));
    println!("  outputs      {}", outputs.join(", "));
    if let Some(p) = preset {
        println!("  weight map   preset `{p}`, {} entries", fe.spec.weights.entries.len());
    }
    if let Some(t) = training {
        let m = &t.memory;
        let mb = kiln_compiler::memory::human;
        println!(
            "  training     {} a step at batch {} x {} ({}): weights {}, gradients {}, {} state {}, activations {}",
            mb(m.total()),
            t.batch,
            t.seq,
            t.optimizer,
            mb(m.weights),
            mb(m.gradients),
            t.optimizer,
            mb(m.optimizer),
            mb(m.activations)
        );
        let (recomputed, blocks) = t.recomputed;
        let all = &t.recomputing_all;
        if recomputed > 0 {
            println!("               recomputing the activations of {recomputed} of {blocks} blocks in the backward");
        }
        if recomputed < blocks {
            println!(
                "               recomputing all {blocks} blocks (--recompute all): {}, activations {}",
                mb(all.total()),
                mb(all.activations)
            );
        }
    }
    if let Some(w) = weights {
        println!(
            "  weights      {} from {} of `{}`, every one checked",
            count(w.parameters, "parameter"),
            count(w.tensors_read, "tensor"),
            w.path.display()
        );
        if let Some(warning) = crate::model_file::unread_warning(&w.path, &w.unused) {
            eprintln!("warning: {warning}");
        }
    }
    Ok(())
}

/// What `kiln check --weights` found in a checkpoint.
struct WeightCheck {
    /// The checkpoint.
    path: std::path::PathBuf,
    /// The spec's parameters, each read and checked (name, shape, dtype, finite values, blocks).
    parameters: usize,
    /// The distinct checkpoint tensors they come from.
    tensors_read: usize,
    /// The checkpoint's tensors that no parameter comes from, sorted.
    unused: Vec<String>,
}

/// `check --seq`: a length from 1 to the model's `max_positions` (default 128, or
/// `max_positions` if smaller), since FLOPs at other lengths describe no run of it.
fn check_seq(fe: &FrontEnd, seq: Option<usize>) -> Result<usize> {
    let max = fe.spec.spec.model.max_positions;
    match seq {
        None => Ok(usize::try_from(max.min(128)).unwrap_or(128)),
        Some(seq) if seq == 0 || seq as u64 > max => {
            bail!(
                "--seq {seq} is not a sequence length of this model: FLOPs are counted at 1 to its `max_positions` = {max}"
            )
        }
        Some(seq) => Ok(seq),
    }
}

/// Reads every parameter of `fe`'s graph from the checkpoint at `path` through the weight map, as
/// a run would (without keeping them), and lists the tensors none of them comes from.
fn check_weights(fe: &FrontEnd, path: &Path, reporter: &Reporter) -> Result<WeightCheck> {
    use kiln_runtime::weights;
    let ckpt = kiln_runtime::Checkpoint::open(path)?;
    let names = weights::graph_params(&fe.graph);
    let dims = kiln_compiler::spec::PackDims::of(&fe.spec);
    drop(weights::load_named_with_progress(&fe.spec.weights, &dims, &names, &ckpt, reporter)?);
    drop(weights::quantized_named_with_progress(&fe.spec.weights, &dims, &names, &ckpt, reporter)?);
    let unused = crate::model_file::unread_tensors(fe, &ckpt);
    let tensors_read = ckpt.names().len() - unused.len();
    Ok(WeightCheck { path: path.to_path_buf(), parameters: names.len(), tensors_read, unused })
}
