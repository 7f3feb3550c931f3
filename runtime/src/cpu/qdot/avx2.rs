//! The 256-bit x86-64 kernels, one block per step: AVX2 (`vpmaddubsw`, `vpmaddwd`) and AVX-VNNI
//! (`vpdpbusd`), one kernel (`kernel256!`) over two modules of integer steps.
//!
//! Inside a `#[target_feature]` function the register-only intrinsics of its features are safe;
//! the loads through raw pointers are not, and say why they hold.

use super::{Kernel, Q8Acts};
use crate::cpu::isa::x86::{hsum256, prefetch};

/// The integer steps of the 256-bit AVX2 kernel.
mod avx2_ops {
    use std::arch::x86_64::*;

    /// Per activation block work for Q8_0 (none).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn q8_prep(_x: __m256i) -> __m256i {
        _mm256_setzero_si256()
    }

    /// The 8 lane sums of 4 products of signed `w` and `x` bytes (`x` within ±127).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn q8_dot(w: __m256i, x: __m256i, _prep: __m256i) -> __m256i {
        // |w| (unsigned, so -128 is 128) times x with w's sign: pairs reach 2 * 128 * 127 < 2^15.
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    /// A Q4_1 block's quants in element order from its 16 bytes in both halves: the low
    /// nibbles (elements 0..16) from the low half, the high ones (16..32) shifted down by 4.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn nibbles(w: __m256i) -> __m256i {
        _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f))
    }

    /// What the lanes of [`nibbles`]' sums are multiplied by at the end (nothing).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn unscale() -> __m256 {
        _mm256_set1_ps(1.0)
    }

    /// The 8 lane sums of 4 products of unsigned `q` (nibbles) and signed `x` bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn u_dot(q: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
    }
}

/// The integer steps of the 256-bit AVX-VNNI kernel.
mod vnni_ops {
    use std::arch::x86_64::*;

    /// `-128 * (sum of each lane's 4 x bytes)`: the start that undoes Q8_0's offset.
    #[target_feature(enable = "avx2,avxvnni")]
    #[inline]
    pub(super) fn q8_prep(x: __m256i) -> __m256i {
        let zero = _mm256_setzero_si256();
        _mm256_sub_epi32(zero, _mm256_dpbusd_avx_epi32(zero, _mm256_set1_epi8(-128), x))
    }

    /// The lane sums of signed `w` times `x`, as `(w + 128) * x` added to `prep`.
    #[target_feature(enable = "avx2,avxvnni")]
    #[inline]
    pub(super) fn q8_dot(w: __m256i, x: __m256i, prep: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(prep, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), x)
    }

    /// A Q4_1 block's quants from its 16 bytes in both halves: the low nibbles, and the high
    /// nibbles left in place (16 times the quant, which `vpdpbusd` sums without saturating;
    /// [`unscale`] divides those lanes' sums back).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn nibbles(w: __m256i) -> __m256i {
        let (lo, hi) = (0x0f0f_0f0f, 0xf0f0_f0f0_u32 as i32);
        _mm256_and_si256(w, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi))
    }

    /// 1/16 for the lanes of the high nibbles (exact: a power of two).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn unscale() -> __m256 {
        _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, 0.0625, 0.0625, 0.0625, 0.0625)
    }

    /// The lane sums of unsigned `q` times signed `x`.
    #[target_feature(enable = "avx2,avxvnni")]
    #[inline]
    pub(super) fn u_dot(q: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x)
    }
}

