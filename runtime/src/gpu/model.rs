//! [`GpuModel`]: a plan loaded on a device — legalized and compiled to WGSL, one pipeline per
//! unique kernel, the weights uploaded once — and what it keeps between runs.

#![expect(clippy::indexing_slicing, reason = "value indices come from a plan `Plan::check` bounded")]

use super::batch::BatchState;
use super::cache::{InPlace, in_place_sites};
use super::error::Wanted;
use super::legalize::f32_where_too_large;
use super::run::RunState;
use super::tensor::STORAGE;
use super::update::Tail;
use super::{Gpu, GpuError};
use crate::progress::{Counter, Phase, Progress};
use crate::quant::QuantWeight;
use kiln_compiler::back::wgsl::{self, Program};
use kiln_compiler::lower::{Plan, Storage, WeightFormat};
use kiln_compiler::tensor::Tensor;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A plan with its pipelines built and its weights on the device.
pub struct GpuModel {
    pub(super) gpu: Arc<Gpu>,
    /// The plan compiled for wgpu (its legalized plan is the one run).
    pub(super) program: Program,
    pub(super) pipelines: Vec<wgpu::ComputePipeline>,
    /// Pipelines of kernel variants, by kernel and variant, built when first needed.
    pub(super) variants: Mutex<HashMap<(usize, Variant), wgpu::ComputePipeline>>,
    pub(super) params: HashMap<usize, Vec<wgpu::Buffer>>,
    /// Bytes of the weights on the device (parameters and folded constants), by storage format.
    weight_bytes: Vec<(WeightFormat, u64)>,
    /// What one run leaves for the next.
    pub(super) state: Mutex<RunState>,
    /// The optimizer's steps at the end of a whole training step's plan, which a run records its
    /// own way after the others (see `super::update`).
    pub(super) tail: Option<Tail>,
    /// The steps that append to a session's cache in place, when it lives on the device.
    pub(super) in_place: Vec<InPlace>,
    /// The plan's inputs (`prepare::input_values`).
    pub(super) inputs: Vec<usize>,
    /// The host's time in runs, up to their submission.
    pub(super) host: HostClock,
    /// How [`GpuModel::run_batched`] runs the plan, or why it cannot; made at its first use.
    pub(super) batch: OnceLock<Result<crate::batching::BatchPlan, String>>,
    /// What one batched run leaves for the next.
    pub(super) batch_state: Mutex<BatchState>,
}

/// A variant of a step's kernel, built when a run first needs it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Variant {
    /// Reading its tensors split over buffers, this many chunks per binding.
    Chunked(Vec<u32>),
    /// A rotating projection reading each sequence's first position from a binding: a batched
    /// step's (see [`wgsl::step_kernel_at_starts`]).
    AtStarts,
}

/// The host's share of a model's runs: from a run's start to its one submission (binding the
/// inputs, growing buffers, encoding and recording every dispatch, a sampling kernel lent the
/// logits), summed, and the runs counted. What the device then takes, and reading the outputs
/// back, is not in it. Clones share the sums, so a caller can read them while a session runs.
#[derive(Clone, Debug, Default)]
pub struct HostClock(Arc<(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64)>);

impl HostClock {
    pub(super) fn add(&self, d: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.0.0.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
        self.0.1.fetch_add(1, Relaxed);
    }

    /// Seconds of host time so far, and the runs they were spent in.
    pub fn read(&self) -> (f64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.0.0.load(Relaxed) as f64 * 1e-9, self.0.1.load(Relaxed))
    }
}

impl GpuModel {
    /// Compiles the plan, builds the pipelines and uploads the parameters (by canonical name)
    /// once. Every weight the plan stores in a block-quantized format must be in `blocks` (see
    /// [`GpuModel::with_blocks`]).
    pub fn new(gpu: Arc<Gpu>, plan: Plan, params: &HashMap<String, Tensor>) -> Result<GpuModel, GpuError> {
        GpuModel::with_blocks(gpu, plan, params, &HashMap::new())
    }

    /// [`GpuModel::new`] with the blocks of the parameters the plan stores quantized
    /// ([`Value::format`](kiln_compiler::lower::Value::format) `Q8_0`, `Q4_1`, `Q5_0`, `Q4_K`, `Q6_K`), by name.
    pub fn with_blocks(
        gpu: Arc<Gpu>,
        plan: Plan,
        params: &HashMap<String, Tensor>,
        blocks: &HashMap<String, QuantWeight>,
    ) -> Result<GpuModel, GpuError> {
        let options = gpu.options();
        GpuModel::with_progress(gpu, &plan, &options, params, blocks, &())
    }

