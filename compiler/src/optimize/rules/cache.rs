//! Head rules: the split → transpose (→ per-head RMSNorm) (→ rotate) (→ append to a cache) chain
//! that a decoder runs for each of its queries, keys and values becomes one `heads` op, which
//! reads the heads in place out of the (merged) projection. With Q/K/V merged by
//! `shared-input-merge`, a step's attention sublayer is then one projection, three `heads` and
//! one `attention`, query/key norms (Gemma 3, Qwen3, OLMo2) included.
//!
//! Without query/key norms the rotation then moves into the projection's epilogue
//! (`attention-cached-rope`): the step's attention reads its rotated queries in place out of the
//! projection (a cached `packed_attention`) and the keys and values out of the caches that two
//! plain `heads` appends fill from the same projection (`attention-cached`, where nothing is
//! rotated). The WGSL back end then runs those appends in the attention's own dispatch.

use super::*;
use crate::graph::{PackedAttention, RopeCols, Rotation};
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
        // attention(rope(q of P), past_k ++ rope(k of P), past_v ++ v of P), P = x W^T:
        // P' = rope(x W^T) over the query and key columns; packed_attention over P' (its queries
        // read in place) and the caches past_k ++ k of P', past_v ++ v of P' (the presents,
        // rewritten too)
        rw!("attention-cached-rope";
            "(attention ?f ?al ?c ?wn ?sm (heads ?hq none (matmul_t ?x ?w) none) (heads ?hk ?pk (matmul_t ?x ?w) none) (heads ?hv ?pv (matmul_t ?x ?w) none) ?m ?t)"
            => { Cached { bias: false, rope: true } }),
        rw!("attention-cached-rope-bias";
            "(attention ?f ?al ?c ?wn ?sm (heads ?hq none (linear none ?x ?w ?b none) none) (heads ?hk ?pk (linear none ?x ?w ?b none) none) (heads ?hv ?pv (linear none ?x ?w ?b none) none) ?m ?t)"
            => { Cached { bias: true, rope: true } }),
        // The same without rotations (learned or no positions, ALiBi): only the attention is
        // rewritten, its queries read in place out of the projection the caches append from.
        rw!("attention-cached";
            "(attention ?f ?al ?c ?wn ?sm (heads ?hq none (matmul_t ?x ?w) none) (heads ?hk ?pk (matmul_t ?x ?w) none) (heads ?hv ?pv (matmul_t ?x ?w) none) ?m ?t)"
            => { Cached { bias: false, rope: false } }),
        rw!("attention-cached-bias";
            "(attention ?f ?al ?c ?wn ?sm (heads ?hq none (linear none ?x ?w ?b none) none) (heads ?hk ?pk (linear none ?x ?w ?b none) none) (heads ?hv ?pv (linear none ?x ?w ?b none) none) ?m ?t)"
            => { Cached { bias: true, rope: false } }),
    ]
}

/// The applier of `attention-cached-rope`: a decoder step's attention whose query and key heads
/// are rotated as they are read out of one (merged) projection and whose keys and values are
/// appended to caches. It rewrites three classes: the attention, and the two presents (the key
/// cache now appends the projection's already rotated key columns). Fires when the query and key
/// heads are adjacent columns with one rotation, the value heads unrotated, and nothing normalizes
/// the heads (a query/key norm comes before the rotation, so the rotation cannot move into the
/// projection). Without `rope` (`attention-cached`), when no head is rotated: the attention alone.
struct Cached {
    bias: bool,
    rope: bool,
}

impl Applier<Kl, KAnalysis> for Cached {
    fn apply_one(&self, egraph: &mut KGraph, eclass: Id, s: &Subst, _: Option<&PatternAst<Kl>>, _: Symbol) -> Vec<Id> {
        self.rewrite(egraph, eclass, s).unwrap_or_default()
    }
}

