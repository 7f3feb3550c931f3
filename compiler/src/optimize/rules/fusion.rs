//! Fusion rules: epilogues into `linear`, scale + mask + softmax into `masked_softmax`, the whole
//! attention into `attention` (or `packed_attention`, reading a merged Q/K/V projection in place,
//! with RoPE moved into that projection's epilogue), and gated feed-forward projections.
//! `a0` = false, `a1` = true, `a2` = no window, `a3` = plain scores (see `optimize::FALSE`).

use super::*;
use crate::graph::{BlockPattern, Bucketing, PackedAttention, ScoreMods};
use egg::rewrite as rw;

/// Matmul epilogues.
#[rustfmt::skip]
pub fn linear() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // x @ W^T = linear(x, W)                       (W a 2-D weight)
        rw!("matmul-to-linear";  "(matmul_t ?x ?w)"
                              => "(linear none ?x ?w none none)" if is_matrix("?w")),
        // linear(x, W) + b = linear(x, W, b)            (b of shape [rows of W])
        rw!("linear-bias";       "(add (linear none ?x ?w none none) ?b)"
                              => "(linear none ?x ?w ?b none)" if is_bias_of("?b", "?w")),
        // act(linear(x, W, b)) = linear_act(x, W, b)
        rw!("linear-act";        "(act ?k (linear none ?x ?w ?b none))"
                              => "(linear ?k ?x ?w ?b none)"),
        // r + linear(...) = linear(..., residual r)      (r of the output's shape)
        rw!("linear-residual";   "(add ?r (linear ?a ?x ?w ?b none))"
                              => "(linear ?a ?x ?w ?b ?r)" if same_shape_as_match("?r")),
        // linear(...) + r = linear(..., residual r)
        rw!("linear-residual-r"; "(add (linear ?a ?x ?w ?b none) ?r)"
                              => "(linear ?a ?x ?w ?b ?r)" if same_shape_as_match("?r")),
    ]
}

