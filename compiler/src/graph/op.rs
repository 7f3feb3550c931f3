//! The ops of the graph IR: [`Op`], one variant per tensor-level operation with its operands
//! documented in order; the attributes ops carry ([`Scalar`], [`Activation`], [`PairStyle`],
//! [`InputRole`], [`Prologue`], [`RopeCols`], [`Rotation`]); and the names and `key=value` attributes that printers show
//! ([`Op::name`], [`Op::attrs`]).

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::{Dim, Shape, Sym, fmt_shape};
use std::fmt;

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

/// What a fused softmax or attention does to its scores besides the scale, ALiBi and the
/// causal/window mask, in this order after the scale: soft-capping, a relative position bias, then
/// a block-sparse mask in place of the causal/window one. The default does none of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ScoreMods {
    /// `cap * tanh(x / cap)` ([`Op::SoftCap`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub softcap: Option<Scalar>,
    /// T5's relative position bias ([`Op::RelativeBias`]) read from a `[buckets, heads]` table,
    /// the op's last operand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relative: Option<Bucketing>,
    /// BigBird's block-sparse pattern ([`Op::BlockSparseMask`]): the kernel visits only the key
    /// blocks a query block attends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse: Option<BlockPattern>,
}

impl ScoreMods {
    /// Whether it does nothing (plain scores).
    pub fn is_plain(&self) -> bool {
        *self == ScoreMods::default()
    }

    /// Attributes as ` key=value` text, each with a leading space (empty when plain).
    fn attrs(&self) -> String {
        let mut a = String::new();
        if let Some(cap) = self.softcap {
            a += &format!(" softcap={cap}");
        }
        if let Some(r) = self.relative {
            a += &format!(
                " relative=[buckets={} max_distance={}{}]",
                r.buckets,
                r.max_distance,
                if r.bidirectional { " bidirectional" } else { "" }
            );
        }
        if let Some(p) = self.sparse {
            a += &format!(
                " sparse=[block={} global={} window={} random={} seed={}]",
                p.block, p.global, p.window, p.random, p.seed
            );
        }
        a
    }
}

/// How T5's relative position bias buckets a distance (see [`Op::RelativeBias`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Bucketing {
    /// Buckets of the table.
    pub buckets: usize,
    /// Distances from here on share the last bucket.
    pub max_distance: usize,
    /// Later keys get buckets of their own (an encoder) rather than distance 0.
    pub bidirectional: bool,
}

impl Bucketing {
    /// The bucketing of a [`Op::RelativeBias`].
    pub fn of(op: &Op) -> Option<Bucketing> {
        match *op {
            Op::RelativeBias { buckets, max_distance, bidirectional, .. } => {
                Some(Bucketing { buckets, max_distance, bidirectional })
            }
            _ => None,
        }
    }

    /// The [`Op::RelativeBias`] of `q` queries over `k` keys with this bucketing.
    pub fn bias(self, q: Dim, k: Dim) -> Op {
        let Bucketing { buckets, max_distance, bidirectional } = self;
        Op::RelativeBias { buckets, max_distance, bidirectional, q, k }
    }
}

/// BigBird's block pattern (see [`crate::semantics::block_pattern`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BlockPattern {
    /// Positions per block.
    pub block: usize,
    /// Leading global blocks.
    pub global: usize,
    /// Neighbour blocks on each side.
    pub window: usize,
    /// Random blocks per query block.
    pub random: usize,
    /// Their seed.
    pub seed: u64,
}

impl BlockPattern {
    /// The pattern of a [`Op::BlockSparseMask`].
    pub fn of(op: &Op) -> Option<BlockPattern> {
        match *op {
            Op::BlockSparseMask { block, global, window, random, seed } => {
                Some(BlockPattern { block, global, window, random, seed })
            }
            _ => None,
        }
    }

    /// The [`Op::BlockSparseMask`] of this pattern.
    pub fn mask(self) -> Op {
        let BlockPattern { block, global, window, random, seed } = self;
        Op::BlockSparseMask { block, global, window, random, seed }
    }
}

/// The configuration of an attention over packed rows ([`Op::PackedAttention`]): its score
/// modifiers, its heads and where they sit in the projection's columns, and whether it reads a
/// cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PackedAttention {
    /// Logit scale.
    pub scale: Scalar,
    /// Add ALiBi biases.
    pub alibi: bool,
    /// Hide later keys.
    pub causal: bool,
    /// Sliding-window size.
    pub window: Option<usize>,
    /// Soft-capping, relative bias, block sparsity.
    #[serde(default, skip_serializing_if = "ScoreMods::is_plain")]
    pub mods: ScoreMods,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// First column of the query heads.
    pub q: usize,
    /// First column of the key heads.
    pub k: usize,
    /// First column of the value heads.
    pub v: usize,
    /// Keys and values come from operands (a cache), not from `qkv`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cached: bool,
    /// With `cached`, in a back end's plan only (never in a graph): the key and value operands
    /// are the caches *before* this step, `[b, kv, past, d]`, and the step also writes the
    /// caches after it, each `past` followed by this step's key (value) columns of `qkv`, as
    /// its two [`Step::also`](crate::lower::Step::also) values: the cache appends done by the
    /// attention's own kernel (see `back::wgsl::fold_appends`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub appends: bool,
}

