//! The CPU reference interpreter: executes any [`Graph`] in f32.
//!
//! This is kiln's in-house oracle. It is written for clarity, not speed: every op is a plain loop
//! over row-major data that states the op's meaning. The optimizer's rewrites and the GPU kernels
//! are tested against it, and it is tested against the golden outputs of independent
//! implementations.
//!
//! Inputs are bound by name through [`bind_inputs`], which also fills defaults (an all-ones mask,
//! zero token types), flips torch-style padding masks and binds the symbolic dimensions.

#![expect(
    clippy::indexing_slicing,
    reason = "ops are evaluated only with the operands their typing rule accepts: nodes of a graph \
              that `Graph::check` accepted, or folds that `eval_op` checks with `graph::infer`, so \
              arity, ranks and the output shape hold; inputs are bound by `bind_named_with`, which \
              checks their ranks and dimensions, and gather ids are range-checked before use"
)]

use crate::graph::{Activation, Dim, Graph, InputRole, Op, PairStyle, Scalar, Sym, resolve};
use crate::memory::{MemoryError, f32_bytes};
use crate::semantics::{
    activation, alibi_slopes, block_pattern, layer_norm_row, relative_bucket, rms_norm_row, rope_frequencies, rotate,
    score_operands,
};
use crate::tensor::{DType, Data, Tensor, Tensor64};
use petgraph::graph::NodeIndex;
use std::collections::HashMap;

/// A run-time error: bad inputs or weights (the graph itself is assumed checked).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum InterpError {
    /// A required input was not given.
    #[error("missing input `{0}`")]
    MissingInput(String),
    /// An input has the wrong rank or disagrees with another about a dimension.
    #[error("input `{name}`: {message}")]
    BadInput {
        /// The input.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A parameter was not supplied.
    #[error("missing parameter `{0}`")]
    MissingParam(String),
    /// A parameter has the wrong shape.
    #[error("parameter `{name}`: expected shape {expected:?}, found {found:?}")]
    ParamShape {
        /// The parameter.
        name: String,
        /// The graph's shape.
        expected: Vec<usize>,
        /// The supplied shape.
        found: Vec<usize>,
    },
    /// An index (token id, position) is outside its table.
    #[error("{what} {index} is out of range for `{table}` ({rows} rows)")]
    IndexOutOfRange {
        /// What was looked up.
        what: &'static str,
        /// The index.
        index: i64,
        /// The table (a parameter name).
        table: String,
        /// Its rows.
        rows: usize,
    },
    /// A tensor would be too large to allocate.
    #[error("`{scope}`: a {op} result of {elements} elements is over the limit of {limit}")]
    TooLarge {
        /// The op.
        op: String,
        /// Its scope.
        scope: String,
        /// Elements asked for.
        elements: u128,
        /// The limit.
        limit: u128,
    },
    /// A result larger than the memory available (see [`crate::memory`]).
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    /// An op given operands its typing rule ([`crate::graph::infer`]) refuses, or a result shape
    /// other than the one it infers: a fold of a damaged or foreign plan.
    #[error("cannot evaluate {op}: {message}")]
    IllTyped {
        /// The op.
        op: String,
        /// What is wrong.
        message: String,
    },
}

type R<T> = Result<T, InterpError>;

/// The largest tensor the interpreter will allocate (elements).
pub const MAX_ELEMENTS: u128 = 1 << 32;

/// Inputs bound to a graph: tensors by input node, and the values of the symbolic dimensions.
#[derive(Clone, Debug, Default)]
pub struct Bound {
    /// Tensors by input node.
    pub tensors: HashMap<NodeIndex, Tensor>,
    /// Values of the symbols.
    pub syms: HashMap<Sym, usize>,
}

/// A model input as the binder sees it.
#[derive(Clone, Copy, Debug)]
pub struct InputSpec<'a> {
    /// The name it is given under.
    pub name: &'a str,
    /// How it is bound.
    pub role: InputRole,
    /// The symbol of its sequence axis.
    pub seq: Sym,
}

/// Binds named tensors to the graph's inputs (see [`bind_named`]).
pub fn bind_inputs(g: &Graph, given: &HashMap<String, Tensor>) -> R<Bound> {
    let nodes: Vec<NodeIndex> = g.inputs().iter().map(|(n, _, _)| *n).collect();
    let specs: Vec<InputSpec> = g
        .inputs()
        .iter()
        .map(|&(n, name, role)| {
            let seq = if let Op::Input { seq, .. } = &g.g[n].op { *seq } else { Sym::Seq };
            InputSpec { name, role, seq }
        })
        .collect();
    let (tensors, syms) = bind_named(&specs, given)?;
    Ok(Bound { tensors: nodes.into_iter().zip(tensors).collect(), syms })
}

/// Binds named tensors to input specs, returning one tensor per spec (in order) and the values of
/// the symbols. Extra tensors are ignored; ids and token types must be integers `[batch, seq]`;
/// masks may be any numeric type and become f32 "1 = attend" (flipped for `pad_is_one`); an absent
/// mask is all ones and absent token types are zeros.
pub fn bind_named(specs: &[InputSpec], given: &HashMap<String, Tensor>) -> R<(Vec<Tensor>, HashMap<Sym, usize>)> {
    let (tensors, syms) = bind_named_with(specs, given, &HashMap::<&str, Vec<usize>>::new())?;
    // With nothing resident, every spec is bound to a tensor.
    Ok((tensors.into_iter().flatten().collect(), syms))
}

/// Bound inputs, one per spec (`None`: resident), and the values of the symbols.
pub type Binding = (Vec<Option<Tensor>>, HashMap<Sym, usize>);

/// [`bind_named`] where some cache inputs already live elsewhere (on a device): `resident`
/// gives their shapes by input name, which are checked and bound like given tensors; their
/// entries in the result are `None`.
pub fn bind_named_with<S: AsRef<[usize]>>(
    specs: &[InputSpec],
    given: &HashMap<String, Tensor>,
    resident: &HashMap<&str, S>,
) -> R<Binding> {
    let mut syms: HashMap<Sym, usize> = HashMap::new();
    let mut out: Vec<Option<Tensor>> = vec![None; specs.len()];
    // Ids first: they fix batch and sequence lengths; then caches, which fix the lengths of what
    // they hold (an encoder's memory fixes the source length a source mask defaults from); masks
    // and token types last, since they default from those.
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&i| match specs[i].role {
        InputRole::Ids => 0,
        InputRole::Cache { .. } => 1,
        _ => 2,
    });
    for i in order {
        let InputSpec { name, role, seq: seq_sym } = specs[i];
        let bad = |message: String| InterpError::BadInput { name: name.to_string(), message };
        if let InputRole::Cache { kv_heads, head_dim, .. } = role {
            let cache = match (given.get(name), resident.get(name)) {
                (Some(t), _) => Some(CacheArg::Host(t)),
                (None, Some(shape)) => Some(CacheArg::Resident(shape.as_ref())),
                (None, None) => None,
            };
            out[i] = bind_cache(name, seq_sym, kv_heads, head_dim, cache, &mut syms)?;
            continue;
        }
        if resident.contains_key(name) && !given.contains_key(name) {
            return Err(bad("only cache inputs can stay on the device; give this one as a tensor".into()));
        }
        // A mask may also be given under its other polarity's name (`src_mask`, HF's "1 = token",
        // for `src_padding`, torch.nn's "1 = padding", and the other way round).
        let mut role = role;
        let other = match role {
            InputRole::KeyMask { pad_is_one } => other_polarity(name).map(|n| (n, !pad_is_one)),
            _ => None,
        };
        let alternate = other.as_ref().and_then(|(n, flipped)| given.get(n).map(|t| (n, t, *flipped)));
        let tensor = match (given.get(name), alternate, role) {
            (Some(t), Some((other, alt, _)), _) => {
                // Both given (a fixture file holds both): they must say the same.
                let (a, b) = (t.to_f32_vec(), alt.to_f32_vec());
                if t.shape != alt.shape || a.iter().zip(&b).any(|(x, y)| (*x != 0.0) == (*y != 0.0)) {
                    return Err(bad(format!(
                        "`{name}` and `{other}` are given and disagree (one is the other's complement)"
                    )));
                }
                t.clone()
            }
            (None, Some((_, t, flipped)), _) => {
                role = InputRole::KeyMask { pad_is_one: flipped };
                t.clone()
            }
            (Some(t), _, _) => t.clone(),
            (None, _, InputRole::Ids | InputRole::Labels) => return Err(InterpError::MissingInput(name.to_string())),
            (None, None, _) => {
                let (b, s) = match (syms.get(&Sym::Batch), syms.get(&seq_sym)) {
                    (Some(b), Some(s)) => (*b, *s),
                    _ => return Err(InterpError::MissingInput(name.to_string())),
                };
                // An absent mask means every position is a token: ones in the "1 = token"
                // polarity (`X_mask`), zeros in the "1 = padding" one (`X_padding`).
                match role {
                    InputRole::TokenTypes => Tensor::i64(vec![b, s], vec![0; b * s]),
                    InputRole::KeyMask { pad_is_one: true } => Tensor::f32(vec![b, s], vec![0.0; b * s]),
                    _ => Tensor::f32(vec![b, s], vec![1.0; b * s]),
                }
            }
        };
        if tensor.shape.len() != 2 {
            return Err(bad(format!("expected [batch, {}], got shape {:?}", seq_sym.name(), tensor.shape)));
        }
        if tensor.shape[0] == 0 || tensor.shape[1] == 0 {
            return Err(bad(format!("empty input of shape {:?}", tensor.shape)));
        }
        for (sym, value) in [(Sym::Batch, tensor.shape[0]), (seq_sym, tensor.shape[1])] {
            match syms.insert(sym, value) {
                Some(prev) if prev != value => {
                    return Err(bad(format!("{} is {value} here but {prev} in another input", sym.name())));
                }
                _ => {}
            }
        }
        let tensor = match role {
            InputRole::Ids | InputRole::TokenTypes | InputRole::Labels => match tensor.dtype() {
                DType::I64 => tensor,
                DType::F32 => return Err(bad("expected integer ids, got f32".into())),
            },
            InputRole::KeyMask { pad_is_one } => {
                let v = tensor.to_f32_vec();
                // A weight between 0 and 1 has no meaning here: refuse it rather than round it.
                if let Some((at, x)) = v.iter().enumerate().find(|(_, x)| **x != 0.0 && **x != 1.0) {
                    let meaning = if pad_is_one { "1 = padding, 0 = token" } else { "1 = attend, 0 = padding" };
                    return Err(bad(format!("a mask holds only 0 and 1 ({meaning}); found {x} at element {at}")));
                }
                let v = v.iter().map(|&x| if (x != 0.0) != pad_is_one { 1.0 } else { 0.0 }).collect();
                Tensor::f32(tensor.shape.clone(), v)
            }
            InputRole::Cache { .. } => tensor, // bound by `bind_cache` above
        };
        out[i] = Some(tensor);
    }
    bind_past(specs, given, &mut syms)?;
    if let Some(&seq) = syms.get(&Sym::Seq) {
        for (cached, attended) in [(Sym::Past, Sym::Ctx), (Sym::Recent, Sym::RecentCtx)] {
            if let Some(&len) = syms.get(&cached) {
                syms.insert(attended, len + seq);
            }
        }
    }
    Ok((out, syms))
}

