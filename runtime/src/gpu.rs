//! Executing a [`Plan`] on a GPU with wgpu.
//!
//! [`Gpu`] picks an adapter (a discrete or integrated GPU first, any CPU adapter such as Mesa's
//! lavapipe as the fallback; `KILN_ADAPTER` or the caller can name one) and opens a device with
//! the adapter's own limits. [`GpuModel`] compiles the plan with the WGSL back end
//! ([`kiln_compiler::back::wgsl::compile`]), builds one pipeline per unique kernel and uploads the
//! weights once; each [`GpuModel::run`] uploads the inputs, records every dispatch into one command
//! encoder and one compute pass, submits once and reads the outputs back. Intermediate buffers
//! (the plan's slots), input buffers, the uniform of dispatch sizes and the bind groups are kept
//! between runs: a buffer is replaced only when a longer input needs more, a bind group only when
//! a buffer it binds was, and the sizes are written only when they change.

#![expect(
    clippy::indexing_slicing,
    reason = "a plan is lowered from a checked graph or read from an artifact, whose `Plan::check` \
              bounds its value and slot indices, and compiled here (one kernel per step); step shapes are read through `dispatch`, \
              which errs on an ill-typed step; inputs are shape-checked by `bind_named_with` and \
              token ids range-checked by `check_indices`; the per-step tables are built here"
)]

