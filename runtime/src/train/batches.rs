//! Pre-batched training data: a tensor file with one leading index per step.
//!
//! `kiln train --batches FILE` trains on the batches of a safetensors file in order: tensors
//! `input_ids`, `labels` and, where the model reads them, `attention_mask`, `token_type_ids`,
//! `src_ids`, `src_mask`, `decoder_input_ids`, each `[steps, batch, seq]`; and an evaluation
//! batch under the same names prefixed `eval_` (`[batch, seq]`). This is how the PyTorch
//! fixtures record a run, so kiln's step `s` sees exactly the batch PyTorch's did.

use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// A model input as a batch file names it, and as the graph does (a sequence-to-sequence
/// decoder's ids are the graph's `tgt_ids`).
const ALIASES: [(&str, &str); 1] = [("decoder_input_ids", "tgt_ids")];

/// The prefix of the evaluation batch's tensors.
pub const EVAL: &str = "eval_";

/// What is wrong with a batch file.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// A per-step tensor without a leading step axis, or steps that disagree.
    #[error("batch tensor `{name}` has shape {shape:?}: {message}")]
    Shape {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// What is wrong.
        message: String,
    },
    /// No per-step tensor at all, or no `labels`.
    #[error("the batch file has no `{0}` tensor (one batch per step: [steps, batch, seq])")]
    Missing(&'static str),
    /// Fewer batches than steps asked for.
    #[error("{steps} steps asked for, but the batch file holds {held} batches")]
    TooFew {
        /// Steps asked for.
        steps: usize,
        /// Batches held.
        held: usize,
    },
}

/// The batches of a file, by step, and its evaluation batch.
#[derive(Clone, Debug)]
pub struct Batches {
    steps: usize,
    per_step: Vec<(String, Tensor)>,
    eval: HashMap<String, Tensor>,
}

impl Batches {
    /// The batches of `tensors` (a batch file's contents).
    pub fn new(tensors: HashMap<String, Tensor>) -> Result<Batches, BatchError> {
        let mut per_step = Vec::new();
        let mut eval = HashMap::new();
        let mut steps: Option<(usize, String)> = None;
        let mut names: Vec<String> = tensors.keys().cloned().collect();
        names.sort();
        let mut tensors = tensors;
        for name in names {
            let Some(t) = tensors.remove(&name) else { continue };
            if let Some(rest) = name.strip_prefix(EVAL) {
                eval.insert(alias(rest), t);
                continue;
            }
            let bad = |message: String| BatchError::Shape { name: name.clone(), shape: t.shape.clone(), message };
            let Some(&n) = t.shape.first().filter(|_| t.shape.len() >= 2) else {
                return Err(bad("expected one batch per step, [steps, batch, ...]".into()));
            };
            match &steps {
                Some((m, other)) if *m != n => {
                    return Err(bad(format!("{n} batches, but `{other}` has {m}")));
                }
                Some(_) => {}
                None => steps = Some((n, name.clone())),
            }
            per_step.push((alias(&name), t));
        }
        let Some((steps, _)) = steps else { return Err(BatchError::Missing("input_ids")) };
        if !per_step.iter().any(|(n, _)| n == kiln_compiler::train::LABELS) {
            return Err(BatchError::Missing("labels"));
        }
        Ok(Batches { steps, per_step, eval })
    }

    /// The number of batches.
    pub fn len(&self) -> usize {
        self.steps
    }

    /// Whether the file holds no batch.
    pub fn is_empty(&self) -> bool {
        self.steps == 0
    }

    /// Refuses a run of `steps` steps that needs more batches than the file holds.
    pub fn check_steps(&self, steps: usize) -> Result<(), BatchError> {
        match steps > self.steps {
            true => Err(BatchError::TooFew { steps, held: self.steps }),
            false => Ok(()),
        }
    }

    /// The batch of step `s` (`None` past the last), by the graph's input names.
    pub fn step(&self, s: usize) -> Option<HashMap<String, Tensor>> {
        // Entry `s` of each tensor's step axis, without that axis.
        let entry = |t: &Tensor| {
            let one = t.leading(s, 1)?;
            Some(Tensor { shape: one.shape.get(1..).unwrap_or_default().to_vec(), data: one.data })
        };
        (s < self.steps).then(|| self.per_step.iter().filter_map(|(name, t)| Some((name.clone(), entry(t)?))).collect())
    }

    /// Tokens per sequence: the last axis of the labels (`[steps, batch, seq]`).
    pub fn seq(&self) -> Option<usize> {
        let (_, labels) = self.per_step.iter().find(|(n, _)| n == kiln_compiler::train::LABELS)?;
        labels.shape.last().copied()
    }

    /// The evaluation batch, if the file has one.
    pub fn eval(&self) -> Option<&HashMap<String, Tensor>> {
        (!self.eval.is_empty()).then_some(&self.eval)
    }
}

fn alias(name: &str) -> String {
    ALIASES.iter().find(|(from, _)| *from == name).map_or(name, |(_, to)| to).to_string()
}
