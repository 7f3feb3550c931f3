//! [`Feed`]: where a training run's batches come from — a batch file (one batch per step, as the
//! PyTorch fixtures record them) or a corpus (random windows, seeded) — with the step's
//! micro-batches, the evaluation batches, and the position in the data as named tensors for a
//! checkpoint, so that a resumed run reads exactly what the uninterrupted run would have.

use super::batches::{BatchError, Batches};
use super::data::{Corpus, DataError, SamplerState, Split};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// A batch of named inputs.
pub type Batch = HashMap<String, Tensor>;

/// The name of the corpus sampler's state in a training state.
const RNG: &str = "data.rng";
/// The windows a corpus sampler has drawn.
const WINDOWS: &str = "data.windows";

/// What can go wrong feeding a run.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    /// From a batch file.
    #[error(transparent)]
    Batches(#[from] BatchError),
    /// From a corpus.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A batch that does not split into the micro-batches asked for.
    #[error("a batch of {rows} sequences does not split into {accumulate} equal micro-batches")]
    Split {
        /// Sequences in the batch.
        rows: usize,
        /// Micro-batches asked for.
        accumulate: usize,
    },
    /// A training state without the data position its feed needs.
    #[error("the training state has no `{0}` (it was not written by a run on a corpus)")]
    NoPosition(&'static str),
}

/// Batches for a run.
pub enum Feed {
    /// A batch file's batches, in order.
    Batches(Batches),
    /// Random windows of a corpus.
    Corpus {
        /// The corpus.
        corpus: Box<Corpus>,
        /// Sequences per micro-batch.
        batch: usize,
        /// Validation batches per evaluation.
        eval_batches: usize,
    },
}

impl Feed {
    /// Tokens per sequence of the batches it gives.
    pub fn seq(&self) -> Option<usize> {
        match self {
            Feed::Batches(b) => b.seq(),
            Feed::Corpus { corpus, .. } => Some(corpus.seq()),
        }
    }

    /// The micro-batches of step `step`: a batch file's batch `step` cut into `accumulate` equal
    /// parts along its rows, or `accumulate` batches of random windows.
    pub fn step(&mut self, step: usize, accumulate: usize) -> Result<Vec<Batch>, FeedError> {
        let accumulate = accumulate.max(1);
        match self {
            Feed::Batches(b) => {
                let batch = b.step(step).ok_or(BatchError::TooFew { steps: step + 1, held: b.len() })?;
                split(batch, accumulate)
            }
            Feed::Corpus { corpus, batch, .. } => {
                (0..accumulate).map(|_| Ok(corpus.batch(Split::Train, *batch)?)).collect()
            }
        }
    }

    /// The evaluation batches: a batch file's `eval_` batch, or the corpus's first validation
    /// windows (the same at every evaluation).
    pub fn eval(&self) -> Result<Vec<Batch>, FeedError> {
        Ok(match self {
            Feed::Batches(b) => b.eval().cloned().into_iter().collect(),
            Feed::Corpus { corpus, batch, eval_batches } => corpus.eval_batches(*batch, *eval_batches)?,
        })
    }

    /// The position in the data, as named tensors (none for a batch file: the step is its
    /// position).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        match self {
            Feed::Batches(_) => Vec::new(),
            Feed::Corpus { corpus, .. } => {
                let SamplerState { rng, windows } = corpus.state();
                // The generator's 64 bits stored as an i64's (a bit cast, undone by `restore`).
                vec![
                    (RNG.into(), Tensor::i64(vec![1], vec![i64::from_ne_bytes(rng.to_ne_bytes())])),
                    (WINDOWS.into(), Tensor::i64(vec![1], vec![i64::try_from(windows).unwrap_or(i64::MAX)])),
                ]
            }
        }
    }

    /// Restores [`Feed::state`] from a training state.
    pub fn restore(&mut self, state: &HashMap<String, Tensor>) -> Result<(), FeedError> {
        let Feed::Corpus { corpus, .. } = self else { return Ok(()) };
        let one = |name: &'static str| {
            state.get(name).and_then(|t| t.as_i64()).and_then(|v| v.first().copied()).ok_or(FeedError::NoPosition(name))
        };
        let rng = u64::from_ne_bytes(one(RNG)?.to_ne_bytes());
        let windows = u64::try_from(one(WINDOWS)?).unwrap_or(0);
        corpus.restore(SamplerState { rng, windows });
        Ok(())
    }
}

/// `batch` cut into `parts` equal parts along its rows (every tensor's leading axis).
fn split(batch: Batch, parts: usize) -> Result<Vec<Batch>, FeedError> {
    if parts == 1 {
        return Ok(vec![batch]);
    }
    let rows = batch.values().next().and_then(|t| t.shape.first().copied()).unwrap_or(0);
    if rows == 0 || !rows.is_multiple_of(parts) || batch.values().any(|t| t.shape.first() != Some(&rows)) {
        return Err(FeedError::Split { rows, accumulate: parts });
    }
    let per = rows / parts;
    Ok((0..parts)
        .map(|p| batch.iter().filter_map(|(name, t)| Some((name.clone(), t.leading(p * per, per)?))).collect())
        .collect())
}
