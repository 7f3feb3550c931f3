//! The model's thread for an embedding model: the one place it runs. Requests arrive as
//! [`EmbedJob`]s; each is tokenized and checked at once (a bad one fails before it waits), then
//! queued. Each forward pass embeds the inputs waiting, in arrival order, as one batch padded to
//! its longest, as many as fit the token budget (`--embed-batch-tokens`: inputs × padded length;
//! one input always runs, however long): requests that arrive while the model runs are embedded
//! together, and a request with more inputs than fit is spread over several passes. Each request
//! gets its own rows back, once all of them are done; a request whose client left is dropped
//! before its next pass. Padding is masked, so an input's vector does not depend on the others in
//! its batch.

use super::Shared;
use super::api::{ApiError, EmbedInput};
use crate::cli::embed::Embedder;
use axum::http::StatusCode;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use tokio::sync::oneshot;

/// An embeddings request handed to the model's thread, and where its answer goes.
pub struct EmbedJob {
    pub inputs: Vec<EmbedInput>,
    pub reply: oneshot::Sender<Result<Embedded, ApiError>>,
}

/// A request's embeddings, one per input in order, and the tokens they embedded.
pub struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: usize,
}

/// A request tokenized, waiting for its rows to be embedded.
struct Pending {
    job: EmbedJob,
    rows: Vec<Vec<i64>>,
    done: Vec<Vec<f32>>,
}

/// Serves jobs until every sender is gone (the server stopped) or the shared abort flag is set,
/// each forward pass at most `budget` tokens (inputs × padded length) unless one input is longer.
pub fn serve(embedder: &Embedder, jobs: Receiver<EmbedJob>, shared: &Shared, budget: usize) {
    let mut queue: VecDeque<Pending> = VecDeque::new();
    loop {
        let Some(incoming) = super::take_jobs(&jobs, queue.is_empty()) else { return };
        for job in incoming {
            match rows(embedder, &job.inputs) {
                Ok(rows) => queue.push_back(Pending { job, rows, done: Vec::new() }),
                Err(e) => {
                    shared.waiting.fetch_sub(1, Ordering::Relaxed);
                    shared.metrics.invalid.add(1);
                    let _ = job.reply.send(Err(e));
                }
            }
        }
        if shared.abort.load(Ordering::Relaxed) {
            for p in queue.drain(..) {
                shared.waiting.fetch_sub(1, Ordering::Relaxed);
                let stopping = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down");
                let _ = p.job.reply.send(Err(stopping));
            }
            return;
        }
        // Requests whose clients left while queued.
        let before = queue.len();
        queue.retain(|p| !p.job.reply.is_closed());
        let gone = before - queue.len();
        shared.metrics.cancelled.add(gone as u64);
        shared.waiting.fetch_sub(gone, Ordering::Relaxed);
        shared.metrics.queue_depth.set(queue.len() as u64);
        let batch = next_batch(&queue, budget);
        if batch.is_empty() {
            continue;
        }
        let ids: Vec<Vec<i64>> = batch.iter().map(|&(q, r)| queue[q].rows[r].clone()).collect();
        let requests = batch.iter().map(|&(q, _)| q).collect::<std::collections::BTreeSet<_>>();
        shared.metrics.embedding_batch_requests.observe(requests.len() as f64);
        shared.metrics.running.set(requests.len() as u64);
        match embedder.embed_ids(&ids) {
            Ok(vectors) => {
                shared.metrics.prompt_tokens.add(ids.iter().map(|r| r.len() as u64).sum());
                for (&(q, _), v) in batch.iter().zip(vectors) {
                    queue[q].done.push(v.into_iter().next().unwrap_or_default());
                }
            }
            Err(e) => {
                // Every request with an input in the failed pass fails; the others go on.
                for &q in requests.iter().rev() {
                    if let Some(p) = queue.remove(q) {
                        shared.waiting.fetch_sub(1, Ordering::Relaxed);
                        shared.metrics.failed.add(1);
                        let message = format!("embedding failed: {e:#}");
                        let _ = p.job.reply.send(Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)));
                    }
                }
            }
        }
        shared.metrics.running.set(0);
        // Requests whose every input is embedded get their answer.
        let mut i = 0;
        while i < queue.len() {
            if queue[i].done.len() < queue[i].rows.len() {
                i += 1;
                continue;
            }
            let Some(p) = queue.remove(i) else { break };
            shared.waiting.fetch_sub(1, Ordering::Relaxed);
            let prompt_tokens = p.rows.iter().map(Vec::len).sum();
            let _ = p.job.reply.send(Ok(Embedded { vectors: p.done, prompt_tokens }));
        }
        shared.metrics.queue_depth.set(queue.len() as u64);
    }
}

/// The inputs of the next forward pass, as (request, row) in arrival order: while the batch's
/// rows times its longest row stay within `budget` (the first row always).
fn next_batch(queue: &VecDeque<Pending>, budget: usize) -> Vec<(usize, usize)> {
    let mut batch = Vec::new();
    let mut longest = 0;
    for (q, p) in queue.iter().enumerate() {
        for r in p.done.len()..p.rows.len() {
            let len = longest.max(p.rows[r].len());
            if !batch.is_empty() && (batch.len() + 1) * len > budget {
                return batch;
            }
            batch.push((q, r));
            longest = len;
        }
    }
    batch
}

/// A request's inputs as the model's token ids: a text tokenized as `kiln embed` does (special
/// tokens added, truncated to the model's length), token ids as given (truncated alike, and
/// checked against the vocabulary).
fn rows(embedder: &Embedder, inputs: &[EmbedInput]) -> Result<Vec<Vec<i64>>, ApiError> {
    let vocab = embedder.vocab;
    inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let mut ids = match input {
                EmbedInput::Text(text) => embedder
                    .tokenize(text)
                    .map_err(|e| ApiError::invalid("input", format!("input {i} cannot be tokenized: {e:#}")))?,
                EmbedInput::Ids(ids) => {
                    if let Some(id) = ids.iter().find(|&&id| id < 0 || id as u64 >= vocab) {
                        return Err(ApiError::invalid(
                            "input",
                            format!("input {i}: token id {id} is outside the model's vocabulary (0..{vocab})"),
                        ));
                    }
                    ids.clone()
                }
            };
            if ids.is_empty() {
                return Err(ApiError::invalid("input", format!("input {i} encodes to no tokens")));
            }
            ids.truncate(embedder.max_len);
            Ok(ids)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_takes_inputs_in_arrival_order_while_they_fit_the_budget() {
        let job = |rows: Vec<Vec<i64>>| {
            let (reply, _) = oneshot::channel();
            Pending { job: EmbedJob { inputs: Vec::new(), reply }, rows, done: Vec::new() }
        };
        let mut queue = VecDeque::from([job(vec![vec![1; 4], vec![1; 2]]), job(vec![vec![1; 6]]), job(vec![vec![1]])]);
        // 3 rows × 6 = 18 fit 18; a 4th row would make 24.
        assert_eq!(next_batch(&queue, 18), vec![(0, 0), (0, 1), (1, 0)]);
        assert_eq!(next_batch(&queue, 17), vec![(0, 0), (0, 1)]);
        // The first row runs whatever the budget; a request half done goes on where it stopped.
        assert_eq!(next_batch(&queue, 1), vec![(0, 0)]);
        queue[0].done.push(Vec::new());
        assert_eq!(next_batch(&queue, 12), vec![(0, 1), (1, 0)]);
    }
}
