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
//! - **weights stored `[in, out]`**: a projection weight that is the transpose of an f32 parameter
//!   (a GPT-2 `Conv1D` weight in a training plan, which folds nothing), or a row range of that
//!   transpose (a packed `c_attn`'s part), is read from the parameter itself, which is that
//!   transpose's `[k, n]` layout (a column range of it, by its row stride): the steps computing the
//!   transpose and its slices are not run where projections and products reading it as their
//!   right-hand matrix are all that read them;
//! - **gather tables**: an f32 parameter read only as the table of gather steps may stay in the
//!   quantized blocks a checkpoint gives it in, each looked-up row dequantized, so an embedding
//!   table stored quantized is never expanded to f32.
//!
//! [`write()`] is a pure function of the plan; the engine applies its [`Program`] to the constants
//! it loads (only an f32 constant is transposed; only a table given as blocks stays blocks).

use crate::graph::Op;
use crate::lower::{Plan, Storage, root};
use std::collections::{BTreeMap, BTreeSet};

/// How the CPU engine holds a plan's constants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Program {
    /// The values read as a projection's weight, in value order.
    pub weights: Vec<Weight>,
    /// The f32 parameters read only as the table of gather steps, in value order.
    pub gather_tables: Vec<usize>,
    /// Projection weights read from a parameter stored `[k, n]`, in value order.
    pub weight_views: Vec<WeightView>,
    /// The steps that compute only such weights (their transposes and slices), not run.
    pub skipped: Vec<usize>,
}

/// A projection's `[n, k]` weight that is rows `start..start + n` of the transpose of an f32
/// parameter stored `[k, cols]`: columns `start..` of the parameter, read with row stride `cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightView {
    /// The weight (the root of the operands' aliases).
    pub value: usize,
    /// The parameter it reads.
    pub param: usize,
    /// Its first column in the parameter.
    pub start: usize,
    /// The parameter's row stride (its column count).
    pub cols: usize,
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
    let (weight_views, skipped) = weight_views(plan);
    Program { weights, gather_tables, weight_views, skipped }
}

/// Whether operand `i` of `op` may be a [`WeightView`]: a projection's weight, or the right-hand
/// matrix of a product (an input's gradient, `dy @ W`, reads the forward's weight so, with an
/// activation's gradient after it or not).
pub fn reads_as_weight(op: &Op, i: usize) -> bool {
    op.linear_weight() == Some(i) || (matches!(op, Op::MatMul { .. } | Op::MatMulActGrad { .. }) && i == 1)
}

/// The projection weights read from a parameter stored `[k, n]` (see [`WeightView`]) and the
/// steps that need not run for them: a `permute [1, 0]` of an f32 parameter, and `slice`s of its
/// rows, where every reader of each is a projection's weight operand, a product's right-hand
/// matrix ([`reads_as_weight`]) or such a slice, and no fold or output reads them.
fn weight_views(plan: &Plan) -> (Vec<WeightView>, Vec<usize>) {
    let root = |v: usize| root(&plan.values, v);
    // How each value is read: as a projection's weight, by a step of another kind, or otherwise.
    let mut as_weight: BTreeSet<usize> = BTreeSet::new();
    let mut readers: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut elsewhere: BTreeSet<usize> = BTreeSet::new();
    for (i, step) in plan.steps.iter().enumerate() {
        for (j, &o) in step.operands.iter().enumerate() {
            if reads_as_weight(&step.op, j) {
                as_weight.insert(root(o));
            } else {
                readers.entry(root(o)).or_default().push(i);
            }
        }
    }
    elsewhere.extend(plan.outputs.iter().map(|&(_, v)| root(v)));
    elsewhere.extend(plan.folds.iter().flat_map(|f| f.operands.iter().map(|&o| root(o))));
    let producer: BTreeMap<usize, usize> = plan.steps.iter().enumerate().map(|(i, s)| (root(s.output), i)).collect();
    let mut views = Vec::new();
    let mut skipped = Vec::new();
    for (i, step) in plan.steps.iter().enumerate() {
        let (Op::Permute { perm }, [x]) = (&step.op, step.operands.as_slice()) else { continue };
        let (t, param) = (root(step.output), root(*x));
        let Some(stored) = plan.values.get(param) else { continue };
        let cols = match stored.shape.as_slice() {
            [_, crate::graph::Dim::Fixed(cols)] => *cols,
            _ => continue,
        };
        if perm != &[1, 0] || !matches!(stored.storage, Storage::Param(_)) || !stored.format.is_f32() {
            continue;
        }
        // The transpose's readers: projections, and row slices read only by projections.
        let mut slices = Vec::new();
        let covered = readers.get(&t).is_none_or(|steps| {
            steps.iter().all(|&r| {
                let Some(s) = plan.steps.get(r) else { return false };
                let out = root(s.output);
                let only_weight = !readers.contains_key(&out) && !elsewhere.contains(&out) && as_weight.contains(&out);
                match s.op {
                    Op::Slice { axis: 0, start, .. } if only_weight && producer.get(&out) == Some(&r) => {
                        slices.push((r, out, start));
                        true
                    }
                    _ => false,
                }
            })
        });
        if !covered || elsewhere.contains(&t) {
            continue;
        }
        if as_weight.contains(&t) {
            views.push(WeightView { value: t, param, start: 0, cols });
        }
        for &(r, out, start) in &slices {
            views.push(WeightView { value: out, param, start, cols });
            skipped.push(r);
        }
        skipped.push(i);
    }
    views.sort_by_key(|v| v.value);
    skipped.sort_unstable();
    skipped.dedup();
    (views, skipped)
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
