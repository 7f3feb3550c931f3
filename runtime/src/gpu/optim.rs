//! [`DeviceOptimizer`]: the optimizer's state on the device and its update run there (AdamW's
//! moments, or SGD's momentum buffers), so a training step on wgpu reads back its loss and one
//! partial sum of squares per 4 096 gradient elements, and nothing else: the parameters stay in
//! the model's buffers and are updated in place, the gradients are read where the step left them
//! (its slots, [`GpuModel::run_leaving`]), and neither crosses to the host between steps. The
//! kernels are [`kiln_compiler::back::wgsl::optim`]'s; the host's [`Optimizer`] keeps the
//! settings and is given the state back whenever it is read ([`DeviceOptimizer::state`]).
//!
//! A step of several micro-batches adds each one's gradients to a running mean on the device
//! ([`DeviceOptimizer::accumulate`], buffers made at the first such step), whose buffers are then
//! the gradients the norm and the update read.
//!
//! A step is two submissions: the sums of squares of every gradient (one dispatch per chunk of
//! each), read back and added on the host in f64, in the parameters' order, for the global norm
//! that clipping reads; then the update of every parameter (one dispatch per chunk), with the
//! clipping factor and the learning rate in its uniform. A tensor larger than one buffer
//! ([`Gpu::chunk_bytes`]) is split at the same element in its parameter, gradient and state
//! buffers (each made by [`Gpu::chunked`], or a slot of the plan), so chunk `c` of each is one
//! dispatch's bindings.
//!
//! [`GpuModel::run_leaving`]: super::GpuModel::run_leaving

#![expect(
    clippy::indexing_slicing,
    reason = "the chunks, slots, bind groups and uniform words are indexed by `each_chunk`, which \
              enumerates the slots and their chunks exactly as `new` made them"
)]

use super::run::{CachedGroup, bind_group};
use super::tensor::STORAGE;
use super::{DeviceTensor, Gpu, GpuError};
use crate::train::Optimizer;
use kiln_compiler::back::wgsl::optim::{
    ACCUMULATE, AdamWSettings, MeanStep, SQUARES_SLOTS, SgdSettings, SquaresSizes, adamw, sgd, sum_squares,
};
use kiln_compiler::back::wgsl::workgroups;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::sync::Arc;

/// The update rule the device runs: the host optimizer's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// AdamW: two moments a parameter (`adam.m.*`, `adam.v.*`).
    AdamW,
    /// SGD: a momentum buffer a parameter (`sgd.momentum.*`) with momentum, else no state.
    Sgd {
        /// Whether it has momentum.
        momentum: bool,
    },
}

impl Rule {
    /// The names of a parameter's state tensors, in its slot's order, and the step count's.
    fn keys(self, name: &str) -> Vec<String> {
        match self {
            Rule::AdamW => vec![format!("adam.m.{name}"), format!("adam.v.{name}")],
            Rule::Sgd { momentum: true } => vec![format!("sgd.momentum.{name}")],
            Rule::Sgd { momentum: false } => Vec::new(),
        }
    }

    fn step_key(self) -> &'static str {
        match self {
            Rule::AdamW => "adam.step",
            Rule::Sgd { .. } => "sgd.step",
        }
    }
}

/// One parameter's state on the device.
struct Slot {
    name: String,
    shape: Vec<usize>,
    /// Whether it takes weight decay (the host's [`Optimizer::param`]).
    decays: bool,
    /// Its state tensors, as [`Rule::keys`] names them, each as [`Gpu::chunked`] splits it.
    state: Vec<Vec<wgpu::Buffer>>,
    /// Whether the state holds values: always for AdamW (zeros before the first step); for
    /// SGD's momentum buffer, from the parameter's first step on (which copies the gradient).
    started: bool,
    /// The running mean of a step's micro-batches' gradients (made when first needed).
    mean: Vec<wgpu::Buffer>,
}

/// A dispatch's bind group, and what it was made for (made again when a slot is replaced).
type Cached = Option<CachedGroup>;

