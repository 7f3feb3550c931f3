//! Executing a [`Plan`] on a GPU with wgpu.
//!
//! [`Gpu`] picks an adapter (a discrete or integrated GPU first, any CPU adapter such as Mesa's
//! lavapipe as the fallback; `KILN_ADAPTER` or the caller can name one) and opens a device with
//! the adapter's own limits. [`GpuModel`] builds one pipeline per unique kernel and uploads the
//! weights once; each [`GpuModel::run`] uploads the inputs, records every dispatch into one command
//! encoder and one compute pass, submits once and reads the outputs back. Intermediate buffers
//! (the plan's slots) are kept between runs and grown when a longer input needs more.

use crate::weights::WeightError;
use kiln_compiler::graph::{InputRole, Sym};
use kiln_compiler::interp::{InputSpec, InterpError, bind_named};
use kiln_compiler::lower::{Plan, Storage, dispatch, resolve, workgroups};
use kiln_compiler::tensor::{DType, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bytes between the `Dims` of consecutive steps in the uniform buffer (the largest uniform offset
/// alignment WebGPU allows an adapter to require).
const DIMS_STRIDE: u64 = 256;

/// What can go wrong on the device.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
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
    /// A buffer would exceed what the adapter can bind.
    #[error("{what} needs {bytes} bytes, more than this adapter's storage-buffer binding limit of {limit} bytes")]
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

/// An opened device.
pub struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    lost: Arc<Mutex<Option<String>>>,
}

const INSTALL_HINT: &str = "no GPU adapter found. On Debian/Ubuntu without a GPU, install Mesa's CPU Vulkan driver \
     (lavapipe): `apt-get install -y mesa-vulkan-drivers`; or run with `--backend interp`";

impl Gpu {
    /// Opens a device. `choice` (or else the `KILN_ADAPTER` environment variable) selects an adapter
    /// whose name contains it, or a device type: `discrete`, `integrated`, `virtual`, `cpu`.
    pub fn new(choice: Option<&str>) -> Result<Gpu, GpuError> {
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
        let adapter = candidates.swap_remove(0);
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kiln"),
            required_features: wgpu::Features::empty(),
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
        Ok(Gpu { device, queue, info, limits, lost })
    }

    /// `name (type, backend)` of the adapter in use.
    pub fn describe(&self) -> String {
        format!("{} ({:?}, {:?})", self.info.name, self.info.device_type, self.info.backend)
    }

    fn check_lost(&self) -> Result<(), GpuError> {
        match self.lost.lock().ok().and_then(|l| l.clone()) {
            Some(reason) => Err(GpuError::Lost(reason)),
            None => Ok(()),
        }
    }

    /// Creates a storage buffer, turning allocation failures into [`GpuError::OutOfMemory`] and
    /// oversize requests into [`GpuError::TooLarge`].
    fn buffer(&self, what: &str, bytes: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer, GpuError> {
        let limit = u64::from(self.limits.max_storage_buffer_binding_size).min(self.limits.max_buffer_size);
        if usage.contains(wgpu::BufferUsages::STORAGE) && bytes > limit {
            return Err(GpuError::TooLarge { what: what.into(), bytes, limit });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes.max(4).next_multiple_of(4),
            usage,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            return Err(GpuError::OutOfMemory { what: what.into(), bytes });
        }
        Ok(buffer)
    }
}

/// A plan with its pipelines built and its weights on the device.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    plan: Plan,
    pipelines: Vec<wgpu::ComputePipeline>,
    params: HashMap<usize, wgpu::Buffer>,
    slots: Mutex<Vec<(u64, wgpu::Buffer)>>,
}

const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::COPY_SRC);

