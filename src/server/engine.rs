//! The model's thread: the one place the model runs. Requests arrive as [`Job`]s; each is
//! tokenized and checked at once (its HTTP status is decided before it waits), then queued until
//! a sequence slot is free and the key/value cache budget holds what it may grow to (its prompt
//! plus its `max_tokens`). Every scheduler step then advances each running sequence by one step
//! — a chunk of its prompt (at most `prefill_chunk` tokens, so a long prompt never stalls the
//! others for long), or one new token — its cache swapped into the one engine for that step
//! ([`Session::park`]): the weights are held once, each sequence has its own cache, and a new
//! request joins at the next step. A sequence whose client went away is dropped at the next step
//! and its cache freed; one whose step fails gets the error and the others go on.
//!
//! The sequences past their prompts decode together where the engine can (the CPU engine:
//! [`Session::forward_batch`]): one step runs every one's next token, each after its own cache,
//! with the weights read once for all of them, so the tokens per second grow with the sequences
//! running. A prompt's chunk runs alone, between two such steps.

use super::api::{ApiError, Prompt, Request, TokenLogprob};
use super::{Limits, Shared};
use crate::cli::generate::{Generator, Model};
use axum::http::StatusCode;
use kiln_runtime::generate::ParkedSequence;
use kiln_runtime::tokenize::DecodeStream;
use kiln_runtime::{Pick, Sampler, Session, Tokenizer};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request handed to the model's thread, and where its events go.
pub struct Job {
    pub request: Request,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// What the model's thread tells a request's handler, in order: `Accepted` or `Failed` first,
/// then text as it comes, then `Done` (or `Failed`).
pub enum Event {
    Accepted,
    Delta { text: String, logprobs: Vec<TokenLogprob> },
    Done { finish: &'static str, prompt_tokens: usize, completion_tokens: usize },
    Failed(ApiError),
}

/// A job tokenized and checked, waiting for a slot.
struct Ready {
    job: Job,
    prompt: Vec<i64>,
    max_new: usize,
    sampler: Sampler,
    /// Cache bytes it may grow to.
    reserve: u64,
}

/// A running sequence.
struct Seq<'t> {
    job: Job,
    prompt: Vec<i64>,
    max_new: usize,
    sampler: Sampler,
    reserve: u64,
    /// The sequence's cache while another runs (`None` only during its own step).
    parked: Option<ParkedSequence>,
    /// Prompt tokens run so far.
    fed: usize,
    generated: Vec<i64>,
    /// Prompt and generated tokens (the repetition penalty's).
    seen: Vec<i64>,
    /// How often each generated token occurs (the frequency and presence penalties').
    counts: HashMap<i64, u32>,
    decoder: DecodeStream<'t>,
    /// The text so far, and how much of it was sent (the rest may begin a stop string).
    text: String,
    sent: usize,
    last_token_at: Option<Instant>,
}

/// Serves jobs until every sender is gone (the server stopped) or the shared abort flag is set.
pub fn serve(model: &Model, generator: &mut Generator, tokenizer: &Tokenizer, jobs: Receiver<Job>, shared: &Shared) {
    let limits = &shared.limits;
    let bytes_per_token = super::cache_bytes_per_token(&model.fe);
    shared.metrics.kv_cache_budget_bytes.set(limits.kv_budget);
    let context = generator.max_positions();
    let mut queue: VecDeque<Ready> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut reserved = 0u64;
    loop {
        let Some(incoming) = super::take_jobs(&jobs, running.is_empty() && queue.is_empty()) else { return };
        for job in incoming {
            match check(model, tokenizer, context, limits, bytes_per_token, &job.request) {
                Ok((prompt, max_new, sampler)) => {
                    let _ = job.events.send(Event::Accepted);
                    let reserve = bytes_per_token * (prompt.len() + max_new) as u64;
                    queue.push_back(Ready { job, prompt, max_new, sampler, reserve });
                }
                Err(e) => {
                    shared.waiting.fetch_sub(1, Ordering::Relaxed);
                    shared.metrics.invalid.add(1);
                    let _ = job.events.send(Event::Failed(e));
                }
            }
        }
        if shared.abort.load(Ordering::Relaxed) {
            let stopping = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down");
            for ready in queue.drain(..) {
                let _ = ready.job.events.send(Event::Failed(ApiError::new(stopping.status, stopping.message.clone())));
            }
            for seq in running.drain(..) {
                let _ = seq.job.events.send(Event::Failed(ApiError::new(stopping.status, stopping.message.clone())));
            }
            return;
        }
        // Requests whose clients left while queued.
        let before = queue.len();
        queue.retain(|r| !r.job.events.is_closed());
        let gone = (before - queue.len()) as u64;
        shared.metrics.cancelled.add(gone);
        shared.waiting.fetch_sub(gone as usize, Ordering::Relaxed);
        // Admission: in arrival order, while a slot is free and the cache budget holds the next.
        while running.len() < limits.max_sequences
            && let Some(next) = queue.front()
            && reserved + next.reserve <= limits.kv_budget
        {
            let Some(ready) = queue.pop_front() else { break };
            shared.waiting.fetch_sub(1, Ordering::Relaxed);
            reserved += ready.reserve;
            let parked = generator.session().park();
            running.push(Seq {
                seen: ready.prompt.clone(),
                job: ready.job,
                prompt: ready.prompt,
                max_new: ready.max_new,
                sampler: ready.sampler,
                reserve: ready.reserve,
                parked: Some(parked),
                fed: 0,
                generated: Vec::new(),
                counts: HashMap::new(),
                decoder: tokenizer.decode_stream(true),
                text: String::new(),
                sent: 0,
                last_token_at: None,
            });
        }
        shared.metrics.queue_depth.set(queue.len() as u64);
        shared.metrics.running.set(running.len() as u64);
        shared.metrics.kv_cache_bytes.set(reserved);
        if running.is_empty() {
            continue;
        }
        // One step of each running sequence: those past their prompts decode together in one
        // batched step where the engine can; the others (a prompt chunk to run, an engine that
        // cannot batch, or a batched step that failed, so that the failure is found in the
        // sequence it belongs to) take turns.
        shared.metrics.batch_size.observe(running.len() as f64);
        let mut finished = Vec::new();
        for (i, seq) in running.iter().enumerate() {
            if seq.job.events.is_closed() {
                shared.metrics.cancelled.add(1);
                finished.push(i);
            }
        }
        let mut stepped = vec![false; running.len()];
        let decoding: Vec<usize> = (0..running.len())
            .filter(|i| !finished.contains(i) && running[*i].fed == running[*i].prompt.len())
            .collect();
        if limits.batching
            && decoding.len() > 1
            && let Some(rows) = decode_together(generator.session(), &mut running, &decoding)
        {
            shared.metrics.decode_batch_size.observe(decoding.len() as f64);
            for (&i, logits) in decoding.iter().zip(rows) {
                let seq = &mut running[i];
                let outcome = pick(seq, logits, tokenizer)
                    .and_then(|(token, logprob)| accept(seq, token, logprob, model, shared));
                stepped[i] = true;
                conclude(seq, outcome, i, &mut finished, shared);
            }
        }
        for (i, seq) in running.iter_mut().enumerate() {
            if stepped[i] || finished.contains(&i) {
                continue;
            }
            if seq.fed == seq.prompt.len() {
                shared.metrics.decode_batch_size.observe(1.0);
            }
            let outcome = step(generator.session(), seq, limits.prefill_chunk, tokenizer, model, shared);
            conclude(seq, outcome, i, &mut finished, shared);
        }
        finished.sort_unstable();
        for &i in finished.iter().rev() {
            let seq = running.swap_remove(i);
            reserved -= seq.reserve;
        }
        shared.metrics.running.set(running.len() as u64);
        shared.metrics.kv_cache_bytes.set(reserved);
    }
}

/// A request's prompt ids, the most tokens it may generate, and its sampler.
fn check(
    model: &Model,
    tokenizer: &Tokenizer,
    context: usize,
    limits: &Limits,
    bytes_per_token: u64,
    request: &Request,
) -> Result<(Vec<i64>, usize, Sampler), ApiError> {
    let (prompt, param) = match &request.prompt {
        Prompt::Messages(messages) => {
            (model.render(messages).map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?, "messages")
        }
        Prompt::Text(text) => {
            let ids = tokenizer.encode(text, true).map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
            (ids.into_iter().map(i64::from).collect(), "prompt")
        }
        Prompt::Ids(ids) => {
            let vocab = model.fe.spec.spec.model.vocab as i64;
            if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (0..{vocab})"),
                ));
            }
            (ids.clone(), "prompt")
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    let vocab = model.fe.spec.spec.model.vocab as i64;
    if let Some((bad, _)) = request.sampling.logit_bias.iter().find(|(t, _)| *t >= vocab) {
        return Err(ApiError::invalid("logit_bias", format!("token id {bad} is outside the vocabulary (0..{vocab})")));
    }
    if prompt.len() >= context || prompt.len() > limits.max_prompt_tokens {
        let most = limits.max_prompt_tokens.min(context - 1);
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is {} tokens; this server takes at most {most} (the model's context is {context})",
                prompt.len()
            ),
        ));
    }
    let max_key = request.max_tokens_param;
    let asked = request.max_tokens.unwrap_or(limits.default_max_tokens);
    if asked > limits.max_tokens {
        return Err(ApiError::invalid(
            max_key,
            format!("`{max_key}` = {asked}: this server generates at most {} tokens a request", limits.max_tokens),
        ));
    }
    let max_new = asked.min(context - prompt.len());
    let need = bytes_per_token * (prompt.len() + max_new) as u64;
    if need > limits.kv_budget {
        return Err(ApiError::invalid(
            max_key,
            format!(
                "the prompt and `max_tokens` need {} of key/value cache, more than the server's whole budget of {} \
                 (--kv-cache): ask for fewer tokens",
                kiln_compiler::memory::human(need),
                kiln_compiler::memory::human(limits.kv_budget)
            ),
        ));
    }
    let base = &model.sampling.sampler;
    let s = &request.sampling;
    let seed = s.seed.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        now as u64 ^ (prompt.len() as u64).rotate_left(32)
    });
    let sampler = Sampler::new(
        s.temperature.unwrap_or(base.temperature),
        s.top_k.unwrap_or(base.top_k),
        s.top_p.unwrap_or(base.top_p),
        s.repetition_penalty.unwrap_or(base.repetition_penalty),
        seed,
    )
    .map_err(|e| ApiError::invalid(e.name, e.to_string()))?;
    Ok((prompt, max_new, sampler))
}

