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
//! by the same drivers, a block of 32 at a time: with AVX-512 dequantized in registers too, with
//! AVX2 and NEON by the portable [`crate::quant::block`] into a buffer the vector code then loads
//! (exactly the same values either way). Two shapes of work:
//!
//! - **Decode** ([`dot_rows_f32`], and [`gemm_rows_f32`] with a few activation rows: up to 4
//!   with AVX-512, 3 with AVX2): tiles of [`TILE`] weight rows stream through once. Each
//!   activation block is loaded into registers once per tile and serves its rows; each weight
//!   block is dequantized into registers once and serves every activation row. The weight words
//!   are also prefetched two tiles ahead (the hardware prefetcher follows a tile's interleaved row
//!   streams poorly), so the product runs at about the speed the weight's bytes arrive from memory.
//! - **Prefill** ([`gemm_rows_f32`] with more activation rows): a tile of 8 weight rows is
//!   dequantized once into an f32 buffer that stays in L1 (a chunk of at most 768 elements of
//!   each row at a time), then a register-blocked micro-kernel (4 weight rows by 4 activation
//!   rows with AVX-512: 16 accumulators, 8 loads for 16 FMAs) runs over it for each group of
//!   activation rows, so the dequantization is shared by all of them and the inner loop is loads
//!   and FMAs. The accumulators, one vector per (activation row, weight row), are summed across
//!   lanes once per pair by a transposing reduction (4 vectors to 4 sums in a few shuffles).
//!   Activation rows aligned to 64 bytes run about 10% faster here.
//!
//! Implementations, chosen once at run time ([`kernel_name`]):
//!
//! - **`avx512`** (AVX-512F with AVX2 and FMA): 16 lanes. Q8_0 bytes are sign-extended to `i32`
//!   (`vpmovsxbd`), converted and multiplied by the scale; Q4_1 looks its nibbles up in a table of
//!   the block's 16 values (`i * d + m`, computed once per block) by `vpermps`, which reads only
//!   the low 4 bits of each index, so the low nibbles need no mask and the high ones one shift.
//!   Q5_0 adds its fifth bits under a lane mask of the block's bit word; Q4_K and Q6_K shift
//!   their nibbles and bit pairs out by the sub-block's position, with the sub-block scales
//!   unpacked once per block (Gemma 3 270M decodes 4x faster than through the buffer).
//! - **`avx2`** (AVX2 and FMA): 8 lanes; Q4_1's nibbles are masked, shifted and converted.
//! - **`neon`** (AArch64): 4 lanes, widening moves and conversions (no prefetching).
//! - **`scalar`**: portable, one row dequantized at a time and summed in order; the reference the
//!   others are tested against (it equals the in-order f32 dot of the dequantized row exactly).
//!
//! Threading is the caller's: split the weight (and the outputs) by rows.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::BLOCK;
use std::sync::OnceLock;

/// Weight rows a SIMD kernel computes together when streaming (decode).
pub const TILE: usize = 4;

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

impl Impl {
    /// Every implementation, the preferred first.
    pub const ALL: [Impl; 4] = [Impl::Avx512, Impl::Avx2, Impl::Neon, Impl::Scalar];

    /// The name [`kernel_name`] reports.
    pub fn name(self) -> &'static str {
        match self {
            Impl::Scalar => "scalar",
            Impl::Avx2 => "avx2",
            Impl::Avx512 => "avx512",
            Impl::Neon => "neon",
        }
    }

    /// Whether this machine (CPU and OS) can run it.
    pub fn is_available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        use std::arch::is_x86_feature_detected as has;
        match self {
            Impl::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Impl::Avx2 => has!("avx2") && has!("fma"),
            #[cfg(target_arch = "x86_64")]
            Impl::Avx512 => has!("avx512f") && has!("avx2") && has!("fma"),
            #[cfg(target_arch = "aarch64")]
            Impl::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }
}

/// The implementations this machine can run, the preferred first ([`Impl::Scalar`] last).
pub fn available() -> Vec<Impl> {
    Impl::ALL.into_iter().filter(|i| i.is_available()).collect()
}

/// The implementation [`gemm_rows_f32`] uses: the preferred available one, chosen on first use.
pub fn best() -> Impl {
    static BEST: OnceLock<Impl> = OnceLock::new();
    *BEST.get_or_init(|| available().first().copied().unwrap_or(Impl::Scalar))
}

/// The name of the implementation [`gemm_rows_f32`] uses (`"avx512"`, `"avx2"`, `"neon"` or
/// `"scalar"`).
pub fn kernel_name() -> &'static str {
    best().name()
}

