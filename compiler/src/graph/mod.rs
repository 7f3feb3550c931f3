//! The graph IR: a dataflow graph of tensor-level ops on petgraph.
//!
//! A node is an [`Op`] applied to its operands (incoming edges, ordered by the edge weight, which is
//! the operand position). Every node carries its inferred [`Shape`] and [`DType`]; model dimensions
//! are concrete, while batch and sequence lengths stay symbolic ([`Sym`]) until run time. Parameters
//! are [`Op::Param`] nodes named after the canonical parameter names the weight map resolves.
//!
//! The ops are deliberately small and unfused (matmul, add, softmax, norm, rope, ...): fusion is the
//! optimizer's business. Each op's meaning is defined once, by the CPU reference interpreter
//! ([`crate::interp`]); shape rules are defined here, in [`Graph::add`].
//!
//! **Invariant**: the graph is acyclic and every node's shape is what [`infer`] gives for its op and
//! operands; [`Graph::check`] verifies both.

#![expect(
    clippy::indexing_slicing,
    reason = "`infer` indexes operands and axes only after its arity and rank checks; the graph \
              methods index nodes of the graph itself, which `Graph::check` type-checks op by op"
)]

pub mod build;
pub mod print;

use crate::spec::{Activation, PairStyle};
use crate::tensor::DType;
use petgraph::Direction;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;

/// A symbolic dimension, bound when inputs are given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Sym {
    /// Sequences per batch.
    Batch,
    /// Tokens per sequence (the target side of an encoder-decoder).
    Seq,
    /// Source tokens per sequence of an encoder-decoder.
    SrcSeq,
    /// Tokens already in a decoder's key/value cache (0 without one). Positions, RoPE and the
    /// causal mask count from here.
    Past,
    /// Keys attended with a cache: `Past + Seq` (the one symbolic sum, made by concatenating the
    /// cache and the new keys).
    Ctx,
}

impl Sym {
    /// The name used in dumps.
    pub fn name(self) -> &'static str {
        match self {
            Sym::Batch => "batch",
            Sym::Seq => "seq",
            Sym::SrcSeq => "src_seq",
            Sym::Past => "past",
            Sym::Ctx => "ctx",
        }
    }
}

/// One axis extent: a number, or a symbol bound at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Dim {
    /// Known at compile time.
    Fixed(usize),
    /// Bound at run time.
    Sym(Sym),
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Sym(s) => f.write_str(s.name()),
        }
    }
}

/// A shape with possibly symbolic axes.
pub type Shape = Vec<Dim>;

/// Resolves a shape with the run-time values of the symbols (unbound symbols count as 0).
pub fn resolve(shape: &[Dim], syms: &std::collections::HashMap<Sym, usize>) -> Vec<usize> {
    shape
        .iter()
        .map(|d| match d {
            Dim::Fixed(k) => *k,
            Dim::Sym(s) => syms.get(s).copied().unwrap_or(0),
        })
        .collect()
}

/// Writes `[a, b, c]`.
pub fn fmt_shape(shape: &[Dim]) -> String {
    let dims: Vec<String> = shape.iter().map(Dim::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// A float attribute, compared and hashed by its bits so ops can be keys (e-graph nodes).
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize)]
pub struct Scalar(pub f32);

impl Eq for Scalar {}
impl std::hash::Hash for Scalar {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}
impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// What an input tensor is, which decides how the runtime binds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum InputRole {
    /// Token ids, `i64[batch, seq]`.
    Ids,
    /// Segment ids, `i64[batch, seq]`; zeros when not given.
    TokenTypes,
    /// Key padding mask, `f32[batch, seq]` with 1 = attend, 0 = padding; all ones when not given.
    /// `pad_is_one` says the tensor as given uses the opposite convention (torch's
    /// `src_key_padding_mask`), and the runtime flips it when binding.
    KeyMask {
        /// The given tensor marks padding with 1.
        pad_is_one: bool,
    },
    /// Cached keys or values of one attention layer, `f32[batch, kv_heads, past, head_dim]`
    /// (empty when nothing is cached yet).
    Cache {
        /// Key/value heads.
        kv_heads: usize,
        /// Width of a head.
        head_dim: usize,
    },
}

/// A norm folded into a projection's prologue (see [`Op::Linear`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Prologue {
    /// RMSNorm; LayerNorm otherwise.
    pub rms: bool,
    /// Epsilon.
    pub eps: Scalar,
    /// A LayerNorm bias operand follows the gain.
    pub bias: bool,
}

/// RoPE applied to output columns `start .. start + len` of rows `[.., seq, n]`, taken as heads of
/// `head_dim` columns, each rotated as [`Op::Rope`] rotates a head at the row's sequence position.
/// `start` and `n` are even (the kernel computes the columns in pairs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RopeCols {
    /// Base of the frequencies.
    pub theta: Scalar,
    /// Leading dimensions of each head rotated.
    pub rotary_dim: usize,
    /// Pair layout.
    pub style: PairStyle,
    /// Width of a head.
    pub head_dim: usize,
    /// First rotated column.
    pub start: usize,
    /// Rotated columns (a multiple of `head_dim`).
    pub len: usize,
}

/// A rotation of head pairs as [`Op::Rope`] makes it, for ops that rotate as they read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Rotation {
    /// Base of the frequencies.
    pub theta: Scalar,
    /// Leading dimensions of each head rotated.
    pub rotary_dim: usize,
    /// Pair layout.
    pub style: PairStyle,
}

