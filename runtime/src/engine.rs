//! Engines: where a [`Session`](crate::Session)'s forward passes run, behind one trait.
//!
//! An [`Engine`] runs a cached decoder step — or, once, an encoder — and keeps the key/value
//! cache where its kernels read it: [`InterpEngine`] (the reference interpreter) and
//! [`CpuEngine`] (native kernels) in host memory, [`GpuEngine`] on the device. Each engine owns
//! its cache, so a session never pairs an engine with another engine's cache; what every engine
//! shares is the contract of [`Engine::step`]: the presents named by the session's links become
//! the cache on success — a sliding-window layer's cut to its latest `window - 1` rows, so its
//! memory is bounded (see [`InputRole::Cache`]) — and on an error the cache is as it was.
//! [`Engine::step_sample`] also picks the next token where the logits are: on the host for the
//! CPU engines, on the device for [`GpuEngine`] (see [`crate::sample`]).

use crate::cpu::cache::KvCache;
use crate::cpu::{CpuError, CpuModel};
use crate::gpu::{DeviceSampler, DeviceTensor, GpuError, GpuModel, Lend, Lent};
use crate::sample::{Pick, Sampled};
use kiln_compiler::graph::{Dim, Graph, InputRole};
use kiln_compiler::interp::{self, InterpError};
use kiln_compiler::lower::{Plan, Storage};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// What can go wrong while generating.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The interpreter failed (bad ids, ...).
    #[error(transparent)]
    Interp(#[from] InterpError),
    /// The device failed.
    #[error(transparent)]
    Gpu(Box<GpuError>),
    /// The CPU back end failed.
    #[error(transparent)]
    Cpu(Box<CpuError>),
    /// The graph is not a cached decoder graph, or the request is unusable.
    #[error("{0}")]
    Invalid(String),
}

type R<T> = Result<T, GenerateError>;

impl From<CpuError> for GenerateError {
    fn from(e: CpuError) -> Self {
        GenerateError::Cpu(Box::new(e))
    }
}

impl From<GpuError> for GenerateError {
    fn from(e: GpuError) -> Self {
        GenerateError::Gpu(Box::new(e))
    }
}

/// Inputs that stay the same for a whole session: an encoder-decoder's source mask on the host,
/// its encoder's keys and values (on the host, or on the device for a
/// [`GpuEngine`](crate::engine::GpuEngine)).
#[derive(Default)]
pub struct Memory {
    pub(crate) host: HashMap<String, Tensor>,
    device: HashMap<String, DeviceTensor>,
}

impl Memory {
    /// Memory of host tensors.
    pub(crate) fn host(host: HashMap<String, Tensor>) -> Memory {
        Memory { host, device: HashMap::new() }
    }

    /// Memory of device tensors.
    pub(crate) fn device(device: HashMap<String, DeviceTensor>) -> Memory {
        Memory { host: HashMap::new(), device }
    }

    /// Lends the device tensors to a run ([`Memory::put_device`] gives them back).
    pub(crate) fn take_device(&mut self) -> HashMap<String, DeviceTensor> {
        std::mem::take(&mut self.device)
    }

    /// Gives device tensors back after a run.
    pub(crate) fn put_device(&mut self, device: HashMap<String, DeviceTensor>) {
        self.device = device;
    }

    /// Runs an encoder graph (see [`kiln_compiler::graph::build::build_encoder`]) on `given`
    /// (`src_ids`, `src_padding`) once on `encoder`; its outputs, and the source mask, become the
    /// memory a decoder session reads at every step. On a GPU the outputs stay on the device.
    pub fn encode(encoder: &dyn Engine, given: &HashMap<String, Tensor>) -> R<Memory> {
        let mut memory = encoder.encode(given)?;
        // The source mask, if given, masks cross-attention at every step (inputs a decoder step
        // does not take, the source ids, are ignored by its binding).
        memory.host.extend(given.iter().map(|(n, t)| (n.clone(), t.clone())));
        Ok(memory)
    }
}

/// The logits of the last position of a step's outputs.
pub(crate) fn last_logits(mut outputs: HashMap<String, Tensor>) -> R<Vec<f32>> {
    let logits = outputs.remove("logits").ok_or_else(|| GenerateError::Invalid("no `logits` output".into()))?;
    let vocab = logits.shape.last().copied().unwrap_or(0);
    let data = logits.as_f32().ok_or_else(|| GenerateError::Invalid("logits are not f32".into()))?;
    let last = data.get(data.len().saturating_sub(vocab)..).unwrap_or_default();
    Ok(last.to_vec())
}

/// `(present output, past input)`: a cached tensor as one step writes it and the next reads it.
pub type Link = (String, String);

/// A forward pass that keeps a key/value cache between calls.
pub trait Engine {
    /// The names of the graph's token-id inputs.
    fn id_inputs(&self) -> Vec<String>;

