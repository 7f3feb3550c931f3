//! Activations over whole rows, written so the compiler vectorizes them: `exp` by Cody–Waite range
//! reduction and a degree-6 polynomial, `tanh` and the logistic function from it, `erf` by a
//! rational approximation — all branch-free, so a row of a projection's epilogue runs in SIMD
//! lanes instead of one libm call per element. Each agrees with the interpreter's libm-based
//! [`kiln_compiler::semantics::activation`] to a few units in the last place of f32 (relative error
//! below 1e-6; `tests` below check every activation against it over a wide range), far inside the
//! engines' tolerance.
//!
//! The loops are compiled three times, for the baseline target, with AVX2 and FMA, and with
//! AVX-512 as well, and the widest the CPU has runs ([`super::isa`]). The loops built on `exp` —
//! [`apply`], [`gate`], [`backward`] and [`exp_shifted`] — also have AVX-512 forms written with
//! intrinsics (`avx512` below), for the instructions the compiler cannot reach from the portable
//! formulas (`vscalefps`, fused multiply-adds, `vrcp14ps`).

#[cfg(target_arch = "x86_64")]
use super::isa::isa;
use kiln_compiler::graph::Activation;

/// Where the exponentials are flushed to 0: below this, just above `ln(f32::MIN_POSITIVE)` =
/// -87.3365..., where their results stop being normal floats. Computing a subnormal result costs
/// a microcode assist on Intel cores (~150 cycles an element: a softmax row with masked keys at
/// -inf ran 20x slower on the Xeon of 2026-11-28), and a value below 1.2e-38 is nothing next to
/// the terms it is summed with or the tolerance it is compared within.
const EXP_MIN: f32 = -87.33;

/// `exp(x)` for f32, relative error below 2e-7 on the range where the result is a normal float;
/// 0 below it ([`EXP_MIN`]) and infinity above.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for the n that occur.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let c = x.clamp(EXP_MIN, 89.0);
    let n = (c * LOG2E).round_ties_even();
    let r = (c - n * LN2_HI) - n * LN2_LO;
    // exp(r) on |r| <= ln2 / 2: Taylor to degree 6 (error < 3e-8 relative).
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n as 2^h * 2^(n - h), h = floor(n / 2), so each factor is a normal float (n is in
    // [-126, 128], the halves in [-63, 64]); built from the exponent bits without a float-to-int
    // conversion, which would not vectorize.
    let h = (n * 0.5).floor();
    let (a, b) = (pow2(h), pow2(n - h));
    // A select, not a branch, so the loops still vectorize; below EXP_MIN the product (of the
    // clamped argument: normal) is dropped, never a subnormal formed. (False for NaN, kept.)
    if x < EXP_MIN { 0.0 } else { p * a * b }
}

/// `2^k` for an integer-valued `k` in [-126, 127]: adding 1.5 * 2^23 puts `k` in the low bits of
/// the sum, from which the exponent field is made with integer operations.
#[inline(always)]
fn pow2(k: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    let int = (k + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits());
    f32::from_bits(int.wrapping_add(127) << 23)
}

/// `tanh(x)`: `1 - 2 / (exp(2|x|) + 1)` with the sign of `x` (exact 1 for |x| > 10).
#[inline(always)]
fn tanh(x: f32) -> f32 {
    let a = x.abs();
    // Near 0 the subtraction loses relative precision: use the odd Taylor series there.
    let small = x * (1.0 - a * a * (1.0 / 3.0 - a * a * (2.0 / 15.0 - a * a * (17.0 / 315.0))));
    let big = 1.0 - 2.0 / (exp(2.0 * a.min(10.0)) + 1.0);
    if a < 0.0625 { small } else { big.copysign(x) }
}

/// `erf(x)` (Numerical Recipes' `erfc` Chebyshev fit, relative error below 1.2e-7).
#[inline(always)]
fn erf(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204 + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * exp(poly);
    (1.0 - erfc).copysign(x)
}

/// One activation, with the interpreter's formulas on these building blocks.
#[inline(always)]
fn act(a: Activation, x: f32) -> f32 {
    match a {
        Activation::Relu => x.max(0.0),
        Activation::Gelu => 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)),
        Activation::GeluTanh => {
            let c = (2.0 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)))
        }
        Activation::Silu => x / (1.0 + exp(-x)),
    }
}

/// The derivative of one activation at `x`: the interpreter's closed forms
/// ([`kiln_compiler::semantics::activation_derivative`]) on these building blocks. `tanh`'s
/// `1 - t^2` is computed as `4 s (1 - s)`, `s = 1 / (exp(2|u|) + 1)`, which keeps its precision
/// where `t` is near 1.
#[inline(always)]
fn derivative(a: Activation, x: f32) -> f32 {
    match a {
        Activation::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::Gelu => {
            let phi = exp(-0.5 * x * x) * (0.5 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2);
            0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)) + x * phi
        }
        Activation::GeluTanh => {
            // tanh(u) = 1 - 2 s and 1 - tanh(u)^2 = 4 s (1 - s), s = 1 / (exp(2|u|) + 1), from one
            // exp (the loop does not vectorize with two); near 0, the odd series of `tanh`.
            let c = (2.0 / std::f32::consts::PI).sqrt();
            let u = c * (x + 0.044715 * x * x * x);
            let a = u.abs();
            let s = 1.0 / (exp(2.0 * a.min(44.0)) + 1.0);
            let small = u * (1.0 - a * a * (1.0 / 3.0 - a * a * (2.0 / 15.0 - a * a * (17.0 / 315.0))));
            let (t, sech2) = if a < 0.0625 {
                (small, 1.0 - small * small)
            } else {
                ((1.0 - 2.0 * s).copysign(u), 4.0 * s * (1.0 - s))
            };
            0.5 * (1.0 + t) + 0.5 * x * sech2 * c * (1.0 + 3.0 * 0.044715 * x * x)
        }
        Activation::Silu => {
            let s = 1.0 / (1.0 + exp(-x));
            s * (1.0 + x * (1.0 - s))
        }
    }
}