/// One step of `seq` in `session`: its cache swapped in, a chunk of its prompt or one token run,
/// swapped out again. `Some(finish reason)` when the sequence is done.
fn step(
    session: &mut Session,
    seq: &mut Seq,
    chunk: usize,
    tokenizer: &Tokenizer,
    model: &Model,
    shared: &Shared,
) -> Result<Option<&'static str>, String> {
    let parked = seq.parked.take().ok_or("a running sequence lost its cache")?;
    session.resume(parked).map_err(|e| e.to_string())?;
    let outcome = advance(session, seq, chunk, tokenizer, model, shared);
    seq.parked = Some(session.park());
    outcome
}

/// One batched decode step of the sequences `which` of `running` (each past its prompt, running
/// its last token): each one's logits, in order; `None` where the engine cannot run them
/// together or the step failed (they then take turns, each meeting its own failure).
fn decode_together(session: &mut Session, running: &mut [Seq], which: &[usize]) -> Option<Vec<Vec<f32>>> {
    let mut batch: Vec<(&mut ParkedSequence, i64)> = Vec::with_capacity(which.len());
    for (i, seq) in running.iter_mut().enumerate() {
        if which.contains(&i) {
            batch.push((seq.parked.as_mut()?, *seq.generated.last()?));
        }
    }
    session.forward_batch(&mut batch).ok().flatten()
}