/// `out[r] = dot(row r, x)` for `r` in `0..out.len()`, of a block-quantized weight of `k`
/// elements a row in the device layout whose row `r` starts at `words[r * format.row_words(k)]`,
/// with `x` (`k` floats) in f32.
///
/// Shapes that do not fit give NaN rather than a panic: every output when `format` is not
/// quantized, `k` is not whole blocks of the format (32, or 256 for the K-quants) or `x.len()` is not `k`, and the rows past the end of
/// `words`. With `k = 0` every dot product is 0. This is [`gemm_rows_f32`] with one activation row.
pub fn dot_rows_f32(format: WeightFormat, words: &[u32], k: usize, x: &[f32], out: &mut [f32]) {
    dot_rows_f32_with(best(), format, words, k, x, out);
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
    gemm_rows_f32_with(best(), format, words, k, xs, m, out, rows);
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
        Impl::Avx512 => unsafe { x86::avx512::gemm(job, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::Avx2 => unsafe { x86::avx2::gemm(job, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::Neon => unsafe { arm::neon::gemm(job, out) },
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

/// Block `b` of the row at `row` (`nb` blocks of the format tagged `tag`) dequantized by
/// [`dequant_block`] into two cache lines: the portable path of the formats a SIMD module has no
/// vector dequantization for.
///
/// # Safety
///
/// `row` is a whole row of the layout for `nb` blocks.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn buffered_block(tag: u8, row: *const u32, nb: usize, b: usize) -> [Line; 2] {
    let format = tag_format(tag);
    let words = format.row_words(BLOCK * nb).unwrap_or(0);
    // SAFETY: the caller's: `row` is a whole row of the layout, `words` words (each row's span
    // asserted in debug builds where the rows are slices: `direct_tile`, `buffered`).
    let row = unsafe { std::slice::from_raw_parts(row, words) };
    let mut w = [0f32; BLOCK];
    dequant_block(format, row, nb, b, &mut w);
    let mut lines = [Line([0.0; 16]); 2];
    for (line, half) in lines.iter_mut().zip(w.chunks_exact(16)) {
        line.0.copy_from_slice(half);
    }
    lines
}

/// The `kquant` of an ops module without vector dequantization of Q5_0, Q4_K and Q6_K (AVX2,
/// NEON): the block through [`buffered_block`], loaded from its lines. Expanded inside the
/// module, whose `V`, `BV`, `LANES`, `zero` and `load` it uses, for `$features`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! buffered_kquant {
    ($features:literal) => {
        /// A block of the formats without vector dequantization here (Q5_0, Q4_K, Q6_K), through
        /// [`buffered_block`](super::super::buffered_block).
        ///
        /// # Safety
        ///
        /// `row` is a whole row of the layout for `nb` blocks and `b < nb`.
        #[target_feature(enable = $features)]
        #[inline]
        pub(super) unsafe fn kquant<const F: u8>(row: *const u32, nb: usize, b: usize) -> [V; BV] {
            // SAFETY: the caller's.
            let lines = unsafe { super::super::buffered_block(F, row, nb, b) };
            let mut out = [zero(); BV];
            for (j, v) in out.iter_mut().enumerate() {
                // SAFETY: `LANES * j < 32`, and `LANES * j % 16 + LANES <= 16`: inside a line.
                debug_assert!(LANES * j < 32 && LANES * j % 16 + LANES <= 16);
                *v = unsafe { load(lines.as_ptr().add(LANES * j / 16).cast::<f32>().add(LANES * j % 16)) };
            }
            out
        }
    };
}

/// The kernels' format parameter (a const generic): Q8_0 and Q4_1 have their own SIMD
/// dequantization; the others are dequantized block by block by [`dequant_block`].
const F_Q8_0: u8 = 0;
/// See [`F_Q8_0`].
const F_Q4_1: u8 = 1;
/// See [`F_Q8_0`].
const F_Q5_0: u8 = 2;
/// See [`F_Q8_0`].
const F_Q4_K: u8 = 3;
/// See [`F_Q8_0`].
const F_Q6_K: u8 = 4;

/// The format of a kernel's format parameter.
const fn tag_format(tag: u8) -> WeightFormat {
    match tag {
        F_Q8_0 => WeightFormat::Q8_0,
        F_Q4_1 => WeightFormat::Q4_1,
        F_Q5_0 => WeightFormat::Q5_0,
        F_Q4_K => WeightFormat::Q4_K,
        _ => WeightFormat::Q6_K,
    }
}

/// The word of a row (of `nb` blocks) at which block `b`'s quants start, for prefetching (the
/// low bits of a Q6_K block; any word of the row would do).
const fn quant_word(tag: u8, nb: usize, b: usize) -> usize {
    match tag {
        F_Q8_0 => nb + 8 * b,
        F_Q4_1 | F_Q5_0 => 2 * nb + 4 * b,
        _ => 5 * (nb / 8) + 4 * b,
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

/// The SIMD kernels and their drivers over a module of vector operations (`$ops`: the vector
/// type `V` of `LANES` floats, `BV = 32 / LANES` vectors a block; `DIRECT`, the most activation
/// rows the streaming kernel takes (up to 4), and `HOIST`, how many activation vectors it keeps
/// in registers; the prefill tile of `NR` weight rows (a multiple of 4) and groups of `MR`
/// activation rows (up to 4); and the operations), compiled for `$features`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! kernels {
    ($module:ident, $features:literal, $ops:ident) => {
        pub(in super::super) mod $module {
            use super::super::{
                BLOCK, F_Q4_1, F_Q4_K, F_Q5_0, F_Q6_K, F_Q8_0, Job, KC, Line, PREFETCH, TILE, quant_word,
            };
            use super::$ops as ops;
            use crate::cpu::debug_span;
            use kiln_compiler::lower::WeightFormat;

            /// The sums of the lanes of each of `a`.
            #[target_feature(enable = $features)]
            #[inline]
            fn sums<const N: usize>(a: [ops::V; N]) -> [f32; N] {
                let mut out = [0f32; N];
                for (o, a) in out.chunks_mut(4).zip(a.chunks(4)) {
                    let mut four = [ops::zero(); 4];
                    for (d, s) in four.iter_mut().zip(a) {
                        *d = *s;
                    }
                    for (o, s) in o.iter_mut().zip(ops::hsum4(four)) {
                        *o = s;
                    }
                }
                out
            }

            /// Block `b` of the row at `row` (`nb` blocks of the format tagged `F`) dequantized:
            /// Q8_0 and Q4_1 in registers, the other formats by [`dequant_block`] into a buffer.
            ///
            /// # Safety
            ///
            /// `row` is a whole row of the layout for `nb` blocks and `b < nb`.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn row_block<const F: u8>(row: *const u32, nb: usize, b: usize) -> [ops::V; ops::BV] {
                debug_assert!(b < nb, "block {b} of {nb}");
                match F {
                    // SAFETY: a Q8_0 row holds `nb` scales, then 8 quant words a block: word
                    // `b < nb` and words `nb + 8 b .. nb + 8 b + 8 <= 9 nb` (the caller's whole row).
                    F_Q8_0 => unsafe { ops::q8(row.add(nb + 8 * b), f32::from_bits(row.add(b).read())) },
                    // SAFETY: a Q4_1 row holds `nb` scales, `nb` minimums, then 4 quant words a
                    // block: words `b`, `nb + b` and `2 nb + 4 b .. 2 nb + 4 b + 4 <= 6 nb`.
                    F_Q4_1 => unsafe {
                        let (d, m) = (f32::from_bits(row.add(b).read()), f32::from_bits(row.add(nb + b).read()));
                        ops::q4(row.add(2 * nb + 4 * b), d, m)
                    },
                    // SAFETY: the caller's.
                    _ => unsafe { ops::kquant::<F>(row, nb, b) },
                }
            }

            /// `R` weight rows against `M` activation rows, streaming: the dot products, by
            /// activation row then weight row.
            ///
            /// # Safety
            ///
            /// The CPU has the features; each of `rows` points at a whole row of the layout for
            /// `nb` blocks and each of `xs` at `32 nb` floats. The words `ahead` words past those
            /// read are prefetched (a hint: they need not exist).
            #[target_feature(enable = $features)]
            unsafe fn direct<const R: usize, const M: usize, const F: u8>(
                rows: &[*const u32; R],
                nb: usize,
                xs: &[*const f32; M],
                ahead: usize,
            ) -> [[f32; R]; M] {
                let mut acc = [[ops::zero(); M]; R];
                let hoist = M * ops::BV <= ops::HOIST;
                for b in 0..nb {
                    // The activation blocks, loaded once for the tile's rows when registers allow.
                    let mut xv = [[ops::zero(); ops::BV]; M];
                    if hoist {
                        for (v, &x) in xv.iter_mut().zip(xs) {
                            for (j, v) in v.iter_mut().enumerate() {
                                // SAFETY: `x` holds `32 nb` floats (the contract, asserted in
                                // `direct_tile`) and `BLOCK * b + LANES * (j + 1) <= 32 nb`
                                // (`b < nb`, `j < BV = 32 / LANES`).
                                *v = unsafe { ops::load(x.add(BLOCK * b + ops::LANES * j)) };
                            }
                        }
                    }
                    for (a, &row) in acc.iter_mut().zip(rows) {
                        if b % 16 == 0 {
                            ops::prefetch(row.wrapping_add(b + ahead));
                            if F == F_Q4_1 {
                                ops::prefetch(row.wrapping_add(nb + b + ahead));
                            }
                        }
                        ops::prefetch(row.wrapping_add(quant_word(F, nb, b) + ahead));
                        // SAFETY: `row` is a whole row and `b < nb`.
                        let w = unsafe { row_block::<F>(row, nb, b) };
                        for ((a, xv), &x) in a.iter_mut().zip(&xv).zip(xs) {
                            for (j, (w, xv)) in w.iter().zip(xv).enumerate() {
                                let xv = if hoist {
                                    *xv
                                } else {
                                    // SAFETY: as above.
                                    unsafe { ops::load(x.add(BLOCK * b + ops::LANES * j)) }
                                };
                                *a = ops::fma(*w, xv, *a);
                            }
                        }
                    }
                }
                let mut out = [[0f32; R]; M];
                for (i, o) in out.iter_mut().enumerate() {
                    let mut col = [ops::zero(); R];
                    for (c, a) in col.iter_mut().zip(&acc) {
                        if let Some(a) = a.get(i) {
                            *c = *a;
                        }
                    }
                    *o = sums(col);
                }
                out
            }

            /// Blocks `b0..b1` of the row at `row` (`nb` blocks) dequantized into `dst`
            /// (`32 (b1 - b0)` floats).
            ///
            /// # Safety
            ///
            /// The CPU has the features; `row` is a whole row of the layout, `b1 <= nb`, and `dst`
            /// is writable for `32 (b1 - b0)` floats.
            #[target_feature(enable = $features)]
            unsafe fn dequant<const F: u8>(row: *const u32, nb: usize, b0: usize, b1: usize, dst: *mut f32) {
                debug_assert!(b1 <= nb, "blocks {b0}..{b1} of {nb}");
                for b in b0..b1 {
                    // SAFETY: the caller's, `b < nb`.
                    let w = unsafe { row_block::<F>(row, nb, b) };
                    for (j, v) in w.iter().enumerate() {
                        // SAFETY: `BLOCK * (b - b0) + LANES * (j + 1) <= 32 (b1 - b0)`, the floats
                        // `dst` is writable for (the contract, asserted in `buffered`).
                        unsafe { ops::store(dst.add(BLOCK * (b - b0) + ops::LANES * j), *v) };
                    }
                }
            }

            /// Weight rows the prefill micro-kernel computes at once.
            const SUB: usize = 4;

            /// The prefill micro-kernel: [`SUB`] dequantized rows (`w`, rows `ldw` floats apart)
            /// against `G <= MR` activation rows (`xs`) over `kc` elements, added to `acc` (by
            /// weight row, then activation row: the first `G` of each).
            ///
            /// # Safety
            ///
            /// The CPU has the features; `w` is readable for `SUB` rows of `kc` floats, each of
            /// `xs` for `kc`, and `kc` is a multiple of `LANES`.
            #[target_feature(enable = $features)]
            unsafe fn micro<const G: usize>(
                w: *const f32,
                ldw: usize,
                kc: usize,
                xs: &[*const f32; G],
                acc: &mut [[ops::V; ops::MR]; SUB],
            ) {
                // Fresh accumulators, added to `acc` at the end: starting from `acc`'s values
                // can make LLVM shuffle the registers around the loop.
                let mut a = [[ops::zero(); G]; SUB];
                debug_assert!(kc.is_multiple_of(ops::LANES), "{kc} floats in vectors of {}", ops::LANES);
                let mut s = 0;
                while s < kc {
                    let mut xv = [ops::zero(); G];
                    for (v, &x) in xv.iter_mut().zip(xs) {
                        // SAFETY: `s + LANES <= kc` (`kc` whole vectors): inside `x`'s `kc` floats
                        // (the contract, asserted in `buffered`).
                        *v = unsafe { ops::load(x.add(s)) };
                    }
                    for (j, a) in a.iter_mut().enumerate() {
                        // SAFETY: `j < SUB` and `s + LANES <= kc`: inside row `j` of `w`'s `SUB`
                        // rows of `kc` floats (the contract, asserted in `buffered`).
                        let wv = unsafe { ops::load(w.add(j * ldw + s)) };
                        for (a, x) in a.iter_mut().zip(&xv) {
                            *a = ops::fma(wv, *x, *a);
                        }
                    }
                    s += ops::LANES;
                }
                for (acc, a) in acc.iter_mut().zip(&a) {
                    for (acc, a) in acc.iter_mut().zip(a) {
                        *acc = ops::add(*acc, *a);
                    }
                }
            }

            /// Computes `job` into `out` (see [`super::super::gemm_rows_f32`]).
            ///
            /// # Safety
            ///
            /// The CPU has the features. (The job's shapes were checked when it was made.)
            #[target_feature(enable = $features)]
            pub(in super::super) unsafe fn gemm(job: &Job<'_>, out: &mut [f32]) {
                let fits = job.k == BLOCK * job.nb
                    && job.format.row_words(job.k).is_some_and(|words| job.stride >= words)
                    && job.xs.len() >= job.m * job.k
                    && out.len() >= job.m * job.rows
                    && job.words.len() / job.stride <= job.rows;
                // The kernels below rely on these shapes (and a release build returns without
                // writing `out` when they do not hold); every job `gemm_rows_f32` makes fits.
                debug_assert!(
                    fits,
                    "a job of {} rows of {} {} floats ({} blocks) at stride {} against {} activations of {} rows, \
                     into {} outputs of {} a row",
                    job.words.len() / job.stride.max(1),
                    job.k,
                    job.format,
                    job.nb,
                    job.stride,
                    job.xs.len(),
                    job.m,
                    out.len(),
                    job.rows
                );
                if !fits || job.m == 0 {
                    return;
                }
                if job.m <= ops::DIRECT {
                    for (t, w) in job.words.chunks(TILE * job.stride).enumerate() {
                        // SAFETY: the features; `w` holds whole rows (the words are whole rows).
                        unsafe {
                            match w.len() / job.stride {
                                4 => direct_m::<4>(job, w, t * TILE, out),
                                3 => direct_m::<3>(job, w, t * TILE, out),
                                2 => direct_m::<2>(job, w, t * TILE, out),
                                _ => direct_m::<1>(job, w, t * TILE, out),
                            }
                        }
                    }
                } else {
                    // SAFETY: the features.
                    unsafe { buffered(job, out) };
                }
            }

            /// The tile of `R` rows (`w`, from row `r0`) against all of the job's `m <= 4`
            /// activation rows.
            ///
            /// # Safety
            ///
            /// The CPU has the features; `job` fits `out` (see [`gemm`]).
            #[target_feature(enable = $features)]
            unsafe fn direct_m<const R: usize>(job: &Job<'_>, w: &[u32], r0: usize, out: &mut [f32]) {
                // SAFETY: the caller's.
                unsafe {
                    match job.m {
                        1 => direct_tile::<R, 1>(job, w, r0, out),
                        2 => direct_tile::<R, 2>(job, w, r0, out),
                        3 => direct_tile::<R, 3>(job, w, r0, out),
                        _ => direct_tile::<R, 4>(job, w, r0, out),
                    }
                }
            }

            /// The tile of `R` rows (`w`, from row `r0`) against the job's `M` activation rows;
            /// does nothing if the shapes do not fit.
            ///
            /// # Safety
            ///
            /// The CPU has the features.
            #[target_feature(enable = $features)]
            unsafe fn direct_tile<const R: usize, const M: usize>(
                job: &Job<'_>,
                w: &[u32],
                r0: usize,
                out: &mut [f32],
            ) {
                if job.m != M || w.len() < R * job.stride || job.xs.len() < M * job.k || job.k != BLOCK * job.nb {
                    return;
                }
                let rows: [*const u32; R] = std::array::from_fn(|r| w.as_ptr().wrapping_add(r * job.stride));
                let xs: [*const f32; M] = std::array::from_fn(|i| job.xs.as_ptr().wrapping_add(i * job.k));
                let ahead = PREFETCH * TILE * job.stride;
                // SAFETY: the kernel reads words `0..row_words` of row `r < R`, which starts at
                // `w[r * stride]`: inside `w` (`w.len() >= R * stride` checked above, `stride >=
                // row_words` by `gemm`); and floats `0..k` of activation row `i < M`, `xs[i * k..]`,
                // inside `xs` (`xs.len() >= M * k`, checked above). Both asserted in debug builds.
                let row_words = job.format.row_words(job.k).unwrap_or(usize::MAX);
                debug_span("f32 weight tile", w.len(), 0, (R, job.stride), (row_words, 1));
                debug_span("f32 activations", job.xs.len(), 0, (M, job.k), (job.k, 1));
                let v = unsafe {
                    match job.format {
                        WeightFormat::Q4_1 => direct::<R, M, F_Q4_1>(&rows, job.nb, &xs, ahead),
                        WeightFormat::Q5_0 => direct::<R, M, F_Q5_0>(&rows, job.nb, &xs, ahead),
                        WeightFormat::Q4_K => direct::<R, M, F_Q4_K>(&rows, job.nb, &xs, ahead),
                        WeightFormat::Q6_K => direct::<R, M, F_Q6_K>(&rows, job.nb, &xs, ahead),
                        _ => direct::<R, M, F_Q8_0>(&rows, job.nb, &xs, ahead),
                    }
                };
                for (i, v) in v.iter().enumerate() {
                    for (r, &v) in v.iter().enumerate() {
                        if let Some(o) = out.get_mut(i * job.rows + r0 + r) {
                            *o = v;
                        }
                    }
                }
            }

            /// Prefill: tiles of `NR` rows dequantized, a chunk of at most [`KC`] elements at a time,
            /// into a buffer, then the micro-kernel over the chunk for each group of at most `MR`
            /// activation rows, whose accumulators are kept from one chunk to the next.
            ///
            /// # Safety
            ///
            /// The CPU has the features; `job` fits `out` (see [`gemm`]).
            #[target_feature(enable = $features)]
            unsafe fn buffered(job: &Job<'_>, out: &mut [f32]) {
                let nr = ops::NR;
                // Chunks of equal whole blocks, at most `KC` elements.
                let chunks = job.nb.div_ceil(KC / BLOCK);
                let cb = job.nb.div_ceil(chunks);
                let ldw = BLOCK * cb;
                // Groups of `MR` activation rows, but never a last group of 1 when it can be 2.
                let mut groups = Vec::new();
                let mut i0 = 0;
                while i0 < job.m {
                    let left = job.m - i0;
                    let g = if left == ops::MR + 1 && ops::MR > 2 { ops::MR - 1 } else { left.min(ops::MR) };
                    groups.push((i0, g));
                    i0 += g;
                }
                let mut accs = vec![[[ops::zero(); ops::MR]; ops::NR]; groups.len()];
                // `ldw` is a multiple of 32, so every row of the buffer starts on a cache line.
                let mut buf = vec![Line([0.0; 16]); (nr * ldw).div_ceil(16)];
                for (t, w) in job.words.chunks(nr * job.stride).enumerate() {
                    let n = w.len() / job.stride;
                    if n < nr {
                        // The missing rows of the last tile: zeros, whose results are not written.
                        for c in buf.iter_mut().skip(n * ldw / 16) {
                            *c = Line([0.0; 16]);
                        }
                    }
                    for a in accs.iter_mut() {
                        *a = [[ops::zero(); ops::MR]; ops::NR];
                    }
                    let mut b0 = 0;
                    while b0 < job.nb {
                        let b1 = (b0 + cb).min(job.nb);
                        let dst = buf.as_mut_ptr().cast::<f32>();
                        for (j, row) in w.chunks_exact(job.stride).enumerate() {
                            // SAFETY: `row` is a whole row (`stride` at least its words, checked by
                            // `gemm`); `b1 <= nb`; `j < n <= NR`, so buffer row `j` (`ldw >=
                            // 32 (b1 - b0)` floats) is inside `buf`. Asserted in debug builds.
                            debug_assert!(
                                job.format.row_words(job.k).is_some_and(|words| row.len() >= words) && b1 <= job.nb
                            );
                            debug_span(
                                "dequantization buffer",
                                16 * buf.len(),
                                j * ldw,
                                (1, ldw),
                                (BLOCK * (b1 - b0), 1),
                            );
                            unsafe {
                                let (row, dst) = (row.as_ptr(), dst.add(j * ldw));
                                match job.format {
                                    WeightFormat::Q4_1 => dequant::<F_Q4_1>(row, job.nb, b0, b1, dst),
                                    WeightFormat::Q5_0 => dequant::<F_Q5_0>(row, job.nb, b0, b1, dst),
                                    WeightFormat::Q4_K => dequant::<F_Q4_K>(row, job.nb, b0, b1, dst),
                                    WeightFormat::Q6_K => dequant::<F_Q6_K>(row, job.nb, b0, b1, dst),
                                    _ => dequant::<F_Q8_0>(row, job.nb, b0, b1, dst),
                                }
                            }
                        }
                        let panel = Panel { w: buf.as_ptr().cast::<f32>(), ldw, k0: BLOCK * b0, kc: BLOCK * (b1 - b0) };
                        for (&(i0, g), acc) in groups.iter().zip(accs.iter_mut()) {
                            // SAFETY: the features; `i0 + g <= m`, `g <= MR`: the micro-kernel reads
                            // floats `k0..k0 + kc` (`<= k`) of activation rows `i0..i0 + g`, and
                            // `kc` floats of each of the buffer's `NR` rows, `ldw` apart. Asserted in
                            // debug builds.
                            debug_assert!(g <= ops::MR && panel.kc.is_multiple_of(BLOCK));
                            debug_span(
                                "prefill activations",
                                job.xs.len(),
                                i0 * job.k + panel.k0,
                                (g, job.k),
                                (panel.kc, 1),
                            );
                            debug_span("prefill panel", 16 * buf.len(), 0, (nr, ldw), (panel.kc, 1));
                            unsafe {
                                match g {
                                    1 => group::<1>(job, &panel, i0, acc),
                                    2 => group::<2>(job, &panel, i0, acc),
                                    3 if ops::MR > 3 => group::<3>(job, &panel, i0, acc),
                                    _ => group::<{ ops::MR }>(job, &panel, i0, acc),
                                }
                            }
                        }
                        b0 = b1;
                    }
                    for (&(i0, g), acc) in groups.iter().zip(&accs) {
                        for i in 0..g {
                            let mut col = [ops::zero(); ops::NR];
                            for (c, a) in col.iter_mut().zip(acc) {
                                if let Some(a) = a.get(i) {
                                    *c = *a;
                                }
                            }
                            let o = out.get_mut((i0 + i) * job.rows + t * nr..).unwrap_or_default();
                            for (o, v) in o.iter_mut().zip(sums(col)).take(n) {
                                *o = v;
                            }
                        }
                    }
                }
            }

            /// A panel of dequantized rows: `NR` rows of `kc` floats at `w`, `ldw` apart, holding
            /// elements `k0..k0 + kc` of the tile's rows.
            struct Panel {
                w: *const f32,
                ldw: usize,
                k0: usize,
                kc: usize,
            }

            /// The micro-kernel for activation rows `i0..i0 + G` over a panel, into their
            /// accumulators.
            ///
            /// # Safety
            ///
            /// The CPU has the features; `i0 + G <= job.m`, `G <= MR` (and `xs` holds `m` rows
            /// of `k`); the panel's buffer holds `NR` rows of `kc` floats `ldw` apart, and
            /// `k0 + kc <= k`, a multiple of 32.
            #[target_feature(enable = $features)]
            unsafe fn group<const G: usize>(
                job: &Job<'_>,
                panel: &Panel,
                i0: usize,
                acc: &mut [[ops::V; ops::MR]; ops::NR],
            ) {
                let xs: [*const f32; G] =
                    std::array::from_fn(|i| job.xs.as_ptr().wrapping_add((i0 + i) * job.k + panel.k0));
                for (h, acc) in acc.as_chunks_mut::<SUB>().0.iter_mut().enumerate() {
                    // SAFETY: the caller's; rows `h * SUB..(h + 1) * SUB` of the panel's `NR`.
                    unsafe { micro::<G>(panel.w.wrapping_add(h * SUB * panel.ldw), panel.ldw, panel.kc, &xs, acc) };
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The x86-64 vector operations. Inside a `#[target_feature]` function the register-only
    //! intrinsics of its features are safe; the loads and stores through raw pointers are not, and
    //! say why they hold.

    /// AVX-512F: 16 lanes; prefill micro-tiles of 4 weight rows by 4 activation rows.
    mod avx512_ops {
        use std::arch::x86_64::*;

        pub(super) type V = __m512;
        pub(super) const LANES: usize = 16;
        pub(super) const BV: usize = 2;
        pub(super) const NR: usize = 8;
        pub(super) const MR: usize = 4;
        pub(super) const HOIST: usize = 8;
        pub(super) const DIRECT: usize = 4;

        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) fn zero() -> V {
            _mm512_setzero_ps()
        }

        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) fn fma(a: V, b: V, c: V) -> V {
            _mm512_fmadd_ps(a, b, c)
        }

        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) fn add(a: V, b: V) -> V {
            _mm512_add_ps(a, b)
        }

        /// # Safety
        ///
        /// `p` is readable for 16 floats.
        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) unsafe fn load(p: *const f32) -> V {
            // SAFETY: the caller's.
            unsafe { _mm512_loadu_ps(p) }
        }

        /// # Safety
        ///
        /// `p` is writable for 16 floats.
        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) unsafe fn store(p: *mut f32, v: V) {
            // SAFETY: the caller's.
            unsafe { _mm512_storeu_ps(p, v) }
        }

        /// Asks for the cache line holding `p` (a hint: `p` need not point into anything).
        #[target_feature(enable = "sse")]
        #[inline]
        pub(super) fn prefetch(p: *const u32) {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }

        /// A Q8_0 block (32 signed bytes at `p`) times `d`.
        ///
        /// # Safety
        ///
        /// `p` is readable for 8 words.
        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) unsafe fn q8(p: *const u32, d: f32) -> [V; BV] {
            let p = p.cast::<__m128i>();
            // SAFETY: the caller's (two 16-byte loads).
            let (a, b) = unsafe { (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1))) };
            let d = _mm512_set1_ps(d);
            let f = |q: __m128i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
            [f(a), f(b)]
        }

        /// A Q4_1 block (16 bytes at `p`: element `j` in byte `j`'s low nibble, `j + 16` in its
        /// high one) as `q * d + m`, looked up in the table of the 16 values.
        ///
        /// # Safety
        ///
        /// `p` is readable for 4 words.
        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) unsafe fn q4(p: *const u32, d: f32, m: f32) -> [V; BV] {
            // SAFETY: the caller's.
            let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.cast()) });
            let iota =
                _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
            // A multiply then an add, as the dequantization computes each element (not an FMA).
            let table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
            // `vpermps` reads the low 4 bits of each index: the low nibble as it is, the high one
            // shifted down.
            [_mm512_permutexvar_ps(q, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table)]
        }

        /// Block `b` of a Q5_0, Q4_K or Q6_K row (format tag `F`, `nb` blocks) dequantized in
        /// registers, each element as [`crate::quant::block`] gives it and
        /// [`dequant_block`](super::super::dequant_block) scales it (`q * scale`, plus Q4_K's
        /// minimum after the multiply): the quants widened to 32 bits, Q5_0's fifth bits added under
        /// a lane mask of the block's bit word, the K formats' nibbles and bit pairs shifted out by
        /// the sub-block's position; the sub-block scales (Q4_K's 6-bit pairs, Q6_K's int8 pairs)
        /// are unpacked once per block on the scalar side.
        ///
        /// # Safety
        ///
        /// `row` is a whole row of the layout for `nb` blocks and `b < nb`.
        #[target_feature(enable = "avx512f")]
        #[inline]
        pub(super) unsafe fn kquant<const F: u8>(row: *const u32, nb: usize, b: usize) -> [V; BV] {
            use super::super::{F_Q4_K, F_Q5_0};
            debug_assert!(b < nb, "block {b} of {nb}");
            let ns = nb / 8;
            // SAFETY (all reads): words of the caller's whole row, in the layouts of
            // `kiln_compiler::lower::format` with `b < nb = 8 ns`: Q5_0 (`6 nb` words) reads words
            // `b`, `nb + b` and `2 nb + 4 b .. + 4`; Q4_K (`37 ns`) words `s`, `ns + s`, `2 ns + 3 s
            // .. + 3` and `5 ns + 8 (b / 2) .. + 8`; Q6_K (`53 ns`) words `s`, `ns + 4 s + c8 / 2`,
            // `low .. low + 8 <= 37 ns` and `high .. high + 8 <= 53 ns` (`bytes16` reads 16 bytes
            // at `half` 0 or 1 of its 8 words).
            let word = |i: usize| unsafe { row.add(i).read() };
            let bytes16 = |at: usize, half: usize| unsafe {
                _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(at).cast::<__m128i>().add(half)))
            };
            let shift = |v: __m512i, n: u32| _mm512_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
            match F {
                F_Q5_0 => {
                    let (d, fifth) = (_mm512_set1_ps(f32::from_bits(word(b))), word(nb + b));
                    let q = bytes16(2 * nb + 4 * b, 0);
                    let sixteen = _mm512_set1_epi32(16);
                    let lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
                    let hi = _mm512_srli_epi32::<4>(q);
                    let lo = _mm512_mask_add_epi32(lo, fifth as u16, lo, sixteen);
                    let hi = _mm512_mask_add_epi32(hi, (fifth >> 16) as u16, hi, sixteen);
                    let f = |v: __m512i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, sixteen)), d);
                    [f(lo), f(hi)]
                }
                F_Q4_K => {
                    let s = b / 8;
                    let mut packed = [0u8; 12];
                    for (i, w) in packed.chunks_exact_mut(4).enumerate() {
                        w.copy_from_slice(&word(2 * ns + 3 * s + i).to_le_bytes());
                    }
                    let (sc, m) = crate::gguf::q4_k_scale_min(&packed, b % 8);
                    let scale = _mm512_set1_ps(f32::from_bits(word(s)) * f32::from(sc));
                    let min = _mm512_set1_ps(-(f32::from_bits(word(ns + s)) * f32::from(m)));
                    let at = 5 * ns + 8 * (b / 2);
                    let nibble = 4 * (b % 2) as u32;
                    let f = |half: usize| {
                        let q = _mm512_and_si512(shift(bytes16(at, half), nibble), _mm512_set1_epi32(15));
                        _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), scale), min)
                    };
                    [f(0), f(1)]
                }
                _ => {
                    let (s, c8) = (b / 8, b % 8);
                    let (h, c) = (c8 / 4, c8 % 4);
                    let d = f32::from_bits(word(s));
                    // Bytes 2 c8 and 2 c8 + 1 of the super-block's 16 scales: one half of a word.
                    let pair = word(ns + 4 * s + c8 / 2) >> (16 * (c8 % 2));
                    let (sc0, sc1) = (pair as u8 as i8, (pair >> 8) as u8 as i8);
                    let (low, high) = (5 * ns + 32 * s + 16 * h + 8 * (c % 2), 37 * ns + 16 * s + 8 * h);
                    let f = |half: usize, sc: i8| {
                        let l = _mm512_and_si512(shift(bytes16(low, half), 4 * (c / 2) as u32), _mm512_set1_epi32(15));
                        let hh = _mm512_and_si512(shift(bytes16(high, half), 2 * c as u32), _mm512_set1_epi32(3));
                        let q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32::<4>(hh)), _mm512_set1_epi32(32));
                        _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d * f32::from(sc)))
                    };
                    [f(0, sc0), f(1, sc1)]
                }
            }
        }

        /// The lane sums of `a[0..4]`.
        #[target_feature(enable = "avx512f,avx2")]
        #[inline]
        pub(super) fn hsum4(a: [V; 4]) -> [f32; 4] {
            let [a0, a1, a2, a3] = a;
            // Per 128-bit lane: [a0, a1, a0, a1] and [a2, a3, a2, a3] partial sums.
            let b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
            let b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
            // Per 128-bit lane: [a0, a1, a2, a3] partial sums; then the 4 lanes added.
            let c = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(b0, b1), _mm512_shuffle_ps::<0xee>(b0, b1));
            let c = _mm512_add_ps(c, _mm512_shuffle_f32x4::<0x4e>(c, c));
            let c = _mm512_castps512_ps256(c);
            let s = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c));
            let mut out = [0f32; 4];
            // SAFETY: `out` holds 4 floats.
            unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
            out
        }
    }

    /// AVX2 and FMA: 8 lanes; prefill micro-tiles of 4 weight rows by 2 activation rows (16 registers).
    mod avx2_ops {
        use std::arch::x86_64::*;

        pub(super) type V = __m256;
        pub(super) const LANES: usize = 8;
        pub(super) const BV: usize = 4;
        pub(super) const NR: usize = 8;
        pub(super) const MR: usize = 2;
        pub(super) const HOIST: usize = 4;
        pub(super) const DIRECT: usize = 3;

        #[target_feature(enable = "avx")]
        #[inline]
        pub(super) fn zero() -> V {
            _mm256_setzero_ps()
        }

        #[target_feature(enable = "avx,fma")]
        #[inline]
        pub(super) fn fma(a: V, b: V, c: V) -> V {
            _mm256_fmadd_ps(a, b, c)
        }

        #[target_feature(enable = "avx")]
        #[inline]
        pub(super) fn add(a: V, b: V) -> V {
            _mm256_add_ps(a, b)
        }

        /// # Safety
        ///
        /// `p` is readable for 8 floats.
        #[target_feature(enable = "avx")]
        #[inline]
        pub(super) unsafe fn load(p: *const f32) -> V {
            // SAFETY: the caller's.
            unsafe { _mm256_loadu_ps(p) }
        }

        /// # Safety
        ///
        /// `p` is writable for 8 floats.
        #[target_feature(enable = "avx")]
        #[inline]
        pub(super) unsafe fn store(p: *mut f32, v: V) {
            // SAFETY: the caller's.
            unsafe { _mm256_storeu_ps(p, v) }
        }

        /// Asks for the cache line holding `p` (a hint: `p` need not point into anything).
        #[target_feature(enable = "sse")]
        #[inline]
        pub(super) fn prefetch(p: *const u32) {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }

        /// A Q8_0 block (32 signed bytes at `p`) times `d`.
        ///
        /// # Safety
        ///
        /// `p` is readable for 8 words.
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) unsafe fn q8(p: *const u32, d: f32) -> [V; BV] {
            let p = p.cast::<u8>();
            let d = _mm256_set1_ps(d);
            let mut out = [_mm256_setzero_ps(); BV];
            for (j, o) in out.iter_mut().enumerate() {
                // SAFETY: the caller's (8 bytes at `8 j < 32`).
                let q = unsafe { _mm_loadl_epi64(p.add(8 * j).cast()) };
                *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            }
            out
        }

        /// A Q4_1 block (16 bytes at `p`: element `j` in byte `j`'s low nibble, `j + 16` in its
        /// high one) as `q * d + m`.
        ///
        /// # Safety
        ///
        /// `p` is readable for 4 words.
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) unsafe fn q4(p: *const u32, d: f32, m: f32) -> [V; BV] {
            let p = p.cast::<u8>();
            // SAFETY: the caller's (bytes 0..8 and 8..16).
            let (a, b) = unsafe { (_mm_loadl_epi64(p.cast()), _mm_loadl_epi64(p.add(8).cast())) };
            let (a, b) = (_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(b));
            let low = _mm256_set1_epi32(0x0f);
            let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            // A multiply then an add, as the dequantization computes each element (not an FMA).
            let f = |q: __m256i| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m);
            [
                f(_mm256_and_si256(a, low)),
                f(_mm256_and_si256(b, low)),
                f(_mm256_srli_epi32::<4>(a)),
                f(_mm256_srli_epi32::<4>(b)),
            ]
        }

        buffered_kquant!("avx");

        /// The lane sums of `a[0..4]`.
        #[target_feature(enable = "avx")]
        #[inline]
        pub(super) fn hsum4(a: [V; 4]) -> [f32; 4] {
            let [a0, a1, a2, a3] = a;
            // Per 128-bit lane: [a0, a1, a0, a1] and [a2, a3, a2, a3] partial sums.
            let b0 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
            let b1 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
            let c = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(b0, b1), _mm256_shuffle_ps::<0xee>(b0, b1));
            let s = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c));
            let mut out = [0f32; 4];
            // SAFETY: `out` holds 4 floats.
            unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
            out
        }
    }

    kernels!(avx512, "avx512f,avx2,fma", avx512_ops);
    kernels!(avx2, "avx2,fma", avx2_ops);
}

