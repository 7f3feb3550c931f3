//! [`Device`]: where a model runs — the reference interpreter, the native CPU kernels on a number
//! of threads, or a wgpu adapter, opened once — and the one entrance from the compiler's output to
//! a model that runs. A device gives the optimizer its target ([`Device::cached_target`], and
//! [`Device::calibrate`] for an adapter without a cached cost model), lowers a graph with the
//! storage formats of its weights and loads it with weights read from a checkpoint or given
//! ([`Device::load`], [`Device::model`]), or loads an artifact's plan ([`Device::load_plan`]).
//! Every command of the `kiln` CLI goes through here, and so will anything else that runs models.

use crate::progress::Progress;
use crate::weights::{self, Checkpoint, WeightError};
use crate::{CpuError, CpuModel, Engine, Gpu, GpuError, GpuModel, InterpEngine, Model, ModelError, QuantWeight};
use kiln_compiler::graph::Graph;
use kiln_compiler::interp::{self, InterpError};
use kiln_compiler::lower::{self, Plan};
use kiln_compiler::spec::{PackDims, Resolved, WeightMap};
use kiln_compiler::target::Target;
use kiln_compiler::tensor::Tensor;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Where a model runs.
pub enum Device {
    /// The CPU reference interpreter: runs graphs, each op by its definition.
    Interp,
    /// The native CPU kernels.
    Cpu {
        /// Threads.
        threads: usize,
    },
    /// Generated WGSL kernels on an opened wgpu device.
    Gpu(Arc<Gpu>),
}

/// The precision of projection weights that are not kept as quantized blocks (wgpu only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// 32-bit floats, or 16-bit where `kiln tune` chose them for the model on the adapter (within
    /// its tolerance and no greedy token changed; see [`crate::tune`]).
    #[default]
    Auto,
    /// 32-bit floats.
    F32,
    /// 16-bit floats; arithmetic stays f32.
    F16,
    /// 16-bit floats, multiplied in f16 (see [`kiln_compiler::back::wgsl::Options::f16_math`]).
    F16Math,
}

impl Precision {
    /// Whether projection weights are stored as f16.
    pub fn f16(self) -> bool {
        matches!(self, Precision::F16 | Precision::F16Math)
    }

    /// The precision's name, as the command line writes it (`f32`, `f16`, `f16-math`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Auto => "auto",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::F16Math => "f16-math",
        }
    }
}

/// How a device stores a model's weights.
#[derive(Clone, Copy, Debug, Default)]
pub struct Storage {
    /// Precision of the f32 projection weights (wgpu only).
    pub precision: Precision,
    /// Load quantized GGUF weights as f32 instead of keeping their blocks.
    pub dequantize: bool,
    /// CPU only: quantize the activations of quantized projections to 8 bits per block of 32 and
    /// use integer dot products (see [`CpuModel::with_int8_activations`]).
    pub int8_activations: bool,
}

/// A checkpoint read through a weight map.
#[derive(Clone, Copy)]
pub struct Reading<'a> {
    /// The checkpoint.
    pub ckpt: &'a Checkpoint,
    /// The weight map: parameter names to the checkpoint's tensors.
    pub map: &'a WeightMap,
    /// The sizes the map needs to cut packed tensors apart.
    pub dims: PackDims,
}

impl<'a> Reading<'a> {
    /// `ckpt` read through `spec`'s weight map.
    pub fn of(spec: &'a Resolved, ckpt: &'a Checkpoint) -> Reading<'a> {
        Reading { ckpt, map: &spec.weights, dims: PackDims::of(spec) }
    }

    /// The named parameters as f32.
    fn f32(
        &self,
        names: &[(String, Vec<usize>)],
        progress: &dyn Progress,
    ) -> Result<HashMap<String, Tensor>, LoadError> {
        Ok(weights::load_named_with_progress(self.map, &self.dims, names, self.ckpt, progress)?)
    }

    /// The blocks of the named parameters the checkpoint stores in a block format kept quantized,
    /// unless `storage` asks to dequantize.
    fn blocks(
        &self,
        names: &[(String, Vec<usize>)],
        storage: Storage,
        progress: &dyn Progress,
    ) -> Result<HashMap<String, QuantWeight>, LoadError> {
        Ok(match storage.dequantize {
            true => HashMap::new(),
            false => weights::quantized_named_with_progress(self.map, &self.dims, names, self.ckpt, progress)?,
        })
    }

    /// The f32 parameters of `graph` and, unless `storage.dequantize`, the blocks of those the
    /// checkpoint stores in a block format kept quantized.
    pub fn params_and_blocks(
        &self,
        graph: &Graph,
        storage: Storage,
        progress: &dyn Progress,
    ) -> Result<weights::ParamsAndBlocks, LoadError> {
        let names = weights::graph_params(graph);
        Ok((self.f32(&names, progress)?, self.blocks(&names, storage, progress)?))
    }
}

