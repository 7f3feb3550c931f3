//! Text generation with a key/value cache: a [`Session`] runs a decoder's cached graph (see
//! [`kiln_compiler::graph::build::build_cached`]) once over the prompt (prefill), then one token at
//! a time, feeding each step's `present_k`/`present_v` outputs back as the next step's
//! `past_k`/`past_v` inputs, so the prefix is never recomputed. A [`Sampler`] picks each token
//! (greedy, temperature, top-k, top-p, repetition penalty, seeded) — on the host from the
//! logits, or where the engine keeps them: on wgpu a kernel after the head picks it and a step
//! reads back one id ([`Session::sample`], [`crate::sample`]); [`generate`] drives the loop with
//! stop tokens and a per-token callback for streaming.

use crate::cpu::CpuError;
use crate::engine::{Engine, Link};
use crate::gpu::{DeviceTensor, GpuError};
use kiln_compiler::interp::{self, InterpError};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::time::Instant;

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
    host: HashMap<String, Tensor>,
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

/// The `(present output, past input)` name pairs of a cached decoder graph's outputs: each
/// `L.present_k` / `L.present_v` output feeds the next step's `L.past_k` / `L.past_v` input.
pub fn links(outputs: &[String]) -> Vec<Link> {
    outputs
        .iter()
        .filter_map(|o| {
            let past = o.strip_suffix(".present_k").map(|l| format!("{l}.past_k"));
            let past = past.or_else(|| o.strip_suffix(".present_v").map(|l| format!("{l}.past_v")));
            past.map(|p| (o.clone(), p))
        })
        .collect()
}

/// One sequence being generated: the engine (which holds the cache so far) and the memory.
pub struct Session {
    engine: Box<dyn Engine>,
    /// The token ids input (`input_ids`, or `tgt_ids` for an encoder-decoder).
    ids_input: String,
    /// `(present output, past input)` name pairs, one per cached tensor.
    links: Vec<Link>,
    memory: Memory,
    /// Tokens in the cache.
    pub position: usize,
    /// Positions the model has (its learned or maximum context).
    pub max_positions: usize,
}

impl Session {
    /// A session on a cached decoder graph's engine; `outputs` are the graph's output names (the
    /// `*.present_k`/`*.present_v` ones are the cache, `logits` the scores). The engine keeps the
    /// cache where its kernels read it (on a GPU, on the device).
    pub fn new(engine: Box<dyn Engine>, outputs: &[String], max_positions: usize) -> R<Session> {
        let links = links(outputs);
        if links.is_empty() || !outputs.iter().any(|o| o == "logits") {
            return Err(GenerateError::Invalid(
                "generation needs a decoder graph built with a key/value cache and a `logits` output".into(),
            ));
        }
        let [ids_input] = <[String; 1]>::try_from(engine.id_inputs()).map_err(|ids| {
            GenerateError::Invalid(format!("a decoder step takes one token-id input, this graph has {}", ids.len()))
        })?;
        Ok(Session { engine, ids_input, links, memory: Memory::default(), position: 0, max_positions })
    }

    /// Sets what every step reads besides the tokens and the cache: an encoder's output.
    pub fn with_memory(mut self, memory: Memory) -> Session {
        self.memory = memory;
        self
    }

    /// Runs `ids` after the cached tokens; returns the logits of the last one. On an error the
    /// session is as it was.
    pub fn forward(&mut self, ids: &[i64]) -> R<Vec<f32>> {
        let inputs = self.inputs(ids)?;
        let outputs = self.engine.step(inputs, &mut self.memory, &self.links)?;
        self.position += ids.len();
        last_logits(outputs)
    }

    /// Runs `ids` after the cached tokens and picks the next token as `pick` says, where the
    /// engine chooses to (on wgpu, on the device: see [`Engine::step_sample`]); the logits are
    /// returned only when `pick.logits` asks for them. On an error the session is as it was
    /// (the sampler may have drawn its uniform).
    pub fn sample(&mut self, ids: &[i64], pick: Pick<'_>) -> R<Sampled> {
        let inputs = self.inputs(ids)?;
        let sampled = self.engine.step_sample(inputs, &mut self.memory, &self.links, pick)?;
        self.position += ids.len();
        Ok(sampled)
    }

