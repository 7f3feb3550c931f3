//! kiln-runtime: loading weights and inputs, and executing compiled models.
//!
//! Today the runtime reads checkpoints (safetensors) through a spec's weight map and reads/writes
//! tensor files; execution goes through the compiler's reference interpreter.
#![warn(missing_docs)]

pub mod weights;

pub use weights::{Checkpoint, WeightError, load_params, read_tensors, write_tensors};

pub mod gpu;

pub use gpu::{Gpu, GpuError, GpuModel};
