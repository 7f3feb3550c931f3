//! Dot products of block-quantized weight rows with f32 activations.
//!
//! [`super::qdot`] quantizes the activations to int8 (llama.cpp's scheme), which moves a model's
//! logits by up to half a quantization step per element: enough to flip a greedy choice between
//! two close logits. The kernels here keep the activations in f32 instead: each weight block is
//! dequantized in registers exactly as [`crate::quant::QuantWeight::dequantize`] does it (Q8_0:
//! `q * d`; Q4_1: `q * d + m`, a multiply then an add, never fused) and multiplied with the f32
//! activations by FMAs into f32 accumulators. So the result is the dot product of the dequantized
//! weight row with `x`, the f32 products the interpreter computes, up to the order of the sums.
//!
//! The weights are read in the device layout of [`kiln_compiler::lower::format`] (per row the
//! block scales, Q4_1's minimums, then the quants as `u32` words). Q5_0, Q4_K and Q6_K are read
//! by the same drivers, a block of 32 at a time, dequantized in registers too (exactly the
//! values of the portable [`crate::quant::block`]). Two shapes of work:
//!
//! - **Decode** ([`dot_rows_f32`], and [`gemm_rows_f32`] with a few activation rows: up to 4
//!   with AVX-512, 3 with AVX2): tiles of [`TILE`] weight rows stream through once. Each
//!   activation block is loaded into registers once per tile and serves its rows; each weight
//!   block is dequantized into registers once and serves every activation row. The weight words
//!   are also prefetched two tiles ahead (the hardware prefetcher follows a tile's interleaved row
//!   streams poorly), so the product runs at about the speed the weight's bytes arrive from memory.
//! - **Prefill** ([`gemm_rows_f32`] with more activation rows): a tile of weight rows (12 with
//!   AVX-512, 8 otherwise: [`Impl::prefill_rows`]) is dequantized once into an f32 buffer that
//!   stays in L1 (a chunk of at most 768 elements of each row at a time), then a register-blocked
//!   micro-kernel (6 weight rows by 4 activation rows with AVX-512: 24 accumulators, 10 loads for
//!   24 FMAs, which ran SmolLM2's 32-token prefill 20-30% faster than 4 by 4's 8 loads for 16; 4
//!   by 2 with AVX2) runs over it for each group of activation rows, so the dequantization is
//!   shared by all of them and the inner loop is loads and FMAs. The accumulators, one vector per (activation row, weight row), are summed across
//!   lanes once per pair by a transposing reduction (4 vectors to 4 sums in a few shuffles).
//!   Activation rows aligned to 64 bytes run about 10% faster here.
//!
//! Implementations, the best this CPU runs chosen at run time ([`Implementation::best`],
//! [`kernel_name`]):
//!
//! - **`avx512`** (AVX-512F with AVX2 and FMA): 16 lanes. Q8_0 bytes are sign-extended to `i32`
//!   (`vpmovsxbd`), converted and multiplied by the scale; Q4_1 looks its nibbles up in a table of
//!   the block's 16 values (`i * d + m`, computed once per block) by `vpermps`, which reads only
//!   the low 4 bits of each index, so the low nibbles need no mask and the high ones one shift.
//!   Q5_0 adds its fifth bits under a lane mask of the block's bit word; Q4_K and Q6_K shift
//!   their nibbles and bit pairs out by the sub-block's position, with the sub-block scales
//!   unpacked once per block (Gemma 3 270M decodes 4x faster than through the buffer).
//! - **`avx2`** (AVX2 and FMA): 8 lanes; Q4_1's nibbles are masked, shifted and converted.
//! - **`neon`** (AArch64): 4 lanes, widening moves and conversions; the K-quants' bits shifted
//!   out per byte (no prefetching).
//! - **`scalar`**: portable, one row dequantized at a time and summed in order; the reference the
//!   others are tested against (it equals the in-order f32 dot of the dequantized row exactly).
//!
//! Threading is the caller's: split the weight (and the outputs) by rows.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::isa::{Implementation, Isa};
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::BLOCK;

/// Weight rows a SIMD kernel computes together when streaming (decode).
pub const TILE: usize = 4;

/// The most activation rows the streaming kernels take (in groups of the ISA's `DIRECT`, each
/// dequantizing a tile's weights again from L1); more go through the prefill kernels' buffer.
const STREAMED: usize = 16;

/// The most elements of a row the prefill kernels dequantize into their buffer at once (so that
/// a tile of rows stays in L1 with the activations).
const KC: usize = 768;

/// How many tiles ahead of the one being computed the streaming kernels prefetch the weight words.
const PREFETCH: usize = 2;

/// Sixteen floats on a cache line: the dequantization buffer's unit, so its rows are aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// An implementation of [`gemm_rows_f32`] and [`dot_rows_f32`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Impl {
    /// Portable Rust (the reference).
    Scalar,
    /// x86-64 AVX2 and FMA.
    Avx2,
    /// x86-64 AVX-512F (with AVX2 and FMA).
    Avx512,
    /// AArch64 NEON.
    Neon,
}