    /// The inputs of a step running `ids` after the cached tokens.
    fn inputs(&self, ids: &[i64]) -> R<HashMap<String, Tensor>> {
        if ids.is_empty() {
            return Err(GenerateError::Invalid("nothing to run: no token ids".into()));
        }
        if self.position + ids.len() > self.max_positions {
            return Err(GenerateError::Invalid(format!(
                "{} cached + {} new tokens exceed the model's {} positions",
                self.position,
                ids.len(),
                self.max_positions
            )));
        }
        let mut inputs = self.memory.host.clone();
        inputs.insert(self.ids_input.clone(), Tensor::i64(vec![1, ids.len()], ids.to_vec()));
        // Where positions start: sliding-window caches hold only the latest tokens.
        inputs.insert(interp::PAST_LEN.to_string(), Tensor::i64(vec![1], vec![self.position as i64]));
        Ok(inputs)
    }

    /// Forgets the cache: the next [`forward`](Self::forward) starts a new sequence (with the
    /// same memory).
    pub fn reset(&mut self) {
        self.engine.clear();
        self.position = 0;
    }

    /// The cache as tensors on the host (read back from the device if it lives there), by past
    /// input name.
    pub fn cache(&self) -> R<HashMap<String, Tensor>> {
        self.engine.cache()
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

/// How a step picks the next token ([`Session::sample`], [`Engine::step_sample`]).
pub struct Pick<'a> {
    /// The settings and the random state.
    pub sampler: &'a mut Sampler,
    /// The tokens so far (for the repetition penalty).
    pub seen: &'a [i64],
    /// Return the logits too (on wgpu, read back only then).
    pub logits: bool,
}

impl Pick<'_> {
    /// Picks on the host from the last position's logits.
    pub(crate) fn on_host(self, logits: Vec<f32>) -> Sampled {
        let token = self.sampler.sample(&logits, self.seen);
        Sampled { token, logits: self.logits.then_some(logits) }
    }
}

/// The token a step picked, and the last position's logits when [`Pick::logits`] asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The next token.
    pub token: i64,
    /// The logits it was picked from (before the repetition penalty).
    pub logits: Option<Vec<f32>>,
}

/// How the next token is chosen. `temperature == 0` is greedy (ties to the lowest id).
#[derive(Clone, Debug)]
pub struct Sampler {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to `top_p` (1 = all).
    pub top_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already seen by this (1 = off),
    /// as CTRL and HF transformers do.
    pub repetition_penalty: f32,
    /// Random state (SplitMix64), from the seed.
    state: u64,
}

