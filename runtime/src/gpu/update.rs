//! [`Tail`]: the optimizer at the end of a whole training step's plan on the device
//! ([`kiln_compiler::train::update`]: the gradients' squared norms, the clipping factor and the
//! update of every trained tensor), so a step is one submission whose only read-back is its loss
//! and the gradients' norms: the clipping factor is computed and read on the device, and the
//! tensors and their optimizer state (parameters of the plan) are updated in place of the
//! buffers the model holds them in.
//!
//! Lowering puts these ops last ([`Op::is_optimizer`]), so the executor records every other step
//! first, then this run of steps, which binds one chunk of each tensor per dispatch
//! ([`kiln_compiler::back::wgsl::optim`]'s kernels) rather than a step's operands at once: a
//! squared norm reads one gradient of many (past any adapter's bindings), and an update writes
//! its operands. Per step:
//! - [`Op::SquareSums`]: [`sum_squares`] over the chunks of the gradients, [`SQUARES_SLOTS`] a
//!   dispatch, into partial sums,
//!   then [`SUM_PARTS`] adding each tensor's into the step's output;
//! - [`Op::ClipScale`]: [`CLIP_SCALE`] into the step's output (`f32[1]`);
//! - [`Op::AdamW`], [`Op::Sgd`]: the update kernel over each chunk of the tensor, its gradient
//!   and its state, in place; the step's own output (the pure form's stacked result) is never
//!   written, and the run binds a placeholder for it ([`Tail::outputs`]).
//!
//! Every size here is fixed by the parameters' shapes, so the uniforms are written once, when
//! the model is loaded; bind groups are made again only where a slot's buffer was replaced.

#![expect(
    clippy::indexing_slicing,
    reason = "step and value indices come from the compiled plan (`Plan::check`); dispatches index \
              the tables built here with them"
)]

use super::run::{Buffers, CachedGroup, bind_group};
use super::tensor::STORAGE;
use super::{Gpu, GpuError};
use kiln_compiler::back::wgsl::optim::{
    AdamWSettings, ClipSettings, SQUARES_SLOTS, SUM_PARTS, SgdSettings, SquaresSizes,
};
#[cfg(doc)]
use kiln_compiler::back::wgsl::optim::{CLIP_SCALE, sum_squares};
use kiln_compiler::back::wgsl::{Program, workgroups};
use kiln_compiler::graph::{Dim, Op};
use std::collections::HashSet;
use std::sync::Mutex;

/// What one dispatch of the tail binds after its uniform.
#[derive(Clone, Debug)]
enum Bind {
    /// [`sum_squares`]: each slot's chunk `chunk` of the step's operand `operand` (empty slots
    /// bound to the first's), then the partial sums.
    Squares { slots: Vec<(usize, usize)> },
    /// [`SUM_PARTS`]: the partial sums, their ranges, then the step's output.
    Parts,
    /// [`CLIP_SCALE`]: the loss, the squared norms (the step's operands), then its output.
    Clip,
    /// An update: chunk `chunk` of the tensor, its gradient and its state (every operand but the
    /// last two), then the clipping factor and the step's constants (the last two, whole).
    Update { chunk: usize },
}

/// One dispatch: the step it belongs to, what it binds, where its uniform is, its grid.
struct Dispatch {
    step: usize,
    bind: Bind,
    uniform_at: u64,
    grid: (u32, u32),
}

/// The optimizer's steps of a plan on the device (see the module docs).
pub(super) struct Tail {
    /// The first of the plan's steps the tail dispatches: every step from it on.
    pub(super) first: usize,
    /// The update steps' output values, which no step writes: bound to a placeholder.
    pub(super) outputs: Vec<usize>,
    /// The plan's outputs among them, by name: never read back.
    pub(super) unwritten: HashSet<String>,
    /// A buffer of 16 bytes that nothing reads or writes, bound for [`Tail::outputs`].
    pub(super) placeholder: wgpu::Buffer,
    dispatches: Vec<Dispatch>,
    /// Each dispatch's bind group, with what it was made for.
    groups: Mutex<Vec<Option<CachedGroup>>>,
    uniform: wgpu::Buffer,
    parts: wgpu::Buffer,
    ranges: wgpu::Buffer,
    sum_parts: wgpu::ComputePipeline,
}

