//! Gradients of a mixture of experts' routing: the top-k selection of router probabilities.
//!
//! The selection is piecewise constant in its input (no gradient flows into *which* entries are
//! kept); the kept values pass through, and with renormalization through the division by their
//! sum: with `m` the indicator of the kept entries, `S = sum(m x)` and `y = m x / S`,
//! `dy_i / dx_j = m_i (delta_ij / S - x_i m_j / S^2)`, so `dx = m (dy - sum(dy y)) / S`.

use super::{Grads, Rule, Site, add};
use crate::autodiff::AutodiffError;
use crate::graph::{Graph, Op};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(top_k x) = m dy, or renormalized m (dy - sum(dy y)) / sum(m x); m the kept entries
        Rule { op: "top_k", grad: top_k },
    ]
}

fn top_k(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::TopK { k, renormalize } = *s.op else { return Err(s.unsupported("not a top_k".into())) };
    Ok(vec![Some(add(g, Op::TopKGrad { k, renormalize }, &[s.operand(0)?, s.dy])?)])
}