impl Op {
    /// A plain fused projection: `act(x @ w^T + bias) + residual`.
    pub fn linear(act: Option<Activation>, bias: bool, residual: bool) -> Op {
        Op::Linear { act, bias, residual, norm: None, glu: false, rope: None }
    }
}

fn style_name(s: &PairStyle) -> &'static str {
    match s {
        PairStyle::RotateHalf => "rotate-half",
        PairStyle::Interleaved => "interleaved",
    }
}

/// A tensor-level operation. Operand order is documented per op.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Op {
    /// A model input (no operands).
    Input {
        /// The name inputs are given under (`input_ids`, ...).
        name: String,
        /// How it is bound.
        role: InputRole,
        /// The symbol of its sequence axis (`seq`, or `src_seq` for an encoder-decoder's source).
        seq: Sym,
    },
    /// A weight (no operands), resolved through the weight map.
    Param {
        /// Canonical parameter name.
        name: String,
    },
    /// `i64[len]` holding `p, p + 1, ..., p + len - 1` (no operands), `p` the number of cached
    /// tokens ([`Sym::Past`], 0 without a cache).
    Positions {
        /// The length.
        len: Dim,
    },
    /// Fixed sinusoidal table for positions `p`: `(positions i64[n]) -> f32[n, dim]`.
    Sinusoid {
        /// Table width.
        dim: usize,
        /// Interleaved (sin, cos) pairs or a sin block then a cos block.
        style: PairStyle,
    },
    /// Row lookup: `(table f32[rows, d], ids i64[...]) -> f32[..., d]`.
    Gather,
    /// Batched matrix product `(a [..., m, k], b [..., k, n]) -> [..., m, n]`; with `transpose_b`, b is
    /// `[..., n, k]`. `b` has either a's batch axes or none (a weight shared over the batch).
    MatMul {
        /// b is stored with its last two axes swapped.
        transpose_b: bool,
    },
    /// Elementwise sum with numpy broadcasting.
    Add,
    /// Elementwise product with numpy broadcasting.
    Mul,
    /// `x * factor`.
    Scale {
        /// The constant.
        factor: Scalar,
    },
    /// Elementwise activation.
    Act(Activation),
    /// LayerNorm over the last axis: `(x, gain[, bias])`.
    LayerNorm {
        /// Added to the variance.
        eps: Scalar,
    },
    /// RMSNorm over the last axis: `(x, gain)`.
    RmsNorm {
        /// Added to the mean square.
        eps: Scalar,
    },
    /// Softmax over the last axis.
    Softmax,
    /// Same elements, new shape (may name symbols, which must match the operand's).
    Reshape {
        /// The new shape.
        shape: Shape,
    },
    /// Axis permutation: output axis `i` is input axis `perm[i]`.
    Permute {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// Rotary embedding of `x [batch, heads, seq, head_dim]` at positions `p..p + seq`, `p` the
    /// number of cached tokens ([`Sym::Past`], 0 without a cache).
    Rope {
        /// Base of the frequencies.
        theta: Scalar,
        /// Leading dimensions rotated; the rest pass through.
        rotary_dim: usize,
        /// Pair layout.
        style: PairStyle,
    },
    /// `[b, kv, s, d] -> [b, kv * times, s, d]`, each head repeated `times` times in a row
    /// (grouped-query attention).
    RepeatHeads {
        /// Copies of each head.
        times: usize,
    },
    /// Adds ALiBi biases to scores `[b, heads, q, k]`: `slope[h] * (k - q)`.
    Alibi,
    /// Masks scores `[b, h, q, k]` (masked entries become the most negative float): `(scores[,
    /// key_mask f32[b, k]])`. Causal keeps `k <= q + (keys - queries)`; a window keeps the last
    /// `window` of those.
    Mask {
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
    },
    /// Keeps the `k` largest entries of the last axis (others become 0), renormalised to sum 1 if asked.
    TopK {
        /// Entries kept.
        k: usize,
        /// Rescale the kept entries to sum to one.
        renormalize: bool,
    },
    /// A contiguous range of one axis.
    Slice {
        /// The axis.
        axis: usize,
        /// First index.
        start: usize,
        /// Extent.
        len: usize,
    },
    /// `(a, b)` joined along one axis (the other axes equal).
    Concat {
        /// The axis.
        axis: usize,
    },
    /// Mean over the tokens a mask keeps: `(x [b, s, d], mask f32[b, s]) -> [b, d]`.
    MeanPool,
    /// Scales the last axis to unit L2 norm: `x / max(||x||, 1e-12)`.
    L2Normalize,

    // ---- Fused ops: produced only by the optimizer. Each is defined as a composition of the ops
    // above; the interpreter evaluates it as exactly that composition.
    /// A projection with its prologue and epilogue:
    /// `rope(act(norm(x) @ w^T + bias)) + residual`, operands
    /// `(x [.., k][, gain [k][, norm_bias [k]]], w [m, k][, bias [m]][, residual [.., n]])`.
    ///
    /// - `norm`: the rows of `x` are normalised first ([`Op::RmsNorm`] / [`Op::LayerNorm`] with
    ///   the `gain` and optional `norm_bias` operands);
    /// - `glu`: `w` stacks a gate block over an up block (`m = 2n`), and the result is
    ///   `act(gate) * up` (SwiGLU, GeGLU); otherwise `m = n` and the result is `act(y)`;
    /// - `rope`: RoPE rotates the heads in a range of output columns (see [`RopeCols`]).
    Linear {
        /// Activation applied before the residual add (to the gate half when `glu`).
        act: Option<Activation>,
        /// A bias operand follows `w`.
        bias: bool,
        /// A residual operand comes last.
        residual: bool,
        /// Normalise the input rows first.
        norm: Option<Prologue>,
        /// Gated: `act(gate) * up` over the two halves of `w`'s rows.
        glu: bool,
        /// Rotate heads of the output.
        rope: Option<RopeCols>,
    },
    /// `softmax(mask(alibi(scores * scale)))` over the last axis: `(scores [b, h, q, k][, key_mask
    /// f32[b, k]])`. The mask hides what [`Op::Mask`] hides; `alibi` adds [`Op::Alibi`]'s biases.
    MaskedSoftmax {
        /// Logit scale.
        scale: Scalar,
        /// Add ALiBi biases.
        alibi: bool,
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
    },
    /// Whole attention with the head merge: `(q [b, h, s, d], k [b, kv, t, d], v [b, kv, t, d][,
    /// key_mask f32[b, t]]) -> [b, s, h * d]`, query head `j` reading key/value head
    /// `j / (h / kv)`; scores are masked and normalised as [`Op::MaskedSoftmax`] does. The kernel
    /// never materialises the score matrix (online softmax).
    Attention {
        /// Logit scale.
        scale: Scalar,
        /// Add ALiBi biases.
        alibi: bool,
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
    },
    /// Heads read out of a packed projection, optionally rotated and appended to a cache:
    /// `([past f32[b, heads, p, head_dim],] x [b, s, width]) -> [b, heads, p + s, head_dim]`, head
    /// `j` of token `t` being columns `start + j * head_dim ..` of row `t` of `x`, rotated as
    /// [`Op::Rope`] at position `past + t` when `rope` is set (`past` as bound: the tokens before
    /// these). The split/transpose/rotate/concatenate chain of a cached decoder step as one
    /// kernel.
    Heads {
        /// First column of head 0.
        start: usize,
        /// Heads read.
        heads: usize,
        /// Width of a head.
        head_dim: usize,
        /// Rotate each head.
        rope: Option<Rotation>,
    },
    /// Attention reading its heads straight out of one packed projection `qkv [b, s, width]`:
    /// query head `j` is columns `q + j * head_dim ..` of each row, key/value head `j` columns
    /// `k + j * head_dim ..` and `v + j * head_dim ..`; `(qkv[, key_mask f32[b, s]]) -> [b, s,
    /// heads * head_dim]`. Equal to [`Op::Attention`] over the split, head-transposed tensors.
    PackedAttention {
        /// Logit scale.
        scale: Scalar,
        /// Add ALiBi biases.
        alibi: bool,
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
        /// Query heads.
        heads: usize,
        /// Key/value heads (dividing `heads`).
        kv_heads: usize,
        /// Width of a head.
        head_dim: usize,
        /// First column of the query heads.
        q: usize,
        /// First column of the key heads.
        k: usize,
        /// First column of the value heads.
        v: usize,
    },
    /// `norm(a + b)`: `(a, b, gain[, bias])` with the LayerNorm (with bias operand, or without)
    /// or the RMSNorm of the given epsilon.
    AddNorm {
        /// RMSNorm instead of LayerNorm.
        rms: bool,
        /// Epsilon.
        eps: Scalar,
    },
}