/// The name under which a cached step may be given the number of tokens before it, `i64[1]`
/// (or `[]`): where positions (RoPE) start. Without it, that is the length of the caches of
/// global layers; a graph whose every cache is a sliding window's (which stops growing at
/// `window - 1`) needs it once its caches are not empty. Sessions always give it.
pub const PAST_LEN: &str = "past_len";

/// Binds [`Sym::Past`] from [`PAST_LEN`] where given (it must agree with the global caches), or
/// else from the sliding caches while they are empty.
fn bind_past(specs: &[InputSpec], given: &HashMap<String, Tensor>, syms: &mut HashMap<Sym, usize>) -> R<()> {
    let bad = |message: String| InterpError::BadInput { name: PAST_LEN.to_string(), message };
    let has = |sym: Sym| specs.iter().any(|s| matches!(s.role, InputRole::Cache { .. }) && s.seq == sym);
    if !has(Sym::Past) && !has(Sym::Recent) {
        return Ok(()); // not a cached step
    }
    match given.get(PAST_LEN) {
        Some(t) => {
            let value = match t.as_i64() {
                Some(&[v]) if t.shape.len() <= 1 => v,
                _ => return Err(bad(format!("expected one integer (i64[1]), got {}{:?}", t.dtype(), t.shape))),
            };
            let past = usize::try_from(value).map_err(|_| bad(format!("{value} tokens")))?;
            if let Some(&cached) = syms.get(&Sym::Past).filter(|&&p| p != past) {
                return Err(bad(format!("is {past}, but the global layers' caches hold {cached} tokens")));
            }
            if let Some(&recent) = syms.get(&Sym::Recent).filter(|&&r| r > past) {
                return Err(bad(format!("is {past}, but the sliding-window caches hold {recent} tokens")));
            }
            syms.insert(Sym::Past, past);
        }
        None if syms.contains_key(&Sym::Past) => {}
        None => match syms.get(&Sym::Recent) {
            Some(0) | None => {
                syms.insert(Sym::Past, 0);
            }
            Some(recent) => {
                return Err(InterpError::BadInput {
                    name: PAST_LEN.to_string(),
                    message: format!(
                        "must be given: the sliding-window caches hold the latest {recent} tokens, which does not say how many came before"
                    ),
                });
            }
        },
    }
    Ok(())
}

/// The name of the same key mask in the other polarity: `X_padding` (1 = padding) <-> `X_mask`
/// (1 = token); `attention_mask` <-> `attention_padding`.
fn other_polarity(name: &str) -> Option<String> {
    if let Some(stem) = name.strip_suffix("_padding") {
        Some(format!("{stem}_mask"))
    } else {
        name.strip_suffix("_mask").map(|stem| format!("{stem}_padding"))
    }
}

