//! Shared-input merges: projections of one input become one projection over stacked weights,
//! each original a slice of its columns. These are multi-pattern rules: two matches anywhere in
//! the graph, `?a = (matmul_t ?x ?w1)` and `?b = (matmul_t ?x ?w2)`, joined on their input `?x`.
//! egg's `MultiPattern` joins by scanning every e-class for the second pattern, which makes the
//! phase quadratic in the model's depth; [`SharedInput`] joins through `?x`'s parent index
//! instead, so each match costs the handful of consumers `?x` has. The stacked weights are
//! constants, folded at load time.
//! Alone a merge is never cheaper (the slices cost dispatches); it pays when a consumer reads
//! the slices in place, as packed attention and the gated projection do.

use super::*;
use egg::{SearchMatches, Searcher, rewrite as rw};

/// The most weights one merged projection stacks (Q, K and V).
pub const MAX_MERGED: usize = 3;

/// Merges `?a = x w1^T (+ b1)` and `?b = x w2^T (+ b2)` into slices of `x [w1; w2]^T (+ [b1; b2])`.
struct Merge {
    bias: bool,
}

impl Applier<Kl, KAnalysis> for Merge {
    fn apply_one(&self, egraph: &mut KGraph, _: Id, subst: &Subst, _: Option<&PatternAst<Kl>>, _: Symbol) -> Vec<Id> {
        let (a, b, x, w1, w2) =
            (subst[var("?a")], subst[var("?b")], subst[var("?x")], subst[var("?w1")], subst[var("?w2")]);
        // Stack in parameter order only, so each set of weights is stacked one way; never twice.
        let (Some(l1), Some(l2)) = (leaves(egraph, w1, 0), leaves(egraph, w2, 0)) else { return vec![] };
        let ordered = l1.iter().max() < l2.iter().min();
        if !ordered || l1.len() + l2.len() > MAX_MERGED || konst(egraph, x) {
            return vec![];
        }
        let (Some(s1), Some(s2), Some(xs)) = (shape(egraph, w1), shape(egraph, w2), shape(egraph, x)) else {
            return vec![];
        };
        let (Some(s1), Some(s2)) = (fixed(s1), fixed(s2)) else { return vec![] };
        let (&[rows1, cols1], &[rows2, cols2]) = (s1.as_slice(), s2.as_slice()) else { return vec![] };
        if cols1 != cols2 || xs.is_empty() {
            return vec![];
        }
        let axis = xs.len() - 1;
        let none = egraph.add(Kl::None);
        let w = egraph.add(Kl::Concat([w1, w2]));
        let merged = if self.bias {
            let (b1, b2) = (subst[var("?b1")], subst[var("?b2")]);
            let bias_ok = |id: Id, n: usize| {
                konst(egraph, id) && shape(egraph, id).and_then(|s| fixed(s)).is_some_and(|s| s == [n])
            };
            if !bias_ok(b1, rows1) || !bias_ok(b2, rows2) {
                return vec![];
            }
            let bias = egraph.add(Kl::Concat([b1, b2]));
            egraph.add(Kl::Linear([none, x, w, bias, none]))
        } else {
            egraph.add(Kl::MatMulT([x, w]))
        };
        let mut changed = vec![];
        for (class, start, len) in [(a, 0, rows1), (b, rows1, rows2)] {
            let at = egraph.analysis.intern(AttrValue::Op(Op::Slice { axis, start, len }));
            let at = egraph.add(Kl::Attr(at));
            let slice = egraph.add(Kl::Slice([at, merged]));
            if egraph.union(class, slice) {
                changed.push(class);
            }
        }
        changed
    }
}

/// `slice(slice(x))` as one slice of `x` (same axis).
fn composed_slice(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (Op::Slice { axis: a1, start: s1, len }, Op::Slice { axis: a2, start: s2, .. }) =
        (op_of(egraph, s, "?o")?, op_of(egraph, s, "?i")?)
    else {
        return None;
    };
    (a1 == a2).then(|| vec![("?oi", AttrValue::Op(Op::Slice { axis: *a1, start: s1 + s2, len: *len }))])
}