/// Softmax and attention fusions.
#[rustfmt::skip]
pub fn attention() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // softmax(mask(s * f)) = masked_softmax(s)
        rw!("masked-softmax";         "(softmax (mask ?c ?wn (scale ?f ?s) ?m))"
                                   => "(masked_softmax ?f a0 ?c ?wn a3 ?s ?m none)" if is_scores("?s")),
        // softmax(mask(alibi(s * f))) = masked_softmax(s, alibi)
        rw!("masked-softmax-alibi";   "(softmax (mask ?c ?wn (alibi (scale ?f ?s)) ?m))"
                                   => "(masked_softmax ?f a1 ?c ?wn a3 ?s ?m none)" if is_scores("?s")),
        // softmax(s * f) = masked_softmax(s) with nothing masked
        rw!("scaled-softmax";         "(softmax (scale ?f ?s))"
                                   => "(masked_softmax ?f a0 a0 a2 a3 ?s none none)" if is_scores("?s")),
        // softmax(alibi(s * f)) = masked_softmax(s, alibi) with nothing masked
        rw!("scaled-softmax-alibi";   "(softmax (alibi (scale ?f ?s)))"
                                   => "(masked_softmax ?f a1 a0 a2 a3 ?s none none)" if is_scores("?s")),
        // softmax(mask(softcap(s * f))) = masked_softmax(s, softcap)
        rw!("masked-softmax-softcap"; "(softmax (mask ?c ?wn (opaque ?sc (scale ?f ?s)) ?m))"
                                   => { derive("(masked_softmax ?f a0 ?c ?wn ?sm ?s ?m none)", softcap) }),
        // softmax(softcap(s * f)) = masked_softmax(s, softcap) with nothing masked
        rw!("scaled-softmax-softcap"; "(softmax (opaque ?sc (scale ?f ?s)))"
                                   => { derive("(masked_softmax ?f a0 a0 a2 ?sm ?s none none)", softcap) }),
        // softmax(mask(s * f + relative_bias(T))) = masked_softmax(s, bias from T)
        rw!("masked-softmax-relative"; "(softmax (mask ?c ?wn (add (scale ?f ?s) (opaque ?rb ?t)) ?m))"
                                   => { derive("(masked_softmax ?f a0 ?c ?wn ?sm ?s ?m ?t)", relative) }),
        // softmax(s * f + relative_bias(T)) = masked_softmax(s, bias from T) with nothing masked
        rw!("scaled-softmax-relative"; "(softmax (add (scale ?f ?s) (opaque ?rb ?t)))"
                                   => { derive("(masked_softmax ?f a0 a0 a2 ?sm ?s none ?t)", relative) }),
        // softmax(block_sparse_mask(s * f, m)) = masked_softmax(s, block pattern, m)
        rw!("sparse-softmax";         "(softmax (opaque ?bs (scale ?f ?s) ?m))"
                                   => { derive("(masked_softmax ?f a0 a0 a2 ?sm ?s ?m none)", sparse) }),
        // softmax(block_sparse_mask(s * f)) = masked_softmax(s, block pattern)
        rw!("sparse-softmax-unmasked"; "(softmax (opaque ?bs (scale ?f ?s)))"
                                   => { derive("(masked_softmax ?f a0 a0 a2 ?sm ?s none none)", sparse) }),
        // merge_heads(masked_softmax(q k^T) v) = attention(q, k, v)
        rw!("attention";              "(reshape ?r (permute ?p (matmul (masked_softmax ?f ?al ?c ?wn ?sm (matmul_t ?q ?k) ?m ?t) ?v)))"
                                   => "(attention ?f ?al ?c ?wn ?sm ?q ?k ?v ?m ?t)" if merges_heads("?p", "?q")),
        // the same with grouped key/value heads repeated: the fused kernel indexes kv heads itself
        rw!("attention-gqa";          "(reshape ?r (permute ?p (matmul (masked_softmax ?f ?al ?c ?wn ?sm (matmul_t ?q (repeat_heads ?n ?k)) ?m ?t) (repeat_heads ?n ?v))))"
                                   => "(attention ?f ?al ?c ?wn ?sm ?q ?k ?v ?m ?t)" if merges_heads("?p", "?q")),
        // attention over head splits of column slices of one projection = packed attention on it
        rw!("attention-packed";       "(attention ?f ?al ?c ?wn ?sm (permute ?p (reshape ?rq (slice ?sq ?C))) (permute ?p (reshape ?rk (slice ?sk ?C))) (permute ?p (reshape ?rv (slice ?sv ?C))) ?m ?t)"
                                   => { derive("(packed_attention ?cfg ?C ?m ?t)", packed) }),
        // the same with RoPE on the query and key heads: the rotation moves into the projection
        rw!("attention-packed-rope";  "(attention ?f ?al ?c ?wn ?sm (rope ?ro (permute ?p (reshape ?rq (slice ?sq (matmul_t ?x ?w))))) (rope ?ro (permute ?p (reshape ?rk (slice ?sk (matmul_t ?x ?w))))) (permute ?p (reshape ?rv (slice ?sv (matmul_t ?x ?w)))) ?m ?t)"
                                   => { derive("(packed_attention ?cfg (xlinear ?lin ?x none none ?w none none) ?m ?t)", packed_rope) }),
        rw!("attention-packed-rope-bias"; "(attention ?f ?al ?c ?wn ?sm (rope ?ro (permute ?p (reshape ?rq (slice ?sq (linear none ?x ?w ?b none))))) (rope ?ro (permute ?p (reshape ?rk (slice ?sk (linear none ?x ?w ?b none))))) (permute ?p (reshape ?rv (slice ?sv (linear none ?x ?w ?b none)))) ?m ?t)"
                                   => { derive("(packed_attention ?cfg (xlinear ?lin ?x none none ?w ?b none) ?m ?t)", packed_rope) }),
        // heads(x)^T E[..n] transposed back = low_rank(x, E): a Linformer projection in one kernel
        rw!("low-rank";               "(permute ?p2 (matmul (permute ?p1 (reshape ?r ?x)) (opaque ?tr ?e)))"
                                   => { derive("(opaque ?cfg ?x ?e)", |e, _, s| low_rank(e, s, false)) }),
        // the same over a column slice of a merged projection, read in place
        rw!("low-rank-slice";         "(permute ?p2 (matmul (permute ?p1 (reshape ?r (slice ?sl ?x))) (opaque ?tr ?e)))"
                                   => { derive("(opaque ?cfg ?x ?e)", |e, _, s| low_rank(e, s, true)) }),
        // act(x Wg^T) * (x Wu^T), Wg and Wu the halves of one stacked weight = gated linear
        rw!("gated-linear";           "(mul (act ?k (slice ?s1 (matmul_t ?x ?w))) (slice ?s2 (matmul_t ?x ?w)))"
                                   => { derive("(xlinear ?cfg ?x none none ?w none none)", gated) }),
        rw!("gated-linear-bias";      "(mul (act ?k (slice ?s1 (linear none ?x ?w ?b none))) (slice ?s2 (linear none ?x ?w ?b none)))"
                                   => { derive("(xlinear ?cfg ?x none none ?w ?b none)", gated) }),
    ]
}

