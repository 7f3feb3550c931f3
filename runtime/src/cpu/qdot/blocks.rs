//! Byte helpers on 256 bits that the integer GEMM's x86 unpacking of Q5_0, Q4_K and Q6_K blocks
//! shares ([`super::gemm`]): a row's 32 bytes from a word, 16-bit lanes shifted, and Q5_0's fifth
//! bits spread to bytes on AVX2.
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads through raw pointers are not, and say why they hold.

use std::arch::x86_64::*;

/// The 32 bytes of the 8 words of `row` from word `at`, or `None` past its end.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn load256(row: &[u32], at: usize) -> Option<__m256i> {
    let w = row.get(at..at.checked_add(8)?)?;
    // SAFETY: `w` holds 8 words, 32 bytes (a checked `get`, in every build).
    debug_assert_eq!(w.len(), 8);
    Some(unsafe { _mm256_loadu_si256(w.as_ptr().cast()) })
}

/// `v`'s 16-bit lanes shifted right by `n`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn shr16(v: __m256i, n: usize) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// Byte `i` 0x10 where bit `i` of `bits` is set, else 0: each byte gets the byte of `bits`
/// holding its bit (a shuffle of the broadcast word), then tests its own bit.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn fifth(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}