#[inline(always)]
fn backward_with(d: impl Fn(f32) -> f32, x: &[f32], dy: &[f32], out: &mut [f32]) {
    // A `for` loop, not `for_each`: the body must be compiled inside the caller (with its target
    // features), and a large closure handed to `for_each` is not inlined there.
    for ((o, &x), &dy) in out.iter_mut().zip(x).zip(dy) {
        *o = dy * d(x);
    }
}

#[inline(always)]
fn backward_generic(a: Activation, x: &[f32], dy: &[f32], out: &mut [f32]) {
    // One loop per activation, so each body is branch-free and vectorizes.
    match a {
        Activation::Relu => backward_with(|x| derivative(Activation::Relu, x), x, dy, out),
        Activation::Gelu => backward_with(|x| derivative(Activation::Gelu, x), x, dy, out),
        Activation::GeluTanh => backward_with(|x| derivative(Activation::GeluTanh, x), x, dy, out),
        Activation::Silu => backward_with(|x| derivative(Activation::Silu, x), x, dy, out),
    }
}

#[inline(always)]
fn apply_with(f: impl Fn(f32) -> f32, xs: &mut [f32]) {
    // `for` loops, as in `backward_with`: a closure handed to `for_each` is not inlined into the
    // caller's target features.
    for x in xs {
        *x = f(*x);
    }
}

#[inline(always)]
fn apply_generic(a: Activation, xs: &mut [f32]) {
    // One loop per activation, so each body is branch-free and vectorizes.
    match a {
        Activation::Relu => apply_with(|x| act(Activation::Relu, x), xs),
        Activation::Gelu => apply_with(|x| act(Activation::Gelu, x), xs),
        Activation::GeluTanh => apply_with(|x| act(Activation::GeluTanh, x), xs),
        Activation::Silu => apply_with(|x| act(Activation::Silu, x), xs),
    }
}

#[inline(always)]
fn gate_with(f: impl Fn(f32) -> f32, gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = f(g) * u;
    }
}

#[inline(always)]
fn gate_generic(a: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match a {
        Activation::Relu => gate_with(|g| g.max(0.0), gate, up, out),
        Activation::Gelu => gate_with(|g| act(Activation::Gelu, g), gate, up, out),
        Activation::GeluTanh => gate_with(|g| act(Activation::GeluTanh, g), gate, up, out),
        Activation::Silu => gate_with(|g| act(Activation::Silu, g), gate, up, out),
    }
}

#[inline(always)]
fn exp_shifted_generic(xs: &mut [f32], max: f32) {
    apply_with(|x| exp(x - max), xs);
}

#[inline(always)]
fn softmax_rows_generic(rows: &mut [f32], width: usize) {
    // Three passes over the rows, so the exponentials run as one long loop rather than a short
    // one per row (each row's maximum, sum and normalization would wait on it).
    let width = width.max(1);
    for row in rows.chunks_mut(width) {
        // The maximum in eight lanes (a `fold` over `f32::max` does not vectorize).
        let mut lanes = [f32::NEG_INFINITY; 8];
        let chunks = row.chunks_exact(8);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (l, &x) in lanes.iter_mut().zip(chunk) {
                *l = l.max(x);
            }
        }
        let max = lanes.iter().chain(rest).copied().fold(f32::NEG_INFINITY, f32::max);
        apply_with(|x| x - max, row);
    }
    // (`exp_shifted` by 0: each row's maximum is already subtracted; the CPU's widest form.)
    exp_shifted(rows, 0.0);
    for row in rows.chunks_mut(width) {
        let inv = 1.0 / sum_f64(row, f64::from);
        for x in row {
            *x = (f64::from(*x) * inv) as f32;
        }
    }
}

