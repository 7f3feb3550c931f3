//! Gradients of the elementwise and row-wise nonlinearities: the activations, softmax, soft-cap,
//! and the masks a softmax reads (causal/window, block-sparse).

use super::{Grads, Rule, Site, add, ones_like, scale};
use crate::autodiff::AutodiffError;
use crate::graph::{Activation, Graph, Op, Scalar};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(act x) = dy * act'(x)
        Rule { op: "relu",      grad: act },
        Rule { op: "gelu",      grad: act },
        Rule { op: "gelu-tanh", grad: act },
        Rule { op: "silu",      grad: act },
        // d(softmax x) = y * (dy - sum(dy * y)) over the last axis
        Rule { op: "softmax",   grad: softmax },
        // d(c tanh(x / c)) = dy * (1 - (y / c)^2)
        Rule { op: "softcap",   grad: softcap },
        // d(mask x) = dy where kept, 0 where masked (the key mask has none)
        Rule { op: "mask",      grad: mask },
        // d(block_sparse_mask x) = dy where the pattern (and key mask) keeps, 0 elsewhere
        Rule { op: "block_sparse_mask", grad: mask },
    ]
}

fn act(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::Act(a) = *s.op else { return Err(s.unsupported("not an activation".into())) };
    Ok(vec![Some(add(g, Op::ActGrad(a), &[s.operand(0)?, s.dy])?)])
}

fn softmax(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    Ok(vec![Some(add(g, Op::SoftmaxGrad, &[s.output, s.dy])?)])
}

fn softcap(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::SoftCap { cap } = *s.op else { return Err(s.unsupported("not a soft-cap".into())) };
    let y = s.output;
    let y2 = add(g, Op::Mul, &[y, y])?;
    let minus = scale(g, y2, -1.0 / (cap.0 * cap.0))?;
    let slope = add(g, Op::Offset { value: Scalar(1.0) }, &[minus])?;
    Ok(vec![Some(add(g, Op::Mul, &[s.dy, slope])?)])
}

fn mask(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    // The same mask over ones: 1 where kept, the most negative float where masked; relu's
    // derivative there (1 above zero, else 0) gates `dy` exactly.
    let x = s.operand(0)?;
    let ones = ones_like(g, x)?;
    let mut operands = vec![ones];
    operands.extend(s.operands.get(1).copied());
    let masked = add(g, s.op.clone(), &operands)?;
    let dx = add(g, Op::ActGrad(Activation::Relu), &[masked, s.dy])?;
    Ok(vec![Some(dx), None])
}
