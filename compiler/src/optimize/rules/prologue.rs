//! Norms folded into what follows them: into the prologue of the projections that read the
//! normalised rows, or into the residual add before them. Whether a fold pays is the cost
//! model's decision (the fused projection recomputes the row statistics).

use super::*;
use crate::graph::Prologue;
use egg::rewrite as rw;

/// A projection `?a`/`?cfg` with the norm of epsilon `?e` in its prologue.
fn with_norm(egraph: &KGraph, s: &Subst, rms: bool) -> Option<Vec<(&'static str, AttrValue)>> {
    let eps = scalar_of(egraph, s, "?e")?;
    let (act, glu, rope) = if s.get(var("?cfg")).is_some() {
        match op_of(egraph, s, "?cfg")? {
            Op::Linear { act, norm: None, glu, rope, .. } => (*act, *glu, *rope),
            _ => return None,
        }
    } else if is_none(egraph, s, "?a") {
        (None, false, None)
    } else {
        match attr_of(egraph, s, "?a")? {
            AttrValue::Act(a) => (Some(*a), false, None),
            _ => return None,
        }
    };
    let norm = Some(Prologue { rms, eps, bias: false });
    let lin = Op::Linear { act, bias: false, residual: false, norm, glu, rope };
    Some(vec![("?lin", AttrValue::Op(lin))])
}

/// A plain projection with the norm of epsilon `?e` in its prologue, from a `matmul_t` by a
/// weight matrix `?w` (a projection the merge phase made, after `matmul-to-linear` ran).
fn matmul_with_norm(egraph: &KGraph, s: &Subst, rms: bool) -> Option<Vec<(&'static str, AttrValue)>> {
    if shape(egraph, s[var("?w")])?.len() != 2 {
        return None;
    }
    let eps = scalar_of(egraph, s, "?e")?;
    let norm = Some(Prologue { rms, eps, bias: false });
    let lin = Op::Linear { act: None, bias: false, residual: false, norm, glu: false, rope: None };
    Some(vec![("?lin", AttrValue::Op(lin))])
}

fn rms(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    with_norm(egraph, s, true)
}

fn layer(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    with_norm(egraph, s, false)
}

/// The `add_norm` op of a norm with epsilon `?e`.
fn add_norm(egraph: &KGraph, _: Id, s: &Subst, rms: bool) -> Option<Vec<(&'static str, AttrValue)>> {
    let eps = scalar_of(egraph, s, "?e")?;
    Some(vec![("?cfg", AttrValue::Op(Op::AddNorm { rms, eps, after: false }))])
}

/// The `add_norm` op adding `?a` after the norm of `?b` (epsilon `?e`), when the two have one
/// shape (a residual, not a broadcast).
fn norm_add(egraph: &KGraph, _: Id, s: &Subst, rms: bool) -> Option<Vec<(&'static str, AttrValue)>> {
    let eps = scalar_of(egraph, s, "?e")?;
    let (a, b) = (shape(egraph, s[var("?a")])?, shape(egraph, s[var("?b")])?);
    (a == b).then(|| vec![("?cfg", AttrValue::Op(Op::AddNorm { rms, eps, after: true }))])
}

#[rustfmt::skip]
pub fn rules() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // linear(rms_norm(h, g), W, ...) = linear with the norm in its prologue
        rw!("norm-prologue-rms";   "(linear ?a (rms_norm ?e ?h ?g) ?w ?b ?r)"
                                => { derive("(xlinear ?lin ?h ?g none ?w ?b ?r)", rms) }),
        rw!("norm-prologue-rms-x"; "(xlinear ?cfg (rms_norm ?e ?h ?g) none none ?w ?b ?r)"
                                => { derive("(xlinear ?lin ?h ?g none ?w ?b ?r)", rms) }),
        // rms_norm(h, g) @ W^T = linear with the norm in its prologue (a merged projection)
        rw!("norm-prologue-rms-m"; "(matmul_t (rms_norm ?e ?h ?g) ?w)"
                                => { derive("(xlinear ?lin ?h ?g none ?w none none)", |e, _, s| matmul_with_norm(e, s, true)) }),
        rw!("norm-prologue-ln-m";  "(matmul_t (layer_norm ?e ?h ?g ?nb) ?w)"
                                => { derive("(xlinear ?lin ?h ?g ?nb ?w none none)", |e, _, s| matmul_with_norm(e, s, false)) }),
        // linear(layer_norm(h, g, beta), W, ...) = linear with the norm in its prologue
        rw!("norm-prologue-ln";    "(linear ?a (layer_norm ?e ?h ?g ?nb) ?w ?b ?r)"
                                => { derive("(xlinear ?lin ?h ?g ?nb ?w ?b ?r)", layer) }),
        rw!("norm-prologue-ln-x";  "(xlinear ?cfg (layer_norm ?e ?h ?g ?nb) none none ?w ?b ?r)"
                                => { derive("(xlinear ?lin ?h ?g ?nb ?w ?b ?r)", layer) }),
        // rms_norm(a + b) = add_norm(a, b)             (the sum read by nothing else)
        rw!("add-norm-rms";        "(rms_norm ?e (add ?a ?b) ?g)"
                                => { derive("(add_norm ?cfg ?a ?b ?g none)", |e, i, s| add_norm(e, i, s, true)) }
                                   if sum_single_use()),
        // layer_norm(a + b) = add_norm(a, b)
        rw!("add-norm-ln";         "(layer_norm ?e (add ?a ?b) ?g ?nb)"
                                => { derive("(add_norm ?cfg ?a ?b ?g ?nb)", |e, i, s| add_norm(e, i, s, false)) }
                                   if sum_single_use()),
        // a + rms_norm(b) = add_norm(a, b) after      (a sandwich block's post-norm and residual;
        //                                              `add` is matched both ways round)
        rw!("norm-add-rms";        "(add ?a (rms_norm ?e ?b ?g))"
                                => { derive("(add_norm ?cfg ?a ?b ?g none)", |e, i, s| norm_add(e, i, s, true)) }),
        rw!("norm-add-rms-r";      "(add (rms_norm ?e ?b ?g) ?a)"
                                => { derive("(add_norm ?cfg ?a ?b ?g none)", |e, i, s| norm_add(e, i, s, true)) }),
        // a + layer_norm(b) = add_norm(a, b) after
        rw!("norm-add-ln";         "(add ?a (layer_norm ?e ?b ?g ?nb))"
                                => { derive("(add_norm ?cfg ?a ?b ?g ?nb)", |e, i, s| norm_add(e, i, s, false)) }),
        rw!("norm-add-ln-r";       "(add (layer_norm ?e ?b ?g ?nb) ?a)"
                                => { derive("(add_norm ?cfg ?a ?b ?g ?nb)", |e, i, s| norm_add(e, i, s, false)) }),
    ]
}

/// The sum `?a + ?b` the matched norm reads has no other consumer.
fn sum_single_use() -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    let (a, b) = (var("?a"), var("?b"));
    move |egraph, id, subst| {
        let sums = egraph[id].nodes.iter().filter_map(|n| match n {
            Kl::RmsNorm([_, x, _]) | Kl::LayerNorm([_, x, _, _]) => Some(*x),
            _ => None,
        });
        let wanted = (egraph.find(subst[a]), egraph.find(subst[b]));
        sums.into_iter().any(|x| {
            let is_sum = egraph[x]
                .nodes
                .iter()
                .any(|n| matches!(n, Kl::Add([p, q]) if (egraph.find(*p), egraph.find(*q)) == wanted));
            is_sum && egraph.analysis.uses.get(&egraph.find(x)).copied() == Some(1)
        })
    }
}
