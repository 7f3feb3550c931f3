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
//! CPU engines ([`crate::sample`]), on the device for [`GpuEngine`]
//! ([`DeviceSampler`](crate::gpu::DeviceSampler)).
//!
//! Engines know sampling (a [`Pick`] asks for a token) but not sessions; a session drives an
//! engine ([`crate::generate`]).

mod cpu;
mod gpu;
mod interp;

pub use cpu::CpuEngine;
pub use gpu::GpuEngine;
pub use interp::InterpEngine;

use crate::ModelError;
use crate::gpu::DeviceTensor;
use crate::sample::{Pick, Sampled};
use kiln_compiler::graph::InputRole;
use kiln_compiler::interp::InterpError;
use kiln_compiler::lower::{Plan, Storage};
use kiln_compiler::memory::MemoryError;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// What can go wrong while generating.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The interpreter failed (bad ids, ...).
    #[error(transparent)]
    Interp(#[from] InterpError),
    /// The back end failed (the device, or the CPU's kernels).
    #[error(transparent)]
    Model(ModelError),
    /// Not enough host memory for the cache.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The graph is not a cached decoder graph with a `logits` output.
    #[error("generation needs a decoder graph built with a key/value cache and a `logits` output")]
    NotCached,
    /// The graph takes no token-id input, or several.
    #[error("a decoder step takes one token-id input, this graph has {0}")]
    IdInputs(usize),
    /// A step was asked to run no tokens.
    #[error("nothing to run: no token ids")]
    NoIds,
    /// The tokens would run past the model's positions.
    #[error("{cached} cached + {new} new tokens exceed the model's {positions} positions")]
    TooLong {
        /// Tokens in the cache.
        cached: usize,
        /// Tokens asked for.
        new: usize,
        /// Positions the model has.
        positions: usize,
    },
    /// A step did not produce an output the session reads (`logits`, a present).
    #[error("the step did not produce `{0}`")]
    MissingOutput(String),
    /// A tensor the session reads is not f32 (`what`: the logits, a cache).
    #[error("{0} is not f32")]
    NotF32(&'static str),
    /// A tensor held as a key/value cache is not `[b, heads, len, d]`.
    #[error("a cache of shape {0:?} is not [b, heads, len, d]")]
    CacheShape(Vec<usize>),
    /// The logits of a step hold a NaN, which no token can be sampled from.
    #[error(
        "the logits to sample from hold a NaN: the model's arithmetic overflowed (with f16 weights or arithmetic, try --precision f32)"
    )]
    NanLogits,
    /// A parked cache was given to another kind of engine than the one that parked it.
    #[error("a cache parked by another kind of engine cannot be resumed on this one")]
    OtherEngine,
}

type R<T> = Result<T, GenerateError>;

/// A back end's error ([`GpuError`](crate::GpuError), [`CpuError`](crate::CpuError)) as
/// [`GenerateError::Model`].
impl<E> From<E> for GenerateError
where
    ModelError: From<E>,
{
    fn from(e: E) -> Self {
        GenerateError::Model(ModelError::from(e))
    }
}

/// Inputs that stay the same for a whole session: an encoder-decoder's source mask on the host,
/// its encoder's keys and values (on the host, or on the device for a [`GpuEngine`]).
#[derive(Default)]
pub struct Memory {
    pub(crate) host: HashMap<String, Tensor>,
    device: HashMap<String, DeviceTensor>,
}

impl Memory {
    /// Memory of host tensors.
    fn host(host: HashMap<String, Tensor>) -> Memory {
        Memory { host, device: HashMap::new() }
    }

    /// Memory of device tensors.
    fn device(device: HashMap<String, DeviceTensor>) -> Memory {
        Memory { host: HashMap::new(), device }
    }

    /// Lends the device tensors to a run ([`Memory::put_device`] gives them back).
    fn take_device(&mut self) -> HashMap<String, DeviceTensor> {
        std::mem::take(&mut self.device)
    }

