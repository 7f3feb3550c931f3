//! `kiln serve`: the OpenAI API over HTTP (axum on tokio) in front of the model's thread
//! ([`engine`]). The handlers read and check a request ([`api`]), hand it to the model's thread
//! as a [`engine::Job`] with a channel for its events, and answer from those events: one JSON
//! document, or a stream of server-sent events (`data: {chunk}` ... `data: [DONE]`). A client
//! that goes away drops the channel, which the model's thread sees at its next step.
//!
//! Safe by default: the address is loopback unless told otherwise, and any other needs an API
//! key; bodies, prompts, `max_tokens`, running sequences and the queue are bounded, and a request
//! past capacity gets 503 with `Retry-After` rather than memory the machine does not have.
//! `/health` answers 503 while the model loads; `/metrics` is Prometheus text ([`metrics`]).
//!
//! An embedding model is served the same way by its own loop ([`embed`]): `/v1/embeddings`
//! hands its inputs to the model's thread as an [`embed::EmbedJob`], which embeds the requests
//! waiting together, and the chat and text completions answer 400.

pub mod api;
pub mod embed;
pub mod engine;
pub mod metrics;

use api::{
    ApiError, EmbeddingRequest, Endpoint, Request, base64_f32, chat_logprobs, completion_logprobs, embedding_usage,
    usage,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use engine::{Event, Job};
use kiln_compiler::FrontEnd;
use kiln_compiler::graph::{Dim, Op};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// What the server takes on.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Sequences generated at once.
    pub max_sequences: usize,
    /// Requests waiting for a sequence slot; more are refused (503).
    pub max_queue: usize,
    /// Key/value cache bytes the running sequences may grow to, together.
    pub kv_budget: u64,
    /// Most prompt tokens one step of a sequence runs.
    pub prefill_chunk: usize,
    /// The sequences past their prompts decode together where the engine can.
    pub batching: bool,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// The largest `max_tokens` a request may ask.
    pub max_tokens: usize,
    /// The longest prompt, in tokens.
    pub max_prompt_tokens: usize,
    /// The largest request body, in bytes.
    pub max_body: usize,
}

/// What the handlers and the model's thread share.
pub struct Shared {
    pub metrics: metrics::Metrics,
    pub limits: Limits,
    /// The model's name in answers and `/v1/models`.
    pub model: String,
    /// The model is loaded (`/health` answers 200, requests are taken).
    pub ready: AtomicBool,
    /// Stop now: the model's thread fails what is queued and running, and returns.
    pub abort: AtomicBool,
    /// Requests handed to the model's thread and not yet running (queued or being checked).
    pub waiting: AtomicUsize,
    /// Generation requests being answered (their answer or stream not yet dropped).
    pub in_flight: AtomicUsize,
    /// The bearer token every `/v1` and `/metrics` request must carry, if any.
    pub api_key: Option<String>,
    /// The model's thread's inbox; `None` once the server stops taking requests.
    pub jobs: Mutex<Option<Inbox>>,
    /// The embeddings' dimensions, for an embedding model (`None`: the model generates text).
    pub embedding_dims: Option<usize>,
    next_id: AtomicU64,
    /// When the server started (the model's `created`).
    pub started: u64,
}

/// Where the model's thread takes its requests: generation jobs, or (an embedding model, of
/// these dimensions) embedding jobs.
pub enum Inbox {
    Generate(std::sync::mpsc::Sender<Job>),
    Embed { jobs: std::sync::mpsc::Sender<embed::EmbedJob>, dims: usize },
}

impl Shared {
    pub fn new(model: String, limits: Limits, api_key: Option<String>, jobs: Inbox) -> Shared {
        let embedding_dims = match &jobs {
            Inbox::Generate(_) => None,
            Inbox::Embed { dims, .. } => Some(*dims),
        };
        Shared {
            embedding_dims,
            metrics: metrics::Metrics::default(),
            limits,
            model,
            ready: AtomicBool::new(false),
            abort: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            api_key,
            jobs: Mutex::new(Some(jobs)),
            next_id: AtomicU64::new(1),
            started: unix_now(),
        }
    }

