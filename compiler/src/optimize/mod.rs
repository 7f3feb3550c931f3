//! The optimizer: Graph -> e-graph -> rewrite rules -> cost-based extraction -> Graph.
//!
//! The graph is turned into an [`egg`] e-graph over the language [`Kl`]: one e-node per graph op,
//! with every op attribute (a scale factor, an activation, a permutation, a parameter's identity)
//! an interned [`Attr`] leaf, so rewrite rules are plain s-expression patterns whose variables
//! range over attributes too. Rule sets (see `rules/` and its README) run in phases under the
//! documented [`Limits`]; each fused op appears in an e-class next to the ops it replaces. The
//! [`CostModel`] (bytes moved, FLOPs, a per-dispatch overhead) then picks the cheapest member of
//! every class, and the chosen terms are rebuilt into a graph, sharing identical subterms.
//!
//! **Invariant**: every rule's right-hand side computes the same values as its left-hand side, as
//! defined by the interpreter; the per-rule differential tests check exactly that.

#![expect(
    clippy::indexing_slicing,
    reason = "the optimizer runs on graphs that `Graph::check` accepted and indexes the e-graph's \
              own classes, attributes and children, and operands of ops that `graph::infer` typed"
)]

pub mod rules;

use crate::graph::{Dim, Graph, GraphError, Node, Op, Scalar, Shape, Sym, infer};
use crate::spec::Activation;
use crate::tensor::DType;
use egg::{Analysis, DidMerge, EGraph, Id, Language, RecExpr, Runner};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// An interned attribute: an index into [`KAnalysis::attrs`].
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
    /// A whole op whose attributes rules do not inspect (permute, reshape, opaque ops).
    Op(Op),
    /// A leaf tensor: a parameter, an input or positions, with its type.
    Leaf(Op, Shape, DType),
}

/// Attributes interned up front so patterns can name them: `a0` = false, `a1` = true, `a2` = no
/// window.
pub const FALSE: &str = "a0";
/// See [`FALSE`].
pub const TRUE: &str = "a1";
/// See [`FALSE`].
pub const NO_WINDOW: &str = "a2";

pub use lang::Kl;

/// The language, in its own module so the generated variants can go undocumented here: each is
/// documented by the comment on its line.
#[allow(missing_docs)]
mod lang {
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
            // (masked_softmax scale alibi causal window scores key_mask|none)
            "masked_softmax" = MaskedSoftmax([Id; 6]),
            // (attention scale alibi causal window q k v key_mask|none)
            "attention" = Attention([Id; 8]),
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
            // (packed_attention op qkv key_mask|none)
            "packed_attention" = PackedAttention([Id; 3]),
            // (append past new): keys or values appended to a cache (concat on axis 2)
            "append" = Append([Id; 2]),
            // (heads op past|none x): heads read out of packed rows, rotated, appended
            "heads" = Heads([Id; 3]),
            // (add_norm op a b gain bias|none)
            "add_norm" = AddNorm([Id; 5]),
            // (opaque op children...): any op no rule looks into
            "opaque" = Opaque(Box<[Id]>),
            Attr(Attr),
        }
    }
}

/// Shapes as e-class data, and the attribute table.
#[derive(Debug)]
pub struct KAnalysis {
    /// Attribute values by index.
    pub attrs: Vec<AttrValue>,
    index: HashMap<AttrValue, u32>,
    /// Consumers of each class of the input graph (outputs count as one), for rules that only pay
    /// when a value has a single use.
    pub uses: HashMap<Id, usize>,
    /// The widest attention head the target's fused attention takes
    /// ([`crate::target::Target::max_attention_head_dim`]).
    pub max_attention_head_dim: usize,
}

impl Default for KAnalysis {
    fn default() -> Self {
        let mut a = KAnalysis {
            attrs: Vec::new(),
            index: HashMap::new(),
            uses: HashMap::new(),
            max_attention_head_dim: crate::target::WGPU_MAX_ATTENTION_HEAD_DIM,
        };
        a.intern(AttrValue::Bool(false));
        a.intern(AttrValue::Bool(true));
        a.intern(AttrValue::Window(None));
        a
    }
}

