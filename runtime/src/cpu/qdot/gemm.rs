//! Quantized prefill as integer GEMMs: a prompt's activation rows, quantized to int8, against
//! block-quantized weight rows.
//!
//! [`super::dot_rows`] dots one quantized activation row with weight rows, lanes along `k`: right
//! for decode, where each weight byte meets one row. At a prompt's rows every weight byte meets
//! every activation row and the work is a GEMM; here it runs in the layout integer GEMMs use,
//! lanes along the activation rows, with `vpdpbusd` (64 byte products an AVX-512 instruction,
//! four times an f32 FMA's multiply-adds) or AArch64's `usdot` and `sdot`:
//!
//! - **Activations** are quantized per row exactly as [`Q8Acts`] does (per block of 32, `d_x =
//!   max|x| / 127`; so the products are the decode kernels', up to summation order) and packed
//!   once per call ([`Acts`]): `L` rows a vector (16 with AVX-512, 8 on 256 bits, which AVX-512
//!   also uses below 16 rows, 4 with NEON; the last vector padded with zero rows), for each 4
//!   elements of `k` the `L` rows' 4 quants side by side (one 32-bit lane a row), and for each
//!   group of `G` elements (32; 16 for Q6_K, whose scales are per 16) the rows' `d_x` and `d_x *
//!   sum(q_x)`.
//! - **Weights** are unpacked a tile of `R` rows by a chunk of `KC` (512) elements at a time
//!   (the K-quants a super-block at a time) into unsigned bytes in element order, a
//!   quant plus its format's offset `o` (128 for Q8_0, 16 for Q5_0, 32 for Q6_K, none for Q4_1
//!   and Q4_K), and per group a scale `a` and a term `c = min - o * a` (Q4_1's and Q4_K's
//!   minimum, else 0), so that over a group `sum((a q + min) x) ~ d_x (a sum(u q_x) + c sum(q_x))`
//!   with `u = q + o` the unsigned quant.
//! - **Micro-kernel**: `R` weight rows by `V` vectors of activation rows. Per 4 elements a weight
//!   row's 4 bytes are broadcast and multiplied with each vector into `i32` lanes (unsigned by
//!   signed bytes: exact; AVX2 has no `vpdpbusd` and pairs `vpmaddubsw` with `vpmaddwd`, which
//!   cannot saturate for quants below 64, and `sdot` multiplies signed bytes, the same for quants
//!   below 128, so both leave Q8_0 to the decode kernels); per group each
//!   lane's sum is added to the lane's f32 result as `f = fma(sum, a * d_x, f)`, then `f = fma(c,
//!   d_x sum(q_x), f)`.
//!
//! The portable reference computes each result in that order from [`Q8Acts`] and
//! [`crate::quant::block`], so every implementation equals it bit for bit: the integer sums are
//! exact (below 2^24, so their conversion too) and each f32 step rounds the same way.
//!
//! Threading is the caller's: split the weight's rows (and the outputs) over the threads.

use super::{Impl as DotImpl, Q8Acts};
use crate::cpu::isa::{Implementation, Isa};
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::{BLOCK, SUPER_BLOCK};

/// Elements of `k` a weight tile is unpacked for at once: with the activations' chunk (`m * KC`
/// bytes) the working set stays in L1 and L2.
const KC: usize = 512;

/// An implementation of [`gemm_rows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Impl {
    /// Portable Rust (the reference).
    Scalar,
    /// x86-64 AVX2 and FMA (not Q8_0).
    Avx2,
    /// x86-64 AVX-VNNI (256-bit `vpdpbusd`) with AVX2 and FMA.
    AvxVnni,
    /// x86-64 AVX-512 (F, BW, VL) with VNNI.
    Avx512Vnni,
    /// The same on 256 bits (8 rows a vector, 32 registers): for fewer than 16 activation rows,
    /// which a 512-bit vector would mostly pad.
    Avx512Vnni256,
    /// AArch64 NEON with the dot-product extension (`sdot`; not Q8_0).
    NeonDot,
    /// AArch64 NEON with the int8 matrix-multiply extension (`usdot`).
    NeonI8mm,
}

impl Implementation for Impl {
    const ALL: &'static [Impl] = &[
        Impl::Avx512Vnni,
        Impl::Avx512Vnni256,
        Impl::AvxVnni,
        Impl::Avx2,
        Impl::NeonI8mm,
        Impl::NeonDot,
        Impl::Scalar,
    ];
    const PORTABLE: Impl = Impl::Scalar;

    fn name(self) -> &'static str {
        match self {
            Impl::Scalar => "scalar",
            Impl::Avx2 => "avx2",
            Impl::AvxVnni => "avx-vnni",
            Impl::Avx512Vnni => "avx512-vnni",
            Impl::Avx512Vnni256 => "avx512-vnni-256",
            Impl::NeonDot => "neon-dotprod",
            Impl::NeonI8mm => "neon-i8mm",
        }
    }

    fn runs_on(self, isa: Isa) -> bool {
        match self {
            Impl::Scalar => true,
            Impl::Avx2 => DotImpl::Avx2.runs_on(isa),
            Impl::AvxVnni => DotImpl::AvxVnni.runs_on(isa),
            Impl::Avx512Vnni | Impl::Avx512Vnni256 => DotImpl::Avx512Vnni.runs_on(isa),
            Impl::NeonDot => DotImpl::NeonDot.runs_on(isa),
            Impl::NeonI8mm => DotImpl::NeonDot.runs_on(isa) && isa.i8mm,
        }
    }
}

impl Impl {
    /// Activation rows a vector holds (the packing's `L`).
    fn lanes(self) -> usize {
        match self {
            Impl::Avx512Vnni => 16,
            Impl::Scalar | Impl::Avx2 | Impl::AvxVnni | Impl::Avx512Vnni256 => 8,
            Impl::NeonDot | Impl::NeonI8mm => 4,
        }
    }

    /// Whether it computes products of `format` (a quantized format kiln reads).
    pub fn computes(self, format: WeightFormat) -> bool {
        format.quantized() && !(matches!(self, Impl::Avx2 | Impl::NeonDot) && format == WeightFormat::Q8_0)
    }

    /// The implementation a product of `format` with `m` activation rows uses on this machine: a
    /// SIMD one that [computes](Impl::computes) it — with AVX-512, on 256 bits below 16 rows —, or
    /// `None` (the portable reference is for tests, slower than the f32 path).
    pub fn for_rows(format: WeightFormat, m: usize) -> Option<Impl> {
        let wide = |i: Impl| match i {
            Impl::Avx512Vnni => m >= 16,
            Impl::Avx512Vnni256 => m < 16,
            _ => true,
        };
        Impl::available().into_iter().find(|&i| i != Impl::Scalar && i.computes(format) && wide(i))
    }
}

/// Elements per scale group of `format`: Q6_K's scales are per 16, the others' per 32.
fn group(format: WeightFormat) -> usize {
    if format == WeightFormat::Q6_K { BLOCK / 2 } else { BLOCK }
}

/// The activation rows of a product, quantized ([`Q8Acts`]) and packed for an implementation's
/// vectors (see the module docs). Built once per call, read by every weight tile.
#[derive(Debug)]
pub struct Acts {
    imp: Impl,
    rows: Vec<Q8Acts>,
    /// Elements a row (a multiple of 32).
    k: usize,
    group: usize,
    /// Vectors of `imp.lanes()` rows.
    vectors: usize,
    /// `[vectors][k / 4][lanes]`: each lane 4 quants of its row.
    q: Vec<i32>,
    /// `[vectors][k / group][lanes]`: each lane its row's `d_x` at the group.
    dx: Vec<f32>,
    /// `[vectors][k / group][lanes]`: each lane its row's `d_x * sum(q_x)` over the group.
    sdx: Vec<f32>,
}