    /// [`GpuModel::with_blocks`] with the back end's `options` (f16 weights: converted from
    /// `params` at upload; the device must support f16, see [`Gpu::supports_f16`], and subgroups
    /// for subgroup reductions, see [`Gpu::options`]), reporting to
    /// `progress` as the pipelines are built ([`Phase::Pipelines`], the slow part on a CPU
    /// adapter), the load-time folds evaluated ([`Phase::Fold`]) and the weights uploaded
    /// ([`Phase::Upload`]).
    pub fn with_progress(
        gpu: Arc<Gpu>,
        plan: &Plan,
        options: &wgsl::Options,
        params: &HashMap<String, Tensor>,
        blocks: &HashMap<String, QuantWeight>,
        progress: &dyn Progress,
    ) -> Result<GpuModel, GpuError> {
        plan.check()?;
        let missing = [
            (Wanted::F16Weights, options.f16_weights && !gpu.supports_f16()),
            (Wanted::F16Math, options.f16_math && !gpu.supports_f16()),
            (Wanted::Subgroups, options.subgroups && !gpu.supports_subgroups()),
        ];
        if let Some(&(wanted, _)) = missing.iter().find(|(_, missing)| *missing) {
            return Err(GpuError::MissingFeature { wanted, adapter: gpu.info.name.clone() });
        }
        let (plan, params) = f32_where_too_large(&gpu, plan, options, params, blocks)?;
        let params = params.as_ref();
        let program = wgsl::compile(&plan, options)?;
        let plan = &program.plan;
        let mut counter = Counter::start(progress, Phase::Pipelines, program.kernels.len());
        let mut pipelines = Vec::with_capacity(program.kernels.len());
        for k in &program.kernels {
            pipelines.push(gpu.pipeline(&k.name, &k.wgsl));
            counter.advance();
        }
        let crate::prepare::Constants { host, quant } = crate::prepare::constants(plan, params, blocks, progress)?;
        let mut uploaded = HashMap::new();
        let mut weight_bytes: Vec<(WeightFormat, u64)> = Vec::new();
        let what = |id: usize| match &plan.values[id].storage {
            Storage::Param(name) => format!("parameter `{name}`"),
            _ => format!("folded constant {id}"),
        };
        let mut counter = Counter::start(progress, Phase::Upload, host.len() + quant.len());
        let mut upload = |id: usize, format: WeightFormat, bytes: &[u8]| -> Result<(), GpuError> {
            let buffers = gpu.chunked(&what(id), bytes.len() as u64, STORAGE)?;
            gpu.write_chunked(&buffers, bytes);
            uploaded.insert(id, buffers);
            match weight_bytes.iter_mut().find(|(f, _)| *f == format) {
                Some((_, b)) => *b += bytes.len() as u64,
                None => weight_bytes.push((format, bytes.len() as u64)),
            }
            counter.advance();
            Ok(())
        };
        for (id, t) in host {
            let format = plan.values[id].format;
            let data = t.as_f32().ok_or_else(|| GpuError::NotF32(what(id)))?;
            let (format, bytes) = device_bytes(format, data);
            upload(id, format, &bytes)?;
        }
        for (id, q) in quant {
            upload(id, q.format, bytemuck::cast_slice(&q.words))?;
        }
        weight_bytes.sort_by_key(|(f, _)| *f as u8);
        gpu.check_lost()?;
        let in_place = in_place_sites(&program.plan);
        let inputs = crate::prepare::input_values(&program.plan);
        let tail = Tail::new(&gpu, &program)?;
        Ok(GpuModel {
            gpu,
            program,
            pipelines,
            variants: Mutex::new(HashMap::new()),
            params: uploaded,
            weight_bytes,
            state: Mutex::new(RunState::default()),
            tail,
            in_place,
            inputs,
            host: HostClock::default(),
            batch: OnceLock::new(),
            batch_state: Mutex::new(BatchState::default()),
        })
    }

