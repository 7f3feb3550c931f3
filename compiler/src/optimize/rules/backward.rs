//! The backward forms of a training step that pay: a weight's gradient, summed over the batch,
//! as one product over all the rows; the transposes a weight stored `[in, out]` (GPT-2's
//! `Conv1D`) adds to the backward, read by the products instead of copied; a norm's input
//! gradient with the residual path's gradient to the same input added in its pass; the
//! gradients of projections by slices of one weight (a packed query-key-value weight's parts)
//! as one product over the stacked gradients, for the weight and for the input; a tied table's
//! two gradients summed by the gather's gradient as it scatters; a bias's gradient, the upstream
//! gradient summed over the batch and then the sequence (a sum per axis, the kept axes reshaped
//! away), as one sum over every row; an activation's gradient applied to the product that
//! brings the upstream gradient to it, as that product's epilogue.

use super::*;
use egg::rewrite as rw;

/// `?n` is axis 0, `?p` swaps the last two axes of a rank-3 `?a`, `?b` has `?a`'s rows, and the
/// result is the `[k, n]` matrix: the batch-summed product `sum_axis(0, transpose(a) @ b)` of a
/// shared weight's gradient, the kept axis of the sum reshaped away.
fn is_batch_sum_of_row_products(egraph: &mut KGraph, id: Id, subst: &Subst) -> bool {
    let axis0 = matches!(attr_of(egraph, subst, "?n"), Some(AttrValue::Count(0)));
    let swap = matches!(op_of(egraph, subst, "?p"), Some(Op::Permute { perm }) if perm == &[0, 2, 1]);
    let rows = match (shape(egraph, subst[var("?a")]), shape(egraph, subst[var("?b")])) {
        (Some(a), Some(b)) => {
            let matrix =
                shape(egraph, id).is_some_and(|s| s.len() == 2 && s.first() == a.last() && s.get(1) == b.last());
            a.len() == 3 && b.len() == 3 && a.get(..2) == b.get(..2) && matrix
        }
        _ => false,
    };
    axis0 && swap && rows
}

/// `?x` is `[b, s, n]`, the sums are over axis `?n0` = 0 then `?n1` = 1 (each keeps its axis
/// with extent 1), and the result is `[n]`: the sums cover both leading axes, so the whole is
/// `sum_rows(?x)`.
fn sums_leading_axes(egraph: &mut KGraph, id: Id, subst: &Subst) -> bool {
    let axis = |v, i| matches!(attr_of(egraph, subst, v), Some(AttrValue::Count(a)) if *a == i);
    let in_order = axis("?n0", 0) && axis("?n1", 1);
    let x = shape(egraph, subst[var("?x")]);
    let fits = x.is_some_and(|x| x.len() == 3 && shape(egraph, id).is_some_and(|y| x.get(2..) == Some(y.as_slice())));
    in_order && fits
}

/// `?p` swaps the two axes of a matrix.
fn swaps_two_axes(p: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    move |egraph, _, subst| matches!(op_of(egraph, subst, p), Some(Op::Permute { perm }) if perm == &[1, 0])
}

/// `?p` swaps the two axes of the matrix `?w`.
fn transposes_matrix(p: &'static str, w: &'static str) -> impl Fn(&mut KGraph, Id, &Subst) -> bool {
    move |egraph, _, subst| {
        let swap = matches!(op_of(egraph, subst, p), Some(Op::Permute { perm }) if perm == &[1, 0]);
        swap && shape(egraph, subst[var(w)]).is_some_and(|s| s.len() == 2)
    }
}

/// `?r` has the shape of the norm's input `?x` (the sum does not broadcast).
fn residual_of_input(egraph: &mut KGraph, _: Id, subst: &Subst) -> bool {
    let (r, x) = (shape(egraph, subst[var("?r")]), shape(egraph, subst[var("?x")]));
    r.is_some() && r == x
}

/// `?a` and `?b` are rank-3 activations `[b, r, n]` of the same leading extents, so they stack
/// along their last axis (`append`, a concatenation on axis 2).
fn stack_columns(egraph: &mut KGraph, _: Id, subst: &Subst) -> bool {
    stackable(egraph, subst)
}

fn stackable(egraph: &KGraph, subst: &Subst) -> bool {
    match (shape(egraph, subst[var("?a")]), shape(egraph, subst[var("?b")])) {
        (Some(a), Some(b)) => a.len() == 3 && b.len() == 3 && a.get(..2) == b.get(..2),
        _ => false,
    }
}

/// The row slices `?s1` and `?s2` of one matrix are adjacent, `?s1` first, and `?a`, `?b` stack
/// (see [`stack_columns`]): `?s12`, one slice of the rows of both.
fn adjacent_rows(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (Op::Slice { axis: 0, start: a, len: la }, Op::Slice { axis: 0, start: b, len: lb }) =
        (op_of(egraph, s, "?s1")?, op_of(egraph, s, "?s2")?)
    else {
        return None;
    };
    let rows = Op::Slice { axis: 0, start: *a, len: la + lb };
    (a + la == *b && stackable(egraph, s)).then(|| vec![("?s12", AttrValue::Op(rows))])
}

/// `?o` is a gather's gradient (`gather_grad`) and `?s` has its table's shape `?t`: the sum's
/// other term can start the scatter.
fn is_gather_grad_of_shape(egraph: &mut KGraph, _: Id, subst: &Subst) -> bool {
    let grad = matches!(op_of(egraph, subst, "?o"), Some(Op::GatherGrad));
    let (s, t) = (shape(egraph, subst[var("?s")]), shape(egraph, subst[var("?t")]));
    grad && s.is_some() && s == t
}

