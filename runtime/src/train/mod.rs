//! Training: running a training graph, the optimizer, the schedule and the recipe.

pub mod batches;
pub mod run;
