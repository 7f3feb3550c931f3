//! Where and how a command runs a model: the backend flags (`--backend`, `--adapter`,
//! `--threads`) and the weight storage flags (GGUF Q8_0, Q4_1, Q5_0, Q4_K and Q6_K blocks kept as
//! blocks by default on wgpu and on the CPU, `--dequantize` loads them as f32 instead; other
//! weights f32 or, with `--precision f16` on wgpu, f16 (see `kiln_compiler::lower::format`),
//! multiplied in f16 with `--precision f16-math`; the interpreter always runs on the f32 weights),
//! resolved into a runtime [`Device`] opened once, and the optimizer's target on it.

use crate::progress::Reporter;
use anyhow::{Result, bail};
use clap::ValueEnum;
use kiln_compiler::FrontEnd;
use kiln_compiler::graph::Graph;
use kiln_compiler::target::Target;
use kiln_runtime::device::Reading;
use kiln_runtime::{Device, Storage};
use std::collections::HashMap;
use std::path::Path;

/// Where and how a model runs (`run`, `generate`, `embed`).
#[derive(clap::Args)]
pub struct Exec {
    /// Execution backend (default: a GPU adapter when the machine has one, else the native CPU
    /// kernels; lavapipe's software Vulkan only when asked for with `wgpu`).
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// GPU adapter to use: part of its name, or discrete / integrated / cpu (default: the
    /// `KILN_ADAPTER` environment variable, else the best adapter found). Implies `--backend wgpu`
    /// when no backend is named.
    #[arg(long)]
    pub adapter: Option<String>,
    /// Threads of the CPU backend (default: one per core available).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Run the graph as built, without the e-graph optimizer.
    #[arg(long)]
    pub no_optimize: bool,
    /// Print the spec that runs (a checkpoint's imported spec) on stderr first.
    #[arg(long)]
    pub print_spec: bool,
    #[command(flatten)]
    pub weights: WeightArgs,
}

/// `--backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The fastest present: a hardware GPU adapter when there is one, else `cpu`.
    Auto,
    /// Native kernels on the host's cores (multithreaded; quantized weights kept as blocks).
    Cpu,
    /// Generated WGSL kernels on a GPU adapter through wgpu (lavapipe on machines without a GPU).
    Wgpu,
    /// The CPU reference interpreter.
    Interp,
}

impl Backend {
    /// The backend `self` stands for: `auto` resolved (to `wgpu` when an adapter is named, with
    /// `--adapter` or `KILN_ADAPTER`, or a hardware GPU is present; else `cpu`), said on stderr
    /// through `reporter` unless `json` output keeps stderr clean.
    pub fn resolve(self, adapter: Option<&str>, threads: usize, reporter: &Reporter, json: bool) -> Backend {
        if self != Backend::Auto {
            return self;
        }
        let named =
            adapter.map(str::to_string).or_else(|| std::env::var("KILN_ADAPTER").ok()).filter(|a| !a.is_empty());
        let (backend, why) = match (named, kiln_runtime::Gpu::hardware_adapter()) {
            (Some(a), _) => (Backend::Wgpu, format!("adapter `{a}` asked for")),
            (None, Some(gpu)) => (Backend::Wgpu, format!("GPU `{gpu}`")),
            (None, None) => (Backend::Cpu, format!("no GPU adapter; {threads} threads")),
        };
        if !json {
            reporter.info(format_args!("backend: {} ({why})", backend.name()));
        }
        backend
    }

    /// The flag's value, as written.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Cpu => "cpu",
            Backend::Wgpu => "wgpu",
            Backend::Interp => "interp",
        }
    }
}

/// The device of a resolved backend: `wgpu` opens the adapter `adapter` selects; `cpu` runs on
/// `threads`.
pub fn open(backend: Backend, adapter: Option<&str>, threads: usize) -> Result<Device> {
    Ok(match backend {
        Backend::Wgpu => Device::gpu(adapter)?,
        Backend::Interp => Device::Interp,
        Backend::Cpu | Backend::Auto => Device::Cpu { threads },
    })
}

/// The device a training (or loss) graph runs on: the CPU kernels (for `auto` too), the
/// interpreter, or wgpu's kernels on the adapter `KILN_ADAPTER` names, else the best one found.
pub fn training_device(backend: Backend, threads: Option<usize>) -> Result<Device> {
    let backend = match backend {
        Backend::Auto | Backend::Cpu => Backend::Cpu,
        other => other,
    };
    open(backend, None, threads_or_default(threads)?)
}

/// What the optimizer compiles for on `device` (see [`Device::cached_target`]); a hardware adapter
/// without a cached cost model is calibrated now, at its first use, and its model cached.
pub fn optimizer_target(device: &Device, reporter: &Reporter) -> Result<Target> {
    if let Some(target) = device.cached_target()? {
        return Ok(target);
    }
    let started = std::time::Instant::now();
    let (constants, saved) = reporter.stage("calibrating the cost model", || device.calibrate(3))?;
    let name = match device {
        Device::Gpu(gpu) => gpu.adapter_name(),
        Device::Interp | Device::Cpu { .. } => device.name(),
    };
    reporter.info(format_args!(
        "cost model: `{name}` calibrated at its first use ({:.1} s; cached in {})",
        started.elapsed().as_secs_f64(),
        saved.map_or_else(String::new, |path| path.display().to_string())
    ));
    Ok(kiln_runtime::costs::wgpu_with(constants.cost_model()))
}