impl KAnalysis {
    /// The attribute of a value, interning it if new.
    pub fn intern(&mut self, v: AttrValue) -> Attr {
        if let Some(&i) = self.index.get(&v) {
            return Attr(i);
        }
        let i = self.attrs.len() as u32;
        self.attrs.push(v.clone());
        self.index.insert(v, i);
        Attr(i)
    }
}

/// What the analysis knows of a tensor class.
#[derive(Clone, Debug, PartialEq)]
pub struct Type {
    /// Shape.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
    /// Computed from parameters alone (folded at load time, free at run time).
    pub konst: bool,
}

/// Type of an e-class: `None` for attribute leaves and `none`.
pub type Data = Option<Type>;

/// The e-graph kiln optimizes.
pub type KGraph = EGraph<Kl, KAnalysis>;

impl Analysis<Kl> for KAnalysis {
    type Data = Data;

    fn make(egraph: &mut KGraph, enode: &Kl, _id: Id) -> Data {
        let (op, operands) = to_op(egraph, enode)?;
        if let Op::Param { .. } | Op::Input { .. } | Op::Positions { .. } = op
            && let Kl::Attr(a) = enode
            && let AttrValue::Leaf(_, shape, dtype) = &egraph.analysis.attrs[a.0 as usize]
        {
            return Some(Type { shape: shape.clone(), dtype: *dtype, konst: matches!(op, Op::Param { .. }) });
        }
        let types: Vec<&Type> = operands.iter().map(|&o| egraph[o].data.as_ref()).collect::<Option<_>>()?;
        let refs: Vec<(&Shape, DType)> = types.iter().map(|t| (&t.shape, t.dtype)).collect();
        let (shape, dtype) = infer(&op, &refs).ok()?;
        let konst =
            !types.is_empty() && types.iter().all(|t| t.konst) && shape.iter().all(|d| matches!(d, Dim::Fixed(_)));
        Some(Type { shape, dtype, konst })
    }

    fn merge(&mut self, a: &mut Data, b: Data) -> DidMerge {
        // Equal classes have equal types; a class is constant if any of its forms is.
        match (a.as_mut(), b) {
            (None, Some(b)) => {
                *a = Some(b);
                DidMerge(true, false)
            }
            (Some(a), Some(b)) => {
                let (was_a, was_b) = (a.konst, b.konst);
                a.konst |= b.konst;
                DidMerge(a.konst != was_a, a.konst != was_b)
            }
            (Some(_), None) => DidMerge(false, true),
            (None, None) => DidMerge(false, false),
        }
    }
}

fn attr(egraph: &KGraph, id: Id) -> Option<&AttrValue> {
    egraph[id].nodes.iter().find_map(|n| match n {
        Kl::Attr(a) => egraph.analysis.attrs.get(a.0 as usize),
        _ => None,
    })
}

fn is_none(egraph: &KGraph, id: Id) -> bool {
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
        Kl::MaskedSoftmax([f, al, c, w, s, m]) => {
            let mut ops = vec![*s];
            ops.extend(opt(*m));
            let op = Op::MaskedSoftmax {
                scale: scalar(egraph, *f)?,
                alibi: flag(egraph, *al)?,
                causal: flag(egraph, *c)?,
                window: window(egraph, *w)?,
            };
            (op, ops)
        }
        Kl::Attention([f, al, c, w, q, k, v, m]) => {
            let mut ops = vec![*q, *k, *v];
            ops.extend(opt(*m));
            let op = Op::Attention {
                scale: scalar(egraph, *f)?,
                alibi: flag(egraph, *al)?,
                causal: flag(egraph, *c)?,
                window: window(egraph, *w)?,
            };
            (op, ops)
        }
        Kl::Concat([a, b]) => (Op::Concat { axis: 0 }, vec![*a, *b]),
        Kl::Append([a, b]) => (Op::Concat { axis: 2 }, vec![*a, *b]),
        Kl::Heads([c, p, x]) => match attr(egraph, *c)? {
            AttrValue::Op(op @ Op::Heads { .. }) => {
                let mut ops: Vec<Id> = opt(*p).into_iter().collect();
                ops.push(*x);
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
        Kl::PackedAttention([c, x, m]) => match attr(egraph, *c)? {
            AttrValue::Op(op @ Op::PackedAttention { .. }) => {
                let mut ops = vec![*x];
                ops.extend(opt(*m));
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
        Kl::Opaque(children) => match attr(egraph, *children.first()?)? {
            AttrValue::Op(op) => (op.clone(), children[1..].to_vec()),
            _ => return None,
        },
    })
}

/// Adds a graph node's op to the e-graph, given its operand classes.
fn add_op(egraph: &mut KGraph, node: &Node, operands: &[Id]) -> Id {
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
        op => {
            let mut children = vec![leaf(egraph, AttrValue::Op(op.clone()))];
            children.extend_from_slice(operands);
            Kl::Opaque(children.into_boxed_slice())
        }
    };
    egraph.add(enode)
}

/// Runner limits. Each is a documented constant, overridable per call (tests use small ones).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Stop after this many e-nodes.
    pub nodes: usize,
    /// Stop after this many iterations of a phase.
    pub iterations: usize,
    /// Stop after this long per phase.
    pub time: Duration,
}