/// The 256-bit kernels (one block per step) over a module of integer steps (`$ops`).
macro_rules! kernel256 {
    ($kernel:ident, $module:ident, $features:literal, $ops:ident) => {
        mod $module {
            use super::super::Q8Acts;
            use super::$ops as ops;
            use super::{hsum256, prefetch};
            use std::arch::x86_64::*;

            /// Q8_0 (`Q4 = false`) or Q4_1 rows: see [`super::super::Kernel`] for the contract.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn tile<const R: usize, const Q4: bool>(
                rows: [*const u32; R],
                nb: usize,
                x: &Q8Acts,
                ahead: usize,
            ) -> [f32; R] {
                let xq = x.q.as_ptr().cast::<__m256i>();
                let mut acc = [_mm256_setzero_ps(); R];
                // Where a row's quants start, and their words a block.
                let (quants, words) = if Q4 { (2 * nb, 4) } else { (nb, 8) };
                for (b, &dx) in x.d.iter().enumerate().take(nb) {
                    // SAFETY: block `b < nb` of `x.q`, which holds at least `nb.div_ceil(2)`
                    // lines of two 32-byte blocks (the contract, asserted in `tile`); each
                    // block is 32-byte aligned (`Line` is 64-byte aligned).
                    let xv = unsafe { _mm256_load_si256(xq.add(b)) };
                    let dx = _mm256_set1_ps(dx);
                    let prep = if Q4 { _mm256_setzero_si256() } else { ops::q8_prep(xv) };
                    for (a, &row) in acc.iter_mut().zip(&rows) {
                        if b % 16 == 0 {
                            prefetch(row.wrapping_add(b + ahead));
                            if Q4 {
                                prefetch(row.wrapping_add(nb + b + ahead));
                            }
                        }
                        prefetch(row.wrapping_add(quants + words * b + ahead));
                        // SAFETY: a row holds `nb` scales (word `b < nb`), Q4_1's `nb` minimums,
                        // then `words` quant words a block: words `quants + words b ..
                        // quants + words (b + 1)`, at most `9 nb` (Q8_0: `nb + 8 nb`) or `6 nb`
                        // (Q4_1: `2 nb + 4 nb`), the row's words (the contract; each row's span
                        // asserted in `tile`).
                        let (dw, w) = unsafe { (row.add(b).read(), row.add(quants + words * b)) };
                        let sums = if Q4 {
                            // SAFETY: as just above (4 words).
                            let w = unsafe { _mm_loadu_si128(w.cast()) };
                            ops::u_dot(ops::nibbles(_mm256_broadcastsi128_si256(w)), xv)
                        } else {
                            // SAFETY: as just above (8 words).
                            ops::q8_dot(unsafe { _mm256_loadu_si256(w.cast()) }, xv, prep)
                        };
                        let scale = _mm256_mul_ps(_mm256_set1_ps(f32::from_bits(dw)), dx);
                        *a = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), *a);
                    }
                }
                let mut out = [0f32; R];
                if !Q4 {
                    for (o, a) in out.iter_mut().zip(acc) {
                        *o = hsum256(a);
                    }
                    return out;
                }
                // The minimums' term, `sum_b m_w[b] * s_x[b]`, 8 blocks at a time.
                let whole = nb - nb % 8;
                let sx = x.s.as_ptr();
                let unscale = ops::unscale();
                for ((o, a), &row) in out.iter_mut().zip(acc).zip(&rows) {
                    let mins = row.wrapping_add(nb).cast::<f32>();
                    let mut m = _mm256_setzero_ps();
                    for b in (0..whole).step_by(8) {
                        // SAFETY: `b + 8 <= nb`: minimums `nb + b .. nb + b + 8` of the row's
                        // `nb` (words `nb .. 2 nb`), and 8 of `x`'s `nb` sums (the contract,
                        // asserted in `tile`).
                        let (mw, s) = unsafe { (_mm256_loadu_ps(mins.add(b)), _mm256_loadu_ps(sx.add(b))) };
                        m = _mm256_fmadd_ps(mw, s, m);
                    }
                    let mut tail = 0f32;
                    for b in whole..nb {
                        // SAFETY: `b < nb`: minimum `b` and sum `b`, as above.
                        tail += unsafe { mins.add(b).read() * sx.add(b).read() };
                    }
                    *o = hsum256(_mm256_fmadd_ps(a, unscale, m)) + tail;
                }
                out
            }
        }

        /// A 256-bit kernel.
        pub(super) struct $kernel;

        impl Kernel for $kernel {
            unsafe fn tile<const R: usize, const Q4: bool>(
                rows: [*const u32; R],
                nb: usize,
                x: &Q8Acts,
                ahead: usize,
            ) -> [f32; R] {
                // SAFETY: the trait's contract, which includes the features.
                unsafe { $module::tile::<R, Q4>(rows, nb, x, ahead) }
            }
        }
    };
}

kernel256!(Avx2, avx2, "avx2,fma", avx2_ops);
kernel256!(AvxVnni, avx_vnni, "avx2,fma,avxvnni", vnni_ops);