/// Ends sequence `i`'s step: when it is done, its last event sent and `i` noted in `finished`.
fn conclude(
    seq: &Seq,
    outcome: Result<Option<&'static str>, String>,
    i: usize,
    finished: &mut Vec<usize>,
    shared: &Shared,
) {
    match outcome {
        Ok(None) => {}
        Ok(Some(finish)) => {
            let _ = seq.job.events.send(Event::Done {
                finish,
                prompt_tokens: seq.prompt.len(),
                completion_tokens: seq.generated.len(),
            });
            finished.push(i);
        }
        Err(message) => {
            shared.metrics.failed.add(1);
            let _ = seq.job.events.send(Event::Failed(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)));
            finished.push(i);
        }
    }
}

fn advance(
    session: &mut Session,
    seq: &mut Seq,
    chunk: usize,
    tokenizer: &Tokenizer,
    model: &Model,
    shared: &Shared,
) -> Result<Option<&'static str>, String> {
    let ids: Vec<i64> = if seq.fed < seq.prompt.len() {
        let end = (seq.fed + chunk.max(1)).min(seq.prompt.len());
        let ids = seq.prompt[seq.fed..end].to_vec();
        if end < seq.prompt.len() {
            session.forward(&ids).map_err(|e| e.to_string())?;
            seq.fed = end;
            shared.metrics.prompt_tokens.add(ids.len() as u64);
            return Ok(None);
        }
        seq.fed = end;
        shared.metrics.prompt_tokens.add(ids.len() as u64);
        ids
    } else {
        match seq.generated.last() {
            Some(&last) => vec![last],
            None => return Err("a sequence with neither prompt nor tokens left to run".into()),
        }
    };
    let request = &seq.job.request;
    let penalized = request.sampling.frequency_penalty != 0.0
        || request.sampling.presence_penalty != 0.0
        || !request.sampling.logit_bias.is_empty();
    let (token, logprob) = if penalized || request.logprobs.is_some() {
        let logits = session.forward(&ids).map_err(|e| e.to_string())?;
        pick(seq, logits, tokenizer)?
    } else {
        let pick = Pick { sampler: &mut seq.sampler, seen: &seq.seen, logits: false };
        (session.sample(&ids, pick).map_err(|e| e.to_string())?.token, None)
    };
    accept(seq, token, logprob, model, shared)
}