    /// Runs the graph once on `given` and keeps every output as memory a decoder reads at every
    /// step (an encoder's keys and values; on the device for [`GpuEngine`]).
    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory>;

    /// One forward pass on `inputs` (the token ids and the memory's host tensors), the cache it
    /// holds and `memory`'s device tensors. On success the presents named by `links` become the
    /// cache (under their past names) and the other outputs are returned; on an error the cache
    /// and `memory` are as they were.
    fn step(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
    ) -> R<HashMap<String, Tensor>>;

    /// [`Engine::step`], then the next token picked as `pick` says from the logits of the last
    /// position (the `logits` output, which is not returned). The default picks on the host;
    /// an engine that keeps the logits elsewhere picks there ([`GpuEngine`]: on the device,
    /// reading back one id, and the logits only when `pick.logits` asks for them).
    fn step_sample(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
        pick: Pick<'_>,
    ) -> R<Sampled> {
        let outputs = self.step(inputs, memory, links)?;
        Ok(pick.on_host(last_logits(outputs)?))
    }

    /// Forgets the cache.
    fn clear(&mut self);

    /// The cache as tensors on the host (read back from the device if it lives there), by past
    /// input name.
    fn cache(&self) -> R<HashMap<String, Tensor>>;
}

impl<E: Engine + ?Sized> Engine for Box<E> {
    fn id_inputs(&self) -> Vec<String> {
        (**self).id_inputs()
    }

    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory> {
        (**self).encode(given)
    }

    fn step(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
    ) -> R<HashMap<String, Tensor>> {
        (**self).step(inputs, memory, links)
    }

    fn step_sample(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
        pick: Pick<'_>,
    ) -> R<Sampled> {
        (**self).step_sample(inputs, memory, links, pick)
    }

    fn clear(&mut self) {
        (**self).clear();
    }

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        (**self).cache()
    }
}

/// Moves each present of `outputs` into `cache` under its past name.
fn take_presents<T>(links: &[Link], outputs: &mut HashMap<String, T>, cache: &mut HashMap<String, T>) -> R<()> {
    for (present, past) in links {
        let t = outputs
            .remove(present)
            .ok_or_else(|| GenerateError::Invalid(format!("the step did not produce `{present}`")))?;
        cache.insert(past.clone(), t);
    }
    Ok(())
}

/// Rows a sliding-window layer's cache keeps, by past input name: `window - 1`.
fn windows<'a>(inputs: impl Iterator<Item = (&'a str, InputRole)>) -> HashMap<String, usize> {
    inputs
        .filter_map(|(name, role)| match role {
            InputRole::Cache { window: Some(w), .. } => Some((name.to_string(), w.saturating_sub(1))),
            _ => None,
        })
        .collect()
}

/// [`windows`] of a plan's inputs.
fn plan_windows(plan: &Plan) -> HashMap<String, usize> {
    windows(plan.values.iter().filter_map(|v| match &v.storage {
        Storage::Input { name, role } => Some((name.as_str(), *role)),
        _ => None,
    }))
}

/// The latest `rows` rows of a `[b, heads, len, d]` host tensor.
fn keep_last_rows(t: Tensor, rows: usize) -> R<Tensor> {
    let &[b, heads, len, d] = t.shape.as_slice() else {
        return Err(GenerateError::Invalid(format!("a cache of shape {:?} is not [b, heads, len, d]", t.shape)));
    };
    if len <= rows {
        return Ok(t);
    }
    let data = t.as_f32().ok_or_else(|| GenerateError::Invalid("a cache is not f32".into()))?;
    let kept =
        data.chunks(len * d).flat_map(|head| head.get((len - rows) * d..).unwrap_or_default()).copied().collect();
    Ok(Tensor::f32(vec![b, heads, rows, d], kept))
}

