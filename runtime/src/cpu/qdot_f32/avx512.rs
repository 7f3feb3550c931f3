//! The AVX-512F implementation (with AVX2 and FMA): 16 lanes; prefill micro-tiles of 6 weight rows
//! by 4 activation rows (24 accumulators of the 32 registers); Q5_0, Q4_K and Q6_K dequantized in registers too.
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads and stores through raw pointers are not, and say why they hold.

mod ops {
    use std::arch::x86_64::*;

    pub(super) type V = __m512;
    pub(super) const LANES: usize = 16;
    pub(super) const BV: usize = 2;
    pub(super) const NR: usize = 12;
    pub(super) const SUB: usize = 6;
    pub(super) const MR: usize = 4;
    pub(super) const HOIST: usize = 8;
    pub(super) const DIRECT: usize = 4;

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn zero() -> V {
        _mm512_setzero_ps()
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn fma(a: V, b: V, c: V) -> V {
        _mm512_fmadd_ps(a, b, c)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn add(a: V, b: V) -> V {
        _mm512_add_ps(a, b)
    }

    /// # Safety
    ///
    /// `p` is readable for 16 floats.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller's.
        unsafe { _mm512_loadu_ps(p) }
    }

    /// # Safety
    ///
    /// `p` is writable for 16 floats.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn store(p: *mut f32, v: V) {
        // SAFETY: the caller's.
        unsafe { _mm512_storeu_ps(p, v) }
    }

    use super::super::Shared;
    pub(super) use crate::cpu::isa::x86::prefetch;