use crate::progress::{Counter, Phase, Progress};
use crate::quant::QuantWeight;
use crate::weights::WeightError;
use kiln_compiler::back::wgsl::{
    self, Elem, Program, dispatch, dispatch_chunked, kernel_chunked, validate as validate_wgsl, workgroups,
};
use kiln_compiler::graph::Sym;
use kiln_compiler::interp::InterpError;
use kiln_compiler::lower::{Plan, PlanError, Step, Storage, Value, WeightFormat, resolve};
use kiln_compiler::tensor::{DType, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bytes between the `Dims` of consecutive steps in the uniform buffer (the largest uniform offset
/// alignment WebGPU allows an adapter to require).
const DIMS_STRIDE: u64 = 256;

/// What can go wrong on the device.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The plan breaks a guarantee of lowering ([`Plan::check`]: an index out of range, an
    /// ill-typed step).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// No adapter at all (or none matching the request).
    #[error("{0}")]
    NoAdapter(String),
    /// The device could not be opened.
    #[error("cannot open a device on `{adapter}`: {message}")]
    Device {
        /// The adapter.
        adapter: String,
        /// wgpu's message.
        message: String,
    },
    /// The device was lost (driver reset, GPU removed, ...).
    #[error("the GPU device was lost: {0}")]
    Lost(String),
    /// An allocation failed.
    #[error("out of GPU memory while allocating {what} ({bytes} bytes)")]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Its size.
        bytes: u64,
    },
    /// A buffer would exceed the adapter's limit on one buffer (or on one storage binding).
    #[error("{what} needs a buffer of {bytes} bytes, more than this adapter's limit of {limit} bytes")]
    TooLarge {
        /// The buffer.
        what: String,
        /// Its size.
        bytes: u64,
        /// The adapter's limit.
        limit: u64,
    },
    /// Bad inputs (missing, wrong shape, out-of-range ids).
    #[error(transparent)]
    Input(#[from] InterpError),
    /// A weight is missing or malformed.
    #[error(transparent)]
    Weights(#[from] WeightError),
    /// A size does not fit the kernels' indexing, or wgpu reported a validation error.
    #[error("{0}")]
    Dispatch(String),
}

impl From<crate::prepare::PrepareError> for GpuError {
    fn from(e: crate::prepare::PrepareError) -> Self {
        match e {
            crate::prepare::PrepareError::Interp(e) => GpuError::Input(e),
            crate::prepare::PrepareError::Invalid(m) => GpuError::Dispatch(m),
        }
    }
}

/// An opened device.
pub struct Gpu {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    lost: Arc<Mutex<Option<String>>>,
    /// The first wgpu error raised outside an error scope, if any.
    uncaptured: Arc<Mutex<Option<String>>>,
    /// Largest buffer kiln creates; larger tensors are split into chunks of this many bytes and
    /// bound as several buffers (see [`kiln_compiler::back::wgsl::kernel_chunked`]).
    chunk_bytes: u64,
    /// Whether `SHADER_F16` is enabled.
    f16: bool,
    /// Whether `SUBGROUP` is enabled.
    subgroups: bool,
    /// Whether `TIMESTAMP_QUERY` is enabled (see [`GpuModel::profile`]).
    timestamps: bool,
}

const INSTALL_HINT: &str = "no GPU adapter found. On Debian/Ubuntu without a GPU, install Mesa's CPU Vulkan driver \
     (lavapipe): `apt-get install -y mesa-vulkan-drivers`; or run with `--backend interp`";

impl Gpu {
    /// Opens a device. `choice` (or else the `KILN_ADAPTER` environment variable) selects an adapter
    /// whose name contains it, or a device type: `discrete`, `integrated`, `virtual`, `cpu`.
    ///
    /// Mesa's implicit device-select Vulkan layer prints "XDG_RUNTIME_DIR is invalid" on stderr
    /// when there is no display session. A program that wants a clean stderr sets
    /// `NODEVICE_SELECT=1` before its first thread starts, as the `kiln` binary does; the layer
    /// only reorders adapters, and this function ranks them itself.
    pub fn new(choice: Option<&str>) -> Result<Gpu, GpuError> {
        let adapter = Gpu::choose(choice)?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        // f16 storage and arithmetic (`--precision f16`, `f16-math`), subgroup reductions (see
        // `Gpu::options`) and timestamp queries (`GpuModel::profile`) where the adapter has them;
        // nothing else is needed.
        let wanted = wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY;
        let features = adapter.features() & wanted;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kiln"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| GpuError::Device { adapter: info.name.clone(), message: e.to_string() })?;
        let lost = Arc::new(Mutex::new(None));
        let flag = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut l) = flag.lock() {
                *l = Some(format!("{reason:?}: {message}"));
            }
        });
        // wgpu's default handler for errors outside an error scope panics. Every call kiln makes
        // that can fail runs inside a scope; what still escapes (work on a device that was lost
        // meanwhile) is kept, and the next check reports it as an error instead.
        let uncaptured = Arc::new(Mutex::new(None));
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut u) = sink.lock() {
                u.get_or_insert_with(|| e.to_string());
            }
        }));
        let chunk_bytes = (limits.max_storage_buffer_binding_size.min(limits.max_buffer_size) / 256 * 256).max(256);
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            lost,
            uncaptured,
            chunk_bytes,
            f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
        })
    }

    /// The adapter [`Gpu::new`] opens for `choice` (see there), without opening a device: its name
    /// and whether it is a software one (lavapipe).
    pub fn chosen_adapter(choice: Option<&str>) -> Result<(String, bool), GpuError> {
        let info = Gpu::choose(choice)?.get_info();
        Ok((info.name, info.device_type == wgpu::DeviceType::Cpu))
    }

    /// The adapter for `choice` (or `KILN_ADAPTER`): the best-ranked one whose name or device type
    /// contains it, hardware before software.
    fn choose(choice: Option<&str>) -> Result<wgpu::Adapter, GpuError> {
        let env = std::env::var("KILN_ADAPTER").ok();
        let choice = choice.map(str::to_string).or(env).filter(|c| !c.is_empty());
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        if adapters.is_empty() {
            return Err(GpuError::NoAdapter(INSTALL_HINT.into()));
        }
        let rank = |t: wgpu::DeviceType| match t {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Cpu => 3,
            wgpu::DeviceType::Other => 4,
        };
        let mut candidates: Vec<wgpu::Adapter> = adapters;
        if let Some(c) = &choice {
            let c = c.to_lowercase();
            let names: Vec<String> = candidates.iter().map(|a| a.get_info().name).collect();
            candidates.retain(|a| {
                let info = a.get_info();
                info.name.to_lowercase().contains(&c) || format!("{:?}", info.device_type).to_lowercase().contains(&c)
            });
            if candidates.is_empty() {
                return Err(GpuError::NoAdapter(format!(
                    "no adapter matches `{c}` (KILN_ADAPTER / --adapter); available: {}",
                    names.join(", ")
                )));
            }
        }
        candidates.sort_by_key(|a| rank(a.get_info().device_type));
        Ok(candidates.swap_remove(0))
    }

    /// The name of the adapter in use.
    pub fn adapter_name(&self) -> &str {
        &self.info.name
    }

    /// Whether the adapter is a software one (lavapipe: Vulkan on the CPU).
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// The name of the first hardware GPU adapter (discrete, else integrated) this machine has,
    /// without opening a device; `None` when there is only a software one (lavapipe) or none.
    /// How `kiln` picks its default back end.
    pub fn hardware_adapter() -> Option<String> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        let infos: Vec<wgpu::AdapterInfo> = adapters.iter().map(|a| a.get_info()).collect();
        [wgpu::DeviceType::DiscreteGpu, wgpu::DeviceType::IntegratedGpu]
            .into_iter()
            .find_map(|t| infos.iter().find(|i| i.device_type == t))
            .map(|i| i.name.clone())
    }

    /// Whether the device was opened with `SHADER_F16`, so weights can be stored as f16.
    pub fn supports_f16(&self) -> bool {
        self.f16
    }

    /// Whether the device was opened with `SUBGROUP`, so kernels can reduce with subgroup
    /// operations.
    pub fn supports_subgroups(&self) -> bool {
        self.subgroups
    }

    /// The WGSL back end's options for this device's features: subgroup reductions where it has
    /// them on hardware; f32 weights (f16 is a precision the caller chooses,
    /// [`wgsl::Options::f16_weights`]). A software adapter (lavapipe, whose subgroups are 8 lanes
    /// emulated on the CPU) keeps the plain forms: there `kiln bench --kernels` measured the split
    /// GEMV at half the speed of the `vec4` GEMV (SmolLM2's QKV projection at one row: 1.29 ms
    /// against 0.65 ms); and a decoder step's cache appends in their own dispatches
    /// ([`wgsl::Options::fold_appends`], slower there); and the attention's blocked forms only,
    /// where a hardware adapter runs a decode step's attention a workgroup per head
    /// ([`wgsl::Options::attention_workgroups`]). Tests ask for those forms explicitly.
    pub fn options(&self) -> wgsl::Options {
        let options = match self.is_software() {
            true => wgsl::Options::default(),
            false => wgsl::Options { subgroups: self.subgroups, ..wgsl::Options::hardware() },
        };
        wgsl::Options { binding_bytes: Some(self.chunk_bytes), ..options }
    }

    /// Whether [`GpuModel::profile`] reads the device's clock: the device was opened with
    /// `TIMESTAMP_QUERY` and [`Gpu::use_host_clock`] was not called.
    pub fn supports_timestamps(&self) -> bool {
        self.timestamps
    }

    /// Makes [`GpuModel::profile`] use the host's clock even where the device has timestamp
    /// queries (to compare the two clocks, and to test the fallback).
    pub fn use_host_clock(&mut self) {
        self.timestamps = false;
    }

    /// Caps the size of one buffer (rounded down to a multiple of 256 bytes, at least 256), so
    /// tensors above it are split into chunks. The adapter's own limit always applies too.
    pub fn limit_buffer_bytes(&mut self, bytes: u64) {
        self.chunk_bytes = (bytes / 256 * 256).clamp(256, self.chunk_bytes);
    }

    /// Bytes of the largest single buffer kiln creates on this device.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// A tensor of `bytes` bytes as chunk buffers.
    fn chunked(&self, what: &str, bytes: u64, usage: wgpu::BufferUsages) -> Result<Vec<wgpu::Buffer>, GpuError> {
        let n = bytes.div_ceil(self.chunk_bytes).max(1);
        (0..n)
            .map(|c| {
                // At least one element: an empty tensor (a cache with nothing in it) still binds.
                let size = (bytes - c * self.chunk_bytes).min(self.chunk_bytes).max(4);
                let label = if n == 1 { what.to_string() } else { format!("{what} (chunk {c} of {n})") };
                self.buffer(&label, size, usage)
            })
            .collect()
    }

    /// Writes `data` across chunk buffers.
    fn write_chunked(&self, buffers: &[wgpu::Buffer], data: &[u8]) {
        for (buffer, part) in buffers.iter().zip(data.chunks(self.chunk_bytes as usize)) {
            self.queue.write_buffer(buffer, 0, part);
        }
    }

    /// `name (type, backend)` of the adapter in use.
    pub fn describe(&self) -> String {
        format!("{} ({:?}, {:?})", self.info.name, self.info.device_type, self.info.backend)
    }

    /// Records on `encoder` the copy of a tensor of `bytes` bytes, held in `chunks` as
    /// [`Gpu::chunked`] splits it, into mappable staging buffers split the same way (so no buffer,
    /// staging included, is larger than a chunk), and returns them for [`Gpu::read_staging`].
    fn stage(
        &self,
        what: &str,
        chunks: &[wgpu::Buffer],
        bytes: u64,
        encoder: &mut wgpu::CommandEncoder,
    ) -> Result<Vec<wgpu::Buffer>, GpuError> {
        let staging = self.chunked(what, bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
        for (c, (from, to)) in chunks.iter().zip(&staging).enumerate() {
            let len = bytes.saturating_sub(c as u64 * self.chunk_bytes).min(self.chunk_bytes).next_multiple_of(4);
            if len > 0 {
                encoder.copy_buffer_to_buffer(from, 0, to, 0, len);
            }
        }
        Ok(staging)
    }

    /// Waits for the work submitted so far and returns the first `n` 4-byte words held by mappable
    /// staging buffers, one after the other (`what` names them in errors).
    pub(crate) fn read_staging(&self, staging: &[wgpu::Buffer], what: &str, n: usize) -> Result<Vec<u8>, GpuError> {
        let (tx, rx) = std::sync::mpsc::channel();
        for buffer in staging {
            let tx = tx.clone();
            buffer.slice(..).map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        }
        drop(tx);
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Dispatch(e.to_string()))?;
        self.check_lost()?;
        for _ in staging {
            rx.recv()
                .map_err(|_| GpuError::Dispatch(format!("reading {what} back was cancelled")))?
                .map_err(|e| GpuError::Dispatch(format!("cannot read {what} back: {e}")))?;
        }
        let mut data = Vec::with_capacity(4 * n);
        for buffer in staging {
            let want = (4 * n).saturating_sub(data.len());
            {
                let view = buffer.slice(..).get_mapped_range().map_err(|e| GpuError::Dispatch(e.to_string()))?;
                data.extend_from_slice(view.get(..want.min(view.len())).unwrap_or_default());
            }
            buffer.unmap();
        }
        if data.len() < 4 * n {
            return Err(GpuError::Dispatch(format!("{what}: read {} of {} bytes back", data.len(), 4 * n)));
        }
        Ok(data)
    }

    /// Fails once the device is lost, or once wgpu reported an error outside an error scope.
    pub(crate) fn check_lost(&self) -> Result<(), GpuError> {
        if let Some(reason) = self.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(GpuError::Lost(reason));
        }
        match self.uncaptured.lock().ok().and_then(|u| u.clone()) {
            Some(error) => Err(GpuError::Dispatch(format!("wgpu reported an error: {error}"))),
            None => Ok(()),
        }
    }

    /// Destroys the device now, freeing its memory; every later use of it, or of a model on it,
    /// fails with [`GpuError::Lost`]. A real loss (a driver reset, a removed GPU) takes the same
    /// path, which is how the tests exercise it.
    pub fn destroy(&self) {
        self.device.destroy();
        // wgpu reports the loss on the next poll; record it now so that no work is submitted.
        let _ = self.device.poll(wgpu::PollType::Poll);
    }

    pub(crate) fn pipeline(&self, label: &str, wgsl: &str) -> wgpu::ComputePipeline {
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(std::borrow::Cow::Borrowed(wgsl)),
        });
        self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        })
    }

    /// Creates a buffer, turning allocation failures into [`GpuError::OutOfMemory`] and
    /// requests over the adapter's limits into [`GpuError::TooLarge`] (tensors are split into
    /// chunks below both limits, see [`Gpu::chunked`]).
    pub(crate) fn buffer(&self, what: &str, bytes: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer, GpuError> {
        let limit = if usage.contains(wgpu::BufferUsages::STORAGE) {
            self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
        } else {
            self.limits.max_buffer_size
        };
        if bytes.max(16).next_multiple_of(16) > limit {
            return Err(GpuError::TooLarge { what: what.into(), bytes, limit });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            // Whole `vec4`s: projection kernels read every tensor as `array<vec4<f32>>`.
            size: bytes.max(16).next_multiple_of(16),
            usage,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            return Err(GpuError::OutOfMemory { what: what.into(), bytes });
        }
        Ok(buffer)
    }
}

