//! `kiln init`: a model's first weights, drawn as its spec's `[init]` says, written under the
//! checkpoint's tensor names and shapes (the spec's weight map), so that `run`, `generate` and
//! `train --weights` read them as they read a checkpoint.

use crate::model_file::load_spec;
use crate::progress::Reporter;
use anyhow::{Context, Result};
use kiln_runtime::train::init::{describe, initialize};
use kiln_runtime::write_tensors;
use std::path::PathBuf;

/// Arguments of `kiln init`.
#[derive(clap::Args)]
pub struct InitArgs {
    /// The spec (TOML) whose parameters are drawn.
    spec: PathBuf,
    /// Where to write the weights (safetensors, under the weight map's tensor names; never the
    /// spec, and an existing file only with `--force`).
    #[arg(short, long)]
    output: PathBuf,
    #[command(flatten)]
    force: crate::output::Force,
    /// The seed of the draws (default: the spec's `init.seed`).
    #[arg(long)]
    seed: Option<u64>,
}

/// Runs `kiln init`: draws the weights, writes them atomically and prints what was drawn.
pub fn run(args: InitArgs, reporter: &Reporter) -> Result<()> {
    crate::output::check("--output", &args.output, &[("the spec", &args.spec)], args.force.force)?;
    let fe = load_spec(&args.spec)?;
    let mut spec = fe.spec.clone();
    if let Some(seed) = args.seed {
        spec.spec.init.seed = seed;
    }
    let tensors = reporter
        .stage("drawing the weights", || initialize(&spec, &fe.graph))
        .with_context(|| format!("cannot initialize `{}`", args.spec.display()))?;
    write_tensors(&args.output, &tensors)?;
    let parameters: usize = tensors.iter().map(|(_, t)| t.len()).sum();
    println!("{}: {} tensors, {parameters} parameters", args.output.display(), tensors.len());
    for line in describe(&spec) {
        println!("  {line}");
    }
    Ok(())
}
