//! The AVX2 and FMA implementation: 8 lanes; prefill micro-tiles of 4 weight rows by 2 activation
//! rows (16 registers); Q5_0, Q4_K and Q6_K dequantized in registers too, as with AVX-512.
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

    use super::super::Shared;
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

    /// Block `b` of a Q5_0, Q4_K or Q6_K row (format tag `F`, `nb` blocks) dequantized in
    /// registers, each element as [`crate::quant::block`] gives it and
    /// [`dequant_block`](super::super::dequant_block) scales it (`q * scale`, plus Q4_K's
    /// minimum after the multiply), the AVX-512 kernel's arithmetic on 8 lanes: vector `v` holds
    /// elements `8 v..8 v + 8`, from bytes `8 v..` of the block's quants (Q5_0 and Q4_1's
    /// layout: bytes `8 (v % 2)..` of the 16, their low nibbles for `v < 2`, high ones after).
    ///
    /// # Safety
    ///
    /// `row` is a whole row of the layout for `nb` blocks and `b < nb`; for Q4_K and Q6_K,
    /// `shared` is its super-block's.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn kquant<const F: u8>(row: *const u32, nb: usize, b: usize, shared: &Shared) -> [V; BV] {
        use super::super::{F_Q4_K, F_Q5_0};
        debug_assert!(b < nb, "block {b} of {nb}");
        let ns = nb / 8;
        // SAFETY (all reads): words of the caller's whole row, in the layouts of
        // `kiln_compiler::lower::format` with `b < nb = 8 ns`: Q5_0 (`6 nb` words) reads words
        // `b`, `nb + b` and `2 nb + 4 b .. + 4`; Q4_K (`37 ns`) words `5 ns + 8 (b / 2) .. + 8`;
        // Q6_K (`53 ns`) words `low .. low + 8 <= 37 ns` and `high .. high + 8 <= 53 ns`
        // (`bytes8` reads 8 bytes at `part` 0 to 3 of the words from `at`, inside the 4 or 8
        // words named; `bytes32` all 8).
        let word = |i: usize| unsafe { row.add(i).read() };
        let bytes8 = |at: usize, part: usize| unsafe {
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(at + 2 * part).cast::<__m128i>()))
        };
        let shift = |v: __m256i, n: u32| _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
        let fifteen = _mm256_set1_epi32(15);
        match F {
            F_Q5_0 => {
                let (d, fifth) = (_mm256_set1_ps(f32::from_bits(word(b))), word(nb + b));
                let sixteen = _mm256_set1_epi32(16);
                let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mut out = [_mm256_setzero_ps(); BV];
                for (v, o) in out.iter_mut().enumerate() {
                    let q = bytes8(2 * nb + 4 * b, v % 2);
                    let q = if v < 2 { _mm256_and_si256(q, fifteen) } else { _mm256_srli_epi32::<4>(q) };
                    // Element `8 v + lane`'s fifth bit, times 16.
                    let bits = _mm256_srlv_epi32(_mm256_set1_epi32((fifth >> (8 * v)) as i32), lanes);
                    let q = _mm256_add_epi32(q, _mm256_slli_epi32::<4>(_mm256_and_si256(bits, _mm256_set1_epi32(1))));
                    *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, sixteen)), d);
                }
                out
            }
            F_Q4_K => {
                let (scale, min) = shared.get(b % 8).copied().unwrap_or_default();
                let (scale, min) = (_mm256_set1_ps(scale), _mm256_set1_ps(min));
                let at = 5 * ns + 8 * (b / 2);
                let nibble = 4 * (b % 2) as u32;
                let mut out = [_mm256_setzero_ps(); BV];
                for (v, o) in out.iter_mut().enumerate() {
                    let q = _mm256_and_si256(shift(bytes8(at, v), nibble), fifteen);
                    *o = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), scale), min);
                }
                out
            }
            _ => {
                let (s, c8) = (b / 8, b % 8);
                let (h, c) = (c8 / 4, c8 % 4);
                let scales = shared.get(b % 8).copied().unwrap_or_default();
                let (low, high) = (5 * ns + 32 * s + 16 * h + 8 * (c % 2), 37 * ns + 16 * s + 8 * h);
                // The block's 32 quants as bytes: its nibbles and bit pairs shifted out of each
                // 16-bit lane and masked per byte (no bit crosses into a kept one), joined, less
                // 32 (as the AVX-512 kernel does); then widened 8 at a time.
                let bytes32 = |at: usize| unsafe { _mm256_loadu_si256(row.add(at).cast::<__m256i>()) };
                let shift16 = |v: __m256i, n: u32| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
                let l = _mm256_and_si256(shift16(bytes32(low), 4 * (c / 2) as u32), _mm256_set1_epi8(15));
                let hh = _mm256_and_si256(shift16(bytes32(high), 2 * c as u32), _mm256_set1_epi8(3));
                let q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16::<4>(hh)), _mm256_set1_epi8(32));
                let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
                let pieces = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                let mut out = [_mm256_setzero_ps(); BV];
                for (v, (o, piece)) in out.iter_mut().zip(pieces).enumerate() {
                    // Elements 0..16 take the first scale, 16..32 the second.
                    let scale = if v < 2 { scales.0 } else { scales.1 };
                    *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(piece)), _mm256_set1_ps(scale));
                }
                out
            }
        }
    }

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

/// The weight rows of this module's prefill tile ([`super::Impl::prefill_rows`]).
pub(super) const PREFILL_ROWS: usize = ops::NR;

kernels!(kernels, "avx2,fma", ops);