    /// Stops taking requests: the model's thread returns once what it holds is done.
    pub fn close(&self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// The jobs that have arrived in a model thread's inbox: waiting for one first when the thread
/// is `idle` (nothing queued or running), taking whatever is there otherwise. `None` once the
/// server has stopped taking requests and an idle thread has nothing left to wait for.
fn take_jobs<J>(inbox: &std::sync::mpsc::Receiver<J>, idle: bool) -> Option<Vec<J>> {
    use std::sync::mpsc::TryRecvError;
    let mut jobs = Vec::new();
    if idle {
        jobs.push(inbox.recv().ok()?);
    }
    loop {
        match inbox.try_recv() {
            Ok(job) => jobs.push(job),
            // Disconnected: what is queued or running is finished first.
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => return Some(jobs),
        }
    }
}

/// Counts a generation request in [`Shared::in_flight`] while it lives (a stream's, while its
/// body is being sent).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(s: &Arc<Shared>) -> InFlight {
        s.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(s.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Bytes of key/value cache one token of a sequence takes: the `*.past_k`/`*.past_v` inputs of
/// the spec's cached decoder graph, per row (f32).
pub fn cache_bytes_per_token(fe: &FrontEnd) -> u64 {
    let Ok(graph) = kiln_compiler::graph::build::build_cached(&fe.spec) else { return 0 };
    graph
        .g
        .node_weights()
        .filter(|n| matches!(&n.op, Op::Input { name, .. } if name.ends_with(".past_k") || name.ends_with(".past_v")))
        .map(|n| 4 * n.shape.iter().map(|d| if let Dim::Fixed(n) = d { *n as u64 } else { 1 }).product::<u64>())
        .sum()
}

/// Serves `router` on `listener`, each connection HTTP/1.1 with a timeout on reading a request's
/// head (a client that sends no complete head within `header_timeout` — a slow or stalled one,
/// or a keep-alive connection left idle — is closed), until `stop` turns true; then stops
/// accepting and lets each open connection finish the request it is answering (graceful
/// shutdown), returning once all are closed. (axum's `serve` sets no timer, so no timeout.)
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: Router,
    stop: tokio::sync::watch::Receiver<bool>,
    header_timeout: std::time::Duration,
) {
    // Each connection's task holds a receiver; the sender sees them all dropped.
    let (all_closed, open) = tokio::sync::watch::channel(());
    let mut stopping = stop.clone();
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors or the like: the next accept may do.
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stopped(&mut stopping) => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let (mut stop, open) = (stop.clone(), open.clone());
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_timeout);
            let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let stopped = tokio::select! {
                _ = connection.as_mut() => false,
                () = stopped(&mut stop) => true,
            };
            if stopped {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
            drop(open);
        });
    }
    drop(listener);
    drop(open);
    all_closed.closed().await;
}

/// Resolves once `stop` turns true (never, if its sender is gone without doing so).
pub async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    if stop.wait_for(|&s| s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The routes.
pub fn router(shared: Arc<Shared>) -> Router {
    let max_body = shared.limits.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(shared.clone(), authorize))
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(shared)
}

/// Requires `Authorization: Bearer KEY` where the server has a key.
async fn authorize(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    request: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    if let Some(key) = &s.api_key {
        let given =
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given.map(str::trim) != Some(key.as_str()) {
            let mut e =
                ApiError::new(StatusCode::UNAUTHORIZED, "a valid API key is needed: `Authorization: Bearer KEY`")
                    .into_response();
            e.headers_mut().insert(header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
            return e;
        }
    }
    next.run(request).await
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    match s.ready.load(Ordering::Relaxed) {
        true => Json(json!({"status": "ok"})).into_response(),
        false => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response(),
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

async fn models(State(s): State<Arc<Shared>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.model, "object": "model", "created": s.started, "owned_by": "kiln"}]}),
    )
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route {uri}: see GET /v1/models, POST /v1/chat/completions"))
}

