//! [`GpuEngine`]: a plan on wgpu as an engine; the cache and an encoder's memory stay on the
//! device, and the next token is picked there.

use super::{
    BatchSeq, Engine, GenerateError, Link, Memory, Parked, R, Request, batch_logits, last_logits, plan_ids,
    plan_windows, slide, take_presents,
};
use crate::gpu::{DeviceSampler, DeviceTensor, GpuError, GpuModel, Lend, Lent, SeqStep};
use crate::sample::{Pick, Sampled};
use kiln_compiler::graph::Dim;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// A compiled plan on a GPU; the cache and an encoder's memory stay on the device between steps,
/// and [`Engine::step_sample`] picks the next token on the device.
pub struct GpuEngine {
    model: GpuModel,
    cache: HashMap<String, DeviceTensor>,
    windows: HashMap<String, usize>,
    /// The sampling kernel, built at the first pick on the device.
    sampler: Option<DeviceSampler>,
    /// Pick on the host instead (see [`GpuEngine::sample_on_host`]).
    host_sampling: bool,
}

impl GpuEngine {
    /// An engine running `model`.
    pub fn new(model: GpuModel) -> GpuEngine {
        let windows = plan_windows(model.plan());
        GpuEngine { model, cache: HashMap::new(), windows, sampler: None, host_sampling: false }
    }

    /// The cache as it is held on the device, by past input name: each a [`DeviceTensor`], with
    /// room for more rows where the steps append to it in place.
    pub fn buffers(&self) -> &HashMap<String, DeviceTensor> {
        &self.cache
    }

    /// Makes [`Engine::step_sample`] read the logits back and pick on the host, as the CPU
    /// engines do (to compare the two samplers, or to rule the device's out).
    pub fn sample_on_host(mut self) -> GpuEngine {
        self.host_sampling = true;
        self
    }

    /// Tokens in a row of the plan's `logits` output, when fixed.
    fn vocab(&self) -> Option<usize> {
        let plan = self.model.plan();
        let (_, v) = plan.outputs.iter().find(|(name, _)| name == "logits")?;
        match plan.values.get(*v)?.shape.last()? {
            Dim::Fixed(n) => Some(*n),
            Dim::Sym(_) => None,
        }
    }

    /// [`Engine::step`], lending an output to a callback (see [`GpuModel::run_lending`]).
    fn step_lending(&mut self, request: Request<'_>, lend: Option<Lend<'_>>) -> R<HashMap<String, Tensor>> {
        let Request { inputs, memory, links } = request;
        // Past and memory stay on the device; so do the presents, the next past.
        let keep: Vec<String> = links.iter().map(|(present, _)| present.clone()).collect();
        let resident: HashMap<String, DeviceTensor> =
            std::mem::take(&mut self.cache).into_iter().chain(memory.take_device()).collect();
        let run = self.model.run_lending(&inputs, &resident, &keep, lend);
        // Give the memory back whatever happened, and the old cache on an error.
        let (pasts, device): (HashMap<_, _>, HashMap<_, _>) =
            resident.into_iter().partition(|(name, _)| links.iter().any(|(_, past)| past == name));
        memory.put_device(device);
        let (outputs, mut kept) = match run {
            Ok(r) => r,
            Err(e) => {
                self.cache = pasts;
                return Err(e.into());
            }
        };
        take_presents(links, &mut kept, &mut self.cache)?;
        slide(&mut self.cache, &self.windows, DeviceTensor::keep_last_rows)?;
        Ok(outputs.into_iter().collect())
    }
}

impl Engine for GpuEngine {
    fn id_inputs(&self) -> Vec<String> {
        plan_ids(self.model.plan())
    }

    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory> {
        let keep: Vec<String> = self.model.plan().outputs.iter().map(|(n, _)| n.clone()).collect();
        Ok(Memory::device(self.model.run_resident(given, &HashMap::new(), &keep)?.1))
    }

    fn step(&mut self, request: Request<'_>) -> R<HashMap<String, Tensor>> {
        self.step_lending(request, None)
    }

    fn step_sample(&mut self, request: Request<'_>, pick: Pick<'_>) -> R<Sampled> {
        let gpu = self.model.gpu().clone();
        if self.host_sampling || !self.vocab().is_some_and(|v| DeviceSampler::fits(&gpu, v)) {
            let outputs = self.step(request)?;
            return pick.on_host(last_logits(outputs)?);
        }
        let mut sampler = match self.sampler.take() {
            Some(s) => s,
            None => DeviceSampler::new(gpu)?,
        };
        // The pick is recorded after the forward pass, in its submission; the logits stay there.
        let mut pick = Some(pick);
        let mut pending = None;
        let mut record = |encoder: &mut wgpu::CommandEncoder, logits: Lent<'_>| {
            let pick = pick.take().ok_or_else(|| GpuError::Internal("`logits` lent twice".into()))?;
            pending = Some(sampler.record(encoder, logits, pick)?);
            Ok(())
        };
        let run = self.step_lending(request, Some(("logits", &mut record)));
        let sampled = run.and_then(|_| {
            let pending = pending.ok_or_else(|| GenerateError::MissingOutput("logits".into()))?;
            Ok(sampler.finish(pending)?)
        });
        self.sampler = Some(sampler);
        sampled
    }

    fn clear(&mut self) {
        self.cache.clear();
    }

    fn host_clock(&self) -> Option<crate::gpu::HostClock> {
        Some(self.model.host_clock())
    }

    fn park(&mut self) -> Parked {
        Parked::new(std::mem::take(&mut self.cache))
    }

    fn resume(&mut self, parked: Parked) -> R<()> {
        self.cache = parked.take()?;
        Ok(())
    }

    fn step_batch(&mut self, seqs: &mut [BatchSeq<'_>], links: &[Link]) -> R<Option<Vec<Vec<f32>>>> {
        if self.model.batching().is_err() {
            return Ok(None);
        }
        let mut steps = Vec::with_capacity(seqs.len());
        for seq in seqs.iter_mut() {
            let cache = seq.parked.get_mut::<HashMap<String, DeviceTensor>>()?;
            steps.push(SeqStep { cache, token: seq.token, past: seq.past });
        }
        let outputs = self.model.run_batched(&mut steps, links)?;
        for step in steps {
            slide(step.cache, &self.windows, DeviceTensor::keep_last_rows)?;
        }
        batch_logits(outputs, seqs.len()).map(Some)
    }

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        self.cache.iter().map(|(name, t)| Ok((name.clone(), t.read()?))).collect()
    }
}
