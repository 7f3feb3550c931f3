//! What the GPU does to a plan and its weights before the WGSL back end compiles it: a
//! quantized weight larger than one buffer is read as f32 where the kernels that read it split
//! over buffers read f32 only ([`f32_where_too_large`]).

#![expect(clippy::indexing_slicing, reason = "value indices come from a plan `Plan::check` bounded")]

use super::{Gpu, GpuError};
use crate::quant::QuantWeight;
use kiln_compiler::back::wgsl;
use kiln_compiler::lower::{Plan, Step, Storage, Value, WeightFormat, resolve};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// The plan with every quantized parameter larger than one buffer of `gpu` read as f32 instead
/// (the kernels that read a tensor split across buffers read f32 only), and the parameters with
/// their f32 values added where only blocks were given. A projection `options` split into pieces
/// that each fit ([`wgsl::Options::binding_bytes`]) keeps reading the blocks: a parameter only
/// such projections read keeps them, and one other steps read too (Gemma 3's tied 262144-row
/// Q8_0 embedding and head on lavapipe, whose bindings stop at 128 MiB) gets an f32 copy for
/// those steps.
pub(super) fn f32_where_too_large<'a>(
    gpu: &Gpu,
    plan: &Plan,
    options: &wgsl::Options,
    params: &'a HashMap<String, Tensor>,
    blocks: &HashMap<String, QuantWeight>,
) -> Result<(Plan, std::borrow::Cow<'a, HashMap<String, Tensor>>), GpuError> {
    let mut plan = plan.clone();
    let mut added: Vec<(String, Tensor)> = Vec::new();
    let split = options.binding_bytes.is_some_and(|b| b <= gpu.chunk_bytes);
    // Which operand of a step is the weight of a projection the back end splits.
    let split_weight = |step: &Step| step.op.linear_weight().filter(|_| split && wgsl::column_divisible(&step.op));
    // The values some step reads other than as such a weight (or through a reshape, or a fold or
    // an output reads), and those read as such a weight.
    let mut whole = std::collections::HashSet::new();
    let mut weights = std::collections::HashSet::new();
    for step in &plan.steps {
        for (i, &o) in step.operands.iter().enumerate() {
            match split_weight(step) == Some(i) && o == crate::prepare::root(&plan, o) {
                true => weights.insert(o),
                false => whole.insert(crate::prepare::root(&plan, o)),
            };
        }
    }
    whole.extend(plan.folds.iter().flat_map(|f| f.operands.iter().map(|&o| crate::prepare::root(&plan, o))));
    whole.extend(plan.outputs.iter().map(|(_, o)| crate::prepare::root(&plan, *o)));
    let aliased: std::collections::HashSet<usize> = (0..plan.values.len())
        .filter(|&v| matches!(plan.values[v].storage, Storage::Alias(_)))
        .map(|v| crate::prepare::root(&plan, v))
        .collect();
    for id in 0..plan.values.len() {
        let v = &plan.values[id];
        let Storage::Param(name) = &v.storage else { continue };
        let name = name.clone();
        let shape = resolve(&v.shape, &HashMap::new());
        let (&[rows, k], true) = (shape.as_slice(), v.format.quantized()) else { continue };
        if v.format.bytes(rows, k) <= gpu.chunk_bytes || !whole.contains(&id) {
            continue;
        }
        if !params.contains_key(&name) && !added.iter().any(|(n, _)| *n == name) {
            let q =
                blocks.get(&name).ok_or_else(|| GpuError::MissingBlocks { name: name.clone(), format: v.format })?;
            kiln_compiler::memory::check(|| format!("`{name}` in f32"), 4 * (rows * k) as u64)?;
            added.push((name.clone(), q.dequantize()));
        }
        if !weights.contains(&id) || aliased.contains(&id) {
            plan.values[id].format = WeightFormat::F32;
            continue;
        }
        // Read both ways: the other readers get an f32 copy, the split projections the blocks.
        let copy = plan.values.len();
        plan.values.push(Value { format: WeightFormat::F32, ..plan.values[id].clone() });
        for step in &mut plan.steps {
            let weight = split_weight(step);
            for (i, o) in step.operands.iter_mut().enumerate() {
                if *o == id && weight != Some(i) {
                    *o = copy;
                }
            }
        }
        for fold in &mut plan.folds {
            fold.operands.iter_mut().filter(|o| **o == id).for_each(|o| *o = copy);
        }
        plan.outputs.iter_mut().filter(|(_, o)| *o == id).for_each(|(_, o)| *o = copy);
    }
    if added.is_empty() {
        return Ok((plan, std::borrow::Cow::Borrowed(params)));
    }
    let mut all = params.clone();
    all.extend(added);
    Ok((plan, std::borrow::Cow::Owned(all)))
}
