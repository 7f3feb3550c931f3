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
//! buffers the GPU reads. Implementations, chosen once at run time ([`kernel_name`]):
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
//! - **`neon`** (AArch64): widening byte multiplies (`smull`/`smlal2`) and pairwise adds into
//!   `i32` lanes (the `sdot` intrinsics are not stable in Rust yet).
//! - **`scalar`**: portable, and the reference the others are tested against.
//!
//! Q5_0, Q4_K and Q6_K have the scalar kernel and one SIMD kernel, AVX-512 VNNI on 256 bits (a
//! row at a time, see `x86::blocks`); the other implementations run the scalar one for them.
//!
//! Every SIMD kernel works on tiles of [`TILE`] rows, so each activation block loaded (and the
//! per-block work on it) serves several rows, while the rows' words stream through once: decode is
//! bound by the weight's memory traffic, so the x86 kernels also prefetch the words two tiles
//! ahead (the hardware prefetcher alone follows the tile's interleaved row streams poorly).
//! Threading is the caller's: split `out` and the words by rows.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::BLOCK;
use std::sync::OnceLock;

/// Rows a SIMD kernel computes together.
pub const TILE: usize = 4;

/// How many tiles ahead of the one being computed a SIMD kernel prefetches the weight words.
const PREFETCH: usize = 2;

/// Two activation blocks, aligned so a block is one aligned 256-bit load and a pair one 512-bit load.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 2 * BLOCK]);

/// An activation row quantized per block of 32 to `i8` (llama.cpp's Q8_0 with Q8_1's block sum).
///
/// For each block `b`: its scale `d[b] = max|x| / 127`, `s[b] = d[b] * sum(q)` (for Q4_1's
/// minimum term) and the 32 quants `q = round(x / d)` (0 where `d = 0`), stored contiguously and
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
        let quants = self.q.iter_mut().flat_map(|l| l.0.chunks_exact_mut(BLOCK));
        for (block, q) in x.chunks(BLOCK).zip(quants) {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = if block.iter().any(|v| v.is_nan()) { f32::NAN } else { amax / 127.0 };
            // `d` is NaN or infinite only for non-finite input: then the quants are 0 (`as`
            // saturates, NaN to 0) and the NaN or infinite scale carries into the products.
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in q.iter_mut().zip(block) {
                // |v * id| <= 127 up to rounding, and `as` saturates.
                *q = (v * id).round() as i8;
                sum += i32::from(*q);
            }
            self.d.push(d);
            self.s.push(d * sum as f32);
        }
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
    /// AArch64 NEON (widening multiplies; the `sdot` intrinsics are not stable yet).
    Neon,
}

impl Impl {
    /// Every implementation, the preferred first.
    pub const ALL: [Impl; 5] = [Impl::Avx512Vnni, Impl::AvxVnni, Impl::Avx2, Impl::Neon, Impl::Scalar];

