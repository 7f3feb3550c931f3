//! Gradients of the training losses: the cross-entropy of scores against labels.

use super::{Grads, Rule, Site, add};
use crate::autodiff::AutodiffError;
use crate::graph::{Graph, Op};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(cross_entropy x) = dy * (softmax(x) - target) / counted at counted positions, 0 at
        // ignored ones; labels are not differentiable
        Rule { op: "cross_entropy", grad: cross_entropy },
    ]
}

fn cross_entropy(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::CrossEntropy { smoothing, ignore_index } = *s.op else {
        return Err(s.unsupported("not a cross-entropy".into()));
    };
    let grad = Op::CrossEntropyGrad { smoothing, ignore_index };
    Ok(vec![Some(add(g, grad, &[s.operand(0)?, s.operand(1)?, s.dy])?), None])
}
