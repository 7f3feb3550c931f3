//! Shapes in the graph IR: symbolic dimensions ([`Sym`], [`Dim`], [`Shape`]), bound at run time by
//! [`resolve`] and printed by [`fmt_shape`]; and [`infer`], the shape and dtype rule of every op
//! (with numpy [`broadcast`]ing), which [`Graph::add`](super::Graph::add) and
//! [`Graph::check`](super::Graph::check) apply.

#![expect(clippy::indexing_slicing, reason = "`infer` indexes operands and axes only after its arity and rank checks")]

use super::{InputRole, Op, PackedAttention};
use crate::tensor::DType;
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
    /// Keys attended with a cache: `Past + Seq` (a symbolic sum, made by concatenating the cache
    /// and the new keys).
    Ctx,
    /// Tokens in the key/value cache of a sliding-window layer: only the latest, at most
    /// `window - 1` (see [`InputRole::Cache`]), so it stops growing with the context.
    Recent,
    /// Keys a sliding-window layer attends with its cache: `Recent + Seq`.
    RecentCtx,
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
            Sym::Recent => "recent",
            Sym::RecentCtx => "recent_ctx",
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

/// The symbols' values as a table indexed by symbol: what a run that resolves hundreds of shapes
/// reads instead of a hash map (an executor sizes every buffer of every step it binds, every
/// decode step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SymTable([usize; SymTable::LEN]);

impl SymTable {
    const LEN: usize = 7;

    /// The slot of symbol `s`: a match over every symbol, so a new one does not compile until it
    /// has its own.
    fn slot(s: Sym) -> usize {
        match s {
            Sym::Batch => 0,
            Sym::Seq => 1,
            Sym::SrcSeq => 2,
            Sym::Past => 3,
            Sym::Ctx => 4,
            Sym::Recent => 5,
            Sym::RecentCtx => 6,
        }
    }

    /// The table of `syms` (unbound symbols count as 0, as in [`resolve`]).
    pub fn new(syms: &std::collections::HashMap<Sym, usize>) -> SymTable {
        let mut t = [0; SymTable::LEN];
        for (&s, &v) in syms {
            if let Some(slot) = t.get_mut(SymTable::slot(s)) {
                *slot = v;
            }
        }
        SymTable(t)
    }

    /// One axis' extent.
    pub fn dim(&self, d: Dim) -> usize {
        match d {
            Dim::Fixed(k) => k,
            Dim::Sym(s) => self.0.get(SymTable::slot(s)).copied().unwrap_or(0),
        }
    }

    /// [`resolve`] into `out` (cleared first), reusing its allocation.
    pub fn resolve_into(&self, shape: &[Dim], out: &mut Vec<usize>) {
        out.clear();
        out.extend(shape.iter().map(|&d| self.dim(d)));
    }

    /// [`elements`].
    pub fn elements(&self, shape: &[Dim]) -> usize {
        shape.iter().map(|&d| self.dim(d)).product()
    }
}

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

/// The number of elements of `shape` at `syms` ([`resolve`]'s product, without allocating: a
/// run sizes every buffer it binds by it, every step).
pub fn elements(shape: &[Dim], syms: &std::collections::HashMap<Sym, usize>) -> usize {
    shape
        .iter()
        .map(|d| match d {
            Dim::Fixed(k) => *k,
            Dim::Sym(s) => syms.get(s).copied().unwrap_or(0),
        })
        .product()
}

