//! Simplifications: scale folding (into weights, which are then folded at load time, and through
//! layout ops), and transpose / reshape elimination.

use super::*;
use egg::Language;
use egg::rewrite as rw;

/// `?f * ?g` as one factor.
fn product(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (f, g) = (scalar_of(egraph, s, "?f")?, scalar_of(egraph, s, "?g")?);
    Some(vec![("?fg", AttrValue::F(Scalar(f.0 * g.0)))])
}

/// The permutation `?p` after `?q`.
fn composed_permutation(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (Op::Permute { perm: p }, Op::Permute { perm: q }) = (op_of(egraph, s, "?p")?, op_of(egraph, s, "?q")?) else {
        return None;
    };
    let perm: Vec<usize> = p.iter().map(|&i| q.get(i).copied()).collect::<Option<_>>()?;
    Some(vec![("?pq", AttrValue::Op(Op::Permute { perm }))])
}

/// `?p` is the identity permutation.
fn is_identity_permutation(p: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let p = var(p);
    move |egraph, _, subst| matches!(crate::optimize::lang::attr(egraph, subst[p]), Some(AttrValue::Op(Op::Permute { perm })) if perm.iter().enumerate().all(|(i, &a)| i == a))
}

/// The reshape `?r` keeps the shape of `?x`.
fn is_same_shape(x: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let x = var(x);
    move |egraph, id, subst| match (shape(egraph, subst[x]), shape(egraph, id)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

#[rustfmt::skip]
pub fn rules() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // (x W^T) * f = x (f W)^T                     (f W is folded when the weights load)
        rw!("scale-into-weight";      "(scale ?f (matmul_t ?x ?w))"
                                   => "(matmul_t ?x (scale ?f ?w))" if is_const("?w") if is_matrix("?w")),
        // gather(T, ids) * f = gather(f T, ids)       (embedding scales, folded at load; not when
        //                                              a tied head reads T too: two copies of it)
        rw!("scale-into-table";       "(scale ?f (gather ?t ?ids))"
                                   => "(gather (scale ?f ?t) ?ids)" if is_const("?t") if only_gathered("?t")),
        // (q k^T) * f = (f q) k^T                     (the logit scale moves to the queries)
        rw!("scale-into-query";       "(scale ?f (matmul_t ?q ?k))"
                                   => "(matmul_t (scale ?f ?q) ?k)" if is_scores_operand("?q")),
        // f * permute(x) = permute(f * x), and the same through a reshape and a rotation
        rw!("scale-through-permute";  "(scale ?f (permute ?p ?x))"  => "(permute ?p (scale ?f ?x))"),
        rw!("scale-through-reshape";  "(scale ?f (reshape ?r ?x))"  => "(reshape ?r (scale ?f ?x))"),
        rw!("scale-through-rope";     "(scale ?f (rope ?r ?x))"     => "(rope ?r (scale ?f ?x))"),
        // (x * g) * f = x * (g f)
        rw!("scale-scale";            "(scale ?f (scale ?g ?x))"    => { derive("(scale ?fg ?x)", product) }),
        // permute(permute(x, q), p) = permute(x, q o p)
        rw!("permute-permute";        "(permute ?p (permute ?q ?x))" => { derive("(permute ?pq ?x)", composed_permutation) }),
        // permute(x, identity) = x
        rw!("permute-identity";       "(permute ?p ?x)"             => "?x" if is_identity_permutation("?p")),
        // reshape(reshape(x)) = reshape(x)
        rw!("reshape-reshape";        "(reshape ?r (reshape ?s ?x))" => "(reshape ?r ?x)"),
        // reshape(x) = x when the shape is unchanged
        rw!("reshape-identity";       "(reshape ?r ?x)"             => "?x" if is_same_shape("?x")),
    ]
}

/// Nothing reads `?t` but gathers and scales of it (this rule's folds): folding a factor into the
/// table then replaces it, where with another reader (a tied head's projection) the folded table
/// would be a second copy of it, as large, for a product per gathered row saved.
fn only_gathered(t: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let t = var(t);
    move |egraph, _, subst| {
        let t = egraph.find(subst[t]);
        egraph[t].parents().all(|p| {
            egraph[p]
                .nodes
                .iter()
                .filter(|n| n.children().iter().any(|&c| egraph.find(c) == t))
                .all(|n| matches!(n, Kl::Gather(_) | Kl::Scale(_)))
        })
    }
}

/// `?q` is a rank-4 `[b, h, s, d]` operand of a score matmul (not a weight).
fn is_scores_operand(q: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let q = var(q);
    move |egraph, _, subst| shape(egraph, subst[q]).is_some_and(|s| s.len() == 4)
}
