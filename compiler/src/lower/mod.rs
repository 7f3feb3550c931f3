//! Lowering: Graph -> [`Plan`], the device-independent program the runtime executes.
//!
//! A plan is a list of [`Step`]s in topological order, each one dispatch of a generated WGSL
//! [`Kernel`] over [`Value`]s. Values are parameters (uploaded once), inputs (uploaded per run),
//! aliases (reshapes share their operand's buffer) or intermediates placed in *slots*: buffers that
//! values with disjoint lifetimes share. Slots are assigned at compile time by liveness; their
//! byte sizes are fixed at run time, when batch and sequence lengths are known, as the largest value
//! each holds. Every kernel module is parsed and validated by naga (all validation flags) here; a
//! module that fails is a compiler bug, reported with the op and model named.

#![expect(
    clippy::indexing_slicing,
    reason = "lowering runs on graphs that `Graph::check` accepted (`graph::infer` fixes each op's \
              arity and operand ranks); a plan read from a file is indexed only after `Plan::check` \
              bounded its value, slot and kernel indices, and its steps' shapes are read by \
              `dims_of` with checked access"
)]

pub mod attention;
pub mod format;
pub mod projection;
pub mod wgsl;

pub use format::WeightFormat;

use crate::graph::{Graph, InputRole, Op, Shape, Sym};
use crate::tensor::DType;
use petgraph::graph::NodeIndex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use wgsl::Elem;

/// A unique WGSL module.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// A readable name (`matmul_t`, `layer_norm`, ...).
    pub name: String,
    /// The module text.
    pub wgsl: String,
    /// Number of operand bindings (after the uniform and the output).
    pub operands: usize,
}

/// Where a value lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Storage {
    /// A weight, by canonical parameter name.
    Param(String),
    /// A model input, by name.
    Input {
        /// Input name.
        name: String,
        /// How it is bound.
        role: InputRole,
    },
    /// An intermediate in a shared slot.
    Slot(usize),
    /// The same buffer as another value (a reshape).
    Alias(usize),
    /// Computed from parameters alone (a concatenation of weights, a scaled table), once when the
    /// weights are loaded: see [`Plan::folds`].
    Const,
}

/// A tensor of the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Value {
    /// Shape (possibly symbolic).
    pub shape: Shape,
    /// Element type on the device (`I64` graph values are `i32` on the device).
    pub dtype: DType,
    /// Where it lives.
    pub storage: Storage,
    /// How it is stored on the device: `F32` for every value but the weight operand of a
    /// projection, which may be f16 or quantized (see [`mod@format`]).
    #[serde(default, skip_serializing_if = "WeightFormat::is_f32")]
    pub format: WeightFormat,
}

/// One kernel dispatch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// Index into [`Plan::kernels`].
    pub kernel: usize,
    /// The op (its sizes are computed at run time by [`dispatch`]).
    pub op: Op,
    /// Operand values.
    pub operands: Vec<usize>,
    /// Result value.
    pub output: usize,
    /// The scope of the graph node, for errors and profiles.
    pub scope: String,
}

/// A computation on parameters alone, evaluated once at load time by the reference interpreter
/// (constant folding): the runtime never dispatches it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fold {
    /// The op.
    pub op: Op,
    /// Operand values (parameters, or earlier folds).
    pub operands: Vec<usize>,
    /// Result value (storage [`Storage::Const`]).
    pub output: usize,
}

/// A lowered model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Model name.
    pub name: String,
    /// Unique kernels.
    pub kernels: Vec<Kernel>,
    /// Every tensor.
    pub values: Vec<Value>,
    /// Load-time computations on parameters, in order.
    pub folds: Vec<Fold>,
    /// Dispatches in order.
    pub steps: Vec<Step>,
    /// Number of shared intermediate buffers.
    pub slots: usize,
    /// Named results.
    pub outputs: Vec<(String, usize)>,
}

/// A compiler bug found while lowering (an invalid generated module).
#[derive(Clone, Debug, thiserror::Error)]
#[error("internal compiler error in model `{model}`, op `{op}` (`{scope}`): generated WGSL is invalid: {message}")]
pub struct LowerError {
    /// The model.
    pub model: String,
    /// The op.
    pub op: String,
    /// Its scope.
    pub scope: String,
    /// naga's message.
    pub message: String,
}

fn device_elem(v: &Value) -> Elem {
    match (v.dtype, v.format) {
        (DType::I64, _) => Elem::I32,
        (DType::F32, f) => Elem::from(f),
    }
}