/// The scale and `d_x * sum(q_x)` of each group of `group` elements of `x`, in order: for whole
/// blocks the row's own (`s`, the same product), for halves summed here.
fn group_sums(x: &Q8Acts, group: usize) -> Box<dyn Iterator<Item = (f32, f32)> + '_> {
    if group == BLOCK {
        return Box::new(x.d.iter().copied().zip(x.s.iter().copied()).take(x.blocks));
    }
    Box::new(x.quant_blocks().zip(&x.d).flat_map(move |(q, &d)| {
        q.chunks(group).map(move |g| (d, d * g.iter().map(|&v| i32::from(v)).sum::<i32>() as f32))
    }))
}

impl Acts {
    /// The rows `rows` (all of one length) for `imp`'s products of `format`.
    pub fn pack(imp: Impl, format: WeightFormat, rows: Vec<Q8Acts>) -> Acts {
        let k = rows.first().map_or(0, Q8Acts::len);
        let (group, lanes) = (group(format), imp.lanes());
        let vectors = rows.len().div_ceil(lanes);
        let (mut q, mut dx, mut sdx) = (Vec::new(), Vec::new(), Vec::new());
        if imp != Impl::Scalar && rows.iter().all(|r| r.len() == k) {
            let (k4, ng) = (k / 4, k / group);
            q = vec![0i32; vectors * k4 * lanes];
            dx = vec![0f32; vectors * ng * lanes];
            sdx = vec![0f32; vectors * ng * lanes];
            for (i, row) in rows.iter().enumerate() {
                let quads = row.quant_blocks().flat_map(|b| bytemuck::cast_slice::<i8, u8>(b).chunks_exact(4));
                for (q, quad) in lane(&mut q, i, lanes, k4).zip(quads) {
                    *q = i32::from_le_bytes(quad.try_into().unwrap_or_default());
                }
                for ((d, s), sums) in
                    lane(&mut dx, i, lanes, ng).zip(lane(&mut sdx, i, lanes, ng)).zip(group_sums(row, group))
                {
                    (*d, *s) = sums;
                }
            }
        }
        Acts { imp, rows, k, group, vectors, q, dx, sdx }
    }

