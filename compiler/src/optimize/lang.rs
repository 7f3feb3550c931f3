//! The e-graph language: [`Kl`], one e-node per graph op, every op attribute an interned [`Attr`]
//! leaf standing for an [`AttrValue`] (so rewrite rules are plain s-expression patterns whose
//! variables range over attributes too; [`FALSE`], [`TRUE`], [`NO_WINDOW`] and [`PLAIN_SCORES`] are interned up front
//! so patterns can name them); and the translation between graph ops and e-nodes: [`to_op`] reads
//! the op an e-node stands for, `add_op` adds a graph node's op, and `attr`, `is_none` and the other
//! attribute readers serve both and the rules' side conditions.

#![expect(
    clippy::indexing_slicing,
    reason = "`to_op` slices an opaque node's children after reading its first, the op attribute"
)]

use super::KGraph;
use crate::graph::Activation;
use crate::graph::{Node, Op, Scalar, ScoreMods, Shape};
use crate::tensor::DType;
use egg::Id;
use std::fmt;
use std::str::FromStr;

/// An interned attribute: an index into [`KAnalysis::attrs`](super::KAnalysis::attrs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attr(pub u32);

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

impl FromStr for Attr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.strip_prefix('a').and_then(|n| n.parse().ok()).map(Attr).ok_or_else(|| format!("not an attribute: {s}"))
    }
}

/// What an attribute leaf stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AttrValue {
    /// A flag (causal, alibi, rms).
    Bool(bool),
    /// A float (scale factor, eps).
    F(Scalar),
    /// An optional window size.
    Window(Option<usize>),
    /// An activation.
    Act(Activation),
    /// A count (repeat times).
    Count(usize),
    /// What a fused softmax does to its scores besides scale, ALiBi and mask.
    Scores(ScoreMods),
    /// A whole op whose attributes rules do not inspect (permute, reshape, opaque ops).
    Op(Op),
    /// A leaf tensor: a parameter, an input or positions, with its type.
    Leaf(Op, Shape, DType),
}

/// Attributes interned up front so patterns can name them: `a0` = false, `a1` = true, `a2` = no
/// window, `a3` = plain scores (no [`ScoreMods`]).
pub const FALSE: &str = "a0";
/// See [`FALSE`].
pub const TRUE: &str = "a1";
/// See [`FALSE`].
pub const NO_WINDOW: &str = "a2";
/// See [`FALSE`].
pub const PLAIN_SCORES: &str = "a3";

pub use kl::Kl;

/// The language, in its own module so the generated variants can go undocumented here: each is
/// documented by the comment on its line.
#[allow(missing_docs)]
mod kl {
    use super::Attr;
    use egg::{Id, define_language};

    define_language! {
        /// The e-graph language: kiln's ops, with attributes as leaves.
        pub enum Kl {
            "none" = None,
            "matmul" = MatMul([Id; 2]),
            "matmul_t" = MatMulT([Id; 2]),
            "add" = Add([Id; 2]),
            "mul" = Mul([Id; 2]),
            // (scale factor x)
            "scale" = Scale([Id; 2]),
            // (act kind x)
            "act" = Act([Id; 2]),
            "softmax" = Softmax(Id),
            // (mask causal window scores key_mask|none)
            "mask" = Mask([Id; 4]),
            "alibi" = Alibi(Id),
            // (repeat_heads times x)
            "repeat_heads" = RepeatHeads([Id; 2]),
            // (permute op x), (reshape op x): the op attribute carries the permutation / shape
            "permute" = Permute([Id; 2]),
            "reshape" = Reshape([Id; 2]),
            // (layer_norm eps x gain bias|none), (rms_norm eps x gain)
            "layer_norm" = LayerNorm([Id; 4]),
            "rms_norm" = RmsNorm([Id; 3]),
            // (linear act|none x w bias|none residual|none)
            "linear" = Linear([Id; 5]),
            // (masked_softmax scale alibi causal window mods scores key_mask|none table|none)
            "masked_softmax" = MaskedSoftmax([Id; 8]),
            // (attention scale alibi causal window mods q k v key_mask|none table|none)
            "attention" = Attention([Id; 10]),
            // (concat a b): weights stacked along axis 0
            "concat" = Concat([Id; 2]),
            // (slice op x), (rope op x): the op attribute carries the range / the rotation
            "slice" = Slice([Id; 2]),
            "rope" = Rope([Id; 2]),
            // (gather table ids)
            "gather" = Gather([Id; 2]),
            // (xlinear op x gain|none norm_bias|none w bias|none residual|none): a projection with
            // a prologue or a gated / rotated epilogue; the op attribute is the whole `Op::Linear`
            "xlinear" = XLinear([Id; 7]),
            // (packed_attention op qkv key_mask|none table|none)
            "packed_attention" = PackedAttention([Id; 4]),
            // (append past new): keys or values appended to a cache (concat on axis 2)
            "append" = Append([Id; 2]),
            // (heads op past|none x gain|none): heads read out of packed rows, normalized, rotated,
            // appended
            "heads" = Heads([Id; 4]),
            // (add_norm op a b gain bias|none)
            "add_norm" = AddNorm([Id; 5]),
            // (sum_axis axis x): the axis a count
            "sum_axis" = SumAxis([Id; 2]),
            // (contract_rows a b): the products of rows summed, `sum(a^T b)` over the leading axes
            "contract_rows" = ContractRows([Id; 2]),
            // (sum_rows x): the sum over every leading axis, `[.., n] -> [n]`
            "sum_rows" = SumRows([Id; 1]),
            // (norm_grad op x gain dy residual|none): a norm's input gradient, the op attribute
            // the whole `Op::NormGrad`
            "norm_grad" = NormGrad([Id; 5]),
            // (opaque op children...): any op no rule looks into
            "opaque" = Opaque(Box<[Id]>),
            Attr(Attr),
        }
    }
}

