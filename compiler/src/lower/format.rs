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
//! - **`Q5_0`**: GGUF's blocks of 32 (`k` a multiple of 32), per row `nb` scales as f32, then
//!   the `nb` words of fifth bits (bit `j` of a block's word is element `j`'s), then Q4_1's
//!   quant words (4 per block, the low four bits of each element as in Q4_1). `stride = 6 * nb`
//!   (24 bytes per 32 weights; the file has 22). An element is `(q - 16) * scale`, `q` the 5-bit
//!   value in 0..31.
//! - **`Q4_K`**: GGUF's super-blocks of 256 (`k` a multiple of 256, `ns = k / 256`), per row the
//!   `ns` super-block scales `d` as f32, the `ns` super-block minimum scales `dmin` as f32, then
//!   per super-block its 12 bytes of packed 6-bit sub-block scales and minimums as in the file (3
//!   words; see `kiln_runtime::gguf::GgmlType::Q4_K`), then per super-block its 128 bytes of
//!   nibbles as in the file (32 words: sub-blocks of 32 `2c` and `2c + 1` in the low and high
//!   nibbles of bytes `32c..32c + 32`). `stride = 37 * ns` (148 bytes per 256 weights; the file
//!   has 144). Element `i` of sub-block `j` is `(d * sc_j) * q - dmin * m_j`; the 6-bit `sc_j`
//!   and `m_j` are unpacked in registers.
//! - **`Q6_K`**: GGUF's super-blocks of 256, per row the `ns` scales `d` as f32, then per
//!   super-block its 16 signed 8-bit scales (4 words, one scale per 16 elements), then per
//!   super-block its 128 bytes `ql` of low nibbles (32 words), then per super-block its 64 bytes
//!   `qh` of high bit pairs (16 words), both as in the file: in each half `h` of 128 elements,
//!   element `32c + l` (`c` in 0..4) has its low four bits in nibble `c / 2` of `ql` byte
//!   `64h + 32 (c % 2) + l` and its high two at bit `2c` of `qh` byte `32h + l`. `stride = 53 *
//!   ns` (212 bytes per 256 weights; the file has 210). Element `e` is `(d * sc_{e / 16}) * (q -
//!   32)`, `q` the 6-bit value.
//!
//! Every quantized layout starts a row with its floats (the scales and minimums a scaling fold
//! multiplies, [`WeightFormat::row_floats`]). Every format is read 32 elements at a time: a
//! *block* is 32 consecutive elements of a row (a sub-block of a K-quant super-block), with an
//! f32 scale, for Q4_1 and Q4_K a minimum term, and integer quants.

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
    /// GGUF Q5_0 blocks (untransposed rows).
    Q5_0,
    // GGUF's name (ggml's `GGML_TYPE_Q4_K`), as the flags and files spell it.
    #[allow(non_camel_case_types)]
    /// GGUF Q4_K super-blocks (untransposed rows).
    Q4_K,
    // GGUF's name (ggml's `GGML_TYPE_Q6_K`), as the flags and files spell it.
    #[allow(non_camel_case_types)]
    /// GGUF Q6_K super-blocks (untransposed rows).
    Q6_K,
}

/// Elements per quantized block (a K-quant's sub-block).
pub const BLOCK: usize = 32;

/// Elements per K-quant super-block.
pub const SUPER_BLOCK: usize = 256;

impl WeightFormat {
    /// Whether this format holds every value of `other` exactly, so a weight of `other` can be
    /// re-encoded in it at load without a change: itself, and Q5_0 in Q8_0 (Q5_0's quants,
    /// -16..15 times the block's scale, are Q8_0's at the same scale). Stacked projections whose
    /// parts differ in format (llama.cpp's mixes give a Q5_0 query and key beside a Q8_0 value
    /// where rows are not whole K-quant super-blocks) are stacked in such a format.
    pub fn holds_exactly(self, other: WeightFormat) -> bool {
        self == other || (self == WeightFormat::Q8_0 && other == WeightFormat::Q5_0)
    }

    /// The format among `formats` that holds all of them exactly ([`WeightFormat::holds_exactly`]),
    /// if any.
    pub fn common_exact(formats: &[WeightFormat]) -> Option<WeightFormat> {
        formats.iter().copied().find(|f| formats.iter().all(|&o| f.holds_exactly(o)))
    }

    /// Whether this is a block quantization (read in the untransposed layout).
    pub fn quantized(self) -> bool {
        !matches!(self, WeightFormat::F32 | WeightFormat::F16)
    }

    /// Whether a block's value has a minimum term besides its scaled quants (Q4_1, Q4_K).
    pub fn has_mins(self) -> bool {
        matches!(self, WeightFormat::Q4_1 | WeightFormat::Q4_K)
    }

    /// The elements a row's length must be a multiple of: 256 for the K-quants, 32 for the
    /// other quantized formats, 1 for floats.
    pub fn row_multiple(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 => 1,
            WeightFormat::Q4_K | WeightFormat::Q6_K => SUPER_BLOCK,
            _ => BLOCK,
        }
    }

    /// Whether this is the default (serde skips it, so f32 plans serialize as before).
    pub fn is_f32(&self) -> bool {
        *self == WeightFormat::F32
    }

    /// 32-bit words per row of `k` elements in the device layout of a quantized format; `None`
    /// for a float format or a `k` that is not a multiple of [`WeightFormat::row_multiple`].
    pub fn row_words(self, k: usize) -> Option<usize> {
        if !self.quantized() || !k.is_multiple_of(self.row_multiple()) {
            return None;
        }
        let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
        Some(match self {
            WeightFormat::Q8_0 => 9 * nb,
            WeightFormat::Q4_1 | WeightFormat::Q5_0 => 6 * nb,
            WeightFormat::Q4_K => 37 * ns,
            _ => 53 * ns,
        })
    }

    /// The f32 words a row of `k` elements starts with (its scales and minimums; what a scaling
    /// multiplies): `None` as for [`WeightFormat::row_words`].
    pub fn row_floats(self, k: usize) -> Option<usize> {
        self.row_words(k)?;
        let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
        Some(match self {
            WeightFormat::Q4_1 => 2 * nb,
            WeightFormat::Q4_K => 2 * ns,
            WeightFormat::Q6_K => ns,
            _ => nb,
        })
    }

    /// Bytes on the device of a `[rows, k]` weight (f32/f16: the plain count, before any padding).
    pub fn bytes(self, rows: usize, k: usize) -> u64 {
        match self {
            WeightFormat::F32 => 4 * (rows * k) as u64,
            WeightFormat::F16 => 2 * (rows * k) as u64,
            q => 4 * (rows * q.row_words(k).unwrap_or(0)) as u64,
        }
    }

    /// The name as flags and GGUF spell it (`f32`, `f16`, `Q8_0`, `Q4_1`, `Q5_0`, `Q4_K`, `Q6_K`).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4_1 => "Q4_1",
            WeightFormat::Q5_0 => "Q5_0",
            WeightFormat::Q4_K => "Q4_K",
            WeightFormat::Q6_K => "Q6_K",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