/// Default node limit: far above what the rules reach on a 100-layer model (they add a few nodes
/// per block), low enough to bound memory.
pub const NODE_LIMIT: usize = 500_000;
/// Default iteration limit per phase; every rule set here saturates within a handful.
pub const ITER_LIMIT: usize = 16;
/// Default time limit per phase.
pub const TIME_LIMIT: Duration = Duration::from_secs(5);

impl Default for Limits {
    fn default() -> Self {
        Limits { nodes: NODE_LIMIT, iterations: ITER_LIMIT, time: TIME_LIMIT }
    }
}

/// [`CostModel::cpu`]'s dispatch constant (one step, in bytes moved).
const CPU_DISPATCH: f64 = 10000.0;
/// [`CostModel::cpu`]'s FLOP constant (in bytes moved).
const CPU_FLOP: f64 = 0.15;

/// The cost model: estimated time of one forward pass at batch 1, sequence [`CostModel::seq`].
#[derive(Clone, Debug)]
pub struct CostModel {
    /// Sequence length the costs are estimated at.
    pub seq: usize,
    /// Cost of one dispatch (kernel launch, barrier), in the unit of one byte moved.
    pub dispatch: f64,
    /// Cost of one floating-point operation, in the unit of one byte moved.
    pub flop: f64,
}

impl Default for CostModel {
    /// Constants measured on lavapipe (Mesa llvmpipe, LLVM 15, 256-bit, on 2 CPU cores) with
    /// `kiln bench --calibrate`: one dispatch took 32 us, one byte moved by an elementwise kernel
    /// 2.5 ns and one FLOP of a projection 2.7 ns, i.e. a dispatch costs as much as moving about
    /// 13 000 bytes and a FLOP about 1.1 bytes. (On a discrete GPU both ratios are far larger:
    /// rerun the calibration there before trusting choices that trade dispatches for FLOPs.)
    fn default() -> Self {
        CostModel { seq: 128, dispatch: 13000.0, flop: 1.1 }
    }
}

impl CostModel {
    /// Constants measured on the native CPU back end (2 cores of an x86 VM with AVX-512, 2
    /// threads) with `kiln bench --calibrate --backend cpu`: one step 0.2-0.4 us, one byte moved
    /// 0.035 ns, one projection FLOP 0.005 ns (about 200 GFLOPS), i.e. a step costs as much as
    /// moving about 10 000 bytes (7 300-13 500 over three runs) and a FLOP 0.15 bytes (0.13-0.21):
    /// arithmetic is seven times cheaper, relative to memory, than on lavapipe. See BENCHMARKS.md.
    pub fn cpu() -> Self {
        CostModel { seq: 128, dispatch: CPU_DISPATCH, flop: CPU_FLOP }
    }