/// A cache input as given: a tensor, or the shape of one that lives on a device.
enum CacheArg<'a> {
    Host(&'a Tensor),
    Resident(&'a [usize]),
}

/// Binds one layer's cached keys or values, `f32[batch, kv_heads, len, head_dim]`, where `len`
/// is the symbol `seq` (`past` for a self-attention cache, `src_seq` for an encoder's memory).
/// An absent self-attention cache means nothing cached yet; an encoder's memory must be given.
/// Every cache input must agree on `len`. A resident cache binds to `None`.
fn bind_cache(
    name: &str,
    seq: Sym,
    kv_heads: usize,
    head_dim: usize,
    given: Option<CacheArg>,
    syms: &mut HashMap<Sym, usize>,
) -> R<Option<Tensor>> {
    let bad = |message: String| InterpError::BadInput { name: name.to_string(), message };
    let batch = *syms.get(&Sym::Batch).ok_or_else(|| InterpError::MissingInput("the token ids".into()))?;
    let (tensor, shape, dtype) = match given {
        Some(CacheArg::Host(t)) => (Some(t.clone()), t.shape.clone(), t.dtype()),
        Some(CacheArg::Resident(shape)) => (None, shape.to_vec(), DType::F32),
        None if seq == Sym::Past || seq == Sym::Recent => {
            let t = Tensor::f32(vec![batch, kv_heads, 0, head_dim], vec![]);
            (Some(t.clone()), t.shape, DType::F32)
        }
        None => return Err(InterpError::MissingInput(name.to_string())),
    };
    if dtype != DType::F32 || shape.len() != 4 || shape[0] != batch || shape[1] != kv_heads || shape[3] != head_dim {
        return Err(bad(format!(
            "expected f32[{batch}, {kv_heads}, {}, {head_dim}], got {dtype}{shape:?}",
            seq.name()
        )));
    }
    match syms.insert(seq, shape[2]) {
        Some(prev) if prev != shape[2] => {
            Err(bad(format!("{} is {} here but {prev} in another input", seq.name(), shape[2])))
        }
        _ => Ok(tensor),
    }
}

/// Runs the graph: parameters by canonical name, inputs by input name. Returns the named outputs.
pub fn run(g: &Graph, params: &HashMap<String, Tensor>, inputs: &HashMap<String, Tensor>) -> R<Vec<(String, Tensor)>> {
    let bound = bind_inputs(g, inputs)?;
    run_bound(g, params, bound)
}

/// Runs the graph on already bound inputs.
pub fn run_bound(g: &Graph, params: &HashMap<String, Tensor>, bound: Bound) -> R<Vec<(String, Tensor)>> {
    let param = |name: &String, shape: Vec<usize>| -> R<Tensor> {
        let t = params.get(name).ok_or_else(|| InterpError::MissingParam(name.clone()))?;
        if t.shape != shape || t.dtype() != DType::F32 {
            return Err(InterpError::ParamShape { name: name.clone(), expected: shape, found: t.shape.clone() });
        }
        Ok(t.clone())
    };
    evaluate(g, param, bound.tensors, &bound.syms)
}

/// [`run`] in f64, the reference mode: every op computes in f64 (attributes, which graphs hold
/// in f32, are widened; a mask's "most negative float" is f64's), so that a finite difference
/// of its loss, or a gradient graph it evaluates, carries f64 rounding rather than f32's.
/// Parameters are f64; inputs are bound as [`run`] binds them (ids stay integers, masks are
/// widened). An integer output (positions) is returned widened to f64.
pub fn run_f64(
    g: &Graph,
    params: &HashMap<String, Tensor64>,
    inputs: &HashMap<String, Tensor>,
) -> R<Vec<(String, Tensor64)>> {
    let Bound { tensors, syms } = bind_inputs(g, inputs)?;
    let tensors = tensors.into_iter().map(|(n, t)| (n, Value64::from(t))).collect();
    let param = |name: &String, shape: Vec<usize>| -> R<Value64> {
        let t = params.get(name).ok_or_else(|| InterpError::MissingParam(name.clone()))?;
        if t.shape != shape || t.data.len() != shape.iter().product::<usize>() {
            return Err(InterpError::ParamShape { name: name.clone(), expected: shape, found: t.shape.clone() });
        }
        Ok(Value64 { shape, data: Elems64::F64(t.data.clone()) })
    };
    let out = evaluate(g, param, tensors, &syms)?;
    Ok(out.into_iter().map(|(name, v)| (name, v.into())).collect())
}

/// Evaluates `g` in `V`'s precision: its inputs bound to `inputs` (by node) with the symbols
/// `syms`, its parameters as `param` gives them (by name and resolved shape).
fn evaluate<V: Value>(
    g: &Graph,
    param: impl Fn(&String, Vec<usize>) -> R<V>,
    mut inputs: HashMap<NodeIndex, V>,
    syms: &HashMap<Sym, usize>,
) -> R<Vec<(String, V)>> {
    let order = g.order();
    // Remaining uses of each value, so intermediates are dropped as soon as they are dead.
    let mut uses: HashMap<NodeIndex, usize> = HashMap::new();
    for &n in &order {
        for o in g.operands(n) {
            *uses.entry(o).or_default() += 1;
        }
    }
    for (_, n) in &g.outputs {
        *uses.entry(*n).or_default() += 1;
    }
    let mut values: HashMap<NodeIndex, V> = HashMap::new();
    let past = syms.get(&Sym::Past).copied().unwrap_or(0);
    for &n in &order {
        let node = &g.g[n];
        let shape = resolve(&node.shape, syms);
        let elements: u128 = shape.iter().map(|&d| d as u128).product();
        if elements > MAX_ELEMENTS {
            return Err(InterpError::TooLarge {
                op: node.op.name(),
                scope: node.scope.clone(),
                elements,
                limit: MAX_ELEMENTS,
            });
        }
        let bytes = f32_bytes(elements.saturating_mul(V::F::WORDS));
        crate::memory::check(|| format!("`{}`: a {} result", node.scope, node.op.name()), bytes)?;
        let operands = g.operands(n);
        let out = match &node.op {
            Op::Input { .. } => inputs.remove(&n).ok_or_else(|| InterpError::MissingInput(node.op.attrs()))?,
            Op::Param { name } => param(name, shape)?,
            op => {
                let args: Vec<&V> = operands.iter().map(|o| &values[o]).collect();
                eval(Ctx { node: Some((g, &operands)), past }, op, &args, shape)?
            }
        };
        for o in &operands {
            if let Some(u) = uses.get_mut(o) {
                *u -= 1;
                if *u == 0 {
                    values.remove(o);
                }
            }
        }
        values.insert(n, out);
    }
    Ok(g.outputs.iter().map(|(name, n)| (name.clone(), values[n].clone())).collect())
}

/// The float type an evaluation computes in: f32 (the public API's, every engine's) or f64 (the
/// reference mode, [`run_f64`]). Op attributes, f32 in graphs, are widened to it; where the f32
/// evaluation accumulates in f64 (sums, norms' statistics, the cross-entropy), an evaluation in
/// f64 does the same, so that the f32 one is exactly what it was before it was made generic.
trait Real:
    Copy
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::iter::Sum
{
    /// Zero.
    const ZERO: Self;
    /// The most negative finite value: a masked score.
    const MIN: Self;
    /// Negative infinity: where a maximum starts.
    const NEG_INFINITY: Self;
    /// Size in 4-byte words (for the memory check).
    const WORDS: u128;
    /// An attribute (f32 in graphs), widened.
    fn from_f32(x: f32) -> Self;
    /// A value computed in f64, rounded to this type.
    fn from_f64(x: f64) -> Self;
    /// This value in f64 (exact).
    fn to_f64(self) -> f64;
    /// An index as a value (`as`).
    fn from_usize(n: usize) -> Self;
    /// `e^self`.
    fn exp(self) -> Self;
    /// `tanh(self)`.
    fn tanh(self) -> Self;
    /// The larger of two values (the other where one is NaN).
    fn max(self, other: Self) -> Self;
    /// [`activation`] in this type.
    fn activation(act: Activation, x: Self) -> Self;
    /// [`crate::semantics::activation_derivative`] in this type.
    fn activation_derivative(act: Activation, x: Self) -> Self;
    /// [`layer_norm_row`] in this type.
    fn layer_norm_row(row: &mut [Self], gain: &[Self], bias: Option<&[Self]>, eps: f32);
    /// [`rms_norm_row`] in this type.
    fn rms_norm_row(row: &mut [Self], gain: &[Self], eps: f32);
    /// [`rotate`] in this type.
    fn rotate(head: &mut [Self], pos: Self, inv: &[Self], style: PairStyle);
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const MIN: Self = f32::MIN;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    const WORDS: u128 = 1;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_usize(n: usize) -> Self {
        n as f32
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    fn activation(act: Activation, x: Self) -> Self {
        activation(act, x)
    }
    fn activation_derivative(act: Activation, x: Self) -> Self {
        crate::semantics::activation_derivative(act, x)
    }
    fn layer_norm_row(row: &mut [Self], gain: &[Self], bias: Option<&[Self]>, eps: f32) {
        layer_norm_row(row, gain, bias, eps);
    }
    fn rms_norm_row(row: &mut [Self], gain: &[Self], eps: f32) {
        rms_norm_row(row, gain, eps);
    }
    fn rotate(head: &mut [Self], pos: Self, inv: &[Self], style: PairStyle) {
        rotate(head, pos, inv, style);
    }
}

/// The definitions of [`crate::semantics`], in f64 throughout.
impl Real for f64 {
    const ZERO: Self = 0.0;
    const MIN: Self = f64::MIN;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    const WORDS: u128 = 2;
    fn from_f32(x: f32) -> Self {
        f64::from(x)
    }
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_usize(n: usize) -> Self {
        n as f64
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    fn activation(act: Activation, x: Self) -> Self {
        match act {
            Activation::Relu => x.max(0.0),
            Activation::Gelu => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
            Activation::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }
            Activation::Silu => x / (1.0 + (-x).exp()),
        }
    }
    fn activation_derivative(act: Activation, x: Self) -> Self {
        crate::semantics::activation_derivative_f64(act, x, libm::erf)
    }
    fn layer_norm_row(row: &mut [Self], gain: &[Self], bias: Option<&[Self]>, eps: f32) {
        let d = row.len().max(1) as f64;
        let mean = row.iter().sum::<f64>() / d;
        let var = row.iter().map(|&v| (v - mean).powi(2)).sum::<f64>() / d;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for (j, (v, &g)) in row.iter_mut().zip(gain).enumerate() {
            *v = (*v - mean) * inv * g + bias.and_then(|b| b.get(j)).copied().unwrap_or(0.0);
        }
    }
    fn rms_norm_row(row: &mut [Self], gain: &[Self], eps: f32) {
        let ms = row.iter().map(|&v| v.powi(2)).sum::<f64>() / row.len().max(1) as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        for (v, &g) in row.iter_mut().zip(gain) {
            *v = *v * inv * g;
        }
    }
    fn rotate(head: &mut [Self], pos: Self, inv: &[Self], style: PairStyle) {
        let half = inv.len();
        for (i, &freq) in inv.iter().enumerate() {
            let (sin, cos) = (pos * freq).sin_cos();
            let (i1, i2) = match style {
                PairStyle::RotateHalf => (i, i + half),
                PairStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            let (x1, x2) = (head[i1], head[i2]);
            head[i1] = x1 * cos - x2 * sin;
            head[i2] = x2 * cos + x1 * sin;
        }
    }
}

/// A value an evaluation computes on: floats of its precision `F`, or integers (ids, positions).
/// [`Tensor`] is the f32 one; [`Value64`] the f64 one.
trait Value: Clone {
    /// The float type.
    type F: Real;
    /// Extent of each axis.
    fn shape(&self) -> &[usize];
    /// The floats, if this is a float value.
    fn floats(&self) -> Option<&[Self::F]>;
    /// The floats, mutably, if this is a float value.
    fn floats_mut(&mut self) -> Option<&mut [Self::F]>;
    /// The integers, if this is an integer value.
    fn ints(&self) -> Option<&[i64]>;
    /// A float value.
    fn of_floats(shape: Vec<usize>, data: Vec<Self::F>) -> Self;
    /// An integer value.
    fn of_ints(shape: Vec<usize>, data: Vec<i64>) -> Self;
    /// The same elements under another shape of as many.
    fn reshaped(self, shape: Vec<usize>) -> Self;
}

impl Value for Tensor {
    type F = f32;
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn floats(&self) -> Option<&[f32]> {
        self.as_f32()
    }
    fn floats_mut(&mut self) -> Option<&mut [f32]> {
        match &mut self.data {
            Data::F32(v) => Some(v),
            Data::I64(_) => None,
        }
    }
    fn ints(&self) -> Option<&[i64]> {
        self.as_i64()
    }
    fn of_floats(shape: Vec<usize>, data: Vec<f32>) -> Self {
        Tensor::f32(shape, data)
    }
    fn of_ints(shape: Vec<usize>, data: Vec<i64>) -> Self {
        Tensor::i64(shape, data)
    }
    fn reshaped(self, shape: Vec<usize>) -> Self {
        Tensor { shape, data: self.data }
    }
}

/// A value of an evaluation in f64: [`run_f64`]'s counterpart of [`Tensor`].
#[derive(Clone, Debug)]
struct Value64 {
    shape: Vec<usize>,
    data: Elems64,
}

/// The elements of a [`Value64`], row-major.
#[derive(Clone, Debug)]
enum Elems64 {
    F64(Vec<f64>),
    I64(Vec<i64>),
}

impl From<Tensor> for Value64 {
    /// Floats widened, integers kept.
    fn from(t: Tensor) -> Self {
        let data = match t.data {
            Data::F32(v) => Elems64::F64(v.into_iter().map(f64::from).collect()),
            Data::I64(v) => Elems64::I64(v),
        };
        Value64 { shape: t.shape, data }
    }
}

impl From<Value64> for Tensor64 {
    /// Integers widened, floats kept.
    fn from(v: Value64) -> Self {
        let data = match v.data {
            Elems64::F64(x) => x,
            Elems64::I64(x) => x.into_iter().map(|i| i as f64).collect(),
        };
        Tensor64 { shape: v.shape, data }
    }
}

impl Value for Value64 {
    type F = f64;
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn floats(&self) -> Option<&[f64]> {
        match &self.data {
            Elems64::F64(v) => Some(v),
            Elems64::I64(_) => None,
        }
    }
    fn floats_mut(&mut self) -> Option<&mut [f64]> {
        match &mut self.data {
            Elems64::F64(v) => Some(v),
            Elems64::I64(_) => None,
        }
    }
    fn ints(&self) -> Option<&[i64]> {
        match &self.data {
            Elems64::I64(v) => Some(v),
            Elems64::F64(_) => None,
        }
    }
    fn of_floats(shape: Vec<usize>, data: Vec<f64>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len(), "shape {shape:?}");
        Value64 { shape, data: Elems64::F64(data) }
    }
    fn of_ints(shape: Vec<usize>, data: Vec<i64>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len(), "shape {shape:?}");
        Value64 { shape, data: Elems64::I64(data) }
    }
    fn reshaped(self, shape: Vec<usize>) -> Self {
        Value64 { shape, data: self.data }
    }
}

#[expect(clippy::expect_used, reason = "eval runs only on well-typed ops: see `eval`")]
fn f<V: Value>(t: &V) -> &[V::F] {
    t.floats().expect("graph typing guarantees floats here")
}

/// Evaluates one op on tensors outside any graph (constant folding at load time). `shape` is the
/// op's resolved output shape.
///
/// The op and its operands need not come from a checked graph (a plan read from a file holds
/// them), so the op's typing rule is checked on the actual operands first: whatever the evaluator
/// assumes about arity, dtypes and ranks then holds.
pub fn eval_op(op: &Op, args: &[&Tensor], shape: Vec<usize>) -> R<Tensor> {
    eval_op_at(op, args, shape, 0)
}

/// [`eval_op`] after `past` cached tokens (where [`Op::Positions`] and the rotary ops start):
/// how an engine without a kernel of its own for an op runs it with the interpreter's meaning.
pub fn eval_op_at(op: &Op, args: &[&Tensor], shape: Vec<usize>, past: usize) -> R<Tensor> {
    let ill = |message: String| InterpError::IllTyped { op: op.name(), message };
    if matches!(op, Op::Input { .. } | Op::Param { .. }) {
        return Err(ill("inputs and parameters are bound, not evaluated".into()));
    }
    let shapes: Vec<Vec<Dim>> = args.iter().map(|t| t.shape.iter().map(|&d| Dim::Fixed(d)).collect()).collect();
    let typed: Vec<(&Vec<Dim>, DType)> = shapes.iter().zip(args).map(|(s, t)| (s, t.dtype())).collect();
    let (inferred, _) = crate::graph::infer(op, &typed).map_err(ill)?;
    // A symbolic dimension (the length of `positions`, which has no operands to take it from)
    // is whatever the caller resolved it to.
    let fits = inferred.len() == shape.len()
        && inferred.iter().zip(&shape).all(|(d, &n)| matches!(d, Dim::Sym(_)) || *d == Dim::Fixed(n));
    if !fits {
        return Err(ill(format!("its operands give shape {inferred:?}, the plan says {shape:?}")));
    }
    eval(Ctx { node: None, past }, op, args, shape)
}

/// Heads `0..heads` of width `head_dim` read out of packed rows `x [b, s, width]` from column
/// `start` on, as `[b, s, heads, head_dim]`: the slice and split that `packed_attention`, `heads`
/// and `low_rank` stand for.
fn head_columns<V: Value>(ctx: Ctx, x: &V, start: usize, heads: usize, head_dim: usize) -> R<V> {
    let (b, s) = (x.shape()[0], x.shape()[1]);
    let cols = eval(ctx, &Op::Slice { axis: 2, start, len: heads * head_dim }, &[x], vec![b, s, heads * head_dim])?;
    Ok(cols.reshaped(vec![b, s, heads, head_dim]))
}

/// Scores `[b, h, q, k]` with every entry `keep(query position, key)` refuses, or at a masked key
/// (`key_mask [b, k]`, 0 = masked), set to the most negative float. Queries are the last `q` of
/// the `k` positions.
fn mask_scores<V: Value>(
    x: &[V::F],
    key_mask: Option<&[V::F]>,
    shape: Vec<usize>,
    keep: impl Fn(usize, usize) -> bool,
) -> V {
    let mut x = x.to_vec();
    let (heads, q, k) = (shape[1], shape[2], shape[3]);
    let offset = k.saturating_sub(q);
    for (row_index, row) in x.chunks_mut(k.max(1)).enumerate() {
        let b = row_index / (heads * q).max(1);
        let qi = row_index % q.max(1) + offset;
        for (ki, v) in row.iter_mut().enumerate() {
            if !(keep(qi, ki) && key_mask.is_none_or(|m| m[b * k + ki] != V::F::ZERO)) {
                *v = V::F::MIN;
            }
        }
    }
    V::of_floats(shape, x)
}

/// The indices of the `k` largest entries of `row`, largest first; ties keep the lower index
/// (a stable sort). The selection of [`Op::TopK`] and [`Op::TopKGrad`].
fn top_k<T: Real>(row: &[T], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&i, &j| row[j].partial_cmp(&row[i]).unwrap_or(std::cmp::Ordering::Equal));
    idx.truncate(k);
    idx
}

