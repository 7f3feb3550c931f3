//! Sampling on the device: [`DeviceSampler`] runs the sampling kernel
//! ([`kiln_compiler::back::wgsl::sample`], whose docs define what it computes: the host
//! [`Sampler`]'s semantics) on the logits row of a step's last position where the forward pass
//! left it, so a generation step on wgpu reads back one id (4 bytes) instead of the row (192 KiB
//! for SmolLM2's 49152 tokens, 1 MiB for Gemma 3's 262144), and the row only when asked for.
//!
//! A step records, on the forward pass's own command encoder (`GpuModel::run_lending` lends it
//! the `logits` output): the copy of the last row out of the output's buffers (a prefill's
//! logits may span several chunk buffers; the row is copied range by range) into the sampler's
//! row buffer, the dispatch of the kernel (one workgroup, after the `parts` entry point's
//! workgroups over a long row's chunks: see the kernel's docs) and the copy of the id into a mappable
//! buffer. The settings, the uniform drawn from the [`Sampler`]'s own SplitMix64 state (so a seed
//! gives the same stream of draws as on the host) and the penalized ids are written to their
//! buffers before the submission. One submission, one wait, one id read.
//!
//! The row must fit one buffer of the device ([`DeviceSampler::fits`]: 4 bytes per token, at
//! most `Gpu::chunk_bytes`, 128 MiB or more on any adapter) and hold at most
//! [`MAX_VOCAB`] tokens; a [`GpuEngine`](crate::GpuEngine) samples a larger one on the host.

use super::run::Lent;
use super::tensor::{STORAGE, copy_range};
use super::{Gpu, GpuError};
use crate::sample::{Pick, Sampled, Sampler};
use kiln_compiler::back::wgsl::sample::{KERNEL, MAX_VOCAB, Settings, keep, part_words, parts};
use std::sync::Arc;

/// The sampling kernel's pipeline on a device, and the buffers a pick reads and writes (kept
/// from one step to the next; the row and seen-id buffers grow when needed).
pub struct DeviceSampler {
    gpu: Arc<Gpu>,
    pipeline: wgpu::ComputePipeline,
    /// The `parts` entry point's pipeline: a long row's first pass over many workgroups.
    parts_pipeline: wgpu::ComputePipeline,
    /// The [`Settings`] uniform.
    settings: wgpu::Buffer,
    /// The picked id, and the mappable buffer it is copied into.
    picked: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// The logits row (penalized in place by the kernel), and its bytes.
    row: Option<(u64, wgpu::Buffer)>,
    /// The penalized ids, and their bytes.
    seen: Option<(u64, wgpu::Buffer)>,
    /// The parts of a long row's first pass, and their bytes.
    parts: Option<(u64, wgpu::Buffer)>,
    /// The bind groups of the buffers above (`main`'s, the `parts` entry point's), rebuilt when
    /// one is replaced.
    group: Option<(wgpu::BindGroup, wgpu::BindGroup)>,
}

/// What a recorded pick reads back after the submission: the row, when asked for, staged in a
/// mappable buffer, with its length.
pub(crate) struct Pending {
    logits: Option<(wgpu::Buffer, usize)>,
}

const READ: wgpu::BufferUsages = wgpu::BufferUsages::MAP_READ.union(wgpu::BufferUsages::COPY_DST);

