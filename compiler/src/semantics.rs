//! The meaning of the ops' shared pieces: what the interpreter and both back ends compute the same
//! way (naga's `proc/`). BigBird's block pattern, T5's relative-position buckets, the norm rows,
//! RoPE's frequencies and rotation, ALiBi's slopes, the activation functions, where a fused
//! op's optional score operands sit, and an optimizer's update of one element (AdamW, SGD) with
//! the clipping factor it reads. The interpreter ([`crate::interp`]) evaluates with these
//! functions, the CPU engine's kernels call them, and the WGSL kernels restate them in WGSL
//! (each kernel's docs name the function it follows).
//!
//! **Architecture invariant**: this module reads the IR's types ([`crate::graph`]) and nothing
//! downstream of it; the IR never calls back into it or into the interpreter.

use crate::graph::{Activation, BlockPattern, Op, PairStyle, ScoreMods};

/// BigBird's block pattern over `blocks` blocks, row-major `[query block, key block]`: the first
/// `global` blocks attend to and are attended by every block; query block `i` attends key blocks
/// `i - window ..= i + window`; then each non-global query block draws `random` more among the
/// blocks it does not attend yet (in ascending order), by SplitMix64 with state `seed * 2^32 + i`:
/// per draw `state += 0x9E3779B97F4A7C15`, `z = (state ^ state >> 30) * 0xBF58476D1CE4E5B9`,
/// `z = (z ^ z >> 27) * 0x94D049BB133111EB`, `r = z ^ z >> 31` (all mod 2^64), taking and
/// removing `candidates[r % len]`.
pub fn block_pattern(blocks: usize, global: usize, window: usize, random: usize, seed: u64) -> Vec<bool> {
    (0..blocks).flat_map(|i| block_pattern_row(blocks, i, global, window, random, seed)).collect()
}

/// Row `i` of [`block_pattern`]: the key blocks query block `i` attends.
pub fn block_pattern_row(blocks: usize, i: usize, global: usize, window: usize, random: usize, seed: u64) -> Vec<bool> {
    let mut allowed: Vec<bool> = (0..blocks).map(|j| i < global || j < global || i.abs_diff(j) <= window).collect();
    if i < global {
        return allowed;
    }
    let mut candidates: Vec<usize> = allowed.iter().enumerate().filter(|&(_, &a)| !a).map(|(j, _)| j).collect();
    let mut state = seed.wrapping_mul(1 << 32).wrapping_add(i as u64);
    for _ in 0..random {
        if candidates.is_empty() {
            break;
        }
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let r = z ^ (z >> 31);
        let j = candidates.remove((r % candidates.len() as u64) as usize);
        if let Some(a) = allowed.get_mut(j) {
            *a = true;
        }
    }
    allowed
}

/// Key blocks query block `qb` of `blocks` attends under `p`, ascending (every block for a
/// global one): the true entries of [`block_pattern_row`].
pub fn attended_blocks(p: &BlockPattern, qb: usize, blocks: usize) -> Vec<usize> {
    let allowed = block_pattern_row(blocks, qb, p.global, p.window, p.random, p.seed);
    (0..blocks).filter(|&kb| allowed.get(kb).copied().unwrap_or(false)).collect()
}

/// The bucket of a key `rel` positions after its query (negative: before) in T5's relative
/// position bias (see [`Op::RelativeBias`]); always below `buckets`. The logarithm is computed in
/// f32, as the reference does.
pub fn relative_bucket(rel: i64, bidirectional: bool, buckets: usize, max_distance: usize) -> usize {
    let (n, offset, distance) = if bidirectional {
        let n = buckets / 2;
        (n, if rel > 0 { n } else { 0 }, rel.unsigned_abs())
    } else {
        (buckets, 0, (-rel.min(0)) as u64)
    };
    let max_exact = (n / 2).max(1) as u64;
    let bucket = if distance < max_exact {
        distance
    } else {
        let ratio =
            ((distance as f32) / max_exact as f32).ln() / ((max_distance as f64 / max_exact as f64).ln() as f32);
        let large = max_exact as f32 + ratio * (n as u64).saturating_sub(max_exact) as f32;
        (large as u64).min((n as u64).saturating_sub(1))
    };
    (offset + bucket as usize).min(buckets.saturating_sub(1))
}