impl Op {
    /// Short name used by printers.
    pub fn name(&self) -> String {
        match self {
            Op::Input { .. } => "input".into(),
            Op::Param { .. } => "param".into(),
            Op::Positions { .. } => "positions".into(),
            Op::Sinusoid { .. } => "sinusoid".into(),
            Op::Gather => "gather".into(),
            Op::MatMul { transpose_b: false } => "matmul".into(),
            Op::MatMul { transpose_b: true } => "matmul_t".into(),
            Op::Add => "add".into(),
            Op::Mul => "mul".into(),
            Op::Scale { .. } => "scale".into(),
            Op::Act(a) => a.name().into(),
            Op::LayerNorm { .. } => "layer_norm".into(),
            Op::RmsNorm { .. } => "rms_norm".into(),
            Op::Softmax => "softmax".into(),
            Op::Reshape { .. } => "reshape".into(),
            Op::Permute { .. } => "permute".into(),
            Op::Rope { .. } => "rope".into(),
            Op::RepeatHeads { .. } => "repeat_heads".into(),
            Op::Alibi => "alibi".into(),
            Op::Mask { .. } => "mask".into(),
            Op::TopK { .. } => "top_k".into(),
            Op::Slice { .. } => "slice".into(),
            Op::MeanPool => "mean_pool".into(),
            Op::L2Normalize => "l2_normalize".into(),
            Op::Linear { act, bias, residual, norm, glu, rope } => {
                let mut n = String::new();
                match norm {
                    Some(Prologue { rms: true, .. }) => n += "rms_norm_",
                    Some(Prologue { rms: false, .. }) => n += "layer_norm_",
                    None => {}
                }
                n += "linear";
                if *glu {
                    n += "_glu";
                }
                if *bias {
                    n += "_bias";
                }
                if let Some(a) = act {
                    n += "_";
                    n += &a.name().replace('-', "_");
                }
                if rope.is_some() {
                    n += "_rope";
                }
                if *residual {
                    n += "_residual";
                }
                n
            }
            Op::PackedAttention { .. } => "packed_attention".into(),
            Op::Heads { rope, .. } => if rope.is_some() { "heads_rope" } else { "heads" }.into(),
            Op::Concat { .. } => "concat".into(),
            Op::MaskedSoftmax { .. } => "masked_softmax".into(),
            Op::Attention { .. } => "attention".into(),
            Op::AddNorm { rms: false, .. } => "add_layer_norm".into(),
            Op::AddNorm { rms: true, .. } => "add_rms_norm".into(),
        }
    }

