//! The AArch64 NEON kernels, one block per step: Q8_0 and Q4_1 `R` rows at a time; Q5_0, Q4_K
//! and Q6_K a row at a time (`rows`), their quants assembled into signed bytes in element order
//! (less their offsets 16 and 32) as the x86 kernels of `blocks` do. Two sets of integer
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
            use super::super::{BLOCK, Q8Acts};
            use super::load16;
            use crate::cpu::isa::arm::{fifths, shr};
            use kiln_compiler::lower::WeightFormat;
            use kiln_compiler::lower::format::SUPER_BLOCK;
            use std::arch::aarch64::*;

            $dot

            /// `out[r] = dot(row r, x)` for the rows of `words` (`stride` words each, `k` elements
            /// of `format`: Q5_0, Q4_K or Q6_K); NaN for a row whose words do not fit the layout.
            /// Per block the quants as signed bytes (Q5_0's less 16, Q6_K's less 32: no offset
            /// term), each half of 16 dotted with the activation block's into `i32` lanes and
            /// scaled by its `scale * d_x`; Q4_K's minimums add `min * s_x` per block.
            ///
            /// # Safety
            ///
            /// The CPU has `$features`. (Shapes are checked here.)
            #[target_feature(enable = $features)]
            pub(in super::super) unsafe fn rows(
                format: WeightFormat,
                words: &[u32],
                stride: usize,
                k: usize,
                x: &Q8Acts,
                out: &mut [f32],
            ) {
                let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
                let xq: Vec<[int8x16_t; 2]> = x
                    .quant_blocks()
                    .take(nb)
                    .map(|q| {
                        // SAFETY: `q` is one block, 32 bytes (`chunks_exact(BLOCK)` of the lines).
                        debug_assert_eq!(q.len(), BLOCK);
                        unsafe { [vld1q_s8(q.as_ptr()), vld1q_s8(q.as_ptr().add(16))] }
                    })
                    .collect();
                if xq.len() < nb || x.d.len() < nb || x.s.len() < nb || stride == 0 {
                    out.fill(f32::NAN);
                    return;
                }
                let fifteen = vdupq_n_u8(0x0f);
                let signed =
                    |q: uint8x16_t, offset: i8| vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(offset));
                for (o, row) in out.iter_mut().zip(words.chunks_exact(stride)) {
                    let mut acc = vdupq_n_f32(0.0);
                    let mut mins = 0f32;
                    let mut ok = true;
                    for (b, ((&[x0, x1], &dx), &sx)) in xq.iter().zip(&x.d).zip(&x.s).enumerate() {
                        let f = |i: usize| row.get(i).map(|&w| f32::from_bits(w));
                        // The block's halves as signed bytes, their scales (times `d_x`) and the
                        // minimum's term.
                        let step = match format {
                            WeightFormat::Q5_0 => (|| {
                                let (q, fifth) = (load16(row, 2 * nb + 4 * b)?, *row.get(nb + b)?);
                                // Elements 0..16 in the low nibbles, 16..32 in the high ones.
                                let lo = vorrq_u8(vandq_u8(q, fifteen), fifths(fifth & 0xffff));
                                let hi = vorrq_u8(vshrq_n_u8::<4>(q), fifths(fifth >> 16));
                                let a = f(b)? * dx;
                                Some(([signed(lo, 16), signed(hi, 16)], [a, a], 0.0))
                            })(),
                            WeightFormat::Q4_K => (|| {
                                let s = b / 8;
                                let packed = row.get(2 * ns + 3 * s..2 * ns + 3 * s + 3)?;
                                let packed: [u8; 12] = bytemuck::cast_slice::<u32, u8>(packed).try_into().ok()?;
                                let (sc, m) = crate::gguf::q4_k_scale_min(&packed, b % 8);
                                let at = 5 * ns + 8 * (b / 2);
                                // Nibbles: below 16, the same signed.
                                let half = |at: usize| {
                                    let q = vandq_u8(shr(load16(row, at)?, 4 * (b % 2)), fifteen);
                                    Some(vreinterpretq_s8_u8(q))
                                };
                                let a = f(s)? * f32::from(sc) * dx;
                                let min = -(f(ns + s)? * f32::from(m));
                                Some(([half(at)?, half(at + 4)?], [a, a], min * sx))
                            })(),
                            _ => (|| {
                                let (s, c8) = (b / 8, b % 8);
                                let (h, c) = (c8 / 4, c8 % 4);
                                let low = 5 * ns + 32 * s + 16 * h + 8 * (c % 2);
                                let high = 37 * ns + 16 * s + 8 * h;
                                let half = |i: usize| {
                                    let l = vandq_u8(shr(load16(row, low + 4 * i)?, 4 * (c / 2)), fifteen);
                                    let hh = vandq_u8(shr(load16(row, high + 4 * i)?, 2 * c), vdupq_n_u8(3));
                                    Some(signed(vorrq_u8(l, vshlq_n_u8::<4>(hh)), 32))
                                };
                                let scales = bytemuck::cast_slice::<u32, u8>(row.get(ns + 4 * s..ns + 4 * s + 4)?);
                                let sc = |i: usize| scales.get(i).map(|&v| f32::from(v as i8));
                                let d = f(s)? * dx;
                                Some(([half(0)?, half(1)?], [sc(2 * c8)? * d, sc(2 * c8 + 1)? * d], 0.0))
                            })(),
                        };
                        let Some(([q0, q1], [a0, a1], min)) = step else {
                            ok = false;
                            break;
                        };
                        let zero = vdupq_n_s32(0);
                        let (s0, s1) = (dot(zero, q0, x0), dot(zero, q1, x1));
                        if a0 == a1 {
                            acc = vfmaq_n_f32(acc, vcvtq_f32_s32(vaddq_s32(s0, s1)), a0);
                        } else {
                            acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s0), a0);
                            acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s1), a1);
                        }
                        mins += min;
                    }
                    *o = if ok { vaddvq_f32(acc) + mins } else { f32::NAN };
                }
            }

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
