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