    /// Activation rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// Row `i`'s values of a packed `[vectors][per][lanes]` array: every `lanes`-th from its own
/// vector's first.
fn lane<T>(values: &mut [T], i: usize, lanes: usize, per: usize) -> impl Iterator<Item = &mut T> {
    let first = (i / lanes) * per * lanes + i % lanes;
    values.iter_mut().skip(first).step_by(lanes).take(per)
}

/// Block `b`'s factors per half (elements `0..16` and `16..32`) of a row of `format` (`k`
/// elements, the device layout): the scale `a` and the term `c = min - offset * a` (see the
/// module docs), and the offset its unsigned quants carry. `None` past the row's end. (The
/// portable reference's; the SIMD unpackers compute the same a chunk of a row at a time.)
fn factors(format: WeightFormat, row: &[u32], k: usize, b: usize) -> Option<([f32; 2], [f32; 2], i32)> {
    let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
    let f = |i: usize| row.get(i).map(|&w| f32::from_bits(w));
    let (a, min, offset) = match format {
        WeightFormat::Q8_0 => ([f(b)?; 2], 0.0, 128),
        WeightFormat::Q4_1 => ([f(b)?; 2], f(nb + b)?, 0),
        WeightFormat::Q5_0 => ([f(b)?; 2], 0.0, 16),
        WeightFormat::Q4_K => {
            let s = b / 8;
            let packed: [u8; 12] =
                bytemuck::cast_slice::<u32, u8>(row.get(2 * ns + 3 * s..2 * ns + 3 * s + 3)?).try_into().ok()?;
            let (sc, m) = crate::gguf::q4_k_scale_min(&packed, b % 8);
            ([f(s)? * f32::from(sc); 2], -(f(ns + s)? * f32::from(m)), 0)
        }
        WeightFormat::Q6_K => {
            let (s, c8) = (b / 8, b % 8);
            let scales = bytemuck::cast_slice::<u32, u8>(row.get(ns + 4 * s..ns + 4 * s + 4)?);
            let d = f(s)?;
            let sc = |i: usize| scales.get(i).map(|&v| f32::from(v as i8));
            ([d * sc(2 * c8)?, d * sc(2 * c8 + 1)?], 0.0, 32)
        }
        WeightFormat::F32 | WeightFormat::F16 => return None,
    };
    Some((a, a.map(|a| term(min, offset, a)), offset))
}

/// A group's term `c = min - offset * a` (see the module docs).
#[inline(always)]
fn term(min: f32, offset: i32, a: f32) -> f32 {
    min - offset as f32 * a
}

/// `out[i * len + r] = dot(weight row r, activation row i)` for the `len` rows of `words` (each
/// `format.row_words(k)` words, the device layout) and every row of `x`, with the best
/// implementation for `x` (the one it was packed for).
///
/// Shapes that do not fit give NaN rather than a panic: every result when `format` is not
/// quantized, `k` is not a multiple of its blocks or not the rows' length, or the implementation
/// does not compute `format`; the results of rows past the end of `words`.
pub fn gemm_rows(format: WeightFormat, words: &[u32], k: usize, x: &Acts, out: &mut [f32], len: usize) {
    let m = x.len();
    let Some(out) = out.get_mut(..m * len) else {
        out.fill(f32::NAN);
        return;
    };
    let stride = format.row_words(k);
    let group_fits =
        x.group == group(format) && (x.imp == Impl::Scalar || x.q.len() == x.vectors * k / 4 * x.imp.lanes());
    let (Some(stride), true, true, true) = (stride, k == x.k, group_fits, x.imp.computes(format)) else {
        out.fill(f32::NAN);
        return;
    };
    if k == 0 {
        out.fill(0.0);
        return;
    }
    let rows = len.min(words.len() / stride);
    for o in out.chunks_mut(len) {
        o.iter_mut().skip(rows).for_each(|v| *v = f32::NAN);
    }
    let imp = if x.imp.is_available() { x.imp } else { Impl::Scalar };
    match imp {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `imp` is available, so the CPU has the kernel's features; the shapes were
        // checked above (and are asserted again where the kernel reads them).
        Impl::Avx512Vnni => unsafe { x86::gemm_avx512_vnni::gemm(format, words, stride, k, x, out, len, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::Avx512Vnni256 => unsafe { x86::gemm_avx512_vnni_256::gemm(format, words, stride, k, x, out, len, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::AvxVnni => unsafe { x86::gemm_avx_vnni::gemm(format, words, stride, k, x, out, len, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Impl::Avx2 => unsafe { x86::gemm_avx2::gemm(format, words, stride, k, x, out, len, rows) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::NeonDot => unsafe { arm::gemm_neon_dot::gemm(format, words, stride, k, x, out, len, rows) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above.
        Impl::NeonI8mm => unsafe { arm::gemm_neon_i8mm::gemm(format, words, stride, k, x, out, len, rows) },
        _ => scalar(format, words, stride, k, x, out, len, rows),
    }
}

/// The portable reference: each result summed over its groups in order, from the weight's
/// blocks ([`crate::quant::block`]) and the rows' quants.
#[expect(clippy::too_many_arguments, reason = "a GEMM's operands and sizes")]
fn scalar(
    format: WeightFormat,
    words: &[u32],
    stride: usize,
    k: usize,
    x: &Acts,
    out: &mut [f32],
    len: usize,
    rows: usize,
) {
    let group = x.group;
    for (r, row) in words.chunks_exact(stride).take(rows).enumerate() {
        let blocks: Vec<_> = (0..k / BLOCK)
            .map(|b| Some((crate::quant::block(format, row, k, b)?, factors(format, row, k, b)?)))
            .collect();
        for (xr, o) in x.rows.iter().zip(out.chunks_mut(len)) {
            let mut f = 0f32;
            let mut sums = group_sums(xr, group);
            for (b, xq) in blocks.iter().zip(xr.quant_blocks()) {
                let Some((block, (a, c, offset))) = b else {
                    f = f32::NAN;
                    break;
                };
                for (h, (q, xq)) in block.q.chunks(group).zip(xq.chunks(group)).enumerate() {
                    let (dx, sdx) = sums.next().unwrap_or((f32::NAN, f32::NAN));
                    let sum: i32 = q.iter().zip(xq).map(|(&q, &v)| (q + offset) * i32::from(v)).sum();
                    let half = |v: [f32; 2]| v.get(h * group / 16).copied().unwrap_or(f32::NAN);
                    let (a, c) = (half(*a), half(*c));
                    f = (sum as f32).mul_add(a * dx, f);
                    f = c.mul_add(sdx, f);
                }
            }
            if let Some(o) = o.get_mut(r) {
                *o = f;
            }
        }
    }
}

/// The formats as constant tags, so that a kernel generic over one unpacks its blocks in
/// straight code ([`format_of`]).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod tags {
    use kiln_compiler::lower::WeightFormat;

    pub const F_Q8_0: u8 = 0;
    pub const F_Q4_1: u8 = 1;
    pub const F_Q5_0: u8 = 2;
    pub const F_Q4_K: u8 = 3;
    pub const F_Q6_K: u8 = 4;

    /// The format a tag names.
    pub const fn format_of(tag: u8) -> WeightFormat {
        match tag {
            F_Q8_0 => WeightFormat::Q8_0,
            F_Q4_1 => WeightFormat::Q4_1,
            F_Q5_0 => WeightFormat::Q5_0,
            F_Q4_K => WeightFormat::Q4_K,
            _ => WeightFormat::Q6_K,
        }
    }

    /// Which blocks of a row a tile unpacks: `c0 .. c0 + cb` of a row of `k` elements.
    #[derive(Clone, Copy)]
    pub struct Chunk {
        pub k: usize,
        pub c0: usize,
        pub cb: usize,
    }

    /// Where a row's unpacked blocks go: its unsigned quants (32 bytes a block) and its factors
    /// `a` and `c` (one a group).
    pub struct Staged<'a> {
        pub u: &'a mut [u8],
        pub a: &'a mut [f32],
        pub c: &'a mut [f32],
    }
}

/// The weight's unpacking per format, compiled for `$features`, over the byte operations of the
/// expanding module's `bytes` (`B`: a block's 32 bytes in element order; `load32` and
/// `nibbles`, 8 words and 4 words of Q4_1's layout from a row, `None` past its end; `flip`,
/// `fifth`, `or`, `bits`, `shl4` and `store`): `unpack`, and per format the unpacker it runs.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! unpackers {
    ($features:literal) => {
        /// The chunk's blocks of `row` (a whole row of the format tagged `F`) unpacked into `out` by
        /// its format's unpacker. A row too short for them (not reached: the caller binds whole rows)
        /// gets NaN factors, so NaN results.
        #[target_feature(enable = $features)]
        #[inline]
        fn unpack<const F: u8>(row: &[u32], chunk: Chunk, out: Staged<'_>) {
            let mut out = out;
            let done = match format_of(F) {
                WeightFormat::Q4_K => q4_k(row, chunk, &mut out),
                WeightFormat::Q6_K => q6_k(row, chunk, &mut out),
                _ => blocks32::<F>(row, chunk, &mut out),
            };
            if done.is_none() {
                out.a.fill(f32::NAN);
            }
        }

        /// Blocks `c0 .. c0 + cb` of a Q8_0, Q4_1 or Q5_0 `row` (`k` elements; the format tagged
        /// `F`) unpacked as [`factors`](super::factors) and [`crate::quant::block`] give them, the
        /// chunk's scales, minimums or fifth bits and quants each taken as one slice. `None` past
        /// the row's end.
        #[target_feature(enable = $features)]
        #[inline]
        fn blocks32<const F: u8>(row: &[u32], Chunk { k, c0, cb }: Chunk, out: &mut Staged<'_>) -> Option<()> {
            let (ut, at, ct) = (&mut *out.u, &mut *out.a, &mut *out.c);
            let format = format_of(F);
            let nb = k / BLOCK;
            // Words of quants a block, and where they start.
            let (qw, q0) = if format == WeightFormat::Q8_0 { (8, nb) } else { (4, 2 * nb) };
            let scales = row.get(c0..c0 + cb)?;
            let seconds = row.get(nb + c0..nb + c0 + cb)?;
            let quants = row.get(q0 + qw * c0..q0 + qw * (c0 + cb))?;
            let blocks = ut.chunks_exact_mut(BLOCK).zip(at.iter_mut().zip(ct.iter_mut()));
            let words = scales.iter().zip(seconds).zip(quants.chunks_exact(qw));
            for ((o, (a, c)), ((&scale, &second), q)) in blocks.zip(words) {
                *a = f32::from_bits(scale);
                let q = match format {
                    WeightFormat::Q8_0 => {
                        *c = term(0.0, 128, *a);
                        bytes::flip(bytes::load32(q, 0)?)
                    }
                    WeightFormat::Q5_0 => {
                        *c = term(0.0, 16, *a);
                        bytes::or(bytes::nibbles(q, 0)?, bytes::fifth(second))
                    }
                    _ => {
                        *c = term(f32::from_bits(second), 0, *a);
                        bytes::nibbles(q, 0)?
                    }
                };
                bytes::store(o, q);
            }
            Some(())
        }

        /// Q4_K's blocks `c0 .. c0 + cb` of `row` (`k` elements; whole super-blocks: `c0` and `cb`
        /// multiples of 8) unpacked as [`factors`](super::factors) and [`crate::quant::block`]
        /// give them, a super-block at a time: its 8 scales and minimums decoded once, each 32
        /// bytes of nibbles loaded once for its two blocks. `None` past the row's end.
        #[target_feature(enable = $features)]
        #[inline]
        fn q4_k(row: &[u32], Chunk { k, c0, cb }: Chunk, out: &mut Staged<'_>) -> Option<()> {
            let (ut, at, ct) = (&mut *out.u, &mut *out.a, &mut *out.c);
            let ns = k / SUPER_BLOCK;
            let per = SUPER_BLOCK / BLOCK;
            let supers = ut.chunks_exact_mut(SUPER_BLOCK).zip(at.chunks_exact_mut(per).zip(ct.chunks_exact_mut(per)));
            for (i, (us, (as_, cs))) in supers.take(cb / per).enumerate() {
                let s = c0 / per + i;
                let f = |i: usize| row.get(i).map(|&w| f32::from_bits(w));
                let (d, dmin) = (f(s)?, f(ns + s)?);
                let packed: [u8; 12] =
                    bytemuck::cast_slice::<u32, u8>(row.get(2 * ns + 3 * s..2 * ns + 3 * s + 3)?).try_into().ok()?;
                for (j, (a, c)) in as_.iter_mut().zip(cs).enumerate() {
                    let (sc, m) = crate::gguf::q4_k_scale_min(&packed, j);
                    *a = d * f32::from(sc);
                    *c = term(-(dmin * f32::from(m)), 0, *a);
                }
                // Blocks 2p and 2p + 1 are the low and high nibbles of 32 bytes.
                for (p, pair) in us.chunks_exact_mut(2 * BLOCK).enumerate() {
                    let v = bytes::load32(row, 5 * ns + 32 * s + 8 * p)?;
                    let halves = [bytes::bits(v, 0, 0x0f), bytes::bits(v, 4, 0x0f)];
                    for (o, q) in pair.chunks_exact_mut(BLOCK).zip(halves) {
                        bytes::store(o, q);
                    }
                }
            }
            Some(())
        }

        /// Q6_K's blocks `c0 .. c0 + cb` of `row` (`k` elements; whole super-blocks) unpacked as
        /// [`factors`](super::factors) and [`crate::quant::block`] give them, a super-block at a
        /// time: its 16 scales once, each half's low and high bits loaded once for its four
        /// blocks. `None` past the row's end.
        #[target_feature(enable = $features)]
        #[inline]
        fn q6_k(row: &[u32], Chunk { k, c0, cb }: Chunk, out: &mut Staged<'_>) -> Option<()> {
            let (ut, at, ct) = (&mut *out.u, &mut *out.a, &mut *out.c);
            let ns = k / SUPER_BLOCK;
            let (per, groups) = (SUPER_BLOCK / BLOCK, SUPER_BLOCK / 16);
            let supers =
                ut.chunks_exact_mut(SUPER_BLOCK).zip(at.chunks_exact_mut(groups).zip(ct.chunks_exact_mut(groups)));
            for (i, (us, (as_, cs))) in supers.take(cb / per).enumerate() {
                let s = c0 / per + i;
                let d = f32::from_bits(*row.get(s)?);
                let scales = bytemuck::cast_slice::<u32, u8>(row.get(ns + 4 * s..ns + 4 * s + 4)?);
                for ((a, c), &sc) in as_.iter_mut().zip(cs).zip(scales) {
                    *a = d * f32::from(sc as i8);
                    *c = term(0.0, 32, *a);
                }
                for (h, half) in us.chunks_exact_mut(4 * BLOCK).enumerate() {
                    let low = 5 * ns + 32 * s + 16 * h;
                    let lo = [bytes::load32(row, low)?, bytes::load32(row, low + 8)?];
                    let hi = bytes::load32(row, 37 * ns + 16 * s + 8 * h)?;
                    for (c, o) in half.chunks_exact_mut(BLOCK).enumerate() {
                        let l = bytes::bits(*lo.get(c % 2)?, 4 * (c / 2), 0x0f);
                        bytes::store(o, bytes::or(l, bytes::shl4(bytes::bits(hi, 2 * c, 3))));
                    }
                }
            }
            Some(())
        }
    };
}

/// The driver and micro-kernel over an ops module, compiled for `$features` (whose ISA's
/// `unpack`, and the names it uses, the expanding module has in scope).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! gemm {
    ($name:ident, $features:literal, $ops:ident) => {
        /// The integer GEMM on one ISA.
        pub(super) mod $name {
            use super::$ops as ops;

            /// Weight rows of the micro-kernel.
            const R: usize = ops::R;
            /// Activation rows a vector.
            const L: usize = ops::L;
            use super::{Acts, BLOCK, Chunk, F_Q4_1, F_Q4_K, F_Q5_0, F_Q6_K, F_Q8_0, KC, Staged, unpack};
            use kiln_compiler::lower::WeightFormat;

            /// [`super::gemm_rows`] on this ISA: `out` (`x.len()` rows of `len`) for the first
            /// `rows <= len` rows of `words` (`stride` words each).
            ///
            /// # Safety
            ///
            /// The CPU has the features; `x` was packed for this ISA's lanes and `format`'s
            /// groups, with rows of `k` elements (`k` a multiple of `format`'s blocks, `stride`
            /// its row words); `words` holds `rows` rows; `out` holds `x.len() * len` results.
            #[target_feature(enable = $features)]
            #[expect(clippy::too_many_arguments, reason = "a GEMM's operands and sizes")]
            pub(in super::super) unsafe fn gemm(
                format: WeightFormat,
                words: &[u32],
                stride: usize,
                k: usize,
                x: &Acts,
                out: &mut [f32],
                len: usize,
                rows: usize,
            ) {
                // SAFETY: the caller's (each driver the same contract for its format).
                unsafe {
                    match format {
                        WeightFormat::Q8_0 => drive::<F_Q8_0>(words, stride, k, x, out, len, rows),
                        WeightFormat::Q4_1 => drive::<F_Q4_1>(words, stride, k, x, out, len, rows),
                        WeightFormat::Q5_0 => drive::<F_Q5_0>(words, stride, k, x, out, len, rows),
                        WeightFormat::Q4_K => drive::<F_Q4_K>(words, stride, k, x, out, len, rows),
                        WeightFormat::Q6_K => drive::<F_Q6_K>(words, stride, k, x, out, len, rows),
                        // Not quantized: refused by `gemm_rows`.
                        WeightFormat::F32 | WeightFormat::F16 => out.fill(f32::NAN),
                    }
                }
            }

            /// [`gemm`] for the format tagged `F` (a constant, so each block's unpacking is
            /// straight code).
            ///
            /// # Safety
            ///
            /// As [`gemm`]'s.
            #[target_feature(enable = $features)]
            unsafe fn drive<const F: u8>(
                words: &[u32],
                stride: usize,
                k: usize,
                x: &Acts,
                out: &mut [f32],
                len: usize,
                rows: usize,
            ) {
                const R: usize = ops::R;
                const L: usize = ops::L;
                debug_assert_eq!(x.imp.lanes(), L);
                let (nb, vectors, group) = (k / BLOCK, x.vectors, x.group);
                // The results, `[row][vector][lane]`, summed over the chunks.
                let mut acc = vec![0f32; rows.next_multiple_of(R) * vectors * L];
                // A tile: `R` rows of `KC` unsigned quants, and `KC / 16` factors `a` and `c`.
                let mut u = vec![0u8; R * KC];
                let (mut fa, mut fc) = (vec![0f32; R * KC / 16], vec![0f32; R * KC / 16]);
                let cpb = KC / BLOCK;
                for c0 in (0..nb).step_by(cpb) {
                    let cb = cpb.min(nb - c0);
                    for r0 in (0..rows).step_by(R) {
                        let tile =
                            u.chunks_exact_mut(KC).zip(fa.chunks_exact_mut(KC / 16)).zip(fc.chunks_exact_mut(KC / 16));
                        for (t, ((ut, at), ct)) in tile.enumerate() {
                            match words.get((r0 + t) * stride..(r0 + t + 1) * stride).filter(|_| r0 + t < rows) {
                                // (This ISA's features include `unpack`'s.)
                                Some(row) => unpack::<F>(row, Chunk { k, c0, cb }, Staged { u: ut, a: at, c: ct }),
                                // A row past the tile's end (`rows` not a multiple of `R`):
                                // zeros, its results never written.
                                None => {
                                    ut.fill(0);
                                    at.fill(0.0);
                                    ct.fill(0.0);
                                }
                            }
                        }
                        let mut v0 = 0;
                        while v0 < vectors {
                            let tile = Tile { u: &u, a: &fa, c: &fc, x, c0, groups: cb * BLOCK / group, r0, v0 };
                            // SAFETY: the caller's features; `acc` holds `rows` rounded up to
                            // `R` rows of every vector (the micro-kernel asserts its reads).
                            v0 += unsafe {
                                match (vectors - v0, group) {
                                    (1, 16) => micro::<1, 16>(&tile, &mut acc),
                                    (1, _) => micro::<1, 32>(&tile, &mut acc),
                                    (_, 16) => micro::<2, 16>(&tile, &mut acc),
                                    _ => micro::<2, 32>(&tile, &mut acc),
                                }
                            };
                        }
                    }
                }
                // Each activation row's results written in order: lane `i % L` of vector
                // `i / L` of each weight row.
                for (i, o) in out.chunks_mut(len).enumerate() {
                    let lane = acc.iter().skip(i).step_by(vectors * L);
                    for (o, &v) in o.iter_mut().zip(lane).take(rows) {
                        *o = v;
                    }
                }
            }

            /// A tile's operands: the unpacked weight (`R` rows of `KC` quants, `KC / 16`
            /// factors), the activations and where the tile sits in them.
            struct Tile<'a> {
                u: &'a [u8],
                a: &'a [f32],
                c: &'a [f32],
                x: &'a Acts,
                /// The chunk's first block.
                c0: usize,
                /// Groups in the chunk.
                groups: usize,
                /// The tile's first weight row and first activation vector.
                r0: usize,
                v0: usize,
            }

            /// Adds the tile's products with `V` activation vectors from `t.v0` to `acc`
            /// (see [`$name`]); returns `V`.
            ///
            /// # Safety
            ///
            /// The CPU has the features. (Every span read or written is asserted here.)
            #[target_feature(enable = $features)]
            unsafe fn micro<const V: usize, const G: usize>(t: &Tile<'_>, acc: &mut [f32]) -> usize {
                let x = t.x;
                let (k4, ng) = (x.k / 4, x.k / G);
                let (q0, g0) = (t.c0 * BLOCK / 4, t.c0 * BLOCK / G);
                let vectors = x.vectors;
                // Every read below: the weight tile's quants `4 * (groups * G / 4)` bytes
                // of each row, factors `groups` of each; the activations' quads `q0 ..
                // q0 + groups * G / 4` and groups `g0 .. g0 + groups` of vectors `v0 ..
                // v0 + V`; `acc`'s rows `r0 .. r0 + R` of those vectors.
                assert!(
                    t.groups * G <= KC && t.u.len() >= R * KC && t.a.len() >= R * KC / 16 && t.c.len() >= R * KC / 16
                );
                assert!(t.v0 + V <= vectors && q0 + t.groups * G / 4 <= k4 && g0 + t.groups <= ng);
                assert!(
                    x.q.len() >= vectors * k4 * L && x.dx.len() >= vectors * ng * L && x.sdx.len() >= vectors * ng * L
                );
                assert!(acc.len() >= (t.r0 + R) * vectors * L);
                let (u, fa, fc) = (t.u.as_ptr(), t.a.as_ptr(), t.c.as_ptr());
                // In bounds (asserted above), so `wrapping_add` is `add`.
                let xq: [*const i32; V] =
                    std::array::from_fn(|v| x.q.as_ptr().wrapping_add(((t.v0 + v) * k4 + q0) * L));
                let xd: [*const f32; V] =
                    std::array::from_fn(|v| x.dx.as_ptr().wrapping_add(((t.v0 + v) * ng + g0) * L));
                let xs: [*const f32; V] =
                    std::array::from_fn(|v| x.sdx.as_ptr().wrapping_add(((t.v0 + v) * ng + g0) * L));
                let at = |r: usize, v: usize| ((t.r0 + r) * vectors + t.v0 + v) * L;
                let mut f = [[ops::zero_f(); V]; R];
                for (r, f) in f.iter_mut().enumerate() {
                    for (v, f) in f.iter_mut().enumerate() {
                        // SAFETY: `at(r, v) + L <= (r0 + R) * vectors * L <= acc.len()`.
                        *f = unsafe { ops::load_f(acc.as_ptr().add(at(r, v))) };
                    }
                }
                for g in 0..t.groups {
                    let mut s = [[ops::zero_i(); V]; R];
                    for j in 0..G / 4 {
                        let quad = g * G / 4 + j;
                        // SAFETY: quad `q0 + quad < q0 + groups * G / 4` of each vector (asserted).
                        let xv: [ops::I; V] = xq.map(|p| unsafe { ops::load_i(p.add(quad * L)) });
                        for (r, s) in s.iter_mut().enumerate() {
                            // SAFETY: bytes `4 quad .. 4 quad + 4 <= groups * G <= KC` of row `r`.
                            let w = unsafe { u.add(r * KC + 4 * quad).cast::<i32>().read_unaligned() };
                            let w = ops::bcast_i(w);
                            for (s, &xv) in s.iter_mut().zip(&xv) {
                                *s = ops::dot(*s, w, xv);
                            }
                        }
                    }
                    // SAFETY: group `g0 + g < g0 + groups` of each vector (asserted).
                    let dx: [ops::F; V] = xd.map(|p| unsafe { ops::load_f(p.add(g * L)) });
                    // SAFETY: as above.
                    let sx: [ops::F; V] = xs.map(|p| unsafe { ops::load_f(p.add(g * L)) });
                    for (r, (f, s)) in f.iter_mut().zip(&s).enumerate() {
                        // SAFETY: factor `g < groups <= KC / 16` of row `r < R`.
                        let (a, c) = unsafe { (fa.add(r * KC / 16 + g).read(), fc.add(r * KC / 16 + g).read()) };
                        let (a, c) = (ops::bcast_f(a), ops::bcast_f(c));
                        for (((f, &s), &dx), &sx) in f.iter_mut().zip(s).zip(&dx).zip(&sx) {
                            *f = ops::fma(ops::cvt(s), ops::mul(a, dx), *f);
                            *f = ops::fma(c, sx, *f);
                        }
                    }
                }
                for (r, f) in f.iter().enumerate() {
                    for (v, &f) in f.iter().enumerate() {
                        // SAFETY: as for the loads.
                        unsafe { ops::store_f(acc.as_mut_ptr().add(at(r, v)), f) };
                    }
                }
                V
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The x86-64 implementations: the driver and micro-kernel (`gemm!`) over each ISA's vector
    //! operations (`ops!`), and the weight's unpacking (`unpackers!`) on AVX2, which they share.
    //!
    //! Inside a `#[target_feature]` function the register-only intrinsics of its features are
    //! safe; the loads and stores through raw pointers are not, and say why they hold.

    use super::tags::{Chunk, F_Q4_1, F_Q4_K, F_Q5_0, F_Q6_K, F_Q8_0, Staged, format_of};
    use super::{Acts, BLOCK, KC, SUPER_BLOCK, term};
    use kiln_compiler::lower::WeightFormat;

    /// The unpackers' byte operations on AVX2: a block's 32 bytes in one vector.
    mod bytes {
        use super::super::super::blocks::{fifth as fifth256, load256, shr16};
        use std::arch::x86_64::*;

        pub type B = __m256i;

        /// The 32 bytes of the 8 words of `row` from word `at`, or `None` past its end.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn load32(row: &[u32], at: usize) -> Option<B> {
            load256(row, at)
        }

        /// The 32 quants of the 4 words of `row` from word `at` (Q4_1's layout: elements 0..16
        /// in the low nibbles, 16..32 in the high ones), or `None` past its end.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn nibbles(row: &[u32], at: usize) -> Option<B> {
            let w = row.get(at..at.checked_add(4)?)?;
            // SAFETY: `w` holds 4 words, 16 bytes (a checked `get`, in every build).
            debug_assert_eq!(w.len(), 4);
            let q = unsafe { _mm_loadu_si128(w.as_ptr().cast()) };
            let q = _mm256_srlv_epi32(_mm256_broadcastsi128_si256(q), _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
            Some(_mm256_and_si256(q, _mm256_set1_epi8(0x0f)))
        }

        /// Signed bytes as unsigned ones: `q + 128`.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn flip(v: B) -> B {
            _mm256_xor_si256(v, _mm256_set1_epi8(-128))
        }

        /// Byte `i` 0x10 where bit `i` of `bits` is set, else 0.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn fifth(bits: u32) -> B {
            fifth256(bits)
        }

        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn or(a: B, b: B) -> B {
            _mm256_or_si256(a, b)
        }

        /// Each byte's bits from bit `n` on, masked by `mask` (which keeps no bit shifted in
        /// from the next byte: the shift is on 16-bit lanes).
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn bits(v: B, n: usize, mask: u8) -> B {
            _mm256_and_si256(shr16(v, n), _mm256_set1_epi8(mask as i8))
        }

        /// Each byte shifted left by 4 (bytes below 16: nothing crosses into the next).
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn shl4(v: B) -> B {
            _mm256_slli_epi16::<4>(v)
        }

        /// Stores a block's 32 quants into `o`, its 32 bytes of the staged tile.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        pub fn store(o: &mut [u8], q: B) {
            assert_eq!(o.len(), 32, "a staged block");
            // SAFETY: `o` is 32 writable bytes (asserted).
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), q) };
        }
    }