    fn elements(&self, shape: &Shape) -> f64 {
        shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(k) => *k as f64,
                Dim::Sym(Sym::Batch) => 1.0,
                Dim::Sym(_) => self.seq as f64,
            })
            .product()
    }

    /// Cost of computing `op` from operands of the given types into `out`, excluding operands.
    pub fn node_cost(&self, op: &Op, operands: &[&Shape], out: &Shape) -> f64 {
        match op {
            Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. } => 0.0,
            _ => {
                let w = self.work(op, operands, out);
                self.dispatch + w.bytes_in + w.bytes_out + self.flop * w.flops
            }
        }
    }

    /// What computing `op` from operands of the given types into `out` moves and computes, at
    /// batch 1 and sequence [`CostModel::seq`]: the estimate [`CostModel::node_cost`] prices.
    pub fn work(&self, op: &Op, operands: &[&Shape], out: &Shape) -> Work {
        let bytes_out = 4.0 * self.elements(out);
        let bytes_in: f64 = match op {
            // Reads only its heads' columns (and the cache), as many as it writes.
            Op::Heads { .. } => bytes_out,
            _ => operands.iter().map(|s| 4.0 * self.elements(s)).sum(),
        };
        let last = |s: &Shape| s.last().map(|d| self.elements(&vec![*d])).unwrap_or(1.0);
        let flops = match op {
            Op::MatMul { .. } => 2.0 * self.elements(out) * operands.first().map_or(1.0, |s| last(s)),
            Op::Linear { norm, glu, .. } => {
                let k = operands.first().map_or(1.0, |s| last(s));
                let rows = self.elements(out) / last(out).max(1.0);
                let n = last(out);
                let m = if *glu { 2.0 * n } else { n };
                let mut f = 2.0 * rows * m * k;
                // The kernel recomputes the row statistics in every thread of the row.
                if let Some(p) = norm {
                    f += rows * n * k * if p.rms { 2.0 } else { 4.0 };
                }
                f
            }
            Op::PackedAttention { heads, head_dim, .. } => {
                let tokens = self.elements(out) / last(out).max(1.0);
                4.0 * tokens * (*heads * *head_dim) as f64 * self.seq as f64
            }
            Op::Attention { .. } => {
                let (q, k) = (operands[0], operands[1]);
                4.0 * self.elements(q) * self.elements(&vec![k[2]])
            }
            _ => self.elements(out),
        };
        Work { bytes_in, bytes_out, flops }
    }
}

/// The estimated work of one op ([`CostModel::work`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Bytes read from the operands.
    pub bytes_in: f64,
    /// Bytes written.
    pub bytes_out: f64,
    /// Floating-point operations.
    pub flops: f64,
}

/// Extraction cost: the cost of an e-node plus that of its operands, except operands that are
/// *shared* (read by several ops of the input graph: a residual stream, a norm feeding Q, K and
/// V). A shared value is computed once whichever consumers are chosen, so it is charged to none
/// of them; charging it to each (plain tree cost) would make any rewrite that reads it fewer
/// times look cheaper by the whole cost of everything before it.
struct Cost<'a> {
    egraph: &'a KGraph,
    model: &'a CostModel,
    shared: HashSet<Id>,
    /// Classes charged in shares: a consumer pays the cost over this many (a merged projection
    /// before any extraction has shown it shared).
    split: HashMap<Id, f64>,
}

impl egg::CostFunction<Kl> for Cost<'_> {
    type Cost = f64;
    fn cost<C: FnMut(Id) -> f64>(&mut self, enode: &Kl, mut costs: C) -> f64 {
        let children: f64 = enode
            .children()
            .iter()
            .map(|&c| {
                let cost = costs(c);
                let c = self.egraph.find(c);
                match self.split.get(&c) {
                    _ if cost.is_finite() && self.shared.contains(&c) => 0.0,
                    Some(k) => cost / k,
                    None => cost,
                }
            })
            .sum();
        let Some((op, operands)) = to_op(self.egraph, enode) else { return children };
        if enode_konst(self.egraph, enode) {
            return children;
        }
        let shapes: Vec<&Shape> =
            operands.iter().filter_map(|&o| self.egraph[o].data.as_ref().map(|d| &d.shape)).collect();
        let out = enode_shape(self.egraph, enode);
        match out {
            Some(out) => children + self.model.node_cost(&op, &shapes, &out),
            None => f64::INFINITY,
        }
    }
}