    /// Replaces the parameters (and blocks) the model was loaded with, the load-time folds
    /// evaluated again on them, as [`GpuModel::with_progress`] takes them: the next run computes
    /// with these. Each is written over the device buffer its predecessor occupies (in the
    /// storage format the model keeps it in), so the pipelines, the slots and the bind groups
    /// stay: what a training loop does after each optimizer step. A parameter the model reads as
    /// f32 must be given as f32 (including a quantized one larger than a buffer, which the model
    /// reads dequantized). Every tensor is checked before the first is written: on an error the
    /// model computes with the parameters it had.
    pub fn set_params(
        &mut self,
        params: &HashMap<String, Tensor>,
        blocks: &HashMap<String, QuantWeight>,
        progress: &dyn Progress,
    ) -> Result<(), GpuError> {
        let plan = &self.program.plan;
        let crate::prepare::Constants { host, quant } = crate::prepare::constants(plan, params, blocks, progress)?;
        let mut writes: Vec<(&[wgpu::Buffer], Cow<'_, [u8]>)> = Vec::with_capacity(host.len() + quant.len());
        let buffers_of = |id: usize, bytes: usize| -> Result<&[wgpu::Buffer], GpuError> {
            let buffers = self.params.get(&id).map(Vec::as_slice).unwrap_or_default();
            let held: u64 = buffers.iter().map(wgpu::Buffer::size).sum();
            match bytes as u64 <= held && !buffers.is_empty() {
                true => Ok(buffers),
                false => Err(GpuError::Internal(format!("constant {id} ({bytes} bytes) has no buffer of its size"))),
            }
        };
        for (id, t) in &host {
            let data = t.as_f32().ok_or_else(|| GpuError::NotF32(format!("constant {id}")))?;
            let (_, bytes) = device_bytes(plan.values[*id].format, data);
            writes.push((buffers_of(*id, bytes.len())?, bytes));
        }
        for (id, q) in &quant {
            let bytes = Cow::Borrowed(bytemuck::cast_slice(&q.words));
            writes.push((buffers_of(*id, bytes.len())?, bytes));
        }
        for (buffers, bytes) in writes {
            self.gpu.write_chunked(buffers, &bytes);
        }
        self.gpu.check_lost()
    }

    /// Writes `values` over the f32 parameter `name` on the device, for the next run: one of a
    /// few values that change between runs (a training step's constants), without
    /// [`GpuModel::set_params`]'s pass over every parameter. `values` must hold the parameter's
    /// elements exactly.
    pub fn write_param(&self, name: &str, values: &[f32]) -> Result<(), GpuError> {
        match self.f32_param(name) {
            Some((buffers, shape)) if shape.iter().product::<usize>() == values.len() => {
                self.gpu.write_chunked(buffers, bytemuck::cast_slice(values));
                Ok(())
            }
            Some((_, shape)) => {
                Err(GpuError::Internal(format!("`{name}` has shape {shape:?}; {} values were given", values.len())))
            }
            None => Err(GpuError::Internal(format!("the model holds no f32 parameter `{name}` of a fixed shape"))),
        }
    }

    /// The f32 parameter `name` as the device holds it now, read back (`None` where the model
    /// holds no f32 parameter of a fixed shape by that name: see [`GpuModel::param_buffers`]).
    pub fn read_param(&self, name: &str) -> Option<Result<Tensor, GpuError>> {
        let (buffers, shape) = self.f32_param(name)?;
        Some(super::optim::read(&self.gpu, buffers, &shape))
    }

    /// The buffers and the fixed shape of the f32 parameter `name` (see
    /// [`GpuModel::param_buffers`]).
    fn f32_param(&self, name: &str) -> Option<(&[wgpu::Buffer], Vec<usize>)> {
        let value = self.program.plan.values.iter().find(|v| matches!(&v.storage, Storage::Param(n) if n == name))?;
        let shape = value
            .shape
            .iter()
            .map(|d| if let kiln_compiler::graph::Dim::Fixed(n) = d { Some(*n) } else { None })
            .collect::<Option<_>>()?;
        Some((self.param_buffers(name)?, shape))
    }

    /// The buffers holding the parameter `name` on the device (chunks of [`Gpu::chunk_bytes`]),
    /// as [`GpuModel::set_params`] wrote it: the tensor as given, f32, unless the plan stores it
    /// otherwise (quantized blocks, or f16: then `None`, as for a parameter the plan does not
    /// read or only folds read).
    pub fn param_buffers(&self, name: &str) -> Option<&[wgpu::Buffer]> {
        let values = &self.program.plan.values;
        let id = values
            .iter()
            .position(|v| matches!(&v.storage, Storage::Param(n) if n == name) && v.format == WeightFormat::F32)?;
        self.params.get(&id).map(Vec::as_slice)
    }

    /// The host's time in this model's runs (see [`HostClock`]).
    pub fn host_clock(&self) -> HostClock {
        self.host.clone()
    }

    /// Bytes of the weights on the device (parameters and folded constants), by storage format.
    pub fn weight_bytes(&self) -> &[(WeightFormat, u64)] {
        &self.weight_bytes
    }

    /// The device it runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The plan being run (legalized for wgpu: see [`GpuModel::program`]).
    pub fn plan(&self) -> &Plan {
        &self.program.plan
    }

    /// The plan compiled for wgpu: its legalized plan and kernels.
    pub fn program(&self) -> &Program {
        &self.program
    }
}

/// An f32 constant's bytes on the device in `format` (f16 for a weight the back end stores so,
/// f32 otherwise: the data itself), and the format they are in.
fn device_bytes(format: WeightFormat, data: &[f32]) -> (WeightFormat, Cow<'_, [u8]>) {
    match format {
        WeightFormat::F16 => {
            let halves: Vec<u16> = data.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
            (format, Cow::Owned(bytemuck::cast_slice(&halves).to_vec()))
        }
        _ => (WeightFormat::F32, Cow::Borrowed(bytemuck::cast_slice(data))),
    }
}
