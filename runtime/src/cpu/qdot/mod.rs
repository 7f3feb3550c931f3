//! Dot products of block-quantized weight rows with an activation row quantized to int8.
//!
//! The scheme is llama.cpp's for its Q8_0/Q4_1 matrix-vector products (the code is written from
//! scratch): the activation row `x` is quantized once per product into blocks of 32 like Q8_0
//! ([`Q8Acts`]: per block `d = max|x| / 127` and `q = round(x / d)`, plus `d * sum(q)`), so that
//! each weight block meets an activation block of integers and the inner loop is an integer dot
//! product, exact in `i32`. With a weight block's scale `d_w` (and Q4_1's minimum `m_w`):
//!
//! - Q8_0: `sum_b d_w[b] * d_x[b] * sum(q_w * q_x)`;
//! - Q4_1: `sum_b d_w[b] * d_x[b] * sum(q4 * q_x) + m_w[b] * (d_x[b] * sum(q_x))`;
//! - Q5_0, Q4_K, Q6_K: per block of 32 (a K-quant's sub-block, read by [`crate::quant::block`]),
//!   `scale * sum(q * q_x) * d_x + min * s_x`, Q4_K's scale and minimum those of its sub-block
//!   (`d * sc`, `-dmin * m`) and Q6_K's scale per 16 elements; Q5_0's and Q6_K's quants less 16
//!   and 32.
//!
//! The only error against the f32 dot of the dequantized weight with `x` is the activation's
//! rounding, at most half a step (`d_x / 2`) per element, plus f32 rounding of the block sums.
//!
//! The weights are read in the device layout of [`kiln_compiler::lower::format`] (per row the
//! block scales, Q4_1's minimums, then the quants as `u32` words), so the CPU streams the same
//! buffers the GPU reads. Implementations, the best this CPU runs chosen at run time
//! ([`Implementation::best`], [`kernel_name`]):
//!
//! - **`avx512-vnni`**: two blocks per 512-bit step. `vpdpbusd` multiplies unsigned by signed
//!   bytes, so Q8_0's signed weights are offset to unsigned (`w ^ 0x80 = w + 128`) and the sums
//!   start at `-128 * sum(q_x)` (computed once per activation block for all rows); Q4_1's nibbles
//!   are unsigned already, and its high nibbles are used in place (16 times the quant, divided back
//!   at the end), against a copy of the activation quants laid out to match. The block scales of
//!   16 blocks are multiplied at once and spread over the lanes by a permute.
//! - **`avx-vnni`**: the same on 256 bits, one block per step (`vpdpbusd` of AVX-VNNI).
//! - **`avx2`**: `vpmaddubsw` (unsigned by signed bytes into saturating pairs of `i16`) then
//!   `vpmaddwd` by ones; Q8_0 uses the sign trick (`|w|` times `x` with `w`'s sign), which cannot
//!   saturate since activations stay within ±127.
//! - **`neon-dotprod`** (AArch64 with the dot-product extension): `sdot`, through inline
//!   assembly (its intrinsics are not stable in Rust yet).
//! - **`neon`** (AArch64): widening byte multiplies (`smull`/`smlal2`) and pairwise adds into
//!   `i32` lanes.
//! - **`scalar`**: portable, and the reference the others are tested against.
//!
//! Q5_0, Q4_K and Q6_K have the portable kernel only, whatever the implementation asked for: it
//! is the reference the integer GEMM ([`gemm`]) is tested against, and nothing else multiplies
//! them a row at a time — a projection runs them through the integer GEMM, or below its rows (and
//! on CPUs without one) on the f32 path, which was faster than row dot products wherever both
//! were measured (see `linear::quantized`). Their SIMD row kernels were removed on 2026-11-28.
//!
//! Every SIMD kernel works on tiles of [`TILE`] rows, so each activation block loaded (and the
//! per-block work on it) serves several rows, while the rows' words stream through once: decode is
//! bound by the weight's memory traffic, so the x86 kernels also prefetch the words four tiles
//! ahead (the hardware prefetcher alone follows the tile's interleaved row streams poorly).
//! Threading is the caller's: split `out` and the words by rows.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::isa::{Implementation, Isa};
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::BLOCK;

/// Rows a SIMD kernel computes together.
pub const TILE: usize = 4;

/// How many tiles ahead of the one being computed a SIMD kernel prefetches the weight words: the
/// integer kernels consume a tile about twice as fast as the f32 ones ([`super::qdot_f32`], 2
/// tiles), so twice as far ahead keeps a memory latency's worth of lines in flight. A Q4_1 GEMV
/// streamed from memory on one thread went from 17 to 22-24 GB/s with 4 (2026-11-27, AMD EPYC).
const PREFETCH: usize = 4;

/// Two activation blocks, aligned so a block is one aligned 256-bit load and a pair one 512-bit load.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 2 * BLOCK]);