/// An f32 tensor that lives on the device (see [`GpuModel::run_resident`]), split over buffers
/// as large tensors are. A key/value cache appended in place (see [`GpuModel::run_resident`]) is
/// a `[b, heads, len, d]` tensor in one buffer with room for more rows per head than it holds:
/// its heads lie `room` rows apart, and rows past `len` are not part of it.
pub struct DeviceTensor {
    gpu: Arc<Gpu>,
    shape: Vec<usize>,
    buffers: Vec<wgpu::Buffer>,
    /// Rows of room per head (the head stride), when more than the rows it holds.
    room: Option<usize>,
}

impl DeviceTensor {
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Rows per head its buffer has room for, if it is a cache with room for more rows than it
    /// holds (see [`DeviceTensor`]).
    pub fn room(&self) -> Option<usize> {
        self.room
    }

    /// `[b * heads, len, d]` of a 4-D tensor, and the rows of room per head.
    fn heads(&self) -> Result<(usize, usize, usize, usize), GpuError> {
        let &[b, heads, len, d] = self.shape.as_slice() else {
            return Err(GpuError::Dispatch(format!("a cache of shape {:?} is not [b, heads, len, d]", self.shape)));
        };
        Ok((b * heads, len, d, self.room.unwrap_or(len)))
    }

    /// Reads it back.
    pub fn read(&self) -> Result<Tensor, GpuError> {
        let gpu = &self.gpu;
        let n = match self.room {
            Some(_) => self.heads().map(|(heads, _, d, room)| heads * room * d)?,
            None => self.shape.iter().product(),
        };
        let bytes = 4 * n as u64;
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("read") });
        let staging = gpu.stage("readback", &self.buffers, bytes, &mut encoder)?;
        gpu.queue.submit([encoder.finish()]);
        let data = gpu.read_staging(&staging, "a device tensor", n)?;
        let data: &[f32] = bytemuck::cast_slice::<u8, f32>(&data);
        let data = match self.room {
            Some(_) => {
                let (heads, len, d, room) = self.heads()?;
                (0..heads).flat_map(|h| data.iter().skip(h * room * d).take(len * d)).copied().collect()
            }
            None => data.to_vec(),
        };
        Ok(Tensor::f32(self.shape.clone(), data))
    }

    /// The latest `rows` rows of a `[b, heads, len, d]` cache (all of it if it holds no more):
    /// what a sliding-window layer keeps. Copied on the device, one range per head.
    pub fn keep_last_rows(self, rows: usize) -> Result<DeviceTensor, GpuError> {
        let (heads, len, d, room) = self.heads()?;
        if len <= rows {
            return Ok(self);
        }
        let gpu = &self.gpu;
        let shape = vec![self.shape[0], self.shape[1], rows, d];
        let buffers = gpu.chunked("the key/value cache", 4 * (heads * rows * d) as u64, STORAGE)?;
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("slide") });
        let copy = CacheCopy { from: (self.buffers.clone(), room), to: (buffers.clone(), rows), heads, rows, d };
        copy.record(&mut encoder, len - rows, gpu.chunk_bytes)?;
        gpu.queue.submit([encoder.finish()]);
        Ok(DeviceTensor { gpu: self.gpu.clone(), shape, buffers, room: None })
    }
}

/// The plan with every quantized parameter larger than one buffer of `gpu` read as f32 instead
/// (the kernels that read a tensor split across buffers read f32 only), and the parameters with
/// their f32 values added where only blocks were given. A projection `options` split into pieces
/// that each fit ([`wgsl::Options::binding_bytes`]) keeps reading the blocks: a parameter only
/// such projections read keeps them, and one other steps read too (Gemma 3's tied 262144-row
/// Q8_0 embedding and head on lavapipe, whose bindings stop at 128 MiB) gets an f32 copy for
/// those steps.
fn f32_where_too_large<'a>(
    gpu: &Gpu,
    plan: &Plan,
    options: &wgsl::Options,
    params: &'a HashMap<String, Tensor>,
    blocks: &HashMap<String, QuantWeight>,
) -> Result<(Plan, std::borrow::Cow<'a, HashMap<String, Tensor>>), GpuError> {
    let mut plan = plan.clone();
    let mut added: Vec<(String, Tensor)> = Vec::new();
    let split = options.binding_bytes.is_some_and(|b| b <= gpu.chunk_bytes);
    // Which operand of a step is the weight of a projection the back end splits.
    let split_weight = |step: &Step| step.op.linear_weight().filter(|_| split && wgsl::column_divisible(&step.op));
    // The values some step reads other than as such a weight (or through a reshape, or a fold or
    // an output reads), and those read as such a weight.
    let mut whole = std::collections::HashSet::new();
    let mut weights = std::collections::HashSet::new();
    for step in &plan.steps {
        for (i, &o) in step.operands.iter().enumerate() {
            match split_weight(step) == Some(i) && o == crate::prepare::root(&plan, o) {
                true => weights.insert(o),
                false => whole.insert(crate::prepare::root(&plan, o)),
            };
        }
    }
    whole.extend(plan.folds.iter().flat_map(|f| f.operands.iter().map(|&o| crate::prepare::root(&plan, o))));
    whole.extend(plan.outputs.iter().map(|(_, o)| crate::prepare::root(&plan, *o)));
    let aliased: std::collections::HashSet<usize> = (0..plan.values.len())
        .filter(|&v| matches!(plan.values[v].storage, Storage::Alias(_)))
        .map(|v| crate::prepare::root(&plan, v))
        .collect();
    for id in 0..plan.values.len() {
        let v = &plan.values[id];
        let Storage::Param(name) = &v.storage else { continue };
        let name = name.clone();
        let shape = resolve(&v.shape, &HashMap::new());
        let (&[rows, k], true) = (shape.as_slice(), v.format.quantized()) else { continue };
        if v.format.bytes(rows, k) <= gpu.chunk_bytes || !whole.contains(&id) {
            continue;
        }
        if !params.contains_key(&name) && !added.iter().any(|(n, _)| *n == name) {
            let q = blocks.get(&name).ok_or_else(|| {
                GpuError::Dispatch(format!("parameter `{name}` is stored as {} but no blocks were given", v.format))
            })?;
            kiln_compiler::memory::check(|| format!("`{name}` in f32"), 4 * (rows * k) as u64)
                .map_err(|e| GpuError::Dispatch(e.to_string()))?;
            added.push((name.clone(), q.dequantize()));
        }
        if !weights.contains(&id) || aliased.contains(&id) {
            plan.values[id].format = WeightFormat::F32;
            continue;
        }
        // Read both ways: the other readers get an f32 copy, the split projections the blocks.
        let copy = plan.values.len();
        plan.values.push(Value { format: WeightFormat::F32, ..plan.values[id].clone() });
        for step in &mut plan.steps {
            let weight = split_weight(step);
            for (i, o) in step.operands.iter_mut().enumerate() {
                if *o == id && weight != Some(i) {
                    *o = copy;
                }
            }
        }
        for fold in &mut plan.folds {
            fold.operands.iter_mut().filter(|o| **o == id).for_each(|o| *o = copy);
        }
        plan.outputs.iter_mut().filter(|(_, o)| *o == id).for_each(|(_, o)| *o = copy);
    }
    if added.is_empty() {
        return Ok((plan, std::borrow::Cow::Borrowed(params)));
    }
    let mut all = params.clone();
    all.extend(added);
    Ok((plan, std::borrow::Cow::Owned(all)))
}