/// Parses and validates a WGSL module with every validation flag.
pub fn validate_wgsl(text: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(text).map_err(|e| e.emit_to_string(text))?;
    // f16 is the one capability a kernel may use (only where a weight is stored as f16).
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::SHADER_FLOAT16)
        .validate(&module)
        .map_err(|e| e.emit_to_string(text))?;
    Ok(())
}

/// Lowering choices (the defaults are what `kiln` runs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Run a projection matmul (`matmul_t` by a 2-D constant weight, as an unoptimized graph holds
    /// them) as an [`Op::Linear`] step, with the fast kernel. Off, it keeps the reference
    /// one-thread-per-output kernel (for benchmarks).
    pub fast_projections: bool,
    /// Evaluate ops on parameters alone once at load time ([`Plan::folds`]). Off, they run as
    /// dispatches like any other op (so tests can run kernels on graphs of parameters).
    pub fold_constants: bool,
    /// Block-quantized parameters (`Q8_0`, `Q4_1`), by canonical name: a projection whose weight is
    /// one of them (or a load-time stack of such rows, or a scaled one) reads the blocks in place
    /// of f32 (see [`mod@format`]). The runtime must then be given the blocks of each. Parameters
    /// whose rows are not a multiple of 32 stay f32.
    pub formats: BTreeMap<String, WeightFormat>,
    /// Store every other constant projection weight as f16 (needs `SHADER_F16` on the device).
    pub f16_weights: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options { fast_projections: true, fold_constants: true, formats: BTreeMap::new(), f16_weights: false }
    }
}

/// Lowers a checked graph into a plan, with the default [`Options`].
pub fn lower(g: &Graph) -> Result<Plan, LowerError> {
    lower_with(g, Options::default())
}

/// The state of one lowering: what has been emitted so far.
struct Lowering<'g> {
    g: &'g Graph,
    values: Vec<Value>,
    kernels: Vec<Kernel>,
    kernel_of: HashMap<String, usize>,
    steps: Vec<Step>,
    folds: Vec<Fold>,
    /// (Weight value, padded) -> its transpose (shared by every projection reading the weight).
    transposed: HashMap<(usize, bool), usize>,
    /// Weight value -> its quantized view, if it has one (see [`Lowering::quantized`]).
    quantized: HashMap<usize, Option<usize>>,
    /// Quantized parameters by name.
    formats: &'g BTreeMap<String, WeightFormat>,
}