/// The next token of `seq` from its logits on the host: the frequency and presence penalties and
/// the logit bias applied, then sampled; its log probabilities where the request asks for them.
fn pick(seq: &mut Seq, mut logits: Vec<f32>, tokenizer: &Tokenizer) -> Result<(i64, Option<TokenLogprob>), String> {
    let request = &seq.job.request;
    let at = |t: i64| usize::try_from(t).ok();
    for (&t, &n) in &seq.counts {
        if let Some(l) = at(t).and_then(|t| logits.get_mut(t)) {
            *l -= request.sampling.frequency_penalty * n as f32 + request.sampling.presence_penalty;
        }
    }
    for &(t, bias) in &request.sampling.logit_bias {
        if let Some(l) = at(t).and_then(|t| logits.get_mut(t)) {
            // -100 bans the token, as OpenAI's does in effect.
            *l = if bias <= -100.0 { f32::NEG_INFINITY } else { *l + bias };
        }
    }
    // The logits come back from the pick where log probabilities are asked for.
    let pick = Pick { sampler: &mut seq.sampler, seen: &seq.seen, logits: request.logprobs.is_some() };
    let sampled = pick.on_host(logits).map_err(|e| e.to_string())?;
    let logprob = request.logprobs.zip(sampled.logits).map(|(top, l)| logprobs(&l, sampled.token, top, tokenizer));
    Ok((sampled.token, logprob))
}