/// Records the copy of `len` bytes from byte `from` of a tensor held in `src`'s chunks of
/// `chunk` bytes to byte `to` of one held in `dst`'s, split where either crosses a chunk.
pub(crate) fn copy_range(
    encoder: &mut wgpu::CommandEncoder,
    (src, mut from): (&[wgpu::Buffer], u64),
    (dst, mut to): (&[wgpu::Buffer], u64),
    mut len: u64,
    chunk: u64,
) -> Result<(), GpuError> {
    let out_of_range = || GpuError::Dispatch("internal error: a cache copy runs past its buffers".into());
    while len > 0 {
        let (s, d) = (
            src.get((from / chunk) as usize).ok_or_else(out_of_range)?,
            dst.get((to / chunk) as usize).ok_or_else(out_of_range)?,
        );
        let n = len.min(chunk - from % chunk).min(chunk - to % chunk);
        encoder.copy_buffer_to_buffer(s, from % chunk, d, to % chunk, n);
        (from, to, len) = (from + n, to + n, len - n);
    }
    Ok(())
}

/// Which clock [`GpuModel::profile`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// Timestamps the device wrote at the start and end of each step's compute pass.
    Device,
    /// The host's clock around the submission of each step alone and the wait for it (the
    /// device lacks `TIMESTAMP_QUERY`); includes the submission's overhead.
    Host,
}

/// Time of each step of a plan, from [`GpuModel::profile`].
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The clock the times were read from.
    pub clock: Clock,
    /// Seconds per step of [`Plan::steps`], in order; `None` for a step with nothing to compute
    /// at these sizes (not dispatched).
    pub seconds: Vec<Option<f64>>,
}

/// Outputs kept on the device, by name.
pub type Kept = HashMap<String, DeviceTensor>;

/// An output lent by [`GpuModel::run_lending`]: its buffers hold it until the next run (they are
/// the plan's slots), so the callback copies out what it needs on the encoder it is given.
pub(crate) struct Lent<'a> {
    /// Its shape.
    pub shape: &'a [usize],
    /// Its chunks, of `chunk_bytes` each but the last.
    pub buffers: &'a [wgpu::Buffer],
    /// Bytes of a chunk.
    pub chunk_bytes: u64,
}

/// The output [`GpuModel::run_lending`] lends, by name, and the callback it lends it to.
pub(crate) type Lend<'a> = (&'a str, &'a mut dyn FnMut(&mut wgpu::CommandEncoder, Lent<'_>) -> Result<(), GpuError>);

/// A plan with its pipelines built and its weights on the device.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    /// The plan compiled for wgpu (its legalized plan is the one run).
    program: Program,
    pipelines: Vec<wgpu::ComputePipeline>,
    /// Pipelines of chunked kernel variants, by kernel and chunk counts, built when first needed.
    variants: Mutex<HashMap<(usize, Vec<u32>), wgpu::ComputePipeline>>,
    params: HashMap<usize, Vec<wgpu::Buffer>>,
    /// Bytes of the weights on the device (parameters and folded constants), by storage format.
    weight_bytes: Vec<(WeightFormat, u64)>,
    /// What one run leaves for the next.
    state: Mutex<RunState>,
    /// The steps that append to a session's cache in place, when it lives on the device.
    in_place: Vec<InPlace>,
}

/// Device objects kept from one run to the next, so a generation step allocates and uploads
/// nothing but its new tokens, and rebuilds only the bind groups whose buffers changed.
#[derive(Default)]
struct RunState {
    /// Intermediate buffers by slot: (bytes, chunks), grown when a longer input needs more.
    slots: Vec<(u64, Vec<wgpu::Buffer>)>,
    /// Input buffers by value: (bytes, chunks), grown likewise.
    inputs: HashMap<usize, (u64, Vec<wgpu::Buffer>)>,
    /// Every step's `Dims`, at `DIMS_STRIDE` apart, and what was last written there.
    uniform: Option<wgpu::Buffer>,
    dims: Vec<u8>,
    /// By step: the pipeline and buffers its bind group was built for, and the bind group.
    bind_groups: Vec<Option<(wgpu::ComputePipeline, Vec<wgpu::Buffer>, wgpu::BindGroup)>>,
    /// A buffer bound where a kernel reads nothing: the cache operand of a step appending in
    /// place, whose output is the cache itself.
    unread: Option<wgpu::Buffer>,
}

/// A step that appends to a cache in place on the device ([`crate::prepare::append_sites`]),
/// whose present only attentions read as keys or values, through the row strides their sizes
/// give (`wgsl::reads_strided_keys`): they then read the cache buffer itself, with room for more
/// rows than it holds, and the step writes only its new rows there.
#[derive(Clone, Debug)]
struct InPlace {
    site: crate::prepare::AppendSite,
    /// The present's value (the step's output, through reshapes).
    present_value: usize,
    /// The steps reading the present, and as which of their operands (1: keys, 2: values).
    readers: Vec<(usize, usize)>,
    /// The step is a cached attention that appends to both caches itself (`fold_appends`), the
    /// present one of its extra outputs: it appends to both in place or to neither.
    folded: bool,
}

/// The `rows` rows of each of `heads` heads of width `d` copied from one cache buffer to another,
/// each given with its rows of room per head.
struct CacheCopy {
    from: (Vec<wgpu::Buffer>, usize),
    to: (Vec<wgpu::Buffer>, usize),
    heads: usize,
    rows: usize,
    d: usize,
}

