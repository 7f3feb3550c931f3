//! The AVX-512 VNNI kernels.
//!
//! Q8_0 and Q4_1: two blocks per 512-bit step, `R` rows at a time.
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
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads through raw pointers are not, and say why they hold.

use super::{Kernel, Q8Acts};
use crate::cpu::isa::x86::prefetch;
use std::arch::x86_64::*;

/// Blocks whose scales are loaded (and multiplied by the activation's) at once.
const GROUP: usize = 16;

/// Q8_0 (`Q4 = false`) or Q4_1 rows: see [`Kernel`] for the contract.
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
                    (_mm512_maskz_loadu_ps(gmask, row.add(nb + g0).cast()), _mm512_maskz_loadu_ps(gmask, xs.add(g0)))
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
        one, one, one, one, one, one, one, one, sixteenth, sixteenth, sixteenth, sixteenth, sixteenth, sixteenth,
        sixteenth, sixteenth,
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
#[expect(
    clippy::too_many_arguments,
    reason = "one step: the tile's accumulators and scales, its rows, and where the step is"
)]
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
            let w = unsafe { if TWO { _mm256_loadu_si256(w.cast()) } else { _mm256_maskz_loadu_epi32(0x0f, w) } };
            _mm512_and_si512(_mm512_broadcast_i64x4(w), nibbles)
        } else {
            // SAFETY: words `nb + 8 b ..` plus 16 (`TWO`: `b + 1 < nb`) or 8 (masked) are
            // within the row's `9 nb` (the contract; each row's span asserted in `tile`).
            let w = unsafe { if TWO { _mm512_loadu_si512(w.cast()) } else { _mm512_maskz_loadu_epi32(0x00ff, w) } };
            _mm512_xor_si512(w, offset)
        };
        let sums = _mm512_dpbusd_epi32(start, q, xv);
        *a = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, *s), _mm512_cvtepi32_ps(sums), *a);
    }
}

/// The AVX-512 VNNI kernel: two blocks (one activation line) per 512-bit step.
pub(super) struct Avx512Vnni;

impl Kernel for Avx512Vnni {
    unsafe fn tile<const R: usize, const Q4: bool>(
        rows: [*const u32; R],
        nb: usize,
        x: &Q8Acts,
        ahead: usize,
    ) -> [f32; R] {
        // SAFETY: the trait's contract, which includes the features.
        unsafe { tile::<R, Q4>(rows, nb, x, ahead) }
    }
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
    use crate::cpu::isa::x86::hsum256;
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