/// The bucket of each query/key pair `(i, j)` of `q` queries over `k` keys, at `i * k + j`: the
/// queries are the last `q` of the keys. The bucketing of [`Op::RelativeBias`] and
/// [`Op::RelativeBiasGrad`].
fn relative_buckets(q: usize, k: usize, bidirectional: bool, buckets: usize, max_distance: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(q * k);
    for i in 0..q {
        for j in 0..k {
            let rel = j as i64 - (i + k - q.min(k)) as i64;
            out.push(relative_bucket(rel, bidirectional, buckets, max_distance));
        }
    }
    out
}

/// [`rope_frequencies`] (f32, as HF computes them: constants of the model) widened to `T`.
fn frequencies<T: Real>(theta: f32, rotary_dim: usize) -> Vec<T> {
    rope_frequencies(theta, rotary_dim).into_iter().map(T::from_f32).collect()
}

/// The graph and operand nodes of the op being evaluated, when there is one (for error
/// messages), and the number of cached tokens (positions start there).
#[derive(Clone, Copy)]
struct Ctx<'a> {
    node: Option<(&'a Graph, &'a [NodeIndex])>,
    past: usize,
}

/// Evaluates one op. `shape` is the node's resolved output shape.
///
/// The op is well typed: its operands are what [`crate::graph::infer`] accepts and `shape` is what
/// it gives, because the op is a node of a checked graph ([`Graph::check`]) or a fold that
/// [`eval_op`] checked. Arity, dtypes and ranks are therefore not checked again here.
#[expect(clippy::expect_used, reason = "operand dtypes and ranks are guaranteed by the typing rules")]
fn eval<V: Value>(ctx: Ctx, op: &Op, a: &[&V], shape: Vec<usize>) -> R<V> {
    Ok(match op {
        Op::Input { .. } | Op::Param { .. } => {
            return Err(InterpError::IllTyped { op: op.name(), message: "bound before evaluation".into() });
        }
        Op::Positions { .. } => {
            let start = ctx.past as i64;
            V::of_ints(shape.clone(), (start..start + shape[0] as i64).collect())
        }
        Op::Sinusoid { dim, style } => {
            let pos = a[0].ints().expect("positions are i64");
            let mut out = vec![V::F::ZERO; pos.len() * dim];
            let half = dim / 2;
            for (p, &position) in pos.iter().enumerate() {
                for i in 0..half {
                    let angle = position as f64 / 10000f64.powf(2.0 * i as f64 / *dim as f64);
                    let (s, c) = (V::F::from_f64(angle.sin()), V::F::from_f64(angle.cos()));
                    let (is, ic) = match style {
                        PairStyle::Interleaved => (2 * i, 2 * i + 1),
                        PairStyle::RotateHalf => (i, half + i),
                    };
                    out[p * dim + is] = s;
                    out[p * dim + ic] = c;
                }
            }
            V::of_floats(shape, out)
        }
        Op::GatherColumns { splits } => {
            let ids = a[splits.len()].ints().expect("ids are i64");
            let d = a[0].shape()[0];
            let rows: usize = splits.iter().sum();
            let mut out = Vec::with_capacity(ids.len() * d);
            for &id in ids {
                if id < 0 || id as usize >= rows {
                    return Err(InterpError::IndexOutOfRange {
                        what: "token id",
                        index: id,
                        table: "table".into(),
                        rows,
                    });
                }
                // The piece holding row `id`, and the row's column in it.
                let (mut p, mut col) = (0, id as usize);
                while col >= splits[p] {
                    col -= splits[p];
                    p += 1;
                }
                let (t, w) = (f(a[p]), a[p].shape()[1]);
                out.extend((0..d).map(|j| t[j * w + col]));
            }
            V::of_floats(shape, out)
        }
        Op::Gather => {
            let (table, ids) = (a[0], a[1].ints().expect("ids are i64"));
            let (rows, d) = (table.shape()[0], table.shape()[1]);
            let t = f(table);
            let mut out = Vec::with_capacity(ids.len() * d);
            for &id in ids {
                if id < 0 || id as usize >= rows {
                    let what = match ctx.node.map(|(g, operands)| &g.g[operands[1]].op) {
                        Some(Op::Positions { .. }) => "position",
                        Some(Op::Input { role: InputRole::TokenTypes, .. }) => "token type id",
                        _ => "token id",
                    };
                    let table = match ctx.node.map(|(g, operands)| &g.g[operands[0]].op) {
                        Some(Op::Param { name }) => name.clone(),
                        _ => "table".into(),
                    };
                    return Err(InterpError::IndexOutOfRange { what, index: id, table, rows });
                }
                out.extend_from_slice(&t[id as usize * d..(id as usize + 1) * d]);
            }
            V::of_floats(shape, out)
        }
        Op::MatMul { transpose_b } => V::of_floats(shape, matmul(a[0], a[1], *transpose_b)),
        Op::Add => V::of_floats(shape.clone(), broadcast_binary(a[0], a[1], &shape, |x, y| x + y)),
        Op::Mul => V::of_floats(shape.clone(), broadcast_binary(a[0], a[1], &shape, |x, y| x * y)),
        Op::Scale { factor } => {
            let factor = V::F::from_f32(factor.0);
            V::of_floats(shape, f(a[0]).iter().map(|&x| x * factor).collect())
        }
        Op::Offset { value } => {
            let value = V::F::from_f32(value.0);
            V::of_floats(shape, f(a[0]).iter().map(|&x| x + value).collect())
        }
        Op::SoftCap { cap } => {
            let cap = V::F::from_f32(cap.0);
            V::of_floats(shape, f(a[0]).iter().map(|&x| cap * (x / cap).tanh()).collect())
        }
        Op::Truncate { .. } => {
            let (rows, n) = (a[0].shape()[0], shape[0]);
            if n > rows {
                return Err(InterpError::IllTyped {
                    op: op.name(),
                    message: format!("{n} rows asked of a matrix of {rows}: the sequence is longer than the table"),
                });
            }
            V::of_floats(shape.clone(), f(a[0])[..shape.iter().product()].to_vec())
        }
        &Op::RelativeBias { buckets, max_distance, bidirectional, .. } => {
            let table = f(a[0]);
            let (heads, q, k) = (shape[1], shape[2], shape[3]);
            let mut out = vec![V::F::ZERO; heads * q * k];
            for (at, b) in relative_buckets(q, k, bidirectional, buckets, max_distance).into_iter().enumerate() {
                for h in 0..heads {
                    out[h * q * k + at] = table[b * heads + h];
                }
            }
            V::of_floats(shape, out)
        }
        &Op::RelativeBiasGrad { buckets, max_distance, bidirectional } => {
            let dy = f(a[1]);
            let rank = a[1].shape().len();
            let (heads, q, k) = (a[1].shape()[rank - 3], a[1].shape()[rank - 2], a[1].shape()[rank - 1]);
            let of = relative_buckets(q, k, bidirectional, buckets, max_distance);
            let mut acc = vec![0.0f64; buckets * heads];
            for (m, plane) in dy.chunks((q * k).max(1)).enumerate() {
                let h = m % heads.max(1);
                for (&b, &v) in of.iter().zip(plane) {
                    acc[b * heads + h] += v.to_f64();
                }
            }
            V::of_floats(shape, acc.into_iter().map(V::F::from_f64).collect())
        }
        Op::TruncateGrad => {
            let mut out = f(a[1]).to_vec();
            out.resize(shape.iter().product(), V::F::ZERO);
            V::of_floats(shape, out)
        }
        Op::Act(act) => V::of_floats(shape, f(a[0]).iter().map(|&x| V::F::activation(*act, x)).collect()),
        Op::ActGrad(act) => V::of_floats(
            shape,
            f(a[0]).iter().zip(f(a[1])).map(|(&x, &dy)| dy * V::F::activation_derivative(*act, x)).collect(),
        ),
        Op::GatherGrad => {
            let (ids, dy) = (a[1].ints().expect("ids are i64"), f(a[2]));
            let (rows, d) = (a[0].shape()[0], a[0].shape()[1]);
            let mut out = match a.get(3) {
                Some(&base) => f(base).to_vec(),
                None => vec![V::F::ZERO; rows * d],
            };
            for (&id, row) in ids.iter().zip(dy.chunks(d.max(1))) {
                if id < 0 || id as usize >= rows {
                    return Err(InterpError::IndexOutOfRange {
                        what: "token id",
                        index: id,
                        table: "table".into(),
                        rows,
                    });
                }
                for (o, &v) in out[id as usize * d..(id as usize + 1) * d].iter_mut().zip(row) {
                    *o += v;
                }
            }
            V::of_floats(shape, out)
        }
        Op::NormGainGrad { rms, eps } => {
            let (x, dy) = (f(a[0]), f(a[1]));
            let d = (*shape.first().expect("a gain has one axis")).max(1);
            let mut acc = vec![0.0f64; d];
            for (row, dy) in x.chunks(d).zip(dy.chunks(d)) {
                let n = d as f64;
                let mean = if *rms { 0.0 } else { row.iter().map(|v| v.to_f64()).sum::<f64>() / n };
                let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
                let r = 1.0 / (var + f64::from(eps.0)).sqrt();
                for ((acc, v), dy) in acc.iter_mut().zip(row).zip(dy) {
                    *acc += dy.to_f64() * (v.to_f64() - mean) * r;
                }
            }
            V::of_floats(shape, acc.into_iter().map(V::F::from_f64).collect())
        }
        Op::SoftmaxGrad => {
            let (y, dy) = (f(a[0]), f(a[1]));
            let n = (*shape.last().expect("softmax_grad has an axis")).max(1);
            let mut out = vec![V::F::ZERO; y.len()];
            for ((y, dy), o) in y.chunks(n).zip(dy.chunks(n)).zip(out.chunks_mut(n)) {
                let dot: f64 = y.iter().zip(dy).map(|(y, dy)| y.to_f64() * dy.to_f64()).sum();
                for ((o, y), dy) in o.iter_mut().zip(y).zip(dy) {
                    *o = V::F::from_f64(y.to_f64() * (dy.to_f64() - dot));
                }
            }
            V::of_floats(shape, out)
        }
        Op::NormGrad { rms, eps } => {
            let (x, gain, dy) = (f(a[0]), f(a[1]), f(a[2]));
            let d = gain.len();
            let mut out = vec![V::F::ZERO; x.len()];
            for ((row, dy), o) in x.chunks(d.max(1)).zip(dy.chunks(d.max(1))).zip(out.chunks_mut(d.max(1))) {
                let n = d as f64;
                let mean = if *rms { 0.0 } else { row.iter().map(|v| v.to_f64()).sum::<f64>() / n };
                let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
                let r = 1.0 / (var + f64::from(eps.0)).sqrt();
                let gx = |j: usize| dy[j].to_f64() * gain[j].to_f64();
                let xhat = |j: usize| (row[j].to_f64() - mean) * r;
                let mean_gx = if *rms { 0.0 } else { (0..d).map(gx).sum::<f64>() / n };
                let mean_gxx = (0..d).map(|j| gx(j) * xhat(j)).sum::<f64>() / n;
                for (j, o) in o.iter_mut().enumerate() {
                    *o = V::F::from_f64(r * (gx(j) - mean_gx - xhat(j) * mean_gxx));
                }
            }
            if let Some(&residual) = a.get(3) {
                out.iter_mut().zip(f(residual)).for_each(|(o, &r)| *o += r);
            }
            V::of_floats(shape, out)
        }
        Op::Rsqrt => V::of_floats(shape, f(a[0]).iter().map(|&x| V::F::from_f64(1.0 / x.to_f64().sqrt())).collect()),
        Op::CrossEntropy { smoothing, ignore_index } => {
            let rows = cross_entropy_rows(f(a[0]), a[1], smoothing.0, *ignore_index)?;
            let mean = rows.iter().map(|r| r.loss).sum::<f64>() / rows.len() as f64;
            V::of_floats(shape, vec![V::F::from_f64(mean)])
        }
        Op::CrossEntropyGrad { smoothing, ignore_index } => {
            let x = f(a[0]);
            let rows = cross_entropy_rows(x, a[1], smoothing.0, *ignore_index)?;
            let vocab = *shape.last().expect("logits have a vocabulary axis");
            let dy = f(a[2])[0].to_f64() / rows.len() as f64;
            let (eps, keep) = (f64::from(smoothing.0), 1.0 - f64::from(smoothing.0));
            let mut out = vec![V::F::ZERO; x.len()];
            for r in &rows {
                let (row, o) = (&x[r.at * vocab..(r.at + 1) * vocab], &mut out[r.at * vocab..(r.at + 1) * vocab]);
                for (j, (o, &v)) in o.iter_mut().zip(row).enumerate() {
                    let target = if j == r.label { keep } else { 0.0 } + eps / vocab as f64;
                    *o = V::F::from_f64(dy * ((v.to_f64() - r.lse).exp() - target));
                }
            }
            V::of_floats(shape, out)
        }
        Op::SumAxis { axis } => {
            let x = a[0];
            let n = x.shape()[*axis];
            let inner: usize = x.shape()[*axis + 1..].iter().product();
            let outer: usize = x.shape()[..*axis].iter().product();
            let xs = f(x);
            let mut out = vec![V::F::ZERO; outer * inner];
            for o in 0..outer {
                for j in 0..inner {
                    let mut acc = 0.0f64;
                    for i in 0..n {
                        acc += xs[(o * n + i) * inner + j].to_f64();
                    }
                    out[o * inner + j] = V::F::from_f64(acc);
                }
            }
            V::of_floats(shape, out)
        }
        Op::LayerNorm { eps } => {
            let gain = f(a[1]);
            let bias = a.get(2).map(|&t| f(t));
            let mut out = f(a[0]).to_vec();
            for row in out.chunks_mut(gain.len()) {
                V::F::layer_norm_row(row, gain, bias, eps.0);
            }
            V::of_floats(shape, out)
        }
        Op::RmsNorm { eps } => {
            let gain = f(a[1]);
            let mut out = f(a[0]).to_vec();
            for row in out.chunks_mut(gain.len()) {
                V::F::rms_norm_row(row, gain, eps.0);
            }
            V::of_floats(shape, out)
        }
        Op::Softmax => {
            let x = f(a[0]);
            let d = *shape.last().expect("softmax has an axis");
            let mut out = vec![V::F::ZERO; x.len()];
            for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
                let max = row.iter().copied().fold(V::F::NEG_INFINITY, V::F::max);
                let mut sum = 0.0f64;
                for j in 0..d {
                    let e = (row[j] - max).exp();
                    o[j] = e;
                    sum += e.to_f64();
                }
                for v in o.iter_mut() {
                    *v = V::F::from_f64(v.to_f64() / sum);
                }
            }
            V::of_floats(shape, out)
        }
        Op::Reshape { .. } => V::of_floats(shape, f(a[0]).to_vec()),
        Op::After => a[0].clone(),
        Op::Permute { perm } => V::of_floats(shape, permute(a[0], perm)),
        Op::Rope { theta, rotary_dim, style } => {
            let x = f(a[0]);
            let (s, d) = (a[0].shape()[2], a[0].shape()[3]);
            let mut out = x.to_vec();
            let inv = frequencies::<V::F>(theta.0, *rotary_dim);
            for (r, row) in out.chunks_mut(d).enumerate() {
                V::F::rotate(row, V::F::from_usize(r % s + ctx.past), &inv, *style);
            }
            V::of_floats(shape, out)
        }
        Op::RepeatHeads { times } => {
            let x = f(a[0]);
            let (b, kv, s, d) = (a[0].shape()[0], a[0].shape()[1], a[0].shape()[2], a[0].shape()[3]);
            let block = s * d;
            let mut out = Vec::with_capacity(x.len() * times);
            for bi in 0..b {
                for h in 0..kv {
                    let start = (bi * kv + h) * block;
                    for _ in 0..*times {
                        out.extend_from_slice(&x[start..start + block]);
                    }
                }
            }
            V::of_floats(shape, out)
        }
        Op::Alibi => {
            let mut x = f(a[0]).to_vec();
            let (heads, q, k) = (shape[1], shape[2], shape[3]);
            let slopes: Vec<V::F> = alibi_slopes(heads).into_iter().map(V::F::from_f32).collect();
            for (row_index, row) in x.chunks_mut(k).enumerate() {
                let h = (row_index / q) % heads;
                let qi = row_index % q + (k - q.min(k));
                for (ki, v) in row.iter_mut().enumerate() {
                    *v += slopes[h] * (V::F::from_usize(ki) - V::F::from_usize(qi));
                }
            }
            V::of_floats(shape, x)
        }
        Op::Mask { causal, window } => {
            let keep = |qi: usize, ki: usize| (!causal || ki <= qi) && window.is_none_or(|w| ki + w > qi);
            mask_scores(f(a[0]), a.get(1).map(|&t| f(t)), shape, keep)
        }
        &Op::BlockSparseMask { block, global, window, random, seed } => {
            let (q, k) = (shape[2], shape[3]);
            let block = block.max(1);
            let blocks = q.max(k).div_ceil(block);
            let allowed = block_pattern(blocks, global, window, random, seed);
            let keep = |qi: usize, ki: usize| allowed[qi / block * blocks + ki / block];
            mask_scores(f(a[0]), a.get(1).map(|&t| f(t)), shape, keep)
        }
        Op::TopK { k, renormalize } => {
            let x = f(a[0]);
            let e = *shape.last().expect("top_k has an axis");
            let mut out = vec![V::F::ZERO; x.len()];
            for (row, o) in x.chunks(e).zip(out.chunks_mut(e)) {
                let kept = top_k(row, *k);
                let sum: V::F = kept.iter().map(|&i| row[i]).sum();
                for &i in &kept {
                    o[i] = if *renormalize { row[i] / sum } else { row[i] };
                }
            }
            V::of_floats(shape, out)
        }
        Op::TopKGrad { k, renormalize } => {
            let (x, dy) = (f(a[0]), f(a[1]));
            let e = *shape.last().expect("top_k has an axis");
            let mut out = vec![V::F::ZERO; x.len()];
            for ((row, d), o) in x.chunks(e).zip(dy.chunks(e)).zip(out.chunks_mut(e)) {
                let kept = top_k(row, *k);
                if *renormalize {
                    // dx = m (dy - sum(dy * y)) / S, y = m x / S.
                    let sum: f64 = kept.iter().map(|&i| row[i].to_f64()).sum();
                    let dot: f64 = kept.iter().map(|&i| d[i].to_f64() * row[i].to_f64() / sum).sum();
                    for &i in &kept {
                        o[i] = V::F::from_f64((d[i].to_f64() - dot) / sum);
                    }
                } else {
                    for &i in &kept {
                        o[i] = d[i];
                    }
                }
            }
            V::of_floats(shape, out)
        }
        Op::Last { axis } => {
            let Some(last) = a[0].shape()[*axis].checked_sub(1) else {
                return Err(InterpError::IllTyped { op: op.name(), message: format!("axis {axis} is empty") });
            };
            return eval(ctx, &Op::Slice { axis: *axis, start: last, len: 1 }, a, shape);
        }
        Op::Slice { axis, start, len } => {
            let x = f(a[0]);
            let in_shape = a[0].shape();
            let outer: usize = in_shape[..*axis].iter().product();
            let inner: usize = in_shape[axis + 1..].iter().product();
            let n = in_shape[*axis];
            let mut out = Vec::with_capacity(outer * len * inner);
            for o in 0..outer {
                let base = o * n * inner;
                out.extend_from_slice(&x[base + start * inner..base + (start + len) * inner]);
            }
            V::of_floats(shape, out)
        }
        Op::SquareSums => {
            let sums = a.iter().map(|x| {
                let x = x.floats().expect("square_sums reads floats");
                V::F::from_f64(x.iter().map(|&v| v.to_f64() * v.to_f64()).sum::<f64>() as f32 as f64)
            });
            V::of_floats(shape, sums.collect())
        }
        // The clipping and the update's arithmetic are f32's whatever the evaluation's float
        // type (they are `torch`'s, element for element).
        Op::ClipScale { max_norm } => {
            let f32s = |i: usize| -> Vec<f32> {
                a[i].floats().expect("clip_scale reads floats").iter().map(|v| v.to_f64() as f32).collect()
            };
            let (loss, sums) = (f32s(0), f32s(1));
            let scale = crate::semantics::step_scale(loss[0], &sums, max_norm.map(|m| m.0));
            V::of_floats(shape, vec![V::F::from_f32(scale)])
        }
        Op::AdamW { .. } | Op::Sgd { .. } => {
            let f32s = |i: usize| -> Vec<f32> {
                a[i].floats().expect("an update reads floats").iter().map(|v| v.to_f64() as f32).collect()
            };
            let state = a.len() - 4;
            let (p, g) = (f32s(0), f32s(1));
            let (scale, step) = (f32s(2 + state)[0], f32s(3 + state));
            let mut out: Vec<f32> = p.clone();
            (1..=state).for_each(|i| out.extend(f32s(1 + i)));
            // No step where the factor is NaN: the parameter and state as given.
            let n = p.len();
            let (new_p, rest) = out.split_at_mut(n);
            match crate::semantics::update_step(op, scale, &step).filter(|_| !scale.is_nan()) {
                Some(crate::semantics::UpdateStep::AdamW(c)) => {
                    let (m, v) = rest.split_at_mut(n);
                    let lerp = if c.w1.abs() < 0.5 { crate::semantics::lerp_near } else { crate::semantics::lerp_far };
                    for i in 0..n {
                        (new_p[i], m[i], v[i]) = crate::semantics::adamw(c, lerp, new_p[i], g[i], m[i], v[i]);
                    }
                }
                Some(crate::semantics::UpdateStep::Sgd(c)) => {
                    for i in 0..n {
                        let buf = rest.get(i).copied().unwrap_or(0.0);
                        let (q, b) = crate::semantics::sgd(c, new_p[i], g[i], buf);
                        new_p[i] = q;
                        if let Some(slot) = rest.get_mut(i) {
                            *slot = b;
                        }
                    }
                }
                None => {}
            }
            V::of_floats(shape, out.into_iter().map(V::F::from_f32).collect())
        }
        // Fused ops are evaluated as exactly the compositions that define them.
        Op::ContractRows => {
            let (sa, sb) = (a[0].shape().to_vec(), a[1].shape().to_vec());
            let r = sa.len();
            let mut perm: Vec<usize> = (0..r).collect();
            perm.swap(r - 2, r - 1);
            let mut st = sa.clone();
            st.swap(r - 2, r - 1);
            let t = eval(ctx, &Op::Permute { perm }, &[a[0]], st)?;
            let mut sp = sa[..r - 2].to_vec();
            sp.extend([sa[r - 1], sb[r - 1]]);
            let mut y = eval(ctx, &Op::MatMul { transpose_b: false }, &[&t, a[1]], sp.clone())?;
            while sp.len() > 2 {
                sp.remove(0);
                y = eval(ctx, &Op::SumAxis { axis: 0 }, &[&y], sp.clone())?;
            }
            y
        }
        Op::MatMulActGrad { act, transpose_b } => {
            let y = eval(ctx, &Op::MatMul { transpose_b: *transpose_b }, &[a[0], a[1]], shape.clone())?;
            eval(ctx, &Op::ActGrad(*act), &[a[2], &y], shape)?
        }
        Op::SumRows => {
            // The leading axes summed first to last (its shape rule gives it at least one).
            let mut sp = a[0].shape().get(1..).unwrap_or_default().to_vec();
            let mut y = eval(ctx, &Op::SumAxis { axis: 0 }, &[a[0]], sp.clone())?;
            while sp.len() > 1 {
                sp.remove(0);
                y = eval(ctx, &Op::SumAxis { axis: 0 }, &[&y], sp.clone())?;
            }
            y
        }
        Op::Linear { act, bias, residual, norm, glu, rope } => {
            // Operands: x, the norm's gain and bias, w, the bias, the residual.
            let mut next = 1;
            let normed;
            let x = match norm {
                Some(p) => {
                    let take = 1 + usize::from(p.bias);
                    let mut args = vec![a[0]];
                    args.extend(&a[1..1 + take]);
                    next += take;
                    let op = if p.rms { Op::RmsNorm { eps: p.eps } } else { Op::LayerNorm { eps: p.eps } };
                    normed = eval(ctx, &op, &args, a[0].shape().to_vec())?;
                    &normed
                }
                None => a[0],
            };
            let w = a[next];
            next += 1;
            let mut shape_mm = x.shape().to_vec();
            let last = shape_mm.len() - 1;
            shape_mm[last] = w.shape()[0];
            let mut y = eval(ctx, &Op::MatMul { transpose_b: true }, &[x, w], shape_mm.clone())?;
            if *bias {
                y = eval(ctx, &Op::Add, &[&y, a[next]], shape_mm.clone())?;
                next += 1;
            }
            if *glu {
                let n = w.shape()[0] / 2;
                let mut half = shape_mm.clone();
                half[last] = n;
                let gate = eval(ctx, &Op::Slice { axis: last, start: 0, len: n }, &[&y], half.clone())?;
                let up = eval(ctx, &Op::Slice { axis: last, start: n, len: n }, &[&y], half.clone())?;
                let gate = match act {
                    Some(act) => eval(ctx, &Op::Act(*act), &[&gate], half.clone())?,
                    None => gate,
                };
                y = eval(ctx, &Op::Mul, &[&gate, &up], half.clone())?;
                shape_mm = half;
            } else if let Some(act) = act {
                y = eval(ctx, &Op::Act(*act), &[&y], shape_mm.clone())?;
            }
            if let Some(r) = rope {
                let s = shape_mm[shape_mm.len() - 2];
                let n = shape_mm[last];
                let inv = frequencies::<V::F>(r.theta.0, r.rotary_dim);
                if let Some(data) = y.floats_mut() {
                    for (row_index, row) in data.chunks_mut(n).enumerate() {
                        for head in row[r.start..r.start + r.len].chunks_mut(r.head_dim) {
                            let pos = V::F::from_usize(row_index % s + ctx.past);
                            V::F::rotate(&mut head[..r.rotary_dim], pos, &inv, r.style);
                        }
                    }
                }
            }
            if *residual {
                y = eval(ctx, &Op::Add, &[&y, a[next]], shape_mm)?;
            }
            y
        }
        Op::PackedAttention(p) => {
            // Split the heads out of the packed rows, then attend as `attention` does (to the
            // cache's keys and values when `cached`).
            let x = a[0];
            let (b, s, width) = (x.shape()[0], x.shape()[1], x.shape()[2]);
            let split = |start: usize, count: usize| -> R<V> {
                let t = head_columns(ctx, x, start, count, p.head_dim)?;
                eval(ctx, &Op::Permute { perm: vec![0, 2, 1, 3] }, &[&t], vec![b, count, s, p.head_dim])
            };
            debug_assert!(width >= p.q + p.heads * p.head_dim);
            let qh = split(p.q, p.heads)?;
            let (kh, vh, rest) = if p.appends {
                // The caches before this step, with this step's keys and values appended.
                let append = |past: &V, start: usize| -> R<V> {
                    let new = split(start, p.kv_heads)?;
                    let mut shape = past.shape().to_vec();
                    shape[2] += s;
                    eval(ctx, &Op::Concat { axis: 2 }, &[past, &new], shape)
                };
                (std::borrow::Cow::Owned(append(a[1], p.k)?), std::borrow::Cow::Owned(append(a[2], p.v)?), &a[3..])
            } else if p.cached {
                (std::borrow::Cow::Borrowed(a[1]), std::borrow::Cow::Borrowed(a[2]), &a[3..])
            } else {
                (
                    std::borrow::Cow::Owned(split(p.k, p.kv_heads)?),
                    std::borrow::Cow::Owned(split(p.v, p.kv_heads)?),
                    &a[1..],
                )
            };
            let mut args = vec![&qh, &*kh, &*vh];
            args.extend(rest);
            eval(ctx, &p.unpacked(), &args, shape)?
        }
        Op::LowRank { start, heads, head_dim } => {
            // Slice, split, transpose the heads to [b, h, d, n], then times `e`'s first n rows.
            let (x, e) = (a[0], a[1]);
            let (b, n, r) = (x.shape()[0], x.shape()[1], e.shape()[1]);
            let split = head_columns(ctx, x, *start, *heads, *head_dim)?;
            let t = eval(ctx, &Op::Permute { perm: vec![0, 2, 3, 1] }, &[&split], vec![b, *heads, *head_dim, n])?;
            let cut = eval(ctx, &Op::Truncate { len: Dim::Fixed(n) }, &[e], vec![n, r])?;
            let y = eval(ctx, &Op::MatMul { transpose_b: false }, &[&t, &cut], vec![b, *heads, *head_dim, r])?;
            eval(ctx, &Op::Permute { perm: vec![0, 1, 3, 2] }, &[&y], shape)?
        }
        Op::Heads { start, heads, head_dim, norm, rope } => {
            // Slice, split, transpose, normalize, rotate, append: the chain this op stands for.
            let gain = norm.map(|_| a[a.len() - 1]);
            let a = &a[..a.len() - usize::from(gain.is_some())];
            let x = a[a.len() - 1];
            let (b, s) = (x.shape()[0], x.shape()[1]);
            let split = head_columns(ctx, x, *start, *heads, *head_dim)?;
            let new_shape = vec![b, *heads, s, *head_dim];
            let mut new = eval(ctx, &Op::Permute { perm: vec![0, 2, 1, 3] }, &[&split], new_shape.clone())?;
            if let (Some(eps), Some(gain)) = (norm, gain) {
                new = eval(ctx, &Op::RmsNorm { eps: *eps }, &[&new, gain], new_shape.clone())?;
            }
            if let Some(r) = rope {
                let op = Op::Rope { theta: r.theta, rotary_dim: r.rotary_dim, style: r.style };
                new = eval(ctx, &op, &[&new], new_shape)?;
            }
            match a.len() {
                2 => eval(ctx, &Op::Concat { axis: 2 }, &[a[0], &new], shape)?,
                _ => new,
            }
        }
        Op::Concat { axis } => {
            let (x, y) = (f(a[0]), f(a[1]));
            let outer: usize = a[0].shape()[..*axis].iter().product();
            let (ix, iy) = (x.len() / outer.max(1), y.len() / outer.max(1));
            let mut out = Vec::with_capacity(x.len() + y.len());
            for o in 0..outer {
                out.extend_from_slice(&x[o * ix..(o + 1) * ix]);
                out.extend_from_slice(&y[o * iy..(o + 1) * iy]);
            }
            V::of_floats(shape, out)
        }
        Op::MaskedSoftmax { scale, alibi, causal, window, mods } => {
            let (key_mask, table) = score_operands(&a[1..], mods);
            let (key_mask, table) = (key_mask.copied(), table.copied());
            let mut y = eval(ctx, &Op::Scale { factor: *scale }, &[a[0]], shape.clone())?;
            if let Some(cap) = mods.softcap {
                y = eval(ctx, &Op::SoftCap { cap }, &[&y], shape.clone())?;
            }
            if *alibi {
                y = eval(ctx, &Op::Alibi, &[&y], shape.clone())?;
            }
            if let (Some(r), Some(table)) = (mods.relative, table) {
                let op = r.bias(Dim::Fixed(shape[2]), Dim::Fixed(shape[3]));
                let bias = eval(ctx, &op, &[table], vec![1, shape[1], shape[2], shape[3]])?;
                y = eval(ctx, &Op::Add, &[&y, &bias], shape.clone())?;
            }
            let mut args = vec![&y];
            args.extend(key_mask);
            if let Some(p) = mods.sparse {
                y = eval(ctx, &p.mask(), &args, shape.clone())?;
            } else if *causal || key_mask.is_some() || window.is_some() {
                y = eval(ctx, &Op::Mask { causal: *causal, window: *window }, &args, shape.clone())?;
            }
            eval(ctx, &Op::Softmax, &[&y], shape)?
        }
        Op::Attention { scale, alibi, causal, window, mods } => {
            let (q, k, v) = (a[0], a[1], a[2]);
            let (b, h, s, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
            let (kv, t) = (k.shape()[1], k.shape()[2]);
            let (k, v) = if kv < h {
                let times = h / kv;
                let rep = vec![b, h, t, d];
                (
                    eval(ctx, &Op::RepeatHeads { times }, &[k], rep.clone())?,
                    eval(ctx, &Op::RepeatHeads { times }, &[v], rep)?,
                )
            } else {
                (k.clone(), v.clone())
            };
            let scores = eval(ctx, &Op::MatMul { transpose_b: true }, &[q, &k], vec![b, h, s, t])?;
            let mut args = vec![&scores];
            args.extend(&a[3..]);
            let soft =
                Op::MaskedSoftmax { scale: *scale, alibi: *alibi, causal: *causal, window: *window, mods: *mods };
            let p = eval(ctx, &soft, &args, vec![b, h, s, t])?;
            let heads = eval(ctx, &Op::MatMul { transpose_b: false }, &[&p, &v], vec![b, h, s, d])?;
            let merged = eval(ctx, &Op::Permute { perm: vec![0, 2, 1, 3] }, &[&heads], vec![b, s, h, d])?;
            merged.reshaped(shape)
        }
        Op::AttentionGrad { scale, alibi, causal, window, mods } => {
            // The composition autodiff builds for the unfused attention, whatever its form there.
            let (q, k, v, dout) = (a[0], a[1], a[2], a[3]);
            let (b, h, s, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
            let kv = k.shape()[1];
            let (k, v) = if kv < h {
                let rep = vec![b, h, s, d];
                let times = h / kv;
                (
                    eval(ctx, &Op::RepeatHeads { times }, &[k], rep.clone())?,
                    eval(ctx, &Op::RepeatHeads { times }, &[v], rep)?,
                )
            } else {
                (k.clone(), v.clone())
            };
            let sq = vec![b, h, s, s];
            let (key_mask, _) = score_operands(&a[4..], mods);
            let scores = eval(ctx, &Op::MatMul { transpose_b: true }, &[q, &k], sq.clone())?;
            let mut args = vec![&scores];
            args.extend(&a[4..]);
            let soft =
                Op::MaskedSoftmax { scale: *scale, alibi: *alibi, causal: *causal, window: *window, mods: *mods };
            let p = eval(ctx, &soft, &args, sq.clone())?;
            let dp = eval(ctx, &Op::MatMul { transpose_b: true }, &[dout, &v], sq.clone())?;
            let mut ds = eval(ctx, &Op::SoftmaxGrad, &[&p, &dp], sq.clone())?;
            // Zero at the keys the mask hides: relu's derivative of the mask over ones.
            let mut mask_args = vec![];
            let ones = V::of_floats(sq.clone(), vec![V::F::from_f64(1.0); b * h * s * s]);
            mask_args.push(&ones);
            mask_args.extend(key_mask.copied());
            let kept = match mods.sparse {
                Some(pattern) => Some(eval(ctx, &pattern.mask(), &mask_args, sq.clone())?),
                None if *causal || window.is_some() || key_mask.is_some() => {
                    Some(eval(ctx, &Op::Mask { causal: *causal, window: *window }, &mask_args, sq.clone())?)
                }
                None => None,
            };
            if let Some(kept) = kept {
                ds = eval(ctx, &Op::ActGrad(Activation::Relu), &[&kept, &ds], sq.clone())?;
            }
            if let Some(cap) = mods.softcap {
                let scaled = eval(ctx, &Op::Scale { factor: *scale }, &[&scores], sq.clone())?;
                let y = eval(ctx, &Op::SoftCap { cap }, &[&scaled], sq.clone())?;
                let y2 = eval(ctx, &Op::Mul, &[&y, &y], sq.clone())?;
                let minus = eval(ctx, &Op::Scale { factor: Scalar(-1.0 / (cap.0 * cap.0)) }, &[&y2], sq.clone())?;
                let slope = eval(ctx, &Op::Offset { value: Scalar(1.0) }, &[&minus], sq.clone())?;
                ds = eval(ctx, &Op::Mul, &[&ds, &slope], sq.clone())?;
            }
            let ds = eval(ctx, &Op::Scale { factor: *scale }, &[&ds], sq.clone())?;
            let rows = vec![b, h, s, d];
            let transpose = Op::Permute { perm: vec![0, 1, 3, 2] };
            let dq = eval(ctx, &Op::MatMul { transpose_b: false }, &[&ds, &k], rows.clone())?;
            let dst = eval(ctx, &transpose, &[&ds], sq.clone())?;
            let dk = eval(ctx, &Op::MatMul { transpose_b: false }, &[&dst, q], rows.clone())?;
            let pt = eval(ctx, &transpose, &[&p], sq)?;
            let dv = eval(ctx, &Op::MatMul { transpose_b: false }, &[&pt, dout], rows)?;
            let mut out = Vec::with_capacity(3 * b * h * s * d);
            for part in [&dq, &dk, &dv] {
                out.extend_from_slice(f(part));
            }
            V::of_floats(shape, out)
        }
        Op::AddNorm { rms, eps, after } => {
            let norm = if *rms { Op::RmsNorm { eps: *eps } } else { Op::LayerNorm { eps: *eps } };
            if *after {
                let mut args = vec![a[1]];
                args.extend(&a[2..]);
                let normed = eval(ctx, &norm, &args, shape.clone())?;
                eval(ctx, &Op::Add, &[a[0], &normed], shape)?
            } else {
                let sum = eval(ctx, &Op::Add, &[a[0], a[1]], shape.clone())?;
                let mut args = vec![&sum];
                args.extend(&a[2..]);
                eval(ctx, &norm, &args, shape)?
            }
        }
        Op::L2Normalize => {
            let x = f(a[0]);
            let d = *shape.last().expect("l2_normalize has an axis");
            let mut out = vec![V::F::ZERO; x.len()];
            for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
                let norm = row.iter().map(|&v| v.to_f64().powi(2)).sum::<f64>().sqrt().max(1e-12);
                for (y, &v) in o.iter_mut().zip(row) {
                    *y = V::F::from_f64(v.to_f64() / norm);
                }
            }
            V::of_floats(shape, out)
        }
        Op::MeanPool => {
            let (x, m) = (f(a[0]), f(a[1]));
            let (b, s, d) = (a[0].shape()[0], a[0].shape()[1], a[0].shape()[2]);
            let mut out = vec![V::F::ZERO; b * d];
            for bi in 0..b {
                let mut count = 0.0f64;
                let mut acc = vec![0.0f64; d];
                for si in 0..s {
                    let w = m[bi * s + si].to_f64();
                    count += w;
                    for j in 0..d {
                        acc[j] += w * x[(bi * s + si) * d + j].to_f64();
                    }
                }
                for j in 0..d {
                    out[bi * d + j] = V::F::from_f64(acc[j] / count.max(1e-9));
                }
            }
            V::of_floats(shape, out)
        }
    })
}

