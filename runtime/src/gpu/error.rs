//! [`GpuError`]: what can go wrong opening a device, loading a plan on it and running it, one
//! variant per case a caller may want to tell apart.

use crate::prepare::PrepareError;
use crate::weights::WeightError;
use kiln_compiler::back::wgsl::CompileError;
use kiln_compiler::interp::InterpError;
use kiln_compiler::lower::{PlanError, WeightFormat};
use kiln_compiler::memory::MemoryError;

/// What can go wrong on the device.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The plan breaks a guarantee of lowering ([`Plan::check`](kiln_compiler::lower::Plan::check):
    /// an index out of range, an ill-typed step).
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
    /// The adapter lacks a feature the back end's options ask for.
    #[error("{wanted} the {} feature, which adapter `{adapter}` does not have{}", wanted.feature(), wanted.hint())]
    MissingFeature {
        /// What needs it.
        wanted: Wanted,
        /// The adapter.
        adapter: String,
    },
    /// The device was lost (driver reset, GPU removed, ...).
    #[error("the GPU device was lost: {0}")]
    Lost(String),
    /// wgpu reported an error outside an error scope (work on a device lost meanwhile, say).
    #[error("wgpu reported an error: {0}")]
    Uncaptured(String),
    /// The device's sampler found a NaN in the logits row (see
    /// [`kiln_compiler::back::wgsl::sample::NAN_ROW`]).
    #[error(
        "the logits to sample from hold a NaN: the model's arithmetic overflowed (with f16 weights or arithmetic, try --precision f32)"
    )]
    NanLogits,
    /// wgpu's validation rejected recorded work (`what`: the forward pass, a profiled dispatch,
    /// the sampling kernel).
    #[error("wgpu rejected {what}: {message}")]
    Rejected {
        /// The work.
        what: &'static str,
        /// wgpu's message.
        message: String,
    },
    /// Waiting for the device failed.
    #[error("{0}")]
    Poll(String),
    /// A buffer could not be mapped and read back.
    #[error("cannot read {what} back: {message}")]
    ReadBack {
        /// The tensor.
        what: String,
        /// Why.
        message: String,
    },
    /// An allocation failed.
    #[error("out of GPU memory while allocating {what} ({bytes} bytes)")]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Its size.
        bytes: u64,
    },
    /// Not enough host memory for a tensor made on the host (a dequantized weight) or a device
    /// buffer checked against it (a key/value cache).
    #[error(transparent)]
    Memory(#[from] MemoryError),
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
    /// A step binds more storage buffers, once its large tensors are split, than the adapter allows.
    #[error(
        "`{step}`: {op} needs {bindings} storage buffers after splitting large tensors, more than this adapter's {limit}"
    )]
    TooManyBindings {
        /// The step's scope.
        step: String,
        /// Its op.
        op: String,
        /// Storage buffers it would bind.
        bindings: u32,
        /// The adapter's limit per shader stage.
        limit: u32,
    },
    /// A step reads a tensor split over buffers in a format the split kernels do not read.
    #[error(
        "`{step}`: a tensor is larger than this adapter binds in one buffer, and the split kernel reads f32 weights only, not {format} (load the weights as f32: `--dequantize` / `--precision f32`)"
    )]
    SplitFormat {
        /// The step's scope.
        step: String,
        /// The format of the operand.
        format: WeightFormat,
    },
    /// A row of logits the device's sampling kernel cannot take.
    #[error("cannot sample a row of {vocab} logits on the device (at most {max} in one buffer of {chunk_bytes} bytes)")]
    SampleRow {
        /// Tokens in the row.
        vocab: usize,
        /// The kernel's limit on tokens.
        max: u32,
        /// Bytes of one buffer on the device.
        chunk_bytes: u64,
    },
    /// A step's sizes do not fit its kernel (the message of the back end's `dispatch`).
    #[error("`{step}`: {message}")]
    Step {
        /// The step's scope.
        step: String,
        /// What does not fit.
        message: String,
    },
    /// A tensor held as a key/value cache is not `[b, heads, len, d]`.
    #[error("a cache of shape {0:?} is not [b, heads, len, d]")]
    CacheShape(Vec<usize>),
    /// The WGSL back end could not compile the plan.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The plan and what was given for it disagree (the message of the shared preparation).
    #[error("{0}")]
    Invalid(String),
    /// A parameter the plan stores quantized was given without its blocks.
    #[error("parameter `{name}` is stored as {format} but no blocks were given")]
    MissingBlocks {
        /// The parameter.
        name: String,
        /// Its format in the plan.
        format: WeightFormat,
    },
    /// A constant to upload as f32 holds another type (`{0}` names it).
    #[error("{0} is not f32")]
    NotF32(String),
    /// The back end has no split-buffer form of an op's kernel.
    #[error("{0} has no kernel")]
    NoKernel(String),
    /// A resident input lives on another device.
    #[error("input `{0}` lives on another device")]
    OtherDevice(String),
    /// Bad inputs (missing, wrong shape, out-of-range ids).
    #[error(transparent)]
    Input(#[from] InterpError),
    /// A weight is missing or malformed.
    #[error(transparent)]
    Weights(#[from] WeightError),
    /// A lock was poisoned by a run that panicked.
    #[error("{0} poisoned")]
    Poisoned(&'static str),
    /// The plan cannot run several sequences' steps together ([`GpuModel::run_batched`]): why.
    ///
    /// [`GpuModel::run_batched`]: super::GpuModel::run_batched
    #[error("cannot run sequences together: {0}")]
    Unbatched(String),
    /// A broken invariant of the engine itself.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What needs a feature the adapter may lack ([`GpuError::MissingFeature`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wanted {
    /// Weights stored as f16.
    F16Weights,
    /// Arithmetic in f16.
    F16Math,
    /// Reductions with subgroup operations.
    Subgroups,
}

impl Wanted {
    /// The wgpu feature.
    fn feature(self) -> &'static str {
        match self {
            Wanted::F16Weights | Wanted::F16Math => "SHADER_F16",
            Wanted::Subgroups => "SUBGROUP",
        }
    }

    /// What to do instead, after the message.
    fn hint(self) -> &'static str {
        match self {
            Wanted::F16Weights => "; use f32 weights",
            Wanted::F16Math => "; use f32",
            Wanted::Subgroups => "",
        }
    }
}

impl std::fmt::Display for Wanted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Wanted::F16Weights => "f16 weights need",
            Wanted::F16Math => "f16 arithmetic needs",
            Wanted::Subgroups => "subgroup reductions need",
        })
    }
}

impl From<PrepareError> for GpuError {
    fn from(e: PrepareError) -> Self {
        match e {
            PrepareError::Interp(e) => GpuError::Input(e),
            PrepareError::Invalid(m) => GpuError::Invalid(m),
        }
    }
}
