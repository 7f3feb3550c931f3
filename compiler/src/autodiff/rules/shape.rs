//! Gradients of the ops that move elements: reshape, permute, slice, truncate, concat, gather,
//! repeat_heads.

use super::{Grads, Rule, Site, add, shape, zeros_like};
use crate::autodiff::AutodiffError;
use crate::graph::{Dim, Graph, Op};

/// The rules of this topic.
#[rustfmt::skip]
pub fn rules() -> Vec<Rule> {
    vec![
        // d(reshape x) = reshape dy to x's shape
        Rule { op: "reshape",      grad: reshape },
        // d(permute_p x) = permute_{p^-1} dy
        Rule { op: "permute",      grad: permute },
        // d(slice x) = dy padded with zeros to x's extent
        Rule { op: "slice",        grad: slice },
        // d(truncate_n x) = dy followed by zero rows for the rows cut off
        Rule { op: "truncate",     grad: truncate },
        // d(concat(a, b)) = (dy's first part, dy's second part)
        Rule { op: "concat",       grad: concat },
        // d(gather(table, ids)) = dy's rows summed into the rows the ids name
        Rule { op: "gather",       grad: gather },
        // d(repeat_heads x) = dy summed over each head's copies
        Rule { op: "repeat_heads", grad: repeat_heads },
    ]
}

fn reshape(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let x = shape(g, s.operand(0)?)?;
    Ok(vec![Some(add(g, Op::Reshape { shape: x }, &[s.dy])?)])
}

fn permute(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::Permute { perm } = s.op else { return Err(s.unsupported("not a permute".into())) };
    let mut inverse = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        match inverse.get_mut(p) {
            Some(slot) => *slot = i,
            None => return Err(s.unsupported(format!("{perm:?} is not a permutation"))),
        }
    }
    Ok(vec![Some(add(g, Op::Permute { perm: inverse }, &[s.dy])?)])
}

fn slice(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::Slice { axis, start, len } = *s.op else { return Err(s.unsupported("not a slice".into())) };
    let x = s.operand(0)?;
    let Some(&Dim::Fixed(total)) = shape(g, x)?.get(axis) else {
        return Err(s.unsupported(format!("axis {axis} is not of a fixed extent")));
    };
    // The zeros before and after are slices of `x` times 0, so they have its other extents.
    let mut dx = s.dy;
    if start > 0 {
        let before = add(g, Op::Slice { axis, start: 0, len: start }, &[x])?;
        let zeros = zeros_like(g, before)?;
        dx = add(g, Op::Concat { axis }, &[zeros, dx])?;
    }
    let end = start + len;
    if end < total {
        let after = add(g, Op::Slice { axis, start: end, len: total - end }, &[x])?;
        let zeros = zeros_like(g, after)?;
        dx = add(g, Op::Concat { axis }, &[dx, zeros])?;
    }
    Ok(vec![Some(dx)])
}

fn concat(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::Concat { axis } = *s.op else { return Err(s.unsupported("not a concat".into())) };
    let extent = |g: &Graph, i: usize| -> Result<usize, AutodiffError> {
        match shape(g, s.operand(i)?)?.get(axis) {
            Some(&Dim::Fixed(n)) => Ok(n),
            _ => Err(s.unsupported(format!("operand {i} has no fixed extent on axis {axis}"))),
        }
    };
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..2 {
        if s.needs(i) {
            let len = extent(g, i)?;
            out.push(Some(add(g, Op::Slice { axis, start, len }, &[s.dy])?));
            start += len;
        } else {
            out.push(None);
            if i == 0 {
                start = extent(g, 0)?;
            }
        }
    }
    Ok(out)
}

fn repeat_heads(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let Op::RepeatHeads { times } = *s.op else { return Err(s.unsupported("not repeat_heads".into())) };
    let x = shape(g, s.operand(0)?)?;
    let [b, kv, sq, d] = x.as_slice() else { return Err(s.unsupported("x is not 4-D".into())) };
    let split = add(g, Op::Reshape { shape: vec![*b, *kv, Dim::Fixed(times), *sq, *d] }, &[s.dy])?;
    let summed = add(g, Op::SumAxis { axis: 2 }, &[split])?;
    Ok(vec![Some(add(g, Op::Reshape { shape: x }, &[summed])?)])
}

fn gather(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    let (table, ids) = (s.operand(0)?, s.operand(1)?);
    Ok(vec![Some(add(g, Op::GatherGrad, &[table, ids, s.dy])?), None])
}

fn truncate(g: &mut Graph, s: &Site) -> Result<Grads, AutodiffError> {
    // A backward op rather than a concatenation with zeros: the rows kept are often symbolic
    // (a Linformer projection cut to the sequence), so the rows cut off are no fixed slice.
    Ok(vec![Some(add(g, Op::TruncateGrad, &[s.operand(0)?, s.dy])?)])
}