impl DeviceSampler {
    /// Builds the kernel's pipeline on `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> Result<DeviceSampler, GpuError> {
        let pipeline = gpu.pipeline("sample", KERNEL);
        let parts_pipeline = gpu.pipeline_of("sample parts", KERNEL, "parts");
        let settings_bytes = 4 * Settings::default().words().len() as u64;
        let settings =
            gpu.buffer("sampler settings", settings_bytes, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST)?;
        let picked = gpu.buffer("sampled token", 4, STORAGE)?;
        let staging = gpu.buffer("sampled token", 4, READ)?;
        gpu.check_lost()?;
        Ok(DeviceSampler {
            gpu,
            pipeline,
            parts_pipeline,
            settings,
            picked,
            staging,
            row: None,
            seen: None,
            parts: None,
            group: None,
        })
    }

    /// Whether the kernel samples a row of `vocab` logits on `gpu`: in one buffer, and within
    /// [`MAX_VOCAB`].
    pub fn fits(gpu: &Gpu, vocab: usize) -> bool {
        vocab > 0 && vocab <= MAX_VOCAB as usize && 4 * vocab as u64 <= gpu.chunk_bytes()
    }

    /// Records on `encoder` the pick of the next token from the last row of `logits` (`[.., vocab]`)
    /// as `pick` says (drawing from its sampler's state), for [`DeviceSampler::finish`] to read
    /// after the encoder is submitted.
    pub(crate) fn record(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        logits: Lent<'_>,
        pick: Pick<'_>,
    ) -> Result<Pending, GpuError> {
        let gpu = self.gpu.clone();
        let vocab = logits.shape.last().copied().unwrap_or(0);
        if !DeviceSampler::fits(&gpu, vocab) {
            return Err(GpuError::SampleRow { vocab, max: MAX_VOCAB, chunk_bytes: gpu.chunk_bytes() });
        }
        let total: usize = logits.shape.iter().product();
        let bytes = 4 * vocab as u64;
        let row = self.grow_row(bytes)?;
        let from = 4 * (total - vocab) as u64;
        copy_range(encoder, (logits.buffers, from), (std::slice::from_ref(&row), 0), bytes, logits.chunk_bytes)?;
        let staged = match pick.logits {
            true => {
                let staging = gpu.buffer("logits row", bytes, READ)?;
                encoder.copy_buffer_to_buffer(&row, 0, &staging, 0, bytes);
                Some((staging, vocab))
            }
            false => None,
        };

        let sampler: &mut Sampler = pick.sampler;
        let seen: Vec<u32> =
            sampler.penalized(pick.seen).into_iter().filter(|&t| t < vocab).map(|t| t as u32).collect();
        let seen_buffer = self.grow_seen(4 * seen.len().max(1) as u64)?;
        if !seen.is_empty() {
            gpu.queue.write_buffer(&seen_buffer, 0, bytemuck::cast_slice(&seen));
        }
        let draw = sampler.draw();
        let parts = parts(vocab as u32);
        let parts_buffer = self.grow_parts(4 * u64::from(part_words(parts.max(1))))?;
        let top_k = u32::try_from(sampler.top_k).unwrap_or(u32::MAX);
        let settings = Settings {
            vocab: vocab as u32,
            top_k,
            seen: seen.len() as u32,
            greedy: draw.is_none(),
            temperature: sampler.temperature,
            top_p: sampler.top_p,
            penalty: sampler.repetition_penalty,
            // In f32, below 1 as the draw is.
            uniform: (draw.unwrap_or(0.0) as f32).min(1.0 - f32::EPSILON / 2.0),
            parts,
            keep: keep(parts, draw.is_none(), top_k),
        };
        gpu.queue.write_buffer(&self.settings, 0, bytemuck::cast_slice(&settings.words()));

        let (group, parts_group) = match &self.group {
            Some(groups) => groups.clone(),
            None => {
                // Each pipeline's layout holds the bindings its entry point reads: the `parts`
                // entry point writes no id (binding 1).
                let buffers = [&self.settings, &self.picked, &row, &seen_buffer, &parts_buffer];
                let group = |label, pipeline: &wgpu::ComputePipeline, skip: Option<usize>| {
                    let entries: Vec<wgpu::BindGroupEntry> = buffers
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| Some(*i) != skip)
                        .map(|(i, buffer)| wgpu::BindGroupEntry {
                            binding: i as u32,
                            resource: buffer.as_entire_binding(),
                        })
                        .collect();
                    gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(label),
                        layout: &pipeline.get_bind_group_layout(0),
                        entries: &entries,
                    })
                };
                let groups =
                    (group("sample", &self.pipeline, None), group("sample parts", &self.parts_pipeline, Some(1)));
                self.group = Some(groups.clone());
                groups
            }
        };
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("sample"), timestamp_writes: None });
            if parts > 0 {
                pass.set_pipeline(&self.parts_pipeline);
                pass.set_bind_group(0, &parts_group, &[]);
                pass.dispatch_workgroups(parts, 1, 1);
            }
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        encoder.copy_buffer_to_buffer(&self.picked, 0, &self.staging, 0, 4);
        Ok(Pending { logits: staged })
    }

    /// Waits for the submission that holds a recorded pick and reads back its token (and the
    /// row, if it was asked for).
    pub(crate) fn finish(&self, pending: Pending) -> Result<Sampled, GpuError> {
        let data = self.gpu.read_staging(std::slice::from_ref(&self.staging), "the sampled token", 1)?;
        let token = data.first_chunk::<4>().map(|&b| u32::from_le_bytes(b)).unwrap_or(0);
        if token == kiln_compiler::back::wgsl::sample::NAN_ROW {
            return Err(GpuError::NanLogits);
        }
        let logits = match pending.logits {
            Some((staging, n)) => {
                let data = self.gpu.read_staging(std::slice::from_ref(&staging), "the logits row", n)?;
                Some(bytemuck::cast_slice::<u8, f32>(data.get(..4 * n).unwrap_or_default()).to_vec())
            }
            None => None,
        };
        Ok(Sampled { token: i64::from(token), logits })
    }

    /// Picks the next token from a row of logits held on the host, on the device: uploads it,
    /// records the pick as a generation step does and reads the token back. What the tests hold
    /// to [`Sampler::sample`].
    pub fn sample(&mut self, logits: &[f32], pick: Pick<'_>) -> Result<Sampled, GpuError> {
        let gpu = self.gpu.clone();
        let buffer = gpu.buffer("logits", 4 * logits.len() as u64, STORAGE)?;
        gpu.queue.write_buffer(&buffer, 0, bytemuck::cast_slice(logits));
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("sample") });
        let shape = [logits.len()];
        let lent = Lent { shape: &shape, buffers: std::slice::from_ref(&buffer), chunk_bytes: gpu.chunk_bytes() };
        let pending = self.record(&mut encoder, lent, pick)?;
        gpu.queue.submit([encoder.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Rejected { what: "the sampling kernel", message: e.to_string() });
        }
        self.finish(pending)
    }

    /// The row buffer, replaced by one of `bytes` if it is smaller.
    fn grow_row(&mut self, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        DeviceSampler::grow(&self.gpu, &mut self.row, &mut self.group, "logits row", bytes)
    }

    /// The seen-id buffer, replaced by one of `bytes` if it is smaller.
    fn grow_seen(&mut self, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        DeviceSampler::grow(&self.gpu, &mut self.seen, &mut self.group, "penalized tokens", bytes)
    }

    /// The parts buffer, replaced by one of `bytes` if it is smaller.
    fn grow_parts(&mut self, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        DeviceSampler::grow(&self.gpu, &mut self.parts, &mut self.group, "sampling parts", bytes)
    }

    /// `held`, replaced by a buffer of `bytes` if it is smaller (forgetting the bind groups).
    fn grow(
        gpu: &Gpu,
        held: &mut Option<(u64, wgpu::Buffer)>,
        group: &mut Option<(wgpu::BindGroup, wgpu::BindGroup)>,
        what: &str,
        bytes: u64,
    ) -> Result<wgpu::Buffer, GpuError> {
        if let Some((have, buffer)) = held
            && *have >= bytes
        {
            return Ok(buffer.clone());
        }
        let buffer = gpu.buffer(what, bytes, STORAGE)?;
        *held = Some((bytes, buffer.clone()));
        *group = None;
        Ok(buffer)
    }
}
