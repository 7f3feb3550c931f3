//! What `kiln check`, `kiln compile` and `kiln run` print on stdout: a few lines of text for a
//! person, or, with `--json`, one JSON document for a script (the fields are listed on each
//! function and in the README).

use anyhow::{Result, bail};
use kiln_compiler::FrontEnd;
use kiln_compiler::graph::{Sym, print};
use kiln_compiler::lower::Plan;
use kiln_compiler::tensor::Tensor;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

/// Prints one JSON document on stdout.
pub fn print_json(value: &serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// `kiln check`: the summary of a valid spec, FLOPs counted at sequence length `seq`. JSON:
/// `spec`, `model`, `kind`, `layers`, `d_model`, `vocab`, `parameters`, `flops_per_token`, `seq`,
/// `graph` (`nodes`, `compute_nodes`, `edges`), `inputs`, `outputs`, `weight_map` (`preset`,
/// `null` without one, and `entries`).
/// With `--weights`, also `weights` (`path`, `parameters`, `tensors_read`, `unused`: the
/// checkpoint's tensors the spec never reads), which text mode gives as a warning on stderr.
pub fn check(path: &Path, fe: &FrontEnd, seq: usize, weights: Option<&WeightCheck>, json: bool) -> Result<()> {
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
    if let Some(w) = weights {
        println!(
            "  weights      {} from {} of `{}`, every one checked",
            count(w.parameters, "parameter"),
            count(w.tensors_read, "tensor"),
            w.path.display()
        );
        if !w.unused.is_empty() {
            const SHOWN: usize = 10;
            let mut names: Vec<String> = w.unused.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
            if w.unused.len() > SHOWN {
                names.push(format!("and {} more", w.unused.len() - SHOWN));
            }
            eprintln!(
                "warning: `{}` holds {} the spec never reads: {}",
                w.path.display(),
                count(w.unused.len(), "tensor"),
                names.join(", ")
            );
        }
    }
    Ok(())
}

/// What `kiln check --weights` found in a checkpoint.
pub struct WeightCheck {
    /// The checkpoint.
    pub path: std::path::PathBuf,
    /// The spec's parameters, each read and checked (name, shape, dtype, finite values, blocks).
    pub parameters: usize,
    /// The distinct checkpoint tensors they come from.
    pub tensors_read: usize,
    /// The checkpoint's tensors that no parameter comes from, sorted.
    pub unused: Vec<String>,
}

/// `check --seq`: a length from 1 to the model's `max_positions` (default 128, or
/// `max_positions` if smaller), since FLOPs at other lengths describe no run of it.
pub fn check_seq(fe: &FrontEnd, seq: Option<usize>) -> Result<usize> {
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
pub fn check_weights(fe: &FrontEnd, path: &Path, reporter: &crate::progress::Reporter) -> Result<WeightCheck> {
    use kiln_runtime::weights;
    let ckpt = kiln_runtime::Checkpoint::open(path)?;
    let names = weights::graph_params(&fe.graph);
    let dims = kiln_compiler::spec::PackDims::of(&fe.spec);
    drop(weights::load_named_with_progress(&fe.spec.weights, &dims, &names, &ckpt, reporter)?);
    drop(weights::quantized_named_with_progress(&fe.spec.weights, &dims, &names, &ckpt, reporter)?);
    let read: std::collections::BTreeSet<String> = names
        .iter()
        .map(|(name, _)| fe.spec.weights.resolve(name).map_or_else(|| name.clone(), |r| r.tensor))
        .collect();
    let unused = ckpt.names().into_iter().filter(|n| !read.contains(n)).collect();
    Ok(WeightCheck { path: path.to_path_buf(), parameters: names.len(), tensors_read: read.len(), unused })
}

/// `kiln compile`: the artifact written to `path` and its plan. JSON: `artifact`, `model`,
/// `optimized`, `kernels` (the plan's unique WGSL kernels on wgpu), `dispatches`, `buffers` (shared intermediate buffers), `memory`
/// (`batch`, `seq`, `placed_bytes`: intermediates as placed in the shared buffers,
/// `unshared_bytes`: their sum were each its own buffer).
pub fn compile(path: &Path, plan: &Plan, optimized: bool, json: bool) -> Result<()> {
    let (batch, seq) = (1, 128);
    let syms = HashMap::from([(Sym::Batch, batch), (Sym::Seq, seq), (Sym::SrcSeq, seq)]);
    let (sum, placed) = plan.memory(&syms);
    let kernels = kiln_compiler::back::wgsl::compile(plan, &Default::default())?.kernels.len();
    if json {
        return print_json(&json!({
            "artifact": path.display().to_string(),
            "model": plan.name,
            "optimized": optimized,
            "kernels": kernels,
            "dispatches": plan.steps.len(),
            "buffers": plan.slots,
            "memory": { "batch": batch, "seq": seq, "placed_bytes": placed, "unshared_bytes": sum },
        }));
    }
    println!(
        "{}: {}, {}, {}",
        path.display(),
        count(kernels, "kernel"),
        count(plan.steps.len(), "dispatch"),
        count(plan.slots, "shared buffer")
    );
    println!(
        "  intermediates at batch {batch}, seq {seq}: {} placed, {} if unshared",
        kiln_compiler::memory::human(placed),
        kiln_compiler::memory::human(sum)
    );
    Ok(())
}

/// `kiln run`: the outputs written to `path`. JSON: `path`, `outputs` (per output in the order
/// written: `name`, `dtype`, `shape`).
pub fn run(path: &Path, outputs: &[(String, Tensor)], backend: &str, json: bool) -> Result<()> {
    if json {
        let outputs: Vec<serde_json::Value> = outputs
            .iter()
            .map(|(name, t)| json!({ "name": name, "dtype": t.dtype().to_string(), "shape": t.shape }))
            .collect();
        return print_json(&json!({ "path": path.display().to_string(), "backend": backend, "outputs": outputs }));
    }
    for (name, t) in outputs {
        println!("{name}: {}{:?}", t.dtype(), t.shape);
    }
    println!("wrote {}", path.display());
    Ok(())
}

/// `1 token`, `3 tokens`, `2 dispatches`: a count with its noun, plural unless one (English's
/// regular plural: `-es` after a sibilant).
pub fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ if ["s", "x", "ch", "sh"].iter().any(|end| noun.ends_with(end)) => format!("{n} {noun}es"),
        _ => format!("{n} {noun}s"),
    }
}

/// `1234567` -> `1.23M`.
pub fn human(x: f64) -> String {
    let (v, unit) = match x {
        x if x >= 1e12 => (x / 1e12, "T"),
        x if x >= 1e9 => (x / 1e9, "G"),
        x if x >= 1e6 => (x / 1e6, "M"),
        x if x >= 1e3 => (x / 1e3, "k"),
        x => (x, ""),
    };
    format!("{v:.2}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_plural_unless_one() {
        assert_eq!(count(1, "token"), "1 token");
        assert_eq!(count(0, "token"), "0 tokens");
        assert_eq!(count(2, "dispatch"), "2 dispatches");
    }
}
