//! Gradients of the position ops: RoPE, ALiBi and T5's relative position bias.
//!
//! RoPE rotates each pair `(x1, x2)` by an angle `a`, `R(a) = [[c, -s], [s, c]]`; its transpose
//! is the rotation by `-a`, which equals `S R(a) S` with `S = diag(1, -1)`: the gradient is the
//! same RoPE applied between two sign flips of each pair's second element.

use super::{Grads, Rule, Site, add, scale, shape};
use crate::autodiff::AutodiffError;
use crate::graph::{Dim, Graph, NodeIndex, Op, PairStyle};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(rope x) = S rope(S dy), S negating each pair's second element
        Rule { op: "rope",  grad: rope },
        // d(x + alibi) = dy
        Rule { op: "alibi", grad: alibi },
        // d(relative_bias table)[r, h] = sum of dy[h, i, j] over the pairs (i, j) in bucket r
        Rule { op: "relative_bias", grad: relative_bias },
    ]
}

fn rope(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::Rope { rotary_dim, style, .. } = *s.op else { return Err(s.unsupported("not a rope".into())) };
    let flipped = flip(g, s, s.dy, rotary_dim, style)?;
    let rotated = add(g, s.op.clone(), &[flipped])?;
    Ok(vec![Some(flip(g, s, rotated, rotary_dim, style)?)])
}

/// `x [b, h, s, d]` with the second element of each rotated pair negated.
fn flip(g: &mut Graph, s: &Site, x: NodeIndex, r: usize, style: PairStyle) -> Result<NodeIndex, AutodiffError> {
    let x_shape = shape(g, x)?;
    let [b, h, sq, Dim::Fixed(d)] = x_shape.as_slice() else {
        return Err(s.unsupported("x is not [b, h, s, d] with a fixed d".into()));
    };
    let (b, h, sq, d) = (*b, *h, *sq, *d);
    let slice = |g: &mut Graph, x, axis, start, len| add(g, Op::Slice { axis, start, len }, &[x]);
    let rotated = if r < d { slice(g, x, 3, 0, r)? } else { x };
    let mut out = match style {
        PairStyle::RotateHalf => {
            let first = slice(g, rotated, 3, 0, r / 2)?;
            let second = slice(g, rotated, 3, r / 2, r / 2)?;
            let second = scale(g, second, -1.0)?;
            add(g, Op::Concat { axis: 3 }, &[first, second])?
        }
        PairStyle::Interleaved => {
            let pairs = add(g, Op::Reshape { shape: vec![b, h, sq, Dim::Fixed(r / 2), Dim::Fixed(2)] }, &[rotated])?;
            let first = slice(g, pairs, 4, 0, 1)?;
            let second = slice(g, pairs, 4, 1, 1)?;
            let second = scale(g, second, -1.0)?;
            let pairs = add(g, Op::Concat { axis: 4 }, &[first, second])?;
            add(g, Op::Reshape { shape: vec![b, h, sq, Dim::Fixed(r)] }, &[pairs])?
        }
    };
    if r < d {
        let rest = slice(g, x, 3, r, d - r)?;
        out = add(g, Op::Concat { axis: 3 }, &[out, rest])?;
    }
    Ok(out)
}

fn alibi(_: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    Ok(vec![Some(s.dy)])
}

fn relative_bias(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::RelativeBias { buckets, max_distance, bidirectional, .. } = *s.op else {
        return Err(s.unsupported("not a relative bias".into()));
    };
    let grad = Op::RelativeBiasGrad { buckets, max_distance, bidirectional };
    Ok(vec![Some(add(g, grad, &[s.operand(0)?, s.dy])?)])
}
