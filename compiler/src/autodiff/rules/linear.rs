//! Gradients of the linear ops: matmul (both layouts), add and mul with numpy broadcasting,
//! scale, offset and the axis sum.

use super::{Grads, Rule, Site, add, scale, shape, sum_to, transpose, zeros_like};
use crate::autodiff::AutodiffError;
use crate::graph::{Graph, NodeIndex, Op};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(a @ b) = (dy @ b^T, a^T @ dy), b's summed over the batch when it is shared
        Rule { op: "matmul",   grad: matmul },
        // d(a @ b^T) = (dy @ b, dy^T @ a)
        Rule { op: "matmul_t", grad: matmul },
        // d(a + b) = (dy, dy), each summed over its broadcast axes
        Rule { op: "add",      grad: add_rule },
        // d(a * b) = (dy * b, dy * a), each summed over its broadcast axes
        Rule { op: "mul",      grad: mul },
        // d(x * c) = dy * c
        Rule { op: "scale",    grad: scale_rule },
        // d(x + c) = dy
        Rule { op: "offset",   grad: offset },
        // d(sum_axis x) = dy broadcast back over the axis
        Rule { op: "sum_axis", grad: sum_axis },
    ]
}

fn matmul(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::MatMul { transpose_b } = *s.op else { return Err(s.unsupported("not a matmul".into())) };
    let (a, b) = (s.operand(0)?, s.operand(1)?);
    let da = match (s.needs(0), transpose_b) {
        (false, _) => None,
        (true, false) => Some(add(g, Op::MatMul { transpose_b: true }, &[s.dy, b])?),
        (true, true) => Some(add(g, Op::MatMul { transpose_b: false }, &[s.dy, b])?),
    };
    let db = if s.needs(1) {
        // [.., k, n] = a^T @ dy, or [.., n, k] = dy^T @ a.
        let full = if transpose_b {
            let dyt = transpose(g, s.dy)?;
            add(g, Op::MatMul { transpose_b: false }, &[dyt, a])?
        } else {
            let at = transpose(g, a)?;
            add(g, Op::MatMul { transpose_b: false }, &[at, s.dy])?
        };
        // A weight shared over the batch gets the sum over the batch axes.
        Some(sum_to(g, full, &shape(g, b)?)?)
    } else {
        None
    };
    Ok(vec![da, db])
}

/// The gradient of a broadcasting operand `i` whose local gradient is `grad`.
fn reduced(g: &mut Graph, s: &Site, i: usize, grad: NodeIndex) -> Result<Option<NodeIndex>, AutodiffError> {
    let target = shape(g, s.operand(i)?)?;
    Ok(Some(sum_to(g, grad, &target)?))
}

fn add_rule(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let mut out = Vec::new();
    for i in 0..2 {
        out.push(if s.needs(i) { reduced(g, s, i, s.dy)? } else { None });
    }
    Ok(out)
}

fn mul(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let (a, b) = (s.operand(0)?, s.operand(1)?);
    let da = if s.needs(0) {
        let d = add(g, Op::Mul, &[s.dy, b])?;
        reduced(g, s, 0, d)?
    } else {
        None
    };
    let db = if s.needs(1) {
        let d = add(g, Op::Mul, &[s.dy, a])?;
        reduced(g, s, 1, d)?
    } else {
        None
    };
    Ok(vec![da, db])
}

fn scale_rule(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::Scale { factor } = *s.op else { return Err(s.unsupported("not a scale".into())) };
    Ok(vec![Some(scale(g, s.dy, factor.0)?)])
}

fn offset(_: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    Ok(vec![Some(s.dy)])
}

fn sum_axis(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let x = s.operand(0)?;
    let zeros = zeros_like(g, x)?;
    Ok(vec![Some(add(g, Op::Add, &[zeros, s.dy])?)])
}
