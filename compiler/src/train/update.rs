//! The optimizer's update as the end of the step's graph: forward, loss, backward, clipping and
//! the update of every trained tensor in one graph, which the e-graph optimizes and an engine
//! runs as one plan.
//!
//! [`with_update`] takes a step's graph (outputs `loss` and `grad.<tensor>`) and adds:
//! - [`Op::SquareSums`] of every gradient, in the order of the trained tensors: the output
//!   [`GRAD_SUMS`], whose sum's root is the global norm the step logs and clips by;
//! - [`Op::ClipScale`] of the loss and those norms: the factor the updates read the gradients
//!   with (NaN, and no update taken, where the loss or the norm is not finite);
//! - per trained tensor, its update ([`Op::AdamW`] or [`Op::Sgd`], as the recipe says): the
//!   tensor (parameter `<tensor>`), its gradient, its optimizer state (parameters named as the
//!   optimizer's checkpoint names them, [`state_names`]), the factor and the step's constants
//!   (parameter [`STEP_CONSTANTS`], [`step_constants`]), giving the output `update.<tensor>`:
//!   the new tensor and state, stacked.
//!
//! The gradients stop being outputs: they live from the backward to their update. An engine
//! may write an update in place of the tensors it reads (the CPU's and wgpu's do), since nothing reads a
//! tensor after its update: lowering puts every update after every other step.

use super::{LOSS, OptimizerKind, Recipe, TrainGraphError};
use crate::graph::{Dim, Graph, GraphError, NodeIndex, Op, Scalar};

/// The output holding each gradient's squared L2 norm, `f32[n]`, in the order of the trained
/// tensors given to [`with_update`].
pub const GRAD_SUMS: &str = "grad_sums";

/// The parameter holding the step's constants (see [`step_constants`]).
pub const STEP_CONSTANTS: &str = "optim.step";

/// The prefix of the output holding a tensor's update: `update.<tensor>`.
pub const UPDATE: &str = "update.";

/// The names under which the optimizer `recipe` names keeps its state of `tensor`, in the
/// order the update reads them: AdamW's first and second moments (`adam.m.<tensor>`,
/// `adam.v.<tensor>`), SGD's momentum buffer (`sgd.momentum.<tensor>`, none without momentum).
pub fn state_names(recipe: &Recipe, tensor: &str) -> Vec<String> {
    match recipe.optimizer {
        OptimizerKind::AdamW => vec![format!("adam.m.{tensor}"), format!("adam.v.{tensor}")],
        OptimizerKind::Sgd if recipe.momentum != 0.0 => vec![format!("sgd.momentum.{tensor}")],
        OptimizerKind::Sgd => Vec::new(),
    }
}

/// The step's constants, [`STEP_CONSTANTS`]'s value, for step `t` (from 1) at learning rate
/// `lr`: AdamW's `(-lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * weight_decay)`, each computed
/// in f64 and rounded once; SGD's `(-lr, first)`, `first` 1 where `t` is 1.
pub fn step_constants(recipe: &Recipe, lr: f64, t: u64) -> Vec<f32> {
    match recipe.optimizer {
        OptimizerKind::AdamW => {
            let [b1, b2] = recipe.betas;
            let t = t as f64;
            vec![
                (-(lr / (1.0 - b1.powf(t)))) as f32,
                (1.0 - b2.powf(t)).sqrt() as f32,
                (1.0 - lr * recipe.weight_decay) as f32,
            ]
        }
        OptimizerKind::Sgd => vec![(-lr) as f32, if t == 1 { 1.0 } else { 0.0 }],
    }
}

/// The update op of a tensor of `shape` under `recipe`.
fn update_op(recipe: &Recipe, shape: &[usize]) -> Op {
    let decays = recipe.decays(shape) && recipe.weight_decay != 0.0;
    match recipe.optimizer {
        OptimizerKind::AdamW => {
            let [b1, b2] = recipe.betas;
            Op::AdamW {
                w1: Scalar((1.0 - b1) as f32),
                b2: Scalar(b2 as f32),
                w2: Scalar((1.0 - b2) as f32),
                eps: Scalar(recipe.eps as f32),
                decays,
            }
        }
        OptimizerKind::Sgd => Op::Sgd {
            momentum: (recipe.momentum != 0.0).then_some(Scalar(recipe.momentum as f32)),
            weight_decay: Scalar(if decays { recipe.weight_decay as f32 } else { 0.0 }),
        },
    }
}

/// `step` with the update of each of `trained` (tensor names, each a parameter of `step` with an
/// output `grad.<tensor>`) by the optimizer `recipe` names: outputs `loss`, [`GRAD_SUMS`] and
/// `update.<tensor>` for each (see the module's documentation). Its other outputs are kept; the
/// gradients are not outputs any more.
pub fn with_update(step: &Graph, trained: &[String], recipe: &Recipe) -> Result<Graph, TrainGraphError> {
    let mut g = step.clone();
    let missing =
        |what: String| TrainGraphError::Graph(GraphError { op: "update".into(), scope: String::new(), message: what });
    let output = |g: &Graph, name: &str| g.outputs.iter().find(|(n, _)| n == name).map(|&(_, n)| n);
    let loss = output(&g, LOSS).ok_or_else(|| missing(format!("the step has no `{LOSS}` output")))?;
    let params: Vec<(NodeIndex, String)> = g.params().into_iter().map(|(n, name)| (n, name.to_string())).collect();
    let mut grads = Vec::with_capacity(trained.len());
    let mut values = Vec::with_capacity(trained.len());
    for tensor in trained {
        let grad = output(&g, &format!("grad.{tensor}"))
            .ok_or_else(|| missing(format!("the step has no gradient of `{tensor}`")))?;
        let value = params
            .iter()
            .find(|(_, name)| name == tensor)
            .map(|&(n, _)| n)
            .ok_or_else(|| missing(format!("the step reads no parameter `{tensor}`")))?;
        grads.push(grad);
        values.push(value);
    }
    if trained.is_empty() {
        return Err(missing("no tensor is trained".into()));
    }
    g.scope = "optimizer".into();
    let sums = g.add(Op::SquareSums, &grads)?;
    let scale = g.add(Op::ClipScale { max_norm: recipe.clip.map(|c| Scalar(c as f32)) }, &[loss, sums])?;
    let constants = match recipe.optimizer {
        OptimizerKind::AdamW => 3,
        OptimizerKind::Sgd => 2,
    };
    let step_constants = g.param(STEP_CONSTANTS, &[constants]);
    g.outputs.retain(|(name, _)| !name.starts_with("grad."));
    g.outputs.push((GRAD_SUMS.into(), sums));
    for ((tensor, &grad), &value) in trained.iter().zip(&grads).zip(&values) {
        let shape: Vec<usize> = g.g[value]
            .shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => Ok(*n),
                Dim::Sym(_) => Err(missing(format!("the parameter `{tensor}` has a symbolic shape"))),
            })
            .collect::<Result<_, _>>()?;
        g.scope = format!("optimizer.{tensor}");
        let mut operands = vec![value, grad];
        for name in state_names(recipe, tensor) {
            operands.push(g.param(&name, &shape));
        }
        operands.extend([scale, step_constants]);
        let update = g.add(update_op(recipe, &shape), &operands)?;
        g.outputs.push((format!("{UPDATE}{tensor}"), update));
    }
    g.scope = String::new();
    Ok(g)
}