/// The score modifiers `?sm` of a `*-softcap` match: the soft-cap of the opaque op `?sc`.
fn softcap(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let Op::SoftCap { cap } = op_of(egraph, s, "?sc")? else { return None };
    scores(egraph, s)?;
    Some(vec![("?sm", AttrValue::Scores(ScoreMods { softcap: Some(*cap), ..ScoreMods::default() }))])
}

/// The score modifiers of a `*-relative` match: the bucketing of the relative bias `?rb`, whose
/// query and key lengths must be the scores'.
fn relative(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let op = op_of(egraph, s, "?rb")?;
    let Op::RelativeBias { q, k, .. } = op else { return None };
    match scores(egraph, s)? {
        [_, _, sq, sk] if sq == q && sk == k => {}
        _ => return None,
    }
    Some(vec![("?sm", AttrValue::Scores(ScoreMods { relative: Bucketing::of(op), ..ScoreMods::default() }))])
}

/// The score modifiers of a `sparse-softmax*` match: the block pattern of `?bs`.
fn sparse(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let sparse = Some(BlockPattern::of(op_of(egraph, s, "?bs")?)?);
    scores(egraph, s)?;
    Some(vec![("?sm", AttrValue::Scores(ScoreMods { sparse, ..ScoreMods::default() }))])
}

/// The low-rank projection of a `low-rank*` match: `?p1` moves the sequence last, `?p2` swaps
/// the result's last two axes, `?r` splits `?x`'s (or its column slice `?sl`'s) last axis into
/// heads, and `?tr` cuts `?e` to the sequence.
fn low_rank(egraph: &KGraph, s: &Subst, sliced: bool) -> Option<Vec<(&'static str, AttrValue)>> {
    let (Op::Permute { perm: p1 }, Op::Permute { perm: p2 }) = (op_of(egraph, s, "?p1")?, op_of(egraph, s, "?p2")?)
    else {
        return None;
    };
    let Op::Reshape { shape: r } = op_of(egraph, s, "?r")? else { return None };
    let Op::Truncate { len } = op_of(egraph, s, "?tr")? else { return None };
    let x = shape(egraph, s[var("?x")])?;
    let e = shape(egraph, s[var("?e")])?;
    let (start, cols) = if sliced {
        let &Op::Slice { axis: 2, start, len } = op_of(egraph, s, "?sl")? else { return None };
        (start, len)
    } else {
        let Some(Dim::Fixed(w)) = x.get(2) else { return None };
        (0, *w)
    };
    let ([b, n, Dim::Fixed(_)], [rb, rn, Dim::Fixed(heads), Dim::Fixed(head_dim)], [_, _]) =
        (x.as_slice(), r.as_slice(), e.as_slice())
    else {
        return None;
    };
    let ok = p1 == &[0, 2, 3, 1] && p2 == &[0, 1, 3, 2] && rb == b && rn == n && len == n && heads * head_dim == cols;
    let op = Op::LowRank { start, heads: *heads, head_dim: *head_dim };
    ok.then(|| vec![("?cfg", AttrValue::Op(op))])
}

/// The shape of the scores `?s`, when they are a rank-4 `[b, h, q, k]` tensor.
fn scores<'a>(egraph: &'a KGraph, s: &Subst) -> Option<&'a [Dim]> {
    shape(egraph, s[var("?s")]).map(Vec::as_slice).filter(|sh| sh.len() == 4)
}

/// Columns `start .. start + heads * head_dim` of the last axis, split as heads by the reshape:
/// `(start, heads)` when `?s` slices the last axis and `?r` splits it into `[.., heads, head_dim]`.
fn heads_of(egraph: &KGraph, s: &Subst, slice: &str, reshape: &str, head_dim: usize) -> Option<(usize, usize)> {
    let Op::Slice { axis, start, len } = op_of(egraph, s, slice)? else { return None };
    let Op::Reshape { shape: r } = op_of(egraph, s, reshape)? else { return None };
    // The reshape splits the sliced (last) axis into [heads, head_dim].
    let ok = r.len() == axis + 2
        && r.get(axis + 1) == Some(&Dim::Fixed(head_dim))
        && r.get(*axis) == Some(&Dim::Fixed(len / head_dim.max(1)))
        && len % head_dim.max(1) == 0;
    ok.then_some((*start, len / head_dim))
}

