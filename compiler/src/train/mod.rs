//! Training as the language declares it: the recipe ([`recipe`]: a spec's `[train]` section, or a
//! file of the same keys) with its learning-rate schedule ([`schedule`]), and the training graph —
//! a model's forward graph with its loss, and the loss's gradients with respect to the checkpoint
//! tensors being trained.
//!
//! [`loss_graph`] adds the objective to a forward graph: an input `labels` (`i64[batch, seq]`,
//! aligned with the positions whose scores they grade) and one output `loss`, the mean
//! [`Op::CrossEntropy`] of the `logits` output against them. Every objective the language
//! trains is this loss over differently prepared labels — next-token prediction (labels are the
//! ids shifted left), masked-token prediction (the original ids at masked positions), teacher-
//! forced sequence-to-sequence (the target ids, the decoder's input shifted right) — so the
//! preparation lives with the data, and the graph has one form.
//!
//! [`training_graph`] then puts the graph on its checkpoint's tensors ([`sources::on_tensors`])
//! and builds the backward into it ([`crate::autodiff::gradients`]): outputs `loss` and
//! `grad.<tensor>` for each tensor trained.

pub mod recipe;
pub mod recompute;
pub mod schedule;
pub mod sources;
pub mod update;

use crate::autodiff::{AutodiffError, gradients};
use crate::graph::{Dim, Graph, GraphError, InputRole, Op, Scalar, Sym};
use crate::spec::weightmap::{PackDims, WeightMap};
pub use recipe::{
    Bytes, Clip, Format, OptimizerKind, Recipe, RecipeError, RecipeFile, Recompute, ScheduleKind, glob_match,
};
pub use schedule::LrSchedule;
pub use sources::{SourceError, TensorUse, on_tensors};

/// The label of positions that take no loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// The name of the labels input.
pub const LABELS: &str = "labels";

/// The name of the loss output.
pub const LOSS: &str = "loss";

/// What a training graph could not be built from.
#[derive(Debug, thiserror::Error)]
pub enum TrainGraphError {
    /// The forward graph has no `logits` output to take a loss of.
    #[error("the model has no `logits` output to train against (is `outputs.logits = false`?)")]
    NoLogits,
    /// The label smoothing is outside `[0, 1)`.
    #[error("label smoothing {0} is outside [0, 1)")]
    Smoothing(f64),
    /// Typing the loss failed.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// Reading the parameters from their tensors.
    #[error(transparent)]
    Sources(#[from] SourceError),
    /// Building the backward.
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    /// The recomputation the recipe asks for is not possible.
    #[error("recipe: {0}")]
    Recompute(String),
}

/// The loss a graph is trained on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Objective {
    /// Label smoothing, in `[0, 1)` (0: none).
    pub label_smoothing: f64,
}

/// `forward` with an input `labels` and one output, `loss`: the mean cross-entropy of its
/// `logits` against the labels, the positions labelled [`IGNORE_INDEX`] left out. The other
/// outputs are dropped.
pub fn loss_graph(forward: &Graph, objective: Objective) -> Result<Graph, TrainGraphError> {
    let smoothing = objective.label_smoothing;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(TrainGraphError::Smoothing(smoothing));
    }
    let &(_, logits) = forward.outputs.iter().find(|(n, _)| n == "logits").ok_or(TrainGraphError::NoLogits)?;
    let mut g = forward.clone();
    // The labels grade the positions of the logits: their sequence axis is the logits'.
    let seq = match g.g[logits].shape.get(1) {
        Some(Dim::Sym(s)) => *s,
        _ => Sym::Seq,
    };
    g.scope = "loss".into();
    let labels = g.add(Op::Input { name: LABELS.into(), role: InputRole::Labels, seq }, &[])?;
    let op = Op::CrossEntropy { smoothing: Scalar(smoothing as f32), ignore_index: IGNORE_INDEX };
    let loss = g.add(op, &[logits, labels])?;
    g.scope = String::new();
    g.outputs = vec![(LOSS.into(), loss)];
    Ok(g)
}

/// The memory a training step needs, in bytes: what [`step_memory`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StepMemory {
    /// The trained and frozen tensors (f32).
    pub weights: u64,
    /// One gradient per trained element.
    pub gradients: u64,
    /// The optimizer's state: AdamW's two moments, SGD's momentum.
    pub optimizer: u64,
    /// The most the step's other values (activations, their gradients, the loss) hold at once,
    /// each freed after its last reader, in the graph's order.
    pub activations: u64,
}

impl StepMemory {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations
    }
}

/// The memory of one step of `graph` (a training graph: [`training_graph`]) at `batch` sequences of
/// `seq` tokens, its parameters read from `weights` elements (of which `trained` have gradients),
/// the optimizer keeping `moments` values per trained element (2 for AdamW, 1 for SGD with
/// momentum, 0 without). The activations are the graph's as autodiff builds it, values live from
/// their op to their last reader; an engine's fused plan holds less.
pub fn step_memory(graph: &Graph, batch: usize, seq: usize, weights: u64, trained: u64, moments: u64) -> StepMemory {
    use std::collections::HashMap;
    let syms: HashMap<Sym, usize> =
        [(Sym::Batch, batch), (Sym::Seq, seq), (Sym::SrcSeq, seq), (Sym::Past, 0), (Sym::Ctx, seq)].into();
    let peak = crate::lower::schedule::peak(graph, &graph.order(), &syms);
    StepMemory { weights: 4 * weights, gradients: 4 * trained, optimizer: 4 * moments * trained, activations: peak }
}

/// The training graph of `forward`: on its checkpoint's tensors (read through `map`), outputs
/// `loss` and `grad.<tensor>` for every tensor `trains` accepts; and where each parameter is
/// read from.
pub fn training_graph(
    forward: &Graph,
    objective: Objective,
    map: &WeightMap,
    dims: &PackDims,
    trains: impl Fn(&str) -> bool,
) -> Result<(Graph, Vec<TensorUse>), TrainGraphError> {
    let loss = loss_graph(forward, objective)?;
    let (on_tensors, uses) = on_tensors(&loss, map, dims)?;
    Ok((gradients(&on_tensors, LOSS, trains)?, uses))
}