/// An activation row quantized per block of 32 to `i8` (llama.cpp's Q8_0 with Q8_1's block sum).
///
/// For each block `b`: its scale `d[b] = max|x| / 127`, `s[b] = d[b] * sum(q)` (for Q4_1's
/// minimum term) and the 32 quants `q = round(x / d)` (ties to even; 0 where `d = 0`), stored contiguously and
/// 32-byte aligned. A block holding NaN gets scale NaN, so NaN propagates to the dot products.
/// Buffers are reused across [`Q8Acts::quantize`] calls.
#[derive(Clone, Default)]
pub struct Q8Acts {
    blocks: usize,
    d: Vec<f32>,
    s: Vec<f32>,
    /// The quants in order, two blocks a line (the last line padded with zeros).
    q: Vec<Line>,
    /// The same lines with their middle halves swapped (block `2l`'s first 16 quants, block
    /// `2l + 1`'s first 16, `2l`'s last 16, `2l + 1`'s last 16): the order the AVX-512 kernel's
    /// Q4_1 nibbles come in.
    qh: Vec<Line>,
}

impl std::fmt::Debug for Q8Acts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q8Acts").field("blocks", &self.blocks).finish_non_exhaustive()
    }
}

impl Q8Acts {
    /// An empty row (no blocks).
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes `x`. A trailing partial block (when `x.len()` is not a multiple of 32) is padded
    /// with zeros, so the row then has `x.len()` rounded up to 32 elements.
    pub fn quantize(&mut self, x: &[f32]) {
        let blocks = x.len().div_ceil(BLOCK);
        self.blocks = blocks;
        self.d.clear();
        self.s.clear();
        self.q.clear();
        self.q.resize(blocks.div_ceil(2), Line([0; 2 * BLOCK]));
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa().avx2 {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { quantize_blocks_avx2(x, &mut self.q, &mut self.d, &mut self.s) };
        } else {
            quantize_blocks(x, &mut self.q, &mut self.d, &mut self.s);
        }
        #[cfg(target_arch = "aarch64")]
        if super::isa::isa().neon {
            // SAFETY: the CPU has NEON.
            unsafe { quantize_blocks_neon(x, &mut self.q, &mut self.d, &mut self.s) };
        } else {
            quantize_blocks(x, &mut self.q, &mut self.d, &mut self.s);
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        quantize_blocks(x, &mut self.q, &mut self.d, &mut self.s);
        self.qh.clear();
        self.qh.extend(self.q.iter().map(|line| {
            let mut out = Line([0; 2 * BLOCK]);
            if let ([a0, a1, b0, b1], _) = line.0.as_chunks::<{ BLOCK / 2 }>() {
                for (o, i) in out.0.chunks_exact_mut(BLOCK / 2).zip([a0, b0, a1, b1]) {
                    o.copy_from_slice(i);
                }
            }
            out
        }));
    }

    /// Elements (a multiple of 32: the quantized length rounded up to whole blocks).
    pub fn len(&self) -> usize {
        self.blocks * BLOCK
    }

    /// Whether the row has no elements.
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// Whether the row has at least `nb` blocks in every buffer the SIMD kernels read: `nb`
    /// scales and sums, and the `nb.div_ceil(2)` lines of quants in both orders.
    fn fits(&self, nb: usize) -> bool {
        let lines = nb.div_ceil(2);
        self.blocks >= nb && self.d.len() >= nb && self.s.len() >= nb && self.q.len() >= lines && self.qh.len() >= lines
    }

    /// The blocks' quants, 32 each.
    fn quant_blocks(&self) -> impl Iterator<Item = &[i8]> {
        self.q.iter().flat_map(|l| l.0.chunks_exact(BLOCK)).take(self.blocks)
    }
}

/// Quantizes the blocks of `x` into the lines `q` (enough for them), pushing each block's scale
/// to `d` and `d * sum(q)` to `s` (see [`Q8Acts`]): the portable loop, which
/// [`quantize_blocks_avx2`] equals bit for bit (this runs over every activation of a prompt's
/// projections: a 32 x 2048 block of rows took 0.26 ms this way, about as long as the integer
/// GEMM over it).
fn quantize_blocks(x: &[f32], q: &mut [Line], d: &mut Vec<f32>, s: &mut Vec<f32>) {
    let quants = q.iter_mut().flat_map(|l| l.0.chunks_exact_mut(BLOCK));
    for (block, q) in x.chunks(BLOCK).zip(quants) {
        let (mut amax, mut nan) = (0f32, false);
        for &v in block {
            amax = amax.max(v.abs());
            nan |= v.is_nan();
        }
        let scale = if nan { f32::NAN } else { amax / 127.0 };
        // `scale` is NaN or infinite only for non-finite input: then the quants are 0 (`as`
        // saturates, NaN to 0) and the NaN or infinite scale carries into the products.
        let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for (q, &v) in q.iter_mut().zip(block) {
            // |v / scale| <= 127 up to rounding, and `as` saturates. Ties round to even, as the
            // SIMD rounding instructions (and llama.cpp's vector quantizers) do.
            *q = (v * inverse).round_ties_even() as i8;
        }
        let sum: i32 = q.iter().map(|&q| i32::from(q)).sum();
        d.push(scale);
        s.push(scale * sum as f32);
    }
}

/// A SIMD quantizer's partial last block `tail` (fewer than 32 values, or none) by the portable
/// loop, into `last`, its block of quants.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn quantize_tail(tail: &[f32], last: Option<&mut [i8]>, d: &mut Vec<f32>, s: &mut Vec<f32>) {
    if let (false, Some(last)) = (tail.is_empty(), last) {
        let mut line = [Line([0; 2 * BLOCK])];
        quantize_blocks(tail, &mut line, d, s);
        last.copy_from_slice(&line[0].0[..BLOCK]);
    }
}

