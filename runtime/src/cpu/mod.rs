//! The native CPU back end: a [`Plan`] executed on the host's cores.
//!
//! [`CpuModel`] runs the same plan as [`crate::GpuModel`] — the fused ops the optimizer chose, one
//! step per op, intermediates in the slots liveness assigned — with native kernels instead of
//! WGSL. What it shares with the wgpu engine is in [`crate::prepare`] (load-time folds, input
//! binding, index checks); the layout it holds the constants in is the CPU back end's writer's
//! ([`kiln_compiler::back::cpu`]: projection weights transposed, gather tables kept as blocks);
//! what is its own is the kernel chosen for each step:
//!
//! - projections ([`linear`]): the norm prologue, then a GEMM through the `gemm` crate for f32
//!   weights, or products straight from the quantized blocks for Q8_0, Q4_1, Q5_0, Q4_K and
//!   Q6_K weights (blocks
//!   dequantized in registers, [`qdot_f32`]; or, opted into, activations quantized per block of
//!   32 as llama.cpp does, [`qdot`]), then the epilogue (bias, activation, gate, RoPE, residual)
//!   on each row while it is in cache;
//! - attention ([`attention`]): a task per query row for decoding, blocks of query rows through
//!   two GEMMs for prefill; every query head of a key/value group sharing the loads, causal and
//!   window ranges skipped;
//! - norms, residual adds, gathers and activations ([`elementwise`], [`math`]);
//! - every other op through the interpreter's own evaluation
//!   ([`kiln_compiler::interp::eval_op_at`]), so any plan runs, and native kernels replace ops one
//!   at a time, each held to the interpreter by `tests/engines/fused_ops.rs`.
//!
//! The plan is target-neutral: projection weights are in the graph's `[out, in]` layout, f32 or
//! quantized blocks (`[rows, k]`), which these kernels read as they are (the wgpu back end
//! transposes its own copy), so an artifact compiled once runs on either engine. Work is spread
//! over a rayon pool of `threads` threads, whose other workers poll for each kernel's jobs while
//! a run's steps go by (`poll`), rather than sleep and wake around every kernel.

#![expect(
    clippy::indexing_slicing,
    reason = "a plan is lowered from a checked graph or read from an artifact, whose `Plan::check` \
              bounds its value and slot indices; every step's operand shapes are checked against \
              its op by `graph::infer` when the model is built (`CpuModel::new`), so the kernels \
              index within the shapes they were given"
)]

pub mod attention;
mod batch;
pub mod cache;
pub mod elementwise;
pub mod isa;
pub mod linear;
pub mod math;
mod poll;
pub mod qdot;
pub mod qdot_f32;
#[cfg(test)]
mod testing;
pub mod training;

use crate::prepare::{self, PrepareError, root};
use crate::progress::Progress;
use crate::quant::QuantWeight;
use cache::{AppendSite, CacheBuf, KvCache};
use kiln_compiler::back::cpu::{self, Program, Weight, WeightView};
use kiln_compiler::graph::{Op, PackedAttention, Sym};
use kiln_compiler::interp::{self, InterpError};
use kiln_compiler::lower::{Plan, PlanError, Storage, WeightFormat, resolve};
use kiln_compiler::tensor::{DType, Data, Tensor};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

pub use batch::SeqStep;