pub(super) fn attr(egraph: &KGraph, id: Id) -> Option<&AttrValue> {
    egraph[id].nodes.iter().find_map(|n| match n {
        Kl::Attr(a) => egraph.analysis.attrs.get(a.0 as usize),
        _ => None,
    })
}

pub(super) fn is_none(egraph: &KGraph, id: Id) -> bool {
    egraph[id].nodes.iter().any(|n| matches!(n, Kl::None))
}

fn flag(egraph: &KGraph, id: Id) -> Option<bool> {
    match attr(egraph, id)? {
        AttrValue::Bool(b) => Some(*b),
        _ => None,
    }
}

fn scalar(egraph: &KGraph, id: Id) -> Option<Scalar> {
    match attr(egraph, id)? {
        AttrValue::F(f) => Some(*f),
        _ => None,
    }
}

fn window(egraph: &KGraph, id: Id) -> Option<Option<usize>> {
    match attr(egraph, id)? {
        AttrValue::Window(w) => Some(*w),
        _ => None,
    }
}

fn mods(egraph: &KGraph, id: Id) -> Option<ScoreMods> {
    match attr(egraph, id)? {
        AttrValue::Scores(m) => Some(*m),
        _ => None,
    }
}

/// The graph op an e-node stands for, with its operand classes (attributes and `none`s removed).
/// `None` for attribute leaves that are not tensors, and for malformed nodes.
pub fn to_op(egraph: &KGraph, enode: &Kl) -> Option<(Op, Vec<Id>)> {
    let opt = |id: Id| if is_none(egraph, id) { None } else { Some(id) };
    Some(match enode {
        Kl::None => return None,
        Kl::Attr(a) => match egraph.analysis.attrs.get(a.0 as usize)? {
            AttrValue::Leaf(op, _, _) => (op.clone(), vec![]),
            _ => return None,
        },
        Kl::MatMul([a, b]) => (Op::MatMul { transpose_b: false }, vec![*a, *b]),
        Kl::MatMulT([a, b]) => (Op::MatMul { transpose_b: true }, vec![*a, *b]),
        Kl::Add([a, b]) => (Op::Add, vec![*a, *b]),
        Kl::Mul([a, b]) => (Op::Mul, vec![*a, *b]),
        Kl::Scale([f, x]) => (Op::Scale { factor: scalar(egraph, *f)? }, vec![*x]),
        Kl::Act([k, x]) => match attr(egraph, *k)? {
            AttrValue::Act(a) => (Op::Act(*a), vec![*x]),
            _ => return None,
        },
        Kl::Softmax(x) => (Op::Softmax, vec![*x]),
        Kl::Mask([c, w, s, m]) => {
            let mut ops = vec![*s];
            ops.extend(opt(*m));
            (Op::Mask { causal: flag(egraph, *c)?, window: window(egraph, *w)? }, ops)
        }
        Kl::Alibi(x) => (Op::Alibi, vec![*x]),
        Kl::RepeatHeads([t, x]) => match attr(egraph, *t)? {
            AttrValue::Count(times) => (Op::RepeatHeads { times: *times }, vec![*x]),
            _ => return None,
        },
        Kl::Permute([p, x]) | Kl::Reshape([p, x]) => match attr(egraph, *p)? {
            AttrValue::Op(op) => (op.clone(), vec![*x]),
            _ => return None,
        },
        Kl::LayerNorm([e, x, g, b]) => {
            let mut ops = vec![*x, *g];
            ops.extend(opt(*b));
            (Op::LayerNorm { eps: scalar(egraph, *e)? }, ops)
        }
        Kl::RmsNorm([e, x, g]) => (Op::RmsNorm { eps: scalar(egraph, *e)? }, vec![*x, *g]),
        Kl::Linear([a, x, w, b, r]) => {
            let act = match opt(*a) {
                None => None,
                Some(k) => match attr(egraph, k)? {
                    AttrValue::Act(a) => Some(*a),
                    _ => return None,
                },
            };
            let mut ops = vec![*x, *w];
            ops.extend(opt(*b));
            ops.extend(opt(*r));
            (Op::linear(act, opt(*b).is_some(), opt(*r).is_some()), ops)
        }
        Kl::MaskedSoftmax([f, al, c, w, x, s, m, t]) => {
            let mut ops = vec![*s];
            ops.extend(opt(*m));
            ops.extend(opt(*t));
            let op = Op::MaskedSoftmax {
                scale: scalar(egraph, *f)?,
                alibi: flag(egraph, *al)?,
                causal: flag(egraph, *c)?,
                window: window(egraph, *w)?,
                mods: mods(egraph, *x)?,
            };
            (op, ops)
        }
        Kl::Attention([f, al, c, w, x, q, k, v, m, t]) => {
            let mut ops = vec![*q, *k, *v];
            ops.extend(opt(*m));
            ops.extend(opt(*t));
            let op = Op::Attention {
                scale: scalar(egraph, *f)?,
                alibi: flag(egraph, *al)?,
                causal: flag(egraph, *c)?,
                window: window(egraph, *w)?,
                mods: mods(egraph, *x)?,
            };
            (op, ops)
        }
        Kl::Concat([a, b]) => (Op::Concat { axis: 0 }, vec![*a, *b]),
        Kl::Append([a, b]) => (Op::Concat { axis: 2 }, vec![*a, *b]),
        Kl::Heads([c, p, x, g]) => match attr(egraph, *c)? {
            AttrValue::Op(op @ Op::Heads { .. }) => {
                let mut ops: Vec<Id> = opt(*p).into_iter().collect();
                ops.push(*x);
                ops.extend(opt(*g));
                (op.clone(), ops)
            }
            _ => return None,
        },
        Kl::Slice([p, x]) | Kl::Rope([p, x]) => match attr(egraph, *p)? {
            AttrValue::Op(op) => (op.clone(), vec![*x]),
            _ => return None,
        },
        Kl::Gather([t, ids]) => (Op::Gather, vec![*t, *ids]),
        Kl::XLinear([c, x, g, nb, w, b, r]) => {
            let AttrValue::Op(Op::Linear { act, norm, glu, rope, .. }) = attr(egraph, *c)? else { return None };
            let norm = norm.map(|p| crate::graph::Prologue { bias: opt(*nb).is_some(), ..p });
            let mut ops = vec![*x];
            if norm.is_some() {
                ops.push(opt(*g)?);
            }
            ops.extend(opt(*nb));
            ops.push(*w);
            ops.extend(opt(*b));
            ops.extend(opt(*r));
            let op = Op::Linear {
                act: *act,
                bias: opt(*b).is_some(),
                residual: opt(*r).is_some(),
                norm,
                glu: *glu,
                rope: *rope,
            };
            (op, ops)
        }
        Kl::PackedAttention([c, x, m, t]) => match attr(egraph, *c)? {
            AttrValue::Op(op @ Op::PackedAttention(_)) => {
                let mut ops = vec![*x];
                ops.extend(opt(*m));
                ops.extend(opt(*t));
                (op.clone(), ops)
            }
            _ => return None,
        },
        Kl::AddNorm([c, a, b, g, nb]) => match attr(egraph, *c)? {
            AttrValue::Op(op @ Op::AddNorm { .. }) => {
                let mut ops = vec![*a, *b, *g];
                ops.extend(opt(*nb));
                (op.clone(), ops)
            }
            _ => return None,
        },
        Kl::SumAxis([n, x]) => match attr(egraph, *n)? {
            AttrValue::Count(axis) => (Op::SumAxis { axis: *axis }, vec![*x]),
            _ => return None,
        },
        Kl::ContractRows([a, b]) => (Op::ContractRows, vec![*a, *b]),
        Kl::SumRows([x]) => (Op::SumRows, vec![*x]),
        Kl::NormGrad([c, x, g, dy, r]) => match attr(egraph, *c)? {
            AttrValue::Op(op @ Op::NormGrad { .. }) => {
                let mut ops = vec![*x, *g, *dy];
                ops.extend(opt(*r));
                (op.clone(), ops)
            }
            _ => return None,
        },
        Kl::Opaque(children) => match attr(egraph, *children.first()?)? {
            AttrValue::Op(op) => (op.clone(), children[1..].to_vec()),
            _ => return None,
        },
    })
}

