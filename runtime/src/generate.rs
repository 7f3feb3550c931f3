//! Text generation with a key/value cache: a [`Session`] runs a decoder's cached graph (see
//! [`kiln_compiler::graph::build::build_cached`]) once over the prompt (prefill), then one token at
//! a time, feeding each step's `present_k`/`present_v` outputs back as the next step's
//! `past_k`/`past_v` inputs, so the prefix is never recomputed. A [`Sampler`] picks each token
//! (greedy, temperature, top-k, top-p, repetition penalty, seeded) — on the host from the
//! logits, or where the engine keeps them: on wgpu a kernel after the head picks it and a step
//! reads back one id ([`Session::sample`], [`crate::gpu::DeviceSampler`]); [`generate`] drives
//! the loop with stop tokens and a per-token callback for streaming.
//!
//! The session is the top of a one-way chain: it drives an [`Engine`] ([`crate::engine`]),
//! which picks tokens as [`crate::sample`] says; neither knows sessions.

use crate::engine::{BatchSeq, Engine, GenerateError, Link, Memory, Request, last_logits};
use crate::sample::{Pick, Sampled, Sampler};
use kiln_compiler::interp;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::time::Instant;

type R<T> = Result<T, GenerateError>;

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
            return Err(GenerateError::NotCached);
        }
        let [ids_input] =
            <[String; 1]>::try_from(engine.id_inputs()).map_err(|ids| GenerateError::IdInputs(ids.len()))?;
        Ok(Session { engine, ids_input, links, memory: Memory::default(), position: 0, max_positions })
    }

    /// Sets what every step reads besides the tokens and the cache: an encoder's output.
    pub fn with_memory(mut self, memory: Memory) -> Session {
        self.memory = memory;
        self
    }

    /// Replaces what every step reads besides the tokens and the cache (a new source's encoding);
    /// the cache is the caller's to [`reset`](Self::reset).
    pub fn set_memory(&mut self, memory: Memory) {
        self.memory = memory;
    }

    /// Runs `ids` after the cached tokens; returns the logits of the last one. On an error the
    /// session is as it was.
    pub fn forward(&mut self, ids: &[i64]) -> R<Vec<f32>> {
        let inputs = self.inputs(ids)?;
        let outputs = self.engine.step(Request { inputs, memory: &mut self.memory, links: &self.links })?;
        self.position += ids.len();
        last_logits(outputs)
    }

    /// Runs `ids` after the cached tokens and picks the next token as `pick` says, where the
    /// engine chooses to (on wgpu, on the device: see [`Engine::step_sample`]); the logits are
    /// returned only when `pick.logits` asks for them. On an error the session is as it was
    /// (the sampler may have drawn its uniform).
    pub fn sample(&mut self, ids: &[i64], pick: Pick<'_>) -> R<Sampled> {
        let inputs = self.inputs(ids)?;
        let request = Request { inputs, memory: &mut self.memory, links: &self.links };
        let sampled = self.engine.step_sample(request, pick)?;
        self.position += ids.len();
        Ok(sampled)
    }

    /// The inputs of a step running `ids` after the cached tokens.
    fn inputs(&self, ids: &[i64]) -> R<HashMap<String, Tensor>> {
        if ids.is_empty() {
            return Err(GenerateError::NoIds);
        }
        if self.position + ids.len() > self.max_positions {
            return Err(GenerateError::TooLong {
                cached: self.position,
                new: ids.len(),
                positions: self.max_positions,
            });
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

    /// The host's time in the engine's steps, where a device does the rest (see
    /// [`Engine::host_clock`]).
    pub fn host_clock(&self) -> Option<crate::gpu::HostClock> {
        self.engine.host_clock()
    }

    /// Takes the sequence out of the session (its cache and position), leaving the session at a
    /// new sequence, to be continued later by [`resume`](Self::resume): one session's engine
    /// serves many sequences in turn, each with its own cache (see [`Engine::park`]).
    pub fn park(&mut self) -> ParkedSequence {
        let position = std::mem::take(&mut self.position);
        ParkedSequence { cache: self.engine.park(), position }
    }

    /// Continues a sequence [`park`](Self::park) took out of this session; the one the session
    /// held is dropped. On an error (a sequence of another kind of engine) the session is as it
    /// was.
    pub fn resume(&mut self, parked: ParkedSequence) -> R<()> {
        self.engine.resume(parked.cache)?;
        self.position = parked.position;
        Ok(())
    }

    /// One decode step of several parked sequences of this session together (continuous
    /// batching, see [`Engine::step_batch`]): each runs its token after its own cache, with every
    /// weight read once for all of them. Returns each sequence's logits, in order, and each
    /// sequence one token longer; `None` where the engine cannot run them together (or the
    /// session has memory, an encoder's, which is the session's and not each sequence's), with
    /// nothing changed: run them in turn. On an error every sequence is as it was. The sequence
    /// the session holds itself is not touched.
    pub fn forward_batch(&mut self, seqs: &mut [(&mut ParkedSequence, i64)]) -> R<Option<Vec<Vec<f32>>>> {
        if !self.memory.host.is_empty() || seqs.is_empty() {
            return Ok(None);
        }
        if let Some((seq, _)) = seqs.iter().find(|(seq, _)| seq.position + 1 > self.max_positions) {
            return Err(GenerateError::TooLong { cached: seq.position, new: 1, positions: self.max_positions });
        }
        let mut batch: Vec<BatchSeq<'_>> = seqs
            .iter_mut()
            .map(|(seq, token)| BatchSeq { past: seq.position, token: *token, parked: &mut seq.cache })
            .collect();
        let logits = self.engine.step_batch(&mut batch, &self.links)?;
        if logits.is_some() {
            for (seq, _) in seqs.iter_mut() {
                seq.position += 1;
            }
        }
        Ok(logits)
    }
}

/// A sequence parked by [`Session::park`]: its cache, where the engine keeps it, and its length.
pub struct ParkedSequence {
    cache: crate::engine::Parked,
    position: usize,
}

impl ParkedSequence {
    /// Tokens in the cache.
    pub fn position(&self) -> usize {
        self.position
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
    on_token: impl FnMut(i64) -> bool,
) -> R<(Vec<i64>, Stats)> {
    generate_after(session, &[], prompt, max_new, sampler, stop, on_token)
}

/// [`generate`] in a session whose cache already holds `context` (an earlier turn of a chat):
/// only `prompt` runs, but the sampler's repetition penalty sees `context` too, as it would had
/// the whole sequence run as one prompt.
pub fn generate_after(
    session: &mut Session,
    context: &[i64],
    prompt: &[i64],
    max_new: usize,
    sampler: &mut Sampler,
    stop: &[i64],
    mut on_token: impl FnMut(i64) -> bool,
) -> R<(Vec<i64>, Stats)> {
    let mut stats = Stats { prompt_tokens: prompt.len(), ..Stats::default() };
    let mut seen = [context, prompt].concat();
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
