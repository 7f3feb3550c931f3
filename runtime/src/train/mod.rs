//! Training: running a training graph on a device, and on the host the recipe, the
//! learning-rate schedule and the optimizer.
//!
//! The gradient graph (autodiff in the compiler) gives a loss and a gradient per parameter; what
//! turns those into the next parameters lives here, on the host, in plain f32 slices:
//!
//! - [`run`]: [`StepRunner`](run::StepRunner), a training graph (loss and gradients) on the
//!   interpreter or the CPU back end; [`batches`]: pre-batched data, one batch per step;
//! - [`recipe`] (the language's, re-exported from [`kiln_compiler::train`]: a spec's `[train]`
//!   section is one): [`Recipe`], the hyperparameters of a run, read from JSON or TOML
//!   ([`RecipeFile`], every key optional, so a file, a spec and command-line flags can be layered
//!   with [`RecipeFile::merge`] before [`RecipeFile::resolve`] fills the defaults and validates),
//!   and the `frozen` globs;
//! - [`schedule`]: the learning rate at each step ([`LrSchedule`]: warm-up, then cosine, linear,
//!   constant or inverse-square-root);
//! - [`optim`]: AdamW and SGD with momentum, each the same arithmetic as PyTorch's
//!   (`torch.optim.AdamW`, `torch.optim.SGD`), global-norm clipping as `clip_grad_norm_`,
//!   gradient accumulation over micro-batches, and the optimizer state as named tensors so a
//!   checkpoint can hold it and a resumed run continues bit for bit.
//!
//! Why on the host: an optimizer step is a handful of element-wise operations per parameter,
//! memory-bound and a small share of a step's time next to the forward and backward passes; on
//! the host it is exact, testable against PyTorch's formulas, and shared by both back ends.
//! **Invariant:** nothing here depends on a back end; the trainer hands over slices.

pub mod batches;
pub mod data;
pub mod feed;
pub mod init;
pub mod optim;
pub mod run;
pub mod trainer;

pub use kiln_compiler::train::{
    Clip, Format, LrSchedule, OptimizerKind, Recipe, RecipeError, RecipeFile, ScheduleKind, glob_match, recipe,
    schedule,
};
pub use optim::{AdamW, GradAccumulator, OptimError, Optimizer, Sgd, Update, clip_grad_norm};
pub use trainer::{StepGraphs, StepLog, TrainError, Trainer, frozen_tensors, step_graphs};