/// A fused softmax's or attention's operands after its scores (or q, k, v): the key mask, if
/// any, then the relative position bias's table when `mods` has one.
pub fn score_operands<'a, T>(rest: &'a [T], mods: &ScoreMods) -> (Option<&'a T>, Option<&'a T>) {
    let (rest, table) = match (mods.relative, rest.split_last()) {
        (Some(_), Some((table, rest))) => (rest, Some(table)),
        _ => (rest, None),
    };
    (rest.first(), table)
}

/// LayerNorm of one row in place (statistics in f64): `(x - mean) / sqrt(var + eps) * gain +
/// bias`. The definition every engine's kernel uses.
pub fn layer_norm_row(row: &mut [f32], gain: &[f32], bias: Option<&[f32]>, eps: f32) {
    let d = row.len().max(1) as f64;
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d;
    let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for (j, (v, &g)) in row.iter_mut().zip(gain).enumerate() {
        *v = ((*v as f64 - mean) * inv) as f32 * g + bias.and_then(|b| b.get(j)).copied().unwrap_or(0.0);
    }
}

/// RMSNorm of one row in place (mean square in f64): `x / sqrt(mean(x^2) + eps) * gain`. The
/// definition every engine's kernel uses.
pub fn rms_norm_row(row: &mut [f32], gain: &[f32], eps: f32) {
    let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / row.len().max(1) as f64;
    let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
    for (v, &g) in row.iter_mut().zip(gain) {
        *v = *v * inv * g;
    }
}

/// RoPE frequencies as HF computes them: `inv_freq[i] = 1 / theta^(2i / rotary_dim)`, in f32.
pub fn rope_frequencies(theta: f32, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32)).collect()
}

/// Rotates the leading `2 * inv.len()` dimensions of one head at position `pos`.
#[expect(
    clippy::indexing_slicing,
    reason = "a head is at least `2 * inv.len()` wide: `inv` is `rope_frequencies` of a rotary width \
              that `graph::infer` bounds by the head width"
)]
pub fn rotate(head: &mut [f32], pos: f32, inv: &[f32], style: PairStyle) {
    let half = inv.len();
    for (i, &freq) in inv.iter().enumerate() {
        let angle = pos * freq;
        let (sin, cos) = (angle.sin(), angle.cos());
        let (i1, i2) = match style {
            PairStyle::RotateHalf => (i, i + half),
            PairStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let (x1, x2) = (head[i1], head[i2]);
        head[i1] = x1 * cos - x2 * sin;
        head[i2] = x2 * cos + x1 * sin;
    }
}

/// The activation functions, as their reference implementations define them.
pub fn activation(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Relu => x.max(0.0),
        Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x / std::f32::consts::SQRT_2)),
        Activation::GeluTanh => {
            let c = (2.0 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        Activation::Silu => x / (1.0 + (-x).exp()),
    }
}

/// The derivative of [`activation`] at `x`, computed in f64 from each function's closed form
/// ([`activation_derivative_f64`], GELU's `erf` in f32 as [`activation`] takes it).
pub fn activation_derivative(act: Activation, x: f32) -> f32 {
    let erf = |z: f64| f64::from(libm::erff(z as f32));
    activation_derivative_f64(act, f64::from(x), erf) as f32
}

