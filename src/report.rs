//! What `kiln check`, `kiln compile` and `kiln run` print on stdout: a few lines of text for a
//! person, or, with `--json`, one JSON document for a script (the fields are listed on each
//! function and in the README).

use anyhow::Result;
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
pub fn check(path: &Path, fe: &FrontEnd, seq: usize, json: bool) -> Result<()> {
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
        }));
    }
    println!("{}: ok", path.display());
    println!(
        "  model        {} ({:?}, {} layers, d_model {}, vocab {})",
        m.name,
        m.kind,
        fe.spec.layers(),
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
    Ok(())
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
    println!("{}: {} kernels, {} dispatches, {} shared buffers", path.display(), kernels, plan.steps.len(), plan.slots);
    println!("  intermediates at batch {batch}, seq {seq}: {placed} bytes placed, {sum} bytes if unshared");
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
