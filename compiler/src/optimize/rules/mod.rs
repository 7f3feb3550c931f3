//! Rewrite rules, grouped by purpose, and the phases they run in. See README.md in this folder for
//! how to write one.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

mod attention_grad;
mod backward;
mod cache;
mod fusion;
mod merge;
mod prologue;
mod simplify;

use super::{AttrValue, KAnalysis, KGraph, Kl};
use crate::graph::{Dim, Op, Scalar};
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol, Var};

/// The rule phases, in order. Each phase runs to saturation (or its limits) before the next
/// starts; later phases match the forms earlier ones added:
///
/// 1. `simplify`: scale folding, transpose and reshape elimination;
/// 2. `linear`: bias, activation and residual epilogues into `linear`; a weight's gradient as
///    one product over all the rows (`contract_rows`);
/// 3. `merge`: projections of one input merged into one over stacked weights (multi-pattern);
/// 4. `attention`: softmax, attention and packed attention; gated projections; heads read
///    out of merged projections, rotated and appended to a cache; attention's backward as one op;
/// 5. `prologue`: norms into the projections that read them, residual add + norm.
pub fn phases() -> Vec<(&'static str, Vec<Rewrite<Kl, KAnalysis>>)> {
    vec![
        ("simplify", simplify::rules()),
        ("linear", fusion::linear().into_iter().chain(backward::rules()).collect()),
        ("merge", merge::rules()),
        ("attention", fusion::attention().into_iter().chain(cache::rules()).chain(attention_grad::rules()).collect()),
        ("prologue", prologue::rules()),
    ]
}

/// Every rule of every phase.
pub fn all() -> Vec<Rewrite<Kl, KAnalysis>> {
    phases().into_iter().flat_map(|(_, r)| r).collect()
}

// ---- Appliers.

/// Computes a [`Derive`] rule's new attributes from a match (`None`: do not fire).
pub type DeriveFn = fn(&KGraph, Id, &Subst) -> Option<Vec<(&'static str, AttrValue)>>;

/// Instantiates a right-hand side after binding new attribute variables computed from the match:
/// rules whose result attributes are functions of the matched ones (a composed permutation, a
/// fused op's configuration) stay readable s-expressions. The function returns `None` when the
/// rule must not fire (a side condition).
pub struct Derive {
    rhs: Pattern<Kl>,
    f: DeriveFn,
}

/// A [`Derive`] applier.
#[expect(clippy::expect_used, reason = "right-hand sides are literals of the rule set; every test builds them")]
pub fn derive(rhs: &str, f: DeriveFn) -> Derive {
    Derive { rhs: rhs.parse().expect("a valid right-hand side"), f }
}

impl Applier<Kl, KAnalysis> for Derive {
    fn apply_one(
        &self,
        egraph: &mut KGraph,
        eclass: Id,
        subst: &Subst,
        searcher_ast: Option<&PatternAst<Kl>>,
        rule_name: Symbol,
    ) -> Vec<Id> {
        let Some(binds) = (self.f)(egraph, eclass, subst) else { return vec![] };
        let mut subst = subst.clone();
        for (name, value) in binds {
            let a = egraph.analysis.intern(value);
            let id = egraph.add(Kl::Attr(a));
            subst.insert(var(name), id);
        }
        self.rhs.apply_one(egraph, eclass, &subst, searcher_ast, rule_name)
    }
}

// ---- Reading matches.

#[expect(clippy::expect_used, reason = "variable names are literals of the rule set")]
fn var(name: &str) -> Var {
    name.parse().expect("a valid pattern variable")
}

fn shape(egraph: &KGraph, id: Id) -> Option<&Vec<Dim>> {
    egraph[id].data.as_ref().map(|d| &d.shape)
}

fn fixed(shape: &[Dim]) -> Option<Vec<usize>> {
    shape
        .iter()
        .map(|d| match d {
            Dim::Fixed(k) => Some(*k),
            Dim::Sym(_) => None,
        })
        .collect()
}

/// The attribute a variable is bound to.
fn attr_of<'a>(egraph: &'a KGraph, subst: &Subst, v: &str) -> Option<&'a AttrValue> {
    super::lang::attr(egraph, subst[var(v)])
}

/// The op attribute a variable is bound to.
fn op_of<'a>(egraph: &'a KGraph, subst: &Subst, v: &str) -> Option<&'a Op> {
    match attr_of(egraph, subst, v)? {
        AttrValue::Op(op) => Some(op),
        _ => None,
    }
}

fn scalar_of(egraph: &KGraph, subst: &Subst, v: &str) -> Option<Scalar> {
    match attr_of(egraph, subst, v)? {
        AttrValue::F(f) => Some(*f),
        _ => None,
    }
}

fn is_none(egraph: &KGraph, subst: &Subst, v: &str) -> bool {
    super::lang::is_none(egraph, subst[var(v)])
}

fn konst(egraph: &KGraph, id: Id) -> bool {
    egraph[id].data.as_ref().is_some_and(|t| t.konst)
}

/// The parameters a constant stacks, in order (a parameter, or a `concat` of such).
fn leaves(egraph: &KGraph, id: Id, depth: usize) -> Option<Vec<u32>> {
    if depth > 8 {
        return None;
    }
    egraph[id].nodes.iter().find_map(|n| match n {
        Kl::Attr(a)
            if matches!(egraph.analysis.attrs.get(a.0 as usize), Some(AttrValue::Leaf(Op::Param { .. }, ..))) =>
        {
            Some(vec![a.0])
        }
        Kl::Concat([a, b]) => {
            let mut l = leaves(egraph, *a, depth + 1)?;
            l.extend(leaves(egraph, *b, depth + 1)?);
            Some(l)
        }
        _ => None,
    })
}

// ---- Side conditions, as small named functions.

/// `?w` is a 2-D tensor (a weight, not a batched operand).
fn is_matrix(w: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let w = var(w);
    move |egraph, _, subst| shape(egraph, subst[w]).is_some_and(|s| s.len() == 2)
}

/// `?w` is computed from parameters alone.
fn is_const(w: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let w = var(w);
    move |egraph, _, subst| konst(egraph, subst[w])
}

/// `?b` is a bias for weight `?w`: shape `[rows of w]`.
fn is_bias_of(b: &'static str, w: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let (b, w) = (var(b), var(w));
    move |egraph, _, subst| match (shape(egraph, subst[b]), shape(egraph, subst[w])) {
        (Some(bs), Some(ws)) => matches!(ws.as_slice(), [rows, _] if bs.as_slice() == [*rows]),
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
        let perm_ok = matches!(super::lang::attr(egraph, subst[p]), Some(AttrValue::Op(Op::Permute { perm })) if perm == &[0, 2, 1, 3]);
        let (Some(qs), Some(out)) = (shape(egraph, subst[q]), shape(egraph, id)) else { return false };
        let max = egraph.analysis.max_attention_head_dim;
        let head_dim_ok = matches!(qs.get(3), Some(Dim::Fixed(d)) if *d <= max);
        let merged = match (qs.as_slice(), out.as_slice()) {
            ([b, Dim::Fixed(h), s, Dim::Fixed(d)], [ob, os, Dim::Fixed(hd)]) => b == ob && s == os && h * d == *hd,
            _ => false,
        };
        perm_ok && head_dim_ok && merged
    }
}