/// The closed forms of the activations' derivatives in f64, with `erf` the error function GELU's
/// takes (f64's for the interpreter's f64 mode, f32's for [`activation_derivative`]).
pub fn activation_derivative_f64(act: Activation, x: f64, erf: impl Fn(f64) -> f64) -> f64 {
    match act {
        Activation::Relu => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::Gelu => {
            let phi = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2)) + x * phi
        }
        Activation::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = (c * (x + 0.044715 * x * x * x)).tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
        }
        Activation::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 + x * (1.0 - s))
        }
    }
}

/// ALiBi slopes for `heads` heads (Press et al.): a geometric sequence from `2^(-8/n)` for the
/// largest power of two `n <= heads`, then the odd terms of the sequence for `2n` for the rest.
pub fn alibi_slopes(heads: usize) -> Vec<f32> {
    let pow2 = 1usize << (usize::BITS - 1 - heads.max(1).leading_zeros());
    let base = 2f64.powf(-8.0 / pow2 as f64);
    let mut slopes: Vec<f32> = (1..=pow2).map(|i| base.powi(i as i32) as f32).collect();
    if pow2 < heads {
        let extra = 2f64.powf(-8.0 / (2 * pow2) as f64);
        slopes.extend((0..heads - pow2).map(|i| extra.powi((2 * i + 1) as i32) as f32));
    }
    slopes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alibi_slopes_match_the_paper() {
        assert_eq!(alibi_slopes(4), vec![0.25, 0.0625, 0.015625, 0.00390625]);
        let s = alibi_slopes(6);
        assert_eq!(s.len(), 6);
        assert!((s[4] - 2f32.powf(-1.0)).abs() < 1e-7, "{s:?}");
    }
}

/// The constants of one AdamW step of one tensor, each the f32 the update multiplies or adds
/// ([`adamw`]; [`crate::graph::Op::AdamW`] holds the step's own in an operand and the optimizer's
/// in attributes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// The clipping factor the gradient is read with (1 unclipped).
    pub scale: f32,
    /// `1 - lr * weight_decay`, or exactly 1 where the parameter takes no decay (`p * 1.0` is
    /// `p`, bit for bit, so no branch is needed).
    pub decay: f32,
    /// The first moment's interpolation weight, `1 - beta1`.
    pub w1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// `sqrt(1 - beta2^t)`, the second moment's bias correction.
    pub bc2_sqrt: f32,
    /// The denominator's epsilon.
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`.
    pub neg_step: f32,
}

/// `torch.lerp(start, end, weight)` as PyTorch's CPU kernel computes it — from whichever end is
/// nearer, so a weight near 1 loses no precision — for a weight below one half in magnitude (the
/// other form is [`lerp_far`]).
#[inline(always)]
pub fn lerp_near(start: f32, end: f32, weight: f32) -> f32 {
    start + weight * (end - start)
}

/// `torch.lerp` for a weight of magnitude one half or more.
#[inline(always)]
pub fn lerp_far(start: f32, end: f32, weight: f32) -> f32 {
    end - (end - start) * (1.0 - weight)
}

/// One element of an AdamW step, as `torch.optim.AdamW` (not fused, not `foreach`) computes it
/// in f32: `g *= scale; p *= decay; m = lerp(m, g, w1); v = v * b2 + w2 * g * g; p += neg_step *
/// m / (sqrt(v) / bc2_sqrt + eps)`, nothing contracted into a fused multiply-add. `lerp` is
/// [`lerp_near`] or [`lerp_far`] as `|w1| < 0.5` or not (callers choosing once per tensor keep
/// their loops branch-free). Returns the new `(p, m, v)`.
#[inline(always)]
pub fn adamw(c: AdamStep, lerp: impl Fn(f32, f32, f32) -> f32, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let g = g * c.scale;
    let p = p * c.decay;
    let m = lerp(m, g, c.w1);
    let v = v * c.b2 + c.w2 * g * g;
    let denom = v.sqrt() / c.bc2_sqrt + c.eps;
    (p + c.neg_step * m / denom, m, v)
}

