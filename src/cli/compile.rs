//! `kiln compile`: a spec optimized for a backend's cost model and lowered into an artifact (plan,
//! spec and weight map; the weights stay in their files), which runs on any backend.

use crate::exec::{Backend, optimizer_target};
use crate::progress::Reporter;
use crate::report::{count, print_json};
use anyhow::Result;
use kiln_compiler::artifact;
use kiln_compiler::graph::Sym;
use kiln_compiler::lower::Plan;
use kiln_compiler::optimize;
use kiln_compiler::target::Target;
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Arguments of `kiln compile`.
#[derive(clap::Args)]
pub struct CompileArgs {
    /// The spec (TOML).
    spec: PathBuf,
    /// Where to write the artifact (never the spec; an existing file only with `--force`).
    #[arg(short, long)]
    output: PathBuf,
    #[command(flatten)]
    force: crate::output::Force,
    /// Lower the graph as built, without the e-graph optimizer.
    #[arg(long)]
    no_optimize: bool,
    /// The backend whose cost model and limits the optimizer extracts for (the artifact runs on
    /// any backend; `auto`: a hardware GPU when this machine has one, else `cpu`).
    #[arg(long = "for", value_parser = crate::exec::BackendParser, default_value = "wgpu")]
    target: Backend,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `kiln compile`.
pub fn run(args: CompileArgs, reporter: &Reporter) -> Result<()> {
    let CompileArgs { spec, output, force, no_optimize, target, json } = args;
    crate::output::check("--output", &output, &[("the spec", &spec)], force.force)?;
    let (source, mut fe) = crate::model_file::read_spec(&spec)?;
    if !no_optimize {
        let target = target_for(target.resolve(None, 1, reporter, json), reporter)?;
        fe.graph = reporter.stage("optimizing", || optimize::optimize_for(&fe.graph, &target))?.0;
    }
    let artifact = reporter.stage("lowering", || artifact::compile(&spec.display().to_string(), &source, &fe))?;
    artifact.write(&output)?;
    print(&output, &artifact.plan, !no_optimize, json)
}

/// `kiln compile`: the artifact written to `path` and its plan. JSON: `artifact`, `model`,
/// `optimized`, `kernels` (the plan's unique WGSL kernels on wgpu), `dispatches`, `buffers` (shared intermediate buffers), `memory`
/// (`batch`, `seq`, `placed_bytes`: intermediates as placed in the shared buffers,
/// `unshared_bytes`: their sum were each its own buffer).
/// What the optimizer extracts for on `backend`. wgpu's is the cost model of the adapter a run
/// would open here, read from the cache without opening it where it can be (a hardware adapter
/// without one is opened and calibrated); none at all leaves the built-in model, since the
/// artifact runs anywhere.
fn target_for(backend: Backend, reporter: &Reporter) -> Result<Target> {
    if backend != Backend::Wgpu {
        return optimizer_target(&crate::exec::open(backend, None, 1)?, reporter);
    }
    let Ok((name, software)) = kiln_runtime::Gpu::chosen_adapter(None) else { return Ok(Target::wgpu()) };
    match kiln_runtime::costs::cached(&name, software)? {
        Some(target) => Ok(target),
        None => optimizer_target(&crate::exec::open(backend, None, 1)?, reporter),
    }
}

fn print(path: &Path, plan: &Plan, optimized: bool, json: bool) -> Result<()> {
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