    unpackers!("avx2,fma");

    /// An ISA's vector operations (`$I` and `$F` vectors of `$L` lanes, by the intrinsics named;
    /// the byte products by `$dot`), compiled for `$features`; `$R` weight rows a micro-kernel.
    macro_rules! ops {
        (
            $features:literal, $I:ty, $F:ty, $L:literal, $R:literal,
            [$zero_i:ident, $zero_f:ident, $load_i:ident, $load_f:ident, $store_f:ident],
            [$bcast_i:ident, $bcast_f:ident, $mul:ident, $fma:ident, $cvt:ident],
            $dot:item
        ) => {
            use std::arch::x86_64::*;

            pub type I = $I;
            pub type F = $F;
            pub const L: usize = $L;
            /// Weight rows of the micro-kernel (`R` rows by 2 vectors: `4 R` accumulators).
            pub const R: usize = $R;

            #[target_feature(enable = $features)]
            #[inline]
            pub fn zero_i() -> I {
                $zero_i()
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn zero_f() -> F {
                $zero_f()
            }
            /// # Safety
            /// `p` points at `L` readable `i32`s.
            #[target_feature(enable = $features)]
            #[inline]
            pub unsafe fn load_i(p: *const i32) -> I {
                // SAFETY: the caller's.
                unsafe { $load_i(p.cast()) }
            }
            /// # Safety
            /// `p` points at `L` readable `f32`s.
            #[target_feature(enable = $features)]
            #[inline]
            pub unsafe fn load_f(p: *const f32) -> F {
                // SAFETY: the caller's.
                unsafe { $load_f(p) }
            }
            /// # Safety
            /// `p` points at `L` writable `f32`s.
            #[target_feature(enable = $features)]
            #[inline]
            pub unsafe fn store_f(p: *mut f32, v: F) {
                // SAFETY: the caller's.
                unsafe { $store_f(p, v) }
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn bcast_i(v: i32) -> I {
                $bcast_i(v)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn bcast_f(v: f32) -> F {
                $bcast_f(v)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn mul(a: F, b: F) -> F {
                $mul(a, b)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn fma(a: F, b: F, c: F) -> F {
                $fma(a, b, c)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn cvt(v: I) -> F {
                $cvt(v)
            }
            $dot
        };
    }

    /// `ops!` on 256 bits (8 lanes, micro-kernels of 2 rows: 8 accumulators of 16 registers).
    macro_rules! ops256 {
        ($features:literal, $dot:item) => {
            ops!(
                $features,
                __m256i,
                __m256,
                8,
                2,
                [_mm256_setzero_si256, _mm256_setzero_ps, _mm256_loadu_si256, _mm256_loadu_ps, _mm256_storeu_ps],
                [_mm256_set1_epi32, _mm256_set1_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_cvtepi32_ps],
                $dot
            );
        };
    }

    mod avx512_vnni {
        // 16 lanes, micro-kernels of 4 rows (16 accumulators of 32 registers).
        ops!(
            "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
            __m512i,
            __m512,
            16,
            4,
            [_mm512_setzero_si512, _mm512_setzero_ps, _mm512_loadu_si512, _mm512_loadu_ps, _mm512_storeu_ps],
            [_mm512_set1_epi32, _mm512_set1_ps, _mm512_mul_ps, _mm512_fmadd_ps, _mm512_cvtepi32_ps],
            /// `acc` plus, per lane, the 4 products of `w`'s unsigned and `x`'s signed bytes.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
            #[inline]
            pub fn dot(acc: I, w: I, x: I) -> I {
                _mm512_dpbusd_epi32(acc, w, x)
            }
        );
    }

    mod avx512_vnni_256 {
        // 8 lanes with AVX-512's 32 registers: micro-kernels of 4 rows (16 accumulators).
        ops!(
            "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma",
            __m256i,
            __m256,
            8,
            4,
            [_mm256_setzero_si256, _mm256_setzero_ps, _mm256_loadu_si256, _mm256_loadu_ps, _mm256_storeu_ps],
            [_mm256_set1_epi32, _mm256_set1_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_cvtepi32_ps],
            /// `acc` plus, per lane, the 4 products of `w`'s unsigned and `x`'s signed bytes.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
            #[inline]
            pub fn dot(acc: I, w: I, x: I) -> I {
                _mm256_dpbusd_epi32(acc, w, x)
            }
        );
    }

    mod avx_vnni {
        ops256!(
            "avx2,fma,avxvnni",
            /// `acc` plus, per lane, the 4 products of `w`'s unsigned and `x`'s signed bytes.
            #[target_feature(enable = "avx2,fma,avxvnni")]
            #[inline]
            pub fn dot(acc: I, w: I, x: I) -> I {
                _mm256_dpbusd_avx_epi32(acc, w, x)
            }
        );
    }

    mod avx2 {
        ops256!(
            "avx2,fma",
            /// `acc` plus, per lane, the 4 products of `w`'s unsigned and `x`'s signed bytes,
            /// as pairs of `i16` (exact for `w` below 64: a pair is below 2^15) added by
            /// `vpmaddwd`.
            #[target_feature(enable = "avx2,fma")]
            #[inline]
            pub fn dot(acc: I, w: I, x: I) -> I {
                _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
            }
        );
    }

    gemm!(gemm_avx512_vnni, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma", avx512_vnni);
    gemm!(gemm_avx512_vnni_256, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma", avx512_vnni_256);
    gemm!(gemm_avx_vnni, "avx2,fma,avxvnni", avx_vnni);
    gemm!(gemm_avx2, "avx2,fma", avx2);
}

#[cfg(target_arch = "aarch64")]
mod arm {
    //! The AArch64 implementations: the same driver and micro-kernel (`gemm!`) on 4 lanes of
    //! NEON, with `sdot` (the dot-product extension: signed by signed bytes, exact for the
    //! unsigned quants below 128 of every format but Q8_0) or `usdot` (the int8 matrix-multiply
    //! extension, `i8mm`: unsigned by signed, `vpdpbusd`'s product, so Q8_0 too), through
    //! inline assembly (their intrinsics are not stable in Rust yet); the weight's unpacking
    //! (`unpackers!`) on NEON.
    //!
    //! Inside a `#[target_feature]` function the register-only intrinsics of its features are
    //! safe; the loads and stores through raw pointers are not, and say why they hold.

    use super::tags::{Chunk, F_Q4_1, F_Q4_K, F_Q5_0, F_Q6_K, F_Q8_0, Staged, format_of};
    use super::{Acts, BLOCK, KC, SUPER_BLOCK, term};
    use kiln_compiler::lower::WeightFormat;

    /// The unpackers' byte operations on NEON: a block's 32 bytes in two vectors.
    mod bytes {
        use super::super::super::neon::load16;
        use crate::cpu::isa::arm::{fifths, shr};
        use std::arch::aarch64::*;

        pub type B = [uint8x16_t; 2];

        /// The 32 bytes of the 8 words of `row` from word `at`, or `None` past its end.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn load32(row: &[u32], at: usize) -> Option<B> {
            Some([load16(row, at)?, load16(row, at.checked_add(4)?)?])
        }

        /// The 32 quants of the 4 words of `row` from word `at` (Q4_1's layout: elements 0..16
        /// in the low nibbles, 16..32 in the high ones), or `None` past its end.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn nibbles(row: &[u32], at: usize) -> Option<B> {
            let q = load16(row, at)?;
            Some([vandq_u8(q, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(q)])
        }

        /// Signed bytes as unsigned ones: `q + 128`.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn flip(v: B) -> B {
            v.map(|v| veorq_u8(v, vdupq_n_u8(0x80)))
        }

        /// Byte `i` 0x10 where bit `i` of `bits` is set, else 0.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn fifth(bits: u32) -> B {
            [fifths(bits & 0xffff), fifths(bits >> 16)]
        }

        #[target_feature(enable = "neon")]
        #[inline]
        pub fn or(a: B, b: B) -> B {
            [vorrq_u8(a[0], b[0]), vorrq_u8(a[1], b[1])]
        }

        /// Each byte's bits from bit `n` on, masked by `mask`.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn bits(v: B, n: usize, mask: u8) -> B {
            v.map(|v| vandq_u8(shr(v, n), vdupq_n_u8(mask)))
        }

        /// Each byte shifted left by 4.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn shl4(v: B) -> B {
            v.map(|v| vshlq_n_u8::<4>(v))
        }

        /// Stores a block's 32 quants into `o`, its 32 bytes of the staged tile.
        #[target_feature(enable = "neon")]
        #[inline]
        pub fn store(o: &mut [u8], q: B) {
            assert_eq!(o.len(), 32, "a staged block");
            // SAFETY: `o` is 32 writable bytes (asserted): two stores of 16.
            unsafe {
                vst1q_u8(o.as_mut_ptr(), q[0]);
                vst1q_u8(o.as_mut_ptr().add(16), q[1]);
            }
        }
    }

    unpackers!("neon");

    /// The micro-kernel's vector operations on NEON (4 lanes; 4 weight rows by 2 vectors: 16
    /// accumulators of the 32 registers), compiled for `$features`, with the byte products
    /// `$dot`.
    macro_rules! ops {
        ($features:literal, $dot:item) => {
            use std::arch::aarch64::*;

            pub type I = int32x4_t;
            pub type F = float32x4_t;
            pub const L: usize = 4;
            /// Weight rows of the micro-kernel (`R` rows by 2 vectors: `4 R` accumulators).
            pub const R: usize = 4;

            #[target_feature(enable = $features)]
            #[inline]
            pub fn zero_i() -> I {
                vdupq_n_s32(0)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn zero_f() -> F {
                vdupq_n_f32(0.0)
            }
            /// # Safety
            /// `p` points at `L` readable `i32`s.
            #[target_feature(enable = $features)]
            #[inline]
            pub unsafe fn load_i(p: *const i32) -> I {
                // SAFETY: the caller's.
                unsafe { vld1q_s32(p) }
            }
            /// # Safety
            /// `p` points at `L` readable `f32`s.
            #[target_feature(enable = $features)]
            #[inline]
            pub unsafe fn load_f(p: *const f32) -> F {
                // SAFETY: the caller's.
                unsafe { vld1q_f32(p) }
            }
            /// # Safety
            /// `p` points at `L` writable `f32`s.
            #[target_feature(enable = $features)]
            #[inline]
            pub unsafe fn store_f(p: *mut f32, v: F) {
                // SAFETY: the caller's.
                unsafe { vst1q_f32(p, v) }
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn bcast_i(v: i32) -> I {
                vdupq_n_s32(v)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn bcast_f(v: f32) -> F {
                vdupq_n_f32(v)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn mul(a: F, b: F) -> F {
                vmulq_f32(a, b)
            }
            /// `a * b + c`, fused.
            #[target_feature(enable = $features)]
            #[inline]
            pub fn fma(a: F, b: F, c: F) -> F {
                vfmaq_f32(c, a, b)
            }
            #[target_feature(enable = $features)]
            #[inline]
            pub fn cvt(v: I) -> F {
                vcvtq_f32_s32(v)
            }
            $dot
        };
    }

    mod neon_dot {
        ops!(
            "neon,dotprod",
            /// `acc` plus, per lane, the 4 products of `w`'s and `x`'s bytes as signed (`sdot`):
            /// `w`'s unsigned quants below 128 (every format's but Q8_0's) are the same signed.
            #[target_feature(enable = "neon,dotprod")]
            #[inline]
            pub fn dot(acc: I, w: I, x: I) -> I {
                super::super::super::neon::sdot(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(x))
            }
        );
    }

    mod neon_i8mm {
        ops!(
            "neon,dotprod,i8mm",
            /// `acc` plus, per lane, the 4 products of `w`'s unsigned and `x`'s signed bytes
            /// (`usdot`).
            #[target_feature(enable = "neon,dotprod,i8mm")]
            #[inline]
            pub fn dot(acc: I, w: I, x: I) -> I {
                super::super::super::neon::usdot(acc, vreinterpretq_u8_s32(w), vreinterpretq_s8_s32(x))
            }
        );
    }

    gemm!(gemm_neon_dot, "neon,dotprod", neon_dot);
    gemm!(gemm_neon_i8mm, "neon,dotprod,i8mm", neon_i8mm);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::qdot::tests::{ks, magnitudes};
    use crate::cpu::testing::{FORMATS, Rng, k_of};
    use crate::quant::QuantWeight;
    use kiln_compiler::tensor::Tensor;

    /// Activation rows: one, part of a vector, whole vectors of both widths and one past.
    const MS: [usize; 7] = [1, 5, 8, 9, 16, 17, 40];

    fn quantized(x: &[f32], k: usize) -> Vec<Q8Acts> {
        x.chunks(k)
            .map(|row| {
                let mut a = Q8Acts::new();
                a.quantize(row);
                a
            })
            .collect()
    }

    /// `gemm_rows` of every row of `w` (and `missing` rows past its words) with `rows` packed
    /// for `imp`.
    fn run(imp: Impl, w: &QuantWeight, rows: &[Q8Acts], missing: usize) -> Vec<f32> {
        let x = Acts::pack(imp, w.format, rows.to_vec());
        let len = w.rows + missing;
        let mut out = vec![-1.0; rows.len() * len];
        gemm_rows(w.format, &w.words, w.k, &x, &mut out, len);
        out
    }

    /// Every implementation equals the reference bit for bit (NaN where it is NaN), the results
    /// of rows past the words NaN.
    fn assert_impls_equal(w: &QuantWeight, rows: &[Q8Acts], what: &str) {
        let reference = run(Impl::Scalar, w, rows, 1);
        let len = w.rows + 1;
        for (i, o) in reference.chunks(len).enumerate() {
            assert!(o[w.rows].is_nan(), "{what}: row {i} past the words");
        }
        for imp in Impl::available().into_iter().filter(|i| i.computes(w.format)) {
            let got = run(imp, w, rows, 1);
            for (j, (&a, &b)) in got.iter().zip(&reference).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{what}: {} result {j} (activation row {}, weight row {}): {a} vs the reference's {b}",
                    imp.name(),
                    j / len,
                    j % len,
                );
            }
        }
    }

    #[test]
    fn implementations_equal_the_reference_and_the_decode_products() {
        let mut rng = Rng(21);
        for format in FORMATS {
            for k in ks(format) {
                for (wrows, m) in [(1, 40), (3, 17), (4, 9), (7, 16), (12, 5)] {
                    let what = format!("{format} k={k} weight rows {wrows}, activation rows {m}");
                    let w = QuantWeight::quantize(format, &Tensor::f32(vec![wrows, k], rng.values(wrows * k))).unwrap();
                    let rows = quantized(&rng.values(m * k), k);
                    assert_impls_equal(&w, &rows, &what);
                    // The reference against the decode kernels' dot products of the same
                    // quantized rows: the same terms, summed in another order.
                    let got = run(Impl::Scalar, &w, &rows, 0);
                    for (i, x) in rows.iter().enumerate() {
                        let mut dots = vec![0.0; wrows];
                        super::super::dot_rows_with(DotImpl::Scalar, format, &w.words, k, x, &mut dots);
                        for (r, (&d, m)) in dots.iter().zip(magnitudes(&w, x)).enumerate() {
                            let g = got[i * wrows + r];
                            assert!(
                                (f64::from(g) - f64::from(d)).abs() <= 1e-5 * m + 1e-30,
                                "{what}: activation row {i}, weight row {r}: {g} vs {d}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Raw random blocks reach every byte value (Q8_0's -128, every nibble and bit pair) and any
    /// scale's sign; activations at full scale reach ±127.
    #[test]
    fn raw_random_blocks_are_equal() {
        let mut rng = Rng(23);
        for format in FORMATS {
            for k in ks(format) {
                let (floats, stride) = (format.row_floats(k).unwrap(), format.row_words(k).unwrap());
                let wrows = 6;
                let words = (0..wrows * stride)
                    .map(|i| if i % stride < floats { rng.unit().to_bits() } else { rng.next() })
                    .collect();
                let w = QuantWeight { format, rows: wrows, k, words };
                for m in MS {
                    let x: Vec<f32> = (0..m * k).map(|i| if i % 7 == 0 { 1.0 } else { rng.unit() }).collect();
                    assert_impls_equal(&w, &quantized(&x, k), &format!("raw {format} k={k} m={m}"));
                }
            }
        }
    }

    /// NaN in one activation row makes that row's results NaN and no other's; shapes that do not
    /// fit give NaN everywhere; an implementation that does not compute a format refuses it.
    #[test]
    fn nan_and_bad_shapes_do_not_panic() {
        let mut rng = Rng(29);
        for format in FORMATS {
            let k = k_of(format, 64);
            let w = QuantWeight::quantize(format, &Tensor::f32(vec![5, k], rng.values(5 * k))).unwrap();
            let mut x = rng.values(3 * k);
            x[k + 3] = f32::NAN;
            let rows = quantized(&x, k);
            for imp in Impl::available().into_iter().filter(|i| i.computes(format)) {
                let out = run(imp, &w, &rows, 0);
                for (i, o) in out.chunks(5).enumerate() {
                    assert!(o.iter().all(|v| v.is_nan() == (i == 1)), "{format} {}: row {i} {o:?}", imp.name());
                }
                let packed = Acts::pack(imp, format, rows.clone());
                let mut out = vec![0.0; 3 * 5];
                // Another k, a float format, another format's groups.
                for (f, k) in [(format, k + 256), (WeightFormat::F32, k)] {
                    gemm_rows(f, &w.words, k, &packed, &mut out, 5);
                    assert!(out.iter().all(|v| v.is_nan()), "{format} {}: {f} k={k}", imp.name());
                }
                let other = if format == WeightFormat::Q6_K { WeightFormat::Q4_K } else { WeightFormat::Q6_K };
                gemm_rows(other, &w.words, k.next_multiple_of(256), &packed, &mut out, 5);
                assert!(out.iter().all(|v| v.is_nan()), "{format} {}: read as {other}", imp.name());
                // Short words: the rows they hold, NaN past them; an output too short: NaN.
                let full = run(imp, &w, &rows, 0);
                gemm_rows(format, &w.words[..w.words.len() - 1], k, &packed, &mut out, 5);
                for (o, f) in out.chunks(5).zip(full.chunks(5)) {
                    assert!(o[4].is_nan() && o[..4].iter().zip(f).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
                let mut short = vec![0.0; 14];
                gemm_rows(format, &w.words, k, &packed, &mut short, 5);
                assert!(short.iter().all(|v| v.is_nan()));
            }
            if !Impl::Avx2.computes(format) {
                let packed = Acts::pack(Impl::Avx2, format, rows.clone());
                let mut out = vec![0.0; 3 * 5];
                gemm_rows(format, &w.words, k, &packed, &mut out, 5);
                assert!(out.iter().all(|v| v.is_nan()), "{format}: AVX2 refuses it");
            }
        }
    }

    /// With AVX-512 VNNI, fewer than 16 rows take the 256-bit form (a 512-bit vector would be
    /// half padding at 8), 16 and more the 512-bit one; elsewhere the best SIMD form that computes
    /// the format, and never the portable reference.
    #[test]
    fn the_rows_choose_the_vector_width() {
        for format in FORMATS {
            for m in [8, 15, 16, 40] {
                let chosen = Impl::for_rows(format, m);
                assert_ne!(chosen, Some(Impl::Scalar));
                if Impl::Avx512Vnni.is_available() {
                    let expected = if m < 16 { Impl::Avx512Vnni256 } else { Impl::Avx512Vnni };
                    assert_eq!(chosen, Some(expected), "{format} at {m} rows");
                }
                if Impl::NeonI8mm.is_available() {
                    assert_eq!(chosen, Some(Impl::NeonI8mm), "{format} at {m} rows");
                }
                assert!(chosen.is_none_or(|i| i.is_available() && i.computes(format)));
            }
        }
    }

    #[test]
    fn every_simd_implementation_computes_the_k_quants() {
        for imp in [Impl::Avx2, Impl::AvxVnni, Impl::Avx512Vnni, Impl::Avx512Vnni256, Impl::NeonDot, Impl::NeonI8mm] {
            for format in [WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q4_K, WeightFormat::Q6_K] {
                assert!(imp.computes(format), "{} {format}", imp.name());
            }
        }
        assert!(!Impl::Avx2.computes(WeightFormat::Q8_0) && Impl::Avx512Vnni.computes(WeightFormat::Q8_0));
        assert!(!Impl::NeonDot.computes(WeightFormat::Q8_0) && Impl::NeonI8mm.computes(WeightFormat::Q8_0));
        assert!(!Impl::Scalar.computes(WeightFormat::F32));
    }
}