/// Public entry points over a `*_generic` body, each compiled three times — for AVX-512, for
/// AVX2 with FMA, and for the baseline — and the widest the CPU has taken at run time ([`isa`]).
/// The body must be `#[inline(always)]`: a body the compiler keeps out of line is compiled once,
/// for the baseline, whichever entry calls it (the AdamW update ran at SSE2 width so).
macro_rules! dispatch {
    ($(#[$doc:meta])* fn $name:ident = $generic:ident($($arg:ident: $ty:ty),*);) => {
        dispatch! { $(#[$doc])* fn $name = $generic($($arg: $ty),*) -> (); }
    };
    ($(#[$doc:meta])* fn $name:ident = $generic:ident($($arg:ident: $ty:ty),*) -> $ret:ty;) => {
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $generic($($arg),*)
                }
                let isa = isa();
                if isa.avx512f && isa.avx2 {
                    // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked at run time just
                    // above); the callee is safe Rust over the slices it is given (iterators, no
                    // unchecked access): no bound to state.
                    return unsafe { avx512($($arg),*) };
                }
                if isa.avx2 {
                    // SAFETY: the CPU has AVX2 and FMA (checked just above); as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

dispatch! {
    /// [`backward`] without AVX-512's own form.
    fn backward_vectorized = backward_generic(a: Activation, x: &[f32], dy: &[f32], out: &mut [f32]);
}

/// `out[i] = dy[i] * a'(x[i])` (an activation's backward), over the shortest of the three.
pub fn backward(a: Activation, x: &[f32], dy: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: as in `apply`.
        return unsafe { avx512::backward(a, x, dy, out) };
    }
    backward_vectorized(a, x, dy, out);
}

dispatch! {
    /// [`apply`] without AVX-512's own form.
    fn apply_vectorized = apply_generic(a: Activation, xs: &mut [f32]);
}

dispatch! {
    /// [`gate`] without AVX-512's own form.
    fn gate_vectorized = gate_generic(a: Activation, gate: &[f32], up: &[f32], out: &mut [f32]);
}

dispatch! {
    /// [`exp_shifted`] without AVX-512's own form.
    fn exp_shifted_vectorized = exp_shifted_generic(xs: &mut [f32], max: f32);
}

/// `xs[i] = a(xs[i])`.
pub fn apply(a: Activation, xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: the CPU has AVX-512F (checked at run time); the callee reads and writes `xs`
        // within its length (whole vectors of its chunks, the rest under a mask).
        return unsafe { avx512::apply(a, xs) };
    }
    apply_vectorized(a, xs);
}

/// `out[i] = a(gate[i]) * up[i]` (a gated feed-forward's product), over the shortest of the
/// three.
pub fn gate(a: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: as in `apply`.
        return unsafe { avx512::gate(a, gate, up, out) };
    }
    gate_vectorized(a, gate, up, out);
}

/// `xs[i] = exp(xs[i] - max)` (a softmax's numerators).
pub fn exp_shifted(xs: &mut [f32], max: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: as in `apply`.
        return unsafe { avx512::exp_shifted(xs, max) };
    }
    exp_shifted_vectorized(xs, max);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! AVX-512 forms of the loops built on `exp`, with the instructions the portable forms cannot
    //! reach through the compiler: `exp`'s `2^n` by `vscalefps` (one instruction in place of two
    //! exponent-field constructions and two multiplies), the polynomials by fused multiply-adds,
    //! and the divisions of `erf`, `tanh` and the logistic function by a reciprocal estimate and
    //! one Newton step (`vrcp14ps`: a division is ~10 cycles a vector on one port). The formulas
    //! are the scalar ones above; the results agree with them to a few units in the last place
    //! (the tests hold both to the interpreter's libm).
    //!
    //! Each loop runs 16 lanes at a time and the last partial vector under a mask.

    use super::Activation;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn splat(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }

    /// `exp(x)` lanewise: the scalar `exp`'s reduction and polynomial, then `p * 2^n` by
    /// `vscalefps` (exact: the results are normal); 0 below [`EXP_MIN`](super::EXP_MIN), as
    /// the scalar `exp` gives; NaN stays NaN.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn exp(x: __m512) -> __m512 {
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        // Lanes at or above EXP_MIN, and NaN (unordered), which is kept.
        let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, splat(super::EXP_MIN));
        // The clamp with `x` second: `vmaxps`/`vminps` return their second operand for a NaN.
        let x = _mm512_min_ps(splat(89.0), _mm512_max_ps(splat(super::EXP_MIN), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            splat(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, splat(LN2_LO), _mm512_fnmadd_ps(n, splat(LN2_HI), x));
        let mut p = splat(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, splat(c));
        }
        _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n))
    }

    /// `1 / d` for `d` finite and at least 1: the 14-bit estimate refined by one Newton step
    /// (relative error below 1e-8).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn recip(d: __m512) -> __m512 {
        let r = _mm512_rcp14_ps(d);
        _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, splat(2.0)))
    }

    /// `|x|` and `x`'s sign bit.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn abs_sign(x: __m512) -> (__m512, __m512i) {
        let bits = _mm512_castps_si512(x);
        let sign = _mm512_and_si512(bits, _mm512_set1_epi32(i32::MIN));
        (_mm512_castsi512_ps(_mm512_andnot_si512(sign, bits)), sign)
    }

    /// `|v|` with the sign bit `sign`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn with_sign(v: __m512, sign: __m512i) -> __m512 {
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign))
    }

    /// `erf(x)`: the scalar `erf`'s fit, `|x|` taken at most 10 (where `erf` is 1 in f32), so
    /// the reciprocal's argument stays finite.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn erf(x: __m512) -> __m512 {
        let (z, sign) = abs_sign(x);
        let z = _mm512_min_ps(splat(10.0), z);
        let t = recip(_mm512_fmadd_ps(splat(0.5), z, splat(1.0)));
        let mut p = splat(0.170_872_77);
        for c in [
            -0.822_152_23,
            1.488_515_9,
            -1.135_204,
            0.278_868_07,
            -0.186_288_06,
            0.096_784_18,
            0.374_091_96,
            1.000_023_7,
        ] {
            p = _mm512_fmadd_ps(p, t, splat(c));
        }
        // -z^2 - 1.2655122 + t * p
        let poly = _mm512_fmadd_ps(t, p, _mm512_fnmadd_ps(z, z, splat(-1.265_512_2)));
        let erfc = _mm512_mul_ps(t, exp(poly));
        with_sign(_mm512_sub_ps(splat(1.0), erfc), sign)
    }

    /// `tanh(x)` near 0 (for `|x|` below 0.0625), by its odd series: `x (1 - x^2 (1/3 - x^2
    /// (2/15 - x^2 17/315)))`, `x2` being `x^2`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn tanh_series(x: __m512, x2: __m512) -> __m512 {
        let series = _mm512_fnmadd_ps(x2, splat(17.0 / 315.0), splat(2.0 / 15.0));
        let series = _mm512_fnmadd_ps(x2, series, splat(1.0 / 3.0));
        _mm512_mul_ps(x, _mm512_fnmadd_ps(x2, series, splat(1.0)))
    }

    /// `tanh(x)`: `1 - 2 / (exp(2|x|) + 1)` with `x`'s sign, the odd series below 0.0625.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn tanh(x: __m512) -> __m512 {
        let (a, sign) = abs_sign(x);
        let small = tanh_series(x, _mm512_mul_ps(a, a));
        let e = exp(_mm512_mul_ps(splat(2.0), _mm512_min_ps(splat(10.0), a)));
        let big = _mm512_fnmadd_ps(splat(2.0), recip(_mm512_add_ps(e, splat(1.0))), splat(1.0));
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, splat(0.0625));
        _mm512_mask_blend_ps(is_small, with_sign(big, sign), small)
    }

    /// The logistic `1 / (1 + exp(-x))`, from `e = exp(-|x|)` (in (0, 1], so `1 + e` is a safe
    /// reciprocal's argument): `1 / (1 + e)` for `x >= 0`, `e / (1 + e)` below.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn logistic(x: __m512) -> __m512 {
        let (a, _) = abs_sign(x);
        let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), a));
        let r = recip(_mm512_add_ps(e, splat(1.0)));
        let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
        _mm512_mask_mul_ps(r, negative, r, e)
    }

    /// `x / (1 + exp(-x))`, as `x` times the [`logistic`].
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn silu(x: __m512) -> __m512 {
        _mm512_mul_ps(x, logistic(x))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn gelu(x: __m512) -> __m512 {
        let e = erf(_mm512_mul_ps(x, splat(std::f32::consts::FRAC_1_SQRT_2)));
        _mm512_mul_ps(_mm512_mul_ps(splat(0.5), x), _mm512_add_ps(splat(1.0), e))
    }

    /// `sqrt(2 / pi)`, the tanh approximation's scale.
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn gelu_tanh(x: __m512) -> __m512 {
        let inner = _mm512_mul_ps(
            splat(SQRT_2_OVER_PI),
            _mm512_fmadd_ps(_mm512_mul_ps(splat(0.044715), x), _mm512_mul_ps(x, x), x),
        );
        _mm512_mul_ps(_mm512_mul_ps(splat(0.5), x), _mm512_add_ps(splat(1.0), tanh(inner)))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn relu(x: __m512) -> __m512 {
        // 0 second, so a NaN lane gives 0, as the scalar `x.max(0.0)` does.
        _mm512_max_ps(x, _mm512_setzero_ps())
    }

    /// The mask of the first `n < 16` lanes.
    #[inline]
    fn first(n: usize) -> __mmask16 {
        debug_assert!(n < 16);
        ((1u32 << n) - 1) as __mmask16
    }

    /// `xs[i] = f(xs[i])`, 16 lanes at a time, the rest under a mask (expanded in the caller,
    /// so `f` is compiled with its features).
    macro_rules! map {
        ($xs:expr, $f:expr) => {{
            let xs: &mut [f32] = $xs;
            let mut chunks = xs.chunks_exact_mut(16);
            for c in &mut chunks {
                // SAFETY: `c` is 16 floats.
                unsafe { _mm512_storeu_ps(c.as_mut_ptr(), $f(_mm512_loadu_ps(c.as_ptr()))) };
            }
            let rest = chunks.into_remainder();
            let m = first(rest.len());
            // SAFETY: the masked lanes are `rest`'s (fewer than 16).
            unsafe { _mm512_mask_storeu_ps(rest.as_mut_ptr(), m, $f(_mm512_maskz_loadu_ps(m, rest.as_ptr()))) };
        }};
    }

    /// [`super::apply`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn apply(a: Activation, xs: &mut [f32]) {
        match a {
            Activation::Relu => map!(xs, relu),
            Activation::Gelu => map!(xs, gelu),
            Activation::GeluTanh => map!(xs, gelu_tanh),
            Activation::Silu => map!(xs, silu),
        }
    }

    /// [`super::exp_shifted`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_shifted(xs: &mut [f32], max: f32) {
        let max = splat(max);
        map!(xs, |x| exp(_mm512_sub_ps(x, max)))
    }

    /// `out[i] = f(gate[i]) * up[i]` over the shortest of the three, as [`map!`] runs.
    macro_rules! gated {
        ($gate:expr, $up:expr, $out:expr, $f:expr) => {{
            let n = $out.len().min($gate.len()).min($up.len());
            let (gate, up, out): (&[f32], &[f32], &mut [f32]) = (&$gate[..n], &$up[..n], &mut $out[..n]);
            let mut at = 0;
            while at < n {
                let m = if n - at >= 16 { !0 } else { first(n - at) };
                // SAFETY: the lanes of `m` are elements `at..` below `n` of each slice.
                unsafe {
                    let g = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(at));
                    let u = _mm512_maskz_loadu_ps(m, up.as_ptr().add(at));
                    _mm512_mask_storeu_ps(out.as_mut_ptr().add(at), m, _mm512_mul_ps($f(g), u));
                }
                at += 16;
            }
        }};
    }

    /// [`super::gate`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gate(a: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
        match a {
            Activation::Relu => gated!(gate, up, out, relu),
            Activation::Gelu => gated!(gate, up, out, gelu),
            Activation::GeluTanh => gated!(gate, up, out, gelu_tanh),
            Activation::Silu => gated!(gate, up, out, silu),
        }
    }

    /// `gelu'(x)`: `0.5 (1 + erf(x / sqrt 2)) + x phi(x)`, `phi` the normal density.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn gelu_derivative(x: __m512) -> __m512 {
        const PHI: f32 = 0.5 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;
        let phi = _mm512_mul_ps(exp(_mm512_mul_ps(splat(-0.5), _mm512_mul_ps(x, x))), splat(PHI));
        let cdf = _mm512_mul_ps(
            splat(0.5),
            _mm512_add_ps(splat(1.0), erf(_mm512_mul_ps(x, splat(std::f32::consts::FRAC_1_SQRT_2)))),
        );
        _mm512_fmadd_ps(x, phi, cdf)
    }

    /// The tanh approximation's derivative, as the scalar `derivative` computes it: `tanh(u)` and
    /// `1 - tanh(u)^2` from `s = 1 / (exp(2|u|) + 1)`, the series below 0.0625.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn gelu_tanh_derivative(x: __m512) -> __m512 {
        let x2 = _mm512_mul_ps(x, x);
        let u = _mm512_mul_ps(splat(SQRT_2_OVER_PI), _mm512_fmadd_ps(_mm512_mul_ps(splat(0.044715), x), x2, x));
        let (a, sign) = abs_sign(u);
        let s = recip(_mm512_add_ps(exp(_mm512_mul_ps(splat(2.0), _mm512_min_ps(splat(44.0), a))), splat(1.0)));
        let small = tanh_series(u, _mm512_mul_ps(a, a));
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, splat(0.0625));
        let t = _mm512_mask_blend_ps(is_small, with_sign(_mm512_fnmadd_ps(splat(2.0), s, splat(1.0)), sign), small);
        let sech2 = _mm512_mask_blend_ps(
            is_small,
            _mm512_mul_ps(_mm512_mul_ps(splat(4.0), s), _mm512_sub_ps(splat(1.0), s)),
            _mm512_fnmadd_ps(small, small, splat(1.0)),
        );
        let slope = _mm512_mul_ps(splat(SQRT_2_OVER_PI), _mm512_fmadd_ps(splat(3.0 * 0.044715), x2, splat(1.0)));
        let half_x = _mm512_mul_ps(splat(0.5), x);
        _mm512_fmadd_ps(_mm512_mul_ps(half_x, sech2), slope, _mm512_mul_ps(splat(0.5), _mm512_add_ps(splat(1.0), t)))
    }

    /// `silu'(x) = s (1 + x (1 - s))`, `s` the [`logistic`].
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn silu_derivative(x: __m512) -> __m512 {
        let s = logistic(x);
        _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(splat(1.0), s), splat(1.0)))
    }

    /// `relu'(x)`: 1 above 0, else 0 (NaN included, as the scalar comparison gives).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn relu_derivative(x: __m512) -> __m512 {
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_setzero_ps());
        _mm512_maskz_mov_ps(positive, splat(1.0))
    }

    /// [`super::backward`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn backward(a: Activation, x: &[f32], dy: &[f32], out: &mut [f32]) {
        // `out = a'(x) * dy`: `gated!`'s loop with the derivative in the activation's place.
        match a {
            Activation::Relu => gated!(x, dy, out, relu_derivative),
            Activation::Gelu => gated!(x, dy, out, gelu_derivative),
            Activation::GeluTanh => gated!(x, dy, out, gelu_tanh_derivative),
            Activation::Silu => gated!(x, dy, out, silu_derivative),
        }
    }
}