impl Cached {
    fn rewrite(&self, egraph: &mut KGraph, attention: Id, s: &Subst) -> Option<Vec<Id>> {
        let heads = |v: &str| match op_of(egraph, s, v)? {
            Op::Heads { start, heads, head_dim, norm: None, rope } => Some((*start, *heads, *head_dim, *rope)),
            _ => None,
        };
        let ((q, h, d, qr), (k, kv, kd, kr), (v, vh, vd, vr)) = (heads("?hq")?, heads("?hk")?, heads("?hv")?);
        let rot = match (qr, kr, vr) {
            (Some(r), Some(k), None) if self.rope && k == r => Some(r),
            (None, None, None) if !self.rope => None,
            _ => return None,
        };
        let geometry_ok = kv > 0 && h % kv == 0 && vh == kv && kd == d && vd == d;
        if !geometry_ok
            || d > egraph.analysis.max_attention_head_dim
            || is_none(egraph, s, "?pk")
            || is_none(egraph, s, "?pv")
        {
            return None;
        }
        let AttrValue::F(scale) = *attr_of(egraph, s, "?f")? else { return None };
        let (AttrValue::Bool(alibi), AttrValue::Bool(causal), AttrValue::Window(window), AttrValue::Scores(mods)) = (
            attr_of(egraph, s, "?al")?,
            attr_of(egraph, s, "?c")?,
            attr_of(egraph, s, "?wn")?,
            attr_of(egraph, s, "?sm")?,
        ) else {
            return None;
        };
        let packed = Op::PackedAttention(PackedAttention {
            scale,
            alibi: *alibi,
            causal: *causal,
            window: *window,
            mods: *mods,
            heads: h,
            kv_heads: kv,
            head_dim: d,
            q,
            k,
            v,
            cached: true,
            appends: false,
        });
        let (x, w) = (s[var("?x")], s[var("?w")]);
        let none = egraph.add(Kl::None);
        let bias = if self.bias { s[var("?b")] } else { none };
        // The classes matched below the attention: the projection and the two presents.
        let projection = if self.bias {
            egraph.lookup(Kl::Linear([none, x, w, bias, none]))?
        } else {
            egraph.lookup(Kl::MatMulT([x, w]))?
        };
        let (pk, pv) = (s[var("?pk")], s[var("?pv")]);
        let present_k = egraph.lookup(Kl::Heads([s[var("?hk")], pk, projection, none]))?;
        let present_v = egraph.lookup(Kl::Heads([s[var("?hv")], pv, projection, none]))?;

        let attr = |egraph: &mut KGraph, value: AttrValue| {
            let a = egraph.analysis.intern(value);
            egraph.add(Kl::Attr(a))
        };
        let extra = [s[var("?m")], s[var("?t")]].into_iter().filter(|&c| !super::super::lang::is_none(egraph, c));
        let extra: Vec<Id> = extra.collect();
        let Some(Rotation { theta, rotary_dim, style }) = rot else {
            // Nothing to rotate: the queries read in place out of the projection the caches
            // append from.
            let mut children = vec![attr(egraph, AttrValue::Op(packed)), projection, present_k, present_v];
            children.extend(extra);
            let fused_node = Kl::Opaque(children.into_boxed_slice());
            let fused = egraph.add(fused_node.clone());
            if !egraph.union(attention, fused) {
                return Some(Vec::new());
            }
            // The appends pay with the attention when they read the same projection (not a
            // slice of it, which a tree extraction may find as cheap).
            let appends = [(present_k, s[var("?hk")], pk), (present_v, s[var("?hv")], pv)]
                .map(|(class, op, past)| (class, Kl::Heads([op, past, projection, none])));
            let mut group = vec![(attention, fused_node)];
            group.extend(appends);
            egraph.analysis.groups.push(group);
            return Some(vec![attention]);
        };
        // The rotated columns: the query and key heads, adjacent.
        let start = if k == q + h * d {
            q
        } else if q == k + kv * d {
            k
        } else {
            return None;
        };
        let rope = RopeCols { theta, rotary_dim, style, head_dim: d, start, len: (h + kv) * d };
        let lin = Op::Linear { act: None, bias: self.bias, residual: false, norm: None, glu: false, rope: Some(rope) };
        let lin = attr(egraph, AttrValue::Op(lin));
        let rotated = egraph.add(Kl::XLinear([lin, x, none, none, w, bias, none]));
        let append = |egraph: &mut KGraph, start: usize, past: Id| {
            let op = attr(egraph, AttrValue::Op(Op::Heads { start, heads: kv, head_dim: d, norm: None, rope: None }));
            let node = Kl::Heads([op, past, rotated, none]);
            (egraph.add(node.clone()), node)
        };
        let ((k_new, k_node), (v_new, v_node)) = (append(egraph, k, pk), append(egraph, v, pv));
        let mut children = vec![attr(egraph, AttrValue::Op(packed)), rotated, k_new, v_new];
        children.extend(extra);
        let fused_node = Kl::Opaque(children.into_boxed_slice());
        let fused = egraph.add(fused_node.clone());
        let mut changed = Vec::new();
        for (class, new) in [(present_k, k_new), (present_v, v_new), (attention, fused)] {
            if egraph.union(class, new) {
                changed.push(class);
            }
        }
        if !changed.is_empty() {
            // The three pay only together: the projection's rotation serves all of them.
            egraph.analysis.groups.push(vec![(present_k, k_node), (present_v, v_node), (attention, fused_node)]);
        }
        Some(changed)
    }
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