    /// Gives device tensors back after a run.
    fn put_device(&mut self, device: HashMap<String, DeviceTensor>) {
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

/// `(present output, past input)`: a cached tensor as one step writes it and the next reads it.
pub type Link = (String, String);

/// One step asked of an engine: its inputs, the session's memory and which presents become the
/// cache.
pub struct Request<'a> {
    /// The token ids and the memory's host tensors.
    pub inputs: HashMap<String, Tensor>,
    /// The memory, whose device tensors the step reads in place.
    pub memory: &'a mut Memory,
    /// The presents that become the cache, under their past names.
    pub links: &'a [Link],
}

/// A forward pass that keeps a key/value cache between calls.
pub trait Engine {
    /// The names of the graph's token-id inputs.
    fn id_inputs(&self) -> Vec<String>;

    /// Runs the graph once on `given` and keeps every output as memory a decoder reads at every
    /// step (an encoder's keys and values; on the device for [`GpuEngine`]).
    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory>;

    /// One forward pass on the request's inputs, the cache it holds and its memory's device
    /// tensors. On success the presents named by its links become the cache (under their past
    /// names) and the other outputs are returned; on an error the cache and the memory are as
    /// they were.
    fn step(&mut self, request: Request<'_>) -> R<HashMap<String, Tensor>>;

    /// [`Engine::step`], then the next token picked as `pick` says from the logits of the last
    /// position (the `logits` output, which is not returned). The default picks on the host;
    /// an engine that keeps the logits elsewhere picks there ([`GpuEngine`]: on the device,
    /// reading back one id, and the logits only when `pick.logits` asks for them).
    fn step_sample(&mut self, request: Request<'_>, pick: Pick<'_>) -> R<Sampled> {
        let outputs = self.step(request)?;
        pick.on_host(last_logits(outputs)?)
    }

    /// Forgets the cache.
    fn clear(&mut self);

    /// The host's time in this engine's steps up to each submission, where a device does the
    /// rest ([`GpuEngine`]); `None` where the host does all of it.
    fn host_clock(&self) -> Option<crate::gpu::HostClock> {
        None
    }

    /// Takes the cache out, leaving the engine's empty (a new sequence), to be put back by
    /// [`Engine::resume`]: one engine, one copy of the weights, serves several sequences, each
    /// cache swapped in for its own steps (`kiln serve`). Nothing is copied.
    fn park(&mut self) -> Parked;

    /// Puts back a cache [`Engine::park`] took out of this engine, replacing the one it holds.
    /// A cache parked by another kind of engine is refused, and this engine's left as it was.
    fn resume(&mut self, parked: Parked) -> R<()>;

    /// One decode step of several parked sequences together (continuous batching): each runs
    /// its token after its own cache, every weight read once for all of them, and each cache
    /// grows by its token as [`Engine::step`] would grow it. Returns each sequence's logits, in
    /// order; `None` where this engine cannot run them together (they then take turns through
    /// [`Engine::resume`] and [`Engine::step`]), with nothing changed. On an error every cache is
    /// as it was. The cache the engine holds itself is not touched.
    fn step_batch(&mut self, seqs: &mut [BatchSeq<'_>], links: &[Link]) -> R<Option<Vec<Vec<f32>>>> {
        let _ = (seqs, links);
        Ok(None)
    }

    /// The cache as tensors on the host (read back from the device if it lives there), by past
    /// input name.
    fn cache(&self) -> R<HashMap<String, Tensor>>;
}

/// A sequence's cache taken out of an engine ([`Engine::park`]), held wherever that engine keeps
/// it (on the device for [`GpuEngine`]).
pub struct Parked(Box<dyn std::any::Any>);

impl Parked {
    fn new<T: 'static>(cache: T) -> Parked {
        Parked(Box::new(cache))
    }

    /// The cache in place, if `T` is what this engine parked.
    fn get_mut<T: 'static>(&mut self) -> R<&mut T> {
        self.0.downcast_mut().ok_or(GenerateError::OtherEngine)
    }