/// Where a model's weights come from.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    /// Read from a checkpoint as the model needs them.
    Checkpoint(Reading<'a>),
    /// Given: f32 parameters, and the blocks of those kept quantized.
    Given {
        /// The f32 parameters.
        params: &'a HashMap<String, Tensor>,
        /// The quantized blocks, by parameter.
        blocks: &'a HashMap<String, QuantWeight>,
    },
}

/// What can go wrong loading a model on a device.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Reading the weights.
    #[error(transparent)]
    Weights(#[from] WeightError),
    /// Building the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// f16 weights on an adapter without `SHADER_F16`.
    #[error("--precision {precision} needs an adapter with the SHADER_F16 feature; {adapter} has none")]
    NoF16 {
        /// The precision asked for.
        precision: &'static str,
        /// The adapter.
        adapter: String,
    },
    /// f16 weights on the CPU.
    #[error("--precision {0} stores weights for wgpu; the CPU backend keeps f32 or quantized blocks")]
    F16OnCpu(&'static str),
    /// Int8 activations on wgpu.
    #[error("--int8-activations is the CPU backend's (wgpu dequantizes blocks in registers, exactly)")]
    Int8OnGpu,
    /// A plan asked of the interpreter, which runs graphs.
    #[error("the interpreter runs graphs, not compiled plans")]
    NotCompiled,
    /// The adapter's cached tuning could not be read.
    #[error(transparent)]
    Tuning(Box<crate::tune::TuneError>),
}

impl From<crate::tune::TuneError> for LoadError {
    fn from(e: crate::tune::TuneError) -> Self {
        LoadError::Tuning(Box::new(e))
    }
}

impl From<GpuError> for LoadError {
    fn from(e: GpuError) -> Self {
        LoadError::Model(e.into())
    }
}

impl From<CpuError> for LoadError {
    fn from(e: CpuError) -> Self {
        LoadError::Model(e.into())
    }
}

/// What can go wrong running a [`Loaded`] model.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// In the interpreter.
    #[error("run failed")]
    Interp(#[source] InterpError),
    /// In a compiled model.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// A graph loaded on a device: as a compiled [`Model`], or with its parameters for the
/// interpreter.
pub enum Loaded {
    /// The graph and its parameters, run by the interpreter.
    Interp {
        /// The graph.
        graph: Graph,
        /// Its parameters.
        params: HashMap<String, Tensor>,
    },
    /// A compiled model.
    Model(Model),
}

impl Loaded {
    /// Runs one forward pass on named inputs; returns the named outputs.
    pub fn run(&self, given: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>, RunError> {
        match self {
            Loaded::Interp { graph, params } => interp::run(graph, params, given).map_err(RunError::Interp),
            Loaded::Model(model) => Ok(model.run(given)?),
        }
    }

    /// The engine that runs the graph in a generation session.
    pub fn into_engine(self) -> Box<dyn Engine> {
        match self {
            Loaded::Interp { graph, params } => Box::new(InterpEngine::new(graph, params)),
            Loaded::Model(model) => model.into(),
        }
    }
}

impl Device {
    /// Opens the wgpu adapter `choice` selects (see [`Gpu::new`]).
    pub fn gpu(choice: Option<&str>) -> Result<Device, GpuError> {
        Ok(Device::Gpu(Arc::new(Gpu::new(choice)?)))
    }

    /// The back end's name (`interp`, `cpu`, `wgpu`).
    pub fn name(&self) -> &'static str {
        match self {
            Device::Interp => "interp",
            Device::Cpu { .. } => "cpu",
            Device::Gpu(_) => "wgpu",
        }
    }

    /// What the device is, for reports: the adapter, or the CPU's threads and dot-product kernels.
    pub fn describe(&self) -> String {
        match self {
            Device::Interp => "the reference interpreter".to_string(),
            Device::Cpu { threads } => {
                format!("cpu ({threads} threads, {} quantized dot products)", crate::cpu::qdot::kernel_name())
            }
            Device::Gpu(gpu) => gpu.describe(),
        }
    }

    /// What the optimizer compiles for here, from what is known without measuring: the CPU's cost
    /// model and kernel limits; for wgpu, the adapter's cached cost model (see [`crate::costs`]),
    /// or the built-in one on a software adapter; the interpreter runs any graph and gets wgpu's
    /// built-in target, as artifacts do. `None` for a hardware adapter with no cached model: it
    /// wants [`Device::calibrate`] first.
    pub fn cached_target(&self) -> Result<Option<Target>, crate::costs::CostError> {
        Ok(match self {
            Device::Interp => Some(Target::wgpu()),
            Device::Cpu { .. } => Some(Target::cpu()),
            Device::Gpu(gpu) => crate::costs::cached(gpu.adapter_name(), gpu.is_software())?,
        })
    }

    /// Measures the cost model's constants here (medians of `runs`, see [`crate::measure`]) and,
    /// on a GPU adapter, caches them as its cost model; returns them and the file they were saved
    /// to.
    pub fn calibrate(
        &self,
        runs: usize,
    ) -> Result<(crate::measure::Constants, Option<std::path::PathBuf>), crate::measure::MeasureError> {
        let constants = crate::measure::constants(self, runs)?;
        let saved = match self {
            Device::Gpu(gpu) => Some(crate::costs::save(gpu.adapter_name(), &constants.cost_model())?),
            Device::Interp | Device::Cpu { .. } => None,
        };
        Ok((constants, saved))
    }

    /// Lowers `graph` and loads it with `weights` stored as `storage` says, the loading shown on
    /// `progress`; on the interpreter, the graph with its f32 parameters.
    pub fn load(
        &self,
        graph: &Graph,
        weights: Weights,
        storage: Storage,
        progress: &dyn Progress,
    ) -> Result<Loaded, LoadError> {
        let Device::Interp = self else { return Ok(Loaded::Model(self.model(graph, weights, storage, progress)?)) };
        let params = match weights {
            Weights::Checkpoint(reading) => reading.f32(&weights::graph_params(graph), progress)?,
            Weights::Given { params, .. } => params.clone(),
        };
        Ok(Loaded::Interp { graph: graph.clone(), params })
    }

    /// Lowers `graph` with the weights stored as `storage` says and loads it on a compiled back
    /// end, the loading shown on `progress`. From a checkpoint: the blocks of quantized GGUF
    /// tensors (unless `storage.dequantize`), and as f32 only the parameters the back end reads
    /// in f32 — on the CPU, a quantized weight (an embedding table included) is never expanded,
    /// and each weight is moved into the model, so it is in memory once.
    pub fn model(
        &self,
        graph: &Graph,
        weights: Weights,
        storage: Storage,
        progress: &dyn Progress,
    ) -> Result<Model, LoadError> {
        match (self, weights) {
            (Device::Interp, _) => Err(LoadError::NotCompiled),
            (Device::Gpu(gpu), Weights::Checkpoint(reading)) => {
                let (params, blocks) = reading.params_and_blocks(graph, storage, progress)?;
                gpu_model(gpu, graph, &params, &blocks, storage, progress)
            }
            (Device::Gpu(gpu), Weights::Given { params, blocks }) => {
                gpu_model(gpu, graph, params, blocks, storage, progress)
            }
            (Device::Cpu { threads }, Weights::Checkpoint(reading)) => {
                refuse_f16(storage)?;
                let names = weights::graph_params(graph);
                let blocks = reading.blocks(&names, storage, progress)?;
                let plan = lower_with_blocks(graph, &blocks);
                let quantized: HashSet<String> = blocks.keys().cloned().collect();
                let wanted: HashSet<String> = CpuModel::f32_params(&plan, &quantized).into_iter().collect();
                let f32_names: Vec<(String, Vec<usize>)> =
                    names.into_iter().filter(|(n, _)| wanted.contains(n)).collect();
                let params = reading.f32(&f32_names, progress)?;
                let model = CpuModel::from_owned(plan, params, blocks, *threads, progress)?;
                Ok(Model::Cpu(Box::new(model.with_int8_activations(storage.int8_activations))))
            }
            (Device::Cpu { threads }, Weights::Given { params, blocks }) => {
                refuse_f16(storage)?;
                let plan = lower_with_blocks(graph, blocks);
                let model = CpuModel::new(plan, params, blocks, *threads, progress)?;
                Ok(Model::Cpu(Box::new(model.with_int8_activations(storage.int8_activations))))
            }
        }
    }

    /// Loads a compiled plan (an artifact's, or one lowered by the caller) with `weights`,
    /// projection weights stored at `storage.precision` on wgpu, quantized projections multiplied
    /// with int8 activations on the CPU where `storage.int8_activations` asks (refused on wgpu,
    /// as [`Device::load`] refuses it); on the interpreter, each step by the interpreter's
    /// definition ([`CpuModel::reference`]).
    pub fn load_plan(
        &self,
        plan: Plan,
        weights: Weights,
        storage: Storage,
        progress: &dyn Progress,
    ) -> Result<Model, LoadError> {
        let (params, blocks) = match weights {
            Weights::Checkpoint(reading) => (reading.f32(&plan_params(&plan), progress)?, HashMap::new()),
            Weights::Given { params, blocks } => (params.clone(), blocks.clone()),
        };
        Ok(match self {
            Device::Interp => Model::Cpu(Box::new(CpuModel::reference(plan, params, progress)?)),
            Device::Cpu { threads } => {
                let model = CpuModel::from_owned(plan, params, blocks, *threads, progress)?;
                Model::Cpu(Box::new(model.with_int8_activations(storage.int8_activations)))
            }
            Device::Gpu(_) if storage.int8_activations => return Err(LoadError::Int8OnGpu),
            Device::Gpu(gpu) => {
                let auto = storage.precision == Precision::Auto;
                let wgsl = crate::tune::options_for(gpu, &plan, wgsl_options(gpu, storage)?, auto)?;
                Model::Gpu(Box::new(GpuModel::with_progress(gpu.clone(), &plan, &wgsl, &params, &blocks, progress)?))
            }
        })
    }
}

/// Refuses f16 weights on the CPU.
fn refuse_f16(storage: Storage) -> Result<(), LoadError> {
    match storage.precision.f16() {
        true => Err(LoadError::F16OnCpu(storage.precision.name())),
        false => Ok(()),
    }
}

/// The WGSL back end's options on `gpu` for weights stored as `storage` says.
fn wgsl_options(gpu: &Gpu, storage: Storage) -> Result<kiln_compiler::back::wgsl::Options, LoadError> {
    let f16 = storage.precision.f16();
    if f16 && !gpu.supports_f16() {
        return Err(LoadError::NoF16 { precision: storage.precision.name(), adapter: gpu.describe() });
    }
    let f16_math = storage.precision == Precision::F16Math;
    Ok(kiln_compiler::back::wgsl::Options { f16_weights: f16, f16_math, ..gpu.options() })
}

/// Lowers `graph` with the weights stored as `storage` and `blocks` say, and loads it on `gpu`.
fn gpu_model(
    gpu: &Arc<Gpu>,
    graph: &Graph,
    params: &HashMap<String, Tensor>,
    blocks: &HashMap<String, QuantWeight>,
    storage: Storage,
    progress: &dyn Progress,
) -> Result<Model, LoadError> {
    if storage.int8_activations {
        return Err(LoadError::Int8OnGpu);
    }
    let plan = lower_with_blocks(graph, blocks);
    // The forms `kiln tune` chose for this model's shapes on this adapter, tuned now if this is
    // a hardware adapter's first use of a decoder step of these shapes.
    crate::tune::at_first_use(gpu, graph, &plan, params, blocks, progress)?;
    let auto = storage.precision == Precision::Auto;
    let wgsl = crate::tune::options_for(gpu, &plan, wgsl_options(gpu, storage)?, auto)?;
    Ok(Model::Gpu(Box::new(GpuModel::with_progress(gpu.clone(), &plan, &wgsl, params, blocks, progress)?)))
}

/// `graph` lowered with the projections whose weights are `blocks` reading them as blocks.
pub(crate) fn lower_with_blocks(graph: &Graph, blocks: &HashMap<String, QuantWeight>) -> Plan {
    let formats = blocks.iter().map(|(name, q)| (name.clone(), q.format)).collect();
    lower::lower_with(graph, lower::Options { formats, ..lower::Options::default() })
}

/// The parameters a plan needs, with their shapes.
fn plan_params(plan: &Plan) -> Vec<(String, Vec<usize>)> {
    plan.values
        .iter()
        .filter_map(|v| match &v.storage {
            lower::Storage::Param(name) => Some((name.clone(), lower::resolve(&v.shape, &HashMap::new()))),
            _ => None,
        })
        .collect()
}