impl GpuModel {
    /// Builds the pipelines and uploads the parameters (by canonical name) once.
    pub fn new(gpu: Arc<Gpu>, plan: Plan, params: &HashMap<String, Tensor>) -> Result<GpuModel, GpuError> {
        let pipelines = plan
            .kernels
            .iter()
            .map(|k| {
                let module = gpu.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(&k.name),
                    source: wgpu::ShaderSource::Wgsl(std::borrow::Cow::Borrowed(&k.wgsl)),
                });
                gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&k.name),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                })
            })
            .collect();
        let mut uploaded = HashMap::new();
        for (id, v) in plan.values.iter().enumerate() {
            let Storage::Param(name) = &v.storage else { continue };
            let t = params.get(name).ok_or_else(|| InterpError::MissingParam(name.clone()))?;
            let expected = resolve(&v.shape, &HashMap::new());
            if t.shape != expected {
                return Err(InterpError::ParamShape { name: name.clone(), expected, found: t.shape.clone() }.into());
            }
            let data = t.as_f32().ok_or_else(|| GpuError::Dispatch(format!("parameter `{name}` is not f32")))?;
            let bytes: &[u8] = bytemuck::cast_slice(data);
            let buffer = gpu.buffer(&format!("parameter `{name}`"), bytes.len() as u64, STORAGE)?;
            gpu.queue.write_buffer(&buffer, 0, bytes);
            uploaded.insert(id, buffer);
        }
        gpu.check_lost()?;
        Ok(GpuModel { gpu, plan, pipelines, params: uploaded, slots: Mutex::new(Vec::new()) })
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Runs one forward pass on named inputs; returns the named outputs.
    pub fn run(&self, given: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>, GpuError> {
        let gpu = &self.gpu;
        gpu.check_lost()?;
        let plan = &self.plan;

        // Bind inputs exactly as the interpreter does.
        let input_ids: Vec<usize> =
            plan.values.iter().enumerate().filter(|(_, v)| matches!(v.storage, Storage::Input { .. })).map(|(i, _)| i).collect();
        let specs: Vec<InputSpec> = input_ids
            .iter()
            .map(|&i| {
                let v = &plan.values[i];
                let Storage::Input { name, role } = &v.storage else { unreachable!("filtered to inputs") };
                let seq = match v.shape.get(1) {
                    Some(kiln_compiler::graph::Dim::Sym(s)) => *s,
                    _ => Sym::Seq,
                };
                InputSpec { name, role: *role, seq }
            })
            .collect();
        let (tensors, syms) = bind_named(&specs, given)?;
        let inputs: HashMap<usize, Tensor> = input_ids.into_iter().zip(tensors).collect();
        self.check_indices(&inputs, &syms)?;

        // Buffers: inputs (fresh), slots (kept, grown as needed), one uniform for every step's Dims.
        let mut input_buffers = HashMap::new();
        for (&id, t) in &inputs {
            let bytes: Vec<u8> = match (&t.data, plan.values[id].dtype) {
                (kiln_compiler::tensor::Data::I64(v), _) => {
                    v.iter().flat_map(|&x| (x.clamp(i32::MIN as i64, i32::MAX as i64) as i32).to_le_bytes()).collect()
                }
                (kiln_compiler::tensor::Data::F32(v), _) => bytemuck::cast_slice(v).to_vec(),
            };
            let b = gpu.buffer("input", bytes.len() as u64, STORAGE)?;
            gpu.queue.write_buffer(&b, 0, &bytes);
            input_buffers.insert(id, b);
        }
        let sizes = plan.slot_sizes(&syms);
        let mut slots = self.slots.lock().map_err(|_| GpuError::Dispatch("slot cache poisoned".into()))?;
        for (s, &bytes) in sizes.iter().enumerate() {
            if slots.len() <= s || slots[s].0 < bytes {
                let b = gpu.buffer(&format!("intermediate buffer {s}"), bytes, STORAGE)?;
                if slots.len() <= s {
                    slots.push((bytes, b));
                } else {
                    slots[s] = (bytes, b);
                }
            }
        }
        let uniform = gpu.buffer(
            "dispatch sizes",
            DIMS_STRIDE * plan.steps.len().max(1) as u64,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        let buffer_of = |value: usize| -> &wgpu::Buffer {
            let mut v = value;
            while let Storage::Alias(a) = plan.values[v].storage {
                v = a;
            }
            match &plan.values[v].storage {
                Storage::Param(_) => &self.params[&v],
                Storage::Input { .. } => &input_buffers[&v],
                Storage::Slot(s) => &slots[*s].1,
                Storage::Alias(_) => unreachable!("aliases resolved above"),
            }
        };

        let mut dims_bytes = vec![0u8; (DIMS_STRIDE as usize) * plan.steps.len().max(1)];
        let mut bind_groups = Vec::with_capacity(plan.steps.len());
        let mut grids = Vec::with_capacity(plan.steps.len());
        for (i, step) in plan.steps.iter().enumerate() {
            let operand_shapes: Vec<Vec<usize>> =
                step.operands.iter().map(|&o| resolve(&plan.values[o].shape, &syms)).collect();
            let out_shape = resolve(&plan.values[step.output].shape, &syms);
            let dims = dispatch(&step.op, &operand_shapes, &out_shape)
                .map_err(|m| GpuError::Dispatch(format!("`{}`: {m}", step.scope)))?;
            let offset = i * DIMS_STRIDE as usize;
            dims_bytes[offset..offset + 64].copy_from_slice(bytemuck::cast_slice(&dims));
            let mut entries = vec![
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &uniform,
                        offset: offset as u64,
                        size: wgpu::BufferSize::new(64),
                    }),
                },
                wgpu::BindGroupEntry { binding: 1, resource: buffer_of(step.output).as_entire_binding() },
            ];
            for (k, &o) in step.operands.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry { binding: 2 + k as u32, resource: buffer_of(o).as_entire_binding() });
            }
            let pipeline = &self.pipelines[step.kernel];
            bind_groups.push(gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            }));
            grids.push(workgroups(dims[0], gpu.limits.max_compute_workgroups_per_dimension));
            if dims[0] == 0 {
                grids[i] = (0, 0);
            }
        }
        gpu.queue.write_buffer(&uniform, 0, &dims_bytes);

        // One encoder, one compute pass, one submission.
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("forward") });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            for (i, step) in plan.steps.iter().enumerate() {
                let (x, y) = grids[i];
                if x == 0 {
                    continue;
                }
                pass.set_pipeline(&self.pipelines[step.kernel]);
                pass.set_bind_group(0, &bind_groups[i], &[]);
                pass.dispatch_workgroups(x, y, 1);
            }
        }
        let mut readbacks = Vec::new();
        for (name, v) in &plan.outputs {
            let shape = resolve(&plan.values[*v].shape, &syms);
            let bytes = 4 * shape.iter().product::<usize>() as u64;
            let staging = gpu.buffer(
                &format!("output `{name}`"),
                bytes,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?;
            encoder.copy_buffer_to_buffer(buffer_of(*v), 0, &staging, 0, bytes.max(4).next_multiple_of(4));
            readbacks.push((name.clone(), shape, plan.values[*v].dtype, staging));
        }
        gpu.queue.submit([encoder.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Dispatch(format!("wgpu rejected the forward pass: {e}")));
        }

        let mut outputs = Vec::new();
        for (name, shape, dtype, staging) in readbacks {
            let slice = staging.slice(..);
            let (tx, rx) = std::sync::mpsc::channel();
            slice.map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Dispatch(e.to_string()))?;
            gpu.check_lost()?;
            rx.recv()
                .map_err(|_| GpuError::Dispatch("readback was cancelled".into()))?
                .map_err(|e| GpuError::Dispatch(format!("cannot read `{name}` back: {e}")))?;
            let n: usize = shape.iter().product();
            let t = {
                let view = slice.get_mapped_range().map_err(|e| GpuError::Dispatch(e.to_string()))?;
                match dtype {
                    DType::F32 => Tensor::f32(shape, bytemuck::cast_slice::<u8, f32>(&view[..4 * n]).to_vec()),
                    DType::I64 => Tensor::i64(
                        shape,
                        bytemuck::cast_slice::<u8, i32>(&view[..4 * n]).iter().map(|&x| x as i64).collect(),
                    ),
                }
            };
            staging.unmap();
            outputs.push((name, t));
        }
        Ok(outputs)
    }

    /// Token ids and positions must index inside their tables; the GPU would clamp silently.
    fn check_indices(&self, inputs: &HashMap<usize, Tensor>, syms: &HashMap<Sym, usize>) -> Result<(), GpuError> {
        use kiln_compiler::graph::Op;
        for step in &self.plan.steps {
            if step.op != Op::Gather {
                continue;
            }
            let (table, ids) = (step.operands[0], step.operands[1]);
            let rows = resolve(&self.plan.values[table].shape, syms)[0];
            let table_name = match &self.plan.values[table].storage {
                Storage::Param(n) => n.clone(),
                _ => "table".into(),
            };
            if let Some(t) = inputs.get(&ids) {
                let what = match &self.plan.values[ids].storage {
                    Storage::Input { role: InputRole::TokenTypes, .. } => "token type id",
                    _ => "token id",
                };
                if let Some(&bad) = t.as_i64().unwrap_or(&[]).iter().find(|&&x| x < 0 || x as usize >= rows) {
                    return Err(InterpError::IndexOutOfRange { what, index: bad, table: table_name, rows }.into());
                }
            } else if let Some(step_def) = self.plan.steps.iter().find(|s| s.output == ids) {
                if let Op::Positions { .. } = step_def.op {
                    let len = resolve(&self.plan.values[ids].shape, syms)[0];
                    if len > rows {
                        return Err(InterpError::IndexOutOfRange {
                            what: "position",
                            index: rows as i64,
                            table: table_name,
                            rows,
                        }
                        .into());
                    }
                }
            }
        }
        Ok(())
    }
}
