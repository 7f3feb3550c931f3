//! [`DeviceAdamW`]: AdamW's moments on the device and its update run there, so a training step
//! on wgpu reads back its loss and one partial sum of squares per 4 096 gradient elements, and
//! nothing else: the parameters stay in the model's buffers and are updated in place, the
//! gradients are read where the step left them (its slots, [`GpuModel::run_leaving`]), and
//! neither crosses to the host between steps. The kernels are
//! [`kiln_compiler::back::wgsl::optim`]'s; the host's [`AdamW`] keeps the settings and is given
//! the moments back whenever the state is read ([`DeviceAdamW::state`]).
//!
//! A step of several micro-batches adds each one's gradients to a running mean on the device
//! ([`DeviceAdamW::accumulate`], buffers made at the first such step), whose buffers are then the
//! gradients the norm and the update read.
//!
//! A step is two submissions: the sums of squares of every gradient (one dispatch per chunk of
//! each), read back and added on the host in f64, in the parameters' order, for the global norm
//! that clipping reads; then the update of every parameter (one dispatch per chunk), with the
//! clipping factor and the learning rate in its uniform. A tensor larger than one buffer
//! ([`Gpu::chunk_bytes`]) is split at the same element in its parameter, gradient and moment
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
use crate::train::AdamW;
use kiln_compiler::back::wgsl::optim::{ACCUMULATE, ADAMW, AdamWStep, MeanStep, SUM_SQUARES, SquaresSizes};
use kiln_compiler::back::wgsl::workgroups;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::sync::Arc;

/// One parameter's moments on the device.
struct Slot {
    name: String,
    shape: Vec<usize>,
    /// Whether it takes weight decay (the host's [`AdamW::decays`]).
    decays: bool,
    /// First and second moments, as [`Gpu::chunked`] splits the tensor.
    m: Vec<wgpu::Buffer>,
    v: Vec<wgpu::Buffer>,
    /// The running mean of a step's micro-batches' gradients (made when first needed).
    mean: Vec<wgpu::Buffer>,
}

/// A dispatch's bind group, and what it was made for (made again when a slot is replaced).
type Cached = Option<CachedGroup>;

/// AdamW on the device for a list of parameters (see the module docs).
pub struct DeviceAdamW {
    gpu: Arc<Gpu>,
    squares: wgpu::ComputePipeline,
    update: wgpu::ComputePipeline,
    accumulate: wgpu::ComputePipeline,
    slots: Vec<Slot>,
    /// Steps taken, as the host's [`AdamW::step_count`] counts them.
    step: u64,
    /// Per dispatch (a chunk of a parameter, in order): its elements and its first partial sum.
    chunks: Vec<SquaresSizes>,
    /// The uniforms: the squares' sizes of every chunk, then the update's constants of every
    /// chunk, then the accumulation's, [`DeviceAdamW::stride`] bytes apart.
    uniform: wgpu::Buffer,
    stride: u64,
    /// The partial sums, and the mappable buffer they are read through.
    parts: (wgpu::Buffer, wgpu::Buffer),
    parts_len: usize,
    squares_groups: Vec<Cached>,
    update_groups: Vec<Cached>,
    mean_groups: Vec<Cached>,
}

/// Bytes of a uniform entry: the 64 a bind group binds (see [`cached`]), rounded up to the
/// device's offset alignment.
fn stride(gpu: &Gpu) -> u64 {
    64u64.next_multiple_of(u64::from(gpu.limits.min_uniform_buffer_offset_alignment.max(1)))
}