/// The optimizer's update on the device for a list of parameters (see the module docs).
pub struct DeviceOptimizer {
    gpu: Arc<Gpu>,
    rule: Rule,
    squares: wgpu::ComputePipeline,
    update: wgpu::ComputePipeline,
    accumulate: wgpu::ComputePipeline,
    slots: Vec<Slot>,
    /// Steps taken, as the host's [`Optimizer::step_count`] counts them.
    step: u64,
    /// Per dispatch (a chunk of a parameter, in order): its elements and its first partial sum.
    chunks: Vec<SquaresSizes>,
    /// The uniforms: the squares' sizes of every chunk, then the update's constants of every
    /// chunk, then the accumulation's, [`DeviceOptimizer::stride`] bytes apart.
    uniform: wgpu::Buffer,
    stride: u64,
    /// The partial sums, and the mappable buffer they are read through.
    parts: (wgpu::Buffer, wgpu::Buffer),
    /// The step's clipping factor (`f32[1]`) and constants (AdamW's `-lr / (1 - beta1^t)`,
    /// `sqrt(1 - beta2^t)`, `1 - lr * weight_decay`; SGD's `-lr`, `first`), which the update
    /// kernels read from bindings (as a whole step's plan binds its values: see `super::update`).
    step_values: (wgpu::Buffer, wgpu::Buffer),
    parts_len: usize,
    squares_groups: Vec<Cached>,
    update_groups: Vec<Cached>,
    mean_groups: Vec<Cached>,
}

/// Bytes of a uniform entry: the 64 a bind group binds (see [`cached`]), rounded up to the
/// device's offset alignment. (`super::update`'s uniforms are laid out the same way.)
pub(super) fn stride(gpu: &Gpu) -> u64 {
    64u64.next_multiple_of(u64::from(gpu.limits.min_uniform_buffer_offset_alignment.max(1)))
}