/// What can go wrong on the CPU back end.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// Bad inputs or parameters, or an op the interpreter refused.
    #[error(transparent)]
    Interp(#[from] InterpError),
    /// The plan breaks a guarantee of lowering ([`Plan::check`]: an index out of range, an
    /// ill-typed step).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Not enough host memory for an intermediate.
    #[error(transparent)]
    Memory(#[from] kiln_compiler::memory::MemoryError),
    /// A step's operands do not fit its kernel (their number, shapes or element types), in the
    /// kernel's words.
    #[error("{0}")]
    Operands(String),
    /// An error of one step, with the step named.
    #[error("`{scope}` ({op}): {error}")]
    Step {
        /// The step's scope.
        scope: String,
        /// The name of its op.
        op: String,
        /// What went wrong.
        error: Box<CpuError>,
    },
    /// The plan stores a weight as f16, which this back end does not hold.
    #[error("the CPU back end stores projection weights as f32 or blocks, not f16")]
    F16Weights,
    /// A quantized parameter the plan reads was not among the blocks given.
    #[error("the blocks of `{0}` were not given")]
    MissingBlocks(String),
    /// An input the plan reads was neither given nor held in the cache.
    #[error("input `{0}` was not given")]
    MissingInput(String),
    /// The thread pool could not start.
    #[error("cannot start {threads} threads: {source}")]
    Threads {
        /// The threads asked for.
        threads: usize,
        /// Why not.
        source: rayon::ThreadPoolBuildError,
    },
    /// An earlier run panicked while holding the model's buffers.
    #[error("run state poisoned")]
    Poisoned,
    /// The key/value cache does not hold what a step reads or writes.
    #[error("{0}")]
    Cache(String),
    /// The plan's constants or inputs could not be prepared ([`PrepareError::Invalid`]).
    #[error("{0}")]
    Prepare(String),
    /// The plan cannot run several sequences' steps together ([`CpuModel::run_batched`]): why.
    #[error("this model cannot run sequences together: {0}")]
    Unbatched(String),
    /// A broken invariant of this back end: a bug, not a bad plan or input.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<PrepareError> for CpuError {
    fn from(e: PrepareError) -> Self {
        match e {
            PrepareError::Interp(e) => CpuError::Interp(e),
            PrepareError::Invalid(m) => CpuError::Prepare(m),
        }
    }
}

type R<T> = Result<T, CpuError>;

/// A constant the steps read.
/// (A parameter read as two values — an embedding table gathered from and projected by — is
/// shared, not copied.)
enum Const {
    F32(Arc<Tensor>),
    Quant(Arc<QuantWeight>),
}

/// An operand as a kernel sees it: its shape at this run and its elements.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// Integer elements.
    I64(&'a [i64]),
    /// A block-quantized `[rows, k]` weight.
    Quant(&'a QuantWeight),
    /// A projection's f32 `[n, k]` weight transposed, `[k, n]` in rows of `ld` elements: as this
    /// back end laid it out at load (`ld = n`, see [`CpuModel::new`]), or a parameter stored
    /// `[k, cols]` read in place (a [`WeightView`]: `data` from its first column, `ld = cols`).
    Transposed {
        /// The elements, from the first of row 0.
        data: &'a [f32],
        /// The row stride.
        ld: usize,
    },
    /// A `[b, heads, rows, d]` tensor kept in a cache buffer with room for `cap` rows per head
    /// (head stride `cap * d`; see [`cache`]).
    Cache {
        /// The buffer's elements.
        data: &'a [f32],
        /// Rows per head the buffer has room for.
        cap: usize,
    },
}

impl<'a> Arg<'a> {
    /// The f32 elements, or an error naming `what` the kernel expected.
    pub fn f32(self, what: &str) -> R<&'a [f32]> {
        match self {
            Arg::F32(x) => Ok(x),
            _ => Err(CpuError::Operands(format!("{what} must be an f32 tensor"))),
        }
    }
}

/// A run's named results.
type Outputs = Vec<(String, Tensor)>;

/// What the optimizer's updates a run deferred read besides the tensors they update (see
/// [`CpuModel::execute`]): one clipping factor and one set of constants, which every update of
/// a step reads, and each update's gradient.
#[derive(Default)]
struct Deferred {
    /// The step's clipping factor (NaN: no step).
    scale: f32,
    /// The step's constants.
    constants: Vec<f32>,
    /// Each update's step and its gradient's elements.
    grads: Vec<(usize, Vec<f32>)>,
}

/// A slot's buffer: its elements, of the type of the value last written there.
enum Buf {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// A plan with its constants on the host and a thread pool to run it on.
pub struct CpuModel {
    plan: Plan,
    consts: HashMap<usize, Const>,
    /// Constant f32 projection weights transposed to `[k, n]`, by value (the GEMM's layout).
    transposed: HashMap<usize, Vec<f32>>,
    pool: rayon::ThreadPool,
    threads: usize,
    /// Slot buffers, kept from one run to the next (grown when a longer input needs more).
    slots: Mutex<Vec<Buf>>,
    weight_bytes: Vec<(WeightFormat, u64)>,
    int8: bool,
    /// Every step through the interpreter ([`CpuModel::reference`]).
    reference: bool,
    /// Projection weights also held transposed (see [`CpuModel::for_training`]).
    transposes: bool,
    /// The steps that append to a session's cache in place.
    appends: Vec<AppendSite>,
    /// Buffers of outputs given back ([`CpuModel::recycle`]), which the next run's outputs reuse.
    spare: Mutex<Vec<Vec<f32>>>,
    /// Projection weights read in place from a parameter stored `[k, n]`, by value, and the steps
    /// not run for them (see [`kiln_compiler::back::cpu::WeightView`]).
    weight_views: HashMap<usize, WeightView>,
    skipped: HashSet<usize>,
    /// Parameter values whose tensors [`CpuModel::run_lent`] gave back: the model holds none for
    /// them until the next lending or [`CpuModel::update_params`].
    vacated: HashSet<usize>,
    /// How [`CpuModel::run_batched`] runs the plan, or why it cannot; made at its first use.
    batch: OnceLock<Result<crate::batching::BatchPlan, String>>,
    /// Where every run adds each step's time, once [`CpuModel::record_step_times`] asked.
    step_times: Option<Arc<Mutex<StepTimes>>>,
}

/// The host time of each step of a [`CpuModel`]'s plan, summed over the runs since the sums were
/// last cleared ([`CpuModel::record_step_times`]): where a run of many short steps (a decode
/// step's) spends its time, by step.
#[derive(Clone, Debug, Default)]
pub struct StepTimes {
    /// Seconds by step of [`Plan::steps`] (the host clock around the step, its kernel's threads
    /// included; 0 for a step a run skipped).
    pub seconds: Vec<f64>,
    /// Runs summed: [`CpuModel::run_cached`]'s, [`CpuModel::run`]'s and
    /// [`CpuModel::run_batched`]'s (a batched step's once, whatever its sequences).
    pub runs: usize,
}

impl StepTimes {
    /// Forgets the sums so far.
    pub fn clear(&mut self) {
        self.seconds.iter_mut().for_each(|s| *s = 0.0);
        self.runs = 0;
    }
}

/// Where the tokens of a run are: what RoPE rotates by and learned positions count from.
#[derive(Clone, Copy, Debug)]
pub enum Positions<'a> {
    /// Every sequence's tokens follow this many cached ones (one session's step, or a forward
    /// pass from 0).
    From(usize),
    /// Sequence `b`'s tokens follow `starts[b]` cached ones: a batched decode step
    /// ([`CpuModel::run_batched`]), whose sequences are at different positions.
    PerSequence(&'a [usize]),
}

impl Positions<'_> {
    /// The position of token `t` of sequence `b` (`b` within the batch the positions were made
    /// for).
    pub fn at(&self, b: usize, t: usize) -> usize {
        match *self {
            Positions::From(past) => past + t,
            Positions::PerSequence(starts) => {
                debug_assert!(b < starts.len(), "sequence {b} of a batch of {}", starts.len());
                starts.get(b).copied().unwrap_or(0) + t
            }
        }
    }

    /// The start every sequence shares, if they share one.
    pub fn shared(&self) -> Option<usize> {
        match *self {
            Positions::From(past) => Some(past),
            Positions::PerSequence(_) => None,
        }
    }
}

/// Debug builds: the elements a strided matrix access touches lie in a slice of `len`: `rows x
/// cols` elements from `offset`, `row_stride` and `col_stride` apart. The kernels' raw-pointer
/// ranges (the `gemm` crate's operands, SIMD loads) state this bound in their SAFETY comments;
/// this checks it where an out-of-bounds access would otherwise corrupt memory silently.
#[inline(always)]
pub(crate) fn debug_span(what: &str, len: usize, offset: usize, rows: (usize, usize), cols: (usize, usize)) {
    if cfg!(debug_assertions) {
        check_span(what, len, offset, rows, cols);
    }
}

/// [`debug_span`] in every build: for a safe function whose callers' shapes are not otherwise
/// checked (one comparison per call, not per element).
#[inline(always)]
pub(crate) fn check_span(
    what: &str,
    len: usize,
    offset: usize,
    (rows, row_stride): (usize, usize),
    (cols, col_stride): (usize, usize),
) {
    if rows > 0 && cols > 0 {
        let last = (rows - 1).checked_mul(row_stride).and_then(|r| (cols - 1).checked_mul(col_stride).map(|c| (r, c)));
        let end = last.and_then(|(r, c)| offset.checked_add(r)?.checked_add(c));
        assert!(
            end.is_some_and(|e| e < len),
            "{what}: {rows} x {cols} elements from {offset} (strides {row_stride}, {col_stride}) overrun a slice of {len}"
        );
    }
}

/// The threads a model uses by default: one per core the process may run on.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl CpuModel {
    /// Evaluates the plan's folds and keeps the constants its steps read; every weight the plan
    /// stores in a block-quantized format must be in `blocks`, and a gather table whose blocks are
    /// there is read from them (see [`CpuModel::f32_params`]). `threads` (at least 1) is the size
    /// of the pool the kernels run on. The parameters are copied; [`CpuModel::from_owned`] moves
    /// them instead.
    pub fn new(
        plan: Plan,
        params: &HashMap<String, Tensor>,
        blocks: &HashMap<String, QuantWeight>,
        threads: usize,
        progress: &dyn Progress,
    ) -> R<CpuModel> {
        CpuModel::from_owned(plan, params.clone(), blocks.clone(), threads, progress)
    }

    /// [`CpuModel::new`], taking the parameters and blocks: each is moved into the model, not
    /// copied, so a model's weights are in memory once.
    pub fn from_owned(
        plan: Plan,
        params: HashMap<String, Tensor>,
        blocks: HashMap<String, QuantWeight>,
        threads: usize,
        progress: &dyn Progress,
    ) -> R<CpuModel> {
        CpuModel::build(plan, params, blocks, threads, false, progress)
    }

    /// The plan's reference: every step evaluated by the interpreter's definition of its op
    /// ([`interp::eval_op_at`]) on one thread, the weights in the plan's layout (f32 only) — what
    /// `--backend interp` runs for an artifact, and the oracle the native kernels and the wgpu
    /// back end are held to on the same plan.
    pub fn reference(plan: Plan, params: HashMap<String, Tensor>, progress: &dyn Progress) -> R<CpuModel> {
        CpuModel::build(plan, params, HashMap::new(), 1, true, progress)
    }

    /// [`CpuModel::from_owned`] for a model whose parameters change after every run (a training
    /// step's, replaced by [`CpuModel::update_params`]): each weight is held once, in the plan's
    /// layout, and no projection weight is also held transposed (the layout a decode step's
    /// narrow products read fastest; a training step's products over many rows read either as
    /// fast, and the copy would be made again each step and would hold its memory).
    pub fn for_training(
        plan: Plan,
        params: HashMap<String, Tensor>,
        threads: usize,
        progress: &dyn Progress,
    ) -> R<CpuModel> {
        CpuModel::build_with(plan, params, HashMap::new(), threads, false, false, progress)
    }

    fn build(
        plan: Plan,
        params: HashMap<String, Tensor>,
        blocks: HashMap<String, QuantWeight>,
        threads: usize,
        reference: bool,
        progress: &dyn Progress,
    ) -> R<CpuModel> {
        CpuModel::build_with(plan, params, blocks, threads, reference, !reference, progress)
    }

    fn build_with(
        plan: Plan,
        params: HashMap<String, Tensor>,
        blocks: HashMap<String, QuantWeight>,
        threads: usize,
        reference: bool,
        transposes: bool,
        progress: &dyn Progress,
    ) -> R<CpuModel> {
        let threads = threads.max(1);
        if plan.values.iter().any(|v| v.format == WeightFormat::F16) {
            return Err(CpuError::F16Weights);
        }
        plan.check()?;
        let program = cpu::write(&plan);
        let Held { consts, transposed, weight_bytes } = hold(&plan, &program, params, blocks, transposes, progress)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kiln-cpu-{i}"))
            .build()
            .map_err(|source| CpuError::Threads { threads, source })?;
        let appends = if reference { Vec::new() } else { cache::append_sites(&plan) };
        let (weight_views, skipped) = match reference {
            true => (HashMap::new(), HashSet::new()),
            false => (
                program.weight_views.iter().map(|w| (w.value, *w)).collect(),
                program.skipped.iter().copied().collect(),
            ),
        };
        Ok(CpuModel {
            plan,
            consts,
            transposed,
            pool,
            threads,
            slots: Mutex::new(Vec::new()),
            weight_bytes,
            int8: false,
            reference,
            transposes,
            appends,
            spare: Mutex::new(Vec::new()),
            weight_views,
            skipped,
            vacated: HashSet::new(),
            batch: OnceLock::new(),
            step_times: None,
        })
    }

    /// The parameters a [`CpuModel`] of `plan` must be given as f32 tensors, when the parameters
    /// named in `quantized` come as blocks: those the plan reads in f32, except gather tables read
    /// from blocks (an embedding table stored quantized is never expanded to f32).
    pub fn f32_params(plan: &Plan, quantized: &HashSet<String>) -> Vec<String> {
        let tables = gather_tables(plan, &cpu::write(plan), |name, _| quantized.contains(name));
        prepare::f32_params(plan, &tables.into_keys().collect())
    }

    /// Replaces the parameters (and blocks) the model was built with, the folds evaluated again on
    /// them, as [`CpuModel::new`] takes them: the next run computes with these. What a training
    /// loop does after each optimizer step; the plan, the thread pool and the buffers stay.
    pub fn set_params(
        &mut self,
        params: HashMap<String, Tensor>,
        blocks: HashMap<String, QuantWeight>,
        progress: &dyn Progress,
    ) -> R<()> {
        let Held { consts, transposed, weight_bytes } =
            hold(&self.plan, &cpu::write(&self.plan), params, blocks, self.transposes, progress)?;
        (self.consts, self.transposed, self.weight_bytes) = (consts, transposed, weight_bytes);
        Ok(())
    }

    /// [`CpuModel::set_params`] without rebuilding what the parameters do not change: each f32
    /// parameter's values copied over the model's own (in place where the model holds them alone)
    /// and its projections' transposed copies rewritten, on the pool's threads. What a training
    /// step does between optimizer updates. Applies where the plan has no folds (nothing is computed
    /// from the parameters at load time; a training plan's readings of its tensors are steps) and
    /// every parameter is an f32 tensor of the shape the model holds; `Ok(false)` otherwise, and
    /// nothing changed (then [`CpuModel::set_params`] replaces them).
    pub fn update_params(&mut self, params: &HashMap<String, Tensor>) -> R<bool> {
        if !self.plan.folds.is_empty() {
            return Ok(false);
        }
        // Every check before the first write.
        let Some(by_name) = self.held_params(params, false) else { return Ok(false) };
        use rayon::prelude::*;
        let (consts, transposed, vacated) = (&mut self.consts, &mut self.transposed, &mut self.vacated);
        self.pool.install(|| {
            for (name, ids) in &by_name {
                let Some(src) = params.get(name) else { continue };
                let Some(x) = src.as_f32() else { continue };
                // The values' holders share one tensor: take it out of all but one, so it is
                // written in place when nothing else holds it.
                let mut held: Option<Arc<Tensor>> = None;
                for id in ids {
                    if let Some(Const::F32(t)) = consts.remove(id) {
                        held = Some(t);
                    }
                }
                if let Some(mut t) = held {
                    match Arc::get_mut(&mut t).and_then(|t| match &mut t.data {
                        kiln_compiler::tensor::Data::F32(v) if v.len() == x.len() => Some(v),
                        _ => None,
                    }) {
                        Some(v) => {
                            v.par_chunks_mut(1 << 16).zip(x.par_chunks(1 << 16)).for_each(|(v, x)| v.copy_from_slice(x))
                        }
                        None => t = Arc::new(src.clone()),
                    }
                    for id in ids {
                        consts.insert(*id, Const::F32(t.clone()));
                    }
                } else if ids.iter().any(|id| vacated.contains(id)) {
                    let t = Arc::new(src.clone());
                    for id in ids {
                        vacated.remove(id);
                        consts.insert(*id, Const::F32(t.clone()));
                    }
                }
                for id in ids {
                    if let (Some(out), &[n, k]) = (transposed.get_mut(id), src.shape.as_slice()) {
                        elementwise::transpose_tiles(x, out, n, k);
                    }
                }
            }
        });
        Ok(true)
    }

    /// The parameter values of the plan by name, where `params` has each as an f32 tensor of the
    /// shape the model holds (or held, before [`CpuModel::run_lent`] gave it back); `None`
    /// otherwise. Lending (`lend`) also wants every parameter held as given — none transposed,
    /// none left out of the model — where an update skips those the model does not hold.
    fn held_params(&self, params: &HashMap<String, Tensor>, lend: bool) -> Option<BTreeMap<String, Vec<usize>>> {
        let mut by_name: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (id, value) in self.plan.values.iter().enumerate() {
            let Storage::Param(name) = &value.storage else { continue };
            let src = params.get(name).filter(|t| t.as_f32().is_some())?;
            let transposed = self.transposed.contains_key(&id);
            if lend && transposed {
                return None;
            }
            let held_shape = match self.consts.get(&id) {
                Some(Const::F32(t)) => t.shape.clone(),
                Some(Const::Quant(_)) => return None,
                None if transposed || self.vacated.contains(&id) => resolve(&value.shape, &HashMap::new()),
                None if lend => return None,
                None => continue,
            };
            if src.shape != held_shape {
                return None;
            }
            by_name.entry(name.clone()).or_default().push(id);
        }
        Some(by_name)
    }

    /// [`CpuModel::run`] with the parameters of `params` lent to the model for this run instead
    /// of copied into it ([`CpuModel::update_params`]), for a training step, whose parameters
    /// change after every run: each f32 tensor is moved into the model and moved back into
    /// `params` after the run, whatever its outcome, and the model holds no copy of its own
    /// in between. `Ok(None)`, and nothing run or moved, where [`CpuModel::update_params`]
    /// would not apply, or a parameter is held transposed.
    ///
    /// An optimizer's updates in the plan ([`Op::AdamW`], [`Op::Sgd`]: a whole training step's
    /// graph) run in place of the tensors of `params` they update, after the rest of the plan,
    /// in one pass; their outputs are not among those returned.
    pub fn run_lent(
        &mut self,
        params: &mut HashMap<String, Tensor>,
        given: &HashMap<String, Tensor>,
    ) -> R<Option<Vec<(String, Tensor)>>> {
        if !self.plan.folds.is_empty() {
            return Ok(None);
        }
        // Every check before the first move.
        let Some(by_name) = self.held_params(params, true) else { return Ok(None) };
        for (name, ids) in &by_name {
            let Some(t) = params.remove(name) else { continue };
            let t = Arc::new(t);
            for &id in ids {
                self.consts.insert(id, Const::F32(t.clone()));
                self.vacated.remove(&id);
            }
        }
        let outputs = self.execute(given, None, None, true);
        for (name, ids) in by_name {
            let mut held: Option<Arc<Tensor>> = None;
            for id in ids {
                if let Some(Const::F32(t)) = self.consts.remove(&id) {
                    held = Some(t);
                }
                self.vacated.insert(id);
            }
            // The model's holders were dropped just above; a run keeps no other.
            if let Some(t) = held {
                params.insert(name, Arc::try_unwrap(t).unwrap_or_else(|t| (*t).clone()));
            }
        }
        // The updates the run deferred, in place of the tensors given back just above.
        let (outputs, deferred) = outputs?;
        self.run_deferred(params, deferred)?;
        Ok(Some(outputs))
    }

    /// Moves the f32 parameter tensors the model holds back into `params`, by name, the model
    /// holding none of them until [`CpuModel::run_lent`] lends them again: what a trainer does
    /// after building its model from its own tensors, so that they are lent to every run rather
    /// than copied into the model once.
    pub fn give_back(&mut self, params: &mut HashMap<String, Tensor>) {
        let mut held: BTreeMap<String, Arc<Tensor>> = BTreeMap::new();
        for (id, value) in self.plan.values.iter().enumerate() {
            let Storage::Param(name) = &value.storage else { continue };
            // (A quantized one stays: it is not a trainer's tensor.)
            if !matches!(self.consts.get(&id), Some(Const::F32(_))) {
                continue;
            }
            if let Some(Const::F32(t)) = self.consts.remove(&id) {
                held.insert(name.clone(), t);
                self.vacated.insert(id);
            }
        }
        for (name, t) in held {
            params.insert(name, Arc::try_unwrap(t).unwrap_or_else(|t| (*t).clone()));
        }
    }

    /// Quantized projections with activations quantized to 8 bits per block of 32 and integer dot
    /// products (llama.cpp's scheme: faster, but each activation moves by up to half a step of
    /// its block's largest magnitude / 127, enough to flip a greedy choice between two close
    /// logits); off by default, when activations stay f32 and only the weights are quantized.
    /// Q5_0 and the K-quants use them in the integer GEMM only (a prompt's projections, from 8
    /// activation rows, where the CPU has one): below it, a decode step included, their f32 path
    /// is the faster (see `linear::quantized`).
    pub fn with_int8_activations(mut self, on: bool) -> CpuModel {
        self.int8 = on;
        self
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Threads the kernels run on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Bytes of the weights in host memory (parameters and folded constants), by format.
    pub fn weight_bytes(&self) -> &[(WeightFormat, u64)] {
        &self.weight_bytes
    }

    /// Runs one forward pass on named inputs; returns the named outputs.
    pub fn run(&self, given: &HashMap<String, Tensor>) -> R<Vec<(String, Tensor)>> {
        Ok(self.execute(given, None, None, false)?.0)
    }

    /// [`CpuModel::run`] for a session's step: the cached tensors are read from `cache` in place
    /// (never copied into the inputs), and each present named by `links` (`(present output,
    /// past input)`) becomes the cache's past — appended in place where the plan appends it
    /// with a `heads` step (see [`cache`]), replaced otherwise. Returns the other outputs. On an
    /// error the cache is as it was.
    pub fn run_cached(
        &self,
        given: &HashMap<String, Tensor>,
        cache: &mut KvCache,
        links: &[(String, String)],
    ) -> R<Vec<(String, Tensor)>> {
        Ok(self.execute(given, Some((cache, links)), None, false)?.0)
    }

    /// From now on, every run adds the host time of each of its steps to the sums the handle
    /// returned holds (one handle a model: a second call returns the same). For profiling a
    /// workload of many runs, as `kiln bench decode --profile` does; each step then costs a
    /// clock read and an uncontended lock more.
    pub fn record_step_times(&mut self) -> Arc<Mutex<StepTimes>> {
        let steps = self.plan.steps.len();
        self.step_times
            .get_or_insert_with(|| Arc::new(Mutex::new(StepTimes { seconds: vec![0.0; steps], runs: 0 })))
            .clone()
    }

    /// Adds step `i`'s time since `start` to the recorded sums, if they are kept.
    fn note_step(&self, i: usize, start: Option<std::time::Instant>) {
        if let (Some(times), Some(start)) = (&self.step_times, start)
            && let Ok(mut times) = times.lock()
            && let Some(s) = times.seconds.get_mut(i)
        {
            *s += start.elapsed().as_secs_f64();
        }
    }

    /// Counts a run in the recorded sums, if they are kept.
    fn note_run(&self) {
        if let Some(times) = &self.step_times
            && let Ok(mut times) = times.lock()
        {
            times.runs += 1;
        }
    }

    /// Runs one forward pass on `given` and returns the seconds each step of [`Plan::steps`] took
    /// (host clock around the step, its kernel's threads included).
    ///
    /// A training step's optimizer updates are timed as [`CpuModel::run_lent`] runs them — all
    /// in place, in one pass after the other steps — on copies of the tensors they update (made
    /// before the clock starts; `given` is not written), the pass's time shared among the
    /// update steps by their tensors' elements. (Their pure form, which copies each tensor and
    /// its state into a stacked result first, took five times as long for GPT-2 small.)
    pub fn profile(&self, given: &HashMap<String, Tensor>) -> R<Vec<f64>> {
        let plan = &self.plan;
        let mut times = Vec::with_capacity(plan.steps.len());
        let copies = self.update_copies(given);
        let (_, deferred) = self.execute(given, None, Some(&mut times), copies.is_some())?;
        let (Some(mut copies), false) = (copies, deferred.grads.is_empty()) else { return Ok(times) };
        let elements: Vec<(usize, usize)> = deferred.grads.iter().map(|(i, g)| (*i, g.len())).collect();
        let start = std::time::Instant::now();
        self.run_deferred(&mut copies, deferred)?;
        let seconds = start.elapsed().as_secs_f64();
        let total: usize = elements.iter().map(|&(_, n)| n).sum();
        for (i, n) in elements {
            if let Some(t) = times.get_mut(i) {
                *t = seconds * n as f64 / total.max(1) as f64;
            }
        }
        Ok(times)
    }

    /// Copies of the tensors the plan's optimizer updates write (each update's tensor and its
    /// state), by name, from `given` or as the model holds them: what [`CpuModel::profile`]
    /// updates in place. `None` where the plan has no update, or one of them is not held as
    /// f32 elements (a weight held only transposed): the updates are then timed in their pure
    /// form.
    fn update_copies(&self, given: &HashMap<String, Tensor>) -> Option<HashMap<String, Tensor>> {
        let plan = &self.plan;
        let mut copies: HashMap<String, Tensor> = HashMap::new();
        for step in plan.steps.iter().filter(|s| s.op.is_update()) {
            let state = step.operands.len().saturating_sub(4);
            for &v in std::iter::once(step.operands.first()?).chain(step.operands.get(2..2 + state)?) {
                let r = root(plan, v);
                let Storage::Param(name) = &plan.values[r].storage else { return None };
                if copies.contains_key(name) {
                    continue;
                }
                let t = match (given.get(name), self.consts.get(&r)) {
                    (Some(t), _) => t.clone(),
                    (None, Some(Const::F32(t))) => Tensor::clone(t),
                    _ => return None,
                };
                copies.insert(name.clone(), t);
            }
        }
        (!copies.is_empty()).then_some(copies)
    }

    /// Runs the plan. With `defer`, the optimizer's updates (the plan's last steps) are not run:
    /// their outputs are left out of the result, and what each reads besides the tensors it
    /// updates is returned instead, for [`CpuModel::run_lent`] to run them in place.
    fn execute(
        &self,
        given: &HashMap<String, Tensor>,
        session: Option<(&mut KvCache, &[(String, String)])>,
        mut times: Option<&mut Vec<f64>>,
        defer: bool,
    ) -> R<(Outputs, Deferred)> {
        let plan = &self.plan;
        let deferred_steps: Vec<usize> = match defer {
            true => plan.steps.iter().enumerate().filter(|(_, s)| s.op.is_update()).map(|(i, _)| i).collect(),
            false => Vec::new(),
        };
        // The cached tensors this run reads (those not given), and the steps appending in place.
        // (Sites by step, so each step finds its own in one lookup.)
        let (held_shapes, inplace): (HashMap<&str, Vec<usize>>, HashMap<usize, &AppendSite>) = match &session {
            Some((kv, links)) => {
                let linked: HashSet<(&str, &str)> = links.iter().map(|(p, q)| (p.as_str(), q.as_str())).collect();
                (
                    kv.iter().filter(|(n, _)| !given.contains_key(*n)).map(|(n, c)| (n.as_str(), c.shape())).collect(),
                    self.appends
                        .iter()
                        .filter(|a| !given.contains_key(&a.past))
                        .filter(|a| linked.contains(&(a.present.as_str(), a.past.as_str())))
                        .map(|a| (a.step, a))
                        .collect(),
                )
            }
            None => (HashMap::new(), HashMap::new()),
        };
        let bound = prepare::bind(plan, given, &held_shapes)?;
        let mut inputs: HashMap<usize, Cow<'_, Tensor>> = HashMap::new();
        // Inputs read from the cache: value -> past name.
        let mut held: HashMap<usize, String> = HashMap::new();
        for ((id, tensor), name) in bound.inputs.into_iter().zip(&bound.names) {
            match tensor {
                Some(t) => drop(inputs.insert(id, Cow::Owned(t))),
                None if held_shapes.contains_key(name.as_str()) => drop(held.insert(id, name.clone())),
                None => return Err(CpuError::MissingInput(name.clone())),
            }
        }
        let syms = bound.syms;
        let by_value: HashMap<usize, &Tensor> = inputs.iter().map(|(&id, t)| (id, t.as_ref())).collect();
        prepare::check_indices(plan, &by_value, &syms)?;
        let past = syms.get(&Sym::Past).copied().unwrap_or(0);

        let mut state = self.slots.lock().map_err(|_| CpuError::Poisoned)?;
        // The buffers move into the pool's closure (a lock guard cannot) and back after it.
        let mut slots = std::mem::take(&mut *state);
        if slots.len() < plan.slots {
            slots.resize_with(plan.slots, || Buf::F32(Vec::new()));
        }
        let (mut empty, no_links) = (KvCache::new(), Vec::new());
        let (kv, links): (&mut KvCache, &[(String, String)]) = match session {
            Some((kv, links)) => (kv, links),
            None => (&mut empty, &no_links),
        };
        let none = KvCache::new();
        // Buffers this run creates (removed again on an error), and the rows each appended one
        // holds once the run succeeds.
        let mut created: Vec<String> = Vec::new();
        let mut appended: HashMap<String, usize> = HashMap::new();
        // Values that are a cache buffer (a held past, or a present appended in place).
        let mut views = held.clone();
        // The steps in order, the other workers polling for each kernel's jobs between them.
        let run = poll::polling(&self.pool, || -> R<()> {
            for (i, step) in plan.steps.iter().enumerate() {
                let start = std::time::Instant::now();
                if let Some(site) = inplace.get(&i) {
                    let x = self.arg(step.operands[1], &inputs, &slots, &syms, &views, &none)?;
                    let x = (x.0, x.1.f32("x").map_err(|e| scoped(e, &step.scope, &step.op))?);
                    if !kv.contains_key(&site.past) {
                        let (b, heads, d) = match (&step.op, x.0.first()) {
                            (Op::Heads { heads, head_dim, .. }, Some(&b)) => (b, *heads, *head_dim),
                            _ => return Err(CpuError::Internal(format!("`{}`: not a heads step", step.scope))),
                        };
                        kv.insert(site.past.clone(), CacheBuf::empty(b, heads, d));
                        created.push(site.past.clone());
                    }
                    let gain = match step.operands.get(2) {
                        Some(&g) => Some(
                            self.arg(g, &inputs, &slots, &syms, &views, &none)?
                                .1
                                .f32("the gain")
                                .map_err(|e| scoped(e, &step.scope, &step.op))?,
                        ),
                        None => None,
                    };
                    let buf = kv.get_mut(&site.past).ok_or_else(|| CpuError::Cache("the cache vanished".into()))?;
                    let rows = elementwise::append_heads(&step.op, &x.0, x.1, gain, past, buf)
                        .map_err(|e| scoped(e, &step.scope, &step.op))?;
                    appended.insert(site.past.clone(), rows);
                    views.insert(root(plan, step.output), site.past.clone());
                } else if !self.skipped.contains(&i) && !deferred_steps.contains(&i) {
                    self.step(step, &inputs, &mut slots, &syms, &views, kv, Positions::From(past))?;
                }
                if let Some(t) = times.as_deref_mut() {
                    t.push(start.elapsed().as_secs_f64());
                }
                self.note_step(i, Some(start));
            }
            Ok(())
        });
        self.note_run();
        let presents: HashMap<&str, &str> =
            links.iter().map(|(present, past)| (present.as_str(), past.as_str())).collect();
        // Slots that hold exactly one output's value: the output takes the slot's buffer itself
        // (the run is over), and the slot a given-back buffer, rather than a copy of it.
        let mut readers: HashMap<usize, usize> = HashMap::new();
        for (_, v) in &plan.outputs {
            if let Storage::Slot(s) = plan.values[root(plan, *v)].storage {
                *readers.entry(s).or_default() += 1;
            }
        }
        let outputs = run.and_then(|()| {
            let deferred = self.deferred(&deferred_steps, &inputs, &mut slots, &syms, &views, kv)?;
            let skipped: HashSet<usize> = deferred_steps.iter().map(|&i| plan.steps[i].output).collect();
            let mut outputs = Vec::new();
            let mut replaced = Vec::new();
            for (name, v) in &plan.outputs {
                if skipped.contains(&root(plan, *v)) {
                    continue; // A deferred update's.
                }
                let shape = resolve(&plan.values[*v].shape, &syms);
                let past_name = presents.get(name.as_str());
                if past_name.is_some_and(|p| appended.contains_key(*p)) {
                    continue; // Already in the cache.
                }
                let r = root(plan, *v);
                let taken = match plan.values[r].storage {
                    Storage::Slot(s) if readers.get(&s) == Some(&1) && !views.contains_key(&r) => {
                        self.take_slot(&mut slots, s, shape.iter().product())
                    }
                    _ => None,
                };
                let t = match taken {
                    Some(data) => Tensor::f32(shape, data),
                    None => match self.arg(*v, &inputs, &slots, &syms, &views, kv)?.1 {
                        Arg::F32(x) => Tensor::f32(shape, self.output_buffer(x)),
                        Arg::I64(x) => Tensor::i64(shape, x.to_vec()),
                        Arg::Quant(q) => q.dequantize(),
                        Arg::Cache { data, cap } => {
                            let heads = shape.first().copied().unwrap_or(1) * shape.get(1).copied().unwrap_or(1);
                            let (rows, d) = (shape.get(2).copied().unwrap_or(0), shape.get(3).copied().unwrap_or(0));
                            Tensor::f32(shape, cache::contiguous(data, heads, rows, cap, d))
                        }
                        Arg::Transposed { .. } => {
                            return Err(CpuError::Internal("an output is a weight".into()));
                        }
                    },
                };
                match past_name {
                    Some(p) => replaced.push((p.to_string(), t)),
                    None => outputs.push((name.clone(), t)),
                }
            }
            if let Some((present, _)) = presents.iter().find(|(present, past)| {
                !appended.contains_key(**past)
                    && !replaced.iter().any(|(p, _)| p == *past)
                    && !plan.outputs.iter().any(|(n, _)| n == *present)
            }) {
                return Err(CpuError::Cache(format!("the step did not produce `{present}`")));
            }
            Ok((outputs, replaced, deferred))
        });
        *state = slots;
        match outputs {
            Ok((outputs, replaced, deferred)) => {
                for (past_name, rows) in appended {
                    if let Some(buf) = kv.get_mut(&past_name) {
                        buf.set_len(rows);
                    }
                }
                for (past_name, t) in replaced {
                    let buf = CacheBuf::from_tensor(t).ok_or_else(|| {
                        CpuError::Cache(format!("`{past_name}` is not an f32 [b, heads, len, d] tensor"))
                    })?;
                    kv.insert(past_name, buf);
                }
                Ok((outputs, deferred))
            }
            Err(e) => {
                for name in created {
                    kv.remove(&name);
                }
                Err(e)
            }
        }
    }

    /// Gives back outputs of an earlier run the caller is done with: the next runs' outputs of the
    /// same sizes are written into their buffers rather than into new ones (a training step's
    /// gradients, hundreds of megabytes a step for a large model, would otherwise be fresh pages
    /// the system zeroes every step).
    pub fn recycle(&self, tensors: impl IntoIterator<Item = Tensor>) {
        // No more than one run's outputs are kept.
        let f32s = tensors.into_iter().filter_map(|t| match t.data {
            Data::F32(v) => Some(v),
            Data::I64(_) => None,
        });
        self.keep_spare(f32s, self.plan.outputs.len());
    }

    /// What the updates `steps` (deferred by a run, see [`CpuModel::execute`]) read besides the
    /// tensors they update, after the run's other steps: each gradient's elements — the slot's own
    /// buffer where nothing else reads it ([`CpuModel::take_slot`]), else a copy — and the
    /// clipping factor and constants.
    fn deferred(
        &self,
        steps: &[usize],
        inputs: &HashMap<usize, Cow<'_, Tensor>>,
        slots: &mut [Buf],
        syms: &HashMap<Sym, usize>,
        views: &HashMap<usize, String>,
        kv: &KvCache,
    ) -> R<Deferred> {
        let Some(&first) = steps.first() else { return Ok(Deferred::default()) };
        let plan = &self.plan;
        let malformed = |i: usize| CpuError::Internal(format!("step {i}: an update with too few operands"));
        let copy = |v: usize, slots: &[Buf]| -> R<Vec<f32>> {
            Ok(self.arg(v, inputs, slots, syms, views, kv)?.1.f32("an update's operand")?.to_vec())
        };
        // The factor and the constants, the last two operands of every update (one value each).
        let shared = |i: usize| -> R<[usize; 2]> {
            match plan.steps[i].operands.as_slice() {
                [_, _, .., scale, constants] => Ok([*scale, *constants]),
                _ => Err(malformed(i)),
            }
        };
        let [scale, constants] = shared(first)?;
        let mut out = Deferred {
            scale: copy(scale, slots)?.first().copied().ok_or_else(|| malformed(first))?,
            constants: copy(constants, slots)?,
            grads: Vec::with_capacity(steps.len()),
        };
        let mut readers: HashMap<usize, usize> = HashMap::new();
        for &i in steps {
            if shared(i)? != [scale, constants] {
                return Err(CpuError::Internal(format!("step {i}: an update of another step's clipping or constants")));
            }
            *readers.entry(root(plan, plan.steps[i].operands[1])).or_default() += 1;
        }
        for (_, v) in &plan.outputs {
            *readers.entry(root(plan, *v)).or_default() += 1;
        }
        for &i in steps {
            let g = plan.steps[i].operands[1];
            let r = root(plan, g);
            let n: usize = resolve(&plan.values[g].shape, syms).iter().product();
            let (taken, room) = match plan.values[r].storage {
                Storage::Slot(s) if readers.get(&r) == Some(&1) && !views.contains_key(&r) => {
                    let room = match slots.get(s) {
                        Some(Buf::F32(held)) => held.len(),
                        _ => n,
                    };
                    // A gradient under half its slot (a bias's, in a slot it shares with
                    // activations) is copied instead: taking the slot would give the slot a
                    // buffer zero-filled past a small gradient's length every step (GPT-2
                    // small: ~30 slots of 6 MB for gradients of 3 KB, 37 ms a step).
                    match 2 * n >= room {
                        true => (self.take_slot(slots, s, n), room),
                        false => (None, n),
                    }
                }
                _ => (None, n),
            };
            let grad = match taken {
                Some(g) => g,
                None => {
                    let x = self.arg(g, inputs, slots, syms, views, kv)?.1.f32("an update's operand")?;
                    self.spare_copy(x, room)
                }
            };
            out.grads.push((i, grad));
        }
        Ok(out)
    }

    /// Runs the updates a run deferred ([`CpuModel::execute`]) in place of the tensors of
    /// `params` they update, all in one pass ([`training::update_in_place`]); the gradients'
    /// buffers are given back for the next run. Nothing is written where the step's clipping
    /// factor is NaN (its loss or global norm not finite: the update's meaning).
    fn run_deferred(&self, params: &mut HashMap<String, Tensor>, deferred: Deferred) -> R<()> {
        if deferred.grads.is_empty() {
            return Ok(());
        }
        let plan = &self.plan;
        // Each update's tensors (the one it updates, then its state), taken out of `params` for
        // the pass and put back after it.
        let mut held: Vec<Vec<(String, Tensor)>> = Vec::with_capacity(deferred.grads.len());
        let mut result = Ok(());
        for &(i, _) in &deferred.grads {
            let step = &plan.steps[i];
            let state = step.operands.len().saturating_sub(4);
            let mut tensors = Vec::with_capacity(1 + state);
            for &v in std::iter::once(&step.operands[0]).chain(&step.operands[2..2 + state]) {
                let taken = match &plan.values[root(plan, v)].storage {
                    Storage::Param(name) => params.remove(name).map(|t| (name.clone(), t)),
                    _ => None,
                };
                match taken {
                    Some(t) => tensors.push(t),
                    None => {
                        let what = format!("`{}`: an update reads a tensor not lent to the run", step.scope);
                        result = Err(CpuError::Internal(what));
                    }
                }
            }
            held.push(tensors);
        }
        if result.is_ok() {
            let mut updates = Vec::with_capacity(deferred.grads.len());
            for ((i, grad), tensors) in deferred.grads.iter().zip(held.iter_mut()) {
                let mut parts = tensors.iter_mut().map(|(_, t)| match &mut t.data {
                    Data::F32(v) => Some(v.as_mut_slice()),
                    Data::I64(_) => None,
                });
                let p = parts.next().flatten();
                let state: Option<Vec<&mut [f32]>> = parts.collect();
                match (p, state) {
                    (Some(p), Some(state)) => {
                        updates.push(training::InPlace { op: &plan.steps[*i].op, p, state, g: grad })
                    }
                    _ => result = Err(CpuError::Operands("an update's tensors must be f32".into())),
                }
            }
            if result.is_ok() {
                let (scale, constants) = (deferred.scale, &deferred.constants);
                result = self.pool.install(|| training::update_in_place(updates, scale, constants)).map(drop);
            }
        }
        for (name, t) in held.into_iter().flatten() {
            params.insert(name, t);
        }
        // The next run's gradients take these buffers' places in their slots.
        let keep = self.plan.outputs.len().max(deferred.grads.len());
        self.keep_spare(deferred.grads.into_iter().map(|(_, g)| g), keep);
        result
    }

    /// Gives `buffers` back for the next runs' outputs and slots ([`CpuModel::take_slot`]),
    /// keeping at most `keep` given back: the latest (the oldest go first).
    fn keep_spare(&self, buffers: impl IntoIterator<Item = Vec<f32>>, keep: usize) {
        let Ok(mut spare) = self.spare.lock() else { return };
        spare.extend(buffers);
        let excess = spare.len().saturating_sub(keep);
        spare.drain(..excess);
    }

    /// The f32 buffer of slot `s` as an output of `len` elements, the slot given a buffer given
    /// back by [`CpuModel::recycle`] in its place (made as long as the slot was, so the next run
    /// finds it grown); `None` if the slot holds no f32 data of that length or no buffer given
    /// back fits.
    fn take_slot(&self, slots: &mut [Buf], s: usize, len: usize) -> Option<Vec<f32>> {
        let Some(Buf::F32(held)) = slots.get(s) else { return None };
        if held.len() < len {
            return None;
        }
        let room = held.len();
        // Without a given-back buffer the value is copied (the first run's outputs): the slot
        // keeps its buffer rather than growing a new one on the next run.
        let mut fresh = self.take_spare(room)?;
        // Only the part past the spare's length is written (none where it held a value of this
        // slot's length before).
        fresh.resize(room, 0.0);
        let Some(Buf::F32(held)) = slots.get_mut(s).map(|b| std::mem::replace(b, Buf::F32(fresh))) else {
            return None;
        };
        let mut out = held;
        out.truncate(len);
        Some(out)
    }

    /// The smallest given-back buffer with room for `room` elements (so that a large slot finds a
    /// large buffer after it), taken out of those kept; `None` if none has.
    fn take_spare(&self, room: usize) -> Option<Vec<f32>> {
        let mut spare = self.spare.lock().ok()?;
        let (at, _) =
            spare.iter().enumerate().filter(|(_, v)| v.capacity() >= room).min_by_key(|(_, v)| v.capacity())?;
        Some(spare.swap_remove(at))
    }

    /// `x` copied into a given-back buffer with room for `room` elements ([`CpuModel::take_spare`]),
    /// or a new buffer with that room. A gradient copied out of its slot so (the first run's, or
    /// one whose slot is larger than it, which no given-back buffer replaced) can take the slot's
    /// place on the next run ([`CpuModel::take_slot`]), and the copy reuses memory already paged
    /// in: a new buffer each step was paged in afresh every step (GPT-2 small's training step
    /// spent ~9% of its time so).
    fn spare_copy(&self, x: &[f32], room: usize) -> Vec<f32> {
        let room = room.max(x.len());
        let mut v = self.take_spare(room).unwrap_or_else(|| Vec::with_capacity(room));
        v.clear();
        v.extend_from_slice(x);
        v
    }

    /// `x` copied into a given-back buffer of its length, or a new one.
    fn output_buffer(&self, x: &[f32]) -> Vec<f32> {
        let reused = self.spare.lock().ok().and_then(|mut spare| {
            let at = spare.iter().position(|v| v.len() == x.len())?;
            Some(spare.swap_remove(at))
        });
        match reused {
            Some(mut v) => {
                v.copy_from_slice(x);
                v
            }
            None => x.to_vec(),
        }
    }

    /// Runs one step into its slot.
    #[expect(clippy::too_many_arguments, reason = "the run's state, borrowed apart")]
    fn step(
        &self,
        step: &kiln_compiler::lower::Step,
        inputs: &HashMap<usize, Cow<'_, Tensor>>,
        slots: &mut [Buf],
        syms: &HashMap<Sym, usize>,
        views: &HashMap<usize, String>,
        kv: &KvCache,
        positions: Positions<'_>,
    ) -> R<()> {
        let plan = &self.plan;
        let out_shape = resolve(&plan.values[step.output].shape, syms);
        let n: usize = out_shape.iter().product();
        let Storage::Slot(s) = plan.values[step.output].storage else {
            return Err(CpuError::Internal(format!("`{}`: a step writes a value that is not in a slot", step.scope)));
        };
        kiln_compiler::memory::check(|| format!("`{}`: a {} result", step.scope, step.op.name()), 4 * n as u64)?;
        let mut out = std::mem::replace(&mut slots[s], Buf::F32(Vec::new()));
        let result = {
            // A projection reads its constant f32 weight in the layout of the load, and a
            // projection or a product a weight view in place.
            let args: Vec<(Vec<usize>, Arg<'_>)> = step
                .operands
                .iter()
                .enumerate()
                .map(|(i, &o)| match cpu::reads_as_weight(&step.op, i).then(|| self.weight(o)).flatten() {
                    Some(w) => Ok((resolve(&plan.values[o].shape, syms), w?)),
                    None => self.arg(o, inputs, slots, syms, views, kv),
                })
                .collect::<R<_>>()?;
            let copies = cache_copies(&step.op, &args);
            let args = read_copies(args, &copies);
            let dtype = plan.values[step.output].dtype;
            self.exec(&step.op, &args, &mut out, dtype, &out_shape, positions)
                .map_err(|e| scoped(e, &step.scope, &step.op))
        };
        slots[s] = out;
        result
    }

    /// Projection weight `v` in a layout of this back end's, transposed (`[k, n]`): held so at
    /// load, or a [`WeightView`] of a parameter stored so; `None` where it is read as the plan
    /// has it.
    fn weight(&self, v: usize) -> Option<R<Arg<'_>>> {
        let r = root(&self.plan, v);
        if let Some(t) = self.transposed.get(&r) {
            let n = self.plan.values[r].shape.first().and_then(|d| match d {
                kiln_compiler::graph::Dim::Fixed(n) => Some(*n),
                _ => None,
            });
            return Some(
                n.map(|ld| Arg::Transposed { data: t, ld })
                    .ok_or_else(|| CpuError::Internal(format!("the transposed weight {r} has no fixed row count"))),
            );
        }
        let view = self.weight_views.get(&r)?;
        let missing = || CpuError::Internal(format!("the parameter of weight {r} is not held"));
        Some(match self.consts.get(&view.param) {
            Some(Const::F32(t)) => t
                .as_f32()
                .and_then(|x| x.get(view.start..))
                .map(|data| Arg::Transposed { data, ld: view.cols })
                .ok_or_else(missing),
            _ => Err(missing()),
        })
    }

    /// Value `v` as an operand: its shape at these symbol values and its elements (a value in
    /// `views` is that cache buffer of `kv`, as many rows as its shape says).
    fn arg<'a>(
        &'a self,
        v: usize,
        inputs: &'a HashMap<usize, Cow<'_, Tensor>>,
        slots: &'a [Buf],
        syms: &HashMap<Sym, usize>,
        views: &HashMap<usize, String>,
        kv: &'a KvCache,
    ) -> R<(Vec<usize>, Arg<'a>)> {
        let shape = resolve(&self.plan.values[v].shape, syms);
        let n: usize = shape.iter().product();
        let r = root(&self.plan, v);
        if let Some(name) = views.get(&r) {
            let buf = kv.get(name).ok_or_else(|| CpuError::Cache(format!("the cache holds no `{name}`")))?;
            let rows = shape.get(2).copied().unwrap_or(0);
            if shape.len() != 4 || rows > buf.room() || shape[..2] != buf.shape()[..2] {
                return Err(CpuError::Cache(format!("`{name}` {:?} is not a view of {:?}", shape, buf.shape())));
            }
            let arg = if rows == buf.capacity() && buf.room() == rows {
                Arg::F32(buf.data().get(..n).ok_or_else(|| CpuError::Cache("a short cache".into()))?)
            } else {
                Arg::Cache { data: buf.data(), cap: buf.capacity() }
            };
            return Ok((shape, arg));
        }
        let missing = || CpuError::Internal(format!("value {v} has no data"));
        let tensor = |t: &'a Tensor| -> R<Arg<'a>> {
            match &t.data {
                Data::F32(x) => x.get(..n).map(Arg::F32),
                Data::I64(x) => x.get(..n).map(Arg::I64),
            }
            .ok_or_else(missing)
        };
        let arg = match &self.plan.values[r].storage {
            Storage::Param(_) | Storage::Const => match self.consts.get(&r).ok_or_else(missing)? {
                Const::F32(t) => tensor(t)?,
                Const::Quant(q) => Arg::Quant(q),
            },
            Storage::Input { .. } => tensor(inputs.get(&r).ok_or_else(missing)?)?,
            Storage::Slot(s) => match slots.get(*s).ok_or_else(missing)? {
                Buf::F32(x) => Arg::F32(x.get(..n).ok_or_else(missing)?),
                Buf::I64(x) => Arg::I64(x.get(..n).ok_or_else(missing)?),
            },
            Storage::Alias(_) => return Err(missing()),
        };
        Ok((shape, arg))
    }

    /// Runs one op into `out` (resized to the output's elements).
    fn exec(
        &self,
        op: &Op,
        args: &[(Vec<usize>, Arg<'_>)],
        out: &mut Buf,
        dtype: DType,
        shape: &[usize],
        positions: Positions<'_>,
    ) -> R<()> {
        let mut lazy = LazyOut { out, n: shape.iter().product() };
        if dtype == DType::F32 && !self.reference {
            match op {
                Op::Linear { .. } => {
                    return linear::forward(op, args, lazy.get(), shape, positions, self.threads, self.int8);
                }
                Op::Attention { .. } | Op::PackedAttention(_) => {
                    return attention::forward(op, args, lazy.get(), shape);
                }
                Op::AttentionGrad { .. } => return attention::backward(op, args, lazy.get(), shape),
                Op::LowRank { .. } => return attention::low_rank(op, args, lazy.get(), shape),
                _ => {
                    if elementwise::forward(op, args, &mut lazy, shape, positions)?
                        || training::forward(op, args, &mut lazy, self.threads)?
                    {
                        return Ok(());
                    }
                }
            }
        }
        let out = lazy.out;
        // No native kernel: the interpreter's evaluation, on copies of the operands.
        let tensors: Vec<Tensor> = args
            .iter()
            .map(|(s, a)| match a {
                Arg::F32(x) => Ok(Tensor::f32(s.clone(), x.to_vec())),
                Arg::I64(x) => Ok(Tensor::i64(s.clone(), x.to_vec())),
                Arg::Quant(q) => Ok(q.dequantize()),
                Arg::Transposed { .. } => Err(CpuError::Internal(format!("{} read a transposed weight", op.name()))),
                Arg::Cache { data, cap } => match s.as_slice() {
                    &[b, h, rows, d] => Ok(Tensor::f32(s.clone(), cache::contiguous(data, b * h, rows, *cap, d))),
                    _ => Err(CpuError::Internal(format!("a cache read as {s:?}"))),
                },
            })
            .collect::<R<_>>()?;
        let refs: Vec<&Tensor> = tensors.iter().collect();
        // The interpreter's ops know one start for the whole run; a batched run gives an op that
        // reads positions per-sequence starts only where its kernel takes them (`batch`).
        let past = match positions.shared() {
            Some(past) => past,
            None if !crate::batching::positional(op) => 0,
            None => {
                return Err(CpuError::Internal(format!("{} has no kernel taking a position per sequence", op.name())));
            }
        };
        let t = interp::eval_op_at(op, &refs, shape.to_vec(), past)?;
        *out = match t.data {
            Data::F32(v) => Buf::F32(v),
            Data::I64(v) => Buf::I64(v),
        };
        Ok(())
    }
}

/// Contiguous copies of the caches among `op`'s operands that its kernel reads whole: only
/// attention reads a cache through its strides, every other op (an append's concatenation, the
/// interpreter's) a copy. `None` where the operand is read as it is.
fn cache_copies(op: &Op, args: &[(Vec<usize>, Arg<'_>)]) -> Vec<Option<Vec<f32>>> {
    let attention = matches!(op, Op::Attention { .. } | Op::PackedAttention(PackedAttention { cached: true, .. }));
    args.iter()
        .map(|(shape, a)| match (a, shape.as_slice()) {
            (Arg::Cache { data, cap }, &[b, h, rows, d]) if !attention => {
                Some(cache::contiguous(data, b * h, rows, *cap, d))
            }
            _ => None,
        })
        .collect()
}

/// `args` with each operand [`cache_copies`] copied read from its copy.
fn read_copies<'a>(args: Vec<(Vec<usize>, Arg<'a>)>, copies: &'a [Option<Vec<f32>>]) -> Vec<(Vec<usize>, Arg<'a>)> {
    args.into_iter().zip(copies).map(|((shape, a), copy)| (shape, copy.as_deref().map_or(a, Arg::F32))).collect()
}

/// A step's output buffer, made an f32 one of the result's length only when a native kernel
/// takes the op (see [`elementwise::forward`]).
pub struct LazyOut<'a> {
    out: &'a mut Buf,
    n: usize,
}

impl LazyOut<'_> {
    /// The output's elements: the first `n` of the step's buffer, grown (with zeros) only where
    /// it is shorter. A buffer is never shortened, so a slot that holds values of several sizes
    /// in turn is not filled with zeros again each time a larger one comes back (readers take
    /// their value's length from its shape); a kernel writes every element it returns.
    pub fn get(&mut self) -> &mut [f32] {
        if !matches!(self.out, Buf::F32(_)) {
            *self.out = Buf::F32(Vec::new());
        }
        match self.out {
            Buf::F32(v) => {
                if v.len() < self.n {
                    v.resize(self.n, 0.0);
                }
                &mut v[..self.n]
            }
            Buf::I64(_) => unreachable!("made f32 just above"),
        }
    }
}