fn enode_shape(egraph: &KGraph, enode: &Kl) -> Option<Shape> {
    let (op, operands) = to_op(egraph, enode)?;
    if let Kl::Attr(a) = enode
        && let AttrValue::Leaf(_, shape, _) = &egraph.analysis.attrs[a.0 as usize]
    {
        return Some(shape.clone());
    }
    let types: Vec<&Type> = operands.iter().map(|&o| egraph[o].data.as_ref()).collect::<Option<_>>()?;
    let refs: Vec<(&Shape, DType)> = types.iter().map(|t| (&t.shape, t.dtype)).collect();
    infer(&op, &refs).ok().map(|(s, _)| s)
}

/// Whether an e-node computes from parameters alone (so it is folded at load time).
fn enode_konst(egraph: &KGraph, enode: &Kl) -> bool {
    let Some((op, operands)) = to_op(egraph, enode) else { return false };
    match op {
        Op::Param { .. } => true,
        Op::Input { .. } | Op::Positions { .. } => false,
        _ => !operands.is_empty() && operands.iter().all(|&o| egraph[o].data.as_ref().is_some_and(|t| t.konst)),
    }
}

/// What the optimizer did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Times each rule fired, by rule name.
    pub applied: BTreeMap<String, usize>,
    /// E-nodes at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// Iterations per phase, with the reason each phase stopped and its time.
    pub phases: Vec<(String, usize, String)>,
    /// Wall time.
    pub optimize_ms: f64,
    /// Dispatches before and after.
    pub dispatches: (usize, usize),
}

/// Optimizes a graph with the default rule phases and cost model.
pub fn optimize(g: &Graph) -> Result<(Graph, Report), GraphError> {
    optimize_for(g, &crate::target::Target::default())
}

/// Optimizes a graph for a back end: its cost model drives extraction and its limits bound the
/// fused forms (see [`crate::target`]).
pub fn optimize_for(g: &Graph, target: &crate::target::Target) -> Result<(Graph, Report), GraphError> {
    optimize_target(g, &Limits::default(), target, &rules::phases())
}

/// Optimizes a graph with the given limits, cost model and rule phases (for the default target's
/// kernel limits).
pub fn optimize_with(
    g: &Graph,
    limits: &Limits,
    model: &CostModel,
    phases: &[(&str, Vec<egg::Rewrite<Kl, KAnalysis>>)],
) -> Result<(Graph, Report), GraphError> {
    let target = crate::target::Target { cost: model.clone(), ..crate::target::Target::default() };
    optimize_target(g, limits, &target, phases)
}