impl DeviceAdamW {
    /// AdamW on `gpu` for the parameters `order` names (each registered with `host`), its moments
    /// and step count `host`'s (zeros for a new run, a checkpoint's state for a resumed one).
    pub fn new(gpu: Arc<Gpu>, host: &AdamW, order: &[String]) -> Result<DeviceAdamW, GpuError> {
        let state: HashMap<String, Tensor> = host.state().into_iter().collect();
        let moment = |kind: &str, name: &str| {
            state
                .get(&format!("adam.{kind}.{name}"))
                .and_then(|t| Some((t.shape.clone(), t.as_f32()?)))
                .ok_or_else(|| GpuError::Internal(format!("the optimizer has no parameter `{name}`")))
        };
        let mut slots = Vec::with_capacity(order.len());
        let mut chunks = Vec::new();
        let mut parts_len = 0usize;
        let per_chunk = (gpu.chunk_bytes / 4) as usize;
        for name in order {
            let (shape, m) = moment("m", name)?;
            let (_, v) = moment("v", name)?;
            let bytes = 4 * m.len() as u64;
            let (mb, vb) = (
                gpu.chunked("AdamW's first moment", bytes, STORAGE)?,
                gpu.chunked("AdamW's second moment", bytes, STORAGE)?,
            );
            gpu.write_chunked(&mb, bytemuck::cast_slice(m));
            gpu.write_chunked(&vb, bytemuck::cast_slice(v));
            for start in (0..m.len().max(1)).step_by(per_chunk.max(1)) {
                let n = per_chunk.min(m.len() - start.min(m.len()));
                let sizes = SquaresSizes { n: n as u32, offset: parts_len as u32 };
                parts_len += sizes.workgroups() as usize;
                chunks.push(sizes);
            }
            let decays = host.decays(name).unwrap_or(false);
            slots.push(Slot { name: name.clone(), shape, decays, m: mb, v: vb, mean: Vec::new() });
        }
        let stride = stride(&gpu);
        let uniform = gpu.buffer(
            "AdamW's uniforms",
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
        Ok(DeviceAdamW {
            squares: gpu.pipeline("sum of squares", SUM_SQUARES),
            update: gpu.pipeline("AdamW", ADAMW),
            accumulate: gpu.pipeline("gradient mean", ACCUMULATE),
            gpu,
            slots,
            step: host.step_count(),
            chunks,
            uniform,
            stride,
            parts,
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

    /// The buffers of the running mean [`DeviceAdamW::accumulate`] adds to, one per parameter in
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
                    &[g, &self.parts.0],
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

    /// One AdamW step at learning rate `lr` of every parameter (`params`, its buffers; `grads`,
    /// its gradient's; both in order), each gradient read scaled by `scale` (the clipping
    /// factor), the constants `host`'s (its settings; its own state is not read).
    /// Recorded and submitted; the next submission sees the parameters updated.
    pub fn update(
        &mut self,
        host: &AdamW,
        lr: f64,
        scale: f32,
        params: &[&[wgpu::Buffer]],
        grads: &[&[wgpu::Buffer]],
    ) -> Result<(), GpuError> {
        self.check(grads, "gradients")?;
        self.check(params, "parameters")?;
        self.step += 1;
        let (constants, decay) = host.constants(lr, self.step);
        let gpu = self.gpu.clone();
        let base = self.chunks.len() as u64 * self.stride;
        let mut words = vec![0u8; (self.chunks.len() as u64 * self.stride) as usize];
        self.each_chunk(|p, _, d| {
            let step = AdamWStep {
                n: self.chunks[d].n,
                scale,
                decay: if self.slots[p].decays { decay } else { 1.0 },
                w1: constants.w1,
                b2: constants.b2,
                w2: constants.w2,
                bc2_sqrt: constants.bc2_sqrt,
                eps: constants.eps,
                neg_step: constants.neg_step,
            };
            let at = d * self.stride as usize;
            words[at..at + 48].copy_from_slice(bytemuck::cast_slice(&step.words()));
            Ok(())
        })?;
        gpu.queue.write_buffer(&self.uniform, base, &words);
        let mut groups = std::mem::take(&mut self.update_groups);
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("AdamW") });
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("AdamW"), timestamp_writes: None });
            pass.set_pipeline(&self.update);
            self.each_chunk(|p, c, d| {
                let slot = &self.slots[p];
                let (m, v) = (slot.m.get(c), slot.v.get(c));
                let (Some(m), Some(v)) = (m, v) else {
                    return Err(GpuError::Internal(format!("`{}`: no moment chunk {c}", slot.name)));
                };
                let bound = [chunk(params, p, c)?, chunk(grads, p, c)?, m, v];
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
        gpu.check_lost()
    }

    /// The state as [`AdamW::state`] names it (`adam.step`, `adam.m.<param>`, `adam.v.<param>`),
    /// read back: what [`AdamW::load_state`] takes.
    pub fn state(&self) -> Result<Vec<(String, Tensor)>, GpuError> {
        let mut out = vec![("adam.step".to_string(), Tensor::i64(vec![], vec![self.step as i64]))];
        for slot in &self.slots {
            for (kind, buffers) in [("m", &slot.m), ("v", &slot.v)] {
                out.push((format!("adam.{kind}.{}", slot.name), read(&self.gpu, buffers, &slot.shape)?));
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
    bind_group(gpu, cached, pipeline, &chunks, None, uniform, offset);
    cached.as_ref().map(|(_, _, group)| group).ok_or_else(|| GpuError::Internal("no bind group was made".into()))
}

/// The f32 tensor of `shape` held in `buffers` (chunks of [`Gpu::chunk_bytes`]), read back.
pub fn read(gpu: &Arc<Gpu>, buffers: &[wgpu::Buffer], shape: &[usize]) -> Result<Tensor, GpuError> {
    DeviceTensor { gpu: gpu.clone(), shape: shape.to_vec(), buffers: buffers.to_vec(), room: None }.read()
}
