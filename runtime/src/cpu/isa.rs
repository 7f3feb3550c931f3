//! The SIMD instruction sets of this CPU: the one detector every CPU kernel consults, run once.
//!
//! The kernels are compiled for several instruction sets (`#[target_feature]` functions) and pick
//! one at run time; [`isa`] is where they learn what the CPU (and the OS, which must save the wider
//! registers) offers. Each kernel family lists its implementations as an [`Implementation`]
//! ([`super::qdot::Impl`], [`super::qdot_f32::Impl`]); the vectorized loops of [`super::math`] and
//! [`super::attention`] run their AVX2 build where [`Isa::avx2`] holds.
//!
//! Also here, the register-level helpers that kernels of different families share (`x86`,
//! `arm`).

use std::sync::OnceLock;

/// The instruction sets the CPU kernels can use, as detected on this machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Isa {
    /// x86-64 AVX2 and FMA.
    pub avx2: bool,
    /// x86-64 AVX-512F.
    pub avx512f: bool,
    /// x86-64 AVX-512 with byte and word operations, 256-bit forms and VNNI (F, BW, VL, VNNI).
    pub avx512_vnni: bool,
    /// x86-64 AVX-VNNI (the 256-bit `vpdpbusd` without AVX-512).
    pub avx_vnni: bool,
    /// AArch64 NEON.
    pub neon: bool,
    /// AArch64's dot-product extension (`sdot`; Armv8.2's `dotprod`).
    pub dotprod: bool,
    /// AArch64's int8 matrix-multiply extension (`usdot`, `smmla`; Armv8.6's `i8mm`).
    pub i8mm: bool,
}

impl Isa {
    /// Asks the CPU (see [`isa`] for the cached answer).
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Isa {
                avx2: has!("avx2") && has!("fma"),
                avx512f: has!("avx512f"),
                avx512_vnni: has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni"),
                avx_vnni: has!("avxvnni"),
                neon: false,
                dotprod: false,
                i8mm: false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected as has;
            let neon = has!("neon");
            Isa { neon, dotprod: neon && has!("dotprod"), i8mm: neon && has!("i8mm"), ..Isa::default() }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            Isa::default()
        }
    }
}

/// The environment variable that caps the instruction sets the kernels use (see [`Cap`]).
pub const CAP_VAR: &str = "KILN_CPU_ISA";

/// A ceiling on the instruction sets the kernels use, below what the CPU has: to measure (or
/// reproduce) on one machine what a CPU with fewer of them runs. It only ever removes sets the
/// CPU has; it never claims one it lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cap {
    /// Everything the CPU has (the default).
    Native,
    /// AVX2 and FMA, and AVX-VNNI (no AVX-512).
    AvxVnni,
    /// AVX2 and FMA alone.
    Avx2,
    /// AArch64 NEON and the dot-product extension (no int8 matrix multiplies).
    NeonDotprod,
    /// AArch64 NEON alone.
    Neon,
    /// None: the portable kernels.
    Scalar,
}

impl Cap {
    /// The names [`CAP_VAR`] takes.
    pub const NAMES: &str = "native, avx-vnni, avx2, neon-dotprod, neon, scalar";

    /// The cap a name gives ([`Cap::NAMES`]), `None` for another.
    pub fn parse(name: &str) -> Option<Cap> {
        Some(match name {
            "native" | "" => Cap::Native,
            "avx-vnni" => Cap::AvxVnni,
            "avx2" => Cap::Avx2,
            "neon-dotprod" => Cap::NeonDotprod,
            "neon" => Cap::Neon,
            "scalar" => Cap::Scalar,
            _ => return None,
        })
    }

    /// The cap [`CAP_VAR`] sets: `Native` when unset, an error naming the variable and the
    /// names it takes for any other value.
    pub fn from_env() -> Result<Cap, String> {
        match std::env::var(CAP_VAR) {
            Err(_) => Ok(Cap::Native),
            Ok(v) => Cap::parse(&v).ok_or_else(|| format!("{CAP_VAR}={v}: expected one of {}", Cap::NAMES)),
        }
    }

    /// `isa` with the sets above this cap removed.
    pub fn apply(self, isa: Isa) -> Isa {
        match self {
            Cap::Native => isa,
            Cap::AvxVnni => Isa { avx512f: false, avx512_vnni: false, ..isa },
            Cap::Avx2 => Isa { avx512f: false, avx512_vnni: false, avx_vnni: false, ..isa },
            Cap::NeonDotprod => Isa { i8mm: false, ..isa },
            Cap::Neon => Isa { dotprod: false, i8mm: false, ..isa },
            Cap::Scalar => Isa::default(),
        }
    }
}

/// The instruction sets the kernels use: this CPU's, detected on the first call, under the cap
/// [`CAP_VAR`] sets (an unrecognized value caps nothing here; the CLI refuses it when it opens
/// the CPU device).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| Cap::from_env().unwrap_or(Cap::Native).apply(Isa::detect()))
}

