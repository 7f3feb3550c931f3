//! kiln-runtime: loading weights and inputs, and executing compiled models.
//!
//! The runtime reads checkpoints (safetensors or GGUF) through a spec's weight map, reads and
//! writes tensor files, tokenizes text (and renders chat templates), and executes compiled plans
//! on wgpu ([`gpu`]) or on the host's cores ([`cpu`]), both after the shared preparation of
//! [`prepare`].
#![warn(missing_docs)]
// No panics on paths that input reaches: errors are values, and slices are read with `get`,
// patterns and iterators rather than `[]`. The few documented invariants that remain `expect`s or
// indexing say why they hold (`#[expect(..., reason)]`); tests may unwrap and index (clippy.toml).
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod batching;
pub mod costs;
pub mod cpu;
pub mod device;
pub mod engine;
pub mod gguf;
pub mod import;
pub mod measure;
pub mod model;
pub mod prepare;
pub mod progress;
pub mod quant;
pub mod tokenize;
pub mod train;
pub mod weights;

pub use gguf::{Gguf, GgufError};
pub use progress::{Phase, Progress};
pub use quant::QuantWeight;
pub use tokenize::{Batch, Message, TokenizeError, Tokenizer};

pub use weights::{Checkpoint, WeightError, load_params, load_params_with_blocks, read_tensors, write_tensors};

pub mod gpu;

pub use cpu::{CpuError, CpuModel, StepTimes};
pub use device::{Device, Loaded, Storage, Weights};
pub use gpu::{Clock, DeviceTensor, Gpu, GpuError, GpuModel, Profile};
pub use model::{Model, ModelError};

pub mod generate;
pub mod sample;
pub mod tune;

pub use engine::{BatchSeq, CpuEngine, Engine, GenerateError, GpuEngine, InterpEngine, Memory, Parked, Request};
pub use generate::{Session, Stats, Stop};
pub use gpu::DeviceSampler;
pub use sample::{BadSettings, Pick, Sampled, Sampler};

/// Where `scripts/fetch-models` caches the real models: `$KILN_DATA`, else
/// `$XDG_CACHE_HOME/kiln`, else `$HOME/.cache/kiln`; `None` when none of them is set.
pub fn data_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    if let Some(dir) = std::env::var_os("KILN_DATA") {
        return Some(dir.into());
    }
    let cache = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    Some(cache.join("kiln"))
}