    /// The name [`kernel_name`] reports.
    pub fn name(self) -> &'static str {
        match self {
            Impl::Scalar => "scalar",
            Impl::Avx2 => "avx2",
            Impl::AvxVnni => "avx-vnni",
            Impl::Avx512Vnni => "avx512-vnni",
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
            Impl::AvxVnni => has!("avx2") && has!("fma") && has!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Impl::Avx512Vnni => {
                has!("avx2")
                    && has!("fma")
                    && has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512vl")
                    && has!("avx512vnni")
            }
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

/// The implementation [`dot_rows`] uses: the preferred available one, chosen on the first call.
pub fn best() -> Impl {
    static BEST: OnceLock<Impl> = OnceLock::new();
    *BEST.get_or_init(|| available().first().copied().unwrap_or(Impl::Scalar))
}

/// The name of the implementation [`dot_rows`] uses (`"avx512-vnni"`, `"avx-vnni"`, `"avx2"` or
/// `"scalar"`).
pub fn kernel_name() -> &'static str {
    best().name()
}

/// `out[r] = dot(row r, x)` for `r` in `0..out.len()`, of a block-quantized weight of `k`
/// elements a row in the device layout whose row `r` starts at `words[r * format.row_words(k)]`.
///
/// Shapes that do not fit give NaN rather than a panic: every row when `format` is not quantized or
/// `k` is not `x.len()` (a multiple of 32), and the rows past the end of `words`. With `k = 0`
/// every dot product is 0.
pub fn dot_rows(format: WeightFormat, words: &[u32], k: usize, x: &Q8Acts, out: &mut [f32]) {
    dot_rows_with(best(), format, words, k, x, out);
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
        let imp = if imp.is_available() { imp } else { Impl::Scalar };
        match imp {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `imp` is available, so the CPU has the kernel's features.
            Impl::Avx512Vnni => unsafe { x86::blocks::rows(format, words, stride, k, x, out) },
            _ => scalar_blocks(format, words, stride, k, x, out),
        }
        return;
    }
    let q4 = format == WeightFormat::Q4_1;
    let imp = if imp.is_available() { imp } else { Impl::Scalar };
    match imp {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `imp` is available, so the CPU has the kernel's features; `words` holds the
        // `out.len()` rows of `stride` words each, and `x` has `nb` blocks (`k == x.len()`)
        // (what `drive` asserts in debug builds; `tile` checks it in every build).
        Impl::Avx512Vnni => unsafe { drive::<x86::Avx512Vnni>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::AvxVnni => unsafe { drive::<x86::AvxVnni>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::Avx2 => unsafe { drive::<x86::Avx2>(q4, words, stride, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::Neon => unsafe { drive::<arm::Neon>(q4, words, stride, nb, x, out) },
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
    /// Q8_0 rows.
    unsafe fn q8_0<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, ahead: usize) -> [f32; R];
    /// Q4_1 rows.
    unsafe fn q4_1<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, ahead: usize) -> [f32; R];
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
    let v = unsafe { if q4 { K::q4_1::<R>(rows, nb, x, ahead) } else { K::q8_0::<R>(rows, nb, x, ahead) } };
    for (o, v) in o.iter_mut().zip(v) {
        *o = v;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The x86-64 kernels. Inside a `#[target_feature]` function the register-only intrinsics of
    //! its features are safe; the loads through raw pointers are not, and say why they hold.

    use super::{Kernel, Q8Acts};
    use std::arch::x86_64::*;

    /// Asks for the cache line holding `p` (a hint: `p` need not point into anything).
    #[target_feature(enable = "sse")]
    #[inline]
    fn prefetch(p: *const u32) {
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The integer steps of the 256-bit AVX2 kernel.
    mod avx2_ops {
        use std::arch::x86_64::*;

        /// Per activation block work for Q8_0 (none).
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn q8_prep(_x: __m256i) -> __m256i {
            _mm256_setzero_si256()
        }

        /// The 8 lane sums of 4 products of signed `w` and `x` bytes (`x` within ±127).
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn q8_dot(w: __m256i, x: __m256i, _prep: __m256i) -> __m256i {
            // |w| (unsigned, so -128 is 128) times x with w's sign: pairs reach 2 * 128 * 127 < 2^15.
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
        }

        /// A Q4_1 block's quants in element order from its 16 bytes in both halves: the low
        /// nibbles (elements 0..16) from the low half, the high ones (16..32) shifted down by 4.
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn nibbles(w: __m256i) -> __m256i {
            _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f))
        }

        /// What the lanes of [`nibbles`]' sums are multiplied by at the end (nothing).
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn unscale() -> __m256 {
            _mm256_set1_ps(1.0)
        }

        /// The 8 lane sums of 4 products of unsigned `q` (nibbles) and signed `x` bytes.
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn u_dot(q: __m256i, x: __m256i) -> __m256i {
            _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
        }
    }

    /// The integer steps of the 256-bit AVX-VNNI kernel.
    mod vnni_ops {
        use std::arch::x86_64::*;

        /// `-128 * (sum of each lane's 4 x bytes)`: the start that undoes Q8_0's offset.
        #[target_feature(enable = "avx2,avxvnni")]
        #[inline]
        pub(super) fn q8_prep(x: __m256i) -> __m256i {
            let zero = _mm256_setzero_si256();
            _mm256_sub_epi32(zero, _mm256_dpbusd_avx_epi32(zero, _mm256_set1_epi8(-128), x))
        }

        /// The lane sums of signed `w` times `x`, as `(w + 128) * x` added to `prep`.
        #[target_feature(enable = "avx2,avxvnni")]
        #[inline]
        pub(super) fn q8_dot(w: __m256i, x: __m256i, prep: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(prep, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), x)
        }

        /// A Q4_1 block's quants from its 16 bytes in both halves: the low nibbles, and the high
        /// nibbles left in place (16 times the quant, which `vpdpbusd` sums without saturating;
        /// [`unscale`] divides those lanes' sums back).
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn nibbles(w: __m256i) -> __m256i {
            let (lo, hi) = (0x0f0f_0f0f, 0xf0f0_f0f0_u32 as i32);
            _mm256_and_si256(w, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi))
        }

        /// 1/16 for the lanes of the high nibbles (exact: a power of two).
        #[target_feature(enable = "avx2")]
        #[inline]
        pub(super) fn unscale() -> __m256 {
            _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, 0.0625, 0.0625, 0.0625, 0.0625)
        }

        /// The lane sums of unsigned `q` times signed `x`.
        #[target_feature(enable = "avx2,avxvnni")]
        #[inline]
        pub(super) fn u_dot(q: __m256i, x: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x)
        }
    }

    /// The 256-bit kernels (one block per step) over a module of integer steps (`$ops`).
    macro_rules! kernel256 {
        ($kernel:ident, $module:ident, $features:literal, $ops:ident) => {
            mod $module {
                use super::super::Q8Acts;
                use super::$ops as ops;
                use super::{hsum256, prefetch};
                use std::arch::x86_64::*;

                /// See [`super::super::Kernel::q8_0`] (the same contract).
                #[target_feature(enable = $features)]
                pub(super) unsafe fn q8_0<const R: usize>(
                    rows: [*const u32; R],
                    nb: usize,
                    x: &Q8Acts,
                    ahead: usize,
                ) -> [f32; R] {
                    let xq = x.q.as_ptr().cast::<__m256i>();
                    let mut acc = [_mm256_setzero_ps(); R];
                    for (b, &dx) in x.d.iter().enumerate().take(nb) {
                        // SAFETY: block `b < nb` of `x.q`, which holds at least `nb.div_ceil(2)`
                        // lines of two 32-byte blocks (the contract, asserted in `tile`); each
                        // block is 32-byte aligned (`Line` is 64-byte aligned).
                        let xv = unsafe { _mm256_load_si256(xq.add(b)) };
                        let dx = _mm256_set1_ps(dx);
                        let prep = ops::q8_prep(xv);
                        for (a, &row) in acc.iter_mut().zip(&rows) {
                            if b % 16 == 0 {
                                prefetch(row.wrapping_add(b + ahead));
                            }
                            prefetch(row.wrapping_add(nb + 8 * b + ahead));
                            // SAFETY: a Q8_0 row holds `nb` scales, then 8 quant words a block:
                            // word `b < nb` and words `nb + 8 b .. nb + 8 b + 8 <= 9 nb` (the
                            // contract; each row's span asserted in `tile`).
                            let (dw, w) =
                                unsafe { (row.add(b).read(), _mm256_loadu_si256(row.add(nb + 8 * b).cast())) };
                            let scale = _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(dw)), dx);
                            *a = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(ops::q8_dot(w, xv, prep)), *a);
                        }
                    }
                    let mut out = [0f32; R];
                    for (o, a) in out.iter_mut().zip(acc) {
                        *o = hsum256(a);
                    }
                    out
                }

                /// See [`super::super::Kernel::q4_1`] (the same contract).
                #[target_feature(enable = $features)]
                pub(super) unsafe fn q4_1<const R: usize>(
                    rows: [*const u32; R],
                    nb: usize,
                    x: &Q8Acts,
                    ahead: usize,
                ) -> [f32; R] {
                    let xq = x.q.as_ptr().cast::<__m256i>();
                    let mut acc = [_mm256_setzero_ps(); R];
                    for (b, &dx) in x.d.iter().enumerate().take(nb) {
                        // SAFETY: as in `q8_0`.
                        let xv = unsafe { _mm256_load_si256(xq.add(b)) };
                        let dx = _mm256_set1_ps(dx);
                        for (a, &row) in acc.iter_mut().zip(&rows) {
                            if b % 16 == 0 {
                                prefetch(row.wrapping_add(b + ahead));
                                prefetch(row.wrapping_add(nb + b + ahead));
                            }
                            prefetch(row.wrapping_add(2 * nb + 4 * b + ahead));
                            // SAFETY: a Q4_1 row holds `nb` scales, `nb` minimums, then 4 quant
                            // words a block: word `b < nb` and words `2 nb + 4 b .. 2 nb + 4 b + 4
                            // <= 6 nb` (the contract; each row's span asserted in `tile`).
                            let (dw, w) =
                                unsafe { (row.add(b).read(), _mm_loadu_si128(row.add(2 * nb + 4 * b).cast())) };
                            let q = ops::nibbles(_mm256_broadcastsi128_si256(w));
                            let scale = _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(dw)), dx);
                            *a = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(ops::u_dot(q, xv)), *a);
                        }
                    }
                    // The minimums' term, `sum_b m_w[b] * s_x[b]`, 8 blocks at a time.
                    let whole = nb - nb % 8;
                    let sx = x.s.as_ptr();
                    let unscale = ops::unscale();
                    let mut out = [0f32; R];
                    for ((o, a), &row) in out.iter_mut().zip(acc).zip(&rows) {
                        let mins = row.wrapping_add(nb).cast::<f32>();
                        let mut m = _mm256_setzero_ps();
                        for b in (0..whole).step_by(8) {
                            // SAFETY: `b + 8 <= nb`: minimums `nb + b .. nb + b + 8` of the row's
                            // `nb` (words `nb .. 2 nb`), and 8 of `x`'s `nb` sums (the contract,
                            // asserted in `tile`).
                            let (mw, s) = unsafe { (_mm256_loadu_ps(mins.add(b)), _mm256_loadu_ps(sx.add(b))) };
                            m = _mm256_fmadd_ps(mw, s, m);
                        }
                        let mut tail = 0f32;
                        for b in whole..nb {
                            // SAFETY: `b < nb`: minimum `b` and sum `b`, as above.
                            tail += unsafe { mins.add(b).read() * sx.add(b).read() };
                        }
                        *o = hsum256(_mm256_fmadd_ps(a, unscale, m)) + tail;
                    }
                    out
                }
            }

            /// A 256-bit kernel.
            pub(super) struct $kernel;

            impl Kernel for $kernel {
                unsafe fn q8_0<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, ahead: usize) -> [f32; R] {
                    // SAFETY: the trait's contract, which includes the features.
                    unsafe { $module::q8_0::<R>(rows, nb, x, ahead) }
                }

                unsafe fn q4_1<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, ahead: usize) -> [f32; R] {
                    // SAFETY: as above.
                    unsafe { $module::q4_1::<R>(rows, nb, x, ahead) }
                }
            }
        };
    }

    pub(super) mod blocks {
        //! Q5_0, Q4_K and Q6_K with AVX-512 VNNI on 256 bits, a row at a time and a block of 32
        //! per step: the weight's 5-bit (Q5_0: nibbles, and the fifth bits spread from their word
        //! by a byte mask), 4-bit (Q4_K: one nibble of 32 bytes) or 6-bit (Q6_K: a nibble and a
        //! bit pair) quants assembled into 32 unsigned bytes in element order, then `vpdpbusd`
        //! with the activation block. Q5_0's and Q6_K's offsets (16, 32) come off as `offset *
        //! sum(q_x)` per lane (four elements, never across Q6_K's 16-element scales), each lane
        //! scaled by its block's (Q6_K: its half's) `scale * d_x`; Q4_K's minimums add
        //! `min * s_x` per block.

        use super::super::{BLOCK, Q8Acts};
        use super::hsum256;
        use kiln_compiler::lower::WeightFormat;
        use kiln_compiler::lower::format::SUPER_BLOCK;
        use std::arch::x86_64::*;

        /// The 32 bytes of the 8 words of `row` from word `at`, or `None` past its end.
        #[target_feature(enable = "avx2")]
        #[inline]
        fn load256(row: &[u32], at: usize) -> Option<__m256i> {
            let w = row.get(at..at.checked_add(8)?)?;
            // SAFETY: `w` holds 8 words, 32 bytes (a checked `get`, in every build).
            debug_assert_eq!(w.len(), 8);
            Some(unsafe { _mm256_loadu_si256(w.as_ptr().cast()) })
        }

        /// `v`'s 16-bit lanes shifted right by `n`.
        #[target_feature(enable = "avx2")]
        #[inline]
        fn shr16(v: __m256i, n: usize) -> __m256i {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
        }

        /// `out[r] = dot(row r, x)` for the rows of `words` (`stride` words each, `k` elements of
        /// `format`: Q5_0, Q4_K or Q6_K); NaN for a row whose words do not fit the layout.
        ///
        /// # Safety
        ///
        /// The CPU has AVX-512 (F, BW, VL, VNNI), AVX2 and FMA. (Shapes are checked here.)
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        pub(in super::super) unsafe fn rows(
            format: WeightFormat,
            words: &[u32],
            stride: usize,
            k: usize,
            x: &Q8Acts,
            out: &mut [f32],
        ) {
            let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
            let xq: Vec<__m256i> = x
                .quant_blocks()
                .take(nb)
                .map(|q| {
                    // SAFETY: `q` is one block, 32 bytes (`chunks_exact(BLOCK)` of the lines).
                    debug_assert_eq!(q.len(), BLOCK);
                    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
                })
                .collect();
            if xq.len() < nb || x.d.len() < nb || x.s.len() < nb || stride == 0 {
                out.fill(f32::NAN);
                return;
            }
            let zero = _mm256_setzero_si256();
            for (o, row) in out.iter_mut().zip(words.chunks_exact(stride)) {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                let mut ok = true;
                for (b, ((&xv, &dx), &sx)) in xq.iter().zip(&x.d).zip(&x.s).enumerate() {
                    let f = |i: usize| row.get(i).map(|&w| f32::from_bits(w));
                    let step = match format {
                        WeightFormat::Q5_0 => (|| {
                            let q = row.get(2 * nb + 4 * b..2 * nb + 4 * b + 4)?;
                            // SAFETY: `q` holds 4 words, 16 bytes (a checked `get`, in every build).
                            debug_assert_eq!(q.len(), 4);
                            let q = unsafe { _mm_loadu_si128(q.as_ptr().cast()) };
                            // Elements 0..16 in the low nibbles, 16..32 in the high ones.
                            let nibbles = _mm256_and_si256(
                                _mm256_srlv_epi32(
                                    _mm256_broadcastsi128_si256(q),
                                    _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
                                ),
                                _mm256_set1_epi8(0x0f),
                            );
                            let fifth = _mm256_maskz_mov_epi8(*row.get(nb + b)?, _mm256_set1_epi8(0x10));
                            let q = _mm256_or_si256(nibbles, fifth);
                            let offset = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(16), xv);
                            let sums = _mm256_sub_epi32(_mm256_dpbusd_epi32(zero, q, xv), offset);
                            Some((_mm256_set1_ps(f(b)? * dx), sums, 0.0))
                        })(),
                        WeightFormat::Q4_K => (|| {
                            let s = b / 8;
                            let packed: [u8; 12] =
                                bytemuck::cast_slice::<u32, u8>(row.get(2 * ns + 3 * s..2 * ns + 3 * s + 3)?)
                                    .try_into()
                                    .ok()?;
                            let (sc, m) = crate::gguf::q4_k_scale_min(&packed, b % 8);
                            let q = _mm256_and_si256(
                                shr16(load256(row, 5 * ns + 8 * (b / 2))?, 4 * (b % 2)),
                                _mm256_set1_epi8(0x0f),
                            );
                            let scale = f(s)? * f32::from(sc);
                            let min = -(f(ns + s)? * f32::from(m));
                            Some((_mm256_set1_ps(scale * dx), _mm256_dpbusd_epi32(zero, q, xv), min * sx))
                        })(),
                        _ => (|| {
                            let (s, c8) = (b / 8, b % 8);
                            let (h, c) = (c8 / 4, c8 % 4);
                            let lo = load256(row, 5 * ns + 32 * s + 16 * h + 8 * (c % 2))?;
                            let hi = load256(row, 37 * ns + 16 * s + 8 * h)?;
                            let q = _mm256_or_si256(
                                _mm256_and_si256(shr16(lo, 4 * (c / 2)), _mm256_set1_epi8(0x0f)),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(shr16(hi, 2 * c), _mm256_set1_epi8(3))),
                            );
                            let scales = bytemuck::cast_slice::<u32, u8>(row.get(ns + 4 * s..ns + 4 * s + 4)?);
                            let sc0 = f32::from(*scales.get(2 * c8)? as i8);
                            let sc1 = f32::from(*scales.get(2 * c8 + 1)? as i8);
                            let d = f(s)? * dx;
                            let (a, z) = (sc0 * d, sc1 * d);
                            let offset = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(32), xv);
                            let sums = _mm256_sub_epi32(_mm256_dpbusd_epi32(zero, q, xv), offset);
                            Some((_mm256_setr_ps(a, a, a, a, z, z, z, z), sums, 0.0))
                        })(),
                    };
                    let Some((scale, sums, min)) = step else {
                        ok = false;
                        break;
                    };
                    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc);
                    mins += min;
                }
                *o = if ok { hsum256(acc) + mins } else { f32::NAN };
            }
        }
    }

    kernel256!(Avx2, avx2, "avx2,fma", avx2_ops);
    kernel256!(AvxVnni, avx_vnni, "avx2,fma,avxvnni", vnni_ops);

    /// The AVX-512 VNNI kernel: two blocks (one activation line) per 512-bit step.
    pub(super) struct Avx512Vnni;

    impl Kernel for Avx512Vnni {
        unsafe fn q8_0<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, ahead: usize) -> [f32; R] {
            // SAFETY: the trait's contract, which includes the features.
            unsafe { avx512::tile::<R, false>(rows, nb, x, ahead) }
        }

        unsafe fn q4_1<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, ahead: usize) -> [f32; R] {
            // SAFETY: as above.
            unsafe { avx512::tile::<R, true>(rows, nb, x, ahead) }
        }
    }

    mod avx512 {
        //! Two blocks per 512-bit step, `R` rows at a time.
        //!
        //! A step takes blocks `b` and `b + 1` (`b` even): one activation line (64 bytes, aligned)
        //! and the two blocks' weight quants, contiguous in a row. Q8_0: the 64 weight bytes as
        //! they are, against the natural line, so `i32` lanes 0..8 sum block `b` and 8..16 block
        //! `b + 1`. Q4_1: the 32 weight bytes broadcast to both halves (a load, no shuffle), masked
        //! to the low nibbles in the low half and to the high nibbles, left in place, in the high
        //! half; the line in [`Q8Acts`]' `qh` order (`b`'s first 16, `b + 1`'s first 16, `b`'s
        //! last 16, `b + 1`'s last 16) matches, so lanes 0..4 and 8..12 sum block `b`, 4..8 and
        //! 12..16 block `b + 1`, and lanes 8..16 sum 16 times the quants (which `vpdpbusd` sums
        //! without overflow: 4 * 240 * 127 < 2^31), divided back once at the end (exactly, a power
        //! of two). Each lane's sums meet their block's scale `d_w * d_x`, spread by a permute from
        //! a group's 16 products. A lone last block loads only its own words (masked); the missing
        //! block's activation quants and scales are zeros.

        use super::super::Q8Acts;
        use super::prefetch;
        use std::arch::x86_64::*;

        /// Blocks whose scales are loaded (and multiplied by the activation's) at once.
        const GROUP: usize = 16;

        /// Q8_0 (`Q4 = false`) or Q4_1 rows: see [`super::super::Kernel`] for the contract.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        pub(super) unsafe fn tile<const R: usize, const Q4: bool>(
            rows: [*const u32; R],
            nb: usize,
            x: &Q8Acts,
            ahead: usize,
        ) -> [f32; R] {
            let (xd, xs) = (x.d.as_ptr(), x.s.as_ptr());
            let mut acc = [_mm512_setzero_ps(); R];
            // Q4_1's minimum terms.
            let mut mins = [_mm512_setzero_ps(); R];
            let mut g0 = 0;
            while g0 < nb {
                let g = (nb - g0).min(GROUP);
                let gmask = ((1u32 << g) - 1) as __mmask16;
                // SAFETY: `g0 + g <= nb`: the `g` scales from `g0` are within `x`'s `nb` (the
                // contract, asserted in `tile`); the masked-off lanes are not read.
                let dx = unsafe { _mm512_maskz_loadu_ps(gmask, xd.add(g0)) };
                let mut scales = [_mm512_setzero_ps(); R];
                for ((s, m), &row) in scales.iter_mut().zip(mins.iter_mut()).zip(&rows) {
                    prefetch(row.wrapping_add(g0 + ahead));
                    if Q4 {
                        prefetch(row.wrapping_add(nb + g0 + ahead));
                    }
                    // SAFETY: words `g0 .. g0 + g <= nb` of the row: its scales (masked load).
                    *s = _mm512_mul_ps(unsafe { _mm512_maskz_loadu_ps(gmask, row.add(g0).cast()) }, dx);
                    if Q4 {
                        // SAFETY: words `nb + g0 .. nb + g0 + g <= 2 nb`, its minimums, and `x`'s
                        // sums `g0 .. g0 + g <= nb` (masked loads).
                        let (mw, sx) = unsafe {
                            (
                                _mm512_maskz_loadu_ps(gmask, row.add(nb + g0).cast()),
                                _mm512_maskz_loadu_ps(gmask, xs.add(g0)),
                            )
                        };
                        *m = _mm512_fmadd_ps(mw, sx, *m);
                    }
                }
                let mut p = 0;
                while p + 1 < g {
                    // SAFETY: blocks `g0 + p` and `g0 + p + 1` are below `nb` (the contract).
                    unsafe { step::<R, Q4, true>(&mut acc, &scales, &rows, nb, g0 + p, p, x, ahead) };
                    p += 2;
                }
                if p < g {
                    // SAFETY: block `g0 + p` is below `nb`.
                    unsafe { step::<R, Q4, false>(&mut acc, &scales, &rows, nb, g0 + p, p, x, ahead) };
                }
                g0 += g;
            }
            let (one, sixteenth) = (1.0, 0.0625);
            let unscale = _mm512_setr_ps(
                one, one, one, one, one, one, one, one, sixteenth, sixteenth, sixteenth, sixteenth, sixteenth,
                sixteenth, sixteenth, sixteenth,
            );
            let mut out = [0f32; R];
            for ((o, a), m) in out.iter_mut().zip(acc).zip(mins) {
                *o = _mm512_reduce_add_ps(if Q4 { _mm512_fmadd_ps(a, unscale, m) } else { a });
            }
            out
        }

        /// One step: blocks `b` and (when `TWO`) `b + 1` of every row, the `p`-th and `p + 1`-th of
        /// the group whose scales are `scales`.
        ///
        /// # Safety
        ///
        /// [`tile`]'s contract, with `b` even, `b < nb` and, when `TWO`, `b + 1 < nb`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn step<const R: usize, const Q4: bool, const TWO: bool>(
            acc: &mut [__m512; R],
            scales: &[__m512; R],
            rows: &[*const u32; R],
            nb: usize,
            b: usize,
            p: usize,
            x: &Q8Acts,
            ahead: usize,
        ) {
            debug_assert!(b.is_multiple_of(2) && b + usize::from(TWO) < nb, "block {b} of {nb}");
            let line = if Q4 { x.qh.as_ptr() } else { x.q.as_ptr() }.cast::<__m512i>();
            // SAFETY: `b < nb`, so line `b / 2 < nb.div_ceil(2)` of `x.q` or `x.qh` (at least
            // that many, the contract asserted in `tile`; 64-byte aligned).
            let xv = unsafe { _mm512_load_si512(line.add(b / 2)) };
            let zero = _mm512_setzero_si512();
            let offset = _mm512_set1_epi8(-128);
            let lanes = if Q4 {
                _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
            } else {
                _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
            };
            let lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(p as i32));
            let (lo, hi) = (0x0f0f_0f0f, 0xf0f0_f0f0_u32 as i32);
            let nibbles = _mm512_setr_epi32(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi);
            // Q8_0 offsets the signed weights to unsigned (`w ^ 0x80 = w + 128`) for `vpdpbusd`;
            // the sums start at `-128 * (each lane's sum of x)` to undo it.
            let start = if Q4 { zero } else { _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, xv)) };
            let (quants, words) = if Q4 { (2 * nb, 4) } else { (nb, 8) };
            for ((a, s), &row) in acc.iter_mut().zip(scales).zip(rows) {
                let w = row.wrapping_add(quants + words * b);
                prefetch(w.wrapping_add(ahead));
                let w = w.cast::<i32>();
                let q = if Q4 {
                    // SAFETY: words `2 nb + 4 b ..` plus 8 (`TWO`: `b + 1 < nb`) or 4 (masked) are
                    // within the row's `6 nb` (the contract; each row's span asserted in `tile`).
                    let w =
                        unsafe { if TWO { _mm256_loadu_si256(w.cast()) } else { _mm256_maskz_loadu_epi32(0x0f, w) } };
                    _mm512_and_si512(_mm512_broadcast_i64x4(w), nibbles)
                } else {
                    // SAFETY: words `nb + 8 b ..` plus 16 (`TWO`: `b + 1 < nb`) or 8 (masked) are
                    // within the row's `9 nb` (the contract; each row's span asserted in `tile`).
                    let w =
                        unsafe { if TWO { _mm512_loadu_si512(w.cast()) } else { _mm512_maskz_loadu_epi32(0x00ff, w) } };
                    _mm512_xor_si512(w, offset)
                };
                let sums = _mm512_dpbusd_epi32(start, q, xv);
                *a = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, *s), _mm512_cvtepi32_ps(sums), *a);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    //! The AArch64 NEON kernel: one block per step, `R` rows at a time. Products of bytes widen
    //! to `i16` (`smull`, `smlal2`: two products of at most 128 * 127 fit) and pairs of those
    //! to `i32` lanes (`sadalp`).

    use super::{Kernel, Q8Acts};
    use std::arch::aarch64::*;

    /// The 4 lane sums of a block's 32 products (`w0`, `x0` its first 16 bytes, `w1`, `x1` the
    /// last 16).
    #[target_feature(enable = "neon")]
    #[inline]
    fn dot32(w0: int8x16_t, w1: int8x16_t, x0: int8x16_t, x1: int8x16_t) -> int32x4_t {
        let p = vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), w0, x0);
        let q = vmlal_high_s8(vmull_s8(vget_low_s8(w1), vget_low_s8(x1)), w1, x1);
        vpadalq_s16(vpaddlq_s16(p), q)
    }

    /// Q8_0 (`Q4 = false`) or Q4_1 rows: see [`Kernel`] for the contract (no prefetching).
    #[target_feature(enable = "neon")]
    unsafe fn tile<const R: usize, const Q4: bool>(rows: [*const u32; R], nb: usize, x: &Q8Acts) -> [f32; R] {
        let xq = x.q.as_ptr().cast::<i8>();
        let mut acc = [vdupq_n_f32(0.0); R];
        for (b, &dx) in x.d.iter().enumerate().take(nb) {
            // SAFETY: block `b < nb` of `x.q`, at least `nb.div_ceil(2)` lines of two 32-byte
            // blocks (the contract, asserted in `tile`).
            let (x0, x1) = unsafe { (vld1q_s8(xq.add(32 * b)), vld1q_s8(xq.add(32 * b + 16))) };
            for (a, &row) in acc.iter_mut().zip(&rows) {
                // SAFETY: word `b < nb`, a scale (the contract; each row's span asserted in `tile`).
                let dw = f32::from_bits(unsafe { row.add(b).read() });
                let sums = if Q4 {
                    // SAFETY: words `2 nb + 4 b .. 2 nb + 4 b + 4 <= 6 nb` of the Q4_1 row.
                    let w = unsafe { vld1q_u8(row.add(2 * nb + 4 * b).cast()) };
                    let lo = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(0x0f)));
                    let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(w));
                    dot32(lo, hi, x0, x1)
                } else {
                    let w = row.wrapping_add(nb + 8 * b).cast::<i8>();
                    // SAFETY: words `nb + 8 b .. nb + 8 b + 8 <= 9 nb` of the Q8_0 row.
                    let (w0, w1) = unsafe { (vld1q_s8(w), vld1q_s8(w.add(16))) };
                    dot32(w0, w1, x0, x1)
                };
                *a = vfmaq_n_f32(*a, vcvtq_f32_s32(sums), dw * dx);
            }
        }
        let mut out = [0f32; R];
        for ((o, a), &row) in out.iter_mut().zip(acc).zip(&rows) {
            let mut sum = vaddvq_f32(a);
            if Q4 {
                let mins = row.wrapping_add(nb).cast::<f32>();
                for (b, &sx) in x.s.iter().enumerate().take(nb) {
                    // SAFETY: word `nb + b < 2 nb`, within the Q4_1 row's minimums.
                    sum += unsafe { mins.add(b).read() } * sx;
                }
            }
            *o = sum;
        }
        out
    }

    /// The NEON kernel.
    pub(super) struct Neon;

    impl Kernel for Neon {
        unsafe fn q8_0<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, _ahead: usize) -> [f32; R] {
            // SAFETY: the trait's contract, which includes the features.
            unsafe { tile::<R, false>(rows, nb, x) }
        }

        unsafe fn q4_1<const R: usize>(rows: [*const u32; R], nb: usize, x: &Q8Acts, _ahead: usize) -> [f32; R] {
            // SAFETY: as above.
            unsafe { tile::<R, true>(rows, nb, x) }
        }
    }
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
    const KS: [usize; 7] = [32, 64, 96, 544, 576, 1536, 32 * 33];

    /// The row lengths tested for `format`: [`KS`] (and Gemma's 640), or for the K-quants, whose
    /// rows are whole super-blocks of 256, 256 to 2048.
    fn ks(format: WeightFormat) -> Vec<usize> {
        match format.row_multiple() {
            32 => KS.iter().copied().chain([640]).collect(),
            _ => vec![256, 512, 768, 1536, 2048],
        }
    }

    /// `k` rounded up to whole blocks of `format`.
    fn k_of(format: WeightFormat, k: usize) -> usize {
        k.next_multiple_of(format.row_multiple())
    }
    const ROWS: [usize; 9] = [1, 2, 3, 4, 5, 7, 8, 9, 33];

    fn run(imp: Impl, w: &QuantWeight, x: &Q8Acts) -> Vec<f32> {
        let mut out = vec![-1.0; w.rows];
        dot_rows_with(imp, w.format, &w.words, w.k, x, &mut out);
        out
    }

    /// Per row, `sum_b |d_w d_x| sum|q_w q_x| + |m_w s_x|`: the magnitude of the float terms.
    fn magnitudes(w: &QuantWeight, x: &Q8Acts) -> Vec<f64> {
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
        for imp in available() {
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
        assert!(available().contains(&Impl::Scalar));
        assert_eq!(available().first().copied(), Some(best()));
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

    #[test]
    fn zero_activations_give_zero() {
        let mut rng = Rng(3);
        let mut x = Q8Acts::new();
        for format in FORMATS {
            let k = k_of(format, 576);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![9, k], rng.values(9 * k))).unwrap();
            x.quantize(&vec![0.0; k]);
            assert!(x.d.iter().all(|&d| d == 0.0));
            for imp in available() {
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
            for imp in available() {
                assert!(run(imp, &w, &x).iter().all(|v| v.is_nan()), "{}", imp.name());
            }
            // A partial last block is padded with zeros.
            let xf = rng.values(k - 5);
            x.quantize(&xf);
            assert_eq!(x.len(), k);
            let padded = run(Impl::Scalar, &w, &x);
            x.quantize(&[xf, vec![0.0; 5]].concat());
            assert_eq!(run(Impl::Scalar, &w, &x), padded);
            for imp in available() {
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
            (Impl::Avx2, drive::<x86::Avx2>),
            (Impl::AvxVnni, drive::<x86::AvxVnni>),
            (Impl::Avx512Vnni, drive::<x86::Avx512Vnni>),
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
        assert!(available().iter().any(|i| i.name() == kernel_name()));
    }
}
