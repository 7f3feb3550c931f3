//! How an ordinary cached step's plan runs several sequences' decode steps together
//! (continuous batching), decided once per plan and shared by the engines that batch
//! ([`CpuModel::run_batched`](crate::CpuModel::run_batched),
//! [`GpuModel::run_batched`](crate::GpuModel::run_batched)).
//!
//! A server decoding many sequences at once reads every weight once per step for all of them,
//! not once per sequence: the projections, norms and the head run over a `[batch, 1, ..]` tensor
//! whose row `i` is sequence `i`'s token. What differs between the sequences is where they are:
//! each has its own key/value cache, of its own length, and its token its own position. So the
//! plan, built for one position for the whole batch ([`Sym::Past`]), runs with each value held in
//! one of four ways ([`Mode`]) and each step run in one of a few ways ([`Exec`]):
//!
//! - a step whose operands are constants or batched values, and which does not depend on the
//!   positions, runs once over the batch; so does one that depends on them where the engine's
//!   kernel takes a position per row (the `batched_positions` of [`BatchPlan::new`]);
//! - a step that reads a cache, or any value with a cache's length in its shape, or one whose
//!   kernel knows only one position, runs once per sequence on that sequence's part of its
//!   operands: attention over each sequence's own cache, the appends of each sequence's keys and
//!   values to its own cache;
//! - a value made per sequence is written into its row of the batched tensor where it has the
//!   batch axis first and no cache length ([`Mode::Batched`]), else kept per sequence
//!   ([`Mode::Rows`]).
//!
//! A plan this cannot run — inputs besides token ids and caches (an encoder's memory, masks), a
//! batch axis that is not a shape's first, an output the same for every sequence — is refused
//! with the reason; its sequences take turns.

#![expect(clippy::indexing_slicing, reason = "value and step indices come from a plan `Plan::check` bounded")]

use crate::prepare::{self, root};
use kiln_compiler::graph::{Dim, InputRole, Op, Sym};
use kiln_compiler::lower::{Plan, Step, Storage};
use std::collections::HashMap;

/// How a batched run holds a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The same for every sequence: a constant, or a value computed from constants alone.
    Shared,
    /// One `[batch, ..]` tensor whose part `i` (of `1 / batch` of it) is sequence `i`'s.
    Batched,
    /// One tensor per sequence, of that sequence's shape: a value with a cache length in its shape,
    /// or one of its positions without a batch axis.
    Rows,
    /// A cache input, or a present appended in place: each sequence's own buffer.
    Cache,
}

/// How a batched run runs a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exec {
    /// Not run (a weight the engine reads in place).
    Skip,
    /// Once over the batch.
    Batched,
    /// Once per sequence, on its part of each operand.
    PerRow,
    /// Once per sequence, appending its new rows to its cache (the engine's append site of this
    /// index).
    Append(usize),
}

/// A plan as a batched run runs it.
pub(crate) struct BatchPlan {
    /// By value: how a batched run holds it (meaningful for the values that are not aliases).
    pub(crate) modes: Vec<Mode>,
    /// By step.
    pub(crate) steps: Vec<Exec>,
    /// The plan's input values.
    pub(crate) inputs: Vec<usize>,
    /// The token-id input: value and name.
    pub(crate) ids: (usize, String),
}

/// Whether a shape has a cache's length in it (which differs between sequences).
fn ragged(shape: &[Dim]) -> bool {
    shape.iter().any(|d| matches!(d, Dim::Sym(Sym::Past | Sym::Ctx | Sym::Recent | Sym::RecentCtx)))
}

/// Whether `op` reads the positions of its rows.
pub(crate) fn positional(op: &Op) -> bool {
    matches!(op, Op::Positions { .. } | Op::Rope { .. })
        || matches!(op, Op::Linear { rope: Some(_), .. } | Op::Heads { rope: Some(_), .. })
}

impl BatchPlan {
    /// How `plan` runs batched on an engine, or why it cannot: `skipped`, the steps the engine
    /// does not run; `appends`, the steps it runs as appends to a cache in place (by step, the
    /// engine's index of the site); `batched_positions`, whether its kernel for a step that reads
    /// positions takes one per row.
    pub(crate) fn new(
        plan: &Plan,
        skipped: impl Fn(usize) -> bool,
        appends: &HashMap<usize, usize>,
        batched_positions: impl Fn(&Step) -> bool,
    ) -> Result<BatchPlan, String> {
        if let Some(v) = plan.values.iter().find(|v| v.shape.iter().skip(1).any(|d| *d == Dim::Sym(Sym::Batch))) {
            return Err(format!("a value of shape {:?} has the batch axis after its first", v.shape));
        }
        let mut modes = vec![Mode::Shared; plan.values.len()];
        let mut ids = None;
        for (i, v) in plan.values.iter().enumerate() {
            if let Storage::Input { name, role } = &v.storage {
                match role {
                    InputRole::Ids if ids.is_none() => {
                        ids = Some((i, name.clone()));
                        modes[i] = Mode::Batched;
                    }
                    InputRole::Cache { .. } => modes[i] = Mode::Cache,
                    _ => return Err(format!("it reads `{name}`, which is neither the token ids nor a cache")),
                }
            }
        }
        let ids = ids.ok_or("it reads no token ids")?;
        if !modes.contains(&Mode::Cache) {
            return Err("it is not a cached step".into());
        }
        let mut steps = Vec::with_capacity(plan.steps.len());
        for (i, step) in plan.steps.iter().enumerate() {
            let out = step.output;
            if skipped(i) {
                steps.push(Exec::Skip);
                continue;
            }
            if let Some(&k) = appends.get(&i) {
                modes[out] = Mode::Cache;
                steps.push(Exec::Append(k));
                continue;
            }
            let operands: Vec<Mode> = step.operands.iter().map(|&o| modes[root(plan, o)]).collect();
            let written = || std::iter::once(out).chain(step.also.iter().copied());
            let per_row = operands.iter().any(|m| matches!(m, Mode::Rows | Mode::Cache))
                || written().any(|v| ragged(&plan.values[v].shape))
                || (positional(&step.op) && !batched_positions(step));
            let batched = operands.contains(&Mode::Batched);
            for v in written() {
                let shape = &plan.values[v].shape;
                let batch_first = shape.first() == Some(&Dim::Sym(Sym::Batch));
                modes[v] = match (per_row, batched) {
                    (true, _) if batch_first && !ragged(shape) => Mode::Batched,
                    (true, _) => Mode::Rows,
                    (false, true) if batch_first => Mode::Batched,
                    (false, true) => {
                        return Err(format!(
                            "`{}` ({}) combines the sequences of the batch",
                            step.scope,
                            step.op.name()
                        ));
                    }
                    (false, false) if batch_first => Mode::Batched,
                    (false, false) => Mode::Shared,
                };
            }
            steps.push(if per_row { Exec::PerRow } else { Exec::Batched });
        }
        for (name, v) in &plan.outputs {
            if modes[root(plan, *v)] == Mode::Shared {
                return Err(format!("its output `{name}` is the same for every sequence"));
            }
        }
        Ok(BatchPlan { modes, steps, inputs: prepare::input_values(plan), ids })
    }
}