    /// The cache, if `T` is what this engine parked.
    fn take<T: 'static>(self) -> R<T> {
        self.0.downcast().map(|b| *b).map_err(|_| GenerateError::OtherEngine)
    }
}

/// One sequence of a batched step ([`Engine::step_batch`]): its parked cache, the token it runs
/// and the tokens before it.
pub struct BatchSeq<'a> {
    /// The sequence's cache, as [`Engine::park`] took it out.
    pub parked: &'a mut Parked,
    /// The token to run.
    pub token: i64,
    /// Tokens before it (its position).
    pub past: usize,
}

/// The logits of the last position of a step's outputs.
pub(crate) fn last_logits(mut outputs: HashMap<String, Tensor>) -> R<Vec<f32>> {
    let logits = outputs.remove("logits").ok_or_else(|| GenerateError::MissingOutput("logits".into()))?;
    let vocab = logits.shape.last().copied().unwrap_or(0);
    let data = logits.as_f32().ok_or(GenerateError::NotF32("the `logits` output"))?;
    let last = data.get(data.len().saturating_sub(vocab)..).unwrap_or_default();
    Ok(last.to_vec())
}

/// Each sequence's logits from a batched step's outputs ([`Engine::step_batch`]): the `logits`
/// output, `[batch, 1, vocab]`, a row per sequence.
fn batch_logits(outputs: Vec<(String, Tensor)>, batch: usize) -> R<Vec<Vec<f32>>> {
    let logits = outputs
        .into_iter()
        .find(|(name, _)| name == "logits")
        .ok_or_else(|| GenerateError::MissingOutput("logits".into()))?
        .1;
    let data = logits.as_f32().ok_or(GenerateError::NotF32("the `logits` output"))?;
    let per_seq = data.len() / batch.max(1);
    Ok(data.chunks(per_seq.max(1)).map(<[f32]>::to_vec).collect())
}

/// Moves each present of `outputs` into `cache` under its past name.
fn take_presents<T>(links: &[Link], outputs: &mut HashMap<String, T>, cache: &mut HashMap<String, T>) -> R<()> {
    for (present, past) in links {
        let t = outputs.remove(present).ok_or_else(|| GenerateError::MissingOutput(present.clone()))?;
        cache.insert(past.clone(), t);
    }
    Ok(())
}

/// Cuts each sliding-window layer's cache to its latest rows (`windows`: rows by past input
/// name) with `keep_last_rows`.
fn slide<T, E>(
    cache: &mut HashMap<String, T>,
    windows: &HashMap<String, usize>,
    keep_last_rows: impl Fn(T, usize) -> Result<T, E>,
) -> R<()>
where
    GenerateError: From<E>,
{
    for (past, &rows) in windows {
        if let Some(t) = cache.remove(past) {
            cache.insert(past.clone(), keep_last_rows(t, rows)?);
        }
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

/// A plan's inputs: name and role.
fn plan_inputs(plan: &Plan) -> impl Iterator<Item = (&str, InputRole)> {
    plan.values.iter().filter_map(|v| match &v.storage {
        Storage::Input { name, role } => Some((name.as_str(), *role)),
        _ => None,
    })
}

/// [`windows`] of a plan's inputs.
fn plan_windows(plan: &Plan) -> HashMap<String, usize> {
    windows(plan_inputs(plan))
}

/// The token-id inputs of a plan.
fn plan_ids(plan: &Plan) -> Vec<String> {
    plan_inputs(plan).filter(|(_, role)| *role == InputRole::Ids).map(|(name, _)| name.to_string()).collect()
}

impl From<crate::Model> for Box<dyn Engine> {
    fn from(model: crate::Model) -> Box<dyn Engine> {
        match model {
            crate::Model::Gpu(m) => Box::new(GpuEngine::new(*m)),
            crate::Model::Cpu(m) => Box::new(CpuEngine::new(*m)),
        }
    }
}
