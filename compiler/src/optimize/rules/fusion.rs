//! Fusion rules: epilogues into `linear`, scale + mask + softmax into `masked_softmax`, and the whole
//! attention into `attention`. `a0` = false, `a1` = true, `a2` = no window (see `optimize::FALSE`).

use super::*;
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
                                   => "(masked_softmax ?f a0 ?c ?wn ?s ?m)" if is_scores("?s")),
        // softmax(mask(alibi(s * f))) = masked_softmax(s, alibi)
        rw!("masked-softmax-alibi";   "(softmax (mask ?c ?wn (alibi (scale ?f ?s)) ?m))"
                                   => "(masked_softmax ?f a1 ?c ?wn ?s ?m)" if is_scores("?s")),
        // softmax(s * f) = masked_softmax(s) with nothing masked
        rw!("scaled-softmax";         "(softmax (scale ?f ?s))"
                                   => "(masked_softmax ?f a0 a0 a2 ?s none)" if is_scores("?s")),
        // softmax(alibi(s * f)) = masked_softmax(s, alibi) with nothing masked
        rw!("scaled-softmax-alibi";   "(softmax (alibi (scale ?f ?s)))"
                                   => "(masked_softmax ?f a1 a0 a2 ?s none)" if is_scores("?s")),
        // merge_heads(masked_softmax(q k^T) v) = attention(q, k, v)
        rw!("attention";              "(reshape ?r (permute ?p (matmul (masked_softmax ?f ?al ?c ?wn (matmul_t ?q ?k) ?m) ?v)))"
                                   => "(attention ?f ?al ?c ?wn ?q ?k ?v ?m)" if merges_heads("?p", "?q")),
        // the same with grouped key/value heads repeated: the fused kernel indexes kv heads itself
        rw!("attention-gqa";          "(reshape ?r (permute ?p (matmul (masked_softmax ?f ?al ?c ?wn (matmul_t ?q (repeat_heads ?t ?k)) ?m) (repeat_heads ?t ?v))))"
                                   => "(attention ?f ?al ?c ?wn ?q ?k ?v ?m)" if merges_heads("?p", "?q")),
    ]
}
