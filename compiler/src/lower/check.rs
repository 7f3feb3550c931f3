//! [`Plan::check`], the one validator of a plan that did not come from [`lower`](super::lower)
//! (an artifact's): what lowering guarantees and every engine relies on, with a [`PlanError`]
//! per broken guarantee. Both engines call it when they load a plan, and `artifact::read` when
//! it reads one.

use super::{MAX_FIXED_ELEMENTS, Plan, Storage};
use crate::graph::{Dim, Shape, infer};
use crate::tensor::DType;

/// What reads a value of a plan: a step, a fold or a named output (for [`PlanError::Index`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reader {
    /// Step `i` (an operand or an output).
    Step(usize),
    /// Fold `i` (an operand or its output).
    Fold(usize),
    /// The named output.
    Output(String),
}

impl std::fmt::Display for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reader::Step(i) => write!(f, "step {i}"),
            Reader::Fold(i) => write!(f, "fold {i}"),
            Reader::Output(name) => write!(f, "output `{name}`"),
        }
    }
}

/// A broken guarantee of a plan ([`Plan::check`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// More shared buffers than values.
    #[error("{slots} shared buffers for {values} values")]
    Slots {
        /// Shared buffers.
        slots: usize,
        /// Values.
        values: usize,
    },
    /// A value placed in a shared buffer that does not exist.
    #[error("value {value} is in buffer {slot} of {slots}")]
    Slot {
        /// The value.
        value: usize,
        /// Its buffer.
        slot: usize,
        /// Shared buffers.
        slots: usize,
    },
    /// A value aliasing itself or a later value (alias chains must end).
    #[error("value {value} aliases value {target}, not an earlier one")]
    Alias {
        /// The value.
        value: usize,
        /// The value it aliases.
        target: usize,
    },
    /// A value with more than [`MAX_FIXED_ELEMENTS`] elements in its fixed dimensions.
    #[error("value {value} has more than {MAX_FIXED_ELEMENTS} elements")]
    TooLarge {
        /// The value.
        value: usize,
    },
    /// A value index out of range.
    #[error("{reader} reads value {index} of {values}")]
    Index {
        /// What reads it.
        reader: Reader,
        /// The index.
        index: usize,
        /// Values.
        values: usize,
    },
    /// A fold writing a value that is not a constant.
    #[error("fold {fold} writes value {value}, which is not a constant")]
    FoldOutput {
        /// The fold.
        fold: usize,
        /// The value it writes.
        value: usize,
    },
    /// A step whose op does not accept its operands (`graph::infer`'s message).
    #[error("step {step} (`{scope}`): {message}")]
    IllTyped {
        /// The step.
        step: usize,
        /// Its scope.
        scope: String,
        /// Why its op refuses its operands.
        message: String,
    },
    /// A step whose operands give another shape or type than the plan declares for its output.
    #[error("step {step} (`{scope}`): its operands give {inferred:?}, the plan says {declared:?}")]
    Mistyped {
        /// The step.
        step: usize,
        /// Its scope.
        scope: String,
        /// The shape its operands give.
        inferred: Shape,
        /// The shape the plan declares.
        declared: Shape,
    },
}

impl Plan {
    /// Checks a plan that did not come from [`lower`](super::lower) (an artifact's) for what
    /// lowering guarantees and the engines rely on: every index (value, slot) in range, aliases
    /// pointing to earlier values (so alias chains end), folds producing constants, shapes within
    /// [`MAX_FIXED_ELEMENTS`], and every step's op accepting its operands and giving the shape and
    /// type the plan declares for its output (symbolic dimensions checked as symbols). (Each back
    /// end checks at load what it needs beyond this, such as the formats it stores.)
    pub fn check(&self) -> Result<(), PlanError> {
        let n = self.values.len();
        if self.slots > n {
            return Err(PlanError::Slots { slots: self.slots, values: n });
        }
        for (i, v) in self.values.iter().enumerate() {
            match v.storage {
                Storage::Slot(s) if s >= self.slots => {
                    return Err(PlanError::Slot { value: i, slot: s, slots: self.slots });
                }
                Storage::Alias(a) if a >= i => return Err(PlanError::Alias { value: i, target: a }),
                _ => {}
            }
            let fixed = v.shape.iter().try_fold(1u64, |acc, d| match d {
                Dim::Fixed(k) => acc.checked_mul(*k as u64).filter(|&e| e <= MAX_FIXED_ELEMENTS),
                Dim::Sym(_) => Some(acc),
            });
            if fixed.is_none() {
                return Err(PlanError::TooLarge { value: i });
            }
        }
        let value = |index: usize, reader: Reader| -> Result<(), PlanError> {
            if index < n { Ok(()) } else { Err(PlanError::Index { reader, index, values: n }) }
        };
        for (i, step) in self.steps.iter().enumerate() {
            for o in step.operands.iter().copied().chain(step.outputs()) {
                value(o, Reader::Step(i))?;
            }
        }
        for (i, fold) in self.folds.iter().enumerate() {
            for &o in fold.operands.iter().chain([&fold.output]) {
                value(o, Reader::Fold(i))?;
            }
            if self.values[fold.output].storage != Storage::Const {
                return Err(PlanError::FoldOutput { fold: i, value: fold.output });
            }
        }
        for (name, v) in &self.outputs {
            value(*v, Reader::Output(name.clone()))?;
        }
        self.check_steps()
    }

    /// Every step's op accepts its operands' shapes and types and gives its output's (the
    /// indices already checked).
    fn check_steps(&self) -> Result<(), PlanError> {
        for (i, step) in self.steps.iter().enumerate() {
            let typed: Vec<(&Shape, DType)> =
                step.operands.iter().map(|&o| (&self.values[o].shape, self.values[o].dtype)).collect();
            let (inferred, dtype) = infer(&step.op, &typed).map_err(|message| PlanError::IllTyped {
                step: i,
                scope: step.scope.clone(),
                message,
            })?;
            let out = &self.values[step.output];
            if inferred != out.shape || dtype != out.dtype {
                return Err(PlanError::Mistyped {
                    step: i,
                    scope: step.scope.clone(),
                    inferred,
                    declared: out.shape.clone(),
                });
            }
        }
        Ok(())
    }
}
