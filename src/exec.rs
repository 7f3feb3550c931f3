//! Where and how a command runs a model: the backend flags (`--backend`, `--adapter`,
//! `--threads`) and the weight storage flags (GGUF Q8_0, Q4_1, Q5_0, Q4_K and Q6_K blocks kept as
//! blocks by default on wgpu and on the CPU, `--dequantize` loads them as f32 instead; other
//! weights f32 or, with `--precision f16` on wgpu, f16 (see `kiln_compiler::lower::format`),
//! multiplied in f16 with `--precision f16-math`; the interpreter always runs on the f32 weights),
//! resolved into a runtime [`Device`] opened once, and the optimizer's target on it.

use crate::progress::Reporter;
use crate::report::count;
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
    #[arg(long, value_parser = BackendParser, default_value = "auto")]
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

/// `--backend`'s parser: a [`Backend`] by name (as [`ValueEnum`] reads it), and for any other
/// name an error listing every backend, where clap's own would suggest the nearest name alone
/// (`cpu` for `cuda`).
#[derive(Clone, Copy, Debug)]
pub struct BackendParser;

impl clap::builder::TypedValueParser for BackendParser {
    type Value = Backend;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> std::result::Result<Backend, clap::Error> {
        let text = value.to_string_lossy();
        Backend::from_str(&text, false).map_err(|_| {
            let flag = arg.map_or_else(|| "--backend".to_string(), |a| format!("--{}", a.get_id()));
            let names: Vec<&str> = Backend::value_variants().iter().map(|b| b.name()).collect();
            clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!(
                    "`{text}` is not a backend of {flag}: kiln runs on {} (a GPU of any vendor, through \
                     `wgpu` on Vulkan)\n",
                    names.join(", ")
                ),
            )
            .with_cmd(cmd)
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(Backend::value_variants().iter().filter_map(ValueEnum::to_possible_value)))
    }
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
    /// On wgpu, the line says which adapter runs it, and when that is a software rasterizer
    /// (Mesa's lavapipe: Vulkan on the CPU, far slower than the `cpu` backend).
    pub fn resolve(self, adapter: Option<&str>, threads: usize, reporter: &Reporter, json: bool) -> Backend {
        let named =
            adapter.map(str::to_string).or_else(|| std::env::var("KILN_ADAPTER").ok()).filter(|a| !a.is_empty());
        let (backend, why) = match self {
            Backend::Auto => match (named, kiln_runtime::Gpu::hardware_adapter()) {
                (Some(a), _) => (Backend::Wgpu, format!("adapter `{a}` asked for")),
                (None, Some(_)) => (Backend::Wgpu, "a GPU found".to_string()),
                (None, None) => (Backend::Cpu, format!("no GPU adapter; {threads} threads")),
            },
            Backend::Wgpu => (Backend::Wgpu, "asked for".to_string()),
            other => return other,
        };
        if json {
            return backend;
        }
        let on = match backend {
            // The adapter `Device::gpu` will open; an error opening it is that call's to report.
            Backend::Wgpu => match kiln_runtime::Gpu::chosen_adapter(adapter) {
                Ok((name, false)) => format!(" on adapter `{name}`"),
                Ok((name, true)) => format!(
                    " on adapter `{name}`, a software rasterizer (lavapipe: Vulkan on the CPU, slower than \
                     --backend cpu)"
                ),
                Err(_) => String::new(),
            },
            _ => String::new(),
        };
        reporter.info(format_args!("backend: {}{on} ({why})", backend.name()));
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
        Backend::Cpu | Backend::Auto => {
            // The kernels read the cap themselves; a value they would ignore is refused here.
            kiln_runtime::cpu::isa::Cap::from_env().map_err(anyhow::Error::msg)?;
            Device::Cpu { threads }
        }
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

/// The most CPU threads per core available that `--threads` may ask for: more only queue behind
/// each other.
pub const THREADS_PER_CORE: usize = 4;

/// `--threads`, checked (1 to [`THREADS_PER_CORE`] per core available), or one per available core.
pub fn threads_or_default(threads: Option<usize>) -> Result<usize> {
    let cores = kiln_runtime::cpu::default_threads();
    match threads {
        Some(0) => bail!("--threads 0: the CPU backend needs at least 1 thread"),
        Some(n) if n > THREADS_PER_CORE * cores => bail!(
            "--threads {n} is more than {THREADS_PER_CORE} per core of the {} available: give at most {} \
             (the default is one per core)",
            count(cores, "core"),
            THREADS_PER_CORE * cores
        ),
        Some(n) => Ok(n),
        None => Ok(cores),
    }
}

/// Weight storage flags (wgpu only).
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct WeightArgs {
    /// Precision of projection weights that are not kept as quantized blocks: f16 halves their
    /// bytes (arithmetic stays f32), f16-math also multiplies them in f16 (see `--help`); both need
    /// an adapter with SHADER_F16. auto: f32, unless `kiln tune` chose f16 for this model on this
    /// adapter (within its tolerance, no greedy token changed). wgpu only.
    #[arg(long, value_enum, default_value_t = Precision::Auto)]
    pub precision: Precision,
    /// Load quantized GGUF weights (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K) as f32 instead of keeping their
    /// blocks on the device (which
    /// projection kernels dequantize in registers).
    #[arg(long)]
    pub dequantize: bool,
    /// CPU backend: quantize the activations of quantized projections to 8 bits per block of 32
    /// and use integer arithmetic, as llama.cpp does (faster: dot products when decoding, an
    /// integer GEMM for a prompt's rows; logits move by about 1%, which can flip a greedy choice
    /// between two close tokens). Q5_0 and K-quant projections take int8 activations in the
    /// integer GEMM only (a prompt's rows, on a CPU with AVX2 or Arm's dot products); elsewhere,
    /// decode steps included, they keep f32 activations, which run faster there.
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
    /// 32-bit floats, or 16-bit where `kiln tune` chose them for the model on this adapter.
    #[default]
    Auto,
    /// 32-bit floats, whatever a tuning chose.
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
            Precision::Auto => kiln_runtime::device::Precision::Auto,
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
        if w.storage().precision.f16() {
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
