//! Head rules: the split → transpose (→ per-head RMSNorm) (→ rotate) (→ append to a cache) chain
//! that a decoder runs for each of its queries, keys and values becomes one `heads` op, which
//! reads the heads in place out of the (merged) projection. With Q/K/V merged by
//! `shared-input-merge`, a step's attention sublayer is then one projection, three `heads` and
//! one `attention`, query/key norms (Gemma 3, Qwen3, OLMo2) included.

use super::*;
use egg::rewrite as rw;

#[rustfmt::skip]
pub fn rules() -> Vec<Rewrite<Kl, KAnalysis>> {
    vec![
        // split_heads(x[:, :, a..b]) = heads(x) at column a
        rw!("heads-split";        "(permute ?p (reshape ?r (slice ?s ?x)))"
                               => { derive("(heads ?cfg none ?x none)", split_slice) }),
        // split_heads(x) = heads(x) at column 0
        rw!("heads-split-whole";  "(permute ?p (reshape ?r ?x))"
                               => { derive("(heads ?cfg none ?x none)", split_whole) }),
        // rms_norm(heads(x), g) = heads(x, g), each head normalized as it is read
        rw!("heads-norm";         "(rms_norm ?e (heads ?h none ?x none) ?g)"
                               => { derive("(heads ?cfg none ?x ?g)", normalized) }),
        // rope(heads(x)) = heads(x), rotated as they are read (after their norm)
        rw!("heads-rope";         "(rope ?ro (heads ?h none ?x ?g))"
                               => { derive("(heads ?cfg none ?x ?g)", rotated) }),
        // append(past, heads(x)) = heads(past, x)
        rw!("heads-append";       "(append ?past (heads ?h none ?x ?g))"
                               => "(heads ?h ?past ?x ?g)"),
    ]
}

/// `[b, s, heads, head_dim]` of a reshape followed by the `[0, 2, 1, 3]` transpose.
fn split(egraph: &KGraph, s: &Subst) -> Option<(usize, usize)> {
    let Op::Permute { perm } = op_of(egraph, s, "?p")? else { return None };
    let Op::Reshape { shape: r } = op_of(egraph, s, "?r")? else { return None };
    match (perm.as_slice(), r.as_slice()) {
        ([0, 2, 1, 3], [_, _, Dim::Fixed(heads), Dim::Fixed(head_dim)]) if *heads > 0 && *head_dim > 0 => {
            Some((*heads, *head_dim))
        }
        _ => None,
    }
}

fn heads_op(start: usize, heads: usize, head_dim: usize) -> Vec<(&'static str, AttrValue)> {
    vec![("?cfg", AttrValue::Op(Op::Heads { start, heads, head_dim, norm: None, rope: None }))]
}

/// The split of a slice of the last axis of a `[b, s, width]` tensor.
fn split_slice(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (heads, head_dim) = split(egraph, s)?;
    let Op::Slice { axis: 2, start, len } = op_of(egraph, s, "?s")? else { return None };
    let x = shape(egraph, s[var("?x")])?;
    (x.len() == 3 && *len == heads * head_dim).then(|| heads_op(*start, heads, head_dim))
}

/// The split of a whole `[b, s, heads * head_dim]` tensor.
fn split_whole(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let (heads, head_dim) = split(egraph, s)?;
    let x = shape(egraph, s[var("?x")])?;
    matches!(x.as_slice(), [_, _, last] if *last == Dim::Fixed(heads * head_dim)).then(|| heads_op(0, heads, head_dim))
}

/// Heads with the rotation of `?ro` (over the whole head's leading `rotary_dim` columns).
fn rotated(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let Op::Heads { start, heads, head_dim, norm, rope: None } = *op_of(egraph, s, "?h")? else { return None };
    let Op::Rope { theta, rotary_dim, style } = *op_of(egraph, s, "?ro")? else { return None };
    let rope = Some(crate::graph::Rotation { theta, rotary_dim, style });
    Some(vec![("?cfg", AttrValue::Op(Op::Heads { start, heads, head_dim, norm, rope }))])
}

/// Heads normalized with the RMSNorm of epsilon `?e` and gain `?g` (`[head_dim]`: the norm is
/// over each head).
fn normalized(egraph: &KGraph, _: Id, s: &Subst) -> Option<Vec<(&'static str, AttrValue)>> {
    let Op::Heads { start, heads, head_dim, norm: None, rope: None } = *op_of(egraph, s, "?h")? else {
        return None;
    };
    let eps = scalar_of(egraph, s, "?e")?;
    let gain = shape(egraph, s[var("?g")])?;
    (gain.as_slice() == [Dim::Fixed(head_dim)])
        .then(|| vec![("?cfg", AttrValue::Op(Op::Heads { start, heads, head_dim, norm: Some(eps), rope: None }))])
}
