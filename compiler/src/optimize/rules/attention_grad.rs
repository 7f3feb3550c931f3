//! Attention's backward as one op ([`Op::AttentionGrad`]): flash-attention's backward, which
//! recomputes the scores per tile instead of keeping the probabilities from the forward.
//!
//! Autodiff differentiates the unfused attention op by op, so its backward reads the forward's
//! probabilities `p` (`[b, h, s, s]`) three times and writes two more matrices of that size:
//!
//! ```text
//! dv  = p^T dout
//! dp  = dout v^T
//! ds  = scale(f, [mul(.., slope)] ([relu_grad(mask(ones), ..)] softmax_grad(p, dp)))
//! dq  = ds k
//! dk  = ds^T q
//! ```
//!
//! — the soft-cap's slope where the scores are soft-capped, the gate where a key mask or a block
//! pattern can hide a whole row (a causal or window mask alone needs none: the softmax is 0 at
//! every key it hides). One rule, rooted at the query gradient `(matmul ?ds ?k)`, walks down
//! `?ds` to the softmax's gradient and the fused forward softmax of `q k^T` (which the attention
//! phase's own rules made), checks that the chain is the one autodiff builds for that softmax's
//! modifiers, and finds the key and value gradients among the parents of `ds` and `p`. All three
//! become slices of one `attention_grad`, registered as a group together with the forward's
//! fused `attention` (a group pays only whole: then nothing reads `p`), and extraction keeps
//! whichever form costs less.
//!
//! Self-attention only (the op's key gradients have the queries' rows), within the target's
//! head width, and only on targets whose kernel keeps the row statistics per tile
//! ([`crate::target::Target::attention_grad`]).

use super::*;
use crate::graph::Activation;
use egg::rewrite as rw;

/// An attention whose backward a match found: the forward softmax's children (`(masked_softmax
/// scale alibi causal window mods scores key_mask table)`), its probabilities' class and the
/// tensors the op reads.
struct Found {
    softmax: [Id; 8],
    p: Id,
    q: Id,
    k: Id,
    v: Id,
    dout: Id,
}

/// What lies between the softmax's gradient and the raw scores' gradient, as found walking down.
#[derive(Clone, Copy)]
struct Chain {
    scale: Id,
    gated: bool,
    /// The soft-cap slope's factor `-1 / cap^2`.
    cap: Option<f32>,
}

/// The op of an `opaque` node and its operand classes.
fn opaque<'a>(egraph: &'a KGraph, node: &'a Kl) -> Option<(&'a Op, &'a [Id])> {
    let Kl::Opaque(children) = node else { return None };
    let (first, rest) = children.split_first()?;
    match super::super::lang::attr(egraph, *first)? {
        AttrValue::Op(op) => Some((op, rest)),
        _ => None,
    }
}

/// The fused softmax of `q k^T` in class `p`: its children, `q` and `k`.
fn softmax_of(egraph: &KGraph, p: Id) -> Option<([Id; 8], Id, Id)> {
    egraph[p].nodes.iter().find_map(|n| match n {
        Kl::MaskedSoftmax(children) => {
            let scores = *children.get(5)?;
            egraph[scores].nodes.iter().find_map(|s| match s {
                Kl::MatMulT([q, k]) => Some((*children, *q, *k)),
                _ => None,
            })
        }
        _ => None,
    })
}

/// The factor `f` of a soft-cap's slope `1 + f * y * y` in class `id`.
fn cap_slope(egraph: &KGraph, id: Id) -> Option<f32> {
    egraph[id].nodes.iter().find_map(|n| {
        let (Op::Offset { value }, &[minus]) = opaque(egraph, n)? else { return None };
        if value.0 != 1.0 {
            return None;
        }
        egraph[minus].nodes.iter().find_map(|m| {
            let Kl::Scale([f, square]) = m else { return None };
            let AttrValue::F(f) = super::super::lang::attr(egraph, *f)? else { return None };
            let squares = egraph[*square]
                .nodes
                .iter()
                .any(|s| matches!(s, Kl::Mul([a, b]) if egraph.find(*a) == egraph.find(*b)));
            squares.then_some(f.0)
        })
    })
}

