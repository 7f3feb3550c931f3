//! The AArch64 NEON implementation: 4 lanes; prefill micro-tiles of 4 weight rows by 4 activation
//! rows; Q5_0, Q4_K and Q6_K dequantized in registers too, as with AVX-512 and AVX2; no
//! prefetching (its intrinsic is not stable yet).
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads and stores through raw pointers are not, and say why they hold.

mod ops {
    use std::arch::aarch64::*;

    pub(super) type V = float32x4_t;
    pub(super) const LANES: usize = 4;
    pub(super) const BV: usize = 8;
    pub(super) const NR: usize = 8;
    pub(super) const SUB: usize = 4;
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

    use super::super::Shared;

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

    /// Block `b` of a Q5_0, Q4_K or Q6_K row (format tag `F`, `nb` blocks) dequantized in
    /// registers, each element as [`crate::quant::block`] gives it and
    /// [`dequant_block`](super::super::dequant_block) scales it (`q * scale`, plus Q4_K's
    /// minimum after the multiply), the x86 kernels' arithmetic on 4 lanes: the block's 32
    /// quants assembled as bytes in element order (two vectors of 16), then widened 4 at a time,
    /// so vector `v` holds elements `4 v..4 v + 4`.
    ///
    /// # Safety
    ///
    /// `row` is a whole row of the layout for `nb` blocks and `b < nb`; for Q4_K and Q6_K,
    /// `shared` is its super-block's.
    #[target_feature(enable = "neon")]
    #[inline]
    pub(super) unsafe fn kquant<const F: u8>(row: *const u32, nb: usize, b: usize, shared: &Shared) -> [V; BV] {
        use super::super::{F_Q4_K, F_Q5_0};
        use crate::cpu::isa::arm::{fifths, shr};
        debug_assert!(b < nb, "block {b} of {nb}");
        let ns = nb / 8;
        // SAFETY (all reads): words of the caller's whole row, in the layouts of
        // `kiln_compiler::lower::format` with `b < nb = 8 ns`: Q5_0 (`6 nb` words) reads words
        // `b`, `nb + b` and `2 nb + 4 b .. + 4`; Q4_K (`37 ns`) words `5 ns + 8 (b / 2) .. + 8`
        // (its factors come in `shared`, and Q6_K's scales); Q6_K (`53 ns`) words `low .. low +
        // 8 <= 37 ns` and `high .. high + 8 <= 53 ns` (`bytes16` reads 4 words from `at`).
        let word = |i: usize| unsafe { row.add(i).read() };
        let bytes16 = |at: usize| unsafe { vld1q_u8(row.add(at).cast::<u8>()) };
        let fifteen = vdupq_n_u8(15);
        let [[a0, a1, a2, a3], [b0, b1, b2, b3]] = match F {
            F_Q5_0 => {
                let (d, fifth) = (f32::from_bits(word(b)), word(nb + b));
                let q = bytes16(2 * nb + 4 * b);
                // Elements 0..16 in the low nibbles, 16..32 in the high ones; less 16, signed.
                let sixteen = vdupq_n_s8(16);
                let lo = vorrq_u8(vandq_u8(q, fifteen), fifths(fifth & 0xffff));
                let hi = vorrq_u8(vshrq_n_u8::<4>(q), fifths(fifth >> 16));
                let lo = vsubq_s8(vreinterpretq_s8_u8(lo), sixteen);
                let hi = vsubq_s8(vreinterpretq_s8_u8(hi), sixteen);
                let d = vdupq_n_f32(d);
                [lo, hi].map(|q| widen(vreinterpretq_u8_s8(q), true).map(|v| vmulq_f32(v, d)))
            }
            F_Q4_K => {
                let (scale, min) = shared.get(b % 8).copied().unwrap_or_default();
                let at = 5 * ns + 8 * (b / 2);
                let nibble = 4 * (b % 2);
                let (scale, min) = (vdupq_n_f32(scale), vdupq_n_f32(min));
                let half = |at: usize| {
                    let [w, x, y, z] = widen(vandq_u8(shr(bytes16(at), nibble), fifteen), false);
                    // A multiply then an add, as the dequantization computes each element.
                    [w, x, y, z].map(|v| vaddq_f32(vmulq_f32(v, scale), min))
                };
                [half(at), half(at + 4)]
            }
            _ => {
                let (s, c8) = (b / 8, b % 8);
                let (h, c) = (c8 / 4, c8 % 4);
                let scales = shared.get(b % 8).copied().unwrap_or_default();
                let (low, high) = (5 * ns + 32 * s + 16 * h + 8 * (c % 2), 37 * ns + 16 * s + 8 * h);
                // Per 16 quants: the nibble and bit pair shifted out of each byte and joined,
                // less 32, signed.
                let half = |i: usize| {
                    let l = vandq_u8(shr(bytes16(low + 4 * i), 4 * (c / 2)), fifteen);
                    let hh = vandq_u8(shr(bytes16(high + 4 * i), 2 * c), vdupq_n_u8(3));
                    vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l, vshlq_n_u8::<4>(hh))), vdupq_n_s8(32))
                };
                // Elements 0..16 take the first scale, 16..32 the second.
                let scaled =
                    |i: usize, scale: f32| widen(vreinterpretq_u8_s8(half(i)), true).map(|v| vmulq_n_f32(v, scale));
                [scaled(0, scales.0), scaled(1, scales.1)]
            }
        };
        [a0, a1, a2, a3, b0, b1, b2, b3]
    }

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

/// The weight rows of this module's prefill tile ([`super::Impl::prefill_rows`]).
pub(super) const PREFILL_ROWS: usize = ops::NR;

kernels!(kernels, "neon", ops);
