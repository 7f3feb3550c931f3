//! `kiln tune`: the WGSL kernels' forms timed on a GPU adapter for a model's shapes, the fastest
//! that matches the reference cached for the adapter (see `kiln_runtime::tune`); every later load
//! of a model of those shapes on that adapter takes it.

use super::{DeviceArgs, SpecArgs, bench_target};
use crate::exec::params_for;
use crate::progress::Reporter;
use anyhow::{Result, bail};
use kiln_compiler::graph::build::build_cached;
use kiln_compiler::optimize;
use kiln_compiler::spec::BlockKind;
use kiln_runtime::tune::{Workload, tune};
use kiln_runtime::{Device, Storage};
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `kiln tune`.
#[derive(clap::Args)]
pub struct TuneArgs {
    #[command(flatten)]
    spec: SpecArgs,
    /// Real weights (safetensors or GGUF; quantized blocks kept) instead of random ones: the
    /// timings depend on the weights' formats, not their values.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Tokens of the timed prompt (of each sequence of an encoder's forward pass).
    #[arg(long, default_value_t = 32)]
    prompt: usize,
    /// Sequences of an encoder's (or encoder-decoder's) timed forward pass; a decoder's
    /// generation is one sequence.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Decode steps timed after it: enough for the costs that grow with the cache to show (on an
    /// H100, forms that won over 16 steps by 1% decoded 6% slower over 64, their cache copied at
    /// every step).
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Seconds after which no further candidate starts (the adapter's default forms always run).
    #[arg(long, default_value_t = 120.0)]
    budget: f64,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print the tuning as JSON on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

impl TuneArgs {
    /// The spec file, if one is named.
    pub fn spec(&self) -> Option<&std::path::Path> {
        self.spec.path()
    }
}

/// Runs `kiln tune`.
pub fn run(args: TuneArgs, reporter: &Reporter) -> Result<()> {
    super::at_least_one(&[("--prompt", args.prompt), ("--steps", args.steps), ("--batch", args.batch)])?;
    if !(args.budget.is_finite() && args.budget >= 0.0) {
        bail!("--budget must be a number of seconds, at least 0 (got {})", args.budget);
    }
    let device = args.device.open(reporter, args.json)?;
    let Device::Gpu(gpu) = &device else {
        bail!(
            "kiln tune times the WGSL kernels on a GPU adapter: use --backend wgpu (the CPU's kernels have no forms to choose)"
        );
    };
    let (_, fe) = args.spec.read()?;
    let positions = fe.spec.spec.model.max_positions as usize;
    // A decoder's generation is timed; any other model's forward pass on a batch of samples.
    let decoder = fe.spec.spec.model.kind == BlockKind::Decoder;
    let needed = if decoder { args.prompt + args.steps + 1 } else { args.prompt };
    if needed > positions {
        bail!(
            "--prompt {} (and --steps {} for a decoder) need {needed} positions; the model has {positions}",
            args.prompt,
            args.steps
        );
    }
    let built = if decoder { build_cached(&fe.spec)? } else { fe.graph.clone() };
    let graph = optimize::optimize_for(&built, &bench_target(&device))?.0;
    let (params, blocks) = params_for(&fe, &graph, args.weights.as_deref(), Storage::default())?;
    let vocab = fe.spec.spec.model.vocab as usize;
    let inputs = match decoder {
        true => None,
        false => Some(kiln_compiler::interp::sample_inputs(&graph, vocab, args.batch, args.prompt)?),
    };
    let work = Workload {
        graph: &graph,
        params: &params,
        blocks: &blocks,
        vocab: fe.spec.spec.model.vocab as usize,
        max_positions: fe.spec.spec.model.max_positions as usize,
        prompt: args.prompt,
        steps: args.steps,
        budget: Duration::from_secs_f64(args.budget),
        inputs: inputs.as_ref(),
    };
    let (entry, path) = tune(gpu, &work, reporter)?;
    if args.json {
        let out = serde_json::json!({
            "model": entry.model, "adapter": gpu.adapter_name(), "driver": gpu.driver(),
            "chosen": entry.chosen, "chosen_forms": entry.chosen.describe(), "prompt_tokens": entry.prompt,
            "decode_steps": entry.steps, "candidates": entry.candidates, "saved": path.display().to_string(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    match decoder {
        true => println!(
            "{} on {} ({}): {} prompt tokens, {} decode steps, the faster of two generations",
            entry.model,
            gpu.describe(),
            gpu.driver(),
            entry.prompt,
            entry.steps
        ),
        false => println!(
            "{} on {} ({}): a forward pass of {} x {} tokens, the faster of two",
            entry.model,
            gpu.describe(),
            gpu.driver(),
            args.batch,
            entry.prompt
        ),
    }
    let first = if decoder { "prefill ms" } else { "forward ms" };
    println!("  {:>9} {first:>11} {:>11}  forms", "error", "ms / token");
    for t in &entry.candidates {
        let mark = if t.tunables == entry.chosen { "*" } else { " " };
        let num = |x: Option<f64>, p: usize| x.map_or_else(|| "-".to_string(), |v| format!("{v:.p$}"));
        let error = t.error.map_or_else(|| "-".to_string(), |e| format!("{e:.1e}"));
        let why = t.rejected.as_ref().map_or_else(String::new, |w| format!(" ({w})"));
        println!(
            "{mark} {error:>9} {:>11} {:>11}  {}{why}",
            num(t.prefill_ms, 1),
            num(t.decode_ms, 2),
            t.tunables.describe()
        );
    }
    println!("chosen: {}; saved to {}", entry.chosen.describe(), path.display());
    Ok(())
}