/// Adds a graph node's op to the e-graph, given its operand classes.
pub(super) fn add_op(egraph: &mut KGraph, node: &Node, operands: &[Id]) -> Id {
    let none = egraph.add(Kl::None);
    let leaf = |egraph: &mut KGraph, v: AttrValue| {
        let a = egraph.analysis.intern(v);
        egraph.add(Kl::Attr(a))
    };
    let o = |i: usize| operands.get(i).copied().unwrap_or(none);
    let enode = match &node.op {
        Op::Param { .. } | Op::Input { .. } | Op::Positions { .. } => {
            return leaf(egraph, AttrValue::Leaf(node.op.clone(), node.shape.clone(), node.dtype));
        }
        Op::MatMul { transpose_b: false } => Kl::MatMul([o(0), o(1)]),
        Op::MatMul { transpose_b: true } => Kl::MatMulT([o(0), o(1)]),
        Op::Add => Kl::Add([o(0), o(1)]),
        Op::Mul => Kl::Mul([o(0), o(1)]),
        Op::Scale { factor } => Kl::Scale([leaf(egraph, AttrValue::F(*factor)), o(0)]),
        Op::Act(a) => Kl::Act([leaf(egraph, AttrValue::Act(*a)), o(0)]),
        Op::Softmax => Kl::Softmax(o(0)),
        Op::Mask { causal, window } => {
            Kl::Mask([leaf(egraph, AttrValue::Bool(*causal)), leaf(egraph, AttrValue::Window(*window)), o(0), o(1)])
        }
        Op::Alibi => Kl::Alibi(o(0)),
        Op::RepeatHeads { times } => Kl::RepeatHeads([leaf(egraph, AttrValue::Count(*times)), o(0)]),
        Op::Permute { .. } => Kl::Permute([leaf(egraph, AttrValue::Op(node.op.clone())), o(0)]),
        Op::Reshape { .. } => Kl::Reshape([leaf(egraph, AttrValue::Op(node.op.clone())), o(0)]),
        Op::LayerNorm { eps } => Kl::LayerNorm([leaf(egraph, AttrValue::F(*eps)), o(0), o(1), o(2)]),
        Op::RmsNorm { eps } => Kl::RmsNorm([leaf(egraph, AttrValue::F(*eps)), o(0), o(1)]),
        Op::Concat { axis: 0 } => Kl::Concat([o(0), o(1)]),
        Op::Concat { axis: 2 } => Kl::Append([o(0), o(1)]),
        Op::Slice { .. } => Kl::Slice([leaf(egraph, AttrValue::Op(node.op.clone())), o(0)]),
        Op::Rope { .. } => Kl::Rope([leaf(egraph, AttrValue::Op(node.op.clone())), o(0)]),
        Op::Gather => Kl::Gather([o(0), o(1)]),
        Op::SumAxis { axis } => Kl::SumAxis([leaf(egraph, AttrValue::Count(*axis)), o(0)]),
        Op::ContractRows => Kl::ContractRows([o(0), o(1)]),
        Op::SumRows => Kl::SumRows([o(0)]),
        Op::NormGrad { .. } => Kl::NormGrad([leaf(egraph, AttrValue::Op(node.op.clone())), o(0), o(1), o(2), o(3)]),
        op => {
            let mut children = vec![leaf(egraph, AttrValue::Op(op.clone()))];
            children.extend_from_slice(operands);
            Kl::Opaque(children.into_boxed_slice())
        }
    };
    egraph.add(enode)
}