impl Lowering<'_> {
    /// Whether value `v` is computed from parameters alone with a fixed shape.
    fn constant(&self, v: usize) -> bool {
        matches!(self.values[root(&self.values, v)].storage, Storage::Param(_) | Storage::Const)
            && self.values[v].shape.iter().all(|d| matches!(d, crate::graph::Dim::Fixed(_)))
    }

    /// Emits a dispatch of `op` (its kernel validated and deduplicated by text).
    fn step(&mut self, op: Op, operands: Vec<usize>, output: usize, scope: &str) -> Result<(), LowerError> {
        let elems: Vec<Elem> = operands.iter().map(|&v| device_elem(&self.values[v])).collect();
        let geometry = self.geometry(&op, &operands);
        let Some(text) = wgsl::kernel(&op, &elems, device_elem(&self.values[output]), geometry) else {
            return Ok(());
        };
        let kernel = match self.kernel_of.get(&text) {
            Some(&k) => k,
            None => {
                validate_wgsl(&text).map_err(|message| LowerError {
                    model: self.g.name.clone(),
                    op: op.name(),
                    scope: scope.to_string(),
                    message,
                })?;
                self.kernels.push(Kernel { name: op.name(), wgsl: text.clone(), operands: operands.len() });
                self.kernel_of.insert(text, self.kernels.len() - 1);
                self.kernels.len() - 1
            }
        };
        self.steps.push(Step { kernel, op, operands, output, scope: scope.to_string() });
        Ok(())
    }

    /// The head geometry of an attention op, which its kernel is specialised to (shape inference
    /// keeps head counts and widths fixed).
    fn geometry(&self, op: &Op, operands: &[usize]) -> Option<attention::Geometry> {
        use crate::graph::Dim::Fixed;
        match *op {
            Op::PackedAttention { heads, kv_heads, head_dim, .. } => {
                Some(attention::Geometry { heads, kv_heads, head_dim })
            }
            Op::Attention { .. } => {
                let (q, k) = (&self.values[operands[0]].shape, &self.values[operands[1]].shape);
                match (q.get(1), q.get(3), k.get(1)) {
                    (Some(&Fixed(heads)), Some(&Fixed(head_dim)), Some(&Fixed(kv_heads))) => {
                        Some(attention::Geometry { heads, kv_heads, head_dim })
                    }
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// The `[k, m]` transpose of a projection weight `w` (`[m, k]`), which the projection kernel
    /// reads, its rows padded to a multiple of 4 columns if `pad` (by repeating the first ones): a
    /// load-time fold for a constant weight, permute (slice, concat) steps otherwise.
    fn transpose(&mut self, w: usize, pad: bool, scope: &str) -> Result<usize, LowerError> {
        if let Some(&t) = self.transposed.get(&(w, pad)) {
            return Ok(t);
        }
        let shape = self.values[w].shape.clone();
        let constant = self.constant(w);
        let derive = |l: &mut Self, op: Op, operands: Vec<usize>, shape: Shape| -> Result<usize, LowerError> {
            let v = l.values.len();
            let storage = if constant { Storage::Const } else { Storage::Slot(usize::MAX) };
            l.values.push(Value { shape, dtype: l.values[w].dtype, storage, format: WeightFormat::F32 });
            if constant {
                l.folds.push(Fold { op, operands, output: v });
            } else {
                l.step(op, operands, v, scope)?;
            }
            Ok(v)
        };
        let mut t = derive(self, Op::Permute { perm: vec![1, 0] }, vec![w], vec![shape[1], shape[0]])?;
        if let (true, crate::graph::Dim::Fixed(n)) = (pad, shape[0]) {
            let extra = n.next_multiple_of(4) - n;
            let rows = shape[1];
            let head = derive(
                self,
                Op::Slice { axis: 1, start: 0, len: extra },
                vec![t],
                vec![rows, crate::graph::Dim::Fixed(extra)],
            )?;
            t = derive(self, Op::Concat { axis: 1 }, vec![t, head], vec![rows, crate::graph::Dim::Fixed(n + extra)])?;
        }
        self.transposed.insert((w, pad), t);
        Ok(t)
    }

    /// The quantized view of projection weight `w` (`[rows, k]`, untransposed), if it has one: a
    /// parameter listed in [`Options::formats`] with `k` a multiple of 32, or a load-time fold
    /// that keeps the blocks: a stack of rows (concatenation on axis 0) of views of one format, or
    /// a scaled view. The view is a value of its own (the f32 value stays, for other readers), with
    /// the same parameter or the same fold over views.
    fn quantized(&mut self, w: usize) -> Option<usize> {
        if let Some(&q) = self.quantized.get(&w) {
            return q;
        }
        let v = &self.values[w];
        let fixed = |d: &crate::graph::Dim| match d {
            crate::graph::Dim::Fixed(n) => Some(*n),
            crate::graph::Dim::Sym(_) => None,
        };
        let k = if v.shape.len() == 2 { fixed(&v.shape[1]) } else { None };
        let view = match (&v.storage, k) {
            (_, None) => None,
            (_, Some(k)) if !k.is_multiple_of(format::BLOCK) || k == 0 => None,
            (Storage::Param(name), _) => match self.formats.get(name) {
                Some(&f) if f.quantized() => {
                    let value = Value { format: f, ..v.clone() };
                    self.values.push(value);
                    Some(self.values.len() - 1)
                }
                _ => None,
            },
            (Storage::Const, _) => {
                let fold = self.folds.iter().find(|f| f.output == w).cloned();
                match fold {
                    Some(Fold { op: op @ (Op::Concat { axis: 0 } | Op::Scale { .. }), operands, .. }) => {
                        let views: Option<Vec<usize>> = operands.iter().map(|&o| self.quantized(o)).collect();
                        match views {
                            Some(views)
                                if views.iter().all(|&q| self.values[q].format == self.values[views[0]].format) =>
                            {
                                let format = self.values[views[0]].format;
                                let value = Value { format, ..self.values[w].clone() };
                                self.values.push(value);
                                let id = self.values.len() - 1;
                                self.folds.push(Fold { op, operands: views, output: id });
                                Some(id)
                            }
                            _ => None,
                        }
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        self.quantized.insert(w, view);
        view
    }
}

/// Lowers a checked graph into a plan.
pub fn lower_with(g: &Graph, options: Options) -> Result<Plan, LowerError> {
    let mut l = Lowering {
        quantized: HashMap::new(),
        formats: &options.formats,
        g,
        values: Vec::new(),
        kernels: Vec::new(),
        kernel_of: HashMap::new(),
        steps: Vec::new(),
        folds: Vec::new(),
        transposed: HashMap::new(),
    };
    let mut value_of: HashMap<NodeIndex, usize> = HashMap::new();
    for n in g.order() {
        let node = &g.g[n];
        let mut operands: Vec<usize> = g.operands(n).iter().map(|o| value_of[o]).collect();
        // Constant: computed from parameters alone, with a fixed shape.
        let constant = options.fold_constants
            && !operands.is_empty()
            && operands
                .iter()
                .all(|&o| matches!(l.values[root(&l.values, o)].storage, Storage::Param(_) | Storage::Const))
            && node.shape.iter().all(|d| matches!(d, crate::graph::Dim::Fixed(_)));
        let storage = match &node.op {
            Op::Param { name } => Storage::Param(name.clone()),
            Op::Input { name, role, .. } => Storage::Input { name: name.clone(), role: *role },
            Op::Reshape { .. } => Storage::Alias(root(&l.values, operands[0])),
            _ if constant => Storage::Const,
            _ => Storage::Slot(usize::MAX), // assigned below
        };
        let id = l.values.len();
        let folded = storage == Storage::Const;
        l.values.push(Value { shape: node.shape.clone(), dtype: node.dtype, storage, format: WeightFormat::F32 });
        value_of.insert(n, id);
        if folded {
            l.folds.push(Fold { op: node.op.clone(), operands, output: id });
            continue;
        }
        let mut op = node.op.clone();
        // A projection by a constant weight: the same product as `linear` without epilogues.
        if options.fast_projections
            && op == (Op::MatMul { transpose_b: true })
            && l.values[operands[1]].shape.len() == 2
            && l.constant(operands[1])
        {
            op = Op::linear(None, false, false);
        }
        // Every projection reads its weight transposed (see `projection`), but a quantized one,
        // whose blocks run along the rows of the untransposed weight.
        if let Op::Linear { norm, .. } = &op {
            let wi = 1 + norm.map_or(0, |p| 1 + usize::from(p.bias));
            if let Some(q) = l.quantized(operands[wi]) {
                operands[wi] = q;
            } else {
                let pad = match l.values[operands[wi]].shape[0] {
                    crate::graph::Dim::Fixed(n) => projection::pads_weight(&op, n),
                    _ => false,
                };
                let t = l.transpose(operands[wi], pad, &node.scope)?;
                if options.f16_weights && l.values[t].storage == Storage::Const {
                    l.values[t].format = WeightFormat::F16;
                }
                operands[wi] = t;
            }
        }
        l.step(op, operands, id, &node.scope)?;
    }
    let Lowering { mut values, kernels, steps, folds, .. } = l;
    let outputs: Vec<(String, usize)> = g.outputs.iter().map(|(name, n)| (name.clone(), value_of[n])).collect();
    let slots = assign_slots(&mut values, &steps, &outputs);
    Ok(Plan { name: g.name.clone(), kernels, values, folds, steps, slots, outputs })
}

/// The value whose buffer `v` uses (following aliases).
fn root(values: &[Value], mut v: usize) -> usize {
    while let Storage::Alias(a) = values[v].storage {
        v = a;
    }
    v
}

/// Sequence length at which slot placement compares sizes (batch 1; every length symbol, the
/// cache included, at this value). Long enough that attention scores, quadratic in it, rank as
/// they do in long runs.
const PLACEMENT_SEQ: usize = 512;

/// Slot placement. Two greedy placements are made and the one whose slots hold fewer bytes at
/// [`PLACEMENT_SEQ`] is kept: in step order (a freed slot whose last value had the same shape
/// preferred, so slots keep sizes close to what they hold), and by size (largest value first,
/// each into the smallest free slot; "greedy by size"). A value lives from the step that writes
/// it to the last step that reads any alias of it; outputs live to the end.
fn assign_slots(values: &mut [Value], steps: &[Step], outputs: &[(String, usize)]) -> usize {
    let mut last_use: HashMap<usize, usize> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        for &o in &s.operands {
            last_use.insert(root(values, o), i);
        }
    }
    for (_, o) in outputs {
        last_use.insert(root(values, *o), usize::MAX);
    }
    let syms: HashMap<Sym, usize> = [Sym::Seq, Sym::SrcSeq, Sym::Past, Sym::Ctx]
        .into_iter()
        .map(|s| (s, PLACEMENT_SEQ))
        .chain([(Sym::Batch, 1)])
        .collect();
    // (value, first step, last step, size)
    let lives: Vec<(usize, usize, usize, usize)> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let size = resolve(&values[s.output].shape, &syms).iter().product::<usize>();
            (s.output, i, last_use.get(&s.output).copied().unwrap_or(i).max(i), size)
        })
        .collect();
    let (step_order, sized) = (in_step_order(values, &lives), by_size(&lives));
    let held = |p: &(Vec<usize>, usize)| {
        let mut sizes = vec![0usize; p.1];
        for (&slot, l) in p.0.iter().zip(&lives) {
            sizes[slot] = sizes[slot].max(l.3);
        }
        sizes.iter().sum::<usize>()
    };
    let best = if held(&sized) < held(&step_order) { sized } else { step_order };
    for (&slot, l) in best.0.iter().zip(&lives) {
        values[l.0].storage = Storage::Slot(slot);
    }
    best.1
}

/// Step-order placement: the slot of each life (in `lives` order), and the slot count.
fn in_step_order(values: &[Value], lives: &[(usize, usize, usize, usize)]) -> (Vec<usize>, usize) {
    let mut free: Vec<(usize, &Shape)> = Vec::new();
    let mut slots = 0;
    let mut dying: HashMap<usize, Vec<(usize, &Shape)>> = HashMap::new();
    let mut out = Vec::with_capacity(lives.len());
    for &(v, first, last, _) in lives {
        let shape = &values[v].shape;
        let pick = free.iter().position(|(_, sh)| *sh == shape).or(if free.is_empty() { None } else { Some(0) });
        let slot = match pick {
            Some(p) => free.remove(p).0,
            None => {
                slots += 1;
                slots - 1
            }
        };
        out.push(slot);
        if last != usize::MAX {
            dying.entry(last).or_default().push((slot, shape));
        }
        free.extend(dying.remove(&first).unwrap_or_default());
    }
    (out, slots)
}

/// Greedy by size: the slot of each life (in `lives` order), and the slot count.
fn by_size(lives: &[(usize, usize, usize, usize)]) -> (Vec<usize>, usize) {
    let mut order: Vec<usize> = (0..lives.len()).collect();
    order.sort_by(|&a, &b| lives[b].3.cmp(&lives[a].3).then(lives[a].1.cmp(&lives[b].1)));
    // Per slot: its size and the lifetimes it holds.
    let mut slots: Vec<(usize, Vec<(usize, usize)>)> = Vec::new();
    let mut out = vec![0; lives.len()];
    for i in order {
        let (_, first, last, size) = lives[i];
        let free = |held: &[(usize, usize)]| held.iter().all(|&(f, l)| l < first || last < f);
        // Largest first, so every existing slot is big enough.
        let fit = slots.iter().enumerate().filter(|(_, (_, held))| free(held)).min_by_key(|(_, (sz, _))| *sz);
        let slot = match fit {
            Some((s, _)) => s,
            None => {
                slots.push((size, Vec::new()));
                slots.len() - 1
            }
        };
        slots[slot].1.push((first, last));
        out[i] = slot;
    }
    let n = slots.len();
    (out, n)
}

pub use crate::graph::resolve;

/// Row-major strides.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * shape[i + 1];
    }
    st
}

/// The `Dims` uniform of a step (16 `u32`s, `[0]` = threads) for concrete operand and output shapes
/// and `past` cached tokens (where positions start). Errors if a size does not fit the kernels'
/// 32-bit indexing.
pub fn dispatch(op: &Op, operands: &[Vec<usize>], out: &[usize], past: usize) -> Result<[u32; 16], String> {
    dims_of(op, operands, out, past, false)
}

/// [`dispatch`] for the step's chunked kernel variant ([`wgsl::kernel_chunked`]), which runs a
/// projection in its scalar forms only and attention one query row per invocation.
pub fn dispatch_chunked(op: &Op, operands: &[Vec<usize>], out: &[usize], past: usize) -> Result<[u32; 16], String> {
    dims_of(op, operands, out, past, true)
}

// A plan read from a file holds any op on any operands (`Plan::check` bounds indices, not
// typing), so this reads operands and axes with `operand` and `axis`: an ill-typed step is an
// error, not a panic.
fn dims_of(op: &Op, operands: &[Vec<usize>], out: &[usize], past: usize, chunked: bool) -> Result<[u32; 16], String> {
    let total: usize = out.iter().product();
    let last = |s: &[usize]| s.last().copied().unwrap_or(1);
    let rows = |s: &[usize]| s.iter().product::<usize>() / last(s).max(1);
    let operand = |i: usize| -> Result<&[usize], String> {
        operands.get(i).map(Vec::as_slice).ok_or_else(|| format!("{} has no operand {i}", op.name()))
    };
    let axis = |s: &[usize], i: usize| -> Result<usize, String> {
        s.get(i).copied().ok_or_else(|| format!("{}: shape {s:?} has no axis {i}", op.name()))
    };
    // Axis `i` counted from the end (1: the last).
    let from_end = |s: &[usize], i: usize| match s.len().checked_sub(i) {
        Some(j) => axis(s, j),
        None => Err(format!("{}: shape {s:?} has fewer than {i} axes", op.name())),
    };
    let mut d: Vec<usize> = match op {
        Op::Positions { .. } => vec![total, past],
        Op::Sinusoid { .. } | Op::Scale { .. } | Op::Act(_) => vec![total],
        Op::Gather => vec![total, last(out)],
        Op::MatMul { transpose_b } => {
            let (a, b) = (operand(0)?, operand(1)?);
            let (m, k) = (from_end(a, 2)?, from_end(a, 1)?);
            let n = if *transpose_b { from_end(b, 2)? } else { from_end(b, 1)? };
            vec![total, m, n, k, usize::from(b.len() > 2)]
        }
        Op::Add | Op::Mul => {
            // Right-align both operands to the output's rank (at most 4), broadcast axes stride 0.
            let pad = |s: &[usize]| -> Vec<usize> {
                let mut v = vec![1; 4 - s.len().min(4)];
                v.extend_from_slice(s);
                v
            };
            let o = pad(out);
            let bstrides = |s: &[usize]| -> Vec<usize> {
                let p = pad(s);
                let st = strides(&p);
                p.iter().zip(st).map(|(&n, st)| if n == 1 { 0 } else { st }).collect()
            };
            let mut v = vec![total];
            v.extend(&o);
            v.extend(bstrides(operand(0)?));
            v.extend(bstrides(operand(1)?));
            v
        }
        Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Softmax | Op::TopK { .. } | Op::L2Normalize => {
            vec![rows(out), last(out)]
        }
        Op::Permute { perm } => {
            let st = strides(operand(0)?);
            let mut o = vec![1; 4usize.saturating_sub(out.len())];
            o.extend_from_slice(out);
            let mut s = vec![0; 4usize.saturating_sub(out.len())];
            for &p in perm {
                s.push(axis(&st, p)?);
            }
            let mut v = vec![total];
            v.extend(o);
            v.extend(s);
            v
        }
        Op::Rope { .. } => vec![total, axis(out, 2)?, axis(out, 3)?, past],
        Op::RepeatHeads { times } => vec![total, axis(operand(0)?, 1)?, *times, axis(out, 2)? * axis(out, 3)?],
        Op::Alibi | Op::Mask { .. } => vec![total, axis(out, 1)?, axis(out, 2)?, axis(out, 3)?],
        Op::Slice { axis: a, start, len } => {
            let x = operand(0)?;
            let inner: usize = x.iter().skip(a + 1).product();
            vec![total, axis(x, *a)?, inner, *start, *len]
        }
        Op::MeanPool => {
            let x = operand(0)?;
            vec![axis(out, 0)? * axis(out, 1)?, axis(x, 1)?, axis(x, 2)?]
        }
        // Tiles of outputs per invocation, whole workgroups: see `projection::dims`.
        Op::Linear { .. } if chunked => projection::scalar_dims(op, operands, out, past),
        Op::Linear { .. } => projection::dims(op, operands, out, past),
        // Chunked: one thread per query row, [b * s * h, h, s, s, d, kv, width] from qkv [b, s, width].
        Op::PackedAttention { heads, kv_heads, head_dim, .. } if chunked => {
            let &[b, s, width] = operand(0)? else { return Err(format!("{}: qkv must be [b, s, width]", op.name())) };
            vec![b * s * heads, *heads, s, s, *head_dim, *kv_heads, width]
        }
        // Blocks of query rows and heads: see `attention::dims`.
        Op::PackedAttention { heads, kv_heads, head_dim, .. } => {
            let &[b, s, width] = operand(0)? else { return Err(format!("{}: qkv must be [b, s, width]", op.name())) };
            let g = attention::Geometry { heads: *heads, kv_heads: *kv_heads, head_dim: *head_dim };
            attention::dims(g, b, s, s, width)
        }
        // One thread per output element: [total, heads, p, s, d, width, past] with `p` tokens
        // from the cache operand (0 without one), `s` new ones from x [b, s, width].
        Op::Heads { .. } => {
            let x = operand(operands.len().saturating_sub(1))?;
            let (s, width) = (axis(x, 1)?, axis(x, 2)?);
            let p =
                axis(out, 2)?.checked_sub(s).ok_or_else(|| format!("{}: more new rows than output rows", op.name()))?;
            vec![total, axis(out, 1)?, p, s, axis(out, 3)?, width, past]
        }
        Op::Concat { axis: a } => {
            let (x, y) = (operand(0)?, operand(1)?);
            let inner: usize = x.iter().skip(a + 1).product();
            vec![total, axis(x, *a)?, axis(y, *a)?, inner]
        }
        // One thread per row of scores [b, h, q, k].
        Op::MaskedSoftmax { .. } => vec![rows(out), axis(out, 1)?, axis(out, 2)?, axis(out, 3)?],
        // Chunked: one thread per query row, [b * s * h, h, s, t, d, kv] from q [b, h, s, d], k [b, kv, t, d].
        Op::Attention { .. } => {
            let (&[b, h, s, d], &[_, kv, t, ..]) = (operand(0)?, operand(1)?) else {
                return Err(format!("{}: q must be [b, h, s, d] and k [b, kv, t, d]", op.name()));
            };
            if chunked {
                vec![b * h * s, h, s, t, d, kv]
            } else {
                attention::dims(attention::Geometry { heads: h, kv_heads: kv, head_dim: d }, b, s, t, 0)
            }
        }
        Op::AddNorm { .. } => vec![rows(out), last(out)],
        Op::Input { .. } | Op::Param { .. } | Op::Reshape { .. } => vec![0],
    };
    if total == 0
        && let Some(threads) = d.first_mut()
    {
        *threads = 0;
    }
    if d.len() > 16 {
        return Err(format!("{} needs {} sizes, more than 16", op.name(), d.len()));
    }
    let mut u = [0u32; 16];
    for (slot, &v) in u.iter_mut().zip(&d) {
        *slot = u32::try_from(v).map_err(|_| format!("{}: size {v} does not fit 32-bit indexing", op.name()))?;
    }
    // Indices inside a kernel reach the operand and output sizes; they must fit in u32 too.
    for s in operands.iter().map(|s| s.iter().product::<usize>()).chain([total]) {
        u32::try_from(s)
            .map_err(|_| format!("{}: a tensor of {s} elements does not fit 32-bit indexing", op.name()))?;
    }
    Ok(u)
}

/// Workgroup grid for `threads` threads: `(x, y)` with `x <= max_x`.
pub fn workgroups(threads: u32, max_x: u32) -> (u32, u32) {
    let groups = threads.div_ceil(wgsl::WORKGROUP).max(1);
    if groups <= max_x { (groups, 1) } else { (max_x, groups.div_ceil(max_x)) }
}

/// The most elements a plan's value may have in its fixed dimensions (a plan read from a file
/// is checked against it before anything is sized from it).
pub const MAX_FIXED_ELEMENTS: u64 = 1 << 40;

impl Plan {
    /// Checks a plan that did not come from [`lower`] (an artifact's) for what lowering guarantees
    /// and the runtime relies on: every index (kernel, value, slot) in range, aliases pointing to
    /// earlier values (so alias chains end), folds producing constants, shapes within
    /// [`MAX_FIXED_ELEMENTS`], and every kernel a valid WGSL module. Returns what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let n = self.values.len();
        if self.slots > n {
            return Err(format!("{} shared buffers for {n} values", self.slots));
        }
        for (i, v) in self.values.iter().enumerate() {
            match v.storage {
                Storage::Slot(s) if s >= self.slots => {
                    return Err(format!("value {i} is in buffer {s} of {}", self.slots));
                }
                Storage::Alias(a) if a >= i => return Err(format!("value {i} aliases value {a}, not an earlier one")),
                _ => {}
            }
            let fixed = v.shape.iter().try_fold(1u64, |acc, d| match d {
                crate::graph::Dim::Fixed(k) => acc.checked_mul(*k as u64).filter(|&e| e <= MAX_FIXED_ELEMENTS),
                crate::graph::Dim::Sym(_) => Some(acc),
            });
            if fixed.is_none() {
                return Err(format!("value {i} has more than {MAX_FIXED_ELEMENTS} elements"));
            }
        }
        let value = |v: usize, what: &str| -> Result<(), String> {
            if v < n { Ok(()) } else { Err(format!("{what} reads value {v} of {n}")) }
        };
        for (i, step) in self.steps.iter().enumerate() {
            if step.kernel >= self.kernels.len() {
                return Err(format!("step {i} runs kernel {} of {}", step.kernel, self.kernels.len()));
            }
            for &o in step.operands.iter().chain([&step.output]) {
                value(o, &format!("step {i}"))?;
            }
        }
        for (i, fold) in self.folds.iter().enumerate() {
            for &o in fold.operands.iter().chain([&fold.output]) {
                value(o, &format!("fold {i}"))?;
            }
            if self.values[fold.output].storage != Storage::Const {
                return Err(format!("fold {i} writes value {}, which is not a constant", fold.output));
            }
        }
        for (name, v) in &self.outputs {
            value(*v, &format!("output `{name}`"))?;
        }
        for kernel in &self.kernels {
            validate_wgsl(&kernel.wgsl).map_err(|e| format!("kernel `{}` is not valid WGSL: {e}", kernel.name))?;
        }
        Ok(())
    }

    /// Bytes of every intermediate if none shared a buffer, and bytes of the slots as placed, at
    /// the given symbol values.
    pub fn memory(&self, syms: &HashMap<Sym, usize>) -> (u64, u64) {
        let mut sum = 0u64;
        let mut slot_bytes = vec![0u64; self.slots];
        for v in &self.values {
            if let Storage::Slot(s) = v.storage {
                let bytes = 4 * resolve(&v.shape, syms).iter().product::<usize>() as u64;
                sum += bytes;
                slot_bytes[s] = slot_bytes[s].max(bytes);
            }
        }
        (sum, slot_bytes.iter().sum())
    }

    /// The most intermediate bytes live at once (while any step runs: its output and every value
    /// still to be read), at the given symbol values: the least memory any placement needs.
    pub fn peak_live(&self, syms: &HashMap<Sym, usize>) -> u64 {
        let root = |mut v: usize| {
            while let Storage::Alias(a) = self.values[v].storage {
                v = a;
            }
            v
        };
        let mut last_use: HashMap<usize, usize> = HashMap::new();
        for (i, step) in self.steps.iter().enumerate() {
            for &o in &step.operands {
                last_use.insert(root(o), i);
            }
        }
        for (_, o) in &self.outputs {
            last_use.insert(root(*o), usize::MAX);
        }
        let bytes = |v: usize| 4 * resolve(&self.values[v].shape, syms).iter().product::<usize>() as u64;
        let mut live: u64 = 0;
        let mut peak: u64 = 0;
        let mut dying: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, step) in self.steps.iter().enumerate() {
            let v = step.output;
            if matches!(self.values[v].storage, Storage::Slot(_)) {
                live += bytes(v);
                peak = peak.max(live);
                let end = last_use.get(&v).copied().unwrap_or(i);
                if end != usize::MAX {
                    dying.entry(end.max(i)).or_default().push(v);
                }
            }
            for dead in dying.remove(&i).unwrap_or_default() {
                live -= bytes(dead);
            }
        }
        peak
    }

    /// Per-slot byte sizes at the given symbol values (at least 4 bytes each).
    pub fn slot_sizes(&self, syms: &HashMap<Sym, usize>) -> Vec<u64> {
        let mut slot_bytes = vec![4u64; self.slots];
        for v in &self.values {
            if let Storage::Slot(s) = v.storage {
                let bytes = 4 * resolve(&v.shape, syms).iter().product::<usize>() as u64;
                slot_bytes[s] = slot_bytes[s].max(bytes);
            }
        }
        slot_bytes
    }

    /// The deterministic text of every kernel, for snapshots: `// kernel N: name` then the module.
    pub fn kernels_text(&self) -> String {
        let mut s = String::new();
        for (i, k) in self.kernels.iter().enumerate() {
            s += &format!("// ---- kernel {i}: {} ({} operands)\n{}\n", k.name, k.operands, k.wgsl);
        }
        s
    }
}