dispatch! {
    /// A softmax over each row of `width` of `rows`, in place: each exponential less its row's
    /// maximum, normalized by their sum taken in f64 (in eight running sums, then added in
    /// order) — the interpreter's softmax up to the order of that sum and a multiplication by its
    /// reciprocal for the division (a unit in the last place of f32 at most).
    fn softmax_rows = softmax_rows_generic(rows: &mut [f32], width: usize);
}

pub use kiln_compiler::semantics::AdamStep;
use kiln_compiler::semantics::{lerp_far, lerp_near};

#[inline(always)]
fn adamw_generic(c: AdamStep, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    // One loop per form of the interpolation, chosen outside it, so each vectorizes. Each
    // element is `semantics::adamw`'s f32 arithmetic in its order: a vector `sqrt` and division
    // round as the scalar ones do, and nothing is contracted into an FMA.
    macro_rules! update {
        ($lerp:ident) => {
            for ((p, &g), (m, v)) in p.iter_mut().zip(g).zip(m.iter_mut().zip(v.iter_mut())) {
                (*p, *m, *v) = kiln_compiler::semantics::adamw(c, $lerp, *p, g, *m, *v);
            }
        };
    }
    if c.w1.abs() < 0.5 {
        update!(lerp_near);
    } else {
        update!(lerp_far);
    }
}