/// Optimizes a graph for `target` with the given limits and rule phases.
pub fn optimize_target(
    g: &Graph,
    limits: &Limits,
    target: &crate::target::Target,
    phases: &[(&str, Vec<egg::Rewrite<Kl, KAnalysis>>)],
) -> Result<(Graph, Report), GraphError> {
    let model = &target.cost;
    let start = Instant::now();
    let analysis = KAnalysis { max_attention_head_dim: target.max_attention_head_dim, ..KAnalysis::default() };
    let mut egraph = KGraph::new(analysis);
    let mut class_of: HashMap<NodeIndex, Id> = HashMap::new();
    let mut scope_of: HashMap<Id, String> = HashMap::new();
    for n in g.order() {
        let operands: Vec<Id> = g.operands(n).iter().map(|o| class_of[o]).collect();
        let id = add_op(&mut egraph, &g.g[n], &operands);
        scope_of.entry(id).or_insert_with(|| g.g[n].scope.clone());
        class_of.insert(n, id);
    }
    egraph.rebuild();
    let roots: Vec<Id> = g.outputs.iter().map(|(_, n)| class_of[n]).collect();
    for n in g.g.node_indices() {
        let users = g.g.edges_directed(n, petgraph::Direction::Outgoing).count();
        *egraph.analysis.uses.entry(egraph.find(class_of[&n])).or_default() += users;
    }
    for root in &roots {
        *egraph.analysis.uses.entry(egraph.find(*root)).or_default() += 1;
    }

    let mut report = Report::default();
    for (name, rules) in phases {
        let runner = Runner::default()
            .with_egraph(egraph)
            .with_node_limit(limits.nodes)
            .with_iter_limit(limits.iterations)
            .with_time_limit(limits.time)
            .run(rules.iter());
        for it in &runner.iterations {
            for (rule, count) in &it.applied {
                *report.applied.entry(rule.to_string()).or_default() += count;
            }
        }
        let reason = runner.stop_reason.as_ref().map(|r| format!("{r:?}")).unwrap_or_default();
        let ms: f64 = runner.iterations.iter().map(|it| it.total_time).sum::<f64>() * 1e3;
        report.phases.push((name.to_string(), runner.iterations.len(), format!("{reason}, {ms:.1} ms")));
        egraph = runner.egraph;
    }
    report.egraph_nodes = egraph.total_number_of_nodes();
    report.egraph_classes = egraph.number_of_classes();

    // Scopes follow the classes through merges.
    let scopes: HashMap<Id, String> = scope_of.into_iter().map(|(id, s)| (egraph.find(id), s)).collect();
    // Shared values: first those of the input graph; then, a few rounds, those of the graph the
    // previous round extracted (a norm read by two projections is no longer shared once both
    // became one), until the set is stable. Values the rules made to be read several times (a
    // merged projection, sliced by its consumers) are shared only once extracted, which the
    // rounds cannot discover from an extraction without them: a second start assumes them shared,
    // and of the two results the one whose graph (each value counted once) costs less is kept.
    let input_shared: HashSet<Id> =
        egraph.analysis.uses.iter().filter(|(_, u)| **u > 1).map(|(id, _)| egraph.find(*id)).collect();
    let starts = [(input_shared.clone(), HashMap::new()), (input_shared, sliced_classes(&egraph))];
    let extractors = starts.map(|(shared, split)| settle(&egraph, model, &roots, shared, split));
    let costs = extractors.each_ref().map(|e| dag_cost(&egraph, model, e, &roots));
    let [first, second] = extractors;
    let extractor = if costs[1] < costs[0] { second } else { first };
    let mut out = Graph::new(&g.name);
    let mut built: HashMap<(Op, Vec<NodeIndex>), NodeIndex> = HashMap::new();
    for ((name, _), root) in g.outputs.iter().zip(&roots) {
        let (_, expr) = extractor.find_best(*root);
        let n = rebuild(&egraph, &expr, &scopes, &mut out, &mut built)?;
        out.outputs.push((name.clone(), n));
    }
    out.scope.clear();
    out.check()?;
    report.dispatches = (dispatches(g), dispatches(&out));
    report.optimize_ms = start.elapsed().as_secs_f64() * 1e3;
    Ok((out, report))
}

/// An extractor whose shared set is stable: extraction from `shared`, re-derived from the result
/// for at most [`EXTRACTION_ROUNDS`].
fn settle<'a>(
    egraph: &'a KGraph,
    model: &'a CostModel,
    roots: &[Id],
    mut shared: HashSet<Id>,
    split: HashMap<Id, f64>,
) -> egg::Extractor<'a, Cost<'a>, Kl, KAnalysis> {
    let mut extractor = egg::Extractor::new(egraph, Cost { egraph, model, shared: shared.clone(), split });
    for _ in 0..EXTRACTION_ROUNDS {
        let next = shared_in_extraction(egraph, &extractor, roots);
        if next == shared {
            break;
        }
        shared = next;
        extractor = egg::Extractor::new(egraph, Cost { egraph, model, shared: shared.clone(), split: HashMap::new() });
    }
    extractor
}

/// Classes sliced by two or more different slices (the merged projections), with the number of
/// slices: each consumer is charged that share of its cost.
fn sliced_classes(egraph: &KGraph) -> HashMap<Id, f64> {
    let mut slices: HashMap<Id, HashSet<Id>> = HashMap::new();
    for class in egraph.classes() {
        for node in &class.nodes {
            if let Kl::Slice([_, x]) = node {
                slices.entry(egraph.find(*x)).or_default().insert(class.id);
            }
        }
    }
    slices.into_iter().filter(|(_, s)| s.len() > 1).map(|(x, s)| (x, s.len() as f64)).collect()
}