#[cfg(target_arch = "aarch64")]
mod arm {
    //! The AArch64 NEON vector operations (no prefetching: its intrinsic is not stable yet).

    /// NEON: 4 lanes; prefill micro-tiles of 4 weight rows by 4 activation rows.
    mod neon_ops {
        use std::arch::aarch64::*;

        pub(super) type V = float32x4_t;
        pub(super) const LANES: usize = 4;
        pub(super) const BV: usize = 8;
        pub(super) const NR: usize = 8;
        pub(super) const MR: usize = 4;
        pub(super) const HOIST: usize = 8;
        pub(super) const DIRECT: usize = 4;

        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) fn zero() -> V {
            vdupq_n_f32(0.0)
        }

        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) fn fma(a: V, b: V, c: V) -> V {
            vfmaq_f32(c, a, b)
        }

        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) fn add(a: V, b: V) -> V {
            vaddq_f32(a, b)
        }

        /// # Safety
        ///
        /// `p` is readable for 4 floats.
        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) unsafe fn load(p: *const f32) -> V {
            // SAFETY: the caller's.
            unsafe { vld1q_f32(p) }
        }

        /// # Safety
        ///
        /// `p` is writable for 4 floats.
        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) unsafe fn store(p: *mut f32, v: V) {
            // SAFETY: the caller's.
            unsafe { vst1q_f32(p, v) }
        }

        /// No prefetching.
        #[inline]
        pub(super) fn prefetch(_p: *const u32) {}

        /// 16 bytes widened to 4 vectors of `i32` (`SIGNED`: as `i8`, else as `u8`), converted to
        /// f32.
        #[target_feature(enable = "neon")]
        #[inline]
        fn widen(q: uint8x16_t, signed: bool) -> [V; 4] {
            if signed {
                let q = vreinterpretq_s8_u8(q);
                let (lo, hi) = (vmovl_s8(vget_low_s8(q)), vmovl_high_s8(q));
                [
                    vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
                    vcvtq_f32_s32(vmovl_high_s16(lo)),
                    vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                    vcvtq_f32_s32(vmovl_high_s16(hi)),
                ]
            } else {
                let (lo, hi) = (vmovl_u8(vget_low_u8(q)), vmovl_high_u8(q));
                [
                    vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))),
                    vcvtq_f32_u32(vmovl_high_u16(lo)),
                    vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
                    vcvtq_f32_u32(vmovl_high_u16(hi)),
                ]
            }
        }

        /// A Q8_0 block (32 signed bytes at `p`) times `d`.
        ///
        /// # Safety
        ///
        /// `p` is readable for 8 words.
        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) unsafe fn q8(p: *const u32, d: f32) -> [V; BV] {
            let p = p.cast::<u8>();
            // SAFETY: the caller's (two 16-byte loads).
            let (a, b) = unsafe { (vld1q_u8(p), vld1q_u8(p.add(16))) };
            let [a0, a1, a2, a3] = widen(a, true);
            let [b0, b1, b2, b3] = widen(b, true);
            [a0, a1, a2, a3, b0, b1, b2, b3].map(|v| vmulq_n_f32(v, d))
        }

        /// A Q4_1 block (16 bytes at `p`: element `j` in byte `j`'s low nibble, `j + 16` in its
        /// high one) as `q * d + m`.
        ///
        /// # Safety
        ///
        /// `p` is readable for 4 words.
        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) unsafe fn q4(p: *const u32, d: f32, m: f32) -> [V; BV] {
            // SAFETY: the caller's.
            let w = unsafe { vld1q_u8(p.cast()) };
            let [a0, a1, a2, a3] = widen(vandq_u8(w, vdupq_n_u8(0x0f)), false);
            let [b0, b1, b2, b3] = widen(vshrq_n_u8::<4>(w), false);
            let m = vdupq_n_f32(m);
            // A multiply then an add, as the dequantization computes each element (not an FMA).
            [a0, a1, a2, a3, b0, b1, b2, b3].map(|v| vaddq_f32(vmulq_n_f32(v, d), m))
        }

        buffered_kquant!("neon");

        /// The lane sums of `a[0..4]`.
        #[target_feature(enable = "neon")]
        #[inline]
        pub(super) fn hsum4(a: [V; 4]) -> [f32; 4] {
            let [a0, a1, a2, a3] = a;
            let s = vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
            let mut out = [0f32; 4];
            // SAFETY: `out` holds 4 floats.
            unsafe { vst1q_f32(out.as_mut_ptr(), s) };
            out
        }
    }

    kernels!(neon, "neon", neon_ops);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QuantWeight;
    use kiln_compiler::tensor::Tensor;

    /// A small deterministic generator (64-bit LCG, high bits).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 32) as u32
        }

        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        }

        /// Values in [-1, 1) times a per-block magnitude spread over 1e-3..1e1.
        fn values(&mut self, n: usize) -> Vec<f32> {
            let mut out = Vec::with_capacity(n);
            for _ in 0..n.div_ceil(BLOCK) {
                let m = 10f32.powf(self.unit() * 2.0 - 1.0);
                out.extend((0..BLOCK).map(|_| self.unit() * m));
            }
            out.truncate(n);
            out
        }
    }

    const FORMATS: [WeightFormat; 5] =
        [WeightFormat::Q8_0, WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q4_K, WeightFormat::Q6_K];
    const KS: [usize; 6] = [32, 64, 96, 576, 800, 1536];

    /// The row lengths tested for `format`: [`KS`] (and Gemma's 640), or for the K-quants, whose
    /// rows are whole super-blocks of 256, 256 to 1536.
    fn ks(format: WeightFormat) -> Vec<usize> {
        match format.row_multiple() {
            32 => KS.iter().copied().chain([640]).collect(),
            _ => vec![256, 512, 768, 1536],
        }
    }

    /// `k` rounded up to whole blocks of `format`.
    fn k_of(format: WeightFormat, k: usize) -> usize {
        k.next_multiple_of(format.row_multiple())
    }
    const ROWS: [usize; 9] = [1, 2, 3, 4, 5, 7, 8, 9, 33];
    const MS: [usize; 6] = [1, 2, 3, 4, 5, 17];

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
        for imp in available() {
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
        assert!(available().contains(&Impl::Scalar));
        assert_eq!(available().first().copied(), Some(best()));
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
                        for imp in available() {
                            assert!(gemm(imp, &w, &xs, m).iter().all(|&g| g == expect), "{format} {}", imp.name());
                        }
                    }
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
            for imp in available() {
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
                for imp in available() {
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
            for imp in available() {
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
                for imp in available().into_iter().filter(|&imp| imp != Impl::Scalar) {
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
        assert!(available().iter().any(|i| i.name() == kernel_name()));
    }
}