dispatch! {
    /// One AdamW step over a piece of a parameter `p`, its gradient `g` and moments `m`, `v`, in
    /// place, as `torch.optim.AdamW` (not fused, not `foreach`) computes each element:
    /// `g *= scale; p *= decay; m = lerp(m, g, 1 - b1); v = v * b2 + (1 - b2) * g * g;
    /// p += neg_step * m / (sqrt(v) / bc2_sqrt + eps)`.
    fn adamw = adamw_generic(c: AdamStep, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]);
}

#[inline(always)]
fn sum_squares_generic(xs: &[f32], scale: f32) -> f64 {
    sum_f64(xs, |x| f64::from(x * scale).powi(2))
}

dispatch! {
    /// The sum of `(x * scale)^2` over `xs`: each product in f32, squared and summed in f64 as
    /// [`sum_f64`] sums (a gradient's share of the global norm, as the update will read it).
    fn sum_squares = sum_squares_generic(xs: &[f32], scale: f32) -> f64;
}

/// The maximum of `xs` (NaNs ignored, as `f32::max` folds; negative infinity for none), in
/// sixteen running maxima, so the loop is vector maxima rather than a chain of dependent ones.
#[inline(always)]
pub fn max_f32(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = xs.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = m.max(x);
        }
    }
    lanes.iter().chain(rest).copied().fold(f32::NEG_INFINITY, f32::max)
}