impl CacheCopy {
    /// Records the copy on `encoder`, one range per head, the rows read from row `skip` of each
    /// source head; buffers are chunks of `chunk` bytes.
    fn record(&self, encoder: &mut wgpu::CommandEncoder, skip: usize, chunk: u64) -> Result<(), GpuError> {
        let row_bytes = 4 * self.d as u64;
        for h in 0..self.heads as u64 {
            let from = (h * self.from.1 as u64 + skip as u64) * row_bytes;
            let to = h * self.to.1 as u64 * row_bytes;
            copy_range(encoder, (&self.from.0, from), (&self.to.0, to), self.rows as u64 * row_bytes, chunk)?;
        }
        Ok(())
    }
}

/// A cache one run appends to in place.
struct Append<'m> {
    site: &'m InPlace,
    /// The cache's buffer, with room for `room` rows per head.
    buffer: wgpu::Buffer,
    room: usize,
    /// `[b * heads, .., d]` of the cache, and the rows it holds before the step.
    heads: usize,
    d: usize,
    held: usize,
    /// The buffer (and its room) the held rows are copied from first, when it grew.
    grown_from: Option<(Vec<wgpu::Buffer>, usize)>,
}

/// The appends of `plan` (a legalized plan) that can run in place.
fn in_place_sites(plan: &Plan) -> Vec<InPlace> {
    let root = |v: usize| crate::prepare::root(plan, v);
    let mut sites = Vec::new();
    for site in crate::prepare::append_sites(plan) {
        let present_value = root(plan.steps[site.step].output);
        let mut readers = Vec::new();
        let mut strided = true;
        for (i, step) in plan.steps.iter().enumerate() {
            for (j, &o) in step.operands.iter().enumerate() {
                if root(o) == present_value {
                    strided &= (j == 1 || j == 2) && wgsl::reads_strided_keys(plan, step);
                    readers.push((i, j));
                }
            }
            strided &= !step.also.iter().any(|&a| root(a) == present_value);
        }
        strided &= !plan.folds.iter().any(|f| f.operands.iter().any(|&o| root(o) == present_value));
        if strided {
            sites.push(InPlace { site, present_value, readers, folded: false });
        }
    }
    // Cached attentions appending themselves: their pasts read by nothing else, their presents
    // only outputs.
    let read = |v: usize| {
        plan.steps.iter().flat_map(|s| &s.operands).filter(|&&o| root(o) == v).count()
            + plan.folds.iter().flat_map(|f| &f.operands).filter(|&&o| root(o) == v).count()
    };
    for (i, step) in plan.steps.iter().enumerate() {
        let (
            kiln_compiler::graph::Op::PackedAttention(kiln_compiler::graph::PackedAttention { appends: true, .. }),
            [_, pk, pv, ..],
            &[ak, av],
        ) = (&step.op, step.operands.as_slice(), step.also.as_slice())
        else {
            continue;
        };
        let site = |past_operand: usize, present: usize| -> Option<InPlace> {
            let (past_value, present_value) = (root(past_operand), root(present));
            let Storage::Input { name: past, .. } = &plan.values[past_value].storage else { return None };
            let names: Vec<&String> =
                plan.outputs.iter().filter(|(_, o)| root(*o) == present_value).map(|(n, _)| n).collect();
            let ([name], 1, 0) = (names.as_slice(), read(past_value), read(present_value)) else { return None };
            let site = crate::prepare::AppendSite { step: i, past_value, past: past.clone(), present: (*name).clone() };
            Some(InPlace { site, present_value, readers: Vec::new(), folded: true })
        };
        if let (Some(k), Some(v)) = (site(*pk, ak), site(*pv, av)) {
            sites.extend([k, v]);
        }
    }
    sites
}

const STORAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_DST).union(wgpu::BufferUsages::COPY_SRC);

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
        if options.f16_weights && !gpu.supports_f16() {
            return Err(GpuError::Dispatch(format!(
                "f16 weights need the SHADER_F16 feature, which adapter `{}` does not have; use f32 weights",
                gpu.info.name
            )));
        }
        if options.f16_math && !gpu.supports_f16() {
            return Err(GpuError::Dispatch(format!(
                "f16 arithmetic needs the SHADER_F16 feature, which adapter `{}` does not have; use f32",
                gpu.info.name
            )));
        }
        if options.subgroups && !gpu.supports_subgroups() {
            return Err(GpuError::Dispatch(format!(
                "subgroup reductions need the SUBGROUP feature, which adapter `{}` does not have",
                gpu.info.name
            )));
        }
        let (plan, params) = f32_where_too_large(&gpu, plan, options, params, blocks)?;
        let params = params.as_ref();
        let program = wgsl::compile(&plan, options).map_err(|e| GpuError::Dispatch(e.to_string()))?;
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
            let data = t.as_f32().ok_or_else(|| GpuError::Dispatch(format!("{} is not f32", what(id))))?;
            let format = plan.values[id].format;
            if format == WeightFormat::F16 {
                let halves: Vec<u16> = data.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect();
                upload(id, format, bytemuck::cast_slice(&halves))?;
            } else {
                upload(id, WeightFormat::F32, bytemuck::cast_slice(data))?;
            }
        }
        for (id, q) in quant {
            upload(id, q.format, bytemuck::cast_slice(&q.words))?;
        }
        weight_bytes.sort_by_key(|(f, _)| *f as u8);
        gpu.check_lost()?;
        let in_place = in_place_sites(&program.plan);
        Ok(GpuModel {
            gpu,
            program,
            pipelines,
            variants: Mutex::new(HashMap::new()),
            params: uploaded,
            weight_bytes,
            state: Mutex::new(RunState::default()),
            in_place,
        })
    }

    /// The caches this run appends to in place: each site whose past is held on the device
    /// (`resident`, by value) or not given at all (empty), and whose present is kept, where the
    /// cache and every binding of the attentions reading it fit in one buffer (the chunked
    /// kernels take no strides). A cache without room for the new rows moves to a buffer with
    /// twice the room (amortized O(1) per row), at least 16 rows.
    fn appends_in_place(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<usize, &DeviceTensor>,
        keep: &[String],
        syms: &HashMap<Sym, usize>,
    ) -> Result<Vec<Append<'_>>, GpuError> {
        let plan = &self.program.plan;
        let gpu = &self.gpu;
        let fits =
            |v: usize| 4 * resolve(&plan.values[v].shape, syms).iter().product::<usize>() as u64 <= gpu.chunk_bytes;
        let mut appends = Vec::new();
        for site in &self.in_place {
            if !keep.contains(&site.site.present) || given.contains_key(&site.site.past) {
                continue;
            }
            let &[b, h, rows, d] = resolve(&plan.values[site.present_value].shape, syms).as_slice() else { continue };
            let held = resident.get(&site.site.past_value);
            let (len, room) = match held {
                Some(t) => match t.heads()? {
                    (heads, len, hd, room) if heads == b * h && hd == d => (len, room),
                    _ => continue,
                },
                None => (0, 0),
            };
            // The steps whose kernels take the room: every binding in one buffer.
            let past = site.site.past_value;
            let mut steps = site.readers.iter().map(|&(r, _)| r).chain(site.folded.then_some(site.site.step));
            let readers_fit = steps.all(|r| {
                let step = &plan.steps[r];
                fits(step.output)
                    && (step.operands.iter())
                        .map(|&o| crate::prepare::root(plan, o))
                        .all(|o| o == site.present_value || o == past || fits(o))
            });
            let reuse = held.filter(|t| room >= rows && t.buffers.len() == 1);
            let new_room = if reuse.is_some() { room } else { rows.max(2 * room).max(16) };
            let bytes = 4 * (b * h * new_room * d) as u64;
            if !readers_fit || bytes > gpu.chunk_bytes || len > rows {
                continue;
            }
            let (buffer, grown_from) = match reuse {
                Some(t) => (t.buffers[0].clone(), None),
                None => {
                    kiln_compiler::memory::check(|| "the key/value cache".to_string(), bytes)
                        .map_err(|e| GpuError::Dispatch(e.to_string()))?;
                    let buffer = gpu.buffer("the key/value cache", bytes, STORAGE)?;
                    (buffer, held.filter(|_| len > 0).map(|t| (t.buffers.clone(), room)))
                }
            };
            appends.push(Append { site, buffer, room: new_room, heads: b * h, d, held: len, grown_from });
        }
        // A folded attention appends to both its caches in place, with one room, or to neither.
        let paired = |a: &Append<'_>| {
            let same: Vec<usize> =
                appends.iter().filter(|b| b.site.site.step == a.site.site.step).map(|b| b.room).collect();
            !a.site.folded || (same.len() == 2 && same[0] == same[1])
        };
        let keep: Vec<bool> = appends.iter().map(paired).collect();
        Ok(appends.into_iter().zip(keep).filter(|(_, k)| *k).map(|(a, _)| a).collect())
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

    /// Runs one forward pass on named inputs; returns the named outputs.
    pub fn run(&self, given: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>, GpuError> {
        Ok(self.run_resident(given, &HashMap::new(), &[])?.0)
    }

    /// Runs one forward pass where some inputs already live on the device (`resident`: cache
    /// inputs, say the previous step's `present_k` or an encoder's keys) and some outputs stay
    /// there (`keep`, by name). Returns the outputs read back (all but those kept) and the kept
    /// ones. Nothing but `given` is uploaded and nothing kept is read back, so a generation
    /// session's cache never leaves the device.
    pub fn run_resident(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<String, DeviceTensor>,
        keep: &[String],
    ) -> Result<(Vec<(String, Tensor)>, Kept), GpuError> {
        self.run_lending(given, resident, keep, None)
    }

    /// [`GpuModel::run_resident`], where one output is neither read back nor kept but lent to a
    /// callback (`lend`: its name and the callback), which records what it does with it (see
    /// [`Lent`]) on the run's command encoder, after the forward pass and before the run's one
    /// submission: how a generation step samples its next token on the device.
    pub(crate) fn run_lending(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<String, DeviceTensor>,
        keep: &[String],
        mut lend: Option<Lend<'_>>,
    ) -> Result<(Vec<(String, Tensor)>, Kept), GpuError> {
        let gpu = &self.gpu;
        gpu.check_lost()?;
        let plan = &self.program.plan;

        // Bind inputs exactly as the interpreter does.
        let resident_shapes: HashMap<String, Vec<usize>> =
            resident.iter().map(|(name, t)| (name.clone(), t.shape.clone())).collect();
        let bound = crate::prepare::bind(plan, given, &resident_shapes)?;
        let syms = bound.syms;
        let mut inputs: HashMap<usize, Tensor> = HashMap::new();
        let mut resident_inputs: HashMap<usize, &DeviceTensor> = HashMap::new();
        for ((id, tensor), name) in bound.inputs.into_iter().zip(&bound.names) {
            match tensor {
                Some(t) => {
                    inputs.insert(id, t);
                }
                None => {
                    let t = &resident[name];
                    if !Arc::ptr_eq(&t.gpu, gpu) {
                        return Err(GpuError::Dispatch(format!("input `{name}` lives on another device")));
                    }
                    resident_inputs.insert(id, t);
                }
            }
        }
        let by_value: HashMap<usize, &Tensor> = inputs.iter().map(|(&id, t)| (id, t)).collect();
        crate::prepare::check_indices(plan, &by_value, &syms)?;
        let appends = self.appends_in_place(given, &resident_inputs, keep, &syms)?;
        // Buffers bound instead of a value's own: a cache appended in place for its present, and
        // a contiguous copy of a cache with room that is read another way (copied on the device
        // before the forward pass, by `copies`).
        let mut bound_instead: HashMap<usize, Vec<wgpu::Buffer>> = HashMap::new();
        let mut copies: Vec<CacheCopy> = Vec::new();
        for a in &appends {
            bound_instead.insert(a.site.present_value, vec![a.buffer.clone()]);
            if let Some((from, room)) = &a.grown_from {
                let to = vec![a.buffer.clone()];
                copies.push(CacheCopy {
                    from: (from.clone(), *room),
                    to: (to, a.room),
                    heads: a.heads,
                    rows: a.held,
                    d: a.d,
                });
            }
        }
        for (&id, t) in &resident_inputs {
            let Some(room) = t.room.filter(|_| !appends.iter().any(|a| a.site.site.past_value == id)) else { continue };
            let (heads, rows, d, _) = t.heads()?;
            let to = gpu.chunked("the key/value cache", 4 * (heads * rows * d) as u64, STORAGE)?;
            copies.push(CacheCopy { from: (t.buffers.clone(), room), to: (to.clone(), rows), heads, rows, d });
            bound_instead.insert(id, to);
        }

        // Buffers: inputs and slots (kept, grown as needed), one uniform for every step's Dims.
        let mut state = self.state.lock().map_err(|_| GpuError::Dispatch("run state poisoned".into()))?;
        let state = &mut *state;
        for (&id, t) in &inputs {
            let bytes: Vec<u8> = match (&t.data, plan.values[id].dtype) {
                (kiln_compiler::tensor::Data::I64(v), _) => {
                    v.iter().flat_map(|&x| (x.clamp(i32::MIN as i64, i32::MAX as i64) as i32).to_le_bytes()).collect()
                }
                (kiln_compiler::tensor::Data::F32(v), _) => bytemuck::cast_slice(v).to_vec(),
            };
            let len = bytes.len() as u64;
            if state.inputs.get(&id).is_none_or(|(have, _)| *have < len) {
                state.inputs.insert(id, (len, gpu.chunked("input", len, STORAGE)?));
            }
            gpu.write_chunked(&state.inputs[&id].1, &bytes);
        }
        let sizes = plan.slot_sizes(&syms);
        let slots = &mut state.slots;
        for (s, &bytes) in sizes.iter().enumerate() {
            if slots.len() <= s || slots[s].0 < bytes {
                let b = gpu.chunked(&format!("intermediate buffer {s}"), bytes, STORAGE)?;
                if slots.len() <= s {
                    slots.push((bytes, b));
                } else {
                    slots[s] = (bytes, b);
                }
            }
        }
        if state.uniform.is_none() {
            state.uniform = Some(gpu.buffer(
                "dispatch sizes",
                DIMS_STRIDE * plan.steps.len().max(1) as u64,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            )?);
        }
        state.bind_groups.resize_with(plan.steps.len(), || None);
        if state.unread.is_none() && !appends.is_empty() {
            state.unread = Some(gpu.buffer("an operand read by nothing", 16, STORAGE)?);
        }
        for a in &appends {
            let unread = state.unread.clone().ok_or_else(|| GpuError::Dispatch("no unread buffer".into()))?;
            bound_instead.insert(a.site.site.past_value, vec![unread]);
        }
        #[expect(clippy::expect_used, reason = "the buffer is made just above when absent")]
        let (slots, input_buffers, uniform) =
            (&state.slots, &state.inputs, state.uniform.as_ref().expect("made above"));
        // The chunk buffers of a value, as many as its current size needs.
        let buffers_of = |value: usize| -> &[wgpu::Buffer] {
            let mut v = value;
            while let Storage::Alias(a) = plan.values[v].storage {
                v = a;
            }
            let all: &[wgpu::Buffer] = match &plan.values[v].storage {
                _ if bound_instead.contains_key(&v) => &bound_instead[&v],
                Storage::Param(_) | Storage::Const => &self.params[&v],
                Storage::Input { .. } => match resident_inputs.get(&v) {
                    Some(t) => &t.buffers,
                    None => &input_buffers[&v].1,
                },
                Storage::Slot(s) => &slots[*s].1,
                Storage::Alias(_) => unreachable!("aliases resolved above"),
            };
            let bytes = 4 * resolve(&plan.values[value].shape, &syms).iter().product::<usize>() as u64;
            &all[..(bytes.div_ceil(gpu.chunk_bytes).max(1) as usize).min(all.len())]
        };

        let mut dims_bytes = vec![0u8; (DIMS_STRIDE as usize) * plan.steps.len().max(1)];
        let mut bind_groups = Vec::with_capacity(plan.steps.len());
        let mut grids = Vec::with_capacity(plan.steps.len());
        let mut variants = self.variants.lock().map_err(|_| GpuError::Dispatch("pipeline cache poisoned".into()))?;
        for (i, step) in plan.steps.iter().enumerate() {
            let operand_shapes: Vec<Vec<usize>> =
                step.operands.iter().map(|&o| resolve(&plan.values[o].shape, &syms)).collect();
            let out_shape = resolve(&plan.values[step.output].shape, &syms);
            let past = syms.get(&Sym::Past).copied().unwrap_or(0);
            // The kernel's calling convention: the output, the operands, then what else it writes.
            let bound: Vec<&[wgpu::Buffer]> = std::iter::once(step.output)
                .chain(step.operands.iter().copied())
                .chain(step.also.iter().copied())
                .map(buffers_of)
                .collect();
            let counts: Vec<u32> = bound.iter().map(|b| b.len() as u32).collect();
            let chunked = counts.iter().any(|&c| c > 1);
            let mut dims = match chunked {
                true => dispatch_chunked(&step.op, &operand_shapes, &out_shape, past),
                false => dispatch(&step.op, &operand_shapes, &out_shape, past, &self.program.options),
            }
            .map_err(|m| GpuError::Dispatch(format!("`{}`: {m}", step.scope)))?;
            if let Some(a) = appends.iter().find(|a| a.site.site.step == i) {
                let room = a.room as u32;
                match a.site.folded {
                    true if chunked => {
                        Err("internal error: a cache appended in place through chunked bindings".to_string())
                    }
                    true => wgsl::appends_in_place(&step.op, &mut dims, room),
                    false => wgsl::heads_in_place(&step.op, &mut dims, room),
                }
                .map_err(|m| GpuError::Dispatch(format!("`{}`: {m}", step.scope)))?;
            }
            for a in &appends {
                let room = a.room as u32;
                for &(_, operand) in a.site.readers.iter().filter(|(r, _)| *r == i) {
                    if chunked {
                        return Err(GpuError::Dispatch(format!(
                            "internal error: `{}` reads a cache appended in place through chunked bindings",
                            step.scope
                        )));
                    }
                    let strides = wgsl::attention::KEY_STRIDES;
                    dims[if operand == 1 { strides.0 } else { strides.1 }] = room;
                }
            }
            let offset = i * DIMS_STRIDE as usize;
            dims_bytes[offset..offset + 64].copy_from_slice(bytemuck::cast_slice(&dims));

            let storage_bindings: u32 = counts.iter().sum();
            if storage_bindings > gpu.limits.max_storage_buffers_per_shader_stage {
                return Err(GpuError::Dispatch(format!(
                    "`{}`: {} needs {storage_bindings} storage buffers after splitting large tensors, more than this adapter's {}",
                    step.scope,
                    step.op.name(),
                    gpu.limits.max_storage_buffers_per_shader_stage
                )));
            }
            let pipeline = if !chunked {
                self.pipelines[self.program.step_kernels[i]].clone()
            } else if let Some(&o) = step.operands.iter().find(|&&o| !plan.values[o].format.is_f32()) {
                // The chunked variants read f32 only.
                return Err(GpuError::Dispatch(format!(
                    "`{}`: a tensor is larger than this adapter binds in one buffer, and the split kernel reads f32 weights only, not {} (load the weights as f32: `--dequantize` / `--precision f32`)",
                    step.scope, plan.values[o].format
                )));
            } else {
                let key = (self.program.step_kernels[i], counts.clone());
                if !variants.contains_key(&key) {
                    let elems: Vec<Elem> = step.operands.iter().map(|&o| elem(plan.values[o].dtype)).collect();
                    let text = kernel_chunked(
                        &step.op,
                        &elems,
                        elem(plan.values[step.output].dtype),
                        &counts,
                        (gpu.chunk_bytes / 4) as u32,
                    )
                    .ok_or_else(|| GpuError::Dispatch(format!("{} has no kernel", step.op.name())))?;
                    validate_wgsl(&text).map_err(|e| {
                        GpuError::Dispatch(format!("internal error: chunked {} kernel is invalid: {e}", step.op.name()))
                    })?;
                    variants.insert(key.clone(), gpu.pipeline(&format!("{} (chunked)", step.op.name()), &text));
                }
                variants[&key].clone()
            };
            // The bind group of the last run, if it bound the same pipeline and buffers.
            let buffers: Vec<wgpu::Buffer> = bound.iter().flat_map(|b| b.iter().cloned()).collect();
            let cached = match &state.bind_groups[i] {
                Some((p, b, group)) if *p == pipeline && *b == buffers => Some(group.clone()),
                _ => None,
            };
            let group = match cached {
                Some(group) => group,
                None => {
                    let mut entries = vec![wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: uniform,
                            offset: offset as u64,
                            size: wgpu::BufferSize::new(64),
                        }),
                    }];
                    for buffer in &buffers {
                        entries.push(wgpu::BindGroupEntry {
                            binding: entries.len() as u32,
                            resource: buffer.as_entire_binding(),
                        });
                    }
                    let group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &pipeline.get_bind_group_layout(0),
                        entries: &entries,
                    });
                    state.bind_groups[i] = Some((pipeline.clone(), buffers, group.clone()));
                    group
                }
            };
            bind_groups.push((pipeline, group));
            grids.push(if dims[0] == 0 {
                (0, 0)
            } else {
                workgroups(dims[0], gpu.limits.max_compute_workgroups_per_dimension)
            });
        }
        drop(variants);
        // Sizes change only with the input's (and a cache's) length.
        if state.dims != dims_bytes {
            gpu.queue.write_buffer(uniform, 0, &dims_bytes);
            state.dims = dims_bytes;
        }

        // One encoder, one compute pass, one submission.
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("forward") });
        // Caches moved to a larger buffer, or made contiguous, first.
        for c in &copies {
            c.record(&mut encoder, 0, gpu.chunk_bytes)?;
        }
        {
            let mut pass =
                encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            for (i, (pipeline, group)) in bind_groups.iter().enumerate() {
                let (x, y) = grids[i];
                if x == 0 {
                    continue;
                }
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, group, &[]);
                pass.dispatch_workgroups(x, y, 1);
            }
        }
        let mut readbacks = Vec::new();
        let mut kept = HashMap::new();
        for (name, v) in &plan.outputs {
            let shape = resolve(&plan.values[*v].shape, &syms);
            if let Some((lent, then)) = lend.as_mut()
                && *lent == name.as_str()
            {
                (*then)(&mut encoder, Lent { shape: &shape, buffers: buffers_of(*v), chunk_bytes: gpu.chunk_bytes })?;
                continue;
            }
            if let Some(a) = appends.iter().find(|a| a.site.site.present == *name) {
                // Already where it is kept: the cache, with room for more rows.
                let buffers = vec![a.buffer.clone()];
                kept.insert(name.clone(), DeviceTensor { gpu: gpu.clone(), shape, buffers, room: Some(a.room) });
                continue;
            }
            if keep.contains(name) {
                // Kept on the device: copied into buffers of its own (a slot is reused next run).
                let bytes = 4 * shape.iter().product::<usize>() as u64;
                let buffers = gpu.chunked(&format!("output `{name}`"), bytes, STORAGE)?;
                for (c, (chunk, to)) in buffers_of(*v).iter().zip(&buffers).enumerate() {
                    let at = c as u64 * gpu.chunk_bytes;
                    let len = (bytes.saturating_sub(at)).min(gpu.chunk_bytes).next_multiple_of(4);
                    if len > 0 {
                        encoder.copy_buffer_to_buffer(chunk, 0, to, 0, len);
                    }
                }
                kept.insert(name.clone(), DeviceTensor { gpu: gpu.clone(), shape, buffers, room: None });
                continue;
            }
            let bytes = 4 * shape.iter().product::<usize>() as u64;
            let staging = gpu.stage(&format!("output `{name}`"), buffers_of(*v), bytes, &mut encoder)?;
            readbacks.push((name.clone(), shape, plan.values[*v].dtype, staging));
        }
        gpu.queue.submit([encoder.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Dispatch(format!("wgpu rejected the forward pass: {e}")));
        }

        let mut outputs = Vec::new();
        for (name, shape, dtype, staging) in readbacks {
            let n: usize = shape.iter().product();
            let data = gpu.read_staging(&staging, &format!("`{name}`"), n)?;
            let t = match dtype {
                DType::F32 => Tensor::f32(shape, bytemuck::cast_slice::<u8, f32>(&data).to_vec()),
                DType::I64 => {
                    Tensor::i64(shape, bytemuck::cast_slice::<u8, i32>(&data).iter().map(|&x| x as i64).collect())
                }
            };
            outputs.push((name, t));
        }
        Ok((outputs, kept))
    }

    /// Times every step of the plan on `given` inputs. A forward pass first binds the inputs and
    /// sizes every buffer (and warms the pipelines); then the steps are dispatched again in order,
    /// each in a compute pass of its own on the same buffers and sizes (so each reads what it
    /// reads in a forward pass), and each is timed: between timestamps
    /// written by the device at the pass's start and end where the device has `TIMESTAMP_QUERY`
    /// ([`Clock::Device`]), else by the host around a submission of that pass alone, waiting for
    /// it ([`Clock::Host`], which includes the submission's overhead).
    pub fn profile(&self, given: &HashMap<String, Tensor>) -> Result<Profile, GpuError> {
        self.run(given)?;
        let gpu = &self.gpu;
        let state = self.state.lock().map_err(|_| GpuError::Dispatch("run state poisoned".into()))?;
        // Every step's pipeline, bind group and grid, as the run above dispatched them.
        let mut dispatches = Vec::with_capacity(self.program.plan.steps.len());
        for (i, cached) in state.bind_groups.iter().enumerate() {
            let (pipeline, _, group) =
                cached.as_ref().ok_or_else(|| GpuError::Dispatch(format!("step {i} has no bind group")))?;
            let offset = i * DIMS_STRIDE as usize;
            let threads = state
                .dims
                .get(offset..offset + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
                .ok_or_else(|| GpuError::Dispatch(format!("step {i} has no dispatch size")))?;
            let grid = match threads {
                0 => None,
                t => Some(workgroups(t, gpu.limits.max_compute_workgroups_per_dimension)),
            };
            dispatches.push((pipeline, group, grid));
        }
        let record =
            |encoder: &mut wgpu::CommandEncoder, step: usize, writes: Option<wgpu::ComputePassTimestampWrites<'_>>| {
                let (pipeline, group, grid) = dispatches[step];
                let mut pass =
                    encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: writes });
                if let Some((x, y)) = grid {
                    pass.set_pipeline(pipeline);
                    pass.set_bind_group(0, group, &[]);
                    pass.dispatch_workgroups(x, y, 1);
                }
            };
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut seconds = vec![None; dispatches.len()];
        if gpu.timestamps {
            // Two queries per step, at most `wgpu::QUERY_SET_MAX_QUERIES` per set.
            let per_set = (wgpu::QUERY_SET_MAX_QUERIES / 2) as usize;
            let period = f64::from(gpu.queue.get_timestamp_period()) * 1e-9;
            for first in (0..dispatches.len()).step_by(per_set) {
                let steps = first..(first + per_set).min(dispatches.len());
                let queries = 2 * steps.len() as u32;
                let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("profile"),
                    ty: wgpu::QueryType::Timestamp,
                    count: queries,
                });
                let bytes = u64::from(queries) * wgpu::QUERY_SIZE as u64;
                let resolved =
                    gpu.buffer("timestamps", bytes, wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC)?;
                let staging =
                    gpu.buffer("timestamps", bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
                let mut encoder =
                    gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("profile") });
                for (q, step) in steps.clone().enumerate() {
                    let writes = wgpu::ComputePassTimestampWrites {
                        query_set: &set,
                        beginning_of_pass_write_index: Some(2 * q as u32),
                        end_of_pass_write_index: Some(2 * q as u32 + 1),
                    };
                    record(&mut encoder, step, Some(writes));
                }
                encoder.resolve_query_set(&set, 0..queries, &resolved, 0);
                encoder.copy_buffer_to_buffer(&resolved, 0, &staging, 0, bytes);
                gpu.queue.submit([encoder.finish()]);
                let data = gpu.read_staging(std::slice::from_ref(&staging), "timestamps", 2 * queries as usize)?;
                let ticks: Vec<u64> = data.as_chunks::<8>().0.iter().map(|&b| u64::from_le_bytes(b)).collect();
                for (q, step) in steps.enumerate() {
                    if dispatches[step].2.is_some() {
                        seconds[step] = Some(ticks[2 * q + 1].saturating_sub(ticks[2 * q]) as f64 * period);
                    }
                }
            }
        } else {
            for (step, time) in seconds.iter_mut().enumerate() {
                if dispatches[step].2.is_none() {
                    continue;
                }
                let mut encoder =
                    gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("profile") });
                record(&mut encoder, step, None);
                let start = std::time::Instant::now();
                gpu.queue.submit([encoder.finish()]);
                gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Dispatch(e.to_string()))?;
                *time = Some(start.elapsed().as_secs_f64());
            }
        }
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Dispatch(format!("wgpu rejected a profiled dispatch: {e}")));
        }
        gpu.check_lost()?;
        Ok(Profile { clock: if gpu.timestamps { Clock::Device } else { Clock::Host }, seconds })
    }
}

fn elem(dtype: DType) -> Elem {
    match dtype {
        DType::F32 => Elem::F32,
        DType::I64 => Elem::I32,
    }
}