/// An error of a step, with the step named.
fn scoped(e: CpuError, scope: &str, op: &Op) -> CpuError {
    match e {
        e @ (CpuError::Interp(_) | CpuError::Memory(_)) => e,
        e => CpuError::Step { scope: scope.to_string(), op: op.name(), error: Box::new(e) },
    }
}

/// A plan's constants as a [`CpuModel`] holds them.
struct Held {
    consts: HashMap<usize, Const>,
    transposed: HashMap<usize, Vec<f32>>,
    weight_bytes: Vec<(WeightFormat, u64)>,
}

/// Evaluates `plan`'s folds on `params` and `blocks` and lays its constants out as the kernels
/// read them (see [`CpuModel::new`]); with `transposes`, each projection weight also (or only)
/// transposed, else in the plan's layout only. `program` is the CPU writer's layout of `plan`.
fn hold(
    plan: &Plan,
    program: &Program,
    mut params: HashMap<String, Tensor>,
    mut blocks: HashMap<String, QuantWeight>,
    transposes: bool,
    progress: &dyn Progress,
) -> R<Held> {
    let tables = gather_tables(plan, program, |name, shape| blocks.get(name).is_some_and(|q| [q.rows, q.k] == shape));
    let provided: HashSet<usize> = tables.keys().copied().collect();
    // Constants by value: folds own their results; parameters are named, and moved out of
    // `params` / `blocks` once the borrows end.
    let mut consts: HashMap<usize, Const> = HashMap::new();
    let mut host_params: Vec<(usize, String)> = Vec::new();
    let mut quant_params: Vec<(usize, String)> = Vec::new();
    {
        let prepare::Constants { host, quant } =
            prepare::constants_except(plan, &params, &blocks, &provided, progress)?;
        let name = |id: usize| match &plan.values[id].storage {
            Storage::Param(name) => Some(name.clone()),
            _ => None,
        };
        for (id, t) in host {
            match (t, name(id)) {
                (Cow::Borrowed(_), Some(n)) => host_params.push((id, n)),
                (t, _) => drop(consts.insert(id, Const::F32(Arc::new(t.into_owned())))),
            }
        }
        for (id, q) in quant {
            match (q, name(id)) {
                (Cow::Borrowed(_), Some(n)) => quant_params.push((id, n)),
                (q, _) => drop(consts.insert(id, Const::Quant(Arc::new(q.into_owned())))),
            }
        }
    }
    quant_params.extend(tables);
    for (id, t) in move_shared(host_params, &mut params, |n| InterpError::MissingParam(n).into())? {
        consts.insert(id, Const::F32(t));
    }
    let missing = CpuError::MissingBlocks;
    for (id, q) in move_shared(quant_params, &mut blocks, missing)? {
        consts.insert(id, Const::Quant(q));
    }
    drop((params, blocks));
    let transposed = if transposes { transpose_weights(program, &mut consts)? } else { HashMap::new() };
    let mut weight_bytes: Vec<(WeightFormat, u64)> = Vec::new();
    let mut counted: HashSet<usize> = HashSet::new();
    for c in consts.values() {
        let (format, bytes, at) = match c {
            Const::F32(t) => (WeightFormat::F32, 4 * t.len() as u64, Arc::as_ptr(t) as usize),
            Const::Quant(q) => (q.format, q.bytes(), Arc::as_ptr(q) as usize),
        };
        if !counted.insert(at) {
            continue;
        }
        match weight_bytes.iter_mut().find(|(f, _)| *f == format) {
            Some((_, b)) => *b += bytes,
            None => weight_bytes.push((format, bytes)),
        }
    }
    let transposed_bytes: u64 = transposed.values().map(|t| 4 * t.len() as u64).sum();
    if transposed_bytes > 0 {
        match weight_bytes.iter_mut().find(|(f, _)| *f == WeightFormat::F32) {
            Some((_, b)) => *b += transposed_bytes,
            None => weight_bytes.push((WeightFormat::F32, transposed_bytes)),
        }
    }
    weight_bytes.sort_by_key(|(f, _)| *f as u8);
    Ok(Held { consts, transposed, weight_bytes })
}

