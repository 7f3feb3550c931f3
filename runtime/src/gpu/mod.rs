//! Executing a [`Plan`](kiln_compiler::lower::Plan) on a GPU with wgpu.
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
//!
//! The parts, in the order a model meets them: `device` (the adapter and device), `tensor`
//! (buffers split at the adapter's limit, upload and read-back, [`DeviceTensor`]), `legalize`
//! (the plan and weights as the device can read them), `model` (loading: [`GpuModel`]), `cache`
//! (key/value caches appended in place), `run` (the executor, [`GpuModel::run`]), `profile` (the
//! per-step profiler, [`GpuModel::profile`]), `sample` (picking the next token on the device:
//! [`DeviceSampler`]) and `error` ([`GpuError`]).

mod batch;
mod cache;
mod device;
mod error;
mod legalize;
mod model;
mod optim;
mod profile;
mod run;
mod sample;
mod tensor;
mod update;

pub use batch::SeqStep;
pub use device::Gpu;
pub use error::{GpuError, Wanted};
pub use model::{GpuModel, HostClock};
pub use optim::DeviceOptimizer;
pub(crate) use optim::read as read_buffers;
pub use profile::{Clock, Profile};
pub use run::{Kept, Left};
pub(crate) use run::{Lend, Lent};
pub use sample::DeviceSampler;
pub use tensor::DeviceTensor;