/// [`quantize_blocks`] with AVX2: each whole block in four vectors (the same scale, quants and
/// sum: `vcvtps2dq` rounds to nearest, ties to even, and the packs saturate as `as` does), a
/// partial last block by the portable loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_blocks_avx2(x: &[f32], q: &mut [Line], d: &mut Vec<f32>, s: &mut Vec<f32>) {
    use std::arch::x86_64::*;
    let whole = x.len() / BLOCK * BLOCK;
    let (head, tail) = x.split_at(whole);
    let mut quants = q.iter_mut().flat_map(|l| l.0.chunks_exact_mut(BLOCK));
    for block in head.chunks_exact(BLOCK) {
        let Some(out) = quants.next() else { return };
        // SAFETY: `block` is 32 floats (`chunks_exact(BLOCK)`): four loads of 8.
        debug_assert_eq!(block.len(), BLOCK);
        let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(block.as_ptr().add(8 * i)) });
        let sign = _mm256_set1_ps(-0.0);
        let abs = v.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let unordered = v.map(|v| _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)));
        let nan = unordered.iter().any(|&u| u != 0);
        let scale = if nan { f32::NAN } else { amax / 127.0 };
        let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        // Non-finite input (a NaN or infinite scale): quants 0, as the portable loop's `as` gives.
        let keep = if scale.is_finite() { -1 } else { 0 };
        let ints = v.map(|v| {
            let i = _mm256_cvtps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(inverse)));
            _mm256_and_si256(i, _mm256_set1_epi32(keep))
        });
        // i32 -> i16 -> i8, saturating; the packs interleave 128-bit lanes, put back in order.
        let words = [_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3])];
        let bytes = _mm256_packs_epi16(words[0], words[1]);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `out` is 32 bytes (`chunks_exact_mut(BLOCK)`).
        debug_assert_eq!(out.len(), BLOCK);
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes) };
        let sum: i32 = out.iter().map(|&q| i32::from(q)).sum();
        d.push(scale);
        s.push(scale * sum as f32);
    }
    quantize_tail(tail, quants.next(), d, s);
}

/// [`quantize_blocks`] with NEON: each whole block in eight vectors (the same scale, quants and
/// sum: `fcvtns` rounds to nearest, ties to even, and gives 0 for NaN, the narrowing moves
/// saturate as `as` does, and a non-finite scale's inverse makes every quant 0 or NaN, so 0, as
/// in the portable loop), a partial last block by the portable loop.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
fn quantize_blocks_neon(x: &[f32], q: &mut [Line], d: &mut Vec<f32>, s: &mut Vec<f32>) {
    use std::arch::aarch64::*;
    let whole = x.len() / BLOCK * BLOCK;
    let (head, tail) = x.split_at(whole);
    let mut quants = q.iter_mut().flat_map(|l| l.0.chunks_exact_mut(BLOCK));
    for block in head.chunks_exact(BLOCK) {
        let Some(out) = quants.next() else { return };
        // SAFETY: `block` is 32 floats (`chunks_exact(BLOCK)`): eight loads of 4.
        debug_assert_eq!(block.len(), BLOCK);
        let v: [float32x4_t; 8] = std::array::from_fn(|i| unsafe { vld1q_f32(block.as_ptr().add(4 * i)) });
        // `fmax` gives NaN where either is NaN: the block's scale is then NaN, as in the loop.
        let amax = vmaxvq_f32(v.iter().fold(vdupq_n_f32(0.0), |m, &v| vmaxq_f32(m, vabsq_f32(v))));
        let scale = if amax.is_nan() { f32::NAN } else { amax / 127.0 };
        let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let ints = v.map(|v| vcvtnq_s32_f32(vmulq_n_f32(v, inverse)));
        // i32 -> i16 -> i8, saturating, in order.
        let [i0, i1, i2, i3, i4, i5, i6, i7] = ints;
        let words = |a, b| vcombine_s16(vqmovn_s32(a), vqmovn_s32(b));
        let (w0, w1, w2, w3) = (words(i0, i1), words(i2, i3), words(i4, i5), words(i6, i7));
        let bytes = [vcombine_s8(vqmovn_s16(w0), vqmovn_s16(w1)), vcombine_s8(vqmovn_s16(w2), vqmovn_s16(w3))];
        // SAFETY: `out` is 32 bytes (`chunks_exact_mut(BLOCK)`): two stores of 16.
        debug_assert_eq!(out.len(), BLOCK);
        unsafe {
            vst1q_s8(out.as_mut_ptr(), bytes[0]);
            vst1q_s8(out.as_mut_ptr().add(16), bytes[1]);
        }
        let sum: i32 = out.iter().map(|&q| i32::from(q)).sum();
        d.push(scale);
        s.push(scale * sum as f32);
    }
    quantize_tail(tail, quants.next(), d, s);
}