/// Deterministic pseudo-random parameters for every parameter of `g` (uniform in
/// `[-scale, scale]`, norm gains around 1), for differential tests and benchmarks without a
/// checkpoint. Refused, before anything is allocated, when they would not fit in memory.
pub fn random_params(g: &Graph, seed: u64) -> Result<HashMap<String, Tensor>, MemoryError> {
    let shapes: Vec<(&str, Vec<usize>)> = g
        .params()
        .into_iter()
        .map(|(n, name)| (name, g.g[n].shape.iter().map(|d| if let Dim::Fixed(k) = d { *k } else { 0 }).collect()))
        .collect();
    let elements: u128 = shapes.iter().map(|(_, s)| s.iter().map(|&d| d as u128).product::<u128>()).sum();
    crate::memory::check(|| format!("random parameters for `{}`", g.name), f32_bytes(elements))?;
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    Ok(shapes
        .into_iter()
        .map(|(name, shape)| {
            let len = shape.iter().product();
            let is_gain = name.ends_with("norm.weight");
            let data =
                (0..len).map(|_| if is_gain { 1.0 + 0.1 * next() as f32 } else { 0.3 * next() as f32 }).collect();
            (name.to_string(), Tensor::f32(shape, data))
        })
        .collect())
}

/// Deterministic inputs for every input of `g`, for differential tests without a dataset: ids
/// spread over `0..vocab`, alternating token types, and key masks with the last key of each row
/// padded (in each mask's own convention).
///
/// Refused, before anything is allocated, when they would not fit in memory.
pub fn sample_inputs(
    g: &Graph,
    vocab: usize,
    batch: usize,
    seq: usize,
) -> Result<HashMap<String, Tensor>, MemoryError> {
    let inputs = g.inputs().len() as u128;
    let what = || format!("sample inputs of batch {batch} x seq {seq}");
    crate::memory::check(what, u64::try_from(8 * inputs * batch as u128 * seq as u128).unwrap_or(u64::MAX))?;
    let n = batch * seq;
    let last = |i: usize| i % seq == seq - 1;
    Ok(g.inputs()
        .into_iter()
        .filter_map(|(_, name, role)| {
            let data: Vec<i64> = match role {
                InputRole::Ids => (0..n).map(|i| (i as i64 * 7919 + 13) % vocab.max(1) as i64).collect(),
                InputRole::TokenTypes => (0..n).map(|i| (i % 2) as i64).collect(),
                // The next id, none taken at each row's last position.
                InputRole::Labels => (0..n)
                    .map(|i| if last(i) { -100 } else { ((i as i64 + 1) * 7919 + 13) % vocab.max(1) as i64 })
                    .collect(),
                InputRole::KeyMask { pad_is_one } => (0..n).map(|i| i64::from(last(i) == pad_is_one)).collect(),
                // Nothing cached: the cache inputs default to empty.
                InputRole::Cache { .. } => return None,
            };
            Some((name.to_string(), Tensor::i64(vec![batch, seq], data)))
        })
        .collect())
}

