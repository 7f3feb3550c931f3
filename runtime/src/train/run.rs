//! [`StepRunner`]: a training graph (see [`kiln_compiler::train`]) run on a device — the loss and
//! the gradients of one batch, for parameters that change after every step.
//!
//! The interpreter runs the graph itself, as built (it is the oracle). The CPU back end runs the
//! graph the e-graph optimizer makes of it for the CPU target — forward, loss and backward
//! optimized as one graph, so the fusions of inference apply to the forward half and the
//! backward's own forms are found by the same rules; the wgpu back end the graph optimized for
//! the adapter. Each lowers its graph once and, before each run, replaces its parameters
//! ([`CpuModel::set_params`], [`GpuModel::set_params`]). Neither plan folds anything at load
//! time: a tensor's reading (transposed, cut out of a pack) changes with every step, so it runs
//! as a step of the plan, on the engine's own kernels, rather than as a fold the interpreter
//! evaluates again on the host each time the parameters change (GPT-2 small's 264 folds took
//! 1.8 s a step that way on the CPU; on an H200 its wgpu step spent 3.4 s of 5.0 on the host).

use crate::cpu::{CpuError, CpuModel};
use crate::device::Device;
use crate::gpu::{Gpu, GpuError, GpuModel};
use crate::progress::Progress;
use kiln_compiler::back::wgsl::Options;
use kiln_compiler::graph::{Graph, GraphError, Sym};
use kiln_compiler::interp::{self, InterpError};
use kiln_compiler::lower::{self, Plan};
use kiln_compiler::optimize::{self, CostModel};
use kiln_compiler::target::Target;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::LOSS;
use kiln_compiler::train::update::{GRAD_SUMS, UPDATE};
use std::collections::HashMap;
use std::sync::Arc;

