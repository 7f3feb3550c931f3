//! The CPU back end's writer: what `kiln-runtime`'s native engine (`cpu`) decides from the plan
//! alone, before any weight is loaded.
//!
//! The engine runs the plan's steps as they are: a native kernel for each op it has one for, the
//! interpreter's evaluation for the others, so no step is rewritten here. What a plan decides is
//! the layout the engine holds its constants in:
//!
//! - **projection weights**: each value read as a projection's weight (`[n, k]` in the plan) is
//!   held transposed, `[k, n]`, the layout the engine's GEMM reads fastest, except one something
//!   else reads too (an embedding table tied to the output projection), which is held once, in the
//!   plan's layout, that both read (the GEMM reads either);
//! - **gather tables**: an f32 parameter read only as the table of gather steps may stay in the
//!   quantized blocks a checkpoint gives it in, each looked-up row dequantized, so an embedding
//!   table stored quantized is never expanded to f32.
//!
//! [`write`] is a pure function of the plan; the engine applies its [`Program`] to the constants
//! it loads (only an f32 constant is transposed; only a table given as blocks stays blocks).

use crate::graph::Op;
use crate::lower::{Plan, Storage, root};
use std::collections::BTreeSet;

/// How the CPU engine holds a plan's constants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Program {
    /// The values read as a projection's weight, in value order.
    pub weights: Vec<Weight>,
    /// The f32 parameters read only as the table of gather steps, in value order.
    pub gather_tables: Vec<usize>,
}

/// A value read as a projection's weight, to be held transposed unless it is also read otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Weight {
    /// The value (the root of the operands' aliases).
    pub value: usize,
    /// Whether a step reads it otherwise or the plan outputs it, so that it is held once, as the
    /// `[n, k]` original, rather than in two layouts (a tied embedding table).
    pub also_read: bool,
}

/// The CPU engine's layout of `plan`'s constants.
pub fn write(plan: &Plan) -> Program {
    let root = |v: usize| root(&plan.values, v);
    let mut weights: BTreeSet<usize> = BTreeSet::new();
    let mut other: BTreeSet<usize> = BTreeSet::new();
    for step in &plan.steps {
        let wi = step.op.linear_weight();
        for (i, &o) in step.operands.iter().enumerate() {
            if Some(i) == wi {
                weights.insert(root(o))
            } else {
                other.insert(root(o))
            };
        }
    }
    other.extend(plan.outputs.iter().map(|&(_, v)| root(v)));
    let weights = weights.into_iter().map(|value| Weight { value, also_read: other.contains(&value) }).collect();
    let gather_tables = plan
        .values
        .iter()
        .enumerate()
        .filter(|(id, v)| matches!(v.storage, Storage::Param(_)) && v.format.is_f32() && only_gathered(plan, *id))
        .map(|(id, _)| id)
        .collect();
    Program { weights, gather_tables }
}

/// Whether value `id` is read only as the table of gather steps (no fold, no other step, no
/// output reads it).
fn only_gathered(plan: &Plan, id: usize) -> bool {
    let reads = |o: &usize| root(&plan.values, *o) == id;
    let mut gathered = false;
    for step in &plan.steps {
        for (i, o) in step.operands.iter().enumerate() {
            if reads(o) {
                if step.op != Op::Gather || i != 0 {
                    return false;
                }
                gathered = true;
            }
        }
    }
    gathered && !plan.folds.iter().any(|f| f.operands.iter().any(reads)) && !plan.outputs.iter().any(|(_, v)| reads(v))
}
