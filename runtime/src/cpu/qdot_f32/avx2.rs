//! The AVX2 and FMA implementation: 8 lanes; prefill micro-tiles of 4 weight rows by 2 activation
//! rows (16 registers); Q5_0, Q4_K and Q6_K through the portable block dequantization.
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads and stores through raw pointers are not, and say why they hold.

mod ops {
    use std::arch::x86_64::*;

    pub(super) type V = __m256;
    pub(super) const LANES: usize = 8;
    pub(super) const BV: usize = 4;
    pub(super) const NR: usize = 8;
    pub(super) const SUB: usize = 4;
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

    pub(super) use crate::cpu::isa::x86::prefetch;

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

kernels!(kernels, "avx2,fma", ops);