/// The constants of one SGD step of one tensor, each the f32 the update uses ([`sgd`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// The clipping factor the gradient is read with (1 unclipped).
    pub scale: f32,
    /// The weight decay added to the gradient (`g += weight_decay * p`), `None` where the
    /// parameter takes none.
    pub weight_decay: Option<f32>,
    /// The momentum, `None` for plain SGD.
    pub momentum: Option<f32>,
    /// Whether this is the momentum buffer's first step (it starts as the gradient).
    pub first: bool,
    /// `-lr`.
    pub neg_lr: f32,
}

/// One element of an SGD step, as `torch.optim.SGD` (dampening 0, no Nesterov) computes it in f32:
/// `g *= scale; g += weight_decay * p; buf = first ? g : buf * momentum + g; g = buf;
/// p += neg_lr * g` (the decay and the buffer only where given). Returns the new `(p, buf)`
/// (`buf` as given without momentum).
#[inline(always)]
pub fn sgd(c: SgdStep, p: f32, g: f32, buf: f32) -> (f32, f32) {
    let mut g = g * c.scale;
    if let Some(wd) = c.weight_decay {
        g += wd * p;
    }
    let buf = match c.momentum {
        Some(_) if c.first => g,
        Some(momentum) => buf * momentum + g,
        None => buf,
    };
    if c.momentum.is_some() {
        g = buf;
    }
    (p + c.neg_lr * g, buf)
}

/// The per-element constants of an optimizer's update op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UpdateStep {
    /// [`Op::AdamW`]'s.
    AdamW(AdamStep),
    /// [`Op::Sgd`]'s.
    Sgd(SgdStep),
}

/// The per-element constants of the update `op` ([`Op::AdamW`] or [`Op::Sgd`]) at clipping
/// factor `scale` with the step's constants `step` (its last operand: AdamW's `(-lr / (1 -
/// beta1^t), sqrt(1 - beta2^t), 1 - lr * weight_decay)`, SGD's `(-lr, first)`). `None` for
/// another op, or constants of another length.
pub fn update_step(op: &Op, scale: f32, step: &[f32]) -> Option<UpdateStep> {
    Some(match (op, step) {
        (&Op::AdamW { w1, b2, w2, eps, decays }, &[neg_step, bc2_sqrt, decay]) => UpdateStep::AdamW(AdamStep {
            scale,
            decay: if decays { decay } else { 1.0 },
            w1: w1.0,
            b2: b2.0,
            w2: w2.0,
            bc2_sqrt,
            eps: eps.0,
            neg_step,
        }),
        (&Op::Sgd { momentum, weight_decay }, &[neg_lr, first]) => UpdateStep::Sgd(SgdStep {
            scale,
            weight_decay: (weight_decay.0 != 0.0).then_some(weight_decay.0),
            momentum: momentum.map(|m| m.0),
            first: first != 0.0,
            neg_lr,
        }),
        _ => return None,
    })
}

/// The factor a step reads its gradients with ([`crate::graph::Op::ClipScale`]), from its `loss`
/// and the gradients' squared norms `sums` (each tensor's, [`crate::graph::Op::SquareSums`]): as
/// `torch.nn.utils.clip_grad_norm_`, with the global norm `norm = sqrt(sum of sums)` (summed in
/// f64), `max_norm / (norm + 1e-6)` where that is below 1, else 1 (always 1 without
/// `max_norm`). NaN where the loss or the norm is not finite: a step the updates do not take.
pub fn step_scale(loss: f32, sums: &[f32], max_norm: Option<f32>) -> f32 {
    let norm = sums.iter().map(|&s| f64::from(s)).sum::<f64>().sqrt();
    if !norm.is_finite() || !loss.is_finite() {
        return f32::NAN;
    }
    match max_norm {
        Some(max) => {
            let coef = f64::from(max) / (norm + 1e-6);
            if coef < 1.0 { coef as f32 } else { 1.0 }
        }
        None => 1.0,
    }
}
