//! Rewrite rules, grouped by purpose, and the phases they run in. See README.md in this folder for
//! how to write one.

mod fusion;

use super::{AttrValue, KAnalysis, KGraph, Kl};
use crate::graph::{Dim, Op};
use egg::{Id, Rewrite, Subst, Var};

/// The rule phases, in order: epilogue fusions into `linear`, then softmax and attention
/// fusions. Each phase runs to saturation (or its limits) before the next starts.
pub fn phases() -> Vec<(&'static str, Vec<Rewrite<Kl, KAnalysis>>)> {
    vec![("linear", fusion::linear()), ("attention", fusion::attention())]
}

/// Every rule of every phase.
pub fn all() -> Vec<Rewrite<Kl, KAnalysis>> {
    phases().into_iter().flat_map(|(_, r)| r).collect()
}

// ---- Side conditions, as small named functions.

fn var(name: &str) -> Var {
    name.parse().expect("a valid pattern variable")
}

fn shape(egraph: &KGraph, id: Id) -> Option<&Vec<Dim>> {
    egraph[id].data.as_ref().map(|d| &d.0)
}

/// `?w` is a 2-D tensor (a weight, not a batched operand).
fn is_matrix(w: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let w = var(w);
    move |egraph, _, subst| shape(egraph, subst[w]).is_some_and(|s| s.len() == 2)
}

/// `?b` is a bias for weight `?w`: shape `[rows of w]`.
fn is_bias_of(b: &'static str, w: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let (b, w) = (var(b), var(w));
    move |egraph, _, subst| match (shape(egraph, subst[b]), shape(egraph, subst[w])) {
        (Some(bs), Some(ws)) => ws.len() == 2 && bs.as_slice() == [ws[0]],
        _ => false,
    }
}

/// `?r` has exactly the shape of the matched class (a residual, not a broadcast).
fn same_shape_as_match(r: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let r = var(r);
    move |egraph, id, subst| match (shape(egraph, subst[r]), shape(egraph, id)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// `?s` is a rank-4 score tensor `[b, h, q, k]`.
fn is_scores(s: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let s = var(s);
    move |egraph, _, subst| shape(egraph, subst[s]).is_some_and(|s| s.len() == 4)
}

/// The permute is the head merge `[0, 2, 1, 3]`, the reshape joins the last two axes, and the
/// head width fits the fused kernel.
fn merges_heads(p: &'static str, q: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let (p, q) = (var(p), var(q));
    move |egraph, id, subst| {
        let perm_ok = egraph[subst[p]].nodes.iter().any(|n| match n {
            Kl::Attr(a) => matches!(&egraph.analysis.attrs[a.0 as usize], AttrValue::Op(Op::Permute { perm }) if perm == &[0, 2, 1, 3]),
            _ => false,
        });
        let (Some(qs), Some(out)) = (shape(egraph, subst[q]), shape(egraph, id)) else { return false };
        let head_dim_ok = matches!(qs.get(3), Some(Dim::Fixed(d)) if *d <= crate::lower::wgsl::MAX_ATTENTION_HEAD_DIM);
        let merged = match (qs.as_slice(), out.as_slice()) {
            ([b, Dim::Fixed(h), s, Dim::Fixed(d)], [ob, os, Dim::Fixed(hd)]) => b == ob && s == os && h * d == *hd,
            _ => false,
        };
        perm_ok && head_dim_ok && merged
    }
}