/// What can go wrong running a training step.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The interpreter refused the batch or the parameters.
    #[error(transparent)]
    Interp(#[from] InterpError),
    /// The CPU back end failed.
    #[error(transparent)]
    Cpu(#[from] CpuError),
    /// The optimizer refused the graph (a bug of a rule: the graph was well typed).
    #[error("optimizing the training step")]
    Optimize(#[from] GraphError),
    /// The wgpu back end failed (boxed: it is larger than the other errors).
    #[error(transparent)]
    Gpu(Box<GpuError>),
    /// A trained tensor got no gradient (a bug of the graph's construction).
    #[error("the training graph gave no gradient for `{0}`")]
    NoGradient(String),
    /// The graph gave no loss (a bug of the graph's construction).
    #[error("the training graph gave no `{LOSS}` output")]
    NoLoss,
}

impl From<GpuError> for RunError {
    fn from(e: GpuError) -> Self {
        RunError::Gpu(Box::new(e))
    }
}

/// The loss of a batch and, by tensor name, the gradients the graph computes — or, for a whole
/// step's graph (its update included, [`kiln_compiler::train::update`]), the gradients' norms
/// and the updates the engine did not write in place.
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// The mean loss.
    pub loss: f64,
    /// `grad.<tensor>` outputs, by tensor name.
    pub grads: HashMap<String, Tensor>,
    /// The `grad_sums` output: each gradient's squared norm, in the order of the trained tensors.
    pub grad_sums: Option<Vec<f32>>,
    /// `update.<tensor>` outputs, by tensor name: the tensor and its optimizer state after the
    /// step, stacked. Empty where the engine updated them in place ([`CpuModel::run_lent`]).
    pub updates: HashMap<String, Tensor>,
}

/// The sizes a step's order is chosen at: 512 tokens (one sequence of 512; four of 128 weigh the
/// same but for attention's scores).
fn schedule_sizes() -> HashMap<Sym, usize> {
    [(Sym::Batch, 1), (Sym::Seq, 512), (Sym::SrcSeq, 512), (Sym::Past, 0), (Sym::Ctx, 512)].into()
}

enum Kind {
    Interp(Graph),
    Cpu { plan: Plan, threads: usize, model: Option<Box<CpuModel>> },
    Gpu { gpu: Arc<Gpu>, plan: Plan, model: Option<Box<GpuModel>> },
}

/// A training (or loss-only) graph on a device.
pub struct StepRunner {
    kind: Kind,
}

impl StepRunner {
    /// `graph` on `device`: the interpreter, or lowered for the CPU or wgpu back end.
    pub fn new(device: &Device, graph: Graph) -> Result<StepRunner, RunError> {
        StepRunner::with_optimization(device, graph, true, CostModel::cpu().seq)
    }

    /// [`StepRunner::new`], the graph optimized for the device or not (`kiln bench train --unoptimized`:
    /// what the e-graph's rewrites of the step are worth), its forms chosen by the cost of a step
    /// at `seq` tokens (the sequence length the step runs at: a form that pays at one length may
    /// not at another, as attention's backward in tiles does not at 64 tokens).
    pub fn with_optimization(
        device: &Device,
        graph: Graph,
        optimize: bool,
        seq: usize,
    ) -> Result<StepRunner, RunError> {
        let kind = match device {
            Device::Interp => Kind::Interp(graph),
            Device::Cpu { threads } => {
                // The optimizer's rebuild makes each output's term in turn (the weights'
                // gradients after the whole backward): its ops run in the order that frees memory
                // soonest, where that holds less than the rebuild's own.
                let optimized = match optimize {
                    true => {
                        let cost = CostModel { seq: seq.max(1), ..CostModel::cpu() };
                        let optimized = optimize::optimize_for(&graph, &Target { cost, ..Target::cpu() })?.0;
                        lower::schedule::by_memory(&optimized, &schedule_sizes())
                    }
                    false => graph,
                };
                let options = lower::Options { fold_constants: false, ..lower::Options::default() };
                Kind::Cpu { plan: lower::lower_with(&optimized, options), threads: *threads, model: None }
            }
            Device::Gpu(gpu) => {
                // Optimized for the adapter's cost model where it has one, else (an adapter never
                // calibrated, or a model that cannot be read) for the built-in one, as inference
                // is. (An uncalibrated adapter's step once ran as autodiff built it: on an H100,
                // 6x slower than the same machine's CPU; BENCHMARKS.md, 2026-11-27.)
                let graph = match optimize {
                    true => {
                        let cached = crate::costs::cached(gpu.adapter_name(), gpu.is_software()).ok().flatten();
                        optimize::optimize_for(&graph, &cached.unwrap_or_else(Target::wgpu))?.0
                    }
                    false => graph,
                };
                // Nothing folded at load time, as on the CPU; nor does the wgpu back end derive
                // anything from the parameters (`Options::params_vary`).
                let options = lower::Options { fold_constants: false, ..lower::Options::default() };
                Kind::Gpu { gpu: gpu.clone(), plan: lower::lower_with(&graph, options), model: None }
            }
        };
        Ok(StepRunner { kind })
    }

    /// Where the step goes: runs the graph once on `batch` with `params` and returns each plan
    /// step's op name and seconds, in plan order — on the CPU by the host's clock (see
    /// [`CpuModel::profile`]), on a device by its timestamps where it has them (see
    /// [`GpuModel::profile`]; a step not dispatched at these sizes counts 0); `None` on the
    /// interpreter.
    pub fn profile(
        &mut self,
        params: &HashMap<String, Tensor>,
        batch: &HashMap<String, Tensor>,
        progress: &dyn Progress,
    ) -> Result<Option<Vec<(String, f64)>>, RunError> {
        if matches!(self.kind, Kind::Interp(_)) {
            return Ok(None);
        }
        // A run first, so the model is built and its parameters are these.
        self.run(params, batch, progress)?;
        Ok(match &self.kind {
            Kind::Cpu { model: Some(m), .. } => {
                let times = m.profile(batch)?;
                Some(m.plan().steps.iter().map(|s| s.op.name()).zip(times).collect())
            }
            Kind::Gpu { model: Some(m), .. } => {
                let times = m.profile(batch)?.seconds.into_iter().map(|s| s.unwrap_or(0.0));
                Some(m.plan().steps.iter().map(|s| s.op.name()).zip(times).collect())
            }
            _ => None,
        })
    }

    /// Gives back gradients of an earlier step the caller is done with, for the next step's
    /// outputs to reuse (see [`CpuModel::recycle`]; the other devices drop them).
    pub fn recycle(&self, spent: impl IntoIterator<Item = Tensor>) {
        if let Kind::Cpu { model: Some(m), .. } = &self.kind {
            m.recycle(spent);
        }
    }

    /// [`StepRunner::run`] with `params` lent rather than copied where the device allows: the CPU
    /// model holds the tensors themselves for the run ([`CpuModel::run_lent`]) and gives them
    /// back, whatever the outcome; elsewhere (and for the run that builds the model) as `run`.
    pub fn run_lent(
        &mut self,
        params: &mut HashMap<String, Tensor>,
        batch: &HashMap<String, Tensor>,
        progress: &dyn Progress,
    ) -> Result<StepOutput, RunError> {
        // The first run builds the CPU model from the tensors themselves, moved in and given
        // back, rather than from a copy: a step's tensors and optimizer state are most of its
        // memory. (Every parameter is checked first, so the build cannot refuse them.)
        if let Kind::Cpu { plan, threads, model: slot @ None } = &mut self.kind
            && lendable(plan, params)
        {
            let mut m = CpuModel::for_training(plan.clone(), std::mem::take(params), *threads, progress)?;
            m.give_back(params);
            *slot = Some(Box::new(m));
        }
        if let Kind::Cpu { model: Some(m), .. } = &mut self.kind
            && let Some(outputs) = m.run_lent(params, batch)?
        {
            return step_output(outputs);
        }
        self.run(params, batch, progress)
    }

    /// The wgpu model the step runs on, once a run has built it (`None` on another device).
    pub fn gpu_model(&self) -> Option<&GpuModel> {
        match &self.kind {
            Kind::Gpu { model: Some(m), .. } => Some(m),
            _ => None,
        }
    }

    /// The device, where the step runs on wgpu.
    pub fn gpu(&self) -> Option<&Arc<Gpu>> {
        match &self.kind {
            Kind::Gpu { gpu, .. } => Some(gpu),
            _ => None,
        }
    }

    /// On wgpu: the loss of `batch` with the parameters already on the device — `params` written
    /// there first if `upload` or the model is not built yet — and the gradients left where the
    /// step wrote them (their buffers by tensor name, valid until the next run; see
    /// [`GpuModel::run_leaving`]). An error on another device.
    pub fn run_on_device(
        &mut self,
        params: &HashMap<String, Tensor>,
        batch: &HashMap<String, Tensor>,
        upload: bool,
        progress: &dyn Progress,
    ) -> Result<(f64, HashMap<String, Vec<wgpu::Buffer>>), RunError> {
        let Kind::Gpu { gpu, plan, model } = &mut self.kind else {
            return Err(RunError::Gpu(Box::new(GpuError::Internal("a step on the device, not on wgpu".into()))));
        };
        let model = gpu_model(gpu, plan, model, params, upload, progress)?;
        let (outputs, left) = model.run_leaving(batch, &|name| name == LOSS)?;
        let loss = step_output(outputs)?.loss;
        let grads = left.into_iter().filter_map(|(n, b)| Some((n.strip_prefix("grad.")?.to_string(), b))).collect();
        Ok((loss, grads))
    }

    /// On wgpu, a whole step's graph (its optimizer included: [`kiln_compiler::train::update`])
    /// on `batch` with the tensors and state already on the device — `params` written there
    /// first if `upload` or the model is not built yet: the loss and the gradients' squared
    /// norms, read back, and the tensors and the optimizer's state updated in place of the
    /// model's parameters (no `updates` given). An error on another device.
    pub fn run_whole_on_device(
        &mut self,
        params: &HashMap<String, Tensor>,
        batch: &HashMap<String, Tensor>,
        upload: bool,
        progress: &dyn Progress,
    ) -> Result<StepOutput, RunError> {
        let Kind::Gpu { gpu, plan, model } = &mut self.kind else {
            return Err(RunError::Gpu(Box::new(GpuError::Internal("a step on the device, not on wgpu".into()))));
        };
        let model = gpu_model(gpu, plan, model, params, upload, progress)?;
        let (outputs, _) = model.run_leaving(batch, &|name| name == LOSS || name == GRAD_SUMS)?;
        step_output(outputs)
    }

    /// On wgpu, writes `values` over the f32 parameter `name` of the step's model on the device
    /// (its shape's elements exactly), for the next run: a whole step's constants
    /// ([`kiln_compiler::train::update::STEP_CONSTANTS`]). An error on another device, or before
    /// the model is built.
    pub fn write_param(&mut self, name: &str, values: &[f32]) -> Result<(), RunError> {
        match &self.kind {
            Kind::Gpu { model: Some(m), .. } => Ok(m.write_param(name, values)?),
            _ => {
                Err(RunError::Gpu(Box::new(GpuError::Internal(format!("no model on the device to write `{name}` to")))))
            }
        }
    }

    /// The loss and gradients of `batch` with the parameters `params` (by tensor name).
    pub fn run(
        &mut self,
        params: &HashMap<String, Tensor>,
        batch: &HashMap<String, Tensor>,
        progress: &dyn Progress,
    ) -> Result<StepOutput, RunError> {
        let outputs = match &mut self.kind {
            Kind::Interp(graph) => interp::run(graph, params, batch)?,
            Kind::Cpu { plan, threads, model } => {
                let model = match model {
                    Some(m) => {
                        if !m.update_params(params)? {
                            m.set_params(params.clone(), HashMap::new(), progress)?;
                        }
                        m
                    }
                    None => model.insert(Box::new(CpuModel::for_training(
                        plan.clone(),
                        params.clone(),
                        *threads,
                        progress,
                    )?)),
                };
                model.run(batch)?
            }
            Kind::Gpu { gpu, plan, model } => gpu_model(gpu, plan, model, params, true, progress)?.run(batch)?,
        };
        step_output(outputs)
    }
}

/// Whether `params` holds every parameter of `plan` as an f32 tensor of its shape (what a model
/// built from them takes as given).
fn lendable(plan: &Plan, params: &HashMap<String, Tensor>) -> bool {
    plan.values.iter().all(|v| match &v.storage {
        lower::Storage::Param(name) => params.get(name).is_some_and(|t| {
            t.as_f32().is_some()
                && t.shape.len() == v.shape.len()
                && t.shape.iter().zip(&v.shape).all(|(&n, d)| *d == kiln_compiler::graph::Dim::Fixed(n))
        }),
        _ => true,
    })
}

/// The step's model on wgpu, built with `params` at its first use (nothing derived from them at
/// load time, `Options::params_vary`), else given `params` first if `upload`.
fn gpu_model<'m>(
    gpu: &Arc<Gpu>,
    plan: &Plan,
    model: &'m mut Option<Box<GpuModel>>,
    params: &HashMap<String, Tensor>,
    upload: bool,
    progress: &dyn Progress,
) -> Result<&'m mut GpuModel, RunError> {
    Ok(match model {
        Some(m) => {
            if upload {
                m.set_params(params, &HashMap::new(), progress)?;
            }
            m
        }
        None => model.insert(Box::new(GpuModel::with_progress(
            gpu.clone(),
            plan,
            &Options { params_vary: true, ..gpu.options() },
            params,
            &HashMap::new(),
            progress,
        )?)),
    })
}

/// A step's loss and gradients, from the graph's outputs.
fn step_output(outputs: Vec<(String, Tensor)>) -> Result<StepOutput, RunError> {
    let mut loss = None;
    let (mut grads, mut updates, mut grad_sums) = (HashMap::new(), HashMap::new(), None);
    for (name, t) in outputs {
        if name == LOSS {
            loss = t.as_f32().and_then(|v| v.first()).map(|&l| f64::from(l));
        } else if name == GRAD_SUMS {
            grad_sums = t.as_f32().map(<[f32]>::to_vec);
        } else if let Some(tensor) = name.strip_prefix("grad.") {
            grads.insert(tensor.to_string(), t);
        } else if let Some(tensor) = name.strip_prefix(UPDATE) {
            updates.insert(tensor.to_string(), t);
        }
    }
    Ok(StepOutput { loss: loss.ok_or(RunError::NoLoss)?, grads, grad_sums, updates })
}
