//! How `kiln` stores projection weights and loads a compiled model on its backend: GGUF Q8_0,
//! Q4_1, Q5_0, Q4_K and Q6_K blocks kept as blocks by default on wgpu and on the CPU (`--dequantize` loads them as f32
//! instead), other weights f32 or, with `--precision f16` on wgpu, f16 (see
//! `kiln_compiler::lower::format`), multiplied in f16 with `--precision f16-math`. The interpreter
//! always runs on the f32 weights.

use crate::progress::Reporter;
use anyhow::{Result, bail};
use kiln_compiler::graph::Graph;
use kiln_compiler::lower::{self, WeightFormat};
use kiln_compiler::spec::{PackDims, Resolved};
use kiln_compiler::tensor::Tensor;
use kiln_runtime::{Checkpoint, CpuModel, Gpu, GpuModel, Model, QuantWeight, weights};
use std::collections::HashMap;
use std::sync::Arc;

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

impl Precision {
    /// Whether projection weights are stored as f16.
    pub fn f16(self) -> bool {
        self != Precision::F32
    }

    /// The flag's value, as written.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::F16Math => "f16-math",
        }
    }
}

/// The f32 parameters of `graph` and, unless `--dequantize`, the blocks of those a GGUF
/// checkpoint stores in a block format kept quantized; the reading is shown on `reporter`.
pub fn load(
    spec: &Resolved,
    graph: &Graph,
    ckpt: &Checkpoint,
    args: WeightArgs,
    reporter: &Reporter,
) -> Result<kiln_runtime::weights::ParamsAndBlocks> {
    let names = kiln_runtime::weights::graph_params(graph);
    let dims = PackDims::of(spec);
    let params = weights::load_named_with_progress(&spec.weights, &dims, &names, ckpt, reporter)?;
    let blocks = match args.dequantize {
        true => HashMap::new(),
        false => weights::quantized_named_with_progress(&spec.weights, &dims, &names, ckpt, reporter)?,
    };
    Ok((params, blocks))
}

/// Lowers `graph` with the weights stored as `args` and `blocks` say, and loads it on `gpu`,
/// shown on `reporter`.
pub fn gpu_model(
    gpu: &Arc<Gpu>,
    graph: &Graph,
    params: &HashMap<String, Tensor>,
    blocks: &HashMap<String, QuantWeight>,
    args: WeightArgs,
    reporter: &Reporter,
) -> Result<GpuModel> {
    let f16 = args.precision.f16();
    if f16 && !gpu.supports_f16() {
        bail!(
            "--precision {} needs an adapter with the SHADER_F16 feature; {} has none",
            args.precision.name(),
            gpu.describe()
        );
    }
    let formats = blocks.iter().map(|(name, q)| (name.clone(), q.format)).collect();
    let options = lower::Options { formats, ..lower::Options::default() };
    let plan = reporter.stage("lowering", || lower::lower_with(graph, options));
    let f16_math = args.precision == Precision::F16Math;
    let wgsl = kiln_compiler::back::wgsl::Options { f16_weights: f16, f16_math, ..gpu.options() };
    Ok(GpuModel::with_progress(gpu.clone(), &plan, &wgsl, params, blocks, reporter)?)
}

/// Where a compiled model runs: a wgpu device, or the CPU's native kernels on a number of threads.
pub enum Target {
    /// A wgpu device.
    Gpu(Arc<Gpu>),
    /// The native CPU backend.
    Cpu {
        /// Threads.
        threads: usize,
    },
}

impl Target {
    /// The target of a resolved backend (`wgpu` opens the adapter).
    pub fn new(backend: crate::Backend, adapter: Option<&str>, threads: usize) -> Result<Target> {
        Ok(match backend {
            crate::Backend::Wgpu => Target::Gpu(Arc::new(Gpu::new(adapter)?)),
            _ => Target::Cpu { threads },
        })
    }

    /// What the target is, for reports: the adapter, or the CPU's threads and dot-product kernels.
    pub fn describe(&self) -> String {
        match self {
            Target::Gpu(gpu) => gpu.describe(),
            Target::Cpu { threads } => {
                format!("cpu ({threads} threads, {} quantized dot products)", kiln_runtime::cpu::qdot::kernel_name())
            }
        }
    }

    /// What the optimizer compiles for here: the backend's cost model and kernel limits.
    /// A GPU's is its adapter's cached cost model (see `costs`), else the built-in one.
    pub fn optimizer(&self) -> kiln_compiler::target::Target {
        match self {
            Target::Gpu(gpu) => {
                crate::costs::target_of(gpu.adapter_name()).unwrap_or_else(|_| kiln_compiler::target::Target::wgpu())
            }
            Target::Cpu { .. } => kiln_compiler::target::Target::cpu(),
        }
    }

