//! Gradients of the elementwise and row-wise nonlinearities: the activations, softmax, soft-cap,
//! and the masks a softmax reads (causal/window, block-sparse).

use super::{Grads, Rule, Site, add, node, ones_like, scale};
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

/// Whether `s.dy` is a softmax's gradient (and nothing else) taken at the softmax of `s`'s output.
fn feeds_only_softmax_grad(g: &Graph, s: &Site) -> Result<bool, AutodiffError> {
    let dy = node(g, s.dy)?;
    if !matches!(dy.op, Op::SoftmaxGrad) {
        return Ok(false);
    }
    let Some(&y) = g.operands(s.dy).first() else { return Ok(false) };
    let softmax_of_output = matches!(node(g, y)?.op, Op::Softmax) && g.operands(y).first() == Some(&s.output);
    Ok(softmax_of_output)
}

fn mask(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    // A causal or window mask without a key mask keeps every row's own position, so the softmax
    // reading it puts exactly 0 at each masked key (`exp` of the most negative float underflows),
    // and its gradient `y * (dy - sum(dy * y))` is 0 there too: when that gradient is all `dy`
    // holds, the gate below would change nothing, and `dy` is the gradient.
    if matches!(s.op, Op::Mask { .. }) && s.operands.len() == 1 && feeds_only_softmax_grad(g, s)? {
        return Ok(vec![Some(s.dy), None]);
    }
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