/// The token-id inputs of a plan.
fn plan_ids(plan: &Plan) -> Vec<String> {
    plan.values
        .iter()
        .filter_map(|v| match &v.storage {
            Storage::Input { name, role: InputRole::Ids } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

/// The reference interpreter on a graph with its parameters; the cache in host memory.
pub struct InterpEngine {
    graph: Graph,
    params: HashMap<String, Tensor>,
    cache: HashMap<String, Tensor>,
    windows: HashMap<String, usize>,
}

impl InterpEngine {
    /// An engine running `graph` (a cached decoder step, or an encoder) with `params`.
    pub fn new(graph: Graph, params: HashMap<String, Tensor>) -> InterpEngine {
        let windows = windows(graph.inputs().into_iter().map(|(_, name, role)| (name, role)));
        InterpEngine { graph, params, cache: HashMap::new(), windows }
    }
}

impl Engine for InterpEngine {
    fn id_inputs(&self) -> Vec<String> {
        self.graph
            .inputs()
            .iter()
            .filter(|(_, _, role)| *role == InputRole::Ids)
            .map(|(_, name, _)| name.to_string())
            .collect()
    }

    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory> {
        Ok(Memory::host(interp::run(&self.graph, &self.params, given)?.into_iter().collect()))
    }

    fn step(
        &mut self,
        mut inputs: HashMap<String, Tensor>,
        _memory: &mut Memory,
        links: &[Link],
    ) -> R<HashMap<String, Tensor>> {
        // The cache moves into the inputs (no copy per step), and back on an error.
        inputs.extend(std::mem::take(&mut self.cache));
        let mut outputs: HashMap<String, Tensor> = match interp::run(&self.graph, &self.params, &inputs) {
            Ok(outputs) => outputs.into_iter().collect(),
            Err(e) => {
                for (_, past) in links {
                    if let Some(t) = inputs.remove(past) {
                        self.cache.insert(past.clone(), t);
                    }
                }
                return Err(e.into());
            }
        };
        take_presents(links, &mut outputs, &mut self.cache)?;
        for (past, &rows) in &self.windows {
            if let Some(t) = self.cache.remove(past) {
                self.cache.insert(past.clone(), keep_last_rows(t, rows)?);
            }
        }
        Ok(outputs)
    }

    fn clear(&mut self) {
        self.cache.clear();
    }

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        Ok(self.cache.clone())
    }
}

/// A compiled plan on the CPU's native kernels; the cache in host memory, read in place and
/// appended in place (see [`crate::cpu::cache`]).
pub struct CpuEngine {
    model: CpuModel,
    cache: KvCache,
    windows: HashMap<String, usize>,
}

impl CpuEngine {
    /// An engine running `model`.
    pub fn new(model: CpuModel) -> CpuEngine {
        let windows = plan_windows(model.plan());
        CpuEngine { model, cache: KvCache::new(), windows }
    }

    /// The cache as it is held: by past input name, each with its length and spare capacity.
    pub fn buffers(&self) -> &KvCache {
        &self.cache
    }
}

impl Engine for CpuEngine {
    fn id_inputs(&self) -> Vec<String> {
        plan_ids(self.model.plan())
    }

    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory> {
        Ok(Memory::host(self.model.run(given)?.into_iter().collect()))
    }

    fn step(
        &mut self,
        inputs: HashMap<String, Tensor>,
        _memory: &mut Memory,
        links: &[Link],
    ) -> R<HashMap<String, Tensor>> {
        let outputs = self.model.run_cached(&inputs, &mut self.cache, links)?;
        for (past, &rows) in &self.windows {
            if let Some(buf) = self.cache.get_mut(past) {
                buf.slide(rows).map_err(|e| GenerateError::Invalid(e.to_string()))?;
            }
        }
        Ok(outputs.into_iter().collect())
    }

    fn clear(&mut self) {
        self.cache.clear();
    }

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        Ok(self.cache.iter().map(|(name, buf)| (name.clone(), buf.to_tensor())).collect())
    }
}

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
    fn step_lending(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
        lend: Option<Lend<'_>>,
    ) -> R<HashMap<String, Tensor>> {
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
        for (past, &rows) in &self.windows {
            if let Some(t) = self.cache.remove(past) {
                self.cache.insert(past.clone(), t.keep_last_rows(rows)?);
            }
        }
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

    fn step(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
    ) -> R<HashMap<String, Tensor>> {
        self.step_lending(inputs, memory, links, None)
    }

    fn step_sample(
        &mut self,
        inputs: HashMap<String, Tensor>,
        memory: &mut Memory,
        links: &[Link],
        pick: Pick<'_>,
    ) -> R<Sampled> {
        let gpu = self.model.gpu().clone();
        if self.host_sampling || !self.vocab().is_some_and(|v| DeviceSampler::fits(&gpu, v)) {
            let outputs = self.step(inputs, memory, links)?;
            return Ok(pick.on_host(last_logits(outputs)?));
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
        let run = self.step_lending(inputs, memory, links, Some(("logits", &mut record)));
        let sampled = run.and_then(|_| {
            let pending = pending.ok_or_else(|| GenerateError::Invalid("no `logits` output".into()))?;
            Ok(sampler.finish(pending)?)
        });
        self.sampler = Some(sampler);
        sampled
    }

    fn clear(&mut self) {
        self.cache.clear();
    }

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        self.cache.iter().map(|(name, t)| Ok((name.clone(), t.read()?))).collect()
    }
}

impl From<crate::Model> for Box<dyn Engine> {
    fn from(model: crate::Model) -> Box<dyn Engine> {
        match model {
            crate::Model::Gpu(m) => Box::new(GpuEngine::new(*m)),
            crate::Model::Cpu(m) => Box::new(CpuEngine::new(*m)),
        }
    }
}