/// The cost of the graph an extractor extracts, each class counted once (what running it costs).
fn dag_cost(egraph: &KGraph, model: &CostModel, extractor: &egg::Extractor<Cost, Kl, KAnalysis>, roots: &[Id]) -> f64 {
    let mut seen: HashSet<Id> = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    let mut total = 0.0;
    while let Some(class) = stack.pop() {
        if !seen.insert(class) {
            continue;
        }
        let node = extractor.find_best_node(class);
        stack.extend(node.children().iter().map(|&c| egraph.find(c)));
        let Some((op, operands)) = to_op(egraph, node) else { continue };
        if enode_konst(egraph, node) {
            continue;
        }
        let shapes: Vec<&Shape> = operands.iter().filter_map(|&o| egraph[o].data.as_ref().map(|d| &d.shape)).collect();
        match enode_shape(egraph, node) {
            Some(out) => total += model.node_cost(&op, &shapes, &out),
            None => return f64::INFINITY,
        }
    }
    total
}

/// Most re-extractions after the first (each with the shared values of the previous one).
const EXTRACTION_ROUNDS: usize = 3;

/// The classes the extracted graph reads from more than one op.
fn shared_in_extraction(egraph: &KGraph, extractor: &egg::Extractor<Cost, Kl, KAnalysis>, roots: &[Id]) -> HashSet<Id> {
    let mut uses: HashMap<Id, usize> = HashMap::new();
    let mut seen: HashSet<Id> = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    for r in &stack {
        *uses.entry(*r).or_default() += 1;
    }
    while let Some(class) = stack.pop() {
        if !seen.insert(class) {
            continue;
        }
        for &c in extractor.find_best_node(class).children() {
            let c = egraph.find(c);
            // Attribute leaves and `none` are not values.
            if egraph[c].data.is_some() {
                *uses.entry(c).or_default() += 1;
                stack.push(c);
            }
        }
    }
    uses.into_iter().filter(|(_, u)| *u > 1).map(|(id, _)| id).collect()
}

/// Kernel dispatches a graph lowers to: every op but inputs, parameters, reshapes and constants
/// (ops on parameters alone, folded at load time as the lowering does).
pub fn dispatches(g: &Graph) -> usize {
    let mut konst = vec![false; g.g.node_count()];
    let mut count = 0;
    for n in g.order() {
        let operands = g.operands(n);
        let node = &g.g[n];
        konst[n.index()] = match node.op {
            Op::Param { .. } => true,
            Op::Input { .. } | Op::Positions { .. } => false,
            _ => {
                !operands.is_empty()
                    && operands.iter().all(|o| konst[o.index()])
                    && node.shape.iter().all(|d| matches!(d, Dim::Fixed(_)))
            }
        };
        if !konst[n.index()] && !matches!(node.op, Op::Input { .. } | Op::Reshape { .. }) {
            count += 1;
        }
    }
    count
}

/// Turns an extracted term back into graph nodes, sharing identical (op, operands) nodes.
fn rebuild(
    egraph: &KGraph,
    expr: &RecExpr<Kl>,
    scopes: &HashMap<Id, String>,
    out: &mut Graph,
    built: &mut HashMap<(Op, Vec<NodeIndex>), NodeIndex>,
) -> Result<NodeIndex, GraphError> {
    // Evaluate the RecExpr bottom-up in a scratch e-graph view: we need each node's op, which
    // `to_op` reads from classes, so look the node up in the real e-graph.
    let mut index: Vec<Option<NodeIndex>> = vec![None; expr.as_ref().len()];
    let nodes = expr.as_ref();
    let mut class: Vec<Id> = Vec::with_capacity(nodes.len());
    // Extraction only returns nodes of the e-graph, children before parents; a term that breaks
    // that is an optimizer bug, reported as an error rather than a panic.
    let broken = |message: &str| GraphError { op: "extract".into(), scope: String::new(), message: message.into() };
    for (i, node) in nodes.iter().enumerate() {
        let in_graph = node.clone().map_children(|c| class[usize::from(c)]);
        let id = egraph.lookup(in_graph.clone()).ok_or_else(|| broken("an extracted node is not in the e-graph"))?;
        class.push(id);
        let Some((op, operand_classes)) = to_op(egraph, &in_graph) else { continue };
        // Map operand classes back to the RecExpr children that produced them.
        let children: Vec<usize> = node.children().iter().map(|&c| usize::from(c)).collect();
        let operands: Vec<NodeIndex> = operand_classes
            .iter()
            .map(|oc| {
                let pos =
                    children.iter().find(|&&c| class[c] == *oc).ok_or_else(|| broken("an operand is no child"))?;
                index[*pos].ok_or_else(|| broken("an operand is built after its user"))
            })
            .collect::<Result<_, _>>()?;
        let key = (op.clone(), operands.clone());
        let n = match built.get(&key) {
            Some(&n) => n,
            None => {
                // Ops the rules created take the scope of their first scoped operand.
                out.scope = scopes.get(&egraph.find(id)).cloned().unwrap_or_else(|| {
                    operands.iter().map(|&o| out.g[o].scope.clone()).find(|s| !s.is_empty()).unwrap_or_default()
                });
                let n = match &op {
                    Op::Param { .. } | Op::Input { .. } | Op::Positions { .. } if operands.is_empty() => {
                        let Type { shape, dtype, .. } =
                            egraph[id].data.clone().ok_or_else(|| broken("a leaf has no type"))?;
                        out.g.add_node(Node { op: op.clone(), shape, dtype, scope: out.scope.clone() })
                    }
                    _ => out.add(op.clone(), &operands)?,
                };
                built.insert(key, n);
                n
            }
        };
        index[i] = Some(n);
    }
    index.last().copied().flatten().ok_or_else(|| broken("the root is not a tensor"))
}