impl Sampler {
    /// Greedy decoding.
    pub fn greedy() -> Sampler {
        Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0, state: 0 }
    }

    /// A sampler with the given settings and seed.
    pub fn new(temperature: f32, top_k: usize, top_p: f32, repetition_penalty: f32, seed: u64) -> R<Sampler> {
        let checks = [
            ("temperature", temperature, temperature.is_finite() && temperature >= 0.0, "a finite number >= 0"),
            ("top-p", top_p, top_p > 0.0 && top_p <= 1.0, "in (0, 1]"),
            (
                "repetition penalty",
                repetition_penalty,
                repetition_penalty.is_finite() && repetition_penalty > 0.0,
                "a finite number > 0",
            ),
        ];
        if let Some((name, value, _, want)) = checks.iter().find(|(_, _, ok, _)| !ok) {
            return Err(GenerateError::Invalid(format!("bad sampling settings: {name} {value} is not {want}")));
        }
        Ok(Sampler { temperature, top_k, top_p, repetition_penalty, state: seed })
    }

    /// Whether it takes the argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The ids whose logits the repetition penalty changes: the `seen` ones that can index a
    /// logit, each once, in increasing order; none when the penalty is off.
    pub(crate) fn penalized(&self, seen: &[i64]) -> Vec<usize> {
        if self.repetition_penalty == 1.0 {
            return Vec::new();
        }
        let mut ids: Vec<usize> = seen.iter().filter_map(|&t| usize::try_from(t).ok()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The draw of a step: `None` when greedy, else the next uniform of the random state (one
    /// per sampled token, wherever it is sampled, so a seed gives one stream of tokens).
    pub(crate) fn draw(&mut self) -> Option<f64> {
        (!self.is_greedy()).then(|| self.uniform())
    }

    /// SplitMix64 (Steele, Lea, Flood 2014): a uniform float in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks a token from `logits`, given the tokens so far (for the repetition penalty). The
    /// device's sampler (`back::wgsl::sample`) has these semantics.
    pub fn sample(&mut self, logits: &[f32], seen: &[i64]) -> i64 {
        let mut l = logits.to_vec();
        for t in self.penalized(seen) {
            if let Some(v) = l.get_mut(t) {
                *v = if *v > 0.0 { *v / self.repetition_penalty } else { *v * self.repetition_penalty };
            }
        }
        let argmax = || {
            l.iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) })
                .0
        };
        let Some(r) = self.draw() else { return argmax() as i64 };
        // Candidates (token, logit) by decreasing logit, cut by top-k, softmax at the temperature,
        // cut by top-p.
        let mut order: Vec<(usize, f32)> = l.iter().copied().enumerate().filter(|(_, v)| v.is_finite()).collect();
        order.sort_by(|&(a, va), &(b, vb)| vb.total_cmp(&va).then(a.cmp(&b)));
        if self.top_k > 0 {
            order.truncate(self.top_k);
        }
        let Some(&(best, max)) = order.first() else { return argmax() as i64 };
        let mut probs: Vec<f64> = order.iter().map(|&(_, v)| (((v - max) / self.temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut kept = 0;
        let mut mass = 0.0;
        for p in &probs {
            kept += 1;
            mass += p;
            if mass >= self.top_p as f64 {
                break;
            }
        }
        // The first kept candidate at which the cumulative mass passes `r` (else the last kept).
        let mut r = r * mass;
        let mut picked = best;
        for (&(i, _), p) in order.iter().zip(&probs).take(kept) {
            picked = i;
            r -= p;
            if r <= 0.0 {
                break;
            }
        }
        picked as i64
    }
}

/// Timings of one generation.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub new_tokens: usize,
    /// Time of the prefill (the prompt's forward pass and the first pick), in seconds.
    pub prefill_s: f64,
    /// Time of the decode steps, in seconds.
    pub decode_s: f64,
    /// Why generation stopped.
    pub stop: Stop,
}

/// Why a generation stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stop {
    /// It generated the most tokens it was allowed (`max_new`; also when that is 0).
    #[default]
    MaxNewTokens,
    /// It generated one of the stop ids.
    StopId,
    /// The `on_token` callback returned `false`.
    Caller,
    /// The session's context is full (its `max_positions`).
    ContextFull,
}

impl Stats {
    /// Prompt tokens per second; 0 when the prompt was not run (nothing to generate).
    pub fn prefill_tok_s(&self) -> f64 {
        if self.prefill_s > 0.0 { self.prompt_tokens as f64 / self.prefill_s } else { 0.0 }
    }

    /// Generated tokens per second (each after the first needs one decode step).
    pub fn decode_tok_s(&self) -> f64 {
        self.new_tokens.saturating_sub(1) as f64 / self.decode_s.max(1e-9)
    }
}

/// Generates up to `max_new` tokens after `prompt`, stopping after any of `stop` (which is
/// returned). `on_token` sees each token as it is chosen and may return `false` to stop early.
/// [`Stats::stop`] says why generation stopped.
pub fn generate(
    session: &mut Session,
    prompt: &[i64],
    max_new: usize,
    sampler: &mut Sampler,
    stop: &[i64],
    mut on_token: impl FnMut(i64) -> bool,
) -> R<(Vec<i64>, Stats)> {
    let mut stats = Stats { prompt_tokens: prompt.len(), ..Stats::default() };
    let mut seen = prompt.to_vec();
    let mut out = Vec::new();
    if max_new == 0 {
        return Ok((out, stats));
    }
    // Each step picks the next token where its engine keeps the logits (on wgpu, on the device).
    let t = Instant::now();
    let mut token = session.sample(prompt, Pick { sampler: &mut *sampler, seen: &seen, logits: false })?.token;
    stats.prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    loop {
        out.push(token);
        seen.push(token);
        let go_on = on_token(token);
        let reason = if stop.contains(&token) {
            Some(Stop::StopId)
        } else if !go_on {
            Some(Stop::Caller)
        } else if out.len() >= max_new {
            Some(Stop::MaxNewTokens)
        } else if session.position >= session.max_positions {
            Some(Stop::ContextFull)
        } else {
            None
        };
        if let Some(reason) = reason {
            stats.stop = reason;
            break;
        }
        token = session.sample(&[token], Pick { sampler: &mut *sampler, seen: &seen, logits: false })?.token;
    }
    stats.decode_s = t.elapsed().as_secs_f64();
    stats.new_tokens = out.len();
    Ok((out, stats))
}