/// The packed attention configuration of an `attention-packed*` match, if the three slices are
/// head splits of one `[b, s, width]` projection (a self-attention: one tensor, one sequence).
fn packed_config(egraph: &KGraph, s: &Subst) -> Option<Op> {
    let Op::Permute { perm } = op_of(egraph, s, "?p")? else { return None };
    let Op::Reshape { shape: rq } = op_of(egraph, s, "?rq")? else { return None };
    let Some(Dim::Fixed(head_dim)) = rq.last().copied() else { return None };
    if perm != &[0, 2, 1, 3] || head_dim > egraph.analysis.max_attention_head_dim {
        return None;
    }
    let (q, heads) = heads_of(egraph, s, "?sq", "?rq", head_dim)?;
    let (k, kv_heads) = heads_of(egraph, s, "?sk", "?rk", head_dim)?;
    let (v, kv2) = heads_of(egraph, s, "?sv", "?rv", head_dim)?;
    if kv2 != kv_heads || kv_heads == 0 || heads % kv_heads != 0 {
        return None;
    }
    let AttrValue::F(scale) = attr_of(egraph, s, "?f")? else { return None };
    let (AttrValue::Bool(alibi), AttrValue::Bool(causal), AttrValue::Window(window), AttrValue::Scores(mods)) =
        (attr_of(egraph, s, "?al")?, attr_of(egraph, s, "?c")?, attr_of(egraph, s, "?wn")?, attr_of(egraph, s, "?sm")?)
    else {
        return None;
    };
    Some(Op::PackedAttention(PackedAttention {
        scale: *scale,
        alibi: *alibi,
        causal: *causal,
        window: *window,
        mods: *mods,
        heads,
        kv_heads,
        head_dim,
        q,
        k,
        v,
        cached: false,
        appends: false,
    }))
}

fn packed(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    Some(vec![("?cfg", AttrValue::Op(packed_config(egraph, s)?))])
}

/// As [`packed`], plus the projection rotating the query and key columns, which must be adjacent.
fn packed_rope(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let cfg = packed_config(egraph, s)?;
    let Op::PackedAttention(PackedAttention { heads, kv_heads, head_dim, q, k, .. }) = cfg else { return None };
    let Op::Rope { theta, rotary_dim, style } = op_of(egraph, s, "?ro")? else { return None };
    let (start, len) = if k == q + heads * head_dim {
        (q, (heads + kv_heads) * head_dim)
    } else if q == k + kv_heads * head_dim {
        (k, (heads + kv_heads) * head_dim)
    } else {
        return None;
    };
    let rope = crate::graph::RopeCols { theta: *theta, rotary_dim: *rotary_dim, style: *style, head_dim, start, len };
    let lin = Op::Linear { act: None, bias: false, residual: false, norm: None, glu: false, rope: Some(rope) };
    Some(vec![("?cfg", AttrValue::Op(cfg)), ("?lin", AttrValue::Op(lin))])
}

/// A gated projection when `?s1` is the first and `?s2` the second half of `?w`'s rows.
fn gated(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (Op::Slice { axis: a1, start: 0, len: n1 }, Op::Slice { axis: a2, start, len: n2 }) =
        (op_of(egraph, s, "?s1")?, op_of(egraph, s, "?s2")?)
    else {
        return None;
    };
    let w = fixed(shape(egraph, s[var("?w")])?)?;
    let x = shape(egraph, s[var("?x")])?;
    let w_ok = matches!(w.as_slice(), [rows, _] if *rows == 2 * n1);
    let ok = a1 == a2 && *a1 + 1 == x.len() && n1 == n2 && start == n1 && w_ok;
    let AttrValue::Act(act) = attr_of(egraph, s, "?k")? else { return None };
    let lin = Op::Linear { act: Some(*act), bias: false, residual: false, norm: None, glu: true, rope: None };
    ok.then(|| vec![("?cfg", AttrValue::Op(lin))])
}