impl DeviceOptimizer {
    /// `host`'s update on `gpu` for the parameters `order` names (each registered with `host`),
    /// its state and step count `host`'s (a new run's, or a checkpoint's for a resumed one).
    pub fn new(gpu: Arc<Gpu>, host: &Optimizer, order: &[String]) -> Result<DeviceOptimizer, GpuError> {
        let rule = match host {
            Optimizer::AdamW(_) => Rule::AdamW,
            Optimizer::Sgd(o) => Rule::Sgd { momentum: o.settings().0 != 0.0 },
        };
        let state: HashMap<String, Tensor> = host.state().into_iter().collect();
        let mut slots = Vec::with_capacity(order.len());
        let mut chunks = Vec::new();
        let mut parts_len = 0usize;
        let per_chunk = (gpu.chunk_bytes / 4) as usize;
        for name in order {
            let (decays, shape) = host
                .param(name)
                .ok_or_else(|| GpuError::Internal(format!("the optimizer has no parameter `{name}`")))?;
            let shape = shape.to_vec();
            let len: usize = shape.iter().product();
            // AdamW's moments are always there; SGD's momentum buffer from the first step on.
            let keys = rule.keys(name);
            let started = keys.iter().all(|k| state.contains_key(k));
            let mut buffers = Vec::with_capacity(keys.len());
            for key in &keys {
                let buffer = gpu.chunked("an optimizer state tensor", 4 * len as u64, STORAGE)?;
                match state.get(key) {
                    Some(t) => match t.as_f32() {
                        Some(values) if t.shape == shape => gpu.write_chunked(&buffer, bytemuck::cast_slice(values)),
                        _ => return Err(GpuError::Internal(format!("`{key}` is not f32 of shape {shape:?}"))),
                    },
                    None if rule == Rule::AdamW => {
                        return Err(GpuError::Internal(format!("the optimizer has no `{key}`")));
                    }
                    // (Written at the first step, before it is read.)
                    None => {}
                }
                buffers.push(buffer);
            }
            for start in (0..len.max(1)).step_by(per_chunk.max(1)) {
                let n = per_chunk.min(len - start.min(len));
                let sizes = SquaresSizes { n: n as u32, offset: parts_len as u32 };
                parts_len += sizes.workgroups() as usize;
                chunks.push(sizes);
            }
            slots.push(Slot { name: name.clone(), shape, decays, state: buffers, started, mean: Vec::new() });
        }
        let stride = stride(&gpu);
        let uniform = gpu.buffer(
            "the optimizer's uniforms",
            3 * stride * chunks.len().max(1) as u64,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        for (i, sizes) in chunks.iter().enumerate() {
            gpu.queue.write_buffer(&uniform, i as u64 * stride, bytemuck::cast_slice(&sizes.words()));
        }
        let parts_bytes = 4 * parts_len.max(1) as u64;
        let parts = (
            gpu.buffer("the gradients' partial sums of squares", parts_bytes, STORAGE)?,
            gpu.buffer(
                "the gradients' partial sums of squares (read back)",
                parts_bytes,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?,
        );
        let n = chunks.len();
        let update = match rule {
            Rule::AdamW => gpu.pipeline("AdamW", &adamw()),
            Rule::Sgd { momentum } => gpu.pipeline("SGD", &sgd(momentum)),
        };
        let step_values =
            (gpu.buffer("the step's clipping factor", 16, STORAGE)?, gpu.buffer("the step's constants", 16, STORAGE)?);
        Ok(DeviceOptimizer {
            squares: gpu.pipeline("sum of squares", &sum_squares()),
            update,
            accumulate: gpu.pipeline("gradient mean", ACCUMULATE),
            gpu,
            rule,
            slots,
            step: host.step_count(),
            chunks,
            uniform,
            stride,
            parts,
            step_values,
            parts_len,
            squares_groups: (0..n).map(|_| None).collect(),
            update_groups: (0..n).map(|_| None).collect(),
            mean_groups: (0..n).map(|_| None).collect(),
        })
    }

    /// The chunks of each parameter's buffers, in order, with the dispatch index of each: `f`
    /// gets the parameter's index, the chunk's index within it and the dispatch's.
    fn each_chunk(&self, mut f: impl FnMut(usize, usize, usize) -> Result<(), GpuError>) -> Result<(), GpuError> {
        let per_chunk = (self.gpu.chunk_bytes / 4).max(1) as usize;
        let mut d = 0;
        for (p, slot) in self.slots.iter().enumerate() {
            let len: usize = slot.shape.iter().product();
            for c in 0..len.max(1).div_ceil(per_chunk) {
                f(p, c, d)?;
                d += 1;
            }
        }
        Ok(())
    }

    /// Adds a micro-batch's gradients (`grads`, one per parameter in order) to the running mean
    /// of the step's: copied if `weight` is `None` (the step's first micro-batch that counts),
    /// else `mean += weight * (g - mean)`, `weight` the micro-batch's counted positions over all
    /// so far, as the host's `GradAccumulator` adds them. Recorded and submitted.
    pub fn accumulate(&mut self, grads: &[&[wgpu::Buffer]], weight: Option<f32>) -> Result<(), GpuError> {
        self.check(grads, "gradients")?;
        let gpu = self.gpu.clone();
        for slot in &mut self.slots {
            if slot.mean.is_empty() {
                let bytes = 4 * slot.shape.iter().product::<usize>() as u64;
                slot.mean = gpu.chunked("a step's mean gradient", bytes, STORAGE)?;
            }
        }
        let base = 2 * self.chunks.len() as u64 * self.stride;
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("mean") });
        match weight {
            None => self.each_chunk(|p, c, d| {
                let mean = self.slots[p].mean.get(c).ok_or_else(|| GpuError::Internal("no mean chunk".into()))?;
                encoder.copy_buffer_to_buffer(chunk(grads, p, c)?, 0, mean, 0, 4 * u64::from(self.chunks[d].n.max(1)));
                Ok(())
            })?,
            Some(weight) => {
                let mut words = vec![0u8; (self.chunks.len() as u64 * self.stride) as usize];
                self.each_chunk(|_, _, d| {
                    let at = d * self.stride as usize;
                    let step = MeanStep { n: self.chunks[d].n, weight };
                    words[at..at + 16].copy_from_slice(bytemuck::cast_slice(&step.words()));
                    Ok(())
                })?;
                gpu.queue.write_buffer(&self.uniform, base, &words);
                let mut groups = std::mem::take(&mut self.mean_groups);
                {
                    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("mean"),
                        timestamp_writes: None,
                    });
                    pass.set_pipeline(&self.accumulate);
                    self.each_chunk(|p, c, d| {
                        let mean =
                            self.slots[p].mean.get(c).ok_or_else(|| GpuError::Internal("no mean chunk".into()))?;
                        let bound = [mean, chunk(grads, p, c)?];
                        let offset = base + d as u64 * self.stride;
                        let group = cached(&gpu, &mut groups[d], &self.accumulate, &self.uniform, offset, &bound)?;
                        pass.set_bind_group(0, group, &[]);
                        let (x, y) = workgroups(self.chunks[d].n, gpu.limits.max_compute_workgroups_per_dimension);
                        pass.dispatch_workgroups(x, y, 1);
                        Ok(())
                    })?;
                }
                self.mean_groups = groups;
            }
        }
        gpu.queue.submit([encoder.finish()]);
        gpu.check_lost()
    }

    /// The buffers of the running mean [`DeviceOptimizer::accumulate`] adds to, one per parameter in
    /// order (empty before its first call).
    pub fn mean(&self) -> Vec<Vec<wgpu::Buffer>> {
        self.slots.iter().map(|s| s.mean.clone()).collect()
    }

    /// Each parameter's sum of the squares of its gradient (`grads`, one per parameter in order,
    /// the chunks holding it), in f32 per 4 096 elements and added in f64 in order.
    pub fn sum_squares(&mut self, grads: &[&[wgpu::Buffer]]) -> Result<Vec<f64>, GpuError> {
        self.check(grads, "gradients")?;
        let gpu = self.gpu.clone();
        let mut groups = std::mem::take(&mut self.squares_groups);
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("norm") });
        let mut sums = vec![0.0f64; self.slots.len()];
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("norm"), timestamp_writes: None });
            pass.set_pipeline(&self.squares);
            self.each_chunk(|p, c, d| {
                let g = chunk(grads, p, c)?;
                let group = cached(
                    &gpu,
                    &mut groups[d],
                    &self.squares,
                    &self.uniform,
                    d as u64 * self.stride,
                    // One chunk a dispatch: the first slot (the others empty, bound to it).
                    &[[g; SQUARES_SLOTS].as_slice(), &[&self.parts.0]].concat(),
                )?;
                pass.set_bind_group(0, group, &[]);
                let (x, y) =
                    workgroups(self.chunks[d].workgroups() * 64, gpu.limits.max_compute_workgroups_per_dimension);
                pass.dispatch_workgroups(x, y, 1);
                Ok(())
            })?;
        }
        encoder.copy_buffer_to_buffer(&self.parts.0, 0, &self.parts.1, 0, 4 * self.parts_len.max(1) as u64);
        gpu.queue.submit([encoder.finish()]);
        self.squares_groups = groups;
        let data = gpu.read_staging(std::slice::from_ref(&self.parts.1), "the sums of squares", self.parts_len)?;
        let parts: &[f32] = bytemuck::cast_slice(&data);
        self.each_chunk(|p, _, d| {
            let SquaresSizes { offset, .. } = self.chunks[d];
            let n = self.chunks[d].workgroups() as usize;
            let range = parts.get(offset as usize..offset as usize + n).unwrap_or_default();
            sums[p] += range.iter().map(|&x| f64::from(x)).sum::<f64>();
            Ok(())
        })?;
        Ok(sums)
    }

    /// One step of `host`'s update at learning rate `lr` of every parameter (`params`, its
    /// buffers; `grads`, its gradient's; both in order), each gradient read scaled by `scale`
    /// (the clipping factor), the constants `host`'s (its settings; its own state is not read,
    /// and it must be the optimizer this was made from). Recorded and submitted; the next
    /// submission sees the parameters updated.
    pub fn update(
        &mut self,
        host: &Optimizer,
        lr: f64,
        scale: f32,
        params: &[&[wgpu::Buffer]],
        grads: &[&[wgpu::Buffer]],
    ) -> Result<(), GpuError> {
        self.check(grads, "gradients")?;
        self.check(params, "parameters")?;
        let step = self.step + 1;
        let mut words = vec![0u8; (self.chunks.len() as u64 * self.stride) as usize];
        let mut write = |d: usize, w: &[u32]| {
            let at = d * self.stride as usize;
            words[at..at + 4 * w.len()].copy_from_slice(bytemuck::cast_slice(w));
        };
        let constants: [f32; 3] = match (self.rule, host) {
            (Rule::AdamW, Optimizer::AdamW(host)) => {
                let (c, decay) = host.constants(lr, step);
                self.each_chunk(|p, _, d| {
                    let (n, decays) = (self.chunks[d].n, self.slots[p].decays);
                    let settings = AdamWSettings { n, decays, w1: c.w1, b2: c.b2, w2: c.w2, eps: c.eps };
                    write(d, &settings.words());
                    Ok(())
                })?;
                [c.neg_step, c.bc2_sqrt, decay]
            }
            (Rule::Sgd { .. }, Optimizer::Sgd(host)) => {
                let (momentum, weight_decay) = host.settings();
                self.each_chunk(|p, _, d| {
                    let weight_decay = if self.slots[p].decays { weight_decay as f32 } else { 0.0 };
                    let settings = SgdSettings { n: self.chunks[d].n, momentum: momentum as f32, weight_decay };
                    write(d, &settings.words());
                    Ok(())
                })?;
                // The buffers start together: the state is loaded for every parameter or none.
                let first = self.slots.iter().any(|s| !s.started);
                [(-lr) as f32, f32::from(u8::from(first)), 0.0]
            }
            _ => return Err(GpuError::Internal("the step's optimizer is not the one on the device".into())),
        };
        self.gpu.queue.write_buffer(&self.step_values.0, 0, bytemuck::cast_slice(&[scale]));
        self.gpu.queue.write_buffer(&self.step_values.1, 0, bytemuck::cast_slice(&constants));
        let gpu = self.gpu.clone();
        let base = self.chunks.len() as u64 * self.stride;
        gpu.queue.write_buffer(&self.uniform, base, &words);
        let mut groups = std::mem::take(&mut self.update_groups);
        let mut encoder =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("optimizer") });
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("optimizer"), timestamp_writes: None });
            pass.set_pipeline(&self.update);
            self.each_chunk(|p, c, d| {
                let slot = &self.slots[p];
                let mut bound = vec![chunk(params, p, c)?, chunk(grads, p, c)?];
                for buffers in &slot.state {
                    let Some(b) = buffers.get(c) else {
                        return Err(GpuError::Internal(format!("`{}`: no state chunk {c}", slot.name)));
                    };
                    bound.push(b);
                }
                bound.extend([&self.step_values.0, &self.step_values.1]);
                let group =
                    cached(&gpu, &mut groups[d], &self.update, &self.uniform, base + d as u64 * self.stride, &bound)?;
                pass.set_bind_group(0, group, &[]);
                let (x, y) = workgroups(self.chunks[d].n, gpu.limits.max_compute_workgroups_per_dimension);
                pass.dispatch_workgroups(x, y, 1);
                Ok(())
            })?;
        }
        gpu.queue.submit([encoder.finish()]);
        self.update_groups = groups;
        self.step = step;
        for slot in &mut self.slots {
            slot.started = true;
        }
        gpu.check_lost()
    }

    /// The state as the host's [`Optimizer::state`] names it (`adam.step`, `adam.m.<param>`,
    /// `adam.v.<param>`; `sgd.step`, `sgd.momentum.<param>` once started), read back: what
    /// [`Optimizer::load_state`] takes.
    pub fn state(&self) -> Result<Vec<(String, Tensor)>, GpuError> {
        let mut out = vec![(self.rule.step_key().to_string(), Tensor::i64(vec![], vec![self.step as i64]))];
        for slot in self.slots.iter().filter(|s| s.started) {
            for (key, buffers) in self.rule.keys(&slot.name).into_iter().zip(&slot.state) {
                out.push((key, read(&self.gpu, buffers, &slot.shape)?));
            }
        }
        Ok(out)
    }

    /// Errors unless `buffers` has one entry per parameter.
    fn check(&self, buffers: &[&[wgpu::Buffer]], what: &str) -> Result<(), GpuError> {
        match buffers.len() == self.slots.len() {
            true => Ok(()),
            false => Err(GpuError::Internal(format!("{} {what} for {} parameters", buffers.len(), self.slots.len()))),
        }
    }
}

