//! The AArch64 NEON implementation: 4 lanes; prefill micro-tiles of 4 weight rows by 4 activation
//! rows; Q5_0, Q4_K and Q6_K through the portable block dequantization; no prefetching (its
//! intrinsic is not stable yet).

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

/// The weight rows of this module's prefill tile ([`super::Impl::prefill_rows`]).
pub(super) const PREFILL_ROWS: usize = ops::NR;

kernels!(kernels, "neon", ops);
