//! Gradients of the row norms over the last axis. With `r = 1 / sqrt(var + eps)` per row,
//! `xhat` the normalized row and `gx = dy * gain`:
//!
//! - rms_norm: `xhat = x r`, `dx = r (gx - xhat mean(gx xhat))`;
//! - layer_norm: `xhat = (x - mean x) r`, `dx = r (gx - mean(gx) - xhat mean(gx xhat))`;
//!
//! and for both `dgain = sum(dy xhat)`, `dbias = sum(dy)` over every axis but the last. `dx` is
//! one op, [`Op::NormGrad`], a pass over the rows (its meaning is the formula above), and
//! `dgain` another, [`Op::NormGainGrad`];
//!
//! - l2_normalize: `y = x / |x|`, `dx = (dy - y sum(dy y)) / |x|` (the `1e-12` floor of `|x|`
//!   is not differentiated: a row that small is taken at its true norm);
//! - mean_pool: `dx[b, s] = dy[b] m[b, s] / sum_s m[b, s]` (a row whose mask keeps nothing has
//!   no defined gradient: its division by zero shows as a non-finite value, never a silent zero).

use super::{Grads, Rule, Site, add, scale, shape, sum_last, sum_to};
use crate::autodiff::AutodiffError;
use crate::graph::{Dim, Graph, Op};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(x r g + b) = (r (gx - mean(gx) - xhat mean(gx xhat)), sum(dy xhat), sum(dy))
        Rule { op: "layer_norm", grad: norm },
        // d(x r g) = (r (gx - xhat mean(gx xhat)), sum(dy xhat))
        Rule { op: "rms_norm",   grad: norm },
        // d(x / |x|) = (dy - y sum(dy y)) / |x|
        Rule { op: "l2_normalize", grad: l2_normalize },
        // d(mean_pool(x, m)) = dy m / sum(m), the mask has none
        Rule { op: "mean_pool",  grad: mean_pool },
    ]
}

fn norm(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let (rms, eps) = match *s.op {
        Op::RmsNorm { eps } => (true, eps),
        Op::LayerNorm { eps } => (false, eps),
        _ => return Err(s.unsupported("not a norm".into())),
    };
    let (x, gain) = (s.operand(0)?, s.operand(1)?);
    let gain_shape = shape(g, gain)?;
    if !matches!(gain_shape.as_slice(), [Dim::Fixed(_)]) {
        return Err(s.unsupported("the gain is not a fixed [d]".into()));
    }
    let dx = match s.needs(0) {
        true => Some(add(g, Op::NormGrad { rms, eps }, &[x, gain, s.dy])?),
        false => None,
    };
    let dgain = match s.needs(1) {
        true => Some(add(g, Op::NormGainGrad { rms, eps }, &[x, s.dy])?),
        false => None,
    };
    let mut out = vec![dx, dgain];
    if s.operands.len() > 2 {
        out.push(if s.needs(2) { Some(sum_to(g, s.dy, &gain_shape)?) } else { None });
    }
    Ok(out)
}

fn l2_normalize(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let (x, y) = (s.operand(0)?, s.output);
    let sq = add(g, Op::Mul, &[x, x])?;
    let ss = sum_last(g, sq)?;
    let inv = add(g, Op::Rsqrt, &[ss])?;
    let dyy = add(g, Op::Mul, &[s.dy, y])?;
    let dot = sum_last(g, dyy)?;
    let proj = add(g, Op::Mul, &[y, dot])?;
    let minus = scale(g, proj, -1.0)?;
    let inner = add(g, Op::Add, &[s.dy, minus])?;
    Ok(vec![Some(add(g, Op::Mul, &[inner, inv])?)])
}

fn mean_pool(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let mask = s.operand(1)?;
    let x_shape = shape(g, s.operand(0)?)?;
    let [b, sq, d] = x_shape.as_slice() else { return Err(s.unsupported("x is not [b, s, d]".into())) };
    let (b, sq, d) = (*b, *sq, *d);
    // 1 / count as rsqrt(count)^2: the IR has no division.
    let count = add(g, Op::SumAxis { axis: 1 }, &[mask])?;
    let half = add(g, Op::Rsqrt, &[count])?;
    let inv = add(g, Op::Mul, &[half, half])?;
    let weights = add(g, Op::Mul, &[mask, inv])?;
    let weights = add(g, Op::Reshape { shape: vec![b, sq, Dim::Fixed(1)] }, &[weights])?;
    let dy = add(g, Op::Reshape { shape: vec![b, Dim::Fixed(1), d] }, &[s.dy])?;
    Ok(vec![Some(add(g, Op::Mul, &[weights, dy])?), None])
}