impl PackedAttention {
    /// The [`Op::Attention`] it equals over its split heads (the same scores, modifiers and mask).
    pub fn unpacked(&self) -> Op {
        Op::Attention {
            scale: self.scale,
            alibi: self.alibi,
            causal: self.causal,
            window: self.window,
            mods: self.mods,
        }
    }

    /// Its `key=value` attributes, as [`Op::attrs`] prints them.
    fn attrs(&self) -> String {
        let PackedAttention { scale, heads, kv_heads, head_dim, q, k, v, .. } = self;
        let mut a = format!(
            "scale={scale} causal={} heads={heads} kv_heads={kv_heads} head_dim={head_dim} q@{q} k@{k} v@{v}",
            self.causal
        );
        if self.cached {
            a += " cached";
        }
        if self.appends {
            a += " appends";
        }
        if let Some(w) = self.window {
            a += &format!(" window={w}");
        }
        if self.alibi {
            a += " alibi";
        }
        a + &self.mods.attrs()
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
    /// Target token ids of a training objective, `i64[batch, seq]`, aligned with the positions
    /// whose scores they grade; the objective's `ignore_index` (-100) where no loss is taken.
    /// Required, like [`InputRole::Ids`].
    Labels,
    /// Cached keys or values of one attention layer, `f32[batch, kv_heads, past, head_dim]`
    /// (empty when nothing is cached yet).
    Cache {
        /// Key/value heads.
        kv_heads: usize,
        /// Width of a head.
        head_dim: usize,
        /// A sliding-window layer's window: its cache holds only the latest `window - 1` tokens
        /// (the [`Sym::Recent`](super::Sym::Recent) axis), all a next query can attend besides
        /// itself. Engines keep it so after each step; the step's keys are contiguous positions
        /// ending at the last query, which is all the masks assume.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        window: Option<usize>,
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

/// An elementwise activation function (see [`crate::semantics::activation`] for each one's
/// definition). The IR's own type: the spec's `ffn.activation` is converted to it when the graph
/// is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Activation {
    /// `max(0, x)`.
    Relu,
    /// Exact GELU, `x * Phi(x)` with the error function.
    Gelu,
    /// GELU's tanh approximation.
    GeluTanh,
    /// `x * sigmoid(x)`.
    Silu,
}

impl Activation {
    /// The name printers and kernels show (the spec's spelling).
    pub fn name(self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu-tanh",
            Activation::Silu => "silu",
        }
    }
}

/// How the two halves of a rotation (or of a sinusoid) are laid out over the dimensions. The
/// IR's own type: the spec's `positions.style` is converted to it when the graph is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PairStyle {
    /// First half / second half (HF's `rotate_half`; sin block then cos block).
    RotateHalf,
    /// Adjacent pairs (2i, 2i+1) (GPT-J, llama.cpp; sin, cos interleaved).
    Interleaved,
}