/// Writes `[a, b, c]`.
pub fn fmt_shape(shape: &[Dim]) -> String {
    let dims: Vec<String> = shape.iter().map(Dim::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// Shape and dtype rules of every op.
pub fn infer(op: &Op, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
    if let Some((plain, buckets)) = without_relative_bias(op) {
        // The table comes last; the rest are typed as the op without the bias.
        let Some(((table, dtype), rest)) = operands.split_last() else { return Err("expects a bias table".into()) };
        let (out, t) = infer(&plain, rest)?;
        let heads = match (&plain, out.get(1)) {
            (Op::MaskedSoftmax { .. }, Some(h)) => *h,
            (Op::PackedAttention(PackedAttention { heads, .. }), _) => Dim::Fixed(*heads),
            _ => rest.first().and_then(|(q, _)| q.get(1)).copied().unwrap_or(Dim::Fixed(0)),
        };
        if *dtype != DType::F32 || table.as_slice() != [Dim::Fixed(buckets), heads] {
            return Err(format!("the bias table must be f32[{buckets}, {heads}], is {dtype}{}", fmt_shape(table)));
        }
        return Ok((out, t));
    }
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
            if let InputRole::Cache { kv_heads, head_dim, .. } = role {
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
        Op::Truncate { len } => {
            arity(1)?;
            let t = float(0)?;
            match (t.as_slice(), len) {
                ([Dim::Fixed(rows), _], Dim::Fixed(n)) if n > rows => Err(format!("cannot keep {n} of {rows} rows")),
                ([_, cols], _) => Ok((vec![*len, *cols], DType::F32)),
                _ => Err(format!("truncates a matrix, not {}", fmt_shape(t))),
            }
        }
        Op::RelativeBias { buckets, q, k, .. } => {
            arity(1)?;
            let t = float(0)?;
            match t.as_slice() {
                [Dim::Fixed(n), h @ Dim::Fixed(_)] if n == buckets => Ok((vec![Dim::Fixed(1), *h, *q, *k], DType::F32)),
                _ => Err(format!("the table must be [{buckets}, heads], is {}", fmt_shape(t))),
            }
        }
        Op::Sinusoid { dim, .. } => {
            arity(1)?;
            let (s, t) = operands[0];
            if t != DType::I64 || s.len() != 1 {
                return Err(format!("positions must be i64[n], are {t}{}", fmt_shape(s)));
            }
            Ok((vec![s[0], Dim::Fixed(*dim)], DType::F32))
        }
        Op::GatherColumns { splits } => {
            arity(splits.len() + 1)?;
            let (ids, t) = operands[splits.len()];
            if t != DType::I64 {
                return Err(format!("ids must be i64, are {t}"));
            }
            let mut d = None;
            for (p, &rows) in splits.iter().enumerate() {
                let table = float(p)?;
                match table.as_slice() {
                    [dp, Dim::Fixed(w)] if *w >= rows && d.is_none_or(|d| d == *dp) => d = Some(*dp),
                    _ => {
                        return Err(format!(
                            "piece {p} of the table must be [d, at least {rows}] like the others, is {}",
                            fmt_shape(table)
                        ));
                    }
                }
            }
            let d = d.ok_or("a column gather needs at least one piece of the table")?;
            let mut shape = ids.clone();
            shape.push(d);
            Ok((shape, DType::F32))
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
        Op::Scale { .. }
        | Op::Offset { .. }
        | Op::SoftCap { .. }
        | Op::Act(_)
        | Op::Softmax
        | Op::L2Normalize
        | Op::Rsqrt => {
            arity(1)?;
            Ok((float(0)?.clone(), DType::F32))
        }
        Op::NormGainGrad { .. } => {
            arity(2)?;
            let (x, dy) = (float(0)?, float(1)?);
            rank_at_least(x, 1, "x")?;
            if x != dy {
                return Err(format!("x and dy differ: {} and {}", fmt_shape(x), fmt_shape(dy)));
            }
            Ok((vec![x[x.len() - 1]], DType::F32))
        }
        Op::SoftmaxGrad => {
            arity(2)?;
            let (y, dy) = (float(0)?, float(1)?);
            rank_at_least(y, 1, "y")?;
            if y != dy {
                return Err(format!("y and dy differ: {} and {}", fmt_shape(y), fmt_shape(dy)));
            }
            Ok((y.clone(), DType::F32))
        }
        Op::NormGrad { .. } => {
            if !(3..=4).contains(&operands.len()) {
                return Err(format!("expects 3 or 4 operands, got {}", operands.len()));
            }
            let (x, gain, dy) = (float(0)?, float(1)?, float(2)?);
            rank_at_least(x, 1, "x")?;
            if gain.as_slice() != &x[x.len() - 1..] || x != dy {
                return Err(format!(
                    "expects x [.., d], gain [d] and dy of x's shape, got {}, {} and {}",
                    fmt_shape(x),
                    fmt_shape(gain),
                    fmt_shape(dy)
                ));
            }
            if operands.len() == 4 && float(3)? != x {
                return Err(format!("expects a residual of x's shape {}, got {}", fmt_shape(x), fmt_shape(float(3)?)));
            }
            Ok((x.clone(), DType::F32))
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
        Op::Mask { .. } | Op::BlockSparseMask { .. } => {
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
        Op::Last { axis } => {
            arity(1)?;
            let x = float(0)?;
            match x.get(*axis) {
                Some(_) => {
                    let mut s = x.clone();
                    s[*axis] = Dim::Fixed(1);
                    Ok((s, DType::F32))
                }
                None => Err(format!("axis {axis} is out of {}", fmt_shape(x))),
            }
        }
        Op::Linear { bias, residual, glu, rope, .. } => {
            let wi = op.linear_weight().unwrap_or(1);
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
        Op::PackedAttention(PackedAttention { heads, kv_heads, head_dim, q, k, v, cached, appends, .. }) => {
            if *appends && !*cached {
                return Err("appends to caches it does not read (`appends` without `cached`)".into());
            }
            let caches = if *cached { 2 } else { 0 };
            if operands.len() < 1 + caches || operands.len() > 2 + caches {
                return Err(format!("expects {} or {} operands, got {}", 1 + caches, 2 + caches, operands.len()));
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
            // Keys: the packed rows, or the cache's.
            let mut keys = x[1];
            if *cached {
                let (kc, vc) = (float(1)?, float(2)?);
                let want = |c: &Shape| matches!(c.as_slice(), [b, Dim::Fixed(h), _, Dim::Fixed(d)] if *b == x[0] && h == kv_heads && d == head_dim);
                if !want(kc) || vc != kc {
                    return Err(format!(
                        "keys and values must be [{}, {kv_heads}, t, {head_dim}] alike, are {} and {}",
                        x[0],
                        fmt_shape(kc),
                        fmt_shape(vc)
                    ));
                }
                keys = kc[2];
                if *appends {
                    // The caches before this step, then this step's rows.
                    keys = match (keys, x[1]) {
                        (Dim::Sym(Sym::Past), Dim::Sym(Sym::Seq)) => Dim::Sym(Sym::Ctx),
                        (Dim::Sym(Sym::Recent), Dim::Sym(Sym::Seq)) => Dim::Sym(Sym::RecentCtx),
                        (Dim::Fixed(p), Dim::Fixed(s)) => Dim::Fixed(p + s),
                        (p, s) => return Err(format!("cannot append {s} rows to a cache of {p}")),
                    };
                }
            }
            if let Some(m) = operands.get(1 + caches)
                && (m.1 != DType::F32 || m.0.as_slice() != [x[0], keys])
            {
                return Err(format!("key mask must be f32[{}, {}], is {}", x[0], keys, fmt_shape(m.0)));
            }
            Ok((vec![x[0], x[1], Dim::Fixed(heads * head_dim)], DType::F32))
        }
        Op::LowRank { start, heads, head_dim } => {
            arity(2)?;
            let (x, e) = (float(0)?, float(1)?);
            match (x.as_slice(), e.as_slice()) {
                ([b, n, Dim::Fixed(w)], [rows, r]) if start + heads * head_dim <= *w => {
                    if let (Dim::Fixed(n), Dim::Fixed(rows)) = (n, rows)
                        && n > rows
                    {
                        return Err(format!("{n} rows asked of a projection of {rows}"));
                    }
                    Ok((vec![*b, Dim::Fixed(*heads), *r, Dim::Fixed(*head_dim)], DType::F32))
                }
                _ => Err(format!(
                    "expects x [b, n, width] holding {heads} heads of {head_dim} at column {start} and e [rows, r]; got {} and {}",
                    fmt_shape(x),
                    fmt_shape(e)
                )),
            }
        }
        Op::Heads { start, heads, head_dim, norm, rope } => {
            let gain = usize::from(norm.is_some());
            if operands.len() < 1 + gain || operands.len() > 2 + gain {
                return Err(format!("expects {} or {} operands, got {}", 1 + gain, 2 + gain, operands.len()));
            }
            let x = float(operands.len() - 1 - gain)?;
            if gain == 1 && *float(operands.len() - 1)? != [Dim::Fixed(*head_dim)] {
                return Err(format!(
                    "the norm's gain must be [{head_dim}], is {}",
                    fmt_shape(float(operands.len() - 1)?)
                ));
            }
            let fits = matches!(x.last(), Some(Dim::Fixed(w)) if start + heads * head_dim <= *w);
            let rope_ok = rope.is_none_or(|r| r.rotary_dim % 2 == 0 && r.rotary_dim <= *head_dim && r.rotary_dim > 0);
            if x.len() != 3 || !fits || *heads == 0 || *head_dim == 0 || !rope_ok {
                return Err(format!("{heads} heads of {head_dim} at column {start} do not fit {}", fmt_shape(x)));
            }
            let new = vec![x[0], Dim::Fixed(*heads), x[1], Dim::Fixed(*head_dim)];
            if operands.len() == 1 + gain {
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
                (Some(Dim::Sym(Sym::Recent)), Some(Dim::Sym(Sym::Seq))) if a.len() == b.len() => {
                    Dim::Sym(Sym::RecentCtx)
                }
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
        Op::AttentionGrad { .. } => {
            if operands.len() < 4 || operands.len() > 5 {
                return Err(format!("expects 4 or 5 operands, got {}", operands.len()));
            }
            let (q, k, v, dout) = (float(0)?, float(1)?, float(2)?, float(3)?);
            match (q.as_slice(), k.as_slice()) {
                ([b, Dim::Fixed(h), s, Dim::Fixed(d)], [kb, Dim::Fixed(kv), t, kd])
                    if kb == b && t == s && kd == &Dim::Fixed(*d) && v == k && dout == q && *kv > 0 && h % kv == 0 =>
                {
                    if operands.len() == 5 && float(4)?.as_slice() != [*b, *s] {
                        return Err(format!("key mask must be [{b}, {s}], is {}", fmt_shape(float(4)?)));
                    }
                    Ok((vec![Dim::Fixed(3), *b, Dim::Fixed(*h), *s, Dim::Fixed(*d)], DType::F32))
                }
                _ => Err(format!(
                    "expects q and dout [b, h, s, d], k and v [b, kv, s, d] with kv dividing h; got {}, {}, {}, {}",
                    fmt_shape(q),
                    fmt_shape(k),
                    fmt_shape(v),
                    fmt_shape(dout)
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
        Op::SumAxis { axis } => {
            arity(1)?;
            let mut shape = float(0)?.clone();
            match shape.get_mut(*axis) {
                Some(d) => *d = Dim::Fixed(1),
                None => return Err(format!("axis {axis} is out of range for {}", fmt_shape(float(0)?))),
            }
            Ok((shape, DType::F32))
        }
        Op::GatherGrad => {
            if !(3..=4).contains(&operands.len()) {
                return Err(format!("expects 3 or 4 operands, got {}", operands.len()));
            }
            let table = float(0)?;
            if operands.len() == 4 && float(3)? != table {
                return Err(format!("the base must be {}, is {}", fmt_shape(table), fmt_shape(float(3)?)));
            }
            let (ids, t) = operands[1];
            let dy = float(2)?;
            if table.len() != 2 || t != DType::I64 {
                return Err(format!("expects a 2-D table and i64 ids, got {} and {t}", fmt_shape(table)));
            }
            let mut want = ids.clone();
            want.push(table[1]);
            if *dy != want {
                return Err(format!("dy must be {}, is {}", fmt_shape(&want), fmt_shape(dy)));
            }
            Ok((table.clone(), DType::F32))
        }
        Op::RelativeBiasGrad { buckets, .. } => {
            arity(2)?;
            let (table, dy) = (float(0)?, float(1)?);
            match (table.as_slice(), dy.as_slice()) {
                ([Dim::Fixed(n), h], [.., dh, _, _]) if n == buckets && h == dh => Ok((table.clone(), DType::F32)),
                _ => Err(format!(
                    "expects a [{buckets}, heads] table and dy [.., heads, q, k], got {} and {}",
                    fmt_shape(table),
                    fmt_shape(dy)
                )),
            }
        }
        Op::TruncateGrad => {
            arity(2)?;
            let (x, dy) = (float(0)?, float(1)?);
            match (x.as_slice(), dy.as_slice()) {
                ([Dim::Fixed(rows), _], [Dim::Fixed(n), _]) if n > rows => Err(format!("{n} rows of {rows}")),
                ([_, cols], [_, c]) if cols == c => Ok((x.clone(), DType::F32)),
                _ => Err(format!(
                    "expects x [rows, cols] and dy [len, cols], got {} and {}",
                    fmt_shape(x),
                    fmt_shape(dy)
                )),
            }
        }
        Op::MatMulActGrad { transpose_b, .. } => {
            arity(3)?;
            let (product, _) = infer(&Op::MatMul { transpose_b: *transpose_b }, &operands[..2])?;
            let x = float(2)?;
            if *x != product {
                return Err(format!("x must have the product's shape {}, is {}", fmt_shape(&product), fmt_shape(x)));
            }
            Ok((product, DType::F32))
        }
        Op::SumRows => {
            arity(1)?;
            let x = float(0)?;
            rank_at_least(x, 2, "x")?;
            Ok((vec![x[x.len() - 1]], DType::F32))
        }
        Op::ContractRows => {
            arity(2)?;
            let (a, b) = (float(0)?, float(1)?);
            rank_at_least(a, 2, "a")?;
            if a.len() != b.len() || a[..a.len() - 1] != b[..b.len() - 1] {
                return Err(format!("the rows of a and b differ: {} and {}", fmt_shape(a), fmt_shape(b)));
            }
            Ok((vec![a[a.len() - 1], b[b.len() - 1]], DType::F32))
        }
        Op::SquareSums => {
            if operands.is_empty() {
                return Err("expects at least one operand".into());
            }
            for i in 0..operands.len() {
                float(i)?;
            }
            Ok((vec![Dim::Fixed(operands.len())], DType::F32))
        }
        Op::ClipScale { .. } => {
            arity(2)?;
            if float(0)?.as_slice() != [Dim::Fixed(1)] {
                return Err(format!("the loss must be f32[1], is {}", fmt_shape(float(0)?)));
            }
            if !matches!(float(1)?.as_slice(), [Dim::Fixed(n)] if *n > 0) {
                return Err(format!("the norms must be a vector f32[n], are {}", fmt_shape(float(1)?)));
            }
            Ok((vec![Dim::Fixed(1)], DType::F32))
        }
        Op::AdamW { .. } | Op::Sgd { .. } => {
            let (state, constants) = match op {
                Op::AdamW { .. } => (2, 3),
                Op::Sgd { momentum, .. } => (usize::from(momentum.is_some()), 2),
                _ => (0, 0),
            };
            arity(2 + state + 2)?;
            let p = float(0)?;
            for i in 1..2 + state {
                if float(i)? != p {
                    return Err(format!(
                        "operand {i} must have the parameter's shape {}, has {}",
                        fmt_shape(p),
                        fmt_shape(float(i)?)
                    ));
                }
            }
            if float(2 + state)?.as_slice() != [Dim::Fixed(1)] {
                return Err(format!("the clipping factor must be f32[1], is {}", fmt_shape(float(2 + state)?)));
            }
            if float(3 + state)?.as_slice() != [Dim::Fixed(constants)] {
                let got = fmt_shape(float(3 + state)?);
                return Err(format!("the step's constants must be f32[{constants}], are {got}"));
            }
            let mut out = vec![Dim::Fixed(1 + state)];
            out.extend(p.iter().copied());
            Ok((out, DType::F32))
        }
        Op::TopKGrad { k, .. } => {
            arity(2)?;
            let (x, dy) = (float(0)?, float(1)?);
            if x != dy {
                return Err(format!("x and dy differ: {} and {}", fmt_shape(x), fmt_shape(dy)));
            }
            match x.last() {
                Some(Dim::Fixed(n)) if k <= n && *k > 0 => Ok((x.clone(), DType::F32)),
                _ => Err(format!("k = {k} must be in 1..=last axis of {}", fmt_shape(x))),
            }
        }
        Op::CrossEntropy { .. } | Op::CrossEntropyGrad { .. } => {
            let grad = matches!(op, Op::CrossEntropyGrad { .. });
            arity(if grad { 3 } else { 2 })?;
            let logits = float(0)?;
            let (labels, t) = operands[1];
            rank_at_least(logits, 1, "logits")?;
            if t != DType::I64 || labels.as_slice() != &logits[..logits.len() - 1] {
                return Err(format!(
                    "labels must be i64{} (the logits' shape without the vocabulary), are {t}{}",
                    fmt_shape(&logits[..logits.len() - 1]),
                    fmt_shape(labels)
                ));
            }
            if grad && float(2)?.as_slice() != [Dim::Fixed(1)] {
                return Err(format!("dy must be [1], is {}", fmt_shape(float(2)?)));
            }
            Ok(if grad { (logits.clone(), DType::F32) } else { (vec![Dim::Fixed(1)], DType::F32) })
        }
        Op::ActGrad(_) => {
            arity(2)?;
            let (x, dy) = (float(0)?, float(1)?);
            if x != dy {
                return Err(format!("x and dy differ: {} and {}", fmt_shape(x), fmt_shape(dy)));
            }
            Ok((x.clone(), DType::F32))
        }
        Op::After => {
            arity(2)?;
            let (shape, dtype) = operands[0];
            Ok((shape.clone(), dtype))
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

/// A fused softmax or attention with a relative position bias as the same op without it, and the
/// bias's bucket count.
fn without_relative_bias(op: &Op) -> Option<(Op, usize)> {
    let mut plain = op.clone();
    let mods = match &mut plain {
        Op::MaskedSoftmax { mods, .. }
        | Op::Attention { mods, .. }
        | Op::AttentionGrad { mods, .. }
        | Op::PackedAttention(PackedAttention { mods, .. }) => mods,
        _ => return None,
    };
    let r = mods.relative.take()?;
    Some((plain, r.buckets))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Scalar;

    #[test]
    fn scalar_summands_of_an_add_norm_are_ill_typed() {
        // A fold read from an artifact may hold any op on any operands; this one used to index
        // the last axis of a rank-0 shape.
        let scalar: Shape = vec![];
        let op = Op::AddNorm { rms: true, eps: Scalar(1e-5), after: false };
        let operands = [(&scalar, DType::F32), (&scalar, DType::F32), (&scalar, DType::F32)];
        let err = infer(&op, &operands).unwrap_err();
        assert!(err.contains("summands must have rank >= 1"), "{err}");
    }

    #[test]
    fn a_sym_table_resolves_as_the_map_does() {
        let all = [Sym::Batch, Sym::Seq, Sym::SrcSeq, Sym::Past, Sym::Ctx, Sym::Recent, Sym::RecentCtx];
        let syms: std::collections::HashMap<Sym, usize> = all.iter().enumerate().map(|(i, &s)| (s, 3 + i)).collect();
        let mut partial = syms.clone();
        partial.remove(&Sym::Recent);
        let shape: Shape = all.iter().map(|&s| Dim::Sym(s)).chain([Dim::Fixed(5)]).collect();
        let mut out = vec![9; 20];
        for map in [&syms, &partial] {
            let table = SymTable::new(map);
            table.resolve_into(&shape, &mut out);
            assert_eq!(out, resolve(&shape, map));
            assert_eq!(table.elements(&shape), elements(&shape, map));
        }
    }
}