/// One position counted by [`Op::CrossEntropy`]: where its scores start (in rows), its label,
/// the log-sum-exp of its scores and its loss.
struct CrossEntropyRow {
    at: usize,
    label: usize,
    lse: f64,
    loss: f64,
}

/// The positions of `x` (rows of `labels.len()` scores each) whose label is not `ignore`, with
/// their losses in f64; refuses a label outside the vocabulary and a batch with no counted
/// position (whose mean loss would be 0 / 0).
fn cross_entropy_rows<V: Value>(x: &[V::F], labels: &V, smoothing: f32, ignore: i64) -> R<Vec<CrossEntropyRow>> {
    let labels = labels
        .ints()
        .ok_or_else(|| InterpError::BadInput { name: "labels".into(), message: "expected integer token ids".into() })?;
    let vocab = x.len() / labels.len().max(1);
    let eps = f64::from(smoothing);
    let mut rows = Vec::new();
    for (at, &label) in labels.iter().enumerate() {
        if label == ignore {
            continue;
        }
        let Some(label) = usize::try_from(label).ok().filter(|&l| l < vocab) else {
            return Err(InterpError::IndexOutOfRange {
                what: "label",
                index: label,
                table: "the vocabulary".into(),
                rows: vocab,
            });
        };
        let row = &x[at * vocab..(at + 1) * vocab];
        let max = row.iter().copied().fold(V::F::NEG_INFINITY, V::F::max).to_f64();
        let sum: f64 = row.iter().map(|&v| (v.to_f64() - max).exp()).sum();
        let lse = max + sum.ln();
        let mean = row.iter().map(|&v| v.to_f64()).sum::<f64>() / vocab as f64;
        let loss = lse - (1.0 - eps) * row[label].to_f64() - eps * mean;
        rows.push(CrossEntropyRow { at, label, lse, loss });
    }
    if rows.is_empty() {
        return Err(InterpError::BadInput {
            name: "labels".into(),
            message: format!("every label is the ignore index {ignore}: no position takes a loss"),
        });
    }
    Ok(rows)
}