    /// A Q8_0 block (32 signed bytes at `p`) times `d`.
    ///
    /// # Safety
    ///
    /// `p` is readable for 8 words.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn q8(p: *const u32, d: f32) -> [V; BV] {
        let p = p.cast::<__m128i>();
        // SAFETY: the caller's (two 16-byte loads).
        let (a, b) = unsafe { (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1))) };
        let d = _mm512_set1_ps(d);
        let f = |q: __m128i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        [f(a), f(b)]
    }

    /// A Q4_1 block (16 bytes at `p`: element `j` in byte `j`'s low nibble, `j + 16` in its
    /// high one) as `q * d + m`, looked up in the table of the 16 values.
    ///
    /// # Safety
    ///
    /// `p` is readable for 4 words.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn q4(p: *const u32, d: f32, m: f32) -> [V; BV] {
        // SAFETY: the caller's.
        let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.cast()) });
        let iota = _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
        // A multiply then an add, as the dequantization computes each element (not an FMA).
        let table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
        // `vpermps` reads the low 4 bits of each index: the low nibble as it is, the high one
        // shifted down.
        [_mm512_permutexvar_ps(q, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table)]
    }

    /// Block `b` of a Q5_0, Q4_K or Q6_K row (format tag `F`, `nb` blocks) dequantized in
    /// registers, each element as [`crate::quant::block`] gives it and
    /// [`dequant_block`](super::super::dequant_block) scales it (`q * scale`, plus Q4_K's
    /// minimum after the multiply): the quants widened to 32 bits, Q5_0's fifth bits added under
    /// a lane mask of the block's bit word, the K formats' nibbles and bit pairs shifted out by
    /// the sub-block's position; Q4_K's scale and minimum, and Q6_K's two scales, are the block's
    /// pair of `shared` (its super-block's, unpacked once for its 8 blocks:
    /// [`q4_k_factors`](super::super::q4_k_factors), [`q6_k_scales`](super::super::q6_k_scales)).
    ///
    /// # Safety
    ///
    /// `row` is a whole row of the layout for `nb` blocks and `b < nb`; for Q4_K and Q6_K,
    /// `shared` is its super-block's.
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    pub(super) unsafe fn kquant<const F: u8>(row: *const u32, nb: usize, b: usize, shared: &Shared) -> [V; BV] {
        use super::super::{F_Q4_K, F_Q5_0};
        debug_assert!(b < nb, "block {b} of {nb}");
        let ns = nb / 8;
        // SAFETY (all reads): words of the caller's whole row, in the layouts of
        // `kiln_compiler::lower::format` with `b < nb = 8 ns`: Q5_0 (`6 nb` words) reads words
        // `b`, `nb + b` and `2 nb + 4 b .. + 4`; Q4_K (`37 ns`) words `5 ns + 8 (b / 2) .. + 8`;
        // Q6_K (`53 ns`) words `low .. low + 8 <= 37 ns` and `high .. high + 8 <= 53 ns`
        // (`bytes16` reads 16 bytes at `half` 0 or 1 of the 8 words it is given, `bytes32` all
        // 32).
        let word = |i: usize| unsafe { row.add(i).read() };
        let bytes16 = |at: usize, half: usize| unsafe {
            _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(at).cast::<__m128i>().add(half)))
        };
        let shift = |v: __m512i, n: u32| _mm512_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
        match F {
            F_Q5_0 => {
                // The block's 32 values `(q - 16) * d`, looked up by `vpermt2ps` (a 5-bit index
                // into two tables of 16) at each quant: its nibble, plus 16 under the lane mask of
                // its fifth bits.
                let (d, fifth) = (_mm512_set1_ps(f32::from_bits(word(b))), word(nb + b));
                let below = _mm512_setr_ps(
                    -16.0, -15.0, -14.0, -13.0, -12.0, -11.0, -10.0, -9.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0,
                    -1.0,
                );
                let above = _mm512_setr_ps(
                    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
                );
                let (below, above) = (_mm512_mul_ps(below, d), _mm512_mul_ps(above, d));
                let q = bytes16(2 * nb + 4 * b, 0);
                let sixteen = _mm512_set1_epi32(16);
                let lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
                let hi = _mm512_srli_epi32::<4>(q);
                let lo = _mm512_mask_or_epi32(lo, fifth as u16, lo, sixteen);
                let hi = _mm512_mask_or_epi32(hi, (fifth >> 16) as u16, hi, sixteen);
                let f = |i: __m512i| _mm512_permutex2var_ps(below, i, above);
                [f(lo), f(hi)]
            }
            F_Q4_K => {
                // The block's 16 values `q * scale + min` (a multiply then an add, as each
                // element is dequantized), looked up by its quants as Q4_1's are ([`q4`]):
                // `vpermps` reads an index's low 4 bits, so the quants' bytes need no mask, the
                // odd blocks' high nibbles only the shift down (4 vector operations a block
                // fewer than converting and scaling each quant).
                let (scale, min) = shared.get(b % 8).copied().unwrap_or_default();
                let iota = _mm512_setr_ps(
                    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
                );
                let table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(scale)), _mm512_set1_ps(min));
                let at = 5 * ns + 8 * (b / 2);
                let nibble = 4 * (b % 2) as u32;
                let f = |half: usize| _mm512_permutexvar_ps(shift(bytes16(at, half), nibble), table);
                [f(0), f(1)]
            }
            _ => {
                let (s, c8) = (b / 8, b % 8);
                let (h, c) = (c8 / 4, c8 % 4);
                let (sc0, sc1) = shared.get(b % 8).copied().unwrap_or_default();
                let (low, high) = (5 * ns + 32 * s + 16 * h + 8 * (c % 2), 37 * ns + 16 * s + 8 * h);
                // The block's 32 quants as bytes: its nibbles and bit pairs shifted out of each
                // 16-bit lane and masked per byte (no bit crosses into a kept one), joined, less
                // 32; then widened 16 at a time.
                let bytes32 = |at: usize| unsafe { _mm256_loadu_si256(row.add(at).cast::<__m256i>()) };
                let shift16 = |v: __m256i, n: u32| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
                let l = _mm256_and_si256(shift16(bytes32(low), 4 * (c / 2) as u32), _mm256_set1_epi8(15));
                let hh = _mm256_and_si256(shift16(bytes32(high), 2 * c as u32), _mm256_set1_epi8(3));
                let q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16::<4>(hh)), _mm256_set1_epi8(32));
                let f = |q: __m128i, scale: f32| {
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(scale))
                };
                [f(_mm256_castsi256_si128(q), sc0), f(_mm256_extracti128_si256::<1>(q), sc1)]
            }
        }
    }

    /// The lane sums of `a[0..4]`.
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    pub(super) fn hsum4(a: [V; 4]) -> [f32; 4] {
        let [a0, a1, a2, a3] = a;
        // Per 128-bit lane: [a0, a1, a0, a1] and [a2, a3, a2, a3] partial sums.
        let b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
        let b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
        // Per 128-bit lane: [a0, a1, a2, a3] partial sums; then the 4 lanes added.
        let c = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(b0, b1), _mm512_shuffle_ps::<0xee>(b0, b1));
        let c = _mm512_add_ps(c, _mm512_shuffle_f32x4::<0x4e>(c, c));
        let c = _mm512_castps512_ps256(c);
        let s = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c));
        let mut out = [0f32; 4];
        // SAFETY: `out` holds 4 floats.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
        out
    }
}

/// The weight rows of this module's prefill tile ([`super::Impl::prefill_rows`]).
pub(super) const PREFILL_ROWS: usize = ops::NR;

kernels!(kernels, "avx512f,avx2,fma", ops);
