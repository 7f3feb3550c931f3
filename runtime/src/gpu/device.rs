//! [`Gpu`]: the adapter kiln picks, the device it opens with the adapter's own limits and
//! features, and the device objects every other part of the engine creates through it
//! (pipelines, buffers within the adapter's limits), with the device's loss and wgpu's
//! uncaptured errors turned into [`GpuError`]s.

use super::GpuError;
use kiln_compiler::back::wgsl;
use std::sync::{Arc, Mutex};

/// An opened device.
pub struct Gpu {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(super) info: wgpu::AdapterInfo,
    pub(super) limits: wgpu::Limits,
    lost: Arc<Mutex<Option<String>>>,
    /// The first wgpu error raised outside an error scope, if any.
    uncaptured: Arc<Mutex<Option<String>>>,
    /// Largest buffer kiln creates; larger tensors are split into chunks of this many bytes and
    /// bound as several buffers (see [`kiln_compiler::back::wgsl::kernel_chunked`]).
    pub(super) chunk_bytes: u64,
    /// Whether `SHADER_F16` is enabled.
    f16: bool,
    /// Whether `SUBGROUP` is enabled.
    subgroups: bool,
    /// Whether `TIMESTAMP_QUERY` is enabled (see `GpuModel::profile`).
    pub(super) timestamps: bool,
    /// The adapter's features that bear on kiln's kernels, for reading (see [`Gpu::features`]).
    features: String,
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
        let features_text = describe_features(&adapter);
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
            features: features_text,
        })
    }

    /// The adapter's features that bear on kiln's kernels, as one line for reading (`kiln bench
    /// calibrate` prints it): f16 shaders, subgroups, timestamp queries, and the
    /// cooperative-matrix (tensor-core) shapes the adapter offers, which no kernel uses yet;
    /// whether each is used is [`Gpu::options`]'s business.
    pub fn features(&self) -> &str {
        &self.features
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

    /// The adapter's driver and its version, as wgpu reports them (`llvmpipe`, `Mesa 23.2.1`):
    /// what a cached tuning was measured with.
    pub fn driver(&self) -> String {
        format!("{} {}", self.info.driver, self.info.driver_info).trim().to_string()
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
    /// emulated on the CPU) keeps the plain forms: there `kiln bench kernels` measured the split
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
    ///
    /// [`GpuModel::profile`]: super::GpuModel::profile
    pub fn supports_timestamps(&self) -> bool {
        self.timestamps
    }

    /// Makes [`GpuModel::profile`] use the host's clock even where the device has timestamp
    /// queries (to compare the two clocks, and to test the fallback).
    ///
    /// [`GpuModel::profile`]: super::GpuModel::profile
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

    /// `name (type, backend)` of the adapter in use.
    pub fn describe(&self) -> String {
        format!("{} ({:?}, {:?})", self.info.name, self.info.device_type, self.info.backend)
    }

    /// Fails once the device is lost, or once wgpu reported an error outside an error scope.
    pub(crate) fn check_lost(&self) -> Result<(), GpuError> {
        if let Some(reason) = self.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(GpuError::Lost(reason));
        }
        match self.uncaptured.lock().ok().and_then(|u| u.clone()) {
            Some(error) => Err(GpuError::Uncaptured(error)),
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
        self.pipeline_of(label, wgsl, "main")
    }

    /// [`Gpu::pipeline`] of the module's entry point `entry`.
    pub(crate) fn pipeline_of(&self, label: &str, wgsl: &str, entry: &str) -> wgpu::ComputePipeline {
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(std::borrow::Cow::Borrowed(wgsl)),
        });
        self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: None,
            module: &module,
            entry_point: Some(entry),
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

/// The line [`Gpu::features`] returns: each feature kiln could use, present or not.
fn describe_features(adapter: &wgpu::Adapter) -> String {
    let has = adapter.features();
    let yes = |f: wgpu::Features| if has.contains(f) { "yes" } else { "no" };
    let matrices: Vec<String> = match has.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        true => adapter
            .cooperative_matrix_properties()
            .iter()
            .map(|p| {
                let saturating = if p.saturating_accumulation { " saturating" } else { "" };
                format!("{}x{}x{} {:?}->{:?}{saturating}", p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type)
            })
            .collect(),
        false => Vec::new(),
    };
    let matrices = match matrices.is_empty() {
        true => "none".to_string(),
        false => matrices.join(", "),
    };
    format!(
        "f16 {}, subgroups {}, timestamps {}, cooperative matrices {matrices}",
        yes(wgpu::Features::SHADER_F16),
        yes(wgpu::Features::SUBGROUP),
        yes(wgpu::Features::TIMESTAMP_QUERY)
    )
}
