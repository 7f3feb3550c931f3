//! Lowering: Graph -> [`Plan`], the target-neutral program every engine executes.
//!
//! A plan is a list of [`Step`]s in topological order, each one op of the graph over [`Value`]s.
//! Values are parameters (uploaded once), inputs (bound per run), aliases (reshapes share their
//! operand's buffer) or intermediates placed in *slots*: buffers that values with disjoint
//! lifetimes share. Slots are assigned at compile time by liveness; their byte sizes are fixed at
//! run time, when batch and sequence lengths are known, as the largest value each holds. Ops on
//! parameters alone are [`Fold`]s, evaluated once when the weights are loaded.
//!
//! The plan names no target: a projection reads its weight in the graph's `[out, in]` layout (or
//! as the blocks of a quantized format, [`Value::format`]). Each back end compiles it at load
//! time with its own legalization — [`crate::back::wgsl::compile`] transposes and pads weights for
//! its projection kernel and generates the WGSL modules; the CPU back end picks native kernels —
//! so an artifact, which stores the plan, runs on either.

#![expect(
    clippy::indexing_slicing,
    reason = "lowering runs on graphs that `Graph::check` accepted (`graph::infer` fixes each op's \
              arity and operand ranks); a plan read from a file is indexed only after `Plan::check` \
              bounded its value, slot and kernel indices, and its steps' shapes are read by \
              `dims_of` with checked access"
)]

mod check;
pub mod format;
pub mod schedule;

pub use check::{PlanError, Reader};
pub use format::WeightFormat;

use crate::graph::{Dim, Graph, InputRole, Op, Shape, Sym};
use crate::tensor::DType;
use petgraph::graph::NodeIndex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};

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
    /// How it is stored: `F32` for every value but the weight operand of a projection, which may
    /// be quantized (see [`mod@format`]; a back end may choose f16 for its own copy).
    #[serde(default, skip_serializing_if = "WeightFormat::is_f32")]
    pub format: WeightFormat,
}

/// One op executed at run time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The op (its sizes follow from the operands' shapes at run time).
    pub op: Op,
    /// Operand values.
    pub operands: Vec<usize>,
    /// Result value.
    pub output: usize,
    /// Values the step writes besides [`Step::output`], bound after its operands. Only a back
    /// end's legalized plan has them, where one kernel does the work of several steps (the WGSL
    /// back end's cached attention that also appends to the key/value caches, see
    /// [`Op::PackedAttention`]); a neutral plan has none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<usize>,
    /// The scope of the graph node, for errors and profiles.
    pub scope: String,
}

impl Step {
    /// Every value the step writes: its output, then [`Step::also`].
    pub fn outputs(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.output).chain(self.also.iter().copied())
    }
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
    /// Every tensor.
    pub values: Vec<Value>,
    /// Load-time computations on parameters, in order.
    pub folds: Vec<Fold>,
    /// Run-time ops in order.
    pub steps: Vec<Step>,
    /// Number of shared intermediate buffers.
    pub slots: usize,
    /// Named results.
    pub outputs: Vec<(String, usize)>,
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
    /// Block-quantized parameters (`Q8_0`, `Q4_1`, `Q5_0`, `Q4_K`, `Q6_K`), by canonical name: a projection whose weight is
    /// one of them (or a load-time stack of such rows, or a scaled one) reads the blocks in place
    /// of f32 (see [`mod@format`]). The runtime must then be given the blocks of each. Parameters
    /// whose rows are not whole blocks of their format (32, or 256 for the K-quants) stay f32.
    pub formats: BTreeMap<String, WeightFormat>,
}

impl Default for Options {
    fn default() -> Options {
        Options { fast_projections: true, fold_constants: true, formats: BTreeMap::new() }
    }
}

/// Lowers a checked graph into a plan, with the default [`Options`].
pub fn lower(g: &Graph) -> Plan {
    lower_with(g, Options::default())
}

/// The state of one lowering: what has been emitted so far.
struct Lowering<'g> {
    values: Vec<Value>,
    steps: Vec<Step>,
    folds: Vec<Fold>,
    /// Weight value -> its quantized view, if it has one (see [`Lowering::quantized`]).
    quantized: HashMap<usize, Option<usize>>,
    /// Quantized parameters by name.
    formats: &'g BTreeMap<String, WeightFormat>,
}