#[inline(always)]
fn softmax_stats_generic(row: &[f32], exps: &mut [f32]) -> (f32, f64) {
    let max = max_f32(row);
    exps.copy_from_slice(row);
    exp_shifted(exps, max);
    (max, sum_f64(exps, f64::from))
}

dispatch! {
    /// A softmax row's statistics: its maximum, `exps[j] = exp(row[j] - max)`, and their sum in f64
    /// (as [`sum_f64`] sums); the row's log-sum-exp is `max + ln(sum)`.
    fn softmax_stats = softmax_stats_generic(row: &[f32], exps: &mut [f32]) -> (f32, f64);
}

#[inline(always)]
fn sum_row_generic(row: &[f32]) -> f64 {
    sum_f64(row, f64::from)
}

dispatch! {
    /// The sum of a row in f64 (as [`sum_f64`] sums).
    fn sum_row = sum_row_generic(row: &[f32]) -> f64;
}

#[inline(always)]
fn cross_entropy_grad_row_generic(o: &mut [f32], inv: f64, scale: f64, uniform: f64) {
    for o in o.iter_mut() {
        *o = (scale * (f64::from(*o) * inv - uniform)) as f32;
    }
}

dispatch! {
    /// A cross-entropy gradient row from its exponentials `o` (see [`softmax_stats`]), in place:
    /// `scale * (o * inv - uniform)`, each in f64 — the softmax less the smoothing's uniform
    /// target; the label's element is the caller's (its target has the label's share too).
    fn cross_entropy_grad_row = cross_entropy_grad_row_generic(o: &mut [f32], inv: f64, scale: f64, uniform: f64);
}

