//! [`Trainer`]: a model's training graph on a device, its tensors and its optimizer, one step at
//! a time.
//!
//! A step is: the learning rate of the step from the schedule; the loss and gradients of each
//! micro-batch ([`StepRunner`]), averaged weighted by the positions each counts
//! ([`GradAccumulator`]); the global gradient norm, and clipping ([`clip_grad_norm`]); the
//! optimizer's update of every trained tensor. The tensors are a checkpoint's (see
//! [`kiln_compiler::train::sources`]), so what is trained is written back under the names it was
//! read from, and the frozen ones are never touched.

use super::optim::{GradAccumulator, OptimError, Optimizer, Update, clip_grad_norm};
use super::recipe::{Recipe, glob_match};
use super::run::{RunError, StepOutput, StepRunner};
use crate::device::Device;
use crate::gpu::{DeviceOptimizer, GpuError};
use kiln_compiler::autodiff::Block;
use kiln_compiler::graph::Graph;
use kiln_compiler::spec::{PackDims, WeightMap};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::recompute::{StepGraph, step_graph};
use kiln_compiler::train::update::{self, with_update};
use kiln_compiler::train::{IGNORE_INDEX, LABELS, Objective, TensorUse, TrainGraphError, loss_graph, on_tensors};
use std::collections::{BTreeSet, HashMap};

/// What can go wrong training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The training graph could not be built (an op without a gradient rule, no logits, ...).
    #[error(transparent)]
    Graph(#[from] TrainGraphError),
    /// A step could not run. (The cause is the error's source, which a report prints after it.)
    #[error("step {step}")]
    Run {
        /// The step (from 0).
        step: usize,
        /// Why.
        source: RunError,
    },
    /// The loss or the gradients stopped being finite.
    #[error("step {step}: {what}")]
    NonFinite {
        /// The step (from 0).
        step: usize,
        /// What was not finite.
        what: String,
    },
    /// The optimizer refused the update (a bug, or state that does not fit); the cause is the
    /// source.
    #[error("step {step}")]
    Optim {
        /// The step.
        step: usize,
        /// Why.
        source: OptimError,
    },
    /// A tensor the model reads is not among the weights given, or has another shape.
    #[error("weights: {0}")]
    Weights(String),
    /// A `frozen` entry that names nothing, or part of a packed tensor.
    #[error("frozen: {0}")]
    Frozen(String),
    /// A step given no batch.
    #[error("step {0}: no batch")]
    NoBatch(usize),
}

/// A model's training step as graphs (what [`step_graphs`] builds).
pub struct StepGraphs {
    /// The loss on the checkpoint's tensors (evaluation).
    pub eval: Graph,
    /// The loss and the gradients of every trained tensor.
    pub step: Graph,
    /// The whole step: `step` with the optimizer's update of every trained tensor at its end
    /// ([`kiln_compiler::train::update`]) — what the interpreter and the CPU run for a step of
    /// one micro-batch. `None` where nothing is trained.
    pub whole: Option<Graph>,
    /// The trained tensors, in the model's order (that of `grad_sums`).
    pub trained: Vec<String>,
    /// Where each parameter is read from.
    pub uses: Vec<TensorUse>,
    /// The tensors `recipe.frozen` freezes.
    pub frozen: Vec<String>,
    /// The blocks whose activations the step recomputes (the recipe's `recompute` or
    /// `memory_budget`).
    pub recomputed: BTreeSet<Block>,
    /// The model's blocks.
    pub blocks: usize,
}