/// The implementations of a kernel family, each for the instruction sets it was compiled for.
pub trait Implementation: Copy + 'static {
    /// Every implementation, the preferred first.
    const ALL: &'static [Self];
    /// The portable one, which runs everywhere (the reference the others are tested against).
    const PORTABLE: Self;

    /// Its name in reports (`"avx512"`, `"scalar"`, ...).
    fn name(self) -> &'static str;

    /// Whether it runs on a CPU with `isa`.
    fn runs_on(self, isa: Isa) -> bool;

    /// Whether this machine (CPU and OS) can run it.
    fn is_available(self) -> bool {
        self.runs_on(isa())
    }

    /// The implementations this machine can run, the preferred first ([`Self::PORTABLE`] last).
    fn available() -> Vec<Self> {
        Self::ALL.iter().copied().filter(|i| i.is_available()).collect()
    }

    /// The preferred implementation this machine can run: the one the family's entry points use.
    fn best() -> Self {
        Self::ALL.iter().copied().find(|i| i.is_available()).unwrap_or(Self::PORTABLE)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    //! Helpers the x86-64 kernels of both quantized families share.

    use std::arch::x86_64::*;

    /// Asks for the cache line holding `p` (a hint: `p` need not point into anything).
    #[target_feature(enable = "sse")]
    #[inline]
    pub(in super::super) fn prefetch(p: *const u32) {
        // Into L2, not L1 (`T0`): a streaming kernel's prefetches then do not hold L1's few
        // outstanding-miss slots, so more lines are in flight. On the AMD EPYC (Zen 4) of
        // 2026-11-27 this took the 262144 x 640 Q8_0 GEMV of Gemma 3's head from 17 to 36 GB/s
        // with int8 activations (the memory's limit) and to 24-26 GB/s with f32 ones, and Gemma
        // 3 270M's decode from 44-47 to 54-58 tok/s (see BENCHMARKS.md).
        _mm_prefetch::<_MM_HINT_T1>(p.cast());
    }

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in super::super) fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

#[cfg(target_arch = "aarch64")]
pub(super) mod arm {
    //! Helpers the AArch64 kernels of both quantized families share.

    use std::arch::aarch64::*;

    /// Each byte of `v` shifted right by `n` (a negative left shift).
    #[target_feature(enable = "neon")]
    #[inline]
    pub(in super::super) fn shr(v: uint8x16_t, n: usize) -> uint8x16_t {
        vshlq_u8(v, vdupq_n_s8(-(n as i8)))
    }

    /// Byte `i` 0x10 where bit `i` of the 16 `bits` is set, else 0 (Q5_0's fifth bits in
    /// place): the two bytes of `bits` spread over 8 lanes each, each lane testing its own bit.
    #[target_feature(enable = "neon")]
    #[inline]
    pub(in super::super) fn fifths(bits: u32) -> uint8x16_t {
        let bytes = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
        let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
        vandq_u8(vtstq_u8(bytes, bit), vdupq_n_u8(0x10))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cap only removes sets, and every name parses to the cap it says.
    #[test]
    fn caps_remove_sets_and_never_add_them() {
        let all = Isa {
            avx2: true,
            avx512f: true,
            avx512_vnni: true,
            avx_vnni: true,
            neon: false,
            dotprod: false,
            i8mm: false,
        };
        assert_eq!(Cap::parse("native").map(|c| c.apply(all)), Some(all));
        assert_eq!(Cap::parse("avx2").map(|c| c.apply(all)), Some(Isa { avx2: true, ..Isa::default() }));
        assert_eq!(
            Cap::parse("avx-vnni").map(|c| c.apply(all)),
            Some(Isa { avx2: true, avx_vnni: true, ..Isa::default() })
        );
        assert_eq!(Cap::parse("scalar").map(|c| c.apply(all)), Some(Isa::default()));
        let arm = Isa { neon: true, dotprod: true, i8mm: true, ..Isa::default() };
        assert_eq!(Cap::parse("neon").map(|c| c.apply(arm)), Some(Isa { neon: true, ..Isa::default() }));
        assert_eq!(
            Cap::parse("neon-dotprod").map(|c| c.apply(arm)),
            Some(Isa { neon: true, dotprod: true, ..Isa::default() })
        );
        assert_eq!(Cap::parse("avx2").map(|c| c.apply(arm)), Some(arm), "an x86 cap leaves AArch64's sets");
        assert_eq!(Cap::parse("avx512"), None);
        let none = Isa::default();
        for cap in [Cap::Native, Cap::AvxVnni, Cap::Avx2, Cap::NeonDotprod, Cap::Neon, Cap::Scalar] {
            assert_eq!(cap.apply(none), none, "{cap:?} adds nothing");
        }
        assert!(Cap::NAMES.split(", ").all(|n| Cap::parse(n).is_some()));
    }
}