async fn embeddings(State(s): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    s.metrics.embedding_requests.add(1);
    embed(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// Refuses a request that cannot wait: 503 while the model loads, or with the queue full.
/// Otherwise counts it in [`Shared::waiting`] (the model's thread takes it off).
fn admit(s: &Shared) -> Result<(), ApiError> {
    if !s.ready.load(Ordering::Relaxed) {
        s.metrics.rejected.add(1);
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the model is loading");
        e.retry_after = Some(5);
        return Err(e);
    }
    if s.waiting.fetch_add(1, Ordering::Relaxed) >= s.limits.max_queue {
        s.waiting.fetch_sub(1, Ordering::Relaxed);
        s.metrics.rejected.add(1);
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            match s.embedding_dims {
                Some(_) => {
                    format!("the server is at capacity ({} requests queued): try again later", s.limits.max_queue)
                }
                None => format!(
                    "the server is at capacity ({} running, {} queued): try again later",
                    s.limits.max_sequences, s.limits.max_queue
                ),
            },
        );
        e.retry_after = Some(1);
        return Err(e);
    }
    Ok(())
}

/// `POST /v1/embeddings`: the inputs embedded on the model's thread (with whatever else waits
/// there), answered as OpenAI does: `data` in input order, floats or base64, and `usage`.
async fn embed(s: Arc<Shared>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let _guard = InFlight::new(&s);
    let Some(dims) = s.embedding_dims else {
        s.metrics.invalid.add(1);
        return Err(ApiError::invalid(
            "model",
            format!(
                "`{}` generates text and gives no sentence embeddings: serve an embedding model for /v1/embeddings",
                s.model
            ),
        ));
    };
    let request =
        json_body(&s, body).and_then(|v| EmbeddingRequest::parse(&v)).inspect_err(|_| s.metrics.invalid.add(1))?;
    if let Some(asked) = request.dimensions
        && asked != dims as u64
    {
        s.metrics.invalid.add(1);
        return Err(ApiError::invalid(
            "dimensions",
            format!("`dimensions` = {asked}: `{}` gives {dims} dimensions, and does not shorten them", s.model),
        ));
    }
    admit(&s)?;
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job = embed::EmbedJob { inputs: request.inputs, reply };
    let sent = match s.jobs.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        Some(Inbox::Embed { jobs, .. }) => jobs.send(job).is_ok(),
        _ => false,
    };
    if !sent {
        s.waiting.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"));
    }
    let done = match answer.await {
        Ok(done) => done?,
        Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the model's thread stopped")),
    };
    let data: Vec<Value> = done
        .vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = match request.base64 {
                true => json!(base64_f32(v)),
                false => json!(v.iter().map(|&x| crate::cli::embed::shortest(x)).collect::<Vec<f64>>()),
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let body = json!({"object": "list", "data": data, "model": s.model, "usage": embedding_usage(done.prompt_tokens)});
    Ok(Json(body).into_response())
}

async fn chat(State(s): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    s.metrics.chat_requests.add(1);
    generate(s, Endpoint::Chat, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    s.metrics.completion_requests.add(1);
    generate(s, Endpoint::Completions, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// The body as JSON: 413 past the size limit, 400 when it does not parse.
fn json_body(s: &Shared, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = body.map_err(|e| {
        let status = e.status();
        let message = match status {
            StatusCode::PAYLOAD_TOO_LARGE => format!("the body is over this server's {} bytes", s.limits.max_body),
            _ => e.body_text(),
        };
        ApiError::new(status, message)
    })?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("the body is not valid JSON: {e}")))
}

async fn generate(
    s: Arc<Shared>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let guard = InFlight::new(&s);
    if s.embedding_dims.is_some() {
        s.metrics.invalid.add(1);
        return Err(ApiError::invalid(
            "model",
            format!("`{}` is an embedding model and does not generate text: use /v1/embeddings", s.model),
        ));
    }
    let request =
        json_body(&s, body).and_then(|v| Request::parse(endpoint, &v)).inspect_err(|_| s.metrics.invalid.add(1))?;
    admit(&s)?;
    let (tx, mut rx) = unbounded_channel();
    let (stream, include_usage, logprobs) = (request.stream, request.include_usage, request.logprobs.is_some());
    let job = Job { request, events: tx, arrived: Instant::now() };
    let sent = match s.jobs.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        Some(Inbox::Generate(jobs)) => jobs.send(job).is_ok(),
        _ => false,
    };
    if !sent {
        s.waiting.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"));
    }
    match rx.recv().await {
        Some(Event::Accepted) => {}
        Some(Event::Failed(e)) => return Err(e),
        _ => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the model's thread stopped")),
    }
    let id = format!(
        "{}-{}",
        if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" },
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let answer = Answer { id, endpoint, model: s.model.clone(), created: unix_now(), logprobs };
    if stream {
        return Ok(streamed(answer, rx, include_usage, guard).into_response());
    }
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Delta { text: t, logprobs }) => {
                text.push_str(&t);
                tokens.extend(logprobs);
            }
            Some(Event::Done { finish, prompt_tokens, completion_tokens }) => {
                let logprobs = match (answer.logprobs, endpoint) {
                    (false, _) => Value::Null,
                    (true, Endpoint::Chat) => chat_logprobs(&tokens),
                    (true, Endpoint::Completions) => completion_logprobs(&tokens, 0),
                };
                let choice = match endpoint {
                    Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs, "finish_reason": finish}),
                    Endpoint::Completions => {
                        json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
                    }
                };
                let mut body = answer.head(endpoint.object(false));
                body["choices"] = json!([choice]);
                body["usage"] = usage(prompt_tokens, completion_tokens);
                return Ok(Json(body).into_response());
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Accepted) => {}
            None => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the model's thread stopped")),
        }
    }
}