/// Chunk `c` of parameter `p`'s buffers.
fn chunk<'b>(buffers: &[&'b [wgpu::Buffer]], p: usize, c: usize) -> Result<&'b wgpu::Buffer, GpuError> {
    buffers
        .get(p)
        .and_then(|b| b.get(c))
        .ok_or_else(|| GpuError::Internal(format!("parameter {p} has no buffer chunk {c}")))
}

/// `cached`'s bind group if it binds `bound` with `pipeline`, else a new one (see
/// [`bind_group`]): the uniform entry at `offset` (the uniforms are at most 64 bytes, each entry
/// a [`stride`] apart), then `bound` in order.
fn cached<'g>(
    gpu: &Gpu,
    cached: &'g mut Cached,
    pipeline: &wgpu::ComputePipeline,
    uniform: &wgpu::Buffer,
    offset: u64,
    bound: &[&wgpu::Buffer],
) -> Result<&'g wgpu::BindGroup, GpuError> {
    let chunks: Vec<&[wgpu::Buffer]> = bound.iter().map(|b| std::slice::from_ref(*b)).collect();
    bind_group(gpu, cached, pipeline, (&chunks, &[]), None, uniform, offset);
    cached.as_ref().map(|(_, _, group)| group).ok_or_else(|| GpuError::Internal("no bind group was made".into()))
}

/// The f32 tensor of `shape` held in `buffers` (chunks of [`Gpu::chunk_bytes`]), read back.
pub fn read(gpu: &Arc<Gpu>, buffers: &[wgpu::Buffer], shape: &[usize]) -> Result<Tensor, GpuError> {
    DeviceTensor { gpu: gpu.clone(), shape: shape.to_vec(), buffers: buffers.to_vec(), room: None }.read()
}