/// An implementation of [`dot_rows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Impl {
    /// Portable Rust (the reference).
    Scalar,
    /// x86-64 AVX2 and FMA.
    Avx2,
    /// x86-64 AVX-VNNI (256-bit `vpdpbusd`) with AVX2 and FMA.
    AvxVnni,
    /// x86-64 AVX-512 (F, BW, VL) with VNNI.
    Avx512Vnni,
    /// AArch64 NEON (widening multiplies).
    Neon,
    /// AArch64 NEON with the dot-product extension (`sdot`).
    NeonDot,
}

impl Implementation for Impl {
    const ALL: &'static [Impl] =
        &[Impl::Avx512Vnni, Impl::AvxVnni, Impl::Avx2, Impl::NeonDot, Impl::Neon, Impl::Scalar];
    const PORTABLE: Impl = Impl::Scalar;

    fn name(self) -> &'static str {
        match self {
            Impl::Scalar => "scalar",
            Impl::Avx2 => "avx2",
            Impl::AvxVnni => "avx-vnni",
            Impl::Avx512Vnni => "avx512-vnni",
            Impl::Neon => "neon",
            Impl::NeonDot => "neon-dotprod",
        }
    }

    fn runs_on(self, isa: Isa) -> bool {
        match self {
            Impl::Scalar => true,
            Impl::Avx2 => isa.avx2,
            Impl::AvxVnni => isa.avx2 && isa.avx_vnni,
            Impl::Avx512Vnni => isa.avx2 && isa.avx512_vnni,
            Impl::Neon => isa.neon,
            Impl::NeonDot => isa.neon && isa.dotprod,
        }
    }
}

/// The name of the implementation [`dot_rows`] uses (`"avx512-vnni"`, `"avx-vnni"`, `"avx2"`,
/// `"neon-dotprod"`, `"neon"` or `"scalar"`).
pub fn kernel_name() -> &'static str {
    Impl::best().name()
}

/// `out[r] = dot(row r, x)` for `r` in `0..out.len()`, of a block-quantized weight of `k`
/// elements a row in the device layout whose row `r` starts at `words[r * format.row_words(k)]`.
///
/// Shapes that do not fit give NaN rather than a panic: every row when `format` is not quantized or
/// `k` is not `x.len()` (a multiple of 32), and the rows past the end of `words`. With `k = 0`
/// every dot product is 0.
pub fn dot_rows(format: WeightFormat, words: &[u32], k: usize, x: &Q8Acts, out: &mut [f32]) {
    dot_rows_with(Impl::best(), format, words, k, x, out);
}