#[inline(always)]
fn norm_stats_generic(row: &[f32], rms: bool, eps: f64) -> (f64, f64) {
    let n = row.len().max(1) as f64;
    let mean = if rms { 0.0 } else { sum_f64(row, f64::from) / n };
    let var = sum_f64(row, |v| (f64::from(v) - mean).powi(2)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

dispatch! {
    /// A norm's row statistics in f64 (as [`sum_f64`] sums): its mean (0 for RMSNorm) and its
    /// reciprocal deviation `1 / sqrt(var + eps)`.
    fn norm_stats = norm_stats_generic(row: &[f32], rms: bool, eps: f64) -> (f64, f64);
}

#[inline(always)]
fn norm_grad_row_generic(o: &mut [f32], row: &[f32], dy: &[f32], gain: &[f32], rms: bool, eps: f64) {
    let n = row.len().max(1) as f64;
    let (mean, r) = norm_stats_generic(row, rms, eps);
    // `gx = dy * gain`, summed alone and times the normalized row, in eight running sums each
    // (as `sum_f64`).
    let (mut sg, mut sgx) = ([0.0f64; 8], [0.0f64; 8]);
    let lanes = row.chunks(8).zip(dy.chunks(8)).zip(gain.chunks(8));
    for ((row, dy), gain) in lanes {
        for ((((&v, &dy), &g), sg), sgx) in row.iter().zip(dy).zip(gain).zip(&mut sg).zip(&mut sgx) {
            let gx = f64::from(dy) * f64::from(g);
            *sg += gx;
            *sgx += gx * (f64::from(v) - mean) * r;
        }
    }
    let (sg, sgx) = (sg.iter().sum::<f64>(), sgx.iter().sum::<f64>());
    let (mg, mgx) = (if rms { 0.0 } else { sg / n }, sgx / n);
    for (((o, &v), &dy), &g) in o.iter_mut().zip(row).zip(dy).zip(gain) {
        let gx = f64::from(dy) * f64::from(g);
        *o = (r * (gx - mg - (f64::from(v) - mean) * r * mgx)) as f32;
    }
}

dispatch! {
    /// A norm's input gradient for one row, in f64 as the interpreter computes it: the row's
    /// statistics, the two means of `dy * gain`, then each element.
    fn norm_grad_row = norm_grad_row_generic(o: &mut [f32], row: &[f32], dy: &[f32], gain: &[f32], rms: bool, eps: f64);
}

#[inline(always)]
fn norm_gain_rows_generic(acc: &mut [f64], row: &[f32], dy: &[f32], mean: f64, r: f64) {
    for ((a, &v), &g) in acc.iter_mut().zip(row).zip(dy) {
        *a += f64::from(g) * (f64::from(v) - mean) * r;
    }
}

dispatch! {
    /// One row's share of a norm's gain gradient over a block of columns: `acc += dy * xhat`, in
    /// f64.
    fn norm_gain_row = norm_gain_rows_generic(acc: &mut [f64], row: &[f32], dy: &[f32], mean: f64, r: f64);
}

/// The dot product of `a` and `b` (over the shorter) in f64: eight running sums over the
/// elements in turn, as [`sum_f64`] sums, then the rest. A softmax's gradient takes its
/// `sum(y * dy)` so, as the interpreter does (`dy - sum` cancels under a sharp softmax).
#[inline(always)]
pub fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f64 = ac.remainder().iter().zip(bc.remainder()).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
    for (a, b) in ac.zip(bc) {
        for ((s, &a), &b) in lanes.iter_mut().zip(a).zip(b) {
            *s += f64::from(a) * f64::from(b);
        }
    }
    lanes.iter().sum::<f64>() + rest
}

#[inline(always)]
fn softmax_grad_row_generic(o: &mut [f32], y: &[f32], dy: &[f32]) {
    let dot = dot_f64(y, dy);
    for ((o, &y), &dy) in o.iter_mut().zip(y).zip(dy) {
        *o = (f64::from(y) * (f64::from(dy) - dot)) as f32;
    }
}

dispatch! {
    /// A softmax's input gradient for one row: `y * (dy - sum(y * dy))`, the dot in f64 (in eight
    /// running sums, as [`sum_f64`] sums).
    fn softmax_grad_row = softmax_grad_row_generic(o: &mut [f32], y: &[f32], dy: &[f32]);
}

/// The sum of `f(x)` over `xs`, in f64: eight running sums over the elements in turn (so the
/// additions overlap rather than each waiting on the one before), then added in order. The
/// interpreter sums in one running sum; the two differ in the last bits of an f64.
#[inline(always)]
pub fn sum_f64(xs: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut sums = [0.0f64; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (s, &x) in sums.iter_mut().zip(chunk) {
            *s += f(x);
        }
    }
    sums.iter().sum::<f64>() + rest.iter().map(|&x| f(x)).sum::<f64>()
}

#[inline(always)]
fn layer_norm_row_generic(row: &mut [f32], gain: &[f32], bias: Option<&[f32]>, eps: f32) {
    let (mean, inv) = norm_stats_generic(row, false, f64::from(eps));
    match bias {
        Some(bias) => {
            for ((v, &g), &b) in row.iter_mut().zip(gain).zip(bias) {
                *v = ((f64::from(*v) - mean) * inv) as f32 * g + b;
            }
        }
        None => {
            for (v, &g) in row.iter_mut().zip(gain) {
                *v = ((f64::from(*v) - mean) * inv) as f32 * g + 0.0;
            }
        }
    }
}

dispatch! {
    /// LayerNorm of one row in place: [`kiln_compiler::semantics::layer_norm_row`], its statistics
    /// summed as [`sum_f64`] sums.
    fn layer_norm_row = layer_norm_row_generic(row: &mut [f32], gain: &[f32], bias: Option<&[f32]>, eps: f32);
}

#[inline(always)]
fn rms_norm_row_generic(row: &mut [f32], gain: &[f32], eps: f32) {
    let inv = norm_stats_generic(row, true, f64::from(eps)).1 as f32;
    for (v, &g) in row.iter_mut().zip(gain) {
        *v = *v * inv * g;
    }
}

dispatch! {
    /// RMSNorm of one row in place: [`kiln_compiler::semantics::rms_norm_row`], its mean square
    /// summed as [`sum_f64`] sums.
    fn rms_norm_row = rms_norm_row_generic(row: &mut [f32], gain: &[f32], eps: f32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::semantics::activation;

    #[test]
    fn every_activation_matches_the_interpreter() {
        let xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 5e-4).chain([-120.0, -90.0, 90.0, 120.0]).collect();
        for a in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            let mut fast = xs.clone();
            apply(a, &mut fast);
            let mut generic = xs.clone();
            apply_generic(a, &mut generic);
            for ((&x, &f), &g) in xs.iter().zip(&fast).zip(&generic) {
                // Relative to max(1, |value|), as the engines' tolerances are.
                let want = activation(a, x);
                let scale = want.abs().max(1.0);
                assert!((f - want).abs() <= 1e-6 * scale, "{a:?}({x}) = {f}, interpreter {want}");
                assert!((g - want).abs() <= 1e-6 * scale, "{a:?}({x}) generic = {g}, interpreter {want}");
            }
            let (mut out, up) = (vec![0.0; xs.len()], vec![1.5f32; xs.len()]);
            gate(a, &xs, &up, &mut out);
            for (&x, &o) in xs.iter().zip(&out) {
                let want = activation(a, x) * 1.5;
                assert!((o - want).abs() <= 1e-6 * want.abs().max(1.0), "gate {a:?}({x}) = {o}, want {want}");
            }
        }
    }

    /// A softmax's numerators against libm, at every length's tail: relative error within the
    /// scalar `exp`'s bound where the result is normal, masked logits (-inf) and everything below
    /// [`EXP_MIN`] exactly 0, NaN kept; the same for the loop the CPU's widest form replaces.
    #[test]
    fn shifted_exponentials_match_libm() {
        let mut xs: Vec<f32> = (-2_000..=2_000).map(|i| i as f32 * 0.05).collect();
        xs.extend([f32::NEG_INFINITY, -200.0, 88.0, f32::NAN, 0.0]);
        for len in [xs.len(), 17, 16, 15, 1, 0] {
            for form in ["widest", "vectorized"] {
                let mut got = xs[..len].to_vec();
                match form {
                    "widest" => exp_shifted(&mut got, 1.5),
                    _ => exp_shifted_vectorized(&mut got, 1.5),
                }
                for (&x, &e) in xs.iter().zip(&got) {
                    let want = (x - 1.5).exp();
                    if want.is_nan() {
                        assert!(e.is_nan(), "{form}: exp({x} - 1.5) = {e}");
                    } else if want.is_infinite() {
                        assert_eq!(e, want, "{form}: exp({x} - 1.5)");
                    } else if x - 1.5 < EXP_MIN {
                        // Flushed: 0, never a subnormal.
                        assert_eq!(e, 0.0, "{form}: exp({x} - 1.5), libm {want}");
                    } else {
                        assert!((e - want).abs() <= 3e-7 * want, "{form}: exp({x} - 1.5) = {e}, libm {want}");
                    }
                }
            }
        }
    }

    /// NaN in, NaN out (ReLU's 0 aside, as `f32::max` gives), on every form.
    #[test]
    fn activations_keep_nan() {
        for a in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            let mut xs = vec![f32::NAN; 19];
            apply(a, &mut xs);
            assert!(xs.iter().all(|x| x.is_nan()), "{a:?}: {xs:?}");
            let mut out = vec![0.0; 19];
            gate(a, &[f32::NAN; 19], &[1.0; 19], &mut out);
            assert!(out.iter().all(|x| x.is_nan()), "gate {a:?}: {out:?}");
        }
    }

    #[test]
    fn every_derivative_matches_the_interpreter() {
        use kiln_compiler::semantics::activation_derivative;
        let xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 5e-4).chain([-120.0, -90.0, 90.0, 120.0]).collect();
        let dy: Vec<f32> = (0..xs.len()).map(|i| 1.0 - (i % 7) as f32 * 0.3).collect();
        for a in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            let (mut fast, mut generic) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
            backward(a, &xs, &dy, &mut fast);
            backward_generic(a, &xs, &dy, &mut generic);
            for (((&x, &d), &f), &g) in xs.iter().zip(&dy).zip(&fast).zip(&generic) {
                let want = d * activation_derivative(a, x);
                let scale = want.abs().max(1.0);
                assert!((f - want).abs() <= 1e-6 * scale, "{a:?}'({x}) * {d} = {f}, interpreter {want}");
                assert!((g - want).abs() <= 1e-6 * scale, "{a:?}'({x}) * {d} generic = {g}, interpreter {want}");
            }
        }
    }

    #[test]
    fn exp_and_tanh_at_the_edges() {
        for x in [-87.0f32, -10.0, -1.0, -1e-8, 0.0, 1e-8, 0.5, 1.0, 10.0, 88.0] {
            let (e, want) = (exp(x), x.exp());
            assert!((e - want).abs() <= 3e-7 * want.max(f32::MIN_POSITIVE), "exp({x}) = {e}, libm {want}");
            let (t, want) = (tanh(x), x.tanh());
            assert!((t - want).abs() <= 2e-7 * want.abs().max(1e-30) + 1e-30, "tanh({x}) = {t}, libm {want}");
        }
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(EXP_MIN - 1e-3), 0.0);
        assert!(exp(EXP_MIN) >= f32::MIN_POSITIVE);
        assert!(exp(200.0) > 1e38);
    }
}