/// The projection weights of `program` held transposed to `[k, n]`, the layout the GEMM reads
/// fastest, by value (each that is an f32 constant), each dropped from `consts` so that it is held
/// once, transposed. One also read otherwise (an embedding table tied to the output projection)
/// stays in `consts` only, in the plan's layout, which its projection reads too: a tied table is
/// held once, as a checkpoint stores it.
fn transpose_weights(program: &Program, consts: &mut HashMap<usize, Const>) -> R<HashMap<usize, Vec<f32>>> {
    let mut transposed = HashMap::new();
    for &Weight { value: w, also_read } in &program.weights {
        if also_read {
            continue;
        }
        let Some(Const::F32(t)) = consts.get(&w) else { continue };
        let (&[n, k], Some(x)) = (t.shape.as_slice(), t.as_f32()) else { continue };
        kiln_compiler::memory::check(
            || format!("the transpose of a [{n}, {k}] projection weight"),
            4 * (n * k) as u64,
        )?;
        let mut out = vec![0.0f32; n * k];
        for (r, row) in x.chunks_exact(k.max(1)).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                out[c * n + r] = v;
            }
        }
        transposed.insert(w, out);
        consts.remove(&w);
    }
    Ok(transposed)
}

/// The gather tables read from blocks: the tables of `program` (f32 parameters read only by
/// gathers) for which `has_blocks(name, shape)` says blocks are given, by value, with their names.
fn gather_tables(
    plan: &Plan,
    program: &Program,
    has_blocks: impl Fn(&str, &[usize]) -> bool,
) -> HashMap<usize, String> {
    program
        .gather_tables
        .iter()
        .filter_map(|&id| match &plan.values[id].storage {
            Storage::Param(n) => {
                let shape = resolve(&plan.values[id].shape, &HashMap::new());
                has_blocks(n, &shape).then(|| (id, n.clone()))
            }
            _ => None,
        })
        .collect()
}

/// Moves each named weight out of `source` into an `Arc`, shared by every value that reads the
/// same name; a name `source` lacks is `missing`.
fn move_shared<T>(
    pending: Vec<(usize, String)>,
    source: &mut HashMap<String, T>,
    missing: impl Fn(String) -> CpuError,
) -> R<Vec<(usize, Arc<T>)>> {
    let mut moved: HashMap<String, Arc<T>> = HashMap::new();
    pending
        .into_iter()
        .map(|(id, name)| {
            if let Some(t) = moved.get(&name) {
                return Ok((id, t.clone()));
            }
            let t = Arc::new(source.remove(&name).ok_or_else(|| missing(name.clone()))?);
            moved.insert(name, t.clone());
            Ok((id, t))
        })
        .collect()
}