impl PairStyle {
    /// The name printers show (the spec's spelling).
    pub fn name(self) -> &'static str {
        match self {
            PairStyle::RotateHalf => "rotate-half",
            PairStyle::Interleaved => "interleaved",
        }
    }
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
    /// The operand index of a projection's weight (after the input and the norm's gain and
    /// bias); `None` for every other op.
    pub fn linear_weight(&self) -> Option<usize> {
        match self {
            Op::Linear { norm, .. } => Some(1 + norm.map_or(0, |p| 1 + usize::from(p.bias))),
            _ => None,
        }
    }

    /// Whether this is an optimizer's update of a trained tensor ([`Op::AdamW`], [`Op::Sgd`]).
    pub fn is_update(&self) -> bool {
        matches!(self, Op::AdamW { .. } | Op::Sgd { .. })
    }

    /// Whether this is one of an optimizer's ops: the gradients' squared norms, the clipping
    /// factor or an update ([`Op::SquareSums`], [`Op::ClipScale`], [`Op::is_update`]), which
    /// lowering puts last.
    pub fn is_optimizer(&self) -> bool {
        matches!(self, Op::SquareSums | Op::ClipScale { .. }) || self.is_update()
    }

    /// A plain fused projection: `act(x @ w^T + bias) + residual`.
    pub fn linear(act: Option<Activation>, bias: bool, residual: bool) -> Op {
        Op::Linear { act, bias, residual, norm: None, glu: false, rope: None }
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
    /// Column lookup, [`Op::Gather`] from a table stored transposed, possibly in pieces:
    /// `(table_0 f32[d, w_0], ..., table_n f32[d, w_n], ids i64[...]) -> f32[..., d]`. Piece `p`
    /// holds the table's rows `start_p .. start_p + splits[p]` as its first columns (`w_p` may
    /// be more: a projection's padding), `start_p` the sum of the earlier splits, so `out[...,
    /// j] = table_p[j, id - start_p]` for the piece holding `id`. Not a graph op: the WGSL back
    /// end's gather from an embedding table it also holds transposed as a projection's weight
    /// (a tied head; in pieces when the projection is split to fit the adapter's bindings), so
    /// that the table is held once.
    GatherColumns {
        /// Rows of each piece, in order (their sum is the table's rows).
        splits: Vec<usize>,
    },
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
    /// T5's relative position bias `(table f32[buckets, heads]) -> [1, heads, q, k]`: element
    /// `(h, i, j)` is `table[bucket(j - (i + k - q)), h]` (queries are the last `q` of the `k`
    /// keys). A distance `r` falls in an exact bucket below `max_exact`, else in
    /// `max_exact + trunc(ln(|r| / max_exact) / ln(max_distance / max_exact) * (n - max_exact))`
    /// (capped at `n - 1`), with `n = buckets / 2` and later keys offset by `n` when
    /// `bidirectional`, else `n = buckets` and later keys at distance 0; `max_exact = n / 2`.
    RelativeBias {
        /// Buckets of the table.
        buckets: usize,
        /// Distances from here on share the last bucket.
        max_distance: usize,
        /// Later keys get buckets of their own (an encoder) rather than distance 0.
        bidirectional: bool,
        /// Query positions.
        q: Dim,
        /// Key positions.
        k: Dim,
    },
    /// The first `len` rows of a matrix (axis 0): `[rows, cols] -> [len, cols]`, `len` at most
    /// `rows` (a Linformer projection cut to the sequence).
    Truncate {
        /// Rows kept.
        len: Dim,
    },
    /// BigBird's block-sparse mask over scores `[b, h, q, k]` (`(scores[, key_mask f32[b, k]])`):
    /// entries outside the blocks [`crate::semantics::block_pattern`] allows, or at masked keys,
    /// become the most negative float.
    BlockSparseMask {
        /// Positions per block.
        block: usize,
        /// Leading global blocks.
        global: usize,
        /// Neighbour blocks on each side.
        window: usize,
        /// Random blocks per query block.
        random: usize,
        /// Their seed.
        seed: u64,
    },
    /// Soft-capping: `cap * tanh(x / cap)`.
    SoftCap {
        /// The bound approached.
        cap: Scalar,
    },
    /// `x + value` (a zero-centred norm gain made whole: `norm.gain_offset`).
    Offset {
        /// The constant.
        value: Scalar,
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
    /// The last index of one axis, kept as an axis of extent 1 (`x[.., -1:, ..]`), whatever the
    /// axis' extent, which may be symbolic: a generation step's logits are its last position's
    /// (see `graph::build::build_cached`).
    Last {
        /// The axis.
        axis: usize,
    },
    /// `(a, b)` joined along one axis (the other axes equal).
    Concat {
        /// The axis.
        axis: usize,
    },
    /// Mean over the tokens a mask keeps: `(x [b, s, d], mask f32[b, s]) -> [b, d]`.
    MeanPool,
    /// Its first operand, read no earlier than its second exists: `(x, after) -> x`. A training
    /// step that recomputes a block's activations reads the block's inputs through it, the
    /// gradient arriving at the block as `after`, so the recomputation runs when the backward
    /// reaches the block rather than beside the forward (see `crate::autodiff`). Engines run
    /// nothing for it: it is a view of `x`'s buffer, kept alive until its last reader.
    After,
    /// Sum over one axis, kept with extent 1: `[.., n, ..] -> [.., 1, ..]` (a loss made scalar,
    /// a gradient summed over the axes its operand was broadcast along; see `crate::autodiff`).
    SumAxis {
        /// The axis summed.
        axis: usize,
    },
    /// An activation's derivative times an upstream gradient: `(x, dy) -> dy * act'(x)`,
    /// elementwise over equal shapes (the backward of [`Op::Act`]; see
    /// [`crate::semantics::activation_derivative`]).
    ActGrad(Activation),
    /// The backward of [`Op::Gather`]: `(table f32[rows, d], ids i64[...], dy f32[..., d]
    /// [, base f32[rows, d]]) -> [rows, d]`, row `r` the sum of the rows of `dy` whose id is `r`
    /// (zero for rows no id names), added to `base`'s row where a fourth operand is given (a tied
    /// table's other gradient, summed in the same pass); `table` gives only the shape.
    GatherGrad,
    /// `1 / sqrt(x)`, elementwise (a norm's inverse deviation, in its backward).
    Rsqrt,
    /// Scales the last axis to unit L2 norm: `x / max(||x||, 1e-12)`.
    L2Normalize,
    /// The mean cross-entropy of scores against target ids, the training loss:
    /// `(logits f32[.., vocab], labels i64[..]) -> f32[1]`. Each position whose label is not
    /// `ignore_index` contributes `logsumexp(x) - (1 - smoothing) * x[label] - smoothing / vocab *
    /// sum(x)` (torch's `cross_entropy` with `label_smoothing`); the result is their mean over the
    /// counted positions. A label outside `0..vocab` other than `ignore_index`, or no counted
    /// position, is an error.
    CrossEntropy {
        /// Label smoothing, in `[0, 1)`.
        smoothing: Scalar,
        /// The label of positions that take no loss (torch's -100).
        ignore_index: i64,
    },
    /// The backward of [`Op::CrossEntropy`]: `(logits, labels, dy f32[1]) -> f32[.., vocab]`, at
    /// each counted position `dy * (softmax(x) - (1 - smoothing) * onehot(label) - smoothing /
    /// vocab) / counted`, zero at the others.
    CrossEntropyGrad {
        /// Label smoothing.
        smoothing: Scalar,
        /// The label of positions that take no loss.
        ignore_index: i64,
    },

    /// The backward of [`Op::RelativeBias`]: `(table f32[buckets, heads], dy f32[.., heads, q, k])
    /// -> [buckets, heads]`, element `(r, h)` the sum of `dy[.., h, i, j]` over the query/key pairs
    /// `(i, j)` whose distance falls in bucket `r` (bucketed as the forward op does; zero for
    /// buckets no pair falls in); `table` gives only the shape.
    RelativeBiasGrad {
        /// Buckets of the table.
        buckets: usize,
        /// Distances from here on share the last bucket.
        max_distance: usize,
        /// Later keys get buckets of their own (an encoder) rather than distance 0.
        bidirectional: bool,
    },
    /// The input's gradient of [`Op::Softmax`] from its output: `(y f32[.., n], dy f32[.., n]) ->
    /// [.., n]`, per row `y * (dy - sum(dy * y))`. One pass over the rows where the composition is
    /// five.
    SoftmaxGrad,
    /// The input's gradient of a row norm ([`Op::LayerNorm`], or [`Op::RmsNorm`] with `rms`): `(x
    /// f32[.., d], gain f32[d], dy f32[.., d][, residual f32[.., d]]) -> [.., d]`, per row, with
    /// `r = 1 / sqrt(var + eps)` (`mean(x^2)` for RMS), `xhat` the normalized row and `gx = dy *
    /// gain`: `r (gx - mean(gx) - xhat mean(gx xhat))` (no `mean(gx)` term for RMS), plus
    /// `residual` where given (the gradient the residual path brings to the same input, added in
    /// f32 as `add` would). One pass over the rows where the composition is a score of
    /// elementwise ops and sums.
    NormGrad {
        /// RMSNorm (no centring).
        rms: bool,
        /// Epsilon.
        eps: Scalar,
    },
    /// The gain's gradient of a row norm ([`Op::LayerNorm`], or [`Op::RmsNorm`] with `rms`): `(x
    /// f32[.., d], dy f32[.., d]) -> [d]`, the sum over every row of `dy * xhat`, `xhat` the row
    /// normalized (without gain). One pass over the rows where the composition normalizes them
    /// again, multiplies and sums twice.
    NormGainGrad {
        /// RMSNorm (no centring).
        rms: bool,
        /// Epsilon.
        eps: Scalar,
    },
    /// The backward of [`Op::Truncate`]: `(x f32[rows, cols], dy f32[len, cols]) -> [rows,
    /// cols]`, the rows of `dy` followed by `rows - len` rows of zeros; `x` gives only the shape.
    TruncateGrad,
    /// The backward of [`Op::TopK`]: `(x, dy) -> dx`, equal shapes. With `m` the indicator of the
    /// entries the forward op keeps in each row of the last axis (the same selection, ties to the
    /// lower index), `dx = m * dy`; with `renormalize`, `y = m x / S` and `S = sum(m x)`, `dx = m
    /// (dy - sum(dy * y)) / S`. The selection itself is piecewise constant: no gradient.
    TopKGrad {
        /// Entries kept.
        k: usize,
        /// The forward op rescaled the kept entries to sum to one.
        renormalize: bool,
    },

    // ---- The optimizer's update: the end of a training step's graph (see `train::update`). No
    // gradient rule takes them (nothing is differentiated through an update).
    /// The sum of the squares of each operand's elements: `(x_0, ..., x_{n-1}) -> f32[n]`,
    /// element `i` the sum over `x_i`, accumulated in f64 and rounded once to f32. A training
    /// step's gradient norms (the global norm is the square root of their sum).
    SquareSums,
    /// The factor a training step reads its gradients with: `(loss f32[1], sums f32[n]) ->
    /// f32[1]`, `sums` the squared norms of every gradient of the step ([`Op::SquareSums`]). As
    /// `torch.nn.utils.clip_grad_norm_`, with the global norm `norm = sqrt(sum of sums)` (summed
    /// in f64): `max_norm / (norm + 1e-6)` where that is below 1, else 1 (always 1 without
    /// `max_norm`); NaN where the loss or the norm is not finite, a step the updates do not
    /// take ([`crate::semantics::step_scale`]).
    ClipScale {
        /// The global norm the gradients are clipped to, if any.
        max_norm: Option<Scalar>,
    },
    /// One AdamW step of a parameter, as `torch.optim.AdamW` (not fused, not `foreach`) computes
    /// each element: `(p, g, m, v, scale f32[1], step f32[3]) -> [3, ..p]`, the new parameter,
    /// first moment and second moment stacked; `p`, `g`, `m` and `v` of one shape. `scale` is the
    /// step's [`Op::ClipScale`]; `step` holds the step's constants, `(-lr / (1 - beta1^t),
    /// sqrt(1 - beta2^t), 1 - lr * weight_decay)`. Per element: `g *= scale; p *= decay; m =
    /// lerp(m, g, w1); v = v * b2 + w2 * g * g; p += step[0] * m / (sqrt(v) / step[1] + eps)`,
    /// `decay` being `step[2]` where the parameter decays and 1 where it does not
    /// ([`crate::semantics::adamw`] has the f32 arithmetic). Where `scale` is NaN (a step not
    /// taken) the result is `p, m, v`.
    AdamW {
        /// `1 - beta1`, the first moment's interpolation weight.
        w1: Scalar,
        /// `beta2`.
        b2: Scalar,
        /// `1 - beta2`.
        w2: Scalar,
        /// The denominator's epsilon.
        eps: Scalar,
        /// Whether the parameter takes weight decay.
        decays: bool,
    },
    /// One SGD step of a parameter, as `torch.optim.SGD` (dampening 0, no Nesterov; weight decay
    /// added to the gradient): `(p, g[, buf], scale f32[1], step f32[2]) -> [k, ..p]`, the new
    /// parameter and, with `momentum`, the new momentum buffer stacked (`k` 2, else 1). `scale`
    /// is as [`Op::AdamW`]'s; `step` holds `(-lr, first)`, `first` 1 at the buffer's first step
    /// (where it starts as the gradient) and 0 after. Per element: `g *= scale; g +=
    /// weight_decay * p` (where the parameter decays); with momentum `buf = first ? g : buf *
    /// momentum + g; g = buf`; `p += step[0] * g`. Where `scale` is NaN the result is `p[, buf]`.
    Sgd {
        /// The momentum, if any.
        momentum: Option<Scalar>,
        /// The weight decay, 0 where the parameter takes none.
        weight_decay: Scalar,
    },

    // ---- Fused ops: produced only by the optimizer. Each is defined as a composition of the ops
    // above; the interpreter evaluates it as exactly that composition.
    /// The products of rows summed over every leading axis: `(a f32[.., r, k], b f32[.., r, n])
    /// -> [k, n]`, `sum_axis(0)` (once per leading axis) of `matmul(transpose(a), b)` — the
    /// gradient of a weight shared by every row (`dW = sum over rows of x^T dy`), one GEMM over
    /// all the rows instead of a product per batch entry, its transpose and its sum.
    ContractRows,
    /// The sum over every leading axis: `(x f32[.., r, n]) -> [n]`, `sum_axis(0)` once per
    /// leading axis, the kept axes reshaped away — a bias's gradient (or a norm's shift's), the
    /// upstream gradient summed over every row, in one pass where the composition runs a sum per
    /// axis (on a GPU the last a thread per column walking every row).
    SumRows,
    /// A product with an activation's gradient as its epilogue: `(a f32[.., m, k], b, x f32[..,
    /// m, n]) -> [.., m, n]`, `act_grad(x, matmul(a, b))` — `(a @ b) * act'(x)`, `b` as
    /// [`Op::MatMul`] reads it (`[k, n]`, or `[n, k]` with `transpose_b`). The input gradient of
    /// the projection an activation feeds (`dy @ W`, times the activation's derivative at the
    /// projection's pre-activation output) with the derivative applied to each output element as
    /// the product writes it, where the composition writes the product and then reads it again.
    MatMulActGrad {
        /// The activation whose derivative scales the product.
        act: Activation,
        /// `b` is `[n, k]`, read transposed.
        transpose_b: bool,
    },
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
    /// `softmax(mask(bias(alibi(softcap(scores * scale)))))` over the last axis: `(scores [b, h, q,
    /// k][, key_mask f32[b, k]][, table f32[buckets, h]])`. The mask hides what [`Op::Mask`] hides
    /// (or, with `mods.sparse`, what [`Op::BlockSparseMask`] hides); `alibi` adds [`Op::Alibi`]'s
    /// biases; `mods` adds the soft-cap and the relative position bias of the `table` operand.
    MaskedSoftmax {
        /// Logit scale.
        scale: Scalar,
        /// Add ALiBi biases.
        alibi: bool,
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
        /// Soft-capping, relative bias, block sparsity.
        #[serde(default, skip_serializing_if = "ScoreMods::is_plain")]
        mods: ScoreMods,
    },
    /// Whole attention with the head merge: `(q [b, h, s, d], k [b, kv, t, d], v [b, kv, t, d][,
    /// key_mask f32[b, t]][, table f32[buckets, h]]) -> [b, s, h * d]`, query head `j` reading
    /// key/value head `j / (h / kv)`; scores are masked and normalised as [`Op::MaskedSoftmax`]
    /// does. The kernel never materialises the score matrix (online softmax), and with
    /// `mods.sparse` visits only the key blocks each query block attends.
    Attention {
        /// Logit scale.
        scale: Scalar,
        /// Add ALiBi biases.
        alibi: bool,
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
        /// Soft-capping, relative bias, block sparsity.
        #[serde(default, skip_serializing_if = "ScoreMods::is_plain")]
        mods: ScoreMods,
    },
    /// The gradients of [`Op::Attention`] over split heads, for self-attention (as many keys as
    /// queries): `(q [b, h, s, d], k [b, kv, s, d], v [b, kv, s, d], dout [b, h, s, d][, key_mask
    /// f32[b, s]][, table f32[buckets, h]]) -> [3, b, h, s, d]`: the gradients of the queries, of
    /// the keys and of the values, the keys' and values' as each query head reads them (query head
    /// `j` reads key/value head `j / (h / kv)`; a shared head's gradient is the sum over its
    /// group), given `dout`, the gradient of the heads' outputs before their merge. With `p` the
    /// probabilities [`Op::MaskedSoftmax`] computes from `q k^T` (the same modifiers and operands),
    /// `dp = dout v^T`, `keep` 0 at the keys the mask hides and 1 elsewhere, and `c` the soft-cap's
    /// slope `1 - y^2 / cap^2` at the capped score `y` (1 without one):
    /// `ds = scale * c * keep * p * (dp - rowsum(p * dp))`, and the result is `ds k`, `ds^T q` and
    /// `p^T dout`. The bias table's own gradient is not among them (it is
    /// [`Op::RelativeBiasGrad`] of the score gradient). Kernels recompute the scores per tile of
    /// query rows and never hold the score matrix: flash-attention's backward.
    AttentionGrad {
        /// Logit scale.
        scale: Scalar,
        /// Add ALiBi biases.
        alibi: bool,
        /// Hide later keys.
        causal: bool,
        /// Sliding-window size.
        window: Option<usize>,
        /// Soft-capping, relative bias, block sparsity.
        #[serde(default, skip_serializing_if = "ScoreMods::is_plain")]
        mods: ScoreMods,
    },
    /// Heads read out of a packed projection, optionally normalized, rotated and appended to a
    /// cache: `([past f32[b, heads, p, head_dim],] x [b, s, width][, gain [head_dim]]) -> [b,
    /// heads, p + s, head_dim]`, head `j` of token `t` being columns `start + j * head_dim ..` of
    /// row `t` of `x`, each head RMS-normalized with `gain` when `norm` is set (a query/key norm,
    /// [`Op::RmsNorm`] of the split heads), then rotated as [`Op::Rope`] at position `past + t`
    /// when `rope` is set (`past` as bound: the tokens before these). The
    /// split/transpose/normalize/rotate/concatenate chain of a decoder's attention input as one
    /// kernel.
    Heads {
        /// First column of head 0.
        start: usize,
        /// Heads read.
        heads: usize,
        /// Width of a head.
        head_dim: usize,
        /// RMS-normalize each head with this epsilon (and the gain operand) before rotating.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        norm: Option<Scalar>,
        /// Rotate each head.
        rope: Option<Rotation>,
    },
    /// Attention reading its heads straight out of one packed projection `qkv [b, s, width]`:
    /// query head `j` is columns `q + j * head_dim ..` of each row, key/value head `j` columns
    /// `k + j * head_dim ..` and `v + j * head_dim ..`; `(qkv[, key_mask f32[b, s]]) -> [b, s,
    /// heads * head_dim]` (a relative position bias's table last, as [`Op::Attention`] takes it).
    /// Equal to [`Op::Attention`] over the split, head-transposed tensors.
    ///
    /// With `cached` (a decoder step over a key/value cache), the keys and values are operands of
    /// their own, `(qkv, k [b, kv, t, d], v [b, kv, t, d][, key_mask f32[b, t]][, table])`: the
    /// cache the step's `heads` appended this projection's key and value columns (`k`, `v`) to;
    /// only the query columns of `qkv` are read here. Equal to [`Op::Attention`] over the split
    /// query heads and those tensors.
    PackedAttention(PackedAttention),
    /// Linformer's low-rank projection of heads along the sequence, read out of packed rows:
    /// `(x [b, n, width], e [rows, r]) -> [b, heads, r, head_dim]`, element `(b, j, i, c)` being
    /// `sum over t < n of e[t, i] * x[b, t, start + j * head_dim + c]` (`e` cut to its first `n`
    /// rows, `n` at most `rows`): the split, transpose, truncate and matmul chain of a Linformer
    /// key or value projection as one kernel, O(n r) per head and no `n x n` matrix.
    LowRank {
        /// First column of head 0.
        start: usize,
        /// Heads read.
        heads: usize,
        /// Width of a head.
        head_dim: usize,
    },
    /// `norm(a + b)`, or with `after` `a + norm(b)` (a sandwich block's post-sublayer norm and
    /// its residual): `(a, b, gain[, bias])` with the LayerNorm (with bias operand, or without)
    /// or the RMSNorm of the given epsilon.
    AddNorm {
        /// RMSNorm instead of LayerNorm.
        rms: bool,
        /// Epsilon.
        eps: Scalar,
        /// Normalize `b` alone and add `a` after: `a + norm(b)`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        after: bool,
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
            Op::GatherColumns { .. } => "gather_columns".into(),
            Op::MatMul { transpose_b: false } => "matmul".into(),
            Op::MatMul { transpose_b: true } => "matmul_t".into(),
            Op::Add => "add".into(),
            Op::Mul => "mul".into(),
            Op::Scale { .. } => "scale".into(),
            Op::Offset { .. } => "offset".into(),
            Op::BlockSparseMask { .. } => "block_sparse_mask".into(),
            Op::SoftCap { .. } => "softcap".into(),
            Op::Truncate { .. } => "truncate".into(),
            Op::RelativeBias { .. } => "relative_bias".into(),
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
            Op::Last { .. } => "last".into(),
            Op::MeanPool => "mean_pool".into(),
            Op::After => "after".into(),
            Op::SumAxis { .. } => "sum_axis".into(),
            Op::Rsqrt => "rsqrt".into(),
            Op::GatherGrad => "gather_grad".into(),
            Op::ActGrad(a) => format!("{}_grad", a.name().replace('-', "_")),
            Op::L2Normalize => "l2_normalize".into(),
            Op::CrossEntropy { .. } => "cross_entropy".into(),
            Op::CrossEntropyGrad { .. } => "cross_entropy_grad".into(),
            Op::RelativeBiasGrad { .. } => "relative_bias_grad".into(),
            Op::TruncateGrad => "truncate_grad".into(),
            Op::SoftmaxGrad => "softmax_grad".into(),
            Op::NormGainGrad { rms: false, .. } => "layer_norm_gain_grad".into(),
            Op::NormGainGrad { rms: true, .. } => "rms_norm_gain_grad".into(),
            Op::NormGrad { rms: false, .. } => "layer_norm_grad".into(),
            Op::NormGrad { rms: true, .. } => "rms_norm_grad".into(),
            Op::TopKGrad { .. } => "top_k_grad".into(),
            Op::ContractRows => "contract_rows".into(),
            Op::SumRows => "sum_rows".into(),
            Op::MatMulActGrad { act, transpose_b } => {
                format!("matmul{}_{}_grad", if *transpose_b { "_t" } else { "" }, act.name().replace('-', "_"))
            }
            Op::SquareSums => "square_sums".into(),
            Op::ClipScale { .. } => "clip_scale".into(),
            Op::AdamW { .. } => "adamw".into(),
            Op::Sgd { .. } => "sgd".into(),
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
            Op::PackedAttention(_) => "packed_attention".into(),
            Op::LowRank { .. } => "low_rank".into(),
            Op::Heads { norm, rope, .. } => {
                format!(
                    "heads{}{}",
                    if norm.is_some() { "_norm" } else { "" },
                    if rope.is_some() { "_rope" } else { "" }
                )
            }
            Op::Concat { .. } => "concat".into(),
            Op::MaskedSoftmax { .. } => "masked_softmax".into(),
            Op::Attention { .. } => "attention".into(),
            Op::AttentionGrad { .. } => "attention_grad".into(),
            Op::AddNorm { rms: false, after: false, .. } => "add_layer_norm".into(),
            Op::AddNorm { rms: true, after: false, .. } => "add_rms_norm".into(),
            Op::AddNorm { rms: false, after: true, .. } => "layer_norm_add".into(),
            Op::AddNorm { rms: true, after: true, .. } => "rms_norm_add".into(),
        }
    }

    /// Attributes as `key=value` text (empty when none), deterministic.
    pub fn attrs(&self) -> String {
        match self {
            Op::Input { name, role, .. } => {
                let role = match role {
                    InputRole::Ids => "ids".to_string(),
                    InputRole::TokenTypes => "token-types".to_string(),
                    InputRole::Labels => "labels".to_string(),
                    InputRole::KeyMask { pad_is_one: false } => "key-mask".to_string(),
                    InputRole::KeyMask { pad_is_one: true } => "key-mask pad-is-one".to_string(),
                    InputRole::Cache { window: None, .. } => "cache".to_string(),
                    InputRole::Cache { window: Some(w), .. } => format!("cache window {w}"),
                };
                format!("\"{name}\" {role}")
            }
            Op::Param { name } => format!("\"{name}\""),
            Op::Positions { len } => format!("len={len}"),
            Op::Sinusoid { dim, style: s } => format!("dim={dim} style={}", s.name()),
            Op::Scale { factor } => format!("factor={factor}"),
            Op::Offset { value } => format!("value={value}"),
            Op::BlockSparseMask { block, global, window, random, seed } => {
                format!("block={block} global={global} window={window} random={random} seed={seed}")
            }
            Op::SoftCap { cap } => format!("cap={cap}"),
            Op::Truncate { len } => format!("len={len}"),
            Op::RelativeBias { buckets, max_distance, bidirectional, q, k } => {
                format!("buckets={buckets} max_distance={max_distance} bidirectional={bidirectional} q={q} k={k}")
            }
            Op::RelativeBiasGrad { buckets, max_distance, bidirectional } => {
                format!("buckets={buckets} max_distance={max_distance} bidirectional={bidirectional}")
            }
            Op::LayerNorm { eps } | Op::RmsNorm { eps } | Op::NormGrad { eps, .. } | Op::NormGainGrad { eps, .. } => {
                format!("eps={eps}")
            }
            Op::Reshape { shape } => fmt_shape(shape),
            Op::Permute { perm } => format!("{perm:?}"),
            Op::Rope { theta, rotary_dim, style: s } => {
                format!("theta={theta} rotary_dim={rotary_dim} style={}", s.name())
            }
            Op::RepeatHeads { times } => format!("times={times}"),
            Op::Mask { causal, window } => match window {
                Some(w) => format!("causal={causal} window={w}"),
                None => format!("causal={causal}"),
            },
            Op::TopK { k, renormalize } | Op::TopKGrad { k, renormalize } => {
                format!("k={k} renormalize={renormalize}")
            }
            Op::Slice { axis, start, len } => format!("axis={axis} start={start} len={len}"),
            Op::Last { axis } => format!("axis={axis}"),
            Op::MaskedSoftmax { scale, alibi, causal, window, mods }
            | Op::Attention { scale, alibi, causal, window, mods }
            | Op::AttentionGrad { scale, alibi, causal, window, mods } => {
                let mut a = format!("scale={scale} causal={causal}");
                if let Some(w) = window {
                    a += &format!(" window={w}");
                }
                if *alibi {
                    a += " alibi";
                }
                a + &mods.attrs()
            }
            Op::AddNorm { eps, .. } => format!("eps={eps}"),
            Op::ClipScale { max_norm } => max_norm.map_or(String::new(), |m| format!("max_norm={m}")),
            Op::AdamW { w1, b2, w2, eps, decays } => {
                let a = format!("w1={w1} b2={b2} w2={w2} eps={eps}");
                if *decays { a + " decays" } else { a }
            }
            Op::Sgd { momentum, weight_decay } => {
                let a = format!("weight_decay={weight_decay}");
                momentum.map_or(a.clone(), |m| format!("{a} momentum={m}"))
            }
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
                        r.style.name()
                    ));
                }
                a.join(" ")
            }
            Op::PackedAttention(p) => p.attrs(),
            Op::CrossEntropy { smoothing, ignore_index } | Op::CrossEntropyGrad { smoothing, ignore_index } => {
                format!("smoothing={smoothing} ignore={ignore_index}")
            }
            Op::Concat { axis } | Op::SumAxis { axis } => format!("axis={axis}"),
            Op::LowRank { start, heads, head_dim } => format!("heads={heads} head_dim={head_dim} at={start}"),
            Op::Heads { start, heads, head_dim, norm, rope } => {
                let mut a = format!("heads={heads} head_dim={head_dim} at={start}");
                if let Some(eps) = norm {
                    a += &format!(" eps={eps}");
                }
                if let Some(r) = rope {
                    a += &format!(" theta={} rotary_dim={} style={}", r.theta, r.rotary_dim, r.style.name());
                }
                a
            }
            _ => String::new(),
        }
    }
}
