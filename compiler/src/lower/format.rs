//! Storage formats of projection weights.
//!
//! Every tensor is f32 except the weight operand of a projection ([`Op::Linear`](crate::graph::Op::Linear)),
//! which lowering may give a quantized [`WeightFormat`] (see [`super::Options::formats`]) and the
//! wgpu back end f16 ([`crate::back::wgsl::Options::f16_weights`]); the plan records it in
//! [`super::Value::format`], and each engine's projection reads that operand in its format (the
//! WGSL kernel through format-specific accessors, [`crate::back::wgsl::projection::bindings`]).
//! The interpreter (and so every load-time fold) still works on the f32 values, which are the
//! exact dequantization of the blocks.
//!
//! - **`F32`**: the graph's `[rows, k]` weight; the wgpu back end reads it transposed to `[k, w]`
//!   (see [`crate::back::wgsl::projection`]), as `array<vec4<f32>>`.
//! - **`F16`** (wgpu only): that transposed layout as `array<vec4<f16>>` (the module `enable`s
//!   `f16`; the arithmetic stays f32). Needs the adapter feature `SHADER_F16`. Halves the weight
//!   bytes, at a rounding error of at most 2^-11 relative per weight.
//! - **`Q8_0`, `Q4_1`**: GGUF's blocks of 32 consecutive elements of a row of the *untransposed*
//!   `[rows, k]` weight (`k` a multiple of 32), repacked at load time into one `array<u32>` so every
//!   load is aligned: row `c` starts at word `c * stride` and holds its `nb = k / 32` block scales
//!   as f32 bits, then (Q4_1 only) its `nb` block minimums as f32 bits, then its quants — Q8_0:
//!   8 words per block, element `4i + j` of the block in byte `j` of word `i` (two's complement);
//!   Q4_1: 4 words per block, byte `j` of the block (in word `j / 4`, byte `j % 4`) holding element
//!   `j` in its low nibble and element `j + 16` in its high one, as GGUF stores them. So
//!   `stride = 9 * nb` words (36 bytes per 32 weights) for Q8_0 and `6 * nb` (24 bytes) for Q4_1,
//!   against 128 bytes in f32. Scales are widened from f16 to f32 at load time (exactly), which
//!   keeps them aligned and lets a load-time scale fold multiply them. An element is
//!   `q * scale` (Q8_0, `q` signed) or `q * scale + min` (Q4_1, `q` in 0..15).

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use serde::{Deserialize, Serialize};

/// How a projection weight is stored on the device (see the module docs for each layout).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WeightFormat {
    /// 32-bit floats.
    #[default]
    F32,
    /// 16-bit floats (transposed layout, like `F32`).
    F16,
    /// GGUF Q8_0 blocks (untransposed rows).
    Q8_0,
    /// GGUF Q4_1 blocks (untransposed rows).
    Q4_1,
}

/// Elements per quantized block.
pub const BLOCK: usize = 32;

impl WeightFormat {
    /// Whether this is a block quantization (read in the untransposed layout).
    pub fn quantized(self) -> bool {
        matches!(self, WeightFormat::Q8_0 | WeightFormat::Q4_1)
    }

    /// Whether this is the default (serde skips it, so f32 plans serialize as before).
    pub fn is_f32(&self) -> bool {
        *self == WeightFormat::F32
    }

    /// 32-bit words per row of `k` elements in the device layout of a quantized format (`k` a
    /// multiple of [`BLOCK`]); `None` for a float format.
    pub fn row_words(self, k: usize) -> Option<usize> {
        let nb = k / BLOCK;
        match self {
            WeightFormat::Q8_0 => Some(9 * nb),
            WeightFormat::Q4_1 => Some(6 * nb),
            _ => None,
        }
    }

    /// Bytes on the device of a `[rows, k]` weight (f32/f16: the plain count, before any padding).
    pub fn bytes(self, rows: usize, k: usize) -> u64 {
        match self {
            WeightFormat::F32 => 4 * (rows * k) as u64,
            WeightFormat::F16 => 2 * (rows * k) as u64,
            q => 4 * (rows * q.row_words(k).unwrap_or(0)) as u64,
        }
    }

    /// The name as flags and GGUF spell it (`f32`, `f16`, `Q8_0`, `Q4_1`).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4_1 => "Q4_1",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
