//! `kiln bench`: measurements, never tests, one subcommand per family (one module each). Every
//! figure is taken side by side in one process (variants interleaved run by run) and reported
//! with the device it ran on; ratios between variants are the numbers to quote, since absolute
//! times on shared machines are noisy.

mod attention;
mod calibrate;
mod decode;
mod forward;
mod kernels;
mod optimize;
mod table;
mod train;
pub mod tune;

use crate::exec::{Backend, threads_or_default};
use crate::progress::Reporter;
use anyhow::{Result, bail};
use kiln_compiler::FrontEnd;
use kiln_compiler::target::Target;
use kiln_runtime::{Device, Model};
use std::path::{Path, PathBuf};

/// Arguments of `kiln bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Bench,
}

/// What `kiln bench` measures.
#[derive(clap::Subcommand)]
enum Bench {
    /// Forward time of a spec unoptimized vs optimized, side by side, with sequences per second
    /// (random weights unless `--weights`).
    Forward(forward::ForwardArgs),
    /// The forward's figures, then every step of each plan (unoptimized and optimized) timed by
    /// itself, by op: where a forward pass spends its time (wgpu: each dispatch, between device
    /// timestamps where the adapter has them).
    Profile(forward::ForwardArgs),
    /// Generation with the key/value cache: a prompt of `--seq` tokens then `--steps` decode
    /// steps (prefill and decode tok/s, optimized graph).
    Decode(decode::DecodeArgs),
    /// The optimizer's time on the spec at several depths.
    Optimize(optimize::OptimizeArgs),
    /// The cost model's constants on the device (a GPU adapter's are cached as its cost model).
    Calibrate(calibrate::CalibrateArgs),
    /// GFLOPS of the projection kernels, reference vs fast, at prefill and decode shapes.
    Kernels(KernelArgs),
    /// Time and GFLOPS of the fused causal attention kernel at prefill shapes (MHA and
    /// grouped-query, sequences 128 to 1024), and block-sparse (BigBird) against dense
    /// bidirectional attention per token from 256 to 4096 tokens.
    Attention(KernelArgs),
    /// A training step (loss, gradients, AdamW) on random batches, per backend side by side:
    /// ms per step and tokens per second.
    Train(train::TrainArgs),
    /// A summary table over `--models` at `--seqs` (forward ms, tok/s, decode tok/s, dispatches,
    /// device memory) and the kernels' GFLOPS.
    Table(table::TableArgs),
}

impl BenchArgs {
    /// The spec file, if one is named.
    pub fn spec(&self) -> Option<&Path> {
        match &self.what {
            Bench::Forward(args) | Bench::Profile(args) => args.spec(),
            Bench::Decode(args) => args.spec(),
            Bench::Train(args) => Some(args.spec()),
            Bench::Optimize(_) | Bench::Calibrate(_) | Bench::Kernels(_) | Bench::Attention(_) | Bench::Table(_) => {
                None
            }
        }
    }
}

/// Runs `kiln bench`.
pub fn run(args: BenchArgs, reporter: &Reporter) -> Result<()> {
    match args.what {
        Bench::Forward(args) => forward::run(args, false, reporter),
        Bench::Profile(args) => forward::run(args, true, reporter),
        Bench::Decode(args) => decode::run(args, reporter),
        Bench::Optimize(args) => optimize::run(args),
        Bench::Calibrate(args) => calibrate::run(args, reporter),
        Bench::Kernels(args) => kernels::run(args, reporter),
        Bench::Attention(args) => attention::run(args, reporter),
        Bench::Table(args) => table::run(args, reporter),
        Bench::Train(args) => train::run(args, reporter),
    }
}

/// The spread of a benchmark's timed runs: the fastest, the median and the slowest, so that one
/// noisy run reads as noise rather than as a speed-up.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Spread {
    min: f64,
    median: f64,
    max: f64,
}

impl Spread {
    /// The spread of `values` (NaN for none: the counts are refused at 0 before anything runs).
    fn of(values: &[f64]) -> Spread {
        let min = values.iter().copied().reduce(f64::min).unwrap_or(f64::NAN);
        let max = values.iter().copied().reduce(f64::max).unwrap_or(f64::NAN);
        Spread { min, median: kiln_runtime::measure::median(values.to_vec()), max }
    }

    /// `min..max` with `decimals` decimals.
    fn range(&self, decimals: usize) -> String {
        format!("{:.decimals$}..{:.decimals$}", self.min, self.max)
    }

    /// `median (min..max)` with `decimals` decimals.
    fn text(&self, decimals: usize) -> String {
        format!("{:.decimals$} ({})", self.median, self.range(decimals))
    }
}

/// Refuses a count of 0 for any of `counts` (flag, value): a benchmark of no runs, tokens or
/// steps would print a median of nothing or a rate of 0.
fn at_least_one(counts: &[(&str, usize)]) -> Result<()> {
    if let Some((flag, _)) = counts.iter().find(|(_, n)| *n == 0) {
        bail!("{flag} 0 measures nothing: give {flag} 1 or more");
    }
    Ok(())
}