    /// Attributes as `key=value` text (empty when none), deterministic.
    pub fn attrs(&self) -> String {
        let style = style_name;
        match self {
            Op::Input { name, role, .. } => {
                let role = match role {
                    InputRole::Ids => "ids".to_string(),
                    InputRole::TokenTypes => "token-types".to_string(),
                    InputRole::KeyMask { pad_is_one: false } => "key-mask".to_string(),
                    InputRole::KeyMask { pad_is_one: true } => "key-mask pad-is-one".to_string(),
                    InputRole::Cache { .. } => "cache".to_string(),
                };
                format!("\"{name}\" {role}")
            }
            Op::Param { name } => format!("\"{name}\""),
            Op::Positions { len } => format!("len={len}"),
            Op::Sinusoid { dim, style: s } => format!("dim={dim} style={}", style(s)),
            Op::Scale { factor } => format!("factor={factor}"),
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => format!("eps={eps}"),
            Op::Reshape { shape } => fmt_shape(shape),
            Op::Permute { perm } => format!("{perm:?}"),
            Op::Rope { theta, rotary_dim, style: s } => {
                format!("theta={theta} rotary_dim={rotary_dim} style={}", style(s))
            }
            Op::RepeatHeads { times } => format!("times={times}"),
            Op::Mask { causal, window } => match window {
                Some(w) => format!("causal={causal} window={w}"),
                None => format!("causal={causal}"),
            },
            Op::TopK { k, renormalize } => format!("k={k} renormalize={renormalize}"),
            Op::Slice { axis, start, len } => format!("axis={axis} start={start} len={len}"),
            Op::MaskedSoftmax { scale, alibi, causal, window } | Op::Attention { scale, alibi, causal, window } => {
                let mut a = format!("scale={scale} causal={causal}");
                if let Some(w) = window {
                    a += &format!(" window={w}");
                }
                if *alibi {
                    a += " alibi";
                }
                a
            }
            Op::AddNorm { eps, .. } => format!("eps={eps}"),
            Op::Linear { norm, rope, .. } => {
                let mut a = Vec::new();
                if let Some(p) = norm {
                    a.push(format!("eps={}", p.eps));
                }
                if let Some(r) = rope {
                    a.push(format!(
                        "rope=[{}..{}] head_dim={} theta={} rotary_dim={} style={}",
                        r.start,
                        r.start + r.len,
                        r.head_dim,
                        r.theta,
                        r.rotary_dim,
                        style_name(&r.style)
                    ));
                }
                a.join(" ")
            }
            Op::PackedAttention { scale, alibi, causal, window, heads, kv_heads, head_dim, q, k, v } => {
                let mut a = format!(
                    "scale={scale} causal={causal} heads={heads} kv_heads={kv_heads} head_dim={head_dim} q@{q} k@{k} v@{v}"
                );
                if let Some(w) = window {
                    a += &format!(" window={w}");
                }
                if *alibi {
                    a += " alibi";
                }
                a
            }
            Op::Concat { axis } => format!("axis={axis}"),
            Op::Heads { start, heads, head_dim, rope } => {
                let mut a = format!("heads={heads} head_dim={head_dim} at={start}");
                if let Some(r) = rope {
                    a += &format!(" theta={} rotary_dim={} style={}", r.theta, r.rotary_dim, style_name(&r.style));
                }
                a
            }
            _ => String::new(),
        }
    }
}

/// A node: an op, its inferred type, and the model scope it was built in (`layers.3.attn`).
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Inferred shape.
    pub shape: Shape,
    /// Inferred element type.
    pub dtype: DType,
    /// Where in the model this node belongs (for dumps, clusters and errors).
    pub scope: String,
}

/// A shape or type error while building or checking a graph.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{op} in `{scope}`: {message}")]
pub struct GraphError {
    /// The op that could not be typed.
    pub op: String,
    /// Its scope.
    pub scope: String,
    /// What is wrong, with the operand shapes.
    pub message: String,
}