/// Finds pairs of projections of one input: `?a = (matmul_t ?x ?w1), ?b = (matmul_t ?x ?w2)`,
/// or with `bias`, `?a = (linear none ?x ?w1 ?b1 none), ?b = (linear none ?x ?w2 ?b2 none)`.
struct SharedInput {
    bias: bool,
}

impl SharedInput {
    /// The projections in a class: (input, weight, bias).
    fn projections(&self, egraph: &KGraph, class: Id) -> Vec<(Id, Id, Option<Id>)> {
        let none = |id: Id| crate::optimize::lang::is_none(egraph, id);
        egraph[class]
            .nodes
            .iter()
            .filter_map(|n| match (n, self.bias) {
                (Kl::MatMulT([x, w]), false) => Some((egraph.find(*x), *w, None)),
                (Kl::Linear([a, x, w, b, r]), true) if none(*a) && none(*r) && !none(*b) => {
                    Some((egraph.find(*x), *w, Some(*b)))
                }
                _ => None,
            })
            .collect()
    }
}

impl Searcher<Kl, KAnalysis> for SharedInput {
    fn search_eclass_with_limit(&self, egraph: &KGraph, a: Id, limit: usize) -> Option<SearchMatches<'_, Kl>> {
        let mut substs = Vec::new();
        for (x, w1, b1) in self.projections(egraph, a) {
            for b in egraph[x].parents().map(|p| egraph.find(p)) {
                if b == a {
                    continue;
                }
                for (x2, w2, b2) in self.projections(egraph, b) {
                    if x2 != x || substs.len() >= limit {
                        continue;
                    }
                    let mut s = Subst::with_capacity(7);
                    for (v, id) in [("?a", a), ("?b", b), ("?x", x), ("?w1", w1), ("?w2", w2)] {
                        s.insert(var(v), id);
                    }
                    if let (Some(b1), Some(b2)) = (b1, b2) {
                        s.insert(var("?b1"), b1);
                        s.insert(var("?b2"), b2);
                    }
                    substs.push(s);
                }
            }
        }
        substs.sort_by_key(|s| (s[var("?b")], s[var("?w1")], s[var("?w2")]));
        substs.dedup_by_key(|s| (s[var("?b")], s[var("?w1")], s[var("?w2")]));
        (!substs.is_empty()).then_some(SearchMatches { eclass: a, substs, ast: None })
    }

    fn vars(&self) -> Vec<Var> {
        let mut v: Vec<Var> = ["?a", "?b", "?x", "?w1", "?w2"].into_iter().map(var).collect();
        if self.bias {
            v.extend(["?b1", "?b2"].into_iter().map(var));
        }
        v
    }
}

#[expect(clippy::expect_used, reason = "the rules are fixed; every optimizer run and test builds them")]
pub fn rules() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // x W1^T, x W2^T = slices of x [W1; W2]^T
        Rewrite::new("shared-input-merge", SharedInput { bias: false }, Merge { bias: false }).expect("a valid rule"),
        // x W1^T + b1, x W2^T + b2 = slices of x [W1; W2]^T + [b1; b2]
        Rewrite::new("shared-input-merge-bias", SharedInput { bias: true }, Merge { bias: true })
            .expect("a valid rule"),
        // slice(slice(x, i), o) = slice(x, i + o)
        rw!("slice-slice"; "(slice ?o (slice ?i ?x))" => { derive("(slice ?oi ?x)", composed_slice) }),
        // [a; [b; c]] = [[a; b]; c]
        rw!("concat-assoc"; "(concat ?a (concat ?b ?c))" => "(concat (concat ?a ?b) ?c)"),
    ]
}