impl Implementation for Impl {
    const ALL: &'static [Impl] = &[Impl::Avx512, Impl::Avx2, Impl::Neon, Impl::Scalar];
    const PORTABLE: Impl = Impl::Scalar;

    fn name(self) -> &'static str {
        match self {
            Impl::Scalar => "scalar",
            Impl::Avx2 => "avx2",
            Impl::Avx512 => "avx512",
            Impl::Neon => "neon",
        }
    }

    fn runs_on(self, isa: Isa) -> bool {
        match self {
            Impl::Scalar => true,
            Impl::Avx2 => isa.avx2,
            Impl::Avx512 => isa.avx512f && isa.avx2,
            Impl::Neon => isa.neon,
        }
    }
}

impl Impl {
    /// The weight rows of its prefill tile (see the module docs): a caller splitting a product's
    /// rows over threads keeps each share a multiple of it, so no share ends on a part tile.
    pub fn prefill_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Impl::Avx512 => avx512::PREFILL_ROWS,
            #[cfg(target_arch = "x86_64")]
            Impl::Avx2 => avx2::PREFILL_ROWS,
            #[cfg(target_arch = "aarch64")]
            Impl::Neon => neon::PREFILL_ROWS,
            _ => 1,
        }
    }
}

/// The name of the implementation [`gemm_rows_f32`] uses (`"avx512"`, `"avx2"`, `"neon"` or
/// `"scalar"`).
pub fn kernel_name() -> &'static str {
    Impl::best().name()
}

/// `out[r] = dot(row r, x)` for `r` in `0..out.len()`, of a block-quantized weight of `k`
/// elements a row in the device layout whose row `r` starts at `words[r * format.row_words(k)]`,
/// with `x` (`k` floats) in f32.
///
/// Shapes that do not fit give NaN rather than a panic: every output when `format` is not
/// quantized, `k` is not whole blocks of the format (32, or 256 for the K-quants) or `x.len()` is not `k`, and the rows past the end of
/// `words`. With `k = 0` every dot product is 0. This is [`gemm_rows_f32`] with one activation row.
pub fn dot_rows_f32(format: WeightFormat, words: &[u32], k: usize, x: &[f32], out: &mut [f32]) {
    dot_rows_f32_with(Impl::best(), format, words, k, x, out);
}

/// [`dot_rows_f32`] with the implementation `imp` ([`Impl::Scalar`] instead if this machine
/// cannot run it); for tests and benchmarks.
pub fn dot_rows_f32_with(imp: Impl, format: WeightFormat, words: &[u32], k: usize, x: &[f32], out: &mut [f32]) {
    let rows = out.len();
    gemm_rows_f32_with(imp, format, words, k, x, 1, out, rows);
}

/// `out[i * rows + r] = dot(weight row r, xs row i)` for `i` in `0..m` and `r` in `0..rows`:
/// the product of `m` activation rows (`xs`, `m` rows of `k` floats, row-major) with the
/// transpose of a `[rows, k]` block-quantized weight in the device layout (row `r` at
/// `words[r * format.row_words(k)]`); `out` holds `m` rows of `rows`.
///
/// With a few activation rows (up to 4 with AVX-512) the weight streams through once with each
/// block dequantized in registers; with more, tiles of weight rows are dequantized once into an L1
/// buffer and reused by every activation row (see the module docs). To thread it, split the
/// weight by rows and give each part its own `out`.
///
/// Shapes that do not fit give NaN rather than a panic: all of `out` when `format` is not
/// quantized, `k` is not whole blocks of the format, `xs.len()` is not `m * k` or `out.len()` is not
/// `m * rows`; the outputs of the rows past the end of `words`. With `k = 0` every output is 0.
pub fn gemm_rows_f32(
    format: WeightFormat,
    words: &[u32],
    k: usize,
    xs: &[f32],
    m: usize,
    out: &mut [f32],
    rows: usize,
) {
    gemm_rows_f32_with(Impl::best(), format, words, k, xs, m, out, rows);
}

/// [`gemm_rows_f32`] with the implementation `imp` ([`Impl::Scalar`] instead if this machine
/// cannot run it); for tests and benchmarks.
#[expect(clippy::too_many_arguments, reason = "gemm_rows_f32's operands and the implementation")]
pub fn gemm_rows_f32_with(
    imp: Impl,
    format: WeightFormat,
    words: &[u32],
    k: usize,
    xs: &[f32],
    m: usize,
    out: &mut [f32],
    rows: usize,
) {
    let fits = k.is_multiple_of(BLOCK) && m.checked_mul(k) == Some(xs.len()) && m.checked_mul(rows) == Some(out.len());
    let Some(stride) = format.row_words(k).filter(|_| fits) else {
        out.fill(f32::NAN);
        return;
    };
    let nb = k / BLOCK;
    if nb == 0 {
        out.fill(0.0);
        return;
    }
    if m == 0 || rows == 0 {
        return;
    }
    // The rows that exist; the others' outputs are NaN.
    let valid = rows.min(words.len() / stride);
    if valid < rows {
        for o in out.chunks_exact_mut(rows) {
            o.get_mut(valid..).unwrap_or_default().fill(f32::NAN);
        }
    }
    let job = Job { format, words: words.get(..valid * stride).unwrap_or_default(), stride, nb, k, xs, m, rows };
    run_job(imp, &job, out);
}