fn matmul<V: Value>(a: &V, b: &V, transpose_b: bool) -> Vec<V::F> {
    let (x, w) = (f(a), f(b));
    let (ar, br) = (a.shape().len(), b.shape().len());
    let (m, k) = (a.shape()[ar - 2], a.shape()[ar - 1]);
    let n = if transpose_b { b.shape()[br - 2] } else { b.shape()[br - 1] };
    let batch: usize = a.shape()[..ar - 2].iter().product();
    let b_batched = br > 2;
    let mut out = vec![V::F::ZERO; batch * m * n];
    for bi in 0..batch {
        let xa = &x[bi * m * k..(bi + 1) * m * k];
        let wb = if b_batched { &w[bi * k * n..(bi + 1) * k * n] } else { w };
        let o = &mut out[bi * m * n..(bi + 1) * m * n];
        for i in 0..m {
            let row = &xa[i * k..(i + 1) * k];
            let orow = &mut o[i * n..(i + 1) * n];
            if transpose_b {
                for (j, oj) in orow.iter_mut().enumerate() {
                    let col = &wb[j * k..(j + 1) * k];
                    *oj = row.iter().zip(col).map(|(&p, &q)| p * q).sum();
                }
            } else {
                for (kk, &av) in row.iter().enumerate() {
                    let wrow = &wb[kk * n..(kk + 1) * n];
                    for (oj, &wv) in orow.iter_mut().zip(wrow) {
                        *oj += av * wv;
                    }
                }
            }
        }
    }
    out
}

