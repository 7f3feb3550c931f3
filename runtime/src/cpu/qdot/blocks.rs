//! Q5_0, Q4_K and Q6_K on 256 bits, a row at a time and a block of 32 per step: the weight's
//! 5-bit (Q5_0: nibbles, and the fifth bits spread from their word to bytes), 4-bit (Q4_K: one
//! nibble of 32 bytes) or 6-bit (Q6_K: a nibble and a bit pair) quants assembled into 32 unsigned
//! bytes in element order, then their products with the activation block summed into `i32`
//! lanes (four elements each). Q5_0's and Q6_K's offsets (16, 32) come off as `offset *
//! sum(q_x)` per lane (never across Q6_K's 16-element scales), each lane scaled by its block's
//! (Q6_K: its half's) `scale * d_x`; Q4_K's minimums add `min * s_x` per block.
//!
//! One kernel (`blocks256!`) over two sets of integer steps: AVX-512 VNNI's `vpdpbusd` on 256
//! bits, and AVX2's `vpmaddubsw` into pairs of `i16` then `vpmaddwd` by ones (unsigned quants
//! below 64 times activations within ±127: a pair is below 2^15, never saturated).
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads through raw pointers are not, and say why they hold.

use super::{BLOCK, Q8Acts};
use crate::cpu::isa::x86::hsum256;
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::SUPER_BLOCK;
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

/// The integer steps with AVX-512 VNNI (on 256 bits).
mod vnni512 {
    use std::arch::x86_64::*;

    /// The 8 lane sums of 4 products of unsigned `q` and signed `x` bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    #[inline]
    pub(super) fn u_dot(q: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x)
    }

    /// Byte `i` 0x10 where bit `i` of `bits` is set, else 0 (Q5_0's fifth bits in place).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    #[inline]
    pub(super) fn fifth(bits: u32) -> __m256i {
        _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10))
    }
}

/// The integer steps with AVX2 (whose `fifth` the integer GEMM's unpacking uses too).
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// The 8 lane sums of 4 products of unsigned `q` (below 64) and signed `x` bytes (within
    /// ±127): pairs below 2^15, so `vpmaddubsw` never saturates.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn u_dot(q: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
    }

    /// Byte `i` 0x10 where bit `i` of `bits` is set, else 0: each byte gets the byte of `bits`
    /// holding its bit (a shuffle of the broadcast word), then tests its own bit.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in super::super) fn fifth(bits: u32) -> __m256i {
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
}

/// The kernel over a module of integer steps (`$ops`), compiled with `$features`.
macro_rules! blocks256 {
    ($name:ident, $features:literal, $ops:ident) => {
        /// `out[r] = dot(row r, x)` for the rows of `words` (`stride` words each, `k` elements
        /// of `format`: Q5_0, Q4_K or Q6_K); NaN for a row whose words do not fit the layout.
        ///
        /// # Safety
        ///
        /// The CPU has the features this is compiled with. (Shapes are checked here.)
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name(
            format: WeightFormat,
            words: &[u32],
            stride: usize,
            k: usize,
            x: &Q8Acts,
            out: &mut [f32],
        ) {
            use $ops::{fifth, u_dot};
            let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
            let xq: Vec<__m256i> = x
                .quant_blocks()
                .take(nb)
                .map(|q| {
                    // SAFETY: `q` is one block, 32 bytes (`chunks_exact(BLOCK)` of the lines).
                    debug_assert_eq!(q.len(), BLOCK);
                    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
                })
                .collect();
            if xq.len() < nb || x.d.len() < nb || x.s.len() < nb || stride == 0 {
                out.fill(f32::NAN);
                return;
            }
            for (o, row) in out.iter_mut().zip(words.chunks_exact(stride)) {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                let mut ok = true;
                for (b, ((&xv, &dx), &sx)) in xq.iter().zip(&x.d).zip(&x.s).enumerate() {
                    let f = |i: usize| row.get(i).map(|&w| f32::from_bits(w));
                    let step = match format {
                        WeightFormat::Q5_0 => (|| {
                            let q = row.get(2 * nb + 4 * b..2 * nb + 4 * b + 4)?;
                            // SAFETY: `q` holds 4 words, 16 bytes (a checked `get`, in every build).
                            debug_assert_eq!(q.len(), 4);
                            let q = unsafe { _mm_loadu_si128(q.as_ptr().cast()) };
                            // Elements 0..16 in the low nibbles, 16..32 in the high ones.
                            let nibbles = _mm256_and_si256(
                                _mm256_srlv_epi32(
                                    _mm256_broadcastsi128_si256(q),
                                    _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
                                ),
                                _mm256_set1_epi8(0x0f),
                            );
                            let q = _mm256_or_si256(nibbles, fifth(*row.get(nb + b)?));
                            let offset = u_dot(_mm256_set1_epi8(16), xv);
                            let sums = _mm256_sub_epi32(u_dot(q, xv), offset);
                            Some((_mm256_set1_ps(f(b)? * dx), sums, 0.0))
                        })(),
                        WeightFormat::Q4_K => (|| {
                            let s = b / 8;
                            let packed: [u8; 12] =
                                bytemuck::cast_slice::<u32, u8>(row.get(2 * ns + 3 * s..2 * ns + 3 * s + 3)?)
                                    .try_into()
                                    .ok()?;
                            let (sc, m) = crate::gguf::q4_k_scale_min(&packed, b % 8);
                            let q = _mm256_and_si256(
                                shr16(load256(row, 5 * ns + 8 * (b / 2))?, 4 * (b % 2)),
                                _mm256_set1_epi8(0x0f),
                            );
                            let scale = f(s)? * f32::from(sc);
                            let min = -(f(ns + s)? * f32::from(m));
                            Some((_mm256_set1_ps(scale * dx), u_dot(q, xv), min * sx))
                        })(),
                        _ => (|| {
                            let (s, c8) = (b / 8, b % 8);
                            let (h, c) = (c8 / 4, c8 % 4);
                            let lo = load256(row, 5 * ns + 32 * s + 16 * h + 8 * (c % 2))?;
                            let hi = load256(row, 37 * ns + 16 * s + 8 * h)?;
                            let q = _mm256_or_si256(
                                _mm256_and_si256(shr16(lo, 4 * (c / 2)), _mm256_set1_epi8(0x0f)),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(shr16(hi, 2 * c), _mm256_set1_epi8(3))),
                            );
                            let scales = bytemuck::cast_slice::<u32, u8>(row.get(ns + 4 * s..ns + 4 * s + 4)?);
                            let sc0 = f32::from(*scales.get(2 * c8)? as i8);
                            let sc1 = f32::from(*scales.get(2 * c8 + 1)? as i8);
                            let d = f(s)? * dx;
                            let (a, z) = (sc0 * d, sc1 * d);
                            let offset = u_dot(_mm256_set1_epi8(32), xv);
                            let sums = _mm256_sub_epi32(u_dot(q, xv), offset);
                            Some((_mm256_setr_ps(a, a, a, a, z, z, z, z), sums, 0.0))
                        })(),
                    };
                    let Some((scale, sums, min)) = step else {
                        ok = false;
                        break;
                    };
                    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc);
                    mins += min;
                }
                *o = if ok { hsum256(acc) + mins } else { f32::NAN };
            }
        }
    };
}

blocks256!(rows_avx512_vnni, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma", vnni512);
blocks256!(rows_avx2, "avx2,fma", avx2);