/// A dataflow graph with named outputs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// A name for dumps.
    pub name: String,
    /// Nodes and operand edges (edge weight = operand position).
    pub g: DiGraph<Node, usize>,
    /// Named results.
    pub outputs: Vec<(String, NodeIndex)>,
    /// Scope given to nodes added from now on.
    pub scope: String,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: &str) -> Self {
        Graph { name: name.to_string(), ..Default::default() }
    }

    /// Adds `op` applied to `operands`, inferring its shape and dtype.
    pub fn add(&mut self, op: Op, operands: &[NodeIndex]) -> Result<NodeIndex, GraphError> {
        let types: Vec<(&Shape, DType)> = operands.iter().map(|&i| (&self.g[i].shape, self.g[i].dtype)).collect();
        let (shape, dtype) =
            infer(&op, &types).map_err(|message| GraphError { op: op.name(), scope: self.scope.clone(), message })?;
        let node = self.g.add_node(Node { op, shape, dtype, scope: self.scope.clone() });
        for (pos, &operand) in operands.iter().enumerate() {
            self.g.add_edge(operand, node, pos);
        }
        Ok(node)
    }

    /// The operands of `node`, in operand order.
    pub fn operands(&self, node: NodeIndex) -> Vec<NodeIndex> {
        let mut edges: Vec<(usize, NodeIndex)> =
            self.g.edges_directed(node, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        edges.sort();
        edges.into_iter().map(|(_, n)| n).collect()
    }

    /// A deterministic topological order: among ready nodes, the lowest index first.
    pub fn order(&self) -> Vec<NodeIndex> {
        let mut indegree: Vec<usize> =
            self.g.node_indices().map(|n| self.g.edges_directed(n, Direction::Incoming).count()).collect();
        let mut ready: BinaryHeap<Reverse<usize>> =
            indegree.iter().enumerate().filter(|(_, d)| **d == 0).map(|(i, _)| Reverse(i)).collect();
        let mut order = Vec::with_capacity(indegree.len());
        while let Some(Reverse(i)) = ready.pop() {
            let n = NodeIndex::new(i);
            order.push(n);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let t = e.target().index();
                indegree[t] -= 1;
                if indegree[t] == 0 {
                    ready.push(Reverse(t));
                }
            }
        }
        order
    }

    /// Parameter nodes with their names, in node order.
    pub fn params(&self) -> Vec<(NodeIndex, &str)> {
        self.g
            .node_indices()
            .filter_map(|n| match &self.g[n].op {
                Op::Param { name } => Some((n, name.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Input nodes, in node order.
    pub fn inputs(&self) -> Vec<(NodeIndex, &str, InputRole)> {
        self.g
            .node_indices()
            .filter_map(|n| match &self.g[n].op {
                Op::Input { name, role, .. } => Some((n, name.as_str(), *role)),
                _ => None,
            })
            .collect()
    }

    /// Verifies the IR invariants: acyclic, and every node typed as [`infer`] says.
    pub fn check(&self) -> Result<(), GraphError> {
        if self.order().len() != self.g.node_count() {
            return Err(GraphError {
                op: "graph".into(),
                scope: String::new(),
                message: "the graph has a cycle".into(),
            });
        }
        for n in self.g.node_indices() {
            let node = &self.g[n];
            if let Op::Param { .. } = node.op {
                if node.shape.iter().any(|d| matches!(d, Dim::Sym(_))) || !self.operands(n).is_empty() {
                    return Err(GraphError {
                        op: "param".into(),
                        scope: node.scope.clone(),
                        message: "parameters have fixed shapes and no operands".into(),
                    });
                }
                continue;
            }
            let operands = self.operands(n);
            let types: Vec<(&Shape, DType)> = operands.iter().map(|&i| (&self.g[i].shape, self.g[i].dtype)).collect();
            let err = |message: String| GraphError { op: node.op.name(), scope: node.scope.clone(), message };
            let (shape, dtype) = infer(&node.op, &types).map_err(err)?;
            if shape != node.shape || dtype != node.dtype {
                return Err(err(format!(
                    "recorded type {}{} differs from inferred {dtype}{}",
                    node.dtype,
                    fmt_shape(&node.shape),
                    fmt_shape(&shape)
                )));
            }
        }
        Ok(())
    }
}

/// Shape and dtype rules of every op.
pub fn infer(op: &Op, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
    let arity = |n: usize| -> Result<(), String> {
        if operands.len() == n { Ok(()) } else { Err(format!("expects {n} operand(s), got {}", operands.len())) }
    };
    let float = |i: usize| -> Result<&Shape, String> {
        let (s, t) = operands[i];
        if t == DType::F32 { Ok(s) } else { Err(format!("operand {i} must be f32, is {t}{}", fmt_shape(s))) }
    };
    let rank_at_least = |s: &Shape, r: usize, what: &str| -> Result<(), String> {
        if s.len() >= r { Ok(()) } else { Err(format!("{what} must have rank >= {r}, is {}", fmt_shape(s))) }
    };
    match op {
        Op::Input { role, seq, .. } => {
            arity(0)?;
            if let InputRole::Cache { kv_heads, head_dim } = role {
                let shape = vec![Dim::Sym(Sym::Batch), Dim::Fixed(*kv_heads), Dim::Sym(*seq), Dim::Fixed(*head_dim)];
                return Ok((shape, DType::F32));
            }
            let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(*seq)];
            let dtype = match role {
                InputRole::KeyMask { .. } => DType::F32,
                _ => DType::I64,
            };
            Ok((shape, dtype))
        }
        Op::Param { .. } => Err("parameters are added with Graph::param".into()),
        Op::Positions { len } => {
            arity(0)?;
            Ok((vec![*len], DType::I64))
        }
        Op::Sinusoid { dim, .. } => {
            arity(1)?;
            let (s, t) = operands[0];
            if t != DType::I64 || s.len() != 1 {
                return Err(format!("positions must be i64[n], are {t}{}", fmt_shape(s)));
            }
            Ok((vec![s[0], Dim::Fixed(*dim)], DType::F32))
        }
        Op::Gather => {
            arity(2)?;
            let table = float(0)?;
            let (ids, t) = operands[1];
            if table.len() != 2 {
                return Err(format!("table must be 2-D, is {}", fmt_shape(table)));
            }
            if t != DType::I64 {
                return Err(format!("ids must be i64, are {t}"));
            }
            let mut shape = ids.clone();
            shape.push(table[1]);
            Ok((shape, DType::F32))
        }
        Op::MatMul { transpose_b } => {
            arity(2)?;
            let a = float(0)?;
            let b = float(1)?;
            rank_at_least(a, 2, "a")?;
            rank_at_least(b, 2, "b")?;
            let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
            let (bk, n) =
                if *transpose_b { (b[b.len() - 1], b[b.len() - 2]) } else { (b[b.len() - 2], b[b.len() - 1]) };
            if k != bk {
                return Err(format!(
                    "inner dimensions differ: {} x {}{}",
                    fmt_shape(a),
                    fmt_shape(b),
                    if *transpose_b { "^T" } else { "" }
                ));
            }
            let a_batch = &a[..a.len() - 2];
            let b_batch = &b[..b.len() - 2];
            if !b_batch.is_empty() && b_batch != a_batch {
                return Err(format!("batch axes differ: {} vs {}", fmt_shape(a), fmt_shape(b)));
            }
            let mut shape = a_batch.to_vec();
            shape.extend([m, n]);
            Ok((shape, DType::F32))
        }
        Op::Add | Op::Mul => {
            arity(2)?;
            Ok((broadcast(float(0)?, float(1)?)?, DType::F32))
        }
        Op::Scale { .. } | Op::Act(_) | Op::Softmax | Op::L2Normalize => {
            arity(1)?;
            Ok((float(0)?.clone(), DType::F32))
        }
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            let max = if matches!(op, Op::LayerNorm { .. }) { 3 } else { 2 };
            if operands.len() < 2 || operands.len() > max {
                return Err(format!("expects 2..={max} operands, got {}", operands.len()));
            }
            let x = float(0)?;
            rank_at_least(x, 1, "x")?;
            let d = x[x.len() - 1];
            for i in 1..operands.len() {
                let p = float(i)?;
                if p.as_slice() != [d] {
                    return Err(format!("gain/bias must be [{d}], is {}", fmt_shape(p)));
                }
            }
            Ok((x.clone(), DType::F32))
        }
        Op::Reshape { shape } => {
            arity(1)?;
            let x = float(0)?;
            if numel(x)? != numel(shape)? {
                return Err(format!("cannot reshape {} into {}", fmt_shape(x), fmt_shape(shape)));
            }
            Ok((shape.clone(), DType::F32))
        }
        Op::Permute { perm } => {
            arity(1)?;
            let x = float(0)?;
            let mut seen = vec![false; x.len()];
            if perm.len() != x.len() || perm.iter().any(|&p| p >= x.len() || std::mem::replace(&mut seen[p], true)) {
                return Err(format!("{perm:?} is not a permutation of the axes of {}", fmt_shape(x)));
            }
            Ok((perm.iter().map(|&p| x[p]).collect(), DType::F32))
        }
        Op::Rope { rotary_dim, .. } => {
            arity(1)?;
            let x = float(0)?;
            if x.len() != 4 {
                return Err(format!("x must be [batch, heads, seq, head_dim], is {}", fmt_shape(x)));
            }
            match x[3] {
                Dim::Fixed(d) if *rotary_dim <= d && rotary_dim % 2 == 0 => Ok((x.clone(), DType::F32)),
                _ => Err(format!("rotary_dim {rotary_dim} must be even and fit head_dim of {}", fmt_shape(x))),
            }
        }
        Op::RepeatHeads { times } => {
            arity(1)?;
            let x = float(0)?;
            match x.as_slice() {
                [b, Dim::Fixed(h), s, d] => Ok((vec![*b, Dim::Fixed(h * times), *s, *d], DType::F32)),
                _ => Err(format!("x must be [batch, heads, seq, head_dim] with fixed heads, is {}", fmt_shape(x))),
            }
        }
        Op::Alibi => {
            arity(1)?;
            let x = float(0)?;
            match x.as_slice() {
                [_, Dim::Fixed(_), _, _] => Ok((x.clone(), DType::F32)),
                _ => Err(format!("scores must be [batch, heads, q, k], is {}", fmt_shape(x))),
            }
        }
        Op::Mask { .. } => {
            if operands.is_empty() || operands.len() > 2 {
                return Err(format!("expects 1 or 2 operands, got {}", operands.len()));
            }
            let x = float(0)?;
            if x.len() != 4 {
                return Err(format!("scores must be [batch, heads, q, k], is {}", fmt_shape(x)));
            }
            if operands.len() == 2 {
                let m = float(1)?;
                if m.as_slice() != [x[0], x[3]] {
                    return Err(format!("key mask must be [{}, {}], is {}", x[0], x[3], fmt_shape(m)));
                }
            }
            Ok((x.clone(), DType::F32))
        }
        Op::TopK { k, .. } => {
            arity(1)?;
            let x = float(0)?;
            match x.last() {
                Some(Dim::Fixed(n)) if k <= n && *k > 0 => Ok((x.clone(), DType::F32)),
                _ => Err(format!("k = {k} must be in 1..=last axis of {}", fmt_shape(x))),
            }
        }
        Op::Slice { axis, start, len } => {
            arity(1)?;
            let x = float(0)?;
            match x.get(*axis) {
                Some(Dim::Fixed(n)) if start + len <= *n && *len > 0 => {
                    let mut s = x.clone();
                    s[*axis] = Dim::Fixed(*len);
                    Ok((s, DType::F32))
                }
                _ => Err(format!("slice {start}..{} of axis {axis} is out of {}", start + len, fmt_shape(x))),
            }
        }
        Op::Linear { bias, residual, norm, glu, rope, .. } => {
            let norm_operands = norm.map_or(0, |p| 1 + usize::from(p.bias));
            let wi = 1 + norm_operands;
            let want = wi + 1 + usize::from(*bias) + usize::from(*residual);
            arity(want)?;
            let x = float(0)?;
            let w = float(wi)?;
            rank_at_least(x, 2, "x")?;
            let k = x[x.len() - 1];
            if w.len() != 2 || w[1] != k {
                return Err(format!("weight must be [m, {k}], is {}", fmt_shape(w)));
            }
            for i in 1..wi {
                if float(i)?.as_slice() != [k] {
                    return Err(format!("norm gain/bias must be [{k}], is {}", fmt_shape(float(i)?)));
                }
            }
            let Dim::Fixed(m) = w[0] else { return Err("weight rows must be fixed".into()) };
            if *glu && m % 2 != 0 {
                return Err(format!("a gated weight stacks two equal blocks; {m} rows do not split"));
            }
            let n = if *glu { m / 2 } else { m };
            let mut out = x.clone();
            let last = out.len() - 1;
            out[last] = Dim::Fixed(n);
            if *bias && float(wi + 1)?.as_slice() != [w[0]] {
                return Err(format!("bias must be [{}], is {}", w[0], fmt_shape(float(wi + 1)?)));
            }
            if *residual && *float(want - 1)? != out {
                return Err(format!("residual must be {}, is {}", fmt_shape(&out), fmt_shape(float(want - 1)?)));
            }
            if let Some(r) = rope {
                let ok = r.head_dim > 0
                    && r.rotary_dim % 2 == 0
                    && r.rotary_dim <= r.head_dim
                    && r.len % r.head_dim == 0
                    && r.start + r.len <= n
                    && r.start % 2 == 0
                    && n % 2 == 0
                    && out.len() >= 3;
                if !ok {
                    return Err(format!(
                        "rope columns {}..{} (head_dim {}, rotary_dim {}) do not fit output {}",
                        r.start,
                        r.start + r.len,
                        r.head_dim,
                        r.rotary_dim,
                        fmt_shape(&out)
                    ));
                }
            }
            Ok((out, DType::F32))
        }
        Op::PackedAttention { heads, kv_heads, head_dim, q, k, v, .. } => {
            if operands.is_empty() || operands.len() > 2 {
                return Err(format!("expects 1 or 2 operands, got {}", operands.len()));
            }
            let x = float(0)?;
            let fits =
                |start: usize, count: usize| matches!(x.last(), Some(Dim::Fixed(w)) if start + count * head_dim <= *w);
            let ok = x.len() == 3
                && *kv_heads > 0
                && heads % kv_heads == 0
                && *head_dim > 0
                && fits(*q, *heads)
                && fits(*k, *kv_heads)
                && fits(*v, *kv_heads);
            if !ok {
                return Err(format!(
                    "{heads} query and {kv_heads} key/value heads of {head_dim} at columns {q}, {k}, {v} do not fit {}",
                    fmt_shape(x)
                ));
            }
            if operands.len() == 2 && float(1)?.as_slice() != [x[0], x[1]] {
                return Err(format!("key mask must be [{}, {}], is {}", x[0], x[1], fmt_shape(float(1)?)));
            }
            Ok((vec![x[0], x[1], Dim::Fixed(heads * head_dim)], DType::F32))
        }
        Op::Heads { start, heads, head_dim, rope } => {
            if operands.is_empty() || operands.len() > 2 {
                return Err(format!("expects 1 or 2 operands, got {}", operands.len()));
            }
            let x = float(operands.len() - 1)?;
            let fits = matches!(x.last(), Some(Dim::Fixed(w)) if start + heads * head_dim <= *w);
            let rope_ok = rope.is_none_or(|r| r.rotary_dim % 2 == 0 && r.rotary_dim <= *head_dim && r.rotary_dim > 0);
            if x.len() != 3 || !fits || *heads == 0 || *head_dim == 0 || !rope_ok {
                return Err(format!("{heads} heads of {head_dim} at column {start} do not fit {}", fmt_shape(x)));
            }
            let new = vec![x[0], Dim::Fixed(*heads), x[1], Dim::Fixed(*head_dim)];
            if operands.len() == 1 {
                return Ok((new, DType::F32));
            }
            infer(&Op::Concat { axis: 2 }, &[(float(0)?, DType::F32), (&new, DType::F32)])
        }
        Op::Concat { axis } => {
            arity(2)?;
            let (a, b) = (float(0)?, float(1)?);
            let joined = match (a.get(*axis), b.get(*axis)) {
                (Some(Dim::Fixed(x)), Some(Dim::Fixed(y))) if a.len() == b.len() => Dim::Fixed(x + y),
                // A key/value cache and the new keys.
                (Some(Dim::Sym(Sym::Past)), Some(Dim::Sym(Sym::Seq))) if a.len() == b.len() => Dim::Sym(Sym::Ctx),
                _ => return Err(format!("cannot join {} and {} along axis {axis}", fmt_shape(a), fmt_shape(b))),
            };
            if a.iter().zip(b).enumerate().any(|(i, (x, y))| i != *axis && x != y) {
                return Err(format!("cannot join {} and {} along axis {axis}", fmt_shape(a), fmt_shape(b)));
            }
            let mut out = a.clone();
            out[*axis] = joined;
            Ok((out, DType::F32))
        }
        // Same operands and result as the mask it absorbs.
        Op::MaskedSoftmax { .. } => infer(&Op::Mask { causal: false, window: None }, operands),
        Op::Attention { .. } => {
            if operands.len() < 3 || operands.len() > 4 {
                return Err(format!("expects 3 or 4 operands, got {}", operands.len()));
            }
            let (q, k, v) = (float(0)?, float(1)?, float(2)?);
            match (q.as_slice(), k.as_slice(), v.as_slice()) {
                ([b, Dim::Fixed(h), s, Dim::Fixed(d)], [kb, Dim::Fixed(kv), t, kd], [vb, vkv, vt, vd])
                    if kb == b
                        && vb == b
                        && kd == &Dim::Fixed(*d)
                        && vd == &Dim::Fixed(*d)
                        && vkv == &Dim::Fixed(*kv)
                        && vt == t
                        && *kv > 0
                        && h % kv == 0 =>
                {
                    if operands.len() == 4 && float(3)?.as_slice() != [*b, *t] {
                        return Err(format!("key mask must be [{b}, {t}], is {}", fmt_shape(float(3)?)));
                    }
                    Ok((vec![*b, *s, Dim::Fixed(h * d)], DType::F32))
                }
                _ => Err(format!(
                    "expects q [b, h, s, d], k and v [b, kv, t, d] with kv dividing h; got {}, {}, {}",
                    fmt_shape(q),
                    fmt_shape(k),
                    fmt_shape(v)
                )),
            }
        }
        Op::AddNorm { rms, .. } => {
            let max = if *rms { 3 } else { 4 };
            if operands.len() < 3 || operands.len() > max {
                return Err(format!("expects 3..={max} operands, got {}", operands.len()));
            }
            let (a, b) = (float(0)?, float(1)?);
            if a != b {
                return Err(format!("summands differ: {} and {}", fmt_shape(a), fmt_shape(b)));
            }
            rank_at_least(a, 1, "summands")?;
            let d = a[a.len() - 1];
            for i in 2..operands.len() {
                if float(i)?.as_slice() != [d] {
                    return Err(format!("gain/bias must be [{d}], is {}", fmt_shape(float(i)?)));
                }
            }
            Ok((a.clone(), DType::F32))
        }
        Op::MeanPool => {
            arity(2)?;
            let x = float(0)?;
            let m = float(1)?;
            if x.len() != 3 || m.as_slice() != [x[0], x[1]] {
                return Err(format!("expects x [b, s, d] and mask [b, s], got {} and {}", fmt_shape(x), fmt_shape(m)));
            }
            Ok((vec![x[0], x[2]], DType::F32))
        }
    }
}

/// Numpy broadcasting of two shapes (right-aligned; equal axes or a fixed 1).
pub fn broadcast(a: &Shape, b: &Shape) -> Result<Shape, String> {
    let rank = a.len().max(b.len());
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { Dim::Fixed(1) };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { Dim::Fixed(1) };
        out.push(match (da, db) {
            _ if da == db => da,
            (Dim::Fixed(1), d) | (d, Dim::Fixed(1)) => d,
            _ => return Err(format!("shapes {} and {} do not broadcast", fmt_shape(a), fmt_shape(b))),
        });
    }
    Ok(out)
}

/// Element count of a shape as (fixed product, symbols sorted) so shapes with symbols can be compared.
fn numel(shape: &Shape) -> Result<(usize, Vec<Sym>), String> {
    let mut n: usize = 1;
    let mut syms = Vec::new();
    for d in shape {
        match d {
            Dim::Fixed(k) => n = n.checked_mul(*k).ok_or("shape overflows")?,
            Dim::Sym(s) => syms.push(*s),
        }
    }
    syms.sort();
    Ok((n, syms))
}

impl Graph {
    /// Adds a parameter with a concrete shape.
    pub fn param(&mut self, name: &str, shape: &[usize]) -> NodeIndex {
        self.g.add_node(Node {
            op: Op::Param { name: name.to_string() },
            shape: shape.iter().map(|&d| Dim::Fixed(d)).collect(),
            dtype: DType::F32,
            scope: self.scope.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_summands_of_an_add_norm_are_ill_typed() {
        // A fold read from an artifact may hold any op on any operands; this one used to index
        // the last axis of a rank-0 shape.
        let scalar: Shape = vec![];
        let op = Op::AddNorm { rms: true, eps: Scalar(1e-5) };
        let operands = [(&scalar, DType::F32), (&scalar, DType::F32), (&scalar, DType::F32)];
        let err = infer(&op, &operands).unwrap_err();
        assert!(err.contains("summands must have rank >= 1"), "{err}");
    }
}