/// `?o` is an activation's gradient and the product's right-hand side `?w` a matrix: `?f`, the
/// product with the derivative as its epilogue ([`Op::MatMulActGrad`]), reading `?w` as the
/// product did (`transpose_b`).
fn act_grad_of_product(egraph: &KGraph, s: &Subst, transpose_b: bool) -> Option<Vec<(&'static str, AttrValue)>> {
    let Some(Op::ActGrad(act)) = op_of(egraph, s, "?o") else { return None };
    let fused = Op::MatMulActGrad { act: *act, transpose_b };
    shape(egraph, s[var("?w")]).is_some_and(|w| w.len() == 2).then(|| vec![("?f", AttrValue::Op(fused))])
}

/// The slice `?s` keeps all of `?x`.
fn is_whole(egraph: &mut KGraph, id: Id, subst: &Subst) -> bool {
    matches!((shape(egraph, subst[var("?x")]), shape(egraph, id)), (Some(x), Some(y)) if x == y)
}

#[rustfmt::skip]
pub fn rules() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // sum_b (a_b^T @ d_b) = contract_rows(a, d)       (a [b, r, k], d [b, r, n])
        rw!("weight-grad-rows"; "(reshape ?r (sum_axis ?n (matmul (permute ?p ?a) ?b)))"
                             => "(contract_rows ?a ?b)" if is_batch_sum_of_row_products),
        // (a^T b)^T = b^T a
        rw!("weight-grad-transposed"; "(permute ?p (contract_rows ?a ?b))"
                                   => "(contract_rows ?b ?a)" if swaps_two_axes("?p")),
        // x @ (W^T) = x @^T W                              (W a matrix: the input's gradient)
        rw!("matmul-transposed-weight"; "(matmul ?x (permute ?p ?w))"
                                     => "(matmul_t ?x ?w)" if transposes_matrix("?p", "?w")),
        // norm_grad(x, g, dy) + r = norm_grad(x, g, dy, r)  (r: the residual path's gradient to x)
        rw!("norm-grad-residual"; "(add (norm_grad ?o ?x ?g ?dy none) ?r)"
                               => "(norm_grad ?o ?x ?g ?dy ?r)" if residual_of_input),
        rw!("norm-grad-residual-left"; "(add ?r (norm_grad ?o ?x ?g ?dy none))"
                                    => "(norm_grad ?o ?x ?g ?dy ?r)" if residual_of_input),
        // [a^T x; b^T x] = [a b]^T x                        (the weight gradients of projections
        //                                                   of one input x, stacked by rows)
        rw!("weight-grads-stacked"; "(concat (contract_rows ?a ?x) (contract_rows ?b ?x))"
                                 => "(contract_rows (append ?a ?b) ?x)" if stack_columns),
        // a W[r1] + b W[r2] = [a b] W[r1 r2]                 (the input gradient of projections by
        //                                                   adjacent row slices r1, r2 of one W)
        rw!("input-grads-stacked"; "(add (matmul ?a (slice ?s1 ?w)) (matmul ?b (slice ?s2 ?w)))"
                                => { derive("(matmul (append ?a ?b) (slice ?s12 ?w))", adjacent_rows) }),
        rw!("input-grads-stacked-r"; "(add (matmul ?b (slice ?s2 ?w)) (matmul ?a (slice ?s1 ?w)))"
                                  => { derive("(matmul (append ?a ?b) (slice ?s12 ?w))", adjacent_rows) }),
        // [a [b c]] = [[a b] c]                              (one association, so the stacks the
        //                                                   two rules above make are one value)
        rw!("append-assoc"; "(append ?a (append ?b ?c))" => "(append (append ?a ?b) ?c)"),
        // reshape([n], sum_1(sum_0(x))) = sum_rows(x)       (x [b, s, n]: a bias's gradient)
        rw!("bias-grad-rows"; "(reshape ?r (sum_axis ?n1 (sum_axis ?n0 ?x)))"
                           => "(sum_rows ?x)" if sums_leading_axes),
        // act_grad(x, dy @ W) = matmul_act_grad(dy, W, x)   (W a matrix: the input gradient of
        //                                                   the projection an activation feeds)
        rw!("act-grad-epilogue"; "(opaque ?o ?x (matmul ?dy ?w))"
                              => { derive("(opaque ?f ?dy ?w ?x)", |g, _, s| act_grad_of_product(g, s, false)) }),
        rw!("act-grad-epilogue-t"; "(opaque ?o ?x (matmul_t ?dy ?w))"
                                => { derive("(opaque ?f ?dy ?w ?x)", |g, _, s| act_grad_of_product(g, s, true)) }),
        // x[all rows] = x
        rw!("slice-whole"; "(slice ?s ?x)" => "?x" if is_whole),
        // s + gather_grad(t, ids, dy) = gather_grad(t, ids, dy, s)   (a tied table's two
        //                                                   gradients summed as the scatter's start)
        rw!("gather-grad-base"; "(add ?s (opaque ?o ?t ?ids ?dy))"
                             => "(opaque ?o ?t ?ids ?dy ?s)" if is_gather_grad_of_shape),
        rw!("gather-grad-base-r"; "(add (opaque ?o ?t ?ids ?dy) ?s)"
                               => "(opaque ?o ?t ?ids ?dy ?s)" if is_gather_grad_of_shape),
    ]
}