/// Whether class `id` is a mask over ones (the gate autodiff builds for a masking op).
fn is_mask(egraph: &KGraph, id: Id) -> bool {
    egraph[id]
        .nodes
        .iter()
        .any(|n| matches!(n, Kl::Mask(_)) || matches!(opaque(egraph, n), Some((Op::BlockSparseMask { .. }, _))))
}

/// The attention whose raw scores' gradient class `ds` is.
fn score_grad(egraph: &KGraph, ds: Id) -> Option<Found> {
    egraph[ds].nodes.iter().find_map(|n| match n {
        Kl::Scale([f, x]) => walk(egraph, *x, Chain { scale: *f, gated: false, cap: None }, 0),
        _ => None,
    })
}

/// Down from class `x` to the softmax's gradient through what `chain` has not met yet.
fn walk(egraph: &KGraph, x: Id, chain: Chain, depth: usize) -> Option<Found> {
    if depth > 2 {
        return None;
    }
    egraph[x].nodes.iter().find_map(|n| match (opaque(egraph, n), n) {
        (Some((Op::SoftmaxGrad, &[p, dp])), _) => finish(egraph, p, dp, chain),
        (Some((Op::ActGrad(Activation::Relu), &[gate, inner])), _) if !chain.gated && is_mask(egraph, gate) => {
            walk(egraph, inner, Chain { gated: true, ..chain }, depth + 1)
        }
        (_, Kl::Mul([a, b])) if chain.cap.is_none() => [(*a, *b), (*b, *a)].into_iter().find_map(|(inner, slope)| {
            let f = cap_slope(egraph, slope)?;
            walk(egraph, inner, Chain { cap: Some(f), ..chain }, depth + 1)
        }),
        _ => None,
    })
}

/// The attention of `softmax_grad(p, dp)`, if the chain above it is the one autodiff builds for
/// the forward softmax's modifiers.
fn finish(egraph: &KGraph, p: Id, dp: Id, chain: Chain) -> Option<Found> {
    let (softmax, q, k) = softmax_of(egraph, p)?;
    let (dout, v) = egraph[dp].nodes.iter().find_map(|n| match n {
        Kl::MatMulT([a, b]) => Some((*a, *b)),
        _ => None,
    })?;
    let (Op::MaskedSoftmax { mods, .. }, _) = super::super::lang::to_op(egraph, &Kl::MaskedSoftmax(softmax))? else {
        return None;
    };
    let same_scale = egraph.find(softmax[0]) == egraph.find(chain.scale);
    let same_cap = match (mods.softcap, chain.cap) {
        (Some(cap), Some(f)) => f == -1.0 / (cap.0 * cap.0),
        (None, None) => true,
        _ => false,
    };
    // A key mask or block pattern can hide a whole row: autodiff gates those.
    let gate_ok = chain.gated || (super::super::lang::is_none(egraph, softmax[6]) && mods.sparse.is_none());
    (same_scale && same_cap && gate_ok).then_some(Found { softmax, p: egraph.find(p), q, k, v, dout })
}

/// The classes among the parents of `x` holding `node(parent-of-x ...)`, by a test on the node.
fn parents_where(egraph: &KGraph, x: Id, test: impl Fn(&Kl) -> bool) -> Option<Id> {
    egraph[x].parents().map(|p| egraph.find(p)).find(|&p| egraph[p].nodes.iter().any(&test))
}

/// Whether a permute attribute swaps the last two of four axes.
fn swaps_last(egraph: &KGraph, p: Id) -> bool {
    matches!(super::super::lang::attr(egraph, p), Some(AttrValue::Op(Op::Permute { perm })) if perm == &[0, 1, 3, 2])
}

/// `x^T y` of class `x`'s transposes: the class holding `matmul(permute(x), y)`.
fn transposed_product(egraph: &KGraph, x: Id, y: Id) -> Option<Id> {
    let (x, y) = (egraph.find(x), egraph.find(y));
    egraph[x].parents().map(|p| egraph.find(p)).find_map(|t| {
        let is_t = egraph[t]
            .nodes
            .iter()
            .any(|n| matches!(n, Kl::Permute([p, a]) if egraph.find(*a) == x && swaps_last(egraph, *p)));
        if !is_t {
            return None;
        }
        parents_where(egraph, t, |n| matches!(n, Kl::MatMul([a, b]) if egraph.find(*a) == t && egraph.find(*b) == y))
    })
}