impl Tail {
    /// The tail of `program`'s plan, or `None` where it has no optimizer's steps. An error where
    /// one of them is not at the end, or reads a tensor whose shape is not fixed.
    pub(super) fn new(gpu: &Gpu, program: &Program) -> Result<Option<Tail>, GpuError> {
        let plan = &program.plan;
        let Some(first) = plan.steps.iter().position(|s| s.op.is_optimizer()) else {
            return Ok(None);
        };
        let internal = |m: String| GpuError::Internal(m);
        if let Some(s) = plan.steps[first..].iter().find(|s| !s.op.is_optimizer()) {
            return Err(internal(format!("`{}` ({}) follows the optimizer's steps", s.scope, s.op.name())));
        }
        let elements = |v: usize| -> Result<usize, GpuError> {
            plan.values[v]
                .shape
                .iter()
                .map(|d| match d {
                    Dim::Fixed(n) => Ok(*n),
                    Dim::Sym(_) => Err(internal(format!("the optimizer reads value {v}, whose shape is not fixed"))),
                })
                .product()
        };
        let per_chunk = (gpu.chunk_bytes / 4).max(1) as usize;
        let stride = super::optim::stride(gpu);
        let (mut dispatches, mut words): (Vec<Dispatch>, Vec<u8>) = (Vec::new(), Vec::new());
        let mut push = |step: usize, bind: Bind, uniform: &[u32], grid: (u32, u32)| {
            let uniform_at = words.len() as u64;
            words.extend_from_slice(bytemuck::cast_slice(uniform));
            words.resize((uniform_at + stride) as usize, 0);
            dispatches.push(Dispatch { step, bind, uniform_at, grid });
        };
        let max = gpu.limits.max_compute_workgroups_per_dimension;
        let (mut ranges, mut parts_len, mut outputs) = (vec![0u32], 0u32, Vec::new());
        for (i, step) in plan.steps.iter().enumerate().skip(first) {
            match &step.op {
                Op::SquareSums => {
                    if ranges.len() > 1 {
                        return Err(internal("a plan with two squared norms' steps".into()));
                    }
                    // Every chunk of every gradient, its partial sums after the last's.
                    let mut chunks = Vec::new();
                    for (operand, &g) in step.operands.iter().enumerate() {
                        let n = elements(g)?;
                        for chunk in 0..n.div_ceil(per_chunk) {
                            let len = per_chunk.min(n - chunk * per_chunk) as u32;
                            let sizes = SquaresSizes { n: len, offset: parts_len };
                            parts_len += sizes.workgroups();
                            chunks.push(((operand, chunk), sizes));
                        }
                        ranges.push(parts_len);
                    }
                    for group in chunks.chunks(SQUARES_SLOTS) {
                        let sizes: Vec<SquaresSizes> = group.iter().map(|&(_, s)| s).collect();
                        let (words, groups) = SquaresSizes::uniform(&sizes);
                        let slots = group.iter().map(|&(slot, _)| slot).collect();
                        push(i, Bind::Squares { slots }, &words, workgroups(groups * 64, max));
                    }
                    let count = step.operands.len() as u32;
                    push(i, Bind::Parts, &[count, 0, 0, 0], workgroups(count * 64, max));
                }
                &Op::ClipScale { max_norm } => {
                    let n = step.operands.get(1).map(|&s| elements(s)).transpose()?.unwrap_or(0) as u32;
                    let settings = ClipSettings { n, max_norm: max_norm.map(|m| m.0) };
                    push(i, Bind::Clip, &settings.words(), (1, 1));
                }
                op @ (Op::AdamW { .. } | Op::Sgd { .. }) => {
                    let n = elements(step.operands[0])?;
                    for chunk in 0..n.div_ceil(per_chunk).max(1) {
                        let len = per_chunk.min(n - (chunk * per_chunk).min(n)) as u32;
                        let words: Vec<u32> = match (AdamWSettings::of(op, len), SgdSettings::of(op, len)) {
                            (Some(a), _) => a.words().to_vec(),
                            (_, Some(s)) => s.words().to_vec(),
                            _ => unreachable!("matched above"),
                        };
                        push(i, Bind::Update { chunk }, &words, workgroups(len, max));
                    }
                    outputs.push(step.output);
                }
                op => return Err(internal(format!("{} is not an optimizer's op", op.name()))),
            }
        }
        let uniform = gpu.buffer(
            "the optimizer's uniforms",
            (words.len() as u64).max(stride),
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        gpu.queue.write_buffer(&uniform, 0, &words);
        let parts = gpu.buffer("the gradients' partial sums of squares", 4 * u64::from(parts_len.max(1)), STORAGE)?;
        let ranges_buffer = gpu.buffer("the partial sums' ranges", 4 * ranges.len() as u64, STORAGE)?;
        gpu.queue.write_buffer(&ranges_buffer, 0, bytemuck::cast_slice(&ranges));
        let unwritten = plan.outputs.iter().filter(|(_, v)| outputs.contains(v)).map(|(n, _)| n.clone()).collect();
        Ok(Some(Tail {
            first,
            outputs,
            unwritten,
            placeholder: gpu.buffer("an update's unwritten result", 16, STORAGE)?,
            groups: Mutex::new((0..dispatches.len()).map(|_| None).collect()),
            dispatches,
            uniform,
            parts,
            ranges: ranges_buffer,
            sum_parts: gpu.pipeline("sum of partial sums", SUM_PARTS),
        }))
    }

    /// Records every dispatch of the tail on `encoder`, in one compute pass, its values where
    /// `buffers` places them and its kernels `program`'s (`pipelines`, by kernel).
    pub(super) fn record(
        &self,
        gpu: &Gpu,
        (program, pipelines): (&Program, &[wgpu::ComputePipeline]),
        buffers: &Buffers<'_>,
        encoder: &mut wgpu::CommandEncoder,
    ) -> Result<(), GpuError> {
        let plan = &program.plan;
        let chunk_of = |v: usize, c: usize| -> Result<&wgpu::Buffer, GpuError> {
            buffers.of(v).get(c).ok_or_else(|| GpuError::Internal(format!("value {v} has no buffer chunk {c}")))
        };
        let mut groups = self.groups.lock().map_err(|_| GpuError::Poisoned("the optimizer's bind groups"))?;
        for (d, group) in self.dispatches.iter().zip(groups.iter_mut()) {
            let step = &plan.steps[d.step];
            let pipeline = match d.bind {
                Bind::Parts => &self.sum_parts,
                _ => &pipelines[program.step_kernels[d.step]],
            };
            let whole = |v: usize| chunk_of(v, 0);
            let bound: Vec<&wgpu::Buffer> = match d.bind {
                Bind::Squares { ref slots } => {
                    let mut bound = Vec::with_capacity(SQUARES_SLOTS + 1);
                    for j in 0..SQUARES_SLOTS {
                        let (operand, chunk) = slots.get(j).or(slots.first()).copied().unwrap_or_default();
                        bound.push(chunk_of(step.operands[operand], chunk)?);
                    }
                    bound.push(&self.parts);
                    bound
                }
                Bind::Parts => vec![&self.parts, &self.ranges, whole(step.output)?],
                Bind::Clip => vec![whole(step.operands[0])?, whole(step.operands[1])?, whole(step.output)?],
                Bind::Update { chunk } => {
                    let (tensors, rest) = step.operands.split_at(step.operands.len().saturating_sub(2));
                    let mut bound = tensors.iter().map(|&v| chunk_of(v, chunk)).collect::<Result<Vec<_>, _>>()?;
                    for &v in rest {
                        bound.push(whole(v)?);
                    }
                    bound
                }
            };
            let chunks: Vec<&[wgpu::Buffer]> = bound.into_iter().map(std::slice::from_ref).collect();
            bind_group(gpu, group, pipeline, (&chunks, &[]), None, &self.uniform, d.uniform_at);
        }
        drop(groups);
        let mut pass = encoder
            .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("optimizer"), timestamp_writes: None });
        self.dispatch(&mut pass, |_| true)
    }

    /// Records on `pass` the dispatches of plan step `step` as the last [`Tail::record`] bound
    /// them (the profiler times each step alone).
    pub(super) fn dispatch_step(&self, pass: &mut wgpu::ComputePass<'_>, step: usize) -> Result<(), GpuError> {
        self.dispatch(pass, |s| s == step)
    }

    /// Records on `pass` the dispatches of the steps `selected` picks, in order.
    fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, selected: impl Fn(usize) -> bool) -> Result<(), GpuError> {
        let groups = self.groups.lock().map_err(|_| GpuError::Poisoned("the optimizer's bind groups"))?;
        for (d, group) in self.dispatches.iter().zip(groups.iter()).filter(|(d, _)| selected(d.step)) {
            let Some((pipeline, _, group)) = group else {
                return Err(GpuError::Internal(format!("optimizer step {} has no bind group", d.step)));
            };
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, group, &[]);
            pass.dispatch_workgroups(d.grid.0, d.grid.1, 1);
        }
        Ok(())
    }
}