/// The parameters of `graph`: from the checkpoint at `weights` (with the blocks of quantized ones,
/// unless `storage.dequantize`), or random (seeded) without one.
pub fn params_for(
    fe: &FrontEnd,
    graph: &Graph,
    weights: Option<&Path>,
    storage: Storage,
) -> Result<kiln_runtime::weights::ParamsAndBlocks> {
    Ok(match weights {
        None => (kiln_compiler::interp::random_params(graph, 1)?, HashMap::new()),
        Some(path) => {
            let ckpt = kiln_runtime::Checkpoint::open(path)?;
            Reading::of(&fe.spec, &ckpt).params_and_blocks(graph, storage, &())?
        }
    })
}

impl Exec {
    /// Threads of the CPU backend.
    pub fn threads(&self) -> Result<usize> {
        threads_or_default(self.threads)
    }

    /// The device of `backend` (resolved) with these flags.
    pub fn device(&self, backend: Backend) -> Result<Device> {
        open(backend, self.adapter.as_deref(), self.threads()?)
    }
}

/// `--threads`, checked, or one per available core.
pub fn threads_or_default(threads: Option<usize>) -> Result<usize> {
    match threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) if n > 1024 => bail!("--threads {n} is more than 1024"),
        Some(n) => Ok(n),
        None => Ok(kiln_runtime::cpu::default_threads()),
    }
}

/// Weight storage flags (wgpu only).
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct WeightArgs {
    /// Precision of projection weights that are not kept as quantized blocks: f16 halves their
    /// bytes (arithmetic stays f32), f16-math also multiplies them in f16 (see `--help`). Both need
    /// an adapter with SHADER_F16. wgpu only.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Load quantized GGUF weights (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K) as f32 instead of keeping their
    /// blocks on the device (which
    /// projection kernels dequantize in registers).
    #[arg(long)]
    pub dequantize: bool,
    /// CPU backend: quantize the activations of quantized projections to 8 bits per block of 32
    /// and use integer dot products, as llama.cpp does (faster; logits move by about 1%, which
    /// can flip a greedy choice between two close tokens).
    #[arg(long)]
    pub int8_activations: bool,
}

/// Refuses the flags about quantized blocks (`--dequantize`, `--int8-activations`) for weights
/// that hold none (`what`: a safetensors file, random weights), where they would do nothing.
pub fn check_blocks(args: WeightArgs, what: &str) -> Result<()> {
    if args.dequantize {
        bail!("--dequantize has no effect: {what} holds no quantized blocks (only GGUF files do)");
    }
    if args.int8_activations {
        bail!("--int8-activations has no effect: {what} holds no quantized projections (only GGUF files do)");
    }
    Ok(())
}

/// `--precision`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// 32-bit floats.
    #[default]
    F32,
    /// 16-bit floats.
    F16,
    /// 16-bit floats, multiplied in f16: activations rounded to f16, the products of each 4
    /// elements of a row summed in f16, accumulated in f32 (logits move by about 1e-3 of their
    /// range; an activation beyond 65504 overflows).
    #[value(name = "f16-math")]
    F16Math,
}

impl WeightArgs {
    /// How the device stores the weights.
    pub fn storage(self) -> Storage {
        let precision = match self.precision {
            Precision::F32 => kiln_runtime::device::Precision::F32,
            Precision::F16 => kiln_runtime::device::Precision::F16,
            Precision::F16Math => kiln_runtime::device::Precision::F16Math,
        };
        Storage { precision, dequantize: self.dequantize, int8_activations: self.int8_activations }
    }
}

/// Refuses the execution flags that would have no effect on `backend` (resolved), naming why.
pub fn check_exec(exec: &Exec, backend: Backend) -> Result<()> {
    let on = backend.name();
    if exec.threads.is_some() && backend != Backend::Cpu {
        bail!(
            "--threads sets the CPU backend's threads, but this runs on `{on}`: add --backend cpu, or drop --threads"
        );
    }
    if exec.adapter.is_some() && backend != Backend::Wgpu {
        bail!("--adapter picks wgpu's GPU adapter, but this runs on `{on}`: drop --adapter or --backend");
    }
    if backend == Backend::Interp {
        let w = exec.weights;
        if w.precision != Precision::F32 {
            bail!(
                "--precision {} stores weights for wgpu; the interpreter computes with f32 weights",
                w.storage().precision.name()
            );
        }
        if w.dequantize {
            bail!("--dequantize has no effect on the interpreter, which always reads weights as f32");
        }
        if w.int8_activations {
            bail!("--int8-activations is the CPU backend's; the interpreter computes in f32");
        }
    }
    Ok(())
}
