//! kiln-runtime: loading weights and inputs, and executing compiled models.
//!
//! The runtime reads checkpoints (safetensors or GGUF) through a spec's weight map, reads and
//! writes tensor files, tokenizes text (and renders chat templates), and executes compiled plans
//! on wgpu.
#![warn(missing_docs)]

pub mod gguf;
pub mod tokenize;
pub mod weights;

pub use gguf::{Gguf, GgufError};
pub use tokenize::{Batch, Message, TokenizeError, Tokenizer};

pub use weights::{Checkpoint, WeightError, load_params, read_tensors, write_tensors};

pub mod gpu;

pub use gpu::{Gpu, GpuError, GpuModel};

pub mod generate;

pub use generate::{Engine, GenerateError, Sampler, Session, Stats};