/// Takes `token` (with its log probabilities) as `seq`'s next: timing, the text streamed up to
/// what may begin a stop string. `Some(finish reason)` when the sequence is done.
fn accept(
    seq: &mut Seq,
    token: i64,
    logprob: Option<TokenLogprob>,
    model: &Model,
    shared: &Shared,
) -> Result<Option<&'static str>, String> {
    let request = &seq.job.request;
    let now = Instant::now();
    match seq.last_token_at {
        None => shared.metrics.time_to_first_token.observe((now - seq.job.arrived).as_secs_f64()),
        Some(t) => shared.metrics.inter_token_latency.observe((now - t).as_secs_f64()),
    }
    seq.last_token_at = Some(now);
    shared.metrics.generated_tokens.add(1);
    seq.generated.push(token);
    seq.seen.push(token);
    *seq.counts.entry(token).or_default() += 1;
    let logprobs: Vec<TokenLogprob> = logprob.into_iter().collect();
    if model.stop.contains(&token) {
        flush(seq, logprobs);
        return Ok(Some("stop"));
    }
    let piece = u32::try_from(token).ok().and_then(|id| seq.decoder.step(id).ok()).flatten().unwrap_or_default();
    seq.text.push_str(&piece);
    if let Some(at) = first_stop(&seq.text, seq.sent, &request.stop) {
        seq.text.truncate(at);
        flush(seq, logprobs);
        return Ok(Some("stop"));
    }
    if seq.generated.len() >= seq.max_new {
        flush(seq, logprobs);
        return Ok(Some("length"));
    }
    // Hold back an ending that may begin a stop string.
    let upto = seq.text.len() - held(&seq.text, &request.stop);
    if upto > seq.sent || !logprobs.is_empty() {
        let text = seq.text[seq.sent..upto.max(seq.sent)].to_string();
        seq.sent = upto.max(seq.sent);
        let _ = seq.job.events.send(Event::Delta { text, logprobs });
    }
    Ok(None)
}

/// Sends what text is left unsent.
fn flush(seq: &mut Seq, logprobs: Vec<TokenLogprob>) {
    let text = seq.text.get(seq.sent..).unwrap_or_default().to_string();
    seq.sent = seq.text.len();
    if !text.is_empty() || !logprobs.is_empty() {
        let _ = seq.job.events.send(Event::Delta { text, logprobs });
    }
}

/// Where the first stop string in `text` begins, looking only where one could end in text not
/// yet sent (`sent` bytes were).
fn first_stop(text: &str, sent: usize, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter_map(|stop| {
            let mut from = sent.saturating_sub(stop.len().saturating_sub(1));
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            text[from..].find(stop.as_str()).map(|at| from + at)
        })
        .min()
}

/// Bytes at the end of `text` that begin some stop string (to hold back until the next token
/// shows whether the stop string follows).
fn held(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|stop| (1..stop.len()).filter(move |&k| stop.is_char_boundary(k)).map(move |k| (stop, k)))
        .filter(|(stop, k)| text.ends_with(&stop[..*k]))
        .map(|(_, k)| k)
        .max()
        .unwrap_or(0)
}

/// The log probability of `token` under `logits` and the `top` most likely tokens'.
fn logprobs(logits: &[f32], token: i64, top: usize, tokenizer: &Tokenizer) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |i: usize| (f64::from(logits[i]) - lse) as f32;
    let name = |i: usize| tokenizer.decode(&[i as u32], false).unwrap_or_default();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if top > 0 {
        order.select_nth_unstable_by(top.min(logits.len()) - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
    }
    order.truncate(top);
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let t = usize::try_from(token).unwrap_or(0).min(logits.len().saturating_sub(1));
    TokenLogprob { token: name(t), logprob: lp(t), top: order.into_iter().map(|i| (name(i), lp(i))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_is_found_across_tokens_and_its_beginning_held_back() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(held("Hello E", &stops), 1);
        assert_eq!(held("Hello EN", &stops), 2);
        assert_eq!(held("Hello\n", &stops), 1);
        assert_eq!(held("Hello", &stops), 0);
        assert_eq!(first_stop("Hello EN", 6, &stops), None);
        assert_eq!(first_stop("Hello END", 6, &stops), Some(6));
        assert_eq!(first_stop("a\n\nb", 2, &stops), Some(1));
        // Only where a stop string could end in unsent text: an earlier one was already sent.
        assert_eq!(first_stop("END then", 8, &stops), None);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_tokens_first() {
        let tok = Tokenizer::bytes().unwrap();
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let l = logprobs(&logits, 2, 2, &tok);
        let total: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((f64::from(l.logprob) - (1.0 - total.ln())).abs() < 1e-6);
        assert_eq!(l.top.len(), 2);
        assert!(l.top[0].1 > l.top[1].1 && (l.top[0].1 - (2.0 - total.ln() as f32)).abs() < 1e-6);
    }
}