/// The graphs of a training step of `forward` (a model's unoptimized graph, with a `logits`
/// output) on the tensors `map` reads, as `recipe` says (its label smoothing, frozen tensors and
/// recomputation): what [`Trainer`] runs and `kiln inspect --graph train` shows.
pub fn step_graphs(
    forward: &Graph,
    map: &WeightMap,
    dims: &PackDims,
    recipe: &Recipe,
) -> Result<StepGraphs, TrainError> {
    // The loss on the checkpoint's tensors is the evaluation graph; its gradients, the step's.
    let objective = Objective { label_smoothing: recipe.label_smoothing };
    let (eval, uses) = on_tensors(&loss_graph(forward, objective)?, map, dims).map_err(TrainGraphError::from)?;
    let frozen = frozen_tensors(&recipe.frozen, &uses)?;
    let StepGraph { graph: step, recomputed, blocks } = step_graph(&eval, &uses, &frozen, recipe)?;
    let mut trained: Vec<String> = Vec::new();
    for u in &uses {
        if !frozen.contains(&u.tensor) && !trained.contains(&u.tensor) {
            trained.push(u.tensor.clone());
        }
    }
    let whole = match trained.is_empty() {
        true => None,
        false => Some(with_update(&step, &trained, recipe)?),
    };
    Ok(StepGraphs { eval, step, whole, trained, uses, frozen, recomputed, blocks })
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLog {
    /// The step (from 0).
    pub step: usize,
    /// The mean loss of the batch, before the update.
    pub loss: f64,
    /// The global L2 norm of the gradients, before clipping.
    pub grad_norm: f64,
    /// The learning rate the update used.
    pub lr: f64,
    /// Label positions the loss counted.
    pub tokens: u64,
}

/// A model being trained: its graphs on a device, its tensors and the optimizer's state.
pub struct Trainer {
    recipe: Recipe,
    train: StepRunner,
    eval: Option<StepRunner>,
    eval_graph: Graph,
    device_for_eval: Device,
    tensors: HashMap<String, Tensor>,
    trained: Vec<String>,
    uses: Vec<TensorUse>,
    optimizer: Optimizer,
    /// Whether `train` runs the whole step — forward, loss, backward, clipping and the update of
    /// every trained tensor in one graph (on the interpreter and the CPU; see
    /// [`Trainer::step`]) — rather than the loss and gradients only.
    whole: bool,
    /// The graph of the loss and gradients alone, and its runner once made: what a step of
    /// several micro-batches runs where `train` runs the whole step.
    gradients: Graph,
    gradient_runner: Option<StepRunner>,
    optimize: bool,
    /// Where the steps run on wgpu (see [`Trainer::step`]), once the first has: then the
    /// parameters and the optimizer's state there are the truth, and `stale` says whether
    /// `tensors` and `optimizer` are behind them (the host's state is dropped meanwhile).
    resident: Option<Resident>,
    stale: bool,
    step: usize,
    recomputed: (usize, usize),
}

/// Where the trained tensors and the optimizer's state live on the device, when there.
enum Resident {
    /// In the whole step's model (its parameters), which its plan's optimizer updates in place
    /// (`kiln_runtime::gpu`'s `update`); `steps` taken so far.
    Graph { steps: u64 },
    /// The gradients' model's parameters and [`DeviceOptimizer`]'s state (a step of several
    /// micro-batches).
    Optimizer(Box<DeviceOptimizer>),
}

/// The tensors `frozen` freezes among `uses`: an entry (a name or a glob) matches a tensor's
/// name, or the graph name of a parameter read from it. A parameter that is one part of a pack
/// freezes nothing alone: the whole tensor must be.
pub fn frozen_tensors(frozen: &[String], uses: &[TensorUse]) -> Result<Vec<String>, TrainError> {
    let mut out: Vec<String> = Vec::new();
    for pattern in frozen {
        let mut matched = false;
        for u in uses {
            if glob_match(pattern, &u.tensor) {
                matched = true;
                if !out.contains(&u.tensor) {
                    out.push(u.tensor.clone());
                }
            } else if glob_match(pattern, &u.param) {
                matched = true;
                let parts: Vec<&TensorUse> = uses.iter().filter(|v| v.tensor == u.tensor).collect();
                if u.packed && !parts.iter().all(|v| glob_match(pattern, &v.param)) {
                    return Err(TrainError::Frozen(format!(
                        "`{pattern}` names `{}`, one part of the packed tensor `{}`; freeze the whole tensor",
                        u.param, u.tensor
                    )));
                }
                if !out.contains(&u.tensor) {
                    out.push(u.tensor.clone());
                }
            }
        }
        if !matched {
            let mut names: Vec<&str> = uses.iter().map(|u| u.tensor.as_str()).collect();
            names.dedup();
            let near: Vec<&str> =
                names.iter().copied().filter(|n| n.contains(pattern.trim_matches('*'))).take(3).collect();
            return Err(TrainError::Frozen(format!(
                "`{pattern}` matches no tensor or parameter of the model{}",
                if near.is_empty() { String::new() } else { format!(" (near: {})", near.join(", ")) }
            )));
        }
    }
    Ok(out)
}

impl Trainer {
    /// A trainer of `forward` (a model's unoptimized graph, with a `logits` output) on `device`,
    /// its parameters read through `map` from `tensors` (a checkpoint's, by name: the trained
    /// ones are updated in place of these), trained as `recipe` says.
    pub fn new(
        device: Device,
        forward: &Graph,
        map: &WeightMap,
        dims: &PackDims,
        recipe: Recipe,
        tensors: HashMap<String, Tensor>,
    ) -> Result<Trainer, TrainError> {
        Trainer::with_optimization(device, forward, map, dims, recipe, tensors, true)
    }

    /// [`Trainer::new`], its step's graph optimized for the device or not (see
    /// [`StepRunner::with_optimization`]).
    pub fn with_optimization(
        device: Device,
        forward: &Graph,
        map: &WeightMap,
        dims: &PackDims,
        recipe: Recipe,
        mut tensors: HashMap<String, Tensor>,
        optimize: bool,
    ) -> Result<Trainer, TrainError> {
        let StepGraphs { eval: eval_graph, step: graph, whole: whole_graph, trained, uses, recomputed, blocks, .. } =
            step_graphs(forward, map, dims, &recipe)?;
        let mut shapes: Vec<(String, Vec<usize>)> = Vec::new();
        for u in &uses {
            if shapes.iter().any(|(t, _)| *t == u.tensor) {
                continue;
            }
            let t = tensors.get_mut(&u.tensor).ok_or_else(|| {
                TrainError::Weights(format!("no tensor `{}` (read as parameter `{}`)", u.tensor, u.param))
            })?;
            if t.shape != u.shape {
                return Err(TrainError::Weights(format!(
                    "tensor `{}` has shape {:?}, the model reads it as {:?}",
                    u.tensor, t.shape, u.shape
                )));
            }
            if t.as_f32().is_none() {
                *t = Tensor::f32(t.shape.clone(), t.to_f32_vec());
            }
            shapes.push((u.tensor.clone(), u.shape.clone()));
        }
        // Only the tensors the model reads are kept (a checkpoint may hold others).
        tensors.retain(|name, _| shapes.iter().any(|(t, _)| t == name));
        let optimizer = Optimizer::from_recipe(
            &recipe,
            shapes.iter().filter(|(t, _)| trained.contains(t)).map(|(t, s)| (t.as_str(), s.as_slice())),
        );
        let seq = recipe.seq.unwrap_or(kiln_compiler::optimize::CostModel::cpu().seq);
        // The step's graph ends with the update on every device. (A recipe accumulating
        // micro-batches never steps on one: it runs the gradients' graph, and on wgpu
        // `DeviceOptimizer` updates.)
        let (whole, step_graph) = match whole_graph {
            Some(w) if recipe.accumulate == 1 => (true, w),
            _ => (false, graph.clone()),
        };
        let train = StepRunner::with_optimization(&device, step_graph, optimize, seq)
            .map_err(|source| TrainError::Run { step: 0, source })?;
        Ok(Trainer {
            recipe,
            train,
            whole,
            gradients: graph,
            gradient_runner: None,
            optimize,
            eval: None,
            eval_graph,
            device_for_eval: device,
            tensors,
            trained,
            uses,
            optimizer,
            resident: None,
            stale: false,
            step: 0,
            recomputed: (recomputed.len(), blocks),
        })
    }

    /// How many of the model's blocks the step recomputes, and how many it has.
    pub fn recomputed(&self) -> (usize, usize) {
        self.recomputed
    }

    /// The recipe.
    pub fn recipe(&self) -> &Recipe {
        &self.recipe
    }

    /// The steps taken so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// The model's tensors, by checkpoint name (the trained ones as trained so far: read back
    /// from the device where the steps run there).
    pub fn tensors(&mut self) -> Result<&HashMap<String, Tensor>, TrainError> {
        self.sync()?;
        Ok(&self.tensors)
    }

    /// Brings the host's tensors and optimizer state up to the device's, where the steps run
    /// there ([`Trainer::step`]); nothing to do otherwise.
    fn sync(&mut self) -> Result<(), TrainError> {
        let (true, Some(resident)) = (self.stale, &self.resident) else {
            return Ok(());
        };
        let step = self.step;
        let failed = |e: GpuError| TrainError::Run { step, source: RunError::from(e) };
        // The model whose parameters the device updates: the step's graph's (with the update in
        // it, or the gradients' graph that `DeviceOptimizer` follows), `train` either way.
        let model = self.train.gpu_model();
        // The parameters, unless the model was never built (its first run failed): then the
        // host's are still the truth.
        let read = |name: &str| -> Result<Tensor, TrainError> {
            model.and_then(|m| m.read_param(name)).ok_or_else(|| no_buffers(step, name))?.map_err(failed)
        };
        if model.is_some() {
            for name in &self.trained {
                let t = read(name)?;
                self.tensors.insert(name.clone(), t);
            }
        }
        let state: HashMap<String, Tensor> = match resident {
            Resident::Optimizer(o) => o.state().map_err(failed)?.into_iter().collect(),
            Resident::Graph { steps } => {
                let mut state = HashMap::new();
                state.insert(self.optimizer.step_key().to_string(), Tensor::i64(vec![], vec![*steps as i64]));
                // (SGD's momentum buffers exist from the first step taken on.)
                let started = *steps > 0 || self.recipe.optimizer == kiln_compiler::train::OptimizerKind::AdamW;
                for tensor in self.trained.iter().filter(|_| started) {
                    for name in update::state_names(&self.recipe, tensor) {
                        let t = read(&name)?;
                        state.insert(name, t);
                    }
                }
                state
            }
        };
        self.optimizer.load_state(&state).map_err(|source| TrainError::Optim { step, source })?;
        self.stale = false;
        Ok(())
    }

    /// The tensors the optimizer updates, in the model's order.
    pub fn trained(&self) -> &[String] {
        &self.trained
    }

    /// Where each graph parameter is read from.
    pub fn uses(&self) -> &[TensorUse] {
        &self.uses
    }

    /// One optimizer step on `micro` (the step's micro-batches: one, or `accumulate` of them).
    /// On an error the tensors and the optimizer's state are those before the step.
    ///
    /// On wgpu, a step runs on the device: the parameters, their gradients (several
    /// micro-batches' averaged there) and the optimizer's state (AdamW's moments, SGD's momentum)
    /// stay there (the first such step writes the host's there), the loss and the gradients'
    /// sums of squares are read back for the checks and the clipping, and [`DeviceOptimizer`]
    /// updates the parameters in place; the host's copies are read back when asked for
    /// ([`Trainer::tensors`], [`Trainer::state`], an evaluation). On another device a step runs
    /// on the host's tensors: a step of one micro-batch as one graph, its update included
    /// ([`kiln_compiler::train::update`]; the CPU writes it in place of the tensors), a step of
    /// several micro-batches as their gradients' graph each, averaged, then the host's
    /// clipping and optimizer.
    pub fn step(&mut self, micro: &[HashMap<String, Tensor>]) -> Result<StepLog, TrainError> {
        let on_device = self.train.gpu().is_some();
        match (micro, self.whole, on_device) {
            ([batch], true, true) => return self.step_whole_on_device(batch),
            ([batch], true, false) => return self.step_whole(batch),
            ([_, ..], false, true) => return self.step_on_device(micro),
            _ => {}
        }
        // The host's tensors are the truth from here: the next step on the device writes them
        // there again.
        self.sync()?;
        self.resident = None;
        let step = self.step;
        let lr = self.recipe.lr_at(step);
        let mut acc = GradAccumulator::new();
        let mut loss_sum = 0.0f64;
        let mut single: Option<HashMap<String, Tensor>> = None;
        let runner = match (self.whole, &mut self.gradient_runner) {
            (false, _) => &mut self.train,
            (true, Some(r)) => r,
            (true, slot @ None) => {
                let seq = self.recipe.seq.unwrap_or(kiln_compiler::optimize::CostModel::cpu().seq);
                let r =
                    StepRunner::with_optimization(&self.device_for_eval, self.gradients.clone(), self.optimize, seq)
                        .map_err(|source| TrainError::Run { step, source })?;
                slot.insert(r)
            }
        };
        for batch in micro {
            let out =
                runner.run_lent(&mut self.tensors, batch, &()).map_err(|source| TrainError::Run { step, source })?;
            if !out.loss.is_finite() {
                return Err(TrainError::NonFinite { step, what: format!("the loss is {}", out.loss) });
            }
            let counted = counted(batch);
            loss_sum += out.loss * counted as f64;
            if micro.len() == 1 {
                single = Some(out.grads);
            } else {
                let grads = out.grads.iter().filter_map(|(n, t)| Some((n.as_str(), t.as_f32()?)));
                acc.add(counted as usize, grads).map_err(|source| TrainError::Optim { step, source })?;
            }
        }
        let tokens = match micro.len() {
            0 => return Err(TrainError::NoBatch(step)),
            1 => micro.first().map_or(0, counted),
            _ => acc.counted(),
        };
        let loss = loss_sum / tokens.max(1) as f64;
        // One micro-batch: its gradients as they are (bit for bit); several: their weighted mean.
        let mut grads: HashMap<String, Tensor> = match single {
            Some(g) => g,
            None => acc
                .finish()
                .into_iter()
                .filter_map(|(n, v)| {
                    let shape = self.tensors.get(&n)?.shape.clone();
                    Some((n, Tensor::f32(shape, v)))
                })
                .collect(),
        };
        // The update is in place: every check (a gradient per trained tensor, its type and shape,
        // a finite norm, the optimizer's own) comes before the first write, so a refused step
        // leaves the tensors as they were. The order is the model's, so the norm's sum is too.
        let mut values: HashMap<&str, &mut Tensor> = self.tensors.iter_mut().map(|(n, t)| (n.as_str(), t)).collect();
        let mut pairs: Vec<(&str, &mut Tensor, Tensor)> = Vec::with_capacity(self.trained.len());
        for name in &self.trained {
            let missing = || TrainError::Run { step, source: RunError::NoGradient(name.clone()) };
            let grad = grads.remove(name.as_str()).ok_or_else(missing)?;
            let value = values.remove(name.as_str()).ok_or_else(missing)?;
            pairs.push((name.as_str(), value, grad));
        }
        let mut updates: Vec<Update> = pairs
            .iter_mut()
            .map(|(name, value, grad)| Update::from_tensors(name, value, grad))
            .collect::<Result<_, _>>()
            .map_err(|source| TrainError::Optim { step, source })?;
        let grad_norm = clip_grad_norm(&mut updates, self.recipe.clip).map_err(|e| match e {
            OptimError::NonFiniteGrad { .. } => TrainError::NonFinite { step, what: e.to_string() },
            source => TrainError::Optim { step, source },
        })?;
        self.optimizer.step(lr, &mut updates).map_err(|source| TrainError::Optim { step, source })?;
        drop(updates);
        runner.recycle(pairs.into_iter().map(|(_, _, grad)| grad));
        self.step += 1;
        Ok(StepLog { step, loss, grad_norm, lr, tokens })
    }

    /// [`Trainer::step`] of one micro-batch by the whole step's graph (see there): the
    /// optimizer's state and the step's constants are lent to the run beside the tensors, and the
    /// engine writes the update in place of them (the CPU's) or gives it as outputs (the
    /// interpreter's). The graph takes no step where the loss or the global norm is not finite,
    /// so a refused step leaves everything as it was.
    fn step_whole(&mut self, batch: &HashMap<String, Tensor>) -> Result<StepLog, TrainError> {
        let step = self.step;
        let lr = self.recipe.lr_at(step);
        let optim = |source: OptimError| TrainError::Optim { step, source };
        let lent = self.lend(lr).map_err(optim)?;
        let out = self.train.run_lent(&mut self.tensors, batch, &());
        let taken = out.as_ref().is_ok_and(|o| self.taken(o).is_ok());
        // The updates an engine gave as outputs, into the tensors and the state.
        let mut written = Ok(());
        if let (Ok(o), true) = (&out, taken) {
            for (tensor, stacked) in &o.updates {
                let mut names = vec![tensor.clone()];
                names.extend(update::state_names(&self.recipe, tensor));
                written = written.and(unstack(stacked, &names, &mut self.tensors));
            }
        }
        self.take_back(&lent, taken).map_err(optim)?;
        let out = out.map_err(|source| TrainError::Run { step, source })?;
        written.map_err(TrainError::Weights)?;
        let grad_norm = self.taken(&out)?;
        self.step += 1;
        Ok(StepLog { step, loss: out.loss, grad_norm, lr, tokens: counted(batch) })
    }

    /// The global norm of the gradients of a whole step's run `out`, or why its update was not
    /// taken: a loss or a norm that is not finite (naming the first gradient whose squared norm
    /// is not), or no norm for each trained tensor.
    fn taken(&self, out: &StepOutput) -> Result<f64, TrainError> {
        let step = self.step;
        if !out.loss.is_finite() {
            return Err(TrainError::NonFinite { step, what: format!("the loss is {}", out.loss) });
        }
        let sums: Vec<f64> = match &out.grad_sums {
            Some(sums) if sums.len() == self.trained.len() => sums.iter().map(|&s| f64::from(s)).collect(),
            _ => {
                let name = self.trained.first().cloned().unwrap_or_default();
                return Err(TrainError::Run { step, source: RunError::NoGradient(name) });
            }
        };
        let grad_norm = sums.iter().sum::<f64>().sqrt();
        if !grad_norm.is_finite() {
            let first = self.trained.iter().zip(&sums).find(|(_, s)| !s.is_finite());
            let first = first.map(|(name, &sum)| (name, sum));
            let (name, sum) = first.map_or(("(none)".to_string(), f64::NAN), |(n, s)| (n.clone(), s));
            let what = format!("gradient norm is {grad_norm}: the gradient of `{name}` has a squared norm of {sum}");
            return Err(TrainError::NonFinite { step, what });
        }
        Ok(grad_norm)
    }

    /// [`Trainer::step`] of one micro-batch by the whole step's graph on wgpu (see there): the
    /// tensors and the optimizer's state are parameters of the step's model on the device
    /// (written there by the first such step, from the host's), the step's constants are written
    /// there before each run, and the plan's optimizer updates them in place; the loss and the
    /// gradients' squared norms are all that is read back. The device takes no step where the
    /// loss or the norm is not finite, so a refused step leaves everything as it was.
    fn step_whole_on_device(&mut self, batch: &HashMap<String, Tensor>) -> Result<StepLog, TrainError> {
        let step = self.step;
        let lr = self.recipe.lr_at(step);
        let run = |source: RunError| TrainError::Run { step, source };
        let optim = |source: OptimError| TrainError::Optim { step, source };
        let out = match self.resident {
            Some(Resident::Graph { steps }) => {
                let constants = update::step_constants(&self.recipe, lr, steps + 1);
                self.train.write_param(update::STEP_CONSTANTS, &constants).map_err(run)?;
                self.train.run_whole_on_device(&self.tensors, batch, false, &()).map_err(run)?
            }
            _ => {
                // The host's tensors and state to the device, lent for the upload and taken
                // back (unchanged); from here the device's are the truth.
                self.sync()?;
                self.resident = None;
                let steps = self.optimizer.step_count();
                let lent = self.lend(lr).map_err(optim)?;
                let out = self.train.run_whole_on_device(&self.tensors, batch, true, &());
                self.take_back(&lent, false).map_err(optim)?;
                let out = out.map_err(run)?;
                self.resident = Some(Resident::Graph { steps });
                out
            }
        };
        // The host's copies are behind the device's now (or will be: its state, if read back
        // since the last step, is dropped again).
        self.optimizer.release_state();
        self.stale = true;
        let grad_norm = self.taken(&out)?;
        if let Some(Resident::Graph { steps }) = &mut self.resident {
            *steps += 1;
        }
        self.step += 1;
        Ok(StepLog { step, loss: out.loss, grad_norm, lr, tokens: counted(batch) })
    }

    /// Joins the optimizer's state and the step's constants at learning rate `lr` to the
    /// tensors, for a run of the whole step's graph; returns the names joined, which
    /// [`Trainer::take_back`] takes out again.
    fn lend(&mut self, lr: f64) -> Result<Vec<String>, OptimError> {
        let t = self.optimizer.step_count() + 1;
        let constants = update::step_constants(&self.recipe, lr, t);
        let mut lent = self.optimizer.lend_state()?;
        lent.push((update::STEP_CONSTANTS.into(), Tensor::f32(vec![constants.len()], constants)));
        let names = lent.iter().map(|(n, _)| n.clone()).collect();
        self.tensors.extend(lent);
        Ok(names)
    }

    /// Takes what [`Trainer::lend`] joined out of the tensors, the state back to the optimizer,
    /// a step counted if `taken`.
    fn take_back(&mut self, lent: &[String], taken: bool) -> Result<(), OptimError> {
        let mut state: HashMap<String, Tensor> =
            lent.iter().filter_map(|n| Some((n.clone(), self.tensors.remove(n)?))).collect();
        state.remove(update::STEP_CONSTANTS);
        self.optimizer.restore_state(&mut state, taken)
    }

    /// [`Trainer::step`] on the device (see there) of `micro` (at least one micro-batch).
    fn step_on_device(&mut self, micro: &[HashMap<String, Tensor>]) -> Result<StepLog, TrainError> {
        let step = self.step;
        let lr = self.recipe.lr_at(step);
        let run = |source: RunError| TrainError::Run { step, source };
        let gpu_failed = |e: GpuError| TrainError::Run { step, source: RunError::from(e) };
        let upload = !matches!(self.resident, Some(Resident::Optimizer(_)));
        if let (true, Some(gpu)) = (upload, self.train.gpu()) {
            // The state to the device; from here the device's copies are the truth (equal to
            // the host's until the first update), and the host's state is dropped.
            let resident = DeviceOptimizer::new(gpu.clone(), &self.optimizer, &self.trained).map_err(gpu_failed)?;
            self.resident = Some(Resident::Optimizer(Box::new(resident)));
            self.optimizer.release_state();
            self.stale = true;
        }
        let no_optimizer = || run(RunError::Gpu(Box::new(GpuError::Internal("no optimizer on the device".into()))));
        // Each micro-batch's loss and gradients; several are averaged on the device, weighted by
        // the positions each counts (as `GradAccumulator` does on the host).
        let (mut loss_sum, mut counted_sum, mut single) = (0.0f64, 0u64, None);
        for (i, batch) in micro.iter().enumerate() {
            let (loss, grads) = self.train.run_on_device(&self.tensors, batch, upload && i == 0, &()).map_err(run)?;
            if !loss.is_finite() {
                return Err(TrainError::NonFinite { step, what: format!("the loss is {loss}") });
            }
            let c = counted(batch);
            loss_sum += loss * c as f64;
            if micro.len() == 1 {
                single = Some(grads);
            } else if c > 0 {
                let g = in_order(&self.trained, &grads, step)?;
                let weight = (counted_sum > 0).then(|| (c as f64 / (counted_sum + c) as f64) as f32);
                let Some(Resident::Optimizer(resident)) = self.resident.as_mut() else {
                    return Err(no_optimizer());
                };
                resident.accumulate(&g, weight).map_err(gpu_failed)?;
                counted_sum += c;
            }
        }
        let tokens = match &single {
            Some(_) => micro.first().map_or(0, counted),
            None => counted_sum,
        };
        let loss = loss_sum / tokens.max(1) as f64;
        let (host, Some(model), Some(Resident::Optimizer(resident))) =
            (&self.optimizer, self.train.gpu_model(), self.resident.as_mut())
        else {
            return Err(no_optimizer());
        };
        let gradients: Vec<Vec<wgpu::Buffer>> = match &single {
            Some(grads) => in_order(&self.trained, grads, step)?.into_iter().map(<[wgpu::Buffer]>::to_vec).collect(),
            // No micro-batch counted a position: no gradient, as on the host.
            None if counted_sum == 0 => {
                let name = self.trained.first().cloned().unwrap_or_default();
                return Err(run(RunError::NoGradient(name)));
            }
            None => resident.mean(),
        };
        let g: Vec<&[wgpu::Buffer]> = gradients.iter().map(Vec::as_slice).collect();
        let mut p: Vec<&[wgpu::Buffer]> = Vec::with_capacity(self.trained.len());
        for name in &self.trained {
            p.push(model.param_buffers(name).ok_or_else(|| no_buffers(step, name))?);
        }
        // The global norm as `clip_grad_norm` computes it (the parameters' sums in order), and
        // the same refusal of a non-finite one, naming the first tensor whose gradient is not
        // finite and a value of it.
        let sums = resident.sum_squares(&g).map_err(gpu_failed)?;
        let grad_norm = sums.iter().sum::<f64>().sqrt();
        if !grad_norm.is_finite() {
            let first = sums.iter().position(|s| !s.is_finite());
            let found = first.and_then(|i| Some((self.trained.get(i)?, *g.get(i)?)));
            let (param, value) = match found {
                Some((name, buffers)) => {
                    let shape =
                        self.tensors.get(name).map(|t| t.shape.clone()).ok_or_else(|| no_buffers(step, name))?;
                    let t = crate::gpu::read_buffers(model.gpu(), buffers, &shape).map_err(gpu_failed)?;
                    let bad = t.as_f32().and_then(|v| v.iter().copied().find(|x| !x.is_finite()));
                    (name.clone(), bad.unwrap_or(f32::NAN))
                }
                None => ("(none)".to_string(), f32::NAN),
            };
            let e = OptimError::NonFiniteGrad { norm: grad_norm, param, value };
            return Err(TrainError::NonFinite { step, what: e.to_string() });
        }
        let scale = match self.recipe.clip {
            Some(max_norm) if max_norm / (grad_norm + 1e-6) < 1.0 => (max_norm / (grad_norm + 1e-6)) as f32,
            _ => 1.0,
        };
        resident.update(host, lr, scale, &p, &g).map_err(gpu_failed)?;
        // The host's copies are behind the device's now (and its state, if read back since the
        // last step, is dropped again).
        self.optimizer.release_state();
        self.stale = true;
        self.step += 1;
        Ok(StepLog { step, loss, grad_norm, lr, tokens })
    }

    /// Where a step's graph spends its time on `batch` (each plan step's op and seconds; `None` on
    /// the interpreter): see [`StepRunner::profile`]. Nothing is updated.
    pub fn profile(&mut self, batch: &HashMap<String, Tensor>) -> Result<Option<Vec<(String, f64)>>, TrainError> {
        self.sync()?;
        let step = self.step;
        // The whole step's graph reads the optimizer's state and constants too (its update's
        // results are outputs of a profiled run, so nothing is written).
        let lent = match self.whole {
            true => self.lend(self.recipe.lr_at(step)).map_err(|source| TrainError::Optim { step, source })?,
            false => Vec::new(),
        };
        let out = self.train.profile(&self.tensors, batch, &());
        if self.whole {
            self.take_back(&lent, false).map_err(|source| TrainError::Optim { step, source })?;
            // On wgpu that run updated the device's copies in place: the host's are the truth
            // again (the next step writes them there).
            if let Some(Resident::Graph { .. }) = self.resident {
                self.resident = None;
            }
        }
        out.map_err(|source| TrainError::Run { step, source })
    }

    /// The mean loss of `batch` with the current tensors (no update).
    pub fn eval(&mut self, batch: &HashMap<String, Tensor>) -> Result<f64, TrainError> {
        self.sync()?;
        let step = self.step;
        let runner = match &mut self.eval {
            Some(r) => r,
            None => self.eval.insert(
                StepRunner::new(&self.device_for_eval, self.eval_graph.clone())
                    .map_err(|source| TrainError::Run { step, source })?,
            ),
        };
        Ok(runner.run(&self.tensors, batch, &()).map_err(|source| TrainError::Run { step, source })?.loss)
    }

    /// The optimizer's state and the step count, as named tensors (`train.step`, and the
    /// optimizer's own names), for a checkpoint a resumed run continues from.
    pub fn state(&mut self) -> Result<Vec<(String, Tensor)>, TrainError> {
        self.sync()?;
        let mut state = self.optimizer.state();
        state.push((STEP.into(), Tensor::i64(vec![1], vec![self.step as i64])));
        Ok(state)
    }

    /// Restores [`Trainer::state`] (the tensors are restored by giving them to [`Trainer::new`]).
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        let step = match state.get(STEP).and_then(|t| t.as_i64()).and_then(|v| v.first()) {
            Some(&s) if s >= 0 => s as usize,
            _ => return Err(TrainError::Weights(format!("the training state has no `{STEP}`"))),
        };
        self.sync()?;
        self.optimizer.load_state(state).map_err(|source| TrainError::Optim { step, source })?;
        // The device's moments, if any, are not these: the next step writes these there.
        self.resident = None;
        self.step = step;
        Ok(())
    }
}