    /// The backend's name (`wgpu`, `cpu`).
    pub fn backend(&self) -> &'static str {
        match self {
            Target::Gpu(_) => "wgpu",
            Target::Cpu { .. } => "cpu",
        }
    }

    /// Reads `graph`'s weights from `ckpt` as `args` say and loads the model, shown on `reporter`:
    /// the blocks of quantized GGUF tensors (unless `--dequantize`), and as f32 only the
    /// parameters the backend reads in f32 — on the CPU, a quantized weight (an embedding table
    /// included) is never expanded, and each weight is moved into the model, so it is in memory
    /// once.
    pub fn load(
        &self,
        spec: &Resolved,
        graph: &Graph,
        ckpt: &Checkpoint,
        args: WeightArgs,
        reporter: &Reporter,
    ) -> Result<Model> {
        let Target::Cpu { threads } = self else {
            let (params, blocks) = load(spec, graph, ckpt, args, reporter)?;
            return self.model(graph, &params, &blocks, args, reporter);
        };
        if args.precision.f16() {
            bail!(
                "--precision {} stores weights for wgpu; the CPU backend keeps f32 or quantized blocks",
                args.precision.name()
            );
        }
        let names = weights::graph_params(graph);
        let dims = PackDims::of(spec);
        let blocks = match args.dequantize {
            true => HashMap::new(),
            false => weights::quantized_named_with_progress(&spec.weights, &dims, &names, ckpt, reporter)?,
        };
        let formats = blocks.iter().map(|(name, q)| (name.clone(), q.format)).collect();
        let plan =
            reporter.stage("lowering", || lower::lower_with(graph, lower::Options { formats, ..Default::default() }));
        let quantized: std::collections::HashSet<String> = blocks.keys().cloned().collect();
        let wanted: std::collections::HashSet<String> = CpuModel::f32_params(&plan, &quantized).into_iter().collect();
        let f32_names: Vec<(String, Vec<usize>)> = names.into_iter().filter(|(n, _)| wanted.contains(n)).collect();
        let params = weights::load_named_with_progress(&spec.weights, &dims, &f32_names, ckpt, reporter)?;
        let model = CpuModel::from_owned(plan, params, blocks, *threads, reporter)?;
        Ok(Model::Cpu(Box::new(model.with_int8_activations(args.int8_activations))))
    }

    /// Lowers `graph` with the weights stored as `args` and `blocks` say and loads it, shown on
    /// `reporter`.
    pub fn model(
        &self,
        graph: &Graph,
        params: &HashMap<String, Tensor>,
        blocks: &HashMap<String, QuantWeight>,
        args: WeightArgs,
        reporter: &Reporter,
    ) -> Result<Model> {
        Ok(match self {
            Target::Gpu(gpu) => {
                if args.int8_activations {
                    bail!("--int8-activations is the CPU backend's (wgpu dequantizes blocks in registers, exactly)");
                }
                Model::Gpu(Box::new(gpu_model(gpu, graph, params, blocks, args, reporter)?))
            }
            Target::Cpu { threads } => {
                if args.precision.f16() {
                    bail!(
                        "--precision {} stores weights for wgpu; the CPU backend keeps f32 or quantized blocks",
                        args.precision.name()
                    );
                }
                let formats = blocks.iter().map(|(name, q)| (name.clone(), q.format)).collect();
                let options = lower::Options { formats, ..lower::Options::default() };
                let plan = reporter.stage("lowering", || lower::lower_with(graph, options));
                let model = CpuModel::new(plan, params, blocks, *threads, reporter)?;
                Model::Cpu(Box::new(model.with_int8_activations(args.int8_activations)))
            }
        })
    }
}

/// `12.3 MiB (Q4_1 9.0 MiB, f32 3.3 MiB)`: the weight bytes where the backend keeps them, by
/// format.
pub fn describe(model: &Model) -> String {
    let human = kiln_compiler::memory::human;
    let parts: Vec<String> = model.weight_bytes().iter().map(|(f, b)| format!("{f} {}", human(*b))).collect();
    let total: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
    format!("{} ({})", human(total), parts.join(", "))
}

/// The bytes of the weights by format, as JSON (`{"Q4_1": 123, ...}`).
pub fn json(model: &Model) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> =
        model.weight_bytes().iter().map(|(f, b)| (f.name().to_string(), (*b).into())).collect();
    map.into()
}

/// The formats a benchmark compares: f32, f16 where the adapter has it, Q8_0, Q4_1.
pub fn formats(target: &Target) -> Vec<WeightFormat> {
    let mut v = vec![WeightFormat::F32];
    if let Target::Gpu(gpu) = target
        && gpu.supports_f16()
    {
        v.push(WeightFormat::F16);
    }
    v.extend([WeightFormat::Q8_0, WeightFormat::Q4_1]);
    v
}