/// Runs `job` into `out` with `imp` ([`Impl::Scalar`] instead if this machine cannot run it).
/// The SIMD drivers check the job's shapes (and assert them in debug builds).
fn run_job(imp: Impl, job: &Job<'_>, out: &mut [f32]) {
    let imp = if imp.is_available() { imp } else { Impl::Scalar };
    match imp {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `imp` is available, so the CPU has the kernel's features (the driver checks
        // the job's shapes in every build, and asserts them in debug builds).
        Impl::Avx512 => unsafe { avx512::kernels::gemm(job, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::Avx2 => unsafe { avx2::kernels::gemm(job, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::Neon => unsafe { neon::kernels::gemm(job, out) },
        _ => scalar(job, out),
    }
}

/// A product whose shapes were checked: `xs` holds `m` rows of `k = 32 nb` floats, `words` whole
/// rows of `stride` words (the rows that exist), and `out` `m` rows of `rows >= words / stride`.
struct Job<'a> {
    /// The weight's format (quantized).
    format: WeightFormat,
    words: &'a [u32],
    stride: usize,
    nb: usize,
    k: usize,
    xs: &'a [f32],
    m: usize,
    /// The row stride of `out`.
    rows: usize,
}

/// A weight row (`nb` blocks of `format`) dequantized into `w` (`32 nb` floats), as
/// `QuantWeight::dequantize` computes it (Q8_0 and Q4_1 directly, the other formats through
/// [`crate::quant::block`]).
fn dequant_row(format: WeightFormat, nb: usize, row: &[u32], w: &mut [f32]) {
    let (scales, rest) = row.split_at(nb.min(row.len()));
    let scales = scales.iter().map(|&d| f32::from_bits(d));
    match format {
        WeightFormat::Q4_1 => {
            let (mins, quants) = rest.split_at(nb.min(rest.len()));
            let mins = mins.iter().map(|&m| f32::from_bits(m));
            for (((d, m), q), w) in scales.zip(mins).zip(quants.chunks_exact(4)).zip(w.chunks_exact_mut(BLOCK)) {
                // Byte j holds element j (low nibble) and element j + 16 (high nibble).
                let (lo, hi) = w.split_at_mut(BLOCK / 2);
                for ((&b, lo), hi) in bytemuck::cast_slice::<u32, u8>(q).iter().zip(lo).zip(hi) {
                    *lo = f32::from(b & 0x0f) * d + m;
                    *hi = f32::from(b >> 4) * d + m;
                }
            }
        }
        WeightFormat::Q8_0 => {
            for ((d, q), w) in scales.zip(rest.chunks_exact(8)).zip(w.chunks_exact_mut(BLOCK)) {
                for (&b, w) in bytemuck::cast_slice::<u32, u8>(q).iter().zip(w) {
                    *w = f32::from(b as i8) * d;
                }
            }
        }
        _ => {
            for (b, w) in w.chunks_exact_mut(BLOCK).enumerate() {
                dequant_block(format, row, nb, b, w);
            }
        }
    }
}

/// Block `b` of a row (`nb` blocks of `format`) dequantized into `w` (32 floats) through
/// [`crate::quant::block`]; NaN if the row is too short (which the callers' checks exclude).
fn dequant_block(format: WeightFormat, row: &[u32], nb: usize, b: usize, w: &mut [f32]) {
    let Some(blk) = crate::quant::block(format, row, BLOCK * nb, b) else {
        w.fill(f32::NAN);
        return;
    };
    for (i, (w, &q)) in w.iter_mut().zip(&blk.q).enumerate() {
        let scale = if i < BLOCK / 2 { blk.scale[0] } else { blk.scale[1] };
        *w = if format.has_mins() { q as f32 * scale + blk.min } else { q as f32 * scale };
    }
}

/// What the blocks of a super-block (8 blocks, 256 elements) share, unpacked once per
/// super-block rather than once per block: a Q4_K row's 8 pairs of scale and minimum term
/// ([`q4_k_factors`]), a Q6_K row's 8 pairs of scales, each block's two halves' ([`q6_k_scales`]);
/// nothing for the other formats. The streaming and dequantizing drivers keep one per weight row
/// and hand a block's kernel its row's.
type Shared = [(f32, f32); 8];

/// Whether the format tagged `F` has a [`Shared`] per super-block.
const fn has_shared(tag: u8) -> bool {
    tag == F_Q4_K || tag == F_Q6_K
}

/// The scales and minimum terms of super-block `s` of a Q4_K row of `nb` blocks read through
/// `word`: block `j`'s `(d * sc_j, -(dmin * m_j))`, as [`crate::quant::block`] gives them. The
/// scalar side of the SIMD modules' register dequantization, once per super-block: its 12 bytes
/// of 6-bit pairs are three words, unpacked four bytes at a time as `gguf::q4_k_scale_min` does
/// it a byte at a time (blocks `j < 4` from the low 6 bits of bytes `j` and `j + 4`, blocks `j >=
/// 4` from the nibbles of byte `j + 4` and the top two bits of bytes `j - 4` and `j`).
#[cfg(any(target_arch = "aarch64", all(test, target_arch = "x86_64")))]
fn q4_k_factors(word: impl Fn(usize) -> u32, nb: usize, s: usize) -> Shared {
    let ns = nb / 8;
    let packed = 2 * ns + 3 * s;
    let (w0, w1, w2) = (word(packed), word(packed + 1), word(packed + 2));
    let low6 = 0x3f3f_3f3f;
    // Each byte's top two bits moved to bits 4 and 5 (what moves in from the next byte masked).
    let top = |w: u32| (w >> 2) & 0x3030_3030;
    let scales = [w0 & low6, (w2 & 0x0f0f_0f0f) | top(w0)];
    let mins = [w1 & low6, ((w2 >> 4) & 0x0f0f_0f0f) | top(w1)];
    let (d, dmin) = (f32::from_bits(word(s)), f32::from_bits(word(ns + s)));
    let byte = |w: &[u32; 2], j: usize| {
        let w = if j < 4 { w[0] } else { w[1] };
        ((w >> (8 * (j % 4))) & 0xff) as f32
    };
    std::array::from_fn(|j| (d * byte(&scales, j), -(dmin * byte(&mins, j))))
}

/// [`q4_k_factors`] by AVX2, bit for bit: the 8 scales and the 8 minima widened, converted and
/// multiplied 8 at a time, then interleaved into pairs, inlined into the kernels. (The scalar
/// form's 16 byte extractions, conversions and products a super-block cost as much as
/// dequantizing its 256 quants: a 640 x 1024 Q4_K decode GEMV on one core of the Intel Xeon of
/// 2026-11-28 ran at 3.6 GB/s with it, 7.5 GB/s with this and AVX-512's table lookup of the
/// blocks' values.)
///
/// # Safety
///
/// The CPU has AVX2; `row` is a whole Q4_K row of `nb` blocks and `s < nb / 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q4_k_factors_avx2(row: *const u32, nb: usize, s: usize) -> Shared {
    use std::arch::x86_64::*;
    let ns = nb / 8;
    let packed = 2 * ns + 3 * s;
    // SAFETY: words `s`, `ns + s` and `2 ns + 3 s .. + 3` of a row of `37 ns` words (`s < ns`):
    // the caller's whole row.
    let [w0, w1, w2, d, dmin] = unsafe {
        [
            row.add(packed).read(),
            row.add(packed + 1).read(),
            row.add(packed + 2).read(),
            row.add(s).read(),
            row.add(ns + s).read(),
        ]
    };
    // The bytes as `q4_k_factors` unpacks them, blocks 0-3 in the low word, 4-7 in the high.
    let low6 = 0x3f3f_3f3f;
    let top = |w: u32| (w >> 2) & 0x3030_3030;
    let scales = u64::from(w0 & low6) | (u64::from((w2 & 0x0f0f_0f0f) | top(w0)) << 32);
    let mins = u64::from(w1 & low6) | (u64::from(((w2 >> 4) & 0x0f0f_0f0f) | top(w1)) << 32);
    let (d, dmin) = (f32::from_bits(d), f32::from_bits(dmin));
    let widen = |bytes: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)));
    let scale = _mm256_mul_ps(_mm256_set1_ps(d), widen(scales));
    // `-(dmin * m)`: the product's sign flipped.
    let min = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), widen(mins)), _mm256_set1_ps(-0.0));
    // Per 128-bit half, pairs (0, 1) and (4, 5), then (2, 3) and (6, 7): reordered by halves.
    let (lo, hi) = (_mm256_unpacklo_ps(scale, min), _mm256_unpackhi_ps(scale, min));
    let mut pairs = [0f32; 16];
    // SAFETY: `pairs` holds 16 floats.
    unsafe {
        _mm256_storeu_ps(pairs.as_mut_ptr(), _mm256_permute2f128_ps::<0x20>(lo, hi));
        _mm256_storeu_ps(pairs.as_mut_ptr().add(8), _mm256_permute2f128_ps::<0x31>(lo, hi));
    }
    let [s0, m0, s1, m1, s2, m2, s3, m3, s4, m4, s5, m5, s6, m6, s7, m7] = pairs;
    [(s0, m0), (s1, m1), (s2, m2), (s3, m3), (s4, m4), (s5, m5), (s6, m6), (s7, m7)]
}

