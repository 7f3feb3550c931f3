//! The AArch64 NEON kernels of Q8_0 and Q4_1, `R` rows at a time and one block per step (Q5_0
//! and the K-quants have the portable row kernel only; see the module above). Two sets of integer
//! products, the same kernels over each (`neon!`):
//!
//! - [`Neon`]: every AArch64 CPU. Products of bytes widen to `i16` (`smull`, `smlal2`: two
//!   products of at most 128 * 127 fit) and pairs of those to `i32` lanes (`sadalp`).
//! - [`NeonDot`]: the dot-product extension (Armv8.2's `dotprod`: Cortex-A55/A76 and later,
//!   Apple M1, Graviton 2): `sdot`, four byte products into each `i32` lane in one instruction,
//!   through inline assembly (its intrinsics are not stable in Rust yet).
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads through raw pointers are not, and say why they hold.

use super::{Kernel, Q8Acts};
use std::arch::aarch64::*;

/// The 16 bytes of the 4 words of `row` from word `at`, or `None` past its end.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn load16(row: &[u32], at: usize) -> Option<uint8x16_t> {
    let w = row.get(at..at.checked_add(4)?)?;
    // SAFETY: `w` holds 4 words, 16 bytes (a checked `get`, in every build).
    debug_assert_eq!(w.len(), 4);
    Some(unsafe { vld1q_u8(w.as_ptr().cast()) })
}

/// `acc` plus, per lane, the 4 products of `w`'s and `x`'s bytes at the lane's place, both
/// signed (`sdot`, the dot-product extension).
#[target_feature(enable = "neon,dotprod")]
#[inline]
pub(super) fn sdot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: one instruction on registers (no memory, stack or flags), of the `dotprod`
    // extension this function is compiled for, so its caller's CPU has it.
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// `acc` plus, per lane, the 4 products of `w`'s unsigned and `x`'s signed bytes at the lane's
/// place (`usdot`, the int8 matrix-multiply extension: `vpdpbusd`'s product).
#[target_feature(enable = "neon,dotprod,i8mm")]
#[inline]
pub(super) fn usdot(acc: int32x4_t, w: uint8x16_t, x: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: one instruction on registers (no memory, stack or flags), of the `i8mm`
    // extension this function is compiled for, so its caller's CPU has it.
    unsafe {
        std::arch::asm!(
            "usdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// The kernels over an integer product `$dot` (`acc` plus the 16 products of `w` and `x`, in
/// `i32` lanes), compiled with `$features`, in module `$m`; `$kernel` its [`Kernel`].
macro_rules! neon {
    ($m:ident, $features:literal, $kernel:ident, $dot:item) => {
        /// The kernel of the module of the same name in lower case.
        pub(super) struct $kernel;

        impl Kernel for $kernel {
            unsafe fn tile<const R: usize, const Q4: bool>(
                rows: [*const u32; R],
                nb: usize,
                x: &Q8Acts,
                _ahead: usize,
            ) -> [f32; R] {
                // SAFETY: the trait's contract, which includes the features.
                unsafe { $m::tile::<R, Q4>(rows, nb, x) }
            }
        }

        pub(super) mod $m {
            use super::super::Q8Acts;
            use std::arch::aarch64::*;

            $dot

            /// Q8_0 (`Q4 = false`) or Q4_1 rows: see [`Kernel`] for the contract (no prefetching).
            #[target_feature(enable = $features)]
            pub(super) unsafe fn tile<const R: usize, const Q4: bool>(
                rows: [*const u32; R],
                nb: usize,
                x: &Q8Acts,
            ) -> [f32; R] {
                let xq = x.q.as_ptr().cast::<i8>();
                let mut acc = [vdupq_n_f32(0.0); R];
                for (b, &dx) in x.d.iter().enumerate().take(nb) {
                    // SAFETY: block `b < nb` of `x.q`, at least `nb.div_ceil(2)` lines of two
                    // 32-byte blocks (the contract, asserted in `tile`).
                    let (x0, x1) = unsafe { (vld1q_s8(xq.add(32 * b)), vld1q_s8(xq.add(32 * b + 16))) };
                    for (a, &row) in acc.iter_mut().zip(&rows) {
                        // SAFETY: word `b < nb`, a scale (the contract; each row's span asserted
                        // in `tile`).
                        let dw = f32::from_bits(unsafe { row.add(b).read() });
                        let sums = if Q4 {
                            // SAFETY: words `2 nb + 4 b .. 2 nb + 4 b + 4 <= 6 nb` of the Q4_1 row.
                            let w = unsafe { vld1q_u8(row.add(2 * nb + 4 * b).cast()) };
                            let lo = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(0x0f)));
                            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(w));
                            dot(dot(vdupq_n_s32(0), lo, x0), hi, x1)
                        } else {
                            let w = row.wrapping_add(nb + 8 * b).cast::<i8>();
                            // SAFETY: words `nb + 8 b .. nb + 8 b + 8 <= 9 nb` of the Q8_0 row.
                            let (w0, w1) = unsafe { (vld1q_s8(w), vld1q_s8(w.add(16))) };
                            dot(dot(vdupq_n_s32(0), w0, x0), w1, x1)
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
        }
    };
}

neon!(
    widening,
    "neon",
    Neon,
    /// `acc` plus the 16 products of `w` and `x`: widened to `i16` (`smull`, `smlal2`), pairs
    /// added into the `i32` lanes (`sadalp`).
    #[target_feature(enable = "neon")]
    #[inline]
    fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(x)), w, x))
    }
);

neon!(
    dotprod,
    "neon,dotprod",
    NeonDot,
    /// `acc` plus the 16 products of `w` and `x`: lane `i` gains those of bytes `4 i..4 i + 4`
    /// (`sdot`).
    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        super::sdot(acc, w, x)
    }
);