/// The device measured.
#[derive(clap::Args)]
struct DeviceArgs {
    /// Backend measured (as for `run`).
    #[arg(long, value_parser = crate::exec::BackendParser, default_value = "auto")]
    backend: Backend,
    /// GPU adapter (as for `run`).
    #[arg(long)]
    adapter: Option<String>,
    /// Threads of the CPU backend (as for `run`).
    #[arg(long)]
    threads: Option<usize>,
}

impl DeviceArgs {
    /// Opens the device, `auto` resolved as for `run` (said through `reporter` unless `json`).
    fn open(&self, reporter: &Reporter, json: bool) -> Result<Device> {
        let threads = threads_or_default(self.threads)?;
        let backend = self.backend.resolve(self.adapter.as_deref(), threads, reporter, json);
        if backend == Backend::Interp {
            bail!(
                "kiln bench measures compiled plans: --backend cpu or wgpu (the interpreter is the oracle, not a target)"
            );
        }
        crate::exec::open(backend, self.adapter.as_deref(), threads)
    }
}

/// Arguments of the kernel benchmarks (`kernels`, `attention`).
#[derive(clap::Args)]
struct KernelArgs {
    /// Timed runs per kernel (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// The spec a benchmark measures.
#[derive(clap::Args)]
struct SpecArgs {
    /// The spec: a file, or the name of a built-in spec (`kiln list`); random weights unless
    /// `--weights`. Default: a GPT-2-small-sized decoder (`benches/specs/gpt2-small.toml`, built
    /// into kiln).
    spec: Option<PathBuf>,
}

impl SpecArgs {
    /// The spec file, if one is named.
    fn path(&self) -> Option<&Path> {
        self.spec.as_deref()
    }

    /// The spec's name and source.
    fn source(&self) -> Result<(String, String)> {
        let (name, (source, _)) = self.read_named()?;
        Ok((name, source))
    }

    /// The spec's source and front end.
    fn read(&self) -> Result<(String, FrontEnd)> {
        Ok(self.read_named()?.1)
    }

    fn read_named(&self) -> Result<(String, (String, FrontEnd))> {
        Ok(match &self.spec {
            Some(path) => (path.display().to_string(), crate::model_file::read_spec(path)?),
            None => (BUILT_IN[0].0.to_string(), built_in(BUILT_IN[0].0)?),
        })
    }
}

/// The specs `kiln bench` measures when none is named (the first by default, all three for
/// `table`), by their paths in the repository; built into the binary so that it runs from any
/// directory.
const BUILT_IN: [(&str, &str); 3] = [
    ("benches/specs/gpt2-small.toml", include_str!("../../../benches/specs/gpt2-small.toml")),
    ("models/smollm2-135m.toml", include_str!("../../../models/smollm2-135m.toml")),
    ("models/minilm-l6.toml", include_str!("../../../models/minilm-l6.toml")),
];

/// A built-in spec's source and front end, by its name in [`BUILT_IN`].
fn built_in(name: &str) -> Result<(String, FrontEnd)> {
    let Some((_, source)) = BUILT_IN.iter().find(|(n, _)| *n == name) else {
        bail!("no built-in spec `{name}`");
    };
    Ok((source.to_string(), kiln_compiler::front_end(name, source)?))
}

/// What the optimizer compiles for on `device` in a benchmark: its cached target, else (a hardware
/// adapter never calibrated, or a cost model that cannot be read) the built-in one; a benchmark
/// calibrates nothing.
fn bench_target(device: &Device) -> Target {
    device.cached_target().ok().flatten().unwrap_or_else(Target::wgpu)
}

/// `12.3 MiB (Q4_1 9.0 MiB, f32 3.3 MiB)`: the weight bytes where the backend keeps them, by
/// format.
fn weight_bytes(model: &Model) -> String {
    let human = kiln_compiler::memory::human;
    let parts: Vec<String> = model.weight_bytes().iter().map(|(f, b)| format!("{f} {}", human(*b))).collect();
    let total: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
    format!("{} ({})", human(total), parts.join(", "))
}

/// The bytes of the weights by format, as JSON (`{"Q4_1": 123, ...}`).
fn weight_bytes_json(model: &Model) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> =
        model.weight_bytes().iter().map(|(f, b)| (f.name().to_string(), (*b).into())).collect();
    map.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_and_counts() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!(s, Spread { min: 1.0, median: 2.0, max: 3.0 });
        assert_eq!(s.text(1), "2.0 (1.0..3.0)");
        assert!(at_least_one(&[("--runs", 3), ("--steps", 1)]).is_ok());
        let err = at_least_one(&[("--runs", 3), ("--steps", 0)]).unwrap_err().to_string();
        assert_eq!(err, "--steps 0 measures nothing: give --steps 1 or more");
    }
}
