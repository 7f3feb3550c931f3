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
    unsafe fn tile<const R: usize, const Q4: bool>(
        rows: [*const u32; R],
        nb: usize,
        x: &Q8Acts,
        _ahead: usize,
    ) -> [f32; R] {
        // SAFETY: the trait's contract, which includes the features.
        unsafe { tile::<R, Q4>(rows, nb, x) }
    }
}