impl Lowering<'_> {
    /// The quantized view of projection weight `w` (`[rows, k]`, untransposed), if it has one: a
    /// parameter listed in [`Options::formats`] with `k` a multiple of its format's
    /// [`WeightFormat::row_multiple`], or a load-time fold
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
            (Storage::Param(name), Some(k)) => match self.formats.get(name) {
                Some(&f) if f.quantized() && k.is_multiple_of(f.row_multiple()) => {
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
                        // Parts of one format stack in it; of several, in one that holds them all
                        // exactly (see `WeightFormat::holds_exactly`), the runtime re-encoding the
                        // others when it folds them.
                        let format = views.as_ref().and_then(|views| {
                            let formats: Vec<WeightFormat> = views.iter().map(|&q| self.values[q].format).collect();
                            WeightFormat::common_exact(&formats)
                        });
                        match (views, format) {
                            (Some(views), Some(format)) => {
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
pub fn lower_with(g: &Graph, options: Options) -> Plan {
    let mut l = Lowering {
        quantized: HashMap::new(),
        formats: &options.formats,
        values: Vec::new(),
        steps: Vec::new(),
        folds: Vec::new(),
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
            Op::Reshape { .. } | Op::After => Storage::Alias(root(&l.values, operands[0])),
            _ if constant => Storage::Const,
            _ => Storage::Slot(usize::MAX), // assigned below
        };
        let id = l.values.len();
        l.values.push(Value { shape: node.shape.clone(), dtype: node.dtype, storage, format: WeightFormat::F32 });
        value_of.insert(n, id);
        match l.values[id].storage {
            Storage::Const => {
                l.folds.push(Fold { op: node.op.clone(), operands, output: id });
                continue;
            }
            // Bound or uploaded, or a view of another value's buffer: nothing to run.
            Storage::Param(_) | Storage::Input { .. } | Storage::Alias(_) => continue,
            Storage::Slot(_) => {}
        }
        let mut op = node.op.clone();
        // A projection by a constant weight: the same product as `linear` without epilogues.
        if options.fast_projections
            && op == (Op::MatMul { transpose_b: true })
            && l.values[operands[1]].shape.len() == 2
            && self::constant(&l.values, operands[1])
        {
            op = Op::linear(None, false, false);
        }
        // A projection by a quantized weight reads its blocks.
        if let Some(wi) = op.linear_weight()
            && let Some(q) = l.quantized(operands[wi])
        {
            operands[wi] = q;
        }
        l.steps.push(Step { op, operands, output: id, also: Vec::new(), scope: node.scope.clone() });
    }
    let Lowering { mut values, steps, folds, .. } = l;
    // An optimizer's ops last, in their order (they read only the gradients, the loss and each
    // other): the updates after every other reader of the tensors they update (nothing reads an
    // update's own result), so that an engine may write them in place, and the whole optimizer
    // one run of steps at the end, which an engine may dispatch its own way (wgpu's does).
    let (updates, mut steps): (Vec<Step>, Vec<Step>) = steps.into_iter().partition(|s| s.op.is_optimizer());
    steps.extend(updates);
    let outputs: Vec<(String, usize)> = g.outputs.iter().map(|(name, n)| (name.clone(), value_of[n])).collect();
    let slots = assign_slots(&mut values, &steps, &outputs);
    Plan { name: g.name.clone(), values, folds, steps, slots, outputs }
}

/// Whether value `v` is computed from parameters alone with a fixed shape.
pub(crate) fn constant(values: &[Value], v: usize) -> bool {
    matches!(values[root(values, v)].storage, Storage::Param(_) | Storage::Const)
        && values[v].shape.iter().all(|d| matches!(d, crate::graph::Dim::Fixed(_)))
}

/// The value whose buffer `v` uses (following aliases).
pub(crate) fn root(values: &[Value], mut v: usize) -> usize {
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
pub(crate) fn assign_slots(values: &mut [Value], steps: &[Step], outputs: &[(String, usize)]) -> usize {
    let mut last_use: HashMap<usize, usize> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        for &o in &s.operands {
            last_use.insert(root(values, o), i);
        }
    }
    for (_, o) in outputs {
        last_use.insert(root(values, *o), usize::MAX);
    }
    let syms: HashMap<Sym, usize> = [Sym::Seq, Sym::SrcSeq, Sym::Past, Sym::Ctx, Sym::Recent, Sym::RecentCtx]
        .into_iter()
        .map(|s| (s, PLACEMENT_SEQ))
        .chain([(Sym::Batch, 1)])
        .collect();
    // (value, first step, last step, size)
    let lives: Vec<(usize, usize, usize, usize)> = steps
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.outputs().map(move |v| (i, v)))
        .map(|(i, v)| {
            let size = elements(&values[v].shape, &syms);
            (v, i, last_use.get(&v).copied().unwrap_or(i).max(i), size)
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
    for (i, &(v, first, last, _)) in lives.iter().enumerate() {
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
        // The slots of the values a step reads last are free once all its outputs have theirs
        // (a step with several outputs must not write one over an operand).
        if lives.get(i + 1).is_none_or(|next| next.1 != first) {
            free.extend(dying.remove(&first).unwrap_or_default());
        }
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

pub use crate::graph::{elements, resolve};

/// The most elements a plan's value may have in its fixed dimensions (a plan read from a file
/// is checked against it before anything is sized from it).
pub const MAX_FIXED_ELEMENTS: u64 = 1 << 40;

/// The bytes a weight value holds on the device: a `[rows, k]` weight in its format, any other
/// value 4 bytes an element (f32, or `i32` for `i64`). Symbolic axes count as 0.
fn value_bytes(value: &Value) -> u64 {
    let fixed = |d: &Dim| if let Dim::Fixed(n) = d { *n } else { 0 };
    match &value.shape[..] {
        [rows, k] => value.format.bytes(fixed(rows), fixed(k)),
        shape => 4 * shape.iter().map(fixed).product::<usize>() as u64,
    }
}

impl Plan {
    /// The values an optimizer's update writes ([`Op::is_update`]): a trainer's engine writes
    /// them in place of the tensors and state the update reads, so they take no memory of their
    /// own (the CPU's deferred updates, wgpu's optimizer steps).
    fn in_place(&self) -> BTreeSet<usize> {
        self.steps.iter().filter(|s| s.op.is_update()).map(|s| s.output).collect()
    }

    /// Bytes of every intermediate if none shared a buffer, and bytes of the slots as placed, at
    /// the given symbol values (an optimizer's updates, written in place, count nothing).
    pub fn memory(&self, syms: &HashMap<Sym, usize>) -> (u64, u64) {
        let mut sum = 0u64;
        let mut slot_bytes = vec![0u64; self.slots];
        let in_place = self.in_place();
        for (i, v) in self.values.iter().enumerate() {
            if let Storage::Slot(s) = v.storage
                && !in_place.contains(&i)
            {
                let bytes = 4 * elements(&v.shape, syms) as u64;
                sum += bytes;
                slot_bytes[s] = slot_bytes[s].max(bytes);
            }
        }
        (sum, slot_bytes.iter().sum())
    }

    /// The most intermediate bytes live at once (while any step runs: its output and every value
    /// still to be read), at the given symbol values: the least memory any placement needs (an
    /// optimizer's updates, written in place, count nothing).
    pub fn peak_live(&self, syms: &HashMap<Sym, usize>) -> u64 {
        let in_place = self.in_place();
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
        let bytes = |v: usize| 4 * elements(&self.values[v].shape, syms) as u64;
        let mut live: u64 = 0;
        let mut peak: u64 = 0;
        let mut dying: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, step) in self.steps.iter().enumerate() {
            for v in step.outputs() {
                if !matches!(self.values[v].storage, Storage::Slot(_)) || in_place.contains(&v) {
                    continue;
                }
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

    /// The bytes of weights (parameters and load-time constants, in their plan formats) one run
    /// reads, each counted once: a weight some step reads whole counts whole, a table only
    /// gathered from (an untied embedding) counts the `rows` rows a run gathers. For a decode step
    /// (`rows` = 1) this is the memory traffic that bounds its speed on a CPU, where the weights
    /// do not fit in cache.
    pub fn weight_bytes_read(&self, rows: usize) -> u64 {
        let (mut whole, mut gathered) = (BTreeSet::new(), BTreeSet::new());
        for step in &self.steps {
            for (i, &o) in step.operands.iter().enumerate() {
                let v = root(&self.values, o);
                if matches!(self.values[v].storage, Storage::Param(_) | Storage::Const) {
                    if matches!(step.op, Op::Gather) && i == 0 {
                        gathered.insert(v)
                    } else {
                        whole.insert(v)
                    };
                }
            }
        }
        let rows_of = |v: &usize| {
            let value = &self.values[*v];
            match value.shape[..] {
                [Dim::Fixed(n), Dim::Fixed(k)] => value.format.bytes(rows.min(n), k),
                _ => value_bytes(value),
            }
        };
        whole.iter().map(|&v| value_bytes(&self.values[v])).sum::<u64>()
            + gathered.difference(&whole).map(rows_of).sum::<u64>()
    }

    /// The bytes of the parameters and constants step `i` of [`Plan::steps`] reads whole (as
    /// stored: blocks for a quantized weight); a gathered table is left out (a gather reads
    /// rows of it, which [`Plan::weight_bytes_read`] counts). 0 past the steps.
    pub fn step_weight_bytes(&self, i: usize) -> u64 {
        let Some(step) = self.steps.get(i) else { return 0 };
        let read: BTreeSet<usize> = (step.operands.iter().enumerate())
            .filter(|&(at, _)| !(matches!(step.op, Op::Gather) && at == 0))
            .map(|(_, &o)| root(&self.values, o))
            .filter(|&v| matches!(self.values[v].storage, Storage::Param(_) | Storage::Const))
            .collect();
        read.iter().map(|&v| value_bytes(&self.values[v])).sum()
    }

    /// Per-slot byte sizes at the given symbol values (at least 4 bytes each).
    pub fn slot_sizes(&self, syms: &HashMap<Sym, usize>) -> Vec<u64> {
        self.slot_sizes_except(syms, |_| false)
    }

    /// [`Plan::slot_sizes`], leaving out the values `elsewhere` says a run keeps in buffers of
    /// their own (a cache appended in place holds its present; its slot is never written).
    pub fn slot_sizes_except(&self, syms: &HashMap<Sym, usize>, elsewhere: impl Fn(usize) -> bool) -> Vec<u64> {
        let mut slot_bytes = vec![4u64; self.slots];
        for (i, v) in self.values.iter().enumerate() {
            if let Storage::Slot(s) = v.storage
                && !elsewhere(i)
            {
                let bytes = 4 * elements(&v.shape, syms) as u64;
                slot_bytes[s] = slot_bytes[s].max(bytes);
            }
        }
        slot_bytes
    }
}