/// The forward's fused attention: the class of `merge_heads(p v)` and its `attention` node.
fn forward(egraph: &KGraph, p: Id, v: Id) -> Option<(Id, Kl)> {
    let v = egraph.find(v);
    let pv =
        parents_where(egraph, p, |n| matches!(n, Kl::MatMul([a, b]) if egraph.find(*a) == p && egraph.find(*b) == v))?;
    egraph[pv].parents().map(|c| egraph.find(c)).find_map(|merged| {
        egraph[merged]
            .parents()
            .map(|c| egraph.find(c))
            .find_map(|out| egraph[out].nodes.iter().find(|n| matches!(n, Kl::Attention(_))).map(|n| (out, n.clone())))
    })
}

/// Rewrites a query gradient `(matmul ?ds ?k)` of an attention, with its key and value gradients,
/// into slices of one `attention_grad`.
struct AttentionGrad;

impl Applier<Kl, KAnalysis> for AttentionGrad {
    fn apply_one(&self, egraph: &mut KGraph, eclass: Id, s: &Subst, _: Option<&PatternAst<Kl>>, _: Symbol) -> Vec<Id> {
        self.rewrite(egraph, eclass, s).unwrap_or_default()
    }
}

impl AttentionGrad {
    fn rewrite(&self, egraph: &mut KGraph, dq: Id, s: &Subst) -> Option<Vec<Id>> {
        if !egraph.analysis.attention_grad {
            return None;
        }
        let ds = egraph.find(s[var("?ds")]);
        let f = score_grad(egraph, ds)?;
        if egraph.find(f.k) != egraph.find(s[var("?k")]) {
            return None;
        }
        // Self-attention within the head width, the output's gradient shaped as the queries.
        let (qs, ks, dos) = (shape(egraph, f.q)?, shape(egraph, f.k)?, shape(egraph, f.dout)?);
        let ([_, Dim::Fixed(_), sq, Dim::Fixed(d)], [_, _, t, _]) = (qs.as_slice(), ks.as_slice()) else { return None };
        if sq != t || dos != qs || *d > egraph.analysis.max_attention_head_dim {
            return None;
        }
        let rows = qs.clone();
        let dk = transposed_product(egraph, ds, f.q)?;
        let dv = transposed_product(egraph, f.p, f.dout)?;
        let fwd = forward(egraph, f.p, f.v);
        let (Op::MaskedSoftmax { scale, alibi, causal, window, mods }, _) =
            super::super::lang::to_op(egraph, &Kl::MaskedSoftmax(f.softmax))?
        else {
            return None;
        };
        let op = Op::AttentionGrad { scale, alibi, causal, window, mods };
        let grad = {
            let a = egraph.analysis.intern(AttrValue::Op(op));
            let mut children = vec![egraph.add(Kl::Attr(a)), f.q, f.k, f.v, f.dout];
            let optional: [Id; 2] = [f.softmax[6], f.softmax[7]];
            children.extend(optional.into_iter().filter(|&o| !super::super::lang::is_none(egraph, o)));
            egraph.add(Kl::Opaque(children.into_boxed_slice()))
        };
        let reshape = {
            let a = egraph.analysis.intern(AttrValue::Op(Op::Reshape { shape: rows }));
            egraph.add(Kl::Attr(a))
        };
        let mut group = Vec::new();
        let mut changed = Vec::new();
        for (part, class) in [dq, dk, dv].into_iter().enumerate() {
            let at = egraph.analysis.intern(AttrValue::Op(Op::Slice { axis: 0, start: part, len: 1 }));
            let at = egraph.add(Kl::Attr(at));
            let slice = egraph.add(Kl::Slice([at, grad]));
            let node = Kl::Reshape([reshape, slice]);
            let id = egraph.add(node.clone());
            group.push((class, node));
            if egraph.union(class, id) {
                changed.push(class);
            }
        }
        // (A rule is applied again to the matches it made before; the group is recorded once.)
        if !changed.is_empty() {
            group.extend(fwd);
            egraph.analysis.groups.push(group);
        }
        Some(changed)
    }
}

/// The rule; see the module's documentation.
pub fn rules() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // dq = ds k, dk = ds^T q, dv = p^T dout = slices of attention_grad(q, k, v, dout)
        rw!("attention-grad"; "(matmul ?ds ?k)" => AttentionGrad),
    ]
}