/// The rules that produce a fused op, read off its attributes (a provenance record: each fused form
/// has one derivation in the current rule set). Empty for ops that are not fused.
pub fn explain(g: &Graph, n: NodeIndex) -> Vec<&'static str> {
    let node = &g.g[n];
    match &node.op {
        Op::Linear { act, bias, residual, norm, glu, rope } => {
            let mut r = vec!["matmul-to-linear"];
            if *bias {
                r.push("linear-bias");
            }
            if *glu {
                r.push("shared-input-merge");
                r.push(if *bias { "gated-linear-bias" } else { "gated-linear" });
            } else if act.is_some() {
                r.push("linear-act");
            }
            if rope.is_some() {
                r.push("shared-input-merge");
                r.push(if *bias { "attention-packed-rope-bias" } else { "attention-packed-rope" });
            }
            if *residual {
                r.push("linear-residual");
            }
            match norm {
                Some(p) if p.rms => r.push("norm-prologue-rms"),
                Some(_) => r.push("norm-prologue-ln"),
                None => {}
            }
            r
        }
        Op::PackedAttention { alibi, causal, window, .. } => {
            let masked = *causal || window.is_some() || g.operands(n).len() > 1;
            let rope = matches!(g.g[g.operands(n)[0]].op, Op::Linear { rope: Some(_), .. });
            vec![
                softmax_rule(masked, *alibi),
                "attention",
                "shared-input-merge",
                if rope { "attention-packed-rope" } else { "attention-packed" },
            ]
        }
        Op::AddNorm { rms, .. } => vec![if *rms { "add-norm-rms" } else { "add-norm-ln" }],
        Op::MaskedSoftmax { alibi, causal, window, .. } => {
            let masked = *causal || window.is_some() || g.operands(n).len() > 1;
            vec![softmax_rule(masked, *alibi)]
        }
        Op::Attention { alibi, causal, window, .. } => {
            let operands = g.operands(n);
            let masked = *causal || window.is_some() || operands.len() > 3;
            let gqa = g.g[operands[1]].shape.get(1) != g.g[operands[0]].shape.get(1);
            vec![softmax_rule(masked, *alibi), if gqa { "attention-gqa" } else { "attention" }]
        }
        Op::Concat { axis: 0 } => vec!["shared-input-merge"],
        Op::Heads { rope, .. } => {
            let mut r = vec!["heads-split"];
            if rope.is_some() {
                r.push("heads-rope");
            }
            if g.operands(n).len() == 2 {
                r.push("heads-append");
            }
            r
        }
        _ => vec![],
    }
}

fn softmax_rule(masked: bool, alibi: bool) -> &'static str {
    match (masked, alibi) {
        (true, false) => "masked-softmax",
        (true, true) => "masked-softmax-alibi",
        (false, false) => "scaled-softmax",
        (false, true) => "scaled-softmax-alibi",
    }
}
