//! `kiln serve`: a model behind the OpenAI API (see [`crate::server`]): a decoder generating
//! text, or an embedding model (an encoder, or a decoder with `--embeddings`) on
//! `/v1/embeddings`. The model is opened (spec, tokenizer, checkpoint) before the address is
//! bound, so a bad argument fails at once; it is then loaded on the model's own thread while
//! `/health` answers 503. Ctrl-C or SIGTERM stops taking requests, lets those in flight finish
//! for up to `--drain-timeout` seconds, then fails what is left and exits.

use crate::cli::embed::{EmbedModel, Pooling};
use crate::cli::generate::{Generator, Model, ModelArgs, Wants};
use crate::progress::Reporter;
use crate::server::{Inbox, Limits, Shared};
use anyhow::{Context, Result, bail};
use kiln_compiler::spec::BlockKind;
use kiln_compiler::train::Bytes;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Arguments of `kiln serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The address to listen on. Anything but loopback needs `--api-key`.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// The port (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests must carry `Authorization: Bearer KEY` (default: the KILN_API_KEY variable).
    #[arg(long)]
    api_key: Option<String>,
    /// The model's name in answers and /v1/models (default: the model file's name).
    #[arg(long)]
    name: Option<String>,
    /// Sequences generated at once.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Requests waiting for a sequence beyond those; more are refused with 503 and Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Key/value cache the running sequences may grow to, together (`2GiB`, `500MB`): a request
    /// waits until its prompt and `max_tokens` fit.
    #[arg(long, default_value = "2GiB")]
    kv_cache: Bytes,
    /// The most prompt tokens one step of a sequence runs (a long prompt is run in chunks, so
    /// running answers keep coming).
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Decode the running sequences in turn, a step each, rather than together in one batched
    /// step (which the CPU back end does by default; wgpu always takes turns).
    #[arg(long)]
    no_batching: bool,
    /// The largest `max_tokens` a request may ask, and the default (up to the model's context).
    #[arg(long, default_value_t = 2048)]
    max_tokens_limit: usize,
    /// The longest prompt in tokens (default: the model's context less one).
    #[arg(long)]
    max_prompt_tokens: Option<usize>,
    /// The largest request body.
    #[arg(long, default_value = "4MiB")]
    max_body: Bytes,
    /// Seconds a client has to send a request's head (method, path, headers) on a connection,
    /// and that an idle keep-alive connection is kept; then it is closed.
    #[arg(long, default_value_t = 30)]
    header_timeout: u64,
    /// Seconds requests in flight get to finish after Ctrl-C or SIGTERM.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Serve this decoder's embeddings on /v1/embeddings (its last token's state, unless
    /// `--pooling` or a sentence-transformers config beside it says otherwise) instead of
    /// generating text. An encoder (`minilm-l6`) is always served this way.
    #[arg(long)]
    embeddings: bool,
    /// An embedding model's pooling: `mean`, `cls` or `last` (default: as `kiln embed` pools).
    #[arg(long, value_enum)]
    pooling: Option<Pooling>,
    /// Scale an embedding model's vectors to unit norm; `--normalize=false`: never (default: as
    /// `kiln embed` does).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    normalize: Option<bool>,
    /// The most tokens one forward pass of an embedding model runs (inputs × their padded
    /// length): the requests waiting are embedded together, in arrival order, up to it.
    #[arg(long, default_value_t = 8192)]
    embed_batch_tokens: usize,
}

impl ServeArgs {
    /// The model file.
    pub fn spec(&self) -> &std::path::Path {
        self.model.spec()
    }
}

/// What the model's thread runs: it loads the model, marks the server ready and serves until
/// its inbox closes. An error (a load that failed) stops the server.
type Worker = Box<dyn FnOnce(&Shared, &Reporter) -> Result<()> + Send>;

/// Runs `kiln serve`: a decoder generating text, or an embedding model (an encoder, or a
/// decoder with `--embeddings`) serving `/v1/embeddings`.
pub fn run(mut args: ServeArgs, reporter: &Reporter) -> Result<()> {
    if args.api_key.is_none() {
        args.api_key = std::env::var("KILN_API_KEY").ok();
    }
    let addr = SocketAddr::new(args.host, args.port);
    if !args.host.is_loopback() && args.api_key.is_none() {
        bail!(
            "--host {}: serving beyond this machine needs --api-key (or KILN_API_KEY); without one, keep the \
             default 127.0.0.1",
            args.host
        );
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("--api-key is empty");
    }
    for (flag, value) in [
        ("--parallel", args.parallel),
        ("--prefill-chunk", args.prefill_chunk),
        ("--max-tokens-limit", args.max_tokens_limit),
        ("--header-timeout", usize::try_from(args.header_timeout).unwrap_or(usize::MAX)),
        ("--embed-batch-tokens", args.embed_batch_tokens),
    ] {
        if value == 0 {
            bail!("{flag} 0: it must be at least 1");
        }
    }
    let name = args.name.clone().unwrap_or_else(|| model_name(args.model.spec()));
    let embeds = args.embeddings || {
        let kind = crate::model_file::load_spec(args.model.spec())?.spec.spec.model.kind;
        kind == BlockKind::Encoder
    };
    if !embeds && (args.pooling.is_some() || args.normalize.is_some()) {
        bail!(
            "--pooling and --normalize are for embedding models: `{name}` is a decoder served for text (give \
             --embeddings to serve its embeddings instead)"
        );
    }
    let mut limits = Limits {
        max_sequences: args.parallel,
        max_queue: args.queue,
        kv_budget: args.kv_cache.0,
        prefill_chunk: args.prefill_chunk,
        batching: !args.no_batching,
        default_max_tokens: args.max_tokens_limit,
        max_tokens: args.max_tokens_limit,
        max_prompt_tokens: 0,
        max_body: usize::try_from(args.max_body.0).unwrap_or(usize::MAX),
    };
    let (inbox, worker): (Inbox, Worker) = if embeds {
        let source = args.model.into_embed_source(args.pooling, args.normalize)?;
        let model = EmbedModel::open(source, reporter, false)?;
        if model.pooling == Pooling::None {
            bail!("kiln serve gives one embedding per input: --pooling none is not served (give mean, cls or last)");
        }
        limits.max_prompt_tokens = model.max_len;
        let (jobs, inbox) = std::sync::mpsc::channel();
        let dims = model.dims;
        let budget = args.embed_batch_tokens;
        let worker: Worker = Box::new(move |shared, reporter| {
            let started = std::time::Instant::now();
            let embedder = model.load(reporter)?;
            shared.ready.store(true, Ordering::Relaxed);
            reporter.info(format_args!(
                "loaded in {:.1} s ({} dimensions, {} pooling{}, up to {} per input); ready",
                started.elapsed().as_secs_f64(),
                embedder.dims,
                format!("{:?}", embedder.pooling).to_lowercase(),
                if embedder.normalize { ", normalized" } else { "" },
                crate::report::count(embedder.max_len, "token")
            ));
            crate::server::embed::serve(&embedder, inbox, shared, budget);
            Ok(())
        });
        (Inbox::Embed { jobs, dims }, worker)
    } else {
        let wants = Wants { chat: true, text: true, ids_only: false, json: false, max_new: args.max_tokens_limit };
        let model = Model::open(args.model, wants, reporter)?;
        if model.fe.spec.spec.model.kind != BlockKind::Decoder {
            bail!(
                "kiln serve generates with decoder models, and embeds with encoders; `{}` is {:?}",
                name,
                model.fe.spec.spec.model.kind
            );
        }
        if model.tokenizer.is_none() {
            bail!("kiln serve needs a tokenizer: give --tokenizer (a tokenizer.json, a GGUF file, or `bytes`)");
        }
        let context = model.fe.spec.spec.model.max_positions as usize;
        limits.max_prompt_tokens = args.max_prompt_tokens.unwrap_or(context.saturating_sub(1));
        let (jobs, inbox) = std::sync::mpsc::channel();
        let worker: Worker = Box::new(move |shared, reporter| {
            let mut generator = Generator::load(&model, reporter)?;
            let tokenizer = model.tokenizer.as_ref().context("no tokenizer")?;
            // On wgpu, a step before the first request (a driver may compile a shader at its
            // first dispatch): the first request's time to first token does not pay for it, and
            // `/health` says ready only after.
            generator.warm_up(0)?;
            shared.ready.store(true, Ordering::Relaxed);
            reporter.info(format_args!("{}; ready", crate::cli::generate::load_line(&generator.timings)));
            crate::server::engine::serve(&model, &mut generator, tokenizer, inbox, shared);
            Ok(())
        });
        (Inbox::Generate(jobs), worker)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the server's runtime")?;
    let listener =
        runtime.block_on(tokio::net::TcpListener::bind(addr)).with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let shared = Arc::new(Shared::new(name.clone(), limits, args.api_key, inbox));
    let what = if embeds { "embeddings, " } else { "" };
    reporter
        .info(format_args!("kiln serve: `{name}` on http://{bound}/v1 ({what}loading; GET /health says when ready)"));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // The model's thread: loads, then serves until the inbox closes or the server aborts.
    let worker = {
        let shared = shared.clone();
        let stop = stop.clone();
        let quiet = reporter.is_quiet();
        std::thread::Builder::new().name("kiln-model".into()).spawn(move || -> Result<()> {
            let reporter = Reporter::new(quiet);
            let served = worker(&shared, &reporter);
            if served.is_err() {
                let _ = stop.send(true);
            }
            served
        })?
    };
    let drain = Duration::from_secs(args.drain_timeout);
    let header_timeout = Duration::from_secs(args.header_timeout);
    let served: Result<()> = runtime.block_on(async {
        tokio::spawn(signals(stop));
        let server =
            crate::server::serve_http(listener, crate::server::router(shared.clone()), stopped.clone(), header_timeout);
        let mut on_stop = stopped.clone();
        let deadline = async move {
            crate::server::stopped(&mut on_stop).await;
            tokio::time::sleep(drain).await;
        };
        tokio::select! {
            () = server => Ok(()),
            () = deadline => Ok(()),
        }
    });
    // No more requests; whatever is still running is failed, and the model's thread returns.
    shared.close();
    shared.abort.store(true, Ordering::Relaxed);
    let loaded = worker.join().map_err(|_| anyhow::anyhow!("the model's thread panicked"))?;
    // The answers the model's thread failed get a moment to send their last event.
    runtime.block_on(async {
        let t = std::time::Instant::now();
        while shared.in_flight.load(Ordering::Relaxed) > 0 && t.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    loaded?;
    served
}

/// Waits for Ctrl-C or SIGTERM, then tells the server to stop taking requests.
async fn signals(stop: tokio::sync::watch::Sender<bool>) {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        () = terminate => {}
    }
    eprintln!("kiln serve: stopping (requests in flight get to finish)");
    let _ = stop.send(true);
}

/// A model's name from its path: the file's stem, or a directory's name.
fn model_name(path: &std::path::Path) -> String {
    let name = match path.is_dir() {
        true => path.file_name(),
        false => path.file_stem(),
    };
    name.map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}