/// A run's gradients (by tensor name) in the order of `trained`.
fn in_order<'g>(
    trained: &[String],
    grads: &'g HashMap<String, Vec<wgpu::Buffer>>,
    step: usize,
) -> Result<Vec<&'g [wgpu::Buffer]>, TrainError> {
    let missing = |name: &String| TrainError::Run { step, source: RunError::NoGradient(name.clone()) };
    trained.iter().map(|name| grads.get(name).map(Vec::as_slice).ok_or_else(|| missing(name))).collect()
}

/// The error of a trained tensor the device holds no f32 buffers for (a bug: the training plan
/// reads every trained tensor as a parameter).
fn no_buffers(step: usize, name: &str) -> TrainError {
    let message = format!("the device holds no buffers for `{name}`");
    TrainError::Run { step, source: RunError::from(GpuError::Internal(message)) }
}

/// Writes `stacked` (an update's result: a tensor and its optimizer state, stacked) into the
/// tensors `names` of `into`, in order.
fn unstack(stacked: &Tensor, names: &[String], into: &mut HashMap<String, Tensor>) -> Result<(), String> {
    let data = stacked.as_f32().ok_or("an update's result is not f32")?;
    let n = data.len() / names.len().max(1);
    for (name, part) in names.iter().zip(data.chunks(n.max(1))) {
        match into.get_mut(name).map(|t| &mut t.data) {
            Some(kiln_compiler::tensor::Data::F32(v)) if v.len() == part.len() => v.copy_from_slice(part),
            _ => return Err(format!("the update's result does not fit `{name}`")),
        }
    }
    Ok(())
}

/// The name of the step count in a training state.
pub const STEP: &str = "train.step";

/// The label positions of `batch` that take a loss.
pub fn counted(batch: &HashMap<String, Tensor>) -> u64 {
    batch.get(LABELS).and_then(|t| t.as_i64()).map_or(0, |l| l.iter().filter(|&&x| x != IGNORE_INDEX).count() as u64)
}