/// Elementwise op with numpy broadcasting into `shape`.
fn broadcast_binary<V: Value>(a: &V, b: &V, shape: &[usize], op: impl Fn(V::F, V::F) -> V::F) -> Vec<V::F> {
    let (x, y) = (f(a), f(b));
    if a.shape() == b.shape() {
        return x.iter().zip(y).map(|(&p, &q)| op(p, q)).collect();
    }
    let strides = |s: &[usize]| -> Vec<usize> {
        // Strides of `s` aligned to `shape`, 0 on broadcast axes.
        let mut st = vec![0; shape.len()];
        let mut acc = 1;
        for i in (0..s.len()).rev() {
            let axis = shape.len() - s.len() + i;
            st[axis] = if s[i] == 1 { 0 } else { acc };
            acc *= s[i];
        }
        st
    };
    let (sa, sb) = (strides(a.shape()), strides(b.shape()));
    let total: usize = shape.iter().product();
    let mut out = Vec::with_capacity(total);
    let mut idx = vec![0usize; shape.len()];
    let (mut ia, mut ib) = (0usize, 0usize);
    for _ in 0..total {
        out.push(op(x[ia], y[ib]));
        for axis in (0..shape.len()).rev() {
            idx[axis] += 1;
            ia += sa[axis];
            ib += sb[axis];
            if idx[axis] < shape[axis] {
                break;
            }
            ia -= sa[axis] * shape[axis];
            ib -= sb[axis] * shape[axis];
            idx[axis] = 0;
        }
    }
    out
}

fn permute<V: Value>(t: &V, perm: &[usize]) -> Vec<V::F> {
    let x = f(t);
    let rank = t.shape().len();
    let mut in_strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        in_strides[i] = in_strides[i + 1] * t.shape()[i + 1];
    }
    let out_shape: Vec<usize> = perm.iter().map(|&p| t.shape()[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let total = x.len();
    let mut out = Vec::with_capacity(total);
    let mut idx = vec![0usize; rank];
    let mut src = 0usize;
    for _ in 0..total {
        out.push(x[src]);
        for axis in (0..rank).rev() {
            idx[axis] += 1;
            src += strides[axis];
            if idx[axis] < out_shape[axis] {
                break;
            }
            src -= strides[axis] * out_shape[axis];
            idx[axis] = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ill_typed_folds_are_errors() {
        // What a damaged plan could ask of a load-time fold: each must be refused, not panic.
        let table = Tensor::f32(vec![4, 2], vec![0.0; 8]);
        let float_ids = Tensor::f32(vec![1, 3], vec![0.0; 3]);
        let err = eval_op(&Op::Gather, &[&table, &float_ids], vec![1, 3, 2]).unwrap_err();
        assert!(matches!(err, InterpError::IllTyped { .. }), "{err}");
        let x = Tensor::f32(vec![2, 3], vec![0.0; 6]);
        assert!(eval_op(&Op::Softmax, &[&x], vec![3, 2]).is_err(), "a result shape the op does not give");
        assert!(eval_op(&Op::Softmax, &[], vec![2, 3]).is_err(), "too few operands");
        assert!(eval_op(&Op::Param { name: "w".into() }, &[], vec![2]).is_err(), "a parameter is not evaluated");
        // A well-typed fold still evaluates.
        assert_eq!(eval_op(&Op::Softmax, &[&x], vec![2, 3]).unwrap().shape, vec![2, 3]);
    }

    #[test]
    fn f64_mode_agrees_with_f32_to_f32_precision() {
        let source = "[model]\nname = \"t\"\nkind = \"decoder\"\nvocab = 11\nd_model = 8\nlayers = 1\n\
                      max_positions = 8\n[positions]\nkind = \"rope\"\n[norm]\nkind = \"rmsnorm\"\n\
                      [attention]\nheads = 2\nkv_heads = 1\n[ffn]\nactivation = \"silu\"\ngated = true\n";
        let g = crate::front_end("t.toml", source).unwrap().graph;
        let params = random_params(&g, 3).unwrap();
        let inputs = sample_inputs(&g, 11, 2, 5).unwrap();
        let wide: HashMap<String, Tensor64> = params.iter().map(|(n, t)| (n.clone(), Tensor64::from(t))).collect();
        let (narrow, wide) = (run(&g, &params, &inputs).unwrap(), run_f64(&g, &wide, &inputs).unwrap());
        assert_eq!(narrow.len(), wide.len());
        for ((name, a), (other, b)) in narrow.iter().zip(&wide) {
            assert_eq!((name, &a.shape), (other, &b.shape));
            let scale = b.data.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let err = a.to_f32_vec().iter().zip(&b.data).map(|(&x, &y)| (f64::from(x) - y).abs()).fold(0.0, f64::max);
            assert!(err <= 1e-5 * scale, "{name}: f32 and f64 differ by {err} (scale {scale})");
            assert!(err > 0.0, "{name}: the f64 mode computed in f32");
        }
    }

    #[test]
    fn broadcasting_adds_a_bias_row() {
        let a = Tensor::f32(vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let b = Tensor::f32(vec![3], vec![10.0, 20.0, 30.0]);
        assert_eq!(broadcast_binary(&a, &b, &[2, 3], |x, y| x + y), vec![10.0, 21.0, 32.0, 13.0, 24.0, 35.0]);
        let c = Tensor::f32(vec![2, 1], vec![1.0, 2.0]);
        assert_eq!(broadcast_binary(&a, &c, &[2, 3], |x, y| x * y), vec![0.0, 1.0, 2.0, 6.0, 8.0, 10.0]);
    }

    #[test]
    fn permute_swaps_axes() {
        let a = Tensor::f32(vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(permute(&a, &[1, 0]), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    }

    #[test]
    fn matmul_transposed_equals_plain() {
        let a = Tensor::f32(vec![1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let b = Tensor::f32(vec![2, 2], vec![5.0, 6.0, 7.0, 8.0]);
        let bt = Tensor::f32(vec![2, 2], vec![5.0, 7.0, 6.0, 8.0]);
        assert_eq!(matmul(&a, &b, false), vec![19.0, 22.0, 43.0, 50.0]);
        assert_eq!(matmul(&a, &bt, true), vec![19.0, 22.0, 43.0, 50.0]);
    }
}