impl Endpoint {
    /// The `object` of an answer (`chunk`: of a stream's chunk).
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }
}

/// What every part of one answer repeats.
struct Answer {
    id: String,
    endpoint: Endpoint,
    model: String,
    created: u64,
    logprobs: bool,
}

impl Answer {
    fn head(&self, object: &str) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model})
    }

    /// A stream's chunk with one choice: a chat's `delta` or a completion's `text`.
    fn chunk(&self, delta: Value, text: &str, logprobs: Value, finish: Option<&str>) -> SseEvent {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}),
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}),
        };
        let mut body = self.head(self.endpoint.object(true));
        body["choices"] = json!([choice]);
        SseEvent::default().data(body.to_string())
    }
}

/// The answer as server-sent events: (a chat's role first,) a chunk per piece of text, the
/// finish reason, usage if asked, then `[DONE]`; a failure midway ends it with an error event.
fn streamed(
    answer: Answer,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
    guard: InFlight,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut pending = VecDeque::new();
    if answer.endpoint == Endpoint::Chat {
        pending.push_back(answer.chunk(json!({"role": "assistant", "content": ""}), "", Value::Null, None));
    }
    let state = (answer, rx, pending, false, 0usize, guard);
    let stream = futures_util::stream::unfold(
        state,
        move |(answer, mut rx, mut pending, mut done, mut offset, guard)| async move {
            loop {
                if let Some(event) = pending.pop_front() {
                    return Some((Ok(event), (answer, rx, pending, done, offset, guard)));
                }
                if done {
                    return None;
                }
                match rx.recv().await {
                    Some(Event::Delta { text, logprobs }) => {
                        let lp = match (answer.logprobs, answer.endpoint) {
                            (false, _) => Value::Null,
                            (true, Endpoint::Chat) => chat_logprobs(&logprobs),
                            (true, Endpoint::Completions) => completion_logprobs(&logprobs, offset),
                        };
                        offset += text.len();
                        pending.push_back(answer.chunk(json!({"content": text}), &text, lp, None));
                    }
                    Some(Event::Done { finish, prompt_tokens, completion_tokens }) => {
                        pending.push_back(answer.chunk(json!({}), "", Value::Null, Some(finish)));
                        if include_usage {
                            let mut body = answer.head(answer.endpoint.object(true));
                            body["choices"] = json!([]);
                            body["usage"] = usage(prompt_tokens, completion_tokens);
                            pending.push_back(SseEvent::default().data(body.to_string()));
                        }
                        pending.push_back(SseEvent::default().data("[DONE]"));
                        done = true;
                    }
                    Some(Event::Failed(e)) => {
                        pending.push_back(SseEvent::default().data(e.body().to_string()));
                        done = true;
                    }
                    Some(Event::Accepted) => {}
                    None => {
                        let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the model's thread stopped");
                        pending.push_back(SseEvent::default().data(e.body().to_string()));
                        done = true;
                    }
                }
            }
        },
    );
    Sse::new(stream).keep_alive(KeepAlive::default())
}