/// The [`Shared`] of super-block `s` of the row at `row` (`nb` blocks of the format tagged `F`).
///
/// # Safety
///
/// `row` is a whole row of the layout for `nb` blocks and `s < nb / 8`.
#[inline(always)]
unsafe fn shared<const F: u8>(row: *const u32, nb: usize, s: usize) -> Shared {
    debug_assert!(s < nb.div_ceil(8), "super-block {s} of {nb} blocks");
    #[cfg(target_arch = "x86_64")]
    if F == F_Q4_K {
        // On x86-64 the callers are the AVX2 and AVX-512 modules' kernels, which run only where
        // the CPU has AVX2.
        debug_assert!(crate::cpu::isa::isa().avx2, "a SIMD kernel without AVX2");
        // SAFETY: the CPU has AVX2 (above); the row and `s` are the caller's.
        return unsafe { q4_k_factors_avx2(row, nb, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if F == F_Q6_K {
        debug_assert!(crate::cpu::isa::isa().avx2, "a SIMD kernel without AVX2");
        // SAFETY: as above.
        return unsafe { q6_k_scales_avx2(row, nb, s) };
    }
    #[cfg(target_arch = "aarch64")]
    if F == F_Q4_K {
        // SAFETY: `q4_k_factors` reads words `s`, `ns + s` and `2 ns + 3 s .. + 3` of a Q4_K
        // row of `37 ns` words (`s < ns = nb / 8`): the caller's whole row.
        return q4_k_factors(|i| unsafe { row.add(i).read() }, nb, s);
    }
    #[cfg(target_arch = "aarch64")]
    if F == F_Q6_K {
        // SAFETY: `q6_k_scales` reads words `s` and `ns + 4 s .. + 4` of a Q6_K row of `53 ns`
        // words (`s < ns`; its blocks `8 s + j`, `j < 8`): the caller's whole row.
        return std::array::from_fn(|j| q6_k_scales(|i| unsafe { row.add(i).read() }, nb, 8 * s + j));
    }
    let _ = row;
    [(0.0, 0.0); 8]
}

/// [`q6_k_scales`] of super-block `s`'s 8 blocks by AVX2, bit for bit: its 16 int8 scales widened,
/// converted and multiplied by `d` 8 at a time (scale `2 j` and `2 j + 1` are block `j`'s pair).
/// (Unpacked a block at a time on the scalar side, two conversions and products a block slowed
/// a 640 x 2048 Q6_K decode GEMV to ~6 GB/s on one core of the Intel Xeon, 2026-11-28.)
///
/// # Safety
///
/// The CPU has AVX2; `row` is a whole Q6_K row of `nb` blocks and `s < nb / 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q6_k_scales_avx2(row: *const u32, nb: usize, s: usize) -> Shared {
    use std::arch::x86_64::*;
    let ns = nb / 8;
    // SAFETY: word `s` and words `ns + 4 s .. + 4` of a row of `53 ns` words (`s < ns`): the
    // caller's whole row.
    let (d, scales) = unsafe { (row.add(s).read(), _mm_loadu_si128(row.add(ns + 4 * s).cast::<__m128i>())) };
    let d = _mm256_set1_ps(f32::from_bits(d));
    let scaled = |bytes: __m128i| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    let mut all = [0f32; 16];
    // SAFETY: `all` holds 16 floats.
    unsafe {
        _mm256_storeu_ps(all.as_mut_ptr(), scaled(scales));
        _mm256_storeu_ps(all.as_mut_ptr().add(8), scaled(_mm_srli_si128::<8>(scales)));
    }
    let [a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7] = all;
    [(a0, b0), (a1, b1), (a2, b2), (a3, b3), (a4, b4), (a5, b5), (a6, b6), (a7, b7)]
}

/// The scales of block `b`'s two halves in a Q6_K row of `nb` blocks read through `word`: `d`
/// times the int8 scales `2 (b % 8)` and `2 (b % 8) + 1` of its super-block, as
/// [`crate::quant::block`] gives them.
#[cfg(any(target_arch = "aarch64", all(test, target_arch = "x86_64")))]
fn q6_k_scales(word: impl Fn(usize) -> u32, nb: usize, b: usize) -> (f32, f32) {
    let (ns, s, c8) = (nb / 8, b / 8, b % 8);
    let d = f32::from_bits(word(s));
    // Bytes 2 c8 and 2 c8 + 1 of the super-block's 16 scales: one half of a word.
    let pair = word(ns + 4 * s + c8 / 2) >> (16 * (c8 % 2));
    (d * f32::from(pair as u8 as i8), d * f32::from((pair >> 8) as u8 as i8))
}

/// The kernels' format parameter (a const generic): Q8_0 and Q4_1 have their own SIMD
/// dequantization (`q8`, `q4`); the others share each ISA's `kquant`.
const F_Q8_0: u8 = 0;
/// See [`F_Q8_0`].
const F_Q4_1: u8 = 1;
/// See [`F_Q8_0`].
const F_Q5_0: u8 = 2;
/// See [`F_Q8_0`].
const F_Q4_K: u8 = 3;
/// See [`F_Q8_0`].
const F_Q6_K: u8 = 4;

/// Words of 8 blocks of a row in the format of a kernel's format parameter (the layouts of
/// `kiln_compiler::lower::format`), for prefetching: at most 53 / 8 words (27 bytes) a block, so
/// a sweep of a line a block (block `b` at word `b * words / 8`, a shift, not a division, on the
/// streaming kernels' inner loop) reaches every line of a row.
const fn words_per_8_blocks(tag: u8) -> usize {
    match tag {
        F_Q8_0 => 72,
        F_Q4_1 | F_Q5_0 => 48,
        F_Q4_K => 37,
        _ => 53,
    }
}

/// The portable implementation: each weight row dequantized once, then dotted in order with every
/// activation row.
fn scalar(job: &Job<'_>, out: &mut [f32]) {
    let mut w = vec![0f32; job.k];
    for (r, row) in job.words.chunks_exact(job.stride).enumerate() {
        dequant_row(job.format, job.nb, row, &mut w);
        for (x, o) in job.xs.chunks_exact(job.k).zip(out.chunks_exact_mut(job.rows)) {
            if let Some(o) = o.get_mut(r) {
                *o = w.iter().zip(x).fold(0f32, |acc, (&w, &x)| acc + w * x);
            }
        }
    }
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[macro_use]
mod drivers;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{FORMATS, Rng, k_of};
    use crate::quant::QuantWeight;
    use kiln_compiler::tensor::Tensor;

    const KS: [usize; 6] = [32, 64, 96, 576, 800, 1536];

    /// The row lengths tested for `format`: [`KS`] (and Gemma's 640), or for the K-quants, whose
    /// rows are whole super-blocks of 256, 256 to 1536.
    fn ks(format: WeightFormat) -> Vec<usize> {
        match format.row_multiple() {
            32 => KS.iter().copied().chain([640]).collect(),
            _ => vec![256, 512, 768, 1536],
        }
    }

    /// Across the prefill tiles' edges (8 and 12 rows) and the streaming tiles' (4).
    const ROWS: [usize; 12] = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 24, 33];
    /// Activation rows: one group of the streaming kernels, several (a last one short on every
    /// ISA), up to `STREAMED`, and past it the buffered kernel's.
    const MS: [usize; 8] = [1, 2, 3, 4, 5, 7, 16, 17];

    fn gemm(imp: Impl, w: &QuantWeight, xs: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![-1.0; m * w.rows];
        gemm_rows_f32_with(imp, w.format, &w.words, w.k, xs, m, &mut out, w.rows);
        out
    }

    /// Per output (activation row, weight row): the f64 dot of the dequantized weight row with the
    /// activation row, and the sum of the products' magnitudes.
    fn reference(w: &QuantWeight, xs: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let deq = w.dequantize();
        let wf = deq.as_f32().unwrap();
        let (mut exact, mut mags) = (vec![], vec![]);
        for x in xs.chunks_exact(w.k) {
            for row in wf.chunks_exact(w.k) {
                let p = row.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b));
                exact.push(p.clone().sum());
                mags.push(p.map(f64::abs).sum());
            }
        }
        (exact, mags)
    }

    /// `got` within `1e-5 * sum|w x|` of `exact`.
    fn assert_close(got: &[f32], exact: &[f64], mags: &[f64], what: &str) {
        assert_eq!(got.len(), exact.len(), "{what}");
        for (o, ((&g, &e), &m)) in got.iter().zip(exact).zip(mags).enumerate() {
            let tol = 1e-5 * m + 1e-30;
            assert!((f64::from(g) - e).abs() <= tol, "{what} output {o}: {g} vs {e} (tolerance {tol})");
        }
    }

    /// Every available implementation, through the product and (one activation row at a time)
    /// the dot products, against the f64 dot of the dequantized weight.
    fn assert_all(w: &QuantWeight, xs: &[f32], m: usize, what: &str) {
        let (exact, mags) = reference(w, xs);
        for imp in Impl::available() {
            let what = format!("{what} {}", imp.name());
            let got = gemm(imp, w, xs, m);
            assert_close(&got, &exact, &mags, &what);
            let scalar = gemm(Impl::Scalar, w, xs, m);
            assert_close(&got, &scalar.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), &mags, &what);
            for (i, x) in xs.chunks_exact(w.k).enumerate() {
                let mut out = vec![-1.0; w.rows];
                dot_rows_f32_with(imp, w.format, &w.words, w.k, x, &mut out);
                let part = i * w.rows..(i + 1) * w.rows;
                assert_close(&out, &exact[part.clone()], &mags[part], &format!("{what} dot_rows row {i}"));
            }
        }
    }

    #[test]
    fn implementations_match_the_dequantized_dot() {
        assert!(Impl::available().contains(&Impl::Scalar));
        assert_eq!(Impl::available().first().copied(), Some(Impl::best()));
        let mut rng = Rng(7);
        for format in FORMATS {
            for k in ks(format) {
                for rows in ROWS {
                    let t = Tensor::f32(vec![rows, k], rng.values(rows * k));
                    let w = QuantWeight::quantize(format, &t).unwrap();
                    for m in MS {
                        let xs = rng.values(m * k);
                        assert_all(&w, &xs, m, &format!("{format} k={k} rows={rows} m={m}"));
                    }
                }
            }
        }
    }

    /// The scalar reference is exactly the in-order f32 dot of the dequantized rows.
    #[test]
    fn scalar_is_the_in_order_dot_of_the_dequantized_rows() {
        let mut rng = Rng(21);
        for format in FORMATS {
            let (rows, k, m) = (7, k_of(format, 576), 3);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![rows, k], rng.values(rows * k))).unwrap();
            let deq = w.dequantize();
            let xs = rng.values(m * k);
            let got = gemm(Impl::Scalar, &w, &xs, m);
            let mut want = vec![];
            for x in xs.chunks_exact(k) {
                for r in deq.as_f32().unwrap().chunks_exact(k) {
                    want.push(r.iter().zip(x).fold(0f32, |a, (&w, &x)| a + w * x));
                }
            }
            assert_eq!(got, want, "{format}");
        }
    }

    /// Raw random blocks (every Q8_0 byte, -128 included, and every nibble; scales and minimums of
    /// any sign), and weights of -128 everywhere against activations of ±1.
    #[test]
    fn raw_random_blocks() {
        let mut rng = Rng(99);
        for format in FORMATS {
            for k in ks(format) {
                let floats = format.row_floats(k).unwrap();
                let stride = format.row_words(k).unwrap();
                let rows = 9;
                let words = (0..rows * stride)
                    .map(|i| if i % stride < floats { rng.unit().to_bits() } else { rng.next() })
                    .collect();
                let w = QuantWeight { format, rows, k, words };
                for m in [1, 5] {
                    let xs: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
                    assert_all(&w, &xs, m, &format!("raw {format} k={k} m={m}"));
                }
                let words = (0..rows * stride).map(|i| if i % stride < floats { 1f32.to_bits() } else { 0x8080_8080 });
                let w = QuantWeight { format, rows, k, words: words.collect() };
                for v in [-1.0, 1.0] {
                    for m in [1, 4] {
                        let xs = vec![v; m * k];
                        assert_all(&w, &xs, m, &format!("extreme {format} k={k} x={v}"));
                        // Q8_0: -128 each; Q4_1: nibbles 0 (low) and 8 (high), plus the minimum 1.
                        let expect = match format {
                            WeightFormat::Q8_0 => -128.0,
                            WeightFormat::Q4_1 => 5.0,
                            _ => continue,
                        } * v
                            * k as f32;
                        for imp in Impl::available() {
                            assert!(gemm(imp, &w, &xs, m).iter().all(|&g| g == expect), "{format} {}", imp.name());
                        }
                    }
                }
            }
        }
    }

    /// The AVX2 unpackings of a super-block's factors — Q4_K's scales and minima, Q6_K's scales —
    /// are the scalar ones', bit for bit, for any words (every bit pattern of the packed 6-bit
    /// pairs and int8 scales, and `d` of any sign, NaN included).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn super_block_factors_by_avx2_are_the_scalar_ones() {
        if !crate::cpu::isa::isa().avx2 {
            return;
        }
        let mut rng = Rng(17);
        let nb = 24;
        let bits = |f: Shared| f.map(|(a, b)| (a.to_bits(), b.to_bits()));
        for _ in 0..200 {
            for words in [37, 53] {
                let row: Vec<u32> = (0..words * nb / 8).map(|_| rng.next()).collect();
                for s in 0..nb / 8 {
                    // SAFETY (both): the CPU has AVX2 (checked above); `row` is a whole row of
                    // `nb` blocks of the format.
                    let (avx2, scalar) = match words {
                        37 => (unsafe { q4_k_factors_avx2(row.as_ptr(), nb, s) }, q4_k_factors(|i| row[i], nb, s)),
                        _ => (
                            unsafe { q6_k_scales_avx2(row.as_ptr(), nb, s) },
                            std::array::from_fn(|j| q6_k_scales(|i| row[i], nb, 8 * s + j)),
                        ),
                    };
                    assert_eq!(bits(avx2), bits(scalar), "super-block {s} of {row:08x?}");
                }
            }
        }
    }

    #[test]
    fn zeros_give_zero() {
        let mut rng = Rng(3);
        for format in FORMATS {
            let k = k_of(format, 576);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![9, k], rng.values(9 * k))).unwrap();
            let zero = QuantWeight::quantize(format, &Tensor::f32(vec![9, k], vec![0.0; 9 * k])).unwrap();
            for imp in Impl::available() {
                for m in MS {
                    assert!(gemm(imp, &w, &vec![0.0; m * k], m).iter().all(|&v| v == 0.0), "{format} {}", imp.name());
                    let xs = rng.values(m * k);
                    assert!(gemm(imp, &zero, &xs, m).iter().all(|&v| v == 0.0), "{format} {}", imp.name());
                }
            }
        }
    }

    #[test]
    fn huge_values() {
        let mut rng = Rng(5);
        for format in FORMATS {
            let k = k_of(format, 96);
            for m in [1, 2, 5] {
                // One huge activation per row.
                let w = QuantWeight::quantize(format, &Tensor::f32(vec![5, k], rng.values(5 * k))).unwrap();
                let mut xs = rng.values(m * k);
                for x in xs.chunks_exact_mut(k) {
                    x[40] = 1e30;
                }
                assert_all(&w, &xs, m, &format!("{format} huge x m={m}"));
                // A weight row with a huge element (its block's scale huge, within f16's range).
                let mut wf = rng.values(5 * k);
                wf[2 * k + 70] = 5e4;
                let w = QuantWeight::quantize(format, &Tensor::f32(vec![5, k], wf)).unwrap();
                let xs = rng.values(m * k);
                assert_all(&w, &xs, m, &format!("{format} huge w m={m}"));
                for imp in Impl::available() {
                    assert!(gemm(imp, &w, &xs, m).iter().all(|v| v.is_finite()));
                }
            }
        }
    }

    #[test]
    fn nan_and_bad_shapes_do_not_panic() {
        let mut rng = Rng(11);
        for format in FORMATS {
            let k = k_of(format, 64);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![5, k], rng.values(5 * k))).unwrap();
            for imp in Impl::available() {
                for m in [1, 2, 5] {
                    // NaN in an activation row gives NaN in that row's outputs only.
                    let mut xs = rng.values(m * k);
                    xs[3] = f32::NAN;
                    let out = gemm(imp, &w, &xs, m);
                    assert!(out[..5].iter().all(|v| v.is_nan()) && out[5..].iter().all(|v| v.is_finite()));
                    let xs = rng.values(m * k);
                    // Rows past the end of the words are NaN.
                    let mut out = vec![0.0; m * 7];
                    gemm_rows_f32_with(imp, format, &w.words, k, &xs, m, &mut out, 7);
                    for o in out.chunks(7) {
                        assert!(o[..5].iter().all(|v| v.is_finite()) && o[5..].iter().all(|v| v.is_nan()));
                    }
                    // A k that does not fit, a float format, xs or out of the wrong length: all NaN.
                    let mut out = vec![0.0; m * 5];
                    for (f, k, xs) in [
                        (format, 32, &xs[..]),
                        (format, 65, &xs[..]),
                        (WeightFormat::F32, k, &xs[..]),
                        (format, k, &xs[1..]),
                    ] {
                        gemm_rows_f32_with(imp, f, &w.words, k, xs, m, &mut out, 5);
                        assert!(out.iter().all(|v| v.is_nan()));
                        out.fill(0.0);
                    }
                    gemm_rows_f32_with(imp, format, &w.words, k, &xs, m, &mut out[1..], 5);
                    assert!(out[1..].iter().all(|v| v.is_nan()));
                    // Short words (part of a row), no rows at all, no activation rows.
                    gemm_rows_f32_with(imp, format, &w.words[..10], k, &xs, m, &mut out, 5);
                    assert!(out.iter().all(|v| v.is_nan()));
                    gemm_rows_f32_with(imp, format, &w.words, k, &xs, m, &mut [], 0);
                    gemm_rows_f32_with(imp, format, &w.words, k, &[], 0, &mut [], 5);
                    // k = 0: empty dot products.
                    let mut out = vec![1.0; m * 5];
                    gemm_rows_f32_with(imp, format, &[], 0, &[], m, &mut out, 5);
                    assert!(out.iter().all(|&v| v == 0.0));
                }
                let mut out = vec![0.0; 3];
                dot_rows_f32_with(imp, format, &w.words, k, &rng.values(k + 1), &mut out);
                assert!(out.iter().all(|v| v.is_nan()));
            }
        }
    }

    /// Debug builds: a job whose activations or outputs are one element short fires the SIMD
    /// driver's bound (a release build returns without writing, as before).
    #[cfg(debug_assertions)]
    #[test]
    fn a_job_one_short_fires_in_debug_builds() {
        let (k, rows) = (64, 6);
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_K] {
            let k = k_of(format, k);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![rows, k], Rng(5).values(rows * k))).unwrap();
            let stride = format.row_words(k).unwrap();
            for m in [1, 9] {
                let xs = Rng(9).values(m * k);
                let job = Job { format, words: &w.words, stride, nb: k / BLOCK, k, xs: &xs, m, rows };
                for imp in Impl::available().into_iter().filter(|&imp| imp != Impl::Scalar) {
                    let mut out = vec![0.0; m * rows];
                    run_job(imp, &job, &mut out);
                    assert_eq!(out, gemm(imp, &w, &xs, m), "{format} m={m} {}", imp.name());
                    for (what, short_xs, short_out) in [("activations", 1, 0), ("outputs", 0, 1)] {
                        let err = std::panic::catch_unwind(|| {
                            let mut out = vec![0.0; m * rows - short_out];
                            run_job(imp, &Job { xs: &xs[..m * k - short_xs], ..job }, &mut out);
                        })
                        .expect_err(what);
                        let msg = err.downcast_ref::<String>().map_or("", String::as_str);
                        assert!(msg.starts_with("a job of"), "{format} m={m} {} {what}: {msg}", imp.name());
                    }
                }
            }
        }
    }

    #[test]
    fn kernel_name_is_an_available_implementation() {
        assert!(Impl::available().iter().any(|i| i.name() == kernel_name()));
    }
}