/// [`dot_rows`] with the implementation `imp` ([`Impl::Scalar`] instead if this machine cannot run
/// it); for tests and benchmarks.
pub fn dot_rows_with(imp: Impl, format: WeightFormat, words: &[u32], k: usize, x: &Q8Acts, out: &mut [f32]) {
    let Some(stride) = format.row_words(k) else {
        out.fill(f32::NAN);
        return;
    };
    if !k.is_multiple_of(BLOCK) || k != x.len() {
        out.fill(f32::NAN);
        return;
    }
    let nb = k / BLOCK;
    if nb == 0 {
        out.fill(0.0);
        return;
    }
    let rows = out.len().min(words.len() / stride);
    let (out, missing) = out.split_at_mut(rows);
    missing.fill(f32::NAN);
    let words = words.get(..rows * stride).unwrap_or_default();
    if !matches!(format, WeightFormat::Q8_0 | WeightFormat::Q4_1) {
        // Q5_0 and the K-quants: the portable form whatever `imp` (see the module docs).
        scalar_blocks(format, words, stride, k, x, out);
        return;
    }
    let q4 = format == WeightFormat::Q4_1;
    let imp = if imp.is_available() { imp } else { Impl::Scalar };
    match imp {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `imp` is available, so the CPU has the kernel's features; `words` holds the
        // `out.len()` rows of `stride` words each, and `x` has `nb` blocks (`k == x.len()`)
        // (what `drive` asserts in debug builds; `tile` checks it in every build).
        Impl::Avx512Vnni => unsafe { drive::<avx512::Avx512Vnni>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::AvxVnni => unsafe { drive::<avx2::AvxVnni>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::Avx2 => unsafe { drive::<avx2::Avx2>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::Neon => unsafe { drive::<neon::Neon>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::NeonDot => unsafe { drive::<neon::NeonDot>(q4, words, stride, nb, x, out) },
        _ => scalar_rows(q4, words, stride, nb, x, out),
    }
}

/// The portable implementation: one row at a time, integer block sums.
fn scalar_rows(q4: bool, words: &[u32], stride: usize, nb: usize, x: &Q8Acts, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(words.chunks_exact(stride)) {
        let (scales, rest) = row.split_at(nb.min(row.len()));
        let scales = scales.iter().map(|&d| f32::from_bits(d));
        let xs = x.d.iter().zip(&x.s).zip(x.quant_blocks());
        let mut acc = 0f32;
        if q4 {
            let (mins, quants) = rest.split_at(nb.min(rest.len()));
            let mins = mins.iter().map(|&m| f32::from_bits(m));
            for (((dw, mw), qw), ((&dx, &sx), qx)) in scales.zip(mins).zip(quants.chunks_exact(4)).zip(xs) {
                // Byte j holds element j (low nibble) and element j + 16 (high nibble).
                let (lo, hi) = qx.split_at(BLOCK / 2);
                let sum: i32 = bytemuck::cast_slice::<u32, u8>(qw)
                    .iter()
                    .zip(lo.iter().zip(hi))
                    .map(|(&w, (&l, &h))| i32::from(w & 0x0f) * i32::from(l) + i32::from(w >> 4) * i32::from(h))
                    .sum();
                acc += dw * dx * sum as f32 + mw * sx;
            }
        } else {
            for ((dw, qw), ((&dx, _), qx)) in scales.zip(rest.chunks_exact(8)).zip(xs) {
                let qw = bytemuck::cast_slice::<u32, u8>(qw);
                let sum: i32 = qw.iter().zip(qx).map(|(&w, &x)| i32::from(w as i8) * i32::from(x)).sum();
                acc += dw * dx * sum as f32;
            }
        }
        *o = acc;
    }
}

/// The portable implementation for the formats read through [`crate::quant::block`] (Q5_0,
/// Q4_K, Q6_K): per block of 32, `scale * sum(q * q_x) * d_x + min * s_x` (each half of 16 with
/// its own scale in Q6_K), the integer sums exact (below `2^24` in magnitude, so also as f32).
fn scalar_blocks(format: WeightFormat, words: &[u32], stride: usize, k: usize, x: &Q8Acts, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(words.chunks_exact(stride)) {
        let mut acc = 0f32;
        for (b, ((&dx, &sx), qx)) in x.d.iter().zip(&x.s).zip(x.quant_blocks()).enumerate() {
            let Some(blk) = crate::quant::block(format, row, k, b) else {
                acc = f32::NAN;
                break;
            };
            let (q0, q1) = blk.q.split_at(BLOCK / 2);
            let (x0, x1) = qx.split_at(BLOCK / 2);
            let sum = |q: &[i32], x: &[i8]| q.iter().zip(x).map(|(&w, &x)| w * i32::from(x)).sum::<i32>() as f32;
            let ints = if blk.scale[0] == blk.scale[1] {
                blk.scale[0] * (sum(q0, x0) + sum(q1, x1))
            } else {
                blk.scale[0] * sum(q0, x0) + blk.scale[1] * sum(q1, x1)
            };
            acc += ints * dx + blk.min * sx;
        }
        *o = acc;
    }
}

/// A SIMD kernel: dot products of tiles of `R` rows.
///
/// # Safety
///
/// The methods may only be called when the CPU has the kernel's features, with each of `rows`
/// pointing at a whole row of the format's device layout for `nb` blocks (`9 * nb` words for
/// Q8_0, `6 * nb` for Q4_1) and `x` holding at least `nb` blocks. They prefetch the words `ahead`
/// words past those they read (a hint: those need not exist).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
trait Kernel {
    /// Q8_0 rows (`Q4 = false`) or Q4_1 rows.
    unsafe fn tile<const R: usize, const Q4: bool>(
        rows: [*const u32; R],
        nb: usize,
        x: &Q8Acts,
        ahead: usize,
    ) -> [f32; R];
}

/// Runs kernel `K` over `out`'s rows in tiles of [`TILE`].
///
/// # Safety
///
/// The CPU has `K`'s features. (Shapes are checked by `tile`; debug builds assert here that the
/// caller's fit, so that no tile is skipped.)
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn drive<K: Kernel>(q4: bool, words: &[u32], stride: usize, nb: usize, x: &Q8Acts, out: &mut [f32]) {
    debug_assert!(
        stride >= if q4 { 6 * nb } else { 9 * nb } && words.len() >= out.len() * stride && x.fits(nb),
        "{} rows of {nb} blocks: {} words at stride {stride}, activations of {} blocks",
        out.len(),
        words.len(),
        x.blocks
    );
    for (o, w) in out.chunks_mut(TILE).zip(words.chunks(TILE * stride)) {
        // SAFETY: the caller's (features); `tile` checks the shapes.
        unsafe {
            match o.len() {
                4 => tile::<K, 4>(q4, w, stride, nb, x, o),
                3 => tile::<K, 3>(q4, w, stride, nb, x, o),
                2 => tile::<K, 2>(q4, w, stride, nb, x, o),
                _ => tile::<K, 1>(q4, w, stride, nb, x, o),
            }
        }
    }
}

/// One tile of `R` rows (the first `R` rows of `w`) into `o`; does nothing if the shapes do not fit.
///
/// # Safety
///
/// The CPU has `K`'s features.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn tile<K: Kernel, const R: usize>(q4: bool, w: &[u32], stride: usize, nb: usize, x: &Q8Acts, o: &mut [f32]) {
    let row_words = if q4 { 6 * nb } else { 9 * nb };
    if stride < row_words || w.len() < R * stride || x.blocks < nb || x.d.len() < nb || x.s.len() < nb {
        return;
    }
    let rows = std::array::from_fn(|r| w.as_ptr().wrapping_add(r * stride));
    // The rows' words stream through once; the hardware prefetcher follows the tile's streams
    // poorly, so each kernel also asks for the words at the same place `PREFETCH` tiles further.
    let ahead = PREFETCH * TILE * stride;
    // SAFETY: the kernel reads words `0..row_words` of row `r < R`, which starts at
    // `w[r * stride]`: inside `w` (`stride >= row_words`, `w.len() >= R * stride`, checked just
    // above); and `x`'s first `nb` blocks: scales and sums (checked above) and quant lines
    // (`x.q`, `x.qh`: `blocks.div_ceil(2)` each, as `quantize` makes them). Both asserted here in
    // debug builds. The caller vouches for the features.
    super::debug_span("quantized weight tile", w.len(), 0, (R, stride), (row_words, 1));
    debug_assert!(x.fits(nb), "activations of {} blocks read for {nb}", x.blocks);
    let v =
        unsafe { if q4 { K::tile::<R, true>(rows, nb, x, ahead) } else { K::tile::<R, false>(rows, nb, x, ahead) } };
    for (o, v) in o.iter_mut().zip(v) {
        *o = v;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod blocks;
pub mod gemm;
#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{FORMATS, Rng, k_of};
    use crate::quant::QuantWeight;
    use kiln_compiler::tensor::Tensor;

    const KS: [usize; 7] = [32, 64, 96, 544, 576, 1536, 32 * 33];

    /// The row lengths tested for `format`: [`KS`] (and Gemma's 640), or for the K-quants, whose
    /// rows are whole super-blocks of 256, 256 to 2048.
    pub(super) fn ks(format: WeightFormat) -> Vec<usize> {
        match format.row_multiple() {
            32 => KS.iter().copied().chain([640]).collect(),
            _ => vec![256, 512, 768, 1536, 2048],
        }
    }

    const ROWS: [usize; 9] = [1, 2, 3, 4, 5, 7, 8, 9, 33];

    fn run(imp: Impl, w: &QuantWeight, x: &Q8Acts) -> Vec<f32> {
        let mut out = vec![-1.0; w.rows];
        dot_rows_with(imp, w.format, &w.words, w.k, x, &mut out);
        out
    }

    /// Per row, `sum_b |d_w d_x| sum|q_w q_x| + |m_w s_x|`: the magnitude of the float terms.
    pub(super) fn magnitudes(w: &QuantWeight, x: &Q8Acts) -> Vec<f64> {
        let nb = w.k / BLOCK;
        let stride = w.format.row_words(w.k).unwrap();
        let xq: Vec<&[i8]> = x.quant_blocks().collect();
        w.words
            .chunks_exact(stride)
            .map(|row| {
                (0..nb)
                    .map(|b| {
                        let blk = crate::quant::block(w.format, row, w.k, b).unwrap();
                        let ints: f64 = blk
                            .q
                            .iter()
                            .zip(xq[b])
                            .enumerate()
                            .map(|(i, (&a, &q))| (f64::from(blk.scale[i / 16]) * f64::from(a) * f64::from(q)).abs())
                            .sum();
                        f64::from(x.d[b]).abs() * ints + (f64::from(blk.min) * f64::from(x.s[b])).abs()
                    })
                    .sum()
            })
            .collect()
    }

    /// Every available implementation agrees with the scalar one to f32 rounding of the terms.
    fn assert_impls_agree(w: &QuantWeight, x: &Q8Acts, what: &str) {
        let reference = run(Impl::Scalar, w, x);
        let mags = magnitudes(w, x);
        for imp in Impl::available() {
            let got = run(imp, w, x);
            for (r, ((&a, &b), &m)) in got.iter().zip(&reference).zip(&mags).enumerate() {
                let tol = 1e-5 * m + 1e-30;
                assert!(
                    (f64::from(a) - f64::from(b)).abs() <= tol,
                    "{what}: {} row {r}: {a} vs scalar {b} (tolerance {tol})",
                    imp.name()
                );
            }
        }
    }

    #[test]
    fn implementations_agree_and_match_f32() {
        assert!(Impl::available().contains(&Impl::Scalar));
        assert_eq!(Impl::available().first().copied(), Some(Impl::best()));
        let mut rng = Rng(7);
        let mut x = Q8Acts::new();
        for format in FORMATS {
            for k in ks(format) {
                for rows in ROWS {
                    let what = format!("{format} k={k} rows={rows}");
                    let t = Tensor::f32(vec![rows, k], rng.values(rows * k));
                    let w = QuantWeight::quantize(format, &t).unwrap();
                    let xf = rng.values(k);
                    x.quantize(&xf);
                    assert_eq!(x.len(), k);
                    assert_impls_agree(&w, &x, &what);
                    // The scalar result against the f32 dot of the dequantized weight with the
                    // unquantized x: activation rounding moves each element by at most half a step,
                    // d_x / 2 = max|x_block| / 254, so the error is at most
                    // sum_b (max|x_b| / 254) sum_{i in b} |w_i|, plus float rounding.
                    let deq = w.dequantize();
                    let wf = deq.as_f32().unwrap();
                    let got = run(Impl::Scalar, &w, &x);
                    let mags = magnitudes(&w, &x);
                    for r in 0..rows {
                        let row = &wf[r * k..(r + 1) * k];
                        let exact: f64 = row.iter().zip(&xf).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                        let bound: f64 = row
                            .chunks(BLOCK)
                            .zip(xf.chunks(BLOCK))
                            .map(|(wb, xb)| {
                                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                                f64::from(amax) / 254.0 * wb.iter().map(|&v| f64::from(v.abs())).sum::<f64>()
                            })
                            .sum();
                        let err = (f64::from(got[r]) - exact).abs();
                        let tol = bound * (1.0 + 1e-3) + 1e-5 * mags[r] + 1e-6 * exact.abs();
                        assert!(err <= tol, "{what} row {r}: {} vs {exact} (error {err}, bound {tol})", got[r]);
                    }
                }
            }
        }
    }

    /// Raw random blocks: every Q8_0 byte (-128 included) and every nibble, any scale sign.
    #[test]
    fn raw_random_blocks_agree() {
        let mut rng = Rng(99);
        let mut x = Q8Acts::new();
        for format in FORMATS {
            for k in ks(format) {
                let floats = format.row_floats(k).unwrap();
                let stride = format.row_words(k).unwrap();
                let rows = 9;
                let words = (0..rows * stride)
                    .map(|i| if i % stride < floats { rng.unit().to_bits() } else { rng.next() })
                    .collect();
                let w = QuantWeight { format, rows, k, words };
                // Activations at full scale, so quants reach ±127.
                let xf: Vec<f32> = (0..k).map(|i| if i % 7 == 0 { 1.0 } else { rng.unit() }).collect();
                x.quantize(&xf);
                assert_impls_agree(&w, &x, &format!("raw {format} k={k}"));
                // Every weight byte -128 against x at -127 and +127 (the sign trick's extremes).
                let words = (0..rows * stride).map(|i| if i % stride < floats { 1f32.to_bits() } else { 0x8080_8080 });
                let w = QuantWeight { format, rows, k, words: words.collect() };
                for v in [-1.0, 1.0] {
                    x.quantize(&vec![v; k]);
                    assert_impls_agree(&w, &x, &format!("extreme {format} k={k} x={v}"));
                    if format == WeightFormat::Q8_0 {
                        let expect = -128.0 * v * k as f32;
                        for got in run(Impl::Scalar, &w, &x) {
                            assert!((got - expect).abs() <= 1e-4 * expect.abs(), "{got} vs {expect}");
                        }
                    }
                }
            }
        }
    }

    /// The SIMD quantizer (AVX2's, NEON's) gives the portable loop's scales, sums and quants bit
    /// for bit: random magnitudes, exact ties (`x / d` at `n + 0.5`), zeros, NaN, infinities and
    /// a partial last block.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[test]
    fn the_simd_quantizer_equals_the_portable_loop() {
        type Quantizer = unsafe fn(&[f32], &mut [Line], &mut Vec<f32>, &mut Vec<f32>);
        #[cfg(target_arch = "x86_64")]
        let (available, simd) = (crate::cpu::isa::isa().avx2, quantize_blocks_avx2 as Quantizer);
        #[cfg(target_arch = "aarch64")]
        let (available, simd) = (crate::cpu::isa::isa().neon, quantize_blocks_neon as Quantizer);
        if !available {
            return;
        }
        let mut rng = Rng(31);
        let mut rows: Vec<Vec<f32>> = (0..20).map(|i| rng.values(32 * 7 + i % 3 * 11)).collect();
        // Ties: 127 at the block's largest, so `d = 1` and `x / d` lands on halves.
        rows.push((0..64).map(|i| if i % 32 == 0 { 127.0 } else { (i as f32 - 40.0) + 0.5 }).collect());
        rows.push(vec![0.0; 64]);
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e38, -3e-39] {
            let mut r = rng.values(96);
            r[37] = special;
            rows.push(r);
        }
        for x in rows {
            let lines = x.len().div_ceil(BLOCK).div_ceil(2);
            let (mut q, mut d, mut s) = (vec![Line([0; 2 * BLOCK]); lines], Vec::new(), Vec::new());
            let (mut q2, mut d2, mut s2) = (q.clone(), Vec::new(), Vec::new());
            quantize_blocks(&x, &mut q, &mut d, &mut s);
            // SAFETY: the CPU has the quantizer's features (checked above; FMA is part of
            // `isa().avx2`).
            unsafe { simd(&x, &mut q2, &mut d2, &mut s2) };
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!((bits(&d), bits(&s)), (bits(&d2), bits(&s2)), "{} elements", x.len());
            for (a, b) in q.iter().zip(&q2) {
                assert_eq!(a.0, b.0, "{} elements", x.len());
            }
        }
    }

    #[test]
    fn zero_activations_give_zero() {
        let mut rng = Rng(3);
        let mut x = Q8Acts::new();
        for format in FORMATS {
            let k = k_of(format, 576);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![9, k], rng.values(9 * k))).unwrap();
            x.quantize(&vec![0.0; k]);
            assert!(x.d.iter().all(|&d| d == 0.0));
            for imp in Impl::available() {
                assert!(run(imp, &w, &x).iter().all(|&v| v == 0.0), "{format} {}", imp.name());
            }
        }
    }

    #[test]
    fn huge_values() {
        let mut rng = Rng(5);
        let mut x = Q8Acts::new();
        for format in FORMATS {
            let k = k_of(format, 96);
            // One huge activation: the rest of its block rounds to 0, the other blocks keep theirs.
            let t = Tensor::f32(vec![5, k], rng.values(5 * k));
            let w = QuantWeight::quantize(format, &t).unwrap();
            let mut xf = rng.values(k);
            xf[40] = 1e30;
            x.quantize(&xf);
            assert_impls_agree(&w, &x, &format!("{format} huge x"));
            let deq = w.dequantize();
            let wf = deq.as_f32().unwrap();
            for (r, got) in run(Impl::Scalar, &w, &x).into_iter().enumerate() {
                let big = f64::from(wf[r * k + 40]) * 1e30;
                assert!(got.is_finite() && (f64::from(got) - big).abs() <= 1e-2 * big.abs() + 1e27, "{got} vs {big}");
            }
            // A weight row with a huge element (its block's scale huge, within GGUF's f16 scales).
            let mut wf = rng.values(5 * k);
            wf[2 * k + 70] = 5e5;
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![5, k], wf)).unwrap();
            x.quantize(&rng.values(k));
            assert_impls_agree(&w, &x, &format!("{format} huge w"));
            assert!(run(Impl::Scalar, &w, &x).iter().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn nan_and_bad_shapes_do_not_panic() {
        let mut rng = Rng(11);
        let mut x = Q8Acts::new();
        for format in FORMATS {
            let k = k_of(format, 64);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![5, k], rng.values(5 * k))).unwrap();
            // NaN in the activation propagates.
            let mut xf = rng.values(k);
            xf[3] = f32::NAN;
            x.quantize(&xf);
            for imp in Impl::available() {
                assert!(run(imp, &w, &x).iter().all(|v| v.is_nan()), "{}", imp.name());
            }
            // A partial last block is padded with zeros.
            let xf = rng.values(k - 5);
            x.quantize(&xf);
            assert_eq!(x.len(), k);
            let padded = run(Impl::Scalar, &w, &x);
            x.quantize(&[xf, vec![0.0; 5]].concat());
            assert_eq!(run(Impl::Scalar, &w, &x), padded);
            for imp in Impl::available() {
                let mut out = vec![0.0; 7];
                // Rows past the end of the words are NaN.
                dot_rows_with(imp, format, &w.words, k, &x, &mut out);
                assert!(out[..5].iter().all(|v| v.is_finite()) && out[5..].iter().all(|v| v.is_nan()));
                // A k that is not x's, or not whole blocks, or a float format: all NaN.
                for (f, k) in [(format, 32), (format, 65), (WeightFormat::F32, k)] {
                    dot_rows_with(imp, f, &w.words, k, &x, &mut out);
                    assert!(out.iter().all(|v| v.is_nan()));
                }
                // Short words (part of a row) and no rows at all.
                dot_rows_with(imp, format, &w.words[..10], k, &x, &mut out);
                assert!(out.iter().all(|v| v.is_nan()));
                dot_rows_with(imp, format, &w.words, k, &x, &mut []);
                // k = 0: empty dot products.
                let mut empty = Q8Acts::new();
                empty.quantize(&[]);
                assert!(empty.is_empty());
                dot_rows_with(imp, format, &[], 0, &empty, &mut out);
                assert!(out.iter().all(|&v| v == 0.0));
            }
        }
    }

    /// Debug builds: weight words one short of the rows fire `drive`'s bound (a release build
    /// skips the short tile, leaving its outputs unwritten).
    #[cfg(all(debug_assertions, target_arch = "x86_64"))]
    #[test]
    fn words_one_short_fire_in_debug_builds() {
        type Drive = unsafe fn(bool, &[u32], usize, usize, &Q8Acts, &mut [f32]);
        let kernels: [(Impl, Drive); 3] = [
            (Impl::Avx2, drive::<avx2::Avx2>),
            (Impl::AvxVnni, drive::<avx2::AvxVnni>),
            (Impl::Avx512Vnni, drive::<avx512::Avx512Vnni>),
        ];
        let (k, rows) = (64, 5);
        let mut x = Q8Acts::new();
        x.quantize(&Rng(13).values(k));
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_1] {
            let t = Tensor::f32(vec![rows, k], Rng(17).values(rows * k));
            let w = QuantWeight::quantize(format, &t).unwrap();
            let stride = format.row_words(k).unwrap();
            let q4 = format == WeightFormat::Q4_1;
            for (imp, drive) in kernels.into_iter().filter(|(imp, _)| imp.is_available()) {
                let mut out = vec![0.0; rows];
                // SAFETY: `imp` is available (the words fit).
                unsafe { drive(q4, &w.words, stride, k / BLOCK, &x, &mut out) };
                assert_eq!(out, run(imp, &w, &x), "{format} {}", imp.name());
                let short = &w.words[..w.words.len() - 1];
                let err = std::panic::catch_unwind(|| {
                    // SAFETY: `imp` is available; the words are one short, which the bound catches
                    // before any tile runs.
                    unsafe { drive(q4, short, stride, k / BLOCK, &x, &mut vec![0.0; rows]) }
                })
                .expect_err(imp.name());
                let msg = err.downcast_ref::<String>().map_or("", String::as_str);
                assert!(msg.contains("words at stride"), "{format} {}: {msg}", imp.name());
            }
        }
    }

    #[test]
    fn kernel_name_is_an_available_implementation() {
        assert!(Impl::available().iter().any(|i| i.name() == kernel_name()));
    }
}
