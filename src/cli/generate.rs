//! `kiln generate`: a decoder spec's cached graph, optimized unless asked not to, run on wgpu (or
//! the interpreter) through a [`Session`]: prefill, then one token per step, streamed as it comes
//! (or, with `--json`, printed once at the end as one JSON document).

use crate::exec::{Backend, Exec, WeightArgs, optimizer_target};
use crate::progress::Reporter;
use crate::report::count;
use anyhow::{Context, Result, bail};
use kiln_compiler::graph::Graph;
use kiln_compiler::graph::build::{build_cached, build_encoder};
use kiln_compiler::spec::BlockKind;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, optimize};
use kiln_runtime::device::{Reading, Weights};
use kiln_runtime::generate::{Session, Stats, Stop, generate};
use kiln_runtime::{Engine, Memory, Message, Phase, Pick, Sampler, Tokenizer};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `kiln generate`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("text").args(["prompt", "prompt_file"])))]
pub struct GenerateArgs {
    /// The spec (TOML), an artifact from `kiln compile` (the spec it stores: generation runs
    /// the decoder's step graph with its key/value cache, built from it), or a checkpoint (a
    /// Hugging Face model directory or a GGUF file) whose spec is imported in memory.
    spec: PathBuf,
    /// Checkpoint (safetensors or GGUF); default: SPEC's, if a checkpoint.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The prompt text (tokenized with `--tokenizer`, or the GGUF weights' own tokenizer); `-`
    /// reads it from standard input.
    #[arg(
        long,
        allow_hyphen_values = true,
        required_unless_present_any = ["prompt_ids", "prompt_file"],
        conflicts_with_all = ["prompt_ids", "prompt_file"]
    )]
    prompt: Option<String>,
    /// Instead of `--prompt`: read the prompt text from this file (`-`: standard input); one
    /// final newline is dropped.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt as a user message in the tokenizer's chat template.
    #[arg(long, requires = "text")]
    chat: bool,
    /// With `--chat`: a system message (the template's default otherwise).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Prompt token ids, comma-separated (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Vec<i64>,
    /// An encoder-decoder's first decoder token (its prompt is the source). Default 0.
    #[arg(long)]
    decoder_start_id: Option<i64>,
    /// The tokenizer: a `tokenizer.json`, or a GGUF file. Default: the weights, when GGUF.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Print the generated ids (comma-separated) instead of text.
    #[arg(long)]
    print_ids: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Stop after any of these token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    stop_ids: Vec<i64>,
    /// Print one JSON document on stdout at the end instead of streaming (ids, text, why
    /// generation stopped, tokens/s).
    #[arg(long, conflicts_with = "print_ids")]
    json: bool,
    #[command(flatten)]
    exec: Exec,
}

impl GenerateArgs {
    /// The model file.
    pub fn spec(&self) -> &Path {
        &self.spec
    }

    /// Whether `--print-spec` was given.
    pub fn print_spec(&self) -> bool {
        self.exec.print_spec
    }
}

/// Runs `kiln generate`.
pub fn run(args: GenerateArgs, reporter: &Reporter) -> Result<()> {
    let GenerateArgs {
        spec,
        weights,
        prompt,
        prompt_file,
        chat,
        system,
        prompt_ids,
        decoder_start_id,
        tokenizer,
        print_ids,
        max_new_tokens,
        sampling,
        stop_ids,
        json,
        exec,
    } = args;
    let threads = exec.threads()?;
    let backend = exec.backend.resolve(exec.adapter.as_deref(), threads, reporter, json);
    crate::exec::check_exec(&exec, backend)?;
    let Exec { adapter, no_optimize, weights: storage, .. } = exec;
    let prompt = prompt_text(prompt, prompt_file)?;
    let fe = crate::model_file::load_spec(&spec)?;
    let vocab = fe.spec.spec.model.vocab;
    if let Some(bad) = stop_ids.iter().find(|&&id| id < 0 || id as u64 >= vocab) {
        bail!("--stop-ids: {bad} is not a token id of this model (its vocabulary is 0..{vocab})");
    }
    let weights = crate::model_file::weights_for(weights, &spec)?;
    let tokenizer = crate::model_file::tokenizer_for(tokenizer, &spec);
    let sampling = sampling.resolve(chat, &weights)?;
    let text = prompt.as_deref().map(|text| TextPrompt { text, chat, system: system.as_deref() });
    let req = Request {
        weights: &weights,
        prompt: prompt_ids,
        decoder_start: decoder_start_id,
        max_new: max_new_tokens,
        sampling,
        stop: stop_ids,
        backend,
        adapter: adapter.as_deref(),
        threads,
        no_optimize,
        storage,
    };
    let output = match (json, print_ids) {
        (true, _) => Output::Json,
        (false, true) => Output::Ids,
        (false, false) => Output::Text,
    };
    run_cli(&fe, req, text, tokenizer.as_deref(), output, reporter)
}

/// The prompt text: `--prompt` (`-`: standard input) or `--prompt-file` (`-` likewise), one final
/// newline of a file or standard input dropped (`echo` ends its text with one).
fn prompt_text(prompt: Option<String>, file: Option<PathBuf>) -> Result<Option<String>> {
    let (mut text, from) = match (prompt, file) {
        (Some(p), _) if p == "-" => {
            (crate::model_file::read_text(Path::new("-"), "the prompt")?, "standard input".into())
        }
        (Some(p), _) => return Ok(Some(p)),
        (None, Some(f)) => (crate::model_file::read_text(&f, "the prompt")?, format!("`{}`", f.display())),
        (None, None) => return Ok(None),
    };
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    if text.is_empty() {
        bail!("the prompt read from {from} is empty");
    }
    Ok(Some(text))
}

/// What to run and how to sample.
pub struct Request<'a> {
    /// The weights (safetensors or GGUF).
    pub weights: &'a Path,
    /// Prompt token ids (an encoder-decoder's source).
    pub prompt: Vec<i64>,
    /// An encoder-decoder's first decoder token.
    pub decoder_start: Option<i64>,
    /// Most tokens to generate.
    pub max_new: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Generation stops after any of these.
    pub stop: Vec<i64>,
    /// The backend (resolved: `wgpu`, `cpu` or `interp`).
    pub backend: Backend,
    /// GPU adapter.
    pub adapter: Option<&'a str>,
    /// Threads of the CPU backend.
    pub threads: usize,
    /// Skip the optimizer.
    pub no_optimize: bool,
    /// How weights are stored on the device.
    pub storage: WeightArgs,
}

/// How `kiln generate` chooses tokens: greedily unless asked to sample; a chat uses the model's
/// recommended settings where its files carry them ([`recommended`]), else [`CHAT_DEFAULTS`]
/// (greedy, with a repetition penalty). Each flag overrides its setting; `--temperature`,
/// `--top-k` or `--top-p` sample (at temperature 1 unless given).
#[derive(clap::Args)]
pub struct SamplingArgs {
    /// Decode greedily (the most likely token at each step): the default without `--chat`.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p", "repetition_penalty", "seed"])]
    greedy: bool,
    /// Sampling temperature (0 = greedy). Default: 0, or with `--chat` the model's recommended one
    /// (its `generation_config.json`), else 0 (greedy); 1 where `--top-k` or `--top-p` ask to
    /// sample.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample among the k most likely tokens only (0 = all). Chat default: recommended, else 40.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens holding this much probability. Chat default:
    /// recommended, else 0.9.
    #[arg(long)]
    top_p: Option<f32>,
    /// Penalise tokens already in the sequence (1 = off). Chat default: recommended, else 1.1.
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Seed of the sampler (default: from the clock; reported, so a run can be repeated).
    #[arg(long)]
    seed: Option<u64>,
}

/// A chat's settings when the model's files recommend none: `(temperature, top_k, top_p,
/// repetition_penalty)`. Conservative: the most likely token at each step, with a mild repetition
/// penalty to keep a small model out of loops. A GGUF carries no `generation_config.json`, and
/// sampling is a gamble on a small model: SmolLM2-135M-Instruct's first answer token to "What is
/// the capital of France?" is a near tie between "The" and "L" (its logits ~0.1 apart), so it
/// answered "L'Étoile ..." for 35-60% of seeds at temperatures 0.1 to 0.7 (the 0.7 chat front
/// ends often use gave Paris for 2 of 10), and greedily, Paris always. `--temperature` samples.
pub const CHAT_DEFAULTS: Settings = (0.0, 40, 0.9, 1.1);

/// Sampling settings: `(temperature, top_k, top_p, repetition_penalty)`.
pub type Settings = (f32, usize, f32, f32);

/// The sampler a generation uses and how to report it.
pub struct Sampling {
    /// The sampler.
    pub sampler: Sampler,
    /// Its settings and where they came from, for `--json` (`null` fields when greedy).
    pub report: serde_json::Value,
    /// The same as one line of text.
    pub line: String,
}

impl SamplingArgs {
    /// The sampler for a generation (`chat`: the prompt is a chat turn) with weights at `weights`.
    pub fn resolve(&self, chat: bool, weights: &Path) -> Result<Sampling> {
        let explicit = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        if self.greedy || (!chat && !explicit && self.repetition_penalty.is_none()) || self.temperature == Some(0.0) {
            let why = if self.greedy || self.temperature == Some(0.0) { "asked" } else { "the default without --chat" };
            return Ok(Sampling {
                sampler: Sampler::greedy(),
                report: serde_json::json!({"greedy": true}),
                line: format!("sampling: greedy ({why})"),
            });
        }
        let (base, source) = match (chat, recommended(weights)?) {
            (true, Some((settings, path))) => (settings, format!("recommended by {}", path.display())),
            (true, None) => (CHAT_DEFAULTS, "chat defaults".to_string()),
            // Sampling asked without a chat: unset settings off, as the flags' neutral values.
            (false, _) => ((0.0, 0, 1.0, 1.0), "flags".to_string()),
        };
        // Without a temperature, top-k or top-p alone sample at 1 where the base is greedy.
        let shaping = self.top_k.is_some() || self.top_p.is_some();
        let temperature = self.temperature.unwrap_or(if !chat || (base.0 == 0.0 && shaping) { 1.0 } else { base.0 });
        let (top_k, top_p) = (self.top_k.unwrap_or(base.1), self.top_p.unwrap_or(base.2));
        let repetition_penalty = self.repetition_penalty.unwrap_or(base.3);
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        let sampler = Sampler::new(temperature, top_k, top_p, repetition_penalty, seed)?;
        if sampler.temperature == 0.0 {
            let penalty = match repetition_penalty {
                1.0 => String::new(),
                p => format!(", repetition penalty {p}"),
            };
            return Ok(Sampling {
                sampler,
                report: serde_json::json!({"greedy": true, "repetition_penalty": repetition_penalty, "source": source}),
                line: format!("sampling: greedy{penalty} ({source}; --temperature samples)"),
            });
        }
        Ok(Sampling {
            report: serde_json::json!({"greedy": false, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "repetition_penalty": repetition_penalty, "seed": seed, "source": source}),
            line: format!(
                "sampling: temperature {temperature}, top-k {top_k}, top-p {top_p}, repetition penalty \
                 {repetition_penalty}, seed {seed} ({source}; --greedy decodes greedily)"
            ),
            sampler,
        })
    }
}

/// The sampling settings a model's files recommend: `generation_config.json` beside the weights
/// (a Hugging Face model directory), read as transformers reads it (`do_sample = false`: greedy).
/// `None` when there is no such file.
pub fn recommended(weights: &Path) -> Result<Option<(Settings, std::path::PathBuf)>> {
    let dir = if weights.is_dir() { weights } else { weights.parent().unwrap_or(Path::new(".")) };
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let cfg: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("`{}` is not valid JSON", path.display()))?;
    let f = |key: &str, default: f64| cfg.get(key).and_then(serde_json::Value::as_f64).unwrap_or(default);
    // A file that names no sampling setting recommends none (it may hold only special ids).
    if !["do_sample", "temperature", "top_k", "top_p", "repetition_penalty"].iter().any(|k| cfg.get(*k).is_some()) {
        return Ok(None);
    }
    if cfg.get("do_sample").and_then(serde_json::Value::as_bool) == Some(false) {
        return Ok(Some(((0.0, 0, 1.0, f("repetition_penalty", 1.0) as f32), path)));
    }
    let top_k = cfg.get("top_k").and_then(serde_json::Value::as_u64).unwrap_or(50) as usize;
    Ok(Some(((f("temperature", 1.0) as f32, top_k, f("top_p", 1.0) as f32, f("repetition_penalty", 1.0) as f32), path)))
}

/// The time spent before the prompt runs/// The time spent before the prompt runs, apart from the prefill it would otherwise inflate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// Optimizing, lowering, reading and uploading the weights, in seconds.
    pub load_s: f64,
    /// Compiling the kernels' shaders (wgpu): building the pipelines, and a warm-up step that
    /// makes the driver finish what it defers to a first dispatch, in seconds.
    pub compile_s: f64,
}

/// Builds the session (its loading shown on `reporter`) and generates, calling `on_token` with
/// each new id.
fn generate_with(
    fe: &FrontEnd,
    req: Request,
    ckpt: &kiln_runtime::Checkpoint,
    reporter: &Reporter,
    on_token: impl FnMut(i64) -> bool,
) -> Result<(Vec<i64>, Stats, Timings)> {
    if req.prompt.is_empty() {
        bail!("the prompt is empty: give --prompt or --prompt-ids");
    }
    let vocab = fe.spec.spec.model.vocab as i64;
    if let Some(bad) = req.prompt.iter().find(|&&t| t < 0 || t >= vocab) {
        bail!("prompt token id {bad} is outside the vocabulary (0..{vocab})");
    }
    let seq2seq = fe.spec.spec.model.kind == BlockKind::EncoderDecoder;
    let prompt = match (seq2seq, req.decoder_start) {
        (true, start) => {
            let start = start.unwrap_or(0);
            if start < 0 || start >= vocab {
                bail!("decoder start id {start} is outside the vocabulary (0..{vocab})");
            }
            vec![start]
        }
        (false, None) => req.prompt.clone(),
        (false, Some(_)) => bail!("--decoder-start-id is for encoder-decoder specs; this one is a decoder"),
    };
    let start = Instant::now();
    let compiled_before = reporter.seconds_in(Phase::Pipelines);
    if ckpt.gguf().is_none() {
        crate::exec::check_blocks(req.storage, &format!("`{}` (safetensors)", req.weights.display()))?;
    }
    let device = crate::exec::open(req.backend, req.adapter, req.threads)?;
    let optimizer = optimizer_target(&device, reporter)?;
    // Builds, optimizes and loads one graph on the device.
    let engine_of = |graph: Graph| -> Result<Box<dyn Engine>> {
        let graph = match req.no_optimize {
            true => graph,
            false => reporter.stage("optimizing", || optimize::optimize_for(&graph, &optimizer))?.0,
        };
        let weights = Weights::Checkpoint(Reading::of(&fe.spec, ckpt));
        Ok(device.load(&graph, weights, req.storage.storage(), reporter)?.into_engine())
    };
    let decoder = build_cached(&fe.spec)?;
    let outputs: Vec<String> = decoder.outputs.iter().map(|(n, _)| n.clone()).collect();
    let mut session = Session::new(engine_of(decoder)?, &outputs, fe.spec.spec.model.max_positions as usize)?;
    let encoder = match seq2seq {
        true => Some(engine_of(build_encoder(&fe.spec)?)?),
        false => None,
    };
    let mut timings = Timings::default();
    let pipelines = reporter.seconds_in(Phase::Pipelines) - compiled_before;
    timings.load_s = start.elapsed().as_secs_f64() - pipelines;
    let encoding = Instant::now();
    if let Some(encoder) = encoder {
        // Encode the source once; the decoder reads its keys and values at every step.
        let src = Tensor::i64(vec![1, req.prompt.len()], req.prompt.clone());
        session =
            session.with_memory(Memory::encode(encoder.as_ref(), &HashMap::from([("src_ids".to_string(), src)]))?);
    }
    let encode_s = encoding.elapsed().as_secs_f64();
    // A GPU driver may compile a pipeline's shader only at its first dispatch: one step before the
    // prompt, forgotten after, keeps that out of the prefill.
    timings.compile_s = pipelines;
    if req.backend == Backend::Wgpu && req.max_new > 0 {
        let warm_up = Instant::now();
        // The sampling kernel too: the pick is part of every step.
        session.sample(&prompt[..1], Pick { sampler: &mut Sampler::greedy(), seen: &[], logits: false })?;
        session.reset();
        timings.compile_s += warm_up.elapsed().as_secs_f64();
    }
    let mut sampler = req.sampling.sampler.clone();
    let (ids, mut stats) = generate(&mut session, &prompt, req.max_new, &mut sampler, &req.stop, on_token)?;
    if stats.prefill_s > 0.0 {
        // An encoder-decoder's prompt is its source: encoding it is part of the prefill.
        stats.prefill_s += encode_s;
    }
    Ok((ids, stats, timings))
}

/// A prompt given as text.
pub struct TextPrompt<'a> {
    /// The text.
    pub text: &'a str,
    /// Render it as a user turn of the tokenizer's chat template.
    pub chat: bool,
    /// The system turn before it (the template's default otherwise).
    pub system: Option<&'a str>,
}

/// What `kiln generate` prints on stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// The new text as it comes (ids when there is no tokenizer).
    Text,
    /// The new ids as they come, comma-separated (`--print-ids`).
    Ids,
    /// One JSON document at the end (`--json`; the fields are listed on `json`).
    Json,
}

/// `kiln generate`: tokenizes a text prompt if there is one, generates, and prints the new tokens
/// as `output` says: streamed to stdout as text (with a tokenizer) or comma-separated ids, or as
/// one JSON document at the end. A tokenizer's end-of-sequence id stops generation too. The
/// throughput line goes to stderr through `reporter` (which `--quiet` silences).
fn run_cli(
    fe: &FrontEnd,
    mut req: Request,
    text: Option<TextPrompt>,
    tokenizer: Option<&Path>,
    output: Output,
    reporter: &Reporter,
) -> Result<()> {
    // The tokenizer: the one named, or the GGUF weights' own (unless only ids are printed).
    let tokenizer_path = match tokenizer {
        Some(path) => Some(path),
        None if (text.is_some() || output != Output::Ids) && crate::model_file::is_gguf(req.weights)? => {
            Some(req.weights)
        }
        None => None,
    };
    let tokenizer = match tokenizer_path {
        Some(path) if path == Path::new("bytes") => Some(Tokenizer::bytes()?),
        Some(path) => {
            Some(Tokenizer::open(path).with_context(|| format!("cannot read the tokenizer in `{}`", path.display()))?)
        }
        None if text.is_some() => {
            bail!("a text prompt needs a tokenizer: give --tokenizer (a tokenizer.json or GGUF file)")
        }
        None => None,
    };
    if let (Some(text), Some(tok)) = (&text, &tokenizer) {
        let ids = if text.chat {
            let mut messages = Vec::new();
            if let Some(system) = text.system {
                messages.push(Message::new("system", system));
            }
            messages.push(Message::new("user", text.text));
            let rendered = tok.apply_chat_template(&messages, true)?;
            tok.encode(&rendered, false)?
        } else {
            tok.encode(text.text, true)?
        };
        req.prompt = ids.into_iter().map(i64::from).collect();
    }
    // What runs, but likely not as meant: said on stderr, or in the JSON document.
    let mut warnings = Vec::new();
    if let (Some(tok), Some(path)) = (&tokenizer, tokenizer_path) {
        let vocab = fe.spec.spec.model.vocab as usize;
        if tok.vocab_size() > vocab {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary is {vocab}: is it this model's tokenizer?",
                tok.vocab_size()
            );
        }
        warnings.extend(crate::model_file::tokenizer_warning(path, tok.vocab_size(), vocab as u64));
        req.stop.extend(tok.eos_id().map(i64::from));
    }
    let ckpt = kiln_runtime::Checkpoint::open(req.weights)?;
    warnings.extend(crate::model_file::unread_warning(req.weights, &crate::model_file::unread_tensors(fe, &ckpt)));
    if output != Output::Json {
        for warning in &warnings {
            eprintln!("warning: {warning}");
        }
    }

    catch_interrupt();
    let prompt = req.prompt.clone();
    let mut out = std::io::stdout();
    let backend = req.backend.name();
    let sampling = req.sampling.report.clone();
    if output != Output::Json {
        reporter.info(format_args!("{}", req.sampling.line));
    }
    let (ids, stats, timings) = match (output, tokenizer.as_ref()) {
        (Output::Json, _) => generate_with(fe, req, &ckpt, reporter, |_| !interrupted())?,
        (Output::Text, Some(tok)) => {
            let mut stream = tok.decode_stream(true);
            let mut failed = None;
            let generated = generate_with(fe, req, &ckpt, reporter, |id| {
                let piece = u32::try_from(id).map_err(|_| anyhow::anyhow!("negative token id {id}"));
                match piece.and_then(|id| Ok(stream.step(id)?)) {
                    Ok(Some(text)) => {
                        let _ = write!(out, "{text}");
                        let _ = out.flush();
                        !interrupted()
                    }
                    Ok(None) => !interrupted(),
                    Err(e) => {
                        failed = Some(e);
                        false
                    }
                }
            })?;
            if let Some(e) = failed {
                return Err(e.context("cannot decode the generated tokens"));
            }
            generated
        }
        (Output::Text | Output::Ids, _) => {
            let mut first = true;
            generate_with(fe, req, &ckpt, reporter, |id| {
                let _ = write!(out, "{}{id}", if first { "" } else { "," });
                let _ = out.flush();
                first = false;
                !interrupted()
            })?
        }
    };
    if output == Output::Json {
        let text = match &tokenizer {
            Some(tok) => {
                let ids: Vec<u32> = ids.iter().map(|&id| u32::try_from(id)).collect::<Result<_, _>>()?;
                Some(tok.decode(&ids, true).context("cannot decode the generated tokens")?)
            }
            None => None,
        };
        let mut value = json(&fe.graph.name, &prompt, &ids, text.as_deref(), &stats, &timings);
        value["backend"] = backend.into();
        value["sampling"] = sampling;
        value["warnings"] = warnings.into();
        // Every figure is in the document: nothing on stderr.
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&value)?);
        return match interrupted() {
            true => Err(Interrupted.into()),
            false => Ok(()),
        };
    }
    let _ = writeln!(out);
    if interrupted() {
        reporter.info(format_args!("interrupted: stopped after {}", count(stats.new_tokens, "token")));
    }
    let compile = match timings.compile_s > 0.0 {
        true => format!(" (compiling kernels {:.2} s)", timings.compile_s),
        false => String::new(),
    };
    let load = format!("load: {:.2} s{compile}", timings.load_s + timings.compile_s);
    if stats.prefill_s == 0.0 {
        reporter.info(format_args!("{load}; nothing generated: --max-new-tokens is 0, so the prompt was not run"));
    } else {
        reporter.info(format_args!(
            "{load}; prefill: {}, {:.1} tok/s; decode: {}, {:.1} tok/s; stopped: {}",
            count(stats.prompt_tokens, "token"),
            stats.prefill_tok_s(),
            count(stats.new_tokens, "token"),
            stats.decode_tok_s(),
            stop_reason(stats.stop).replace('_', " ")
        ));
    }
    match interrupted() {
        true => Err(Interrupted.into()),
        false => Ok(()),
    }
}

/// The error of a generation stopped by Ctrl-C, after its output and figures were printed: `main`
/// exits with 130 (128 + SIGINT, as shells report a command interrupted) and prints nothing more.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Why generation stopped, as `--json` names it.
fn stop_reason(stop: Stop) -> &'static str {
    match stop {
        Stop::MaxNewTokens => "max_new_tokens",
        Stop::StopId => "stop_id",
        Stop::ContextFull => "context_full",
        Stop::Caller => "interrupted",
    }
}

/// `kiln generate --json`: `model`, `prompt_ids` (after tokenization; an encoder-decoder's
/// source), `generated_ids`, `text` (the generated ids decoded, special tokens skipped; `null`
/// without a tokenizer), `stop_reason` (`max_new_tokens`, `stop_id` (a `--stop-ids` id or the
/// tokenizer's end of sequence), `context_full` (`max_positions` reached) or `interrupted`
/// (Ctrl-C)), `prompt_tokens`, `new_tokens`, `load_s` (optimizing, lowering, reading and
/// uploading weights), `compile_s` (compiling kernels; 0 but on wgpu), `prefill_s`, `decode_s`,
/// `prefill_tok_s` and `decode_tok_s` (0 when nothing was generated) (and `backend` and `sampling`
/// (`greedy`, and when sampling `temperature`, `top_k`, `top_p`, `repetition_penalty`, `seed`,
/// `source`), added by the caller).
fn json(
    model: &str,
    prompt: &[i64],
    ids: &[i64],
    text: Option<&str>,
    stats: &Stats,
    timings: &Timings,
) -> serde_json::Value {
    let stop_reason = stop_reason(stats.stop);
    serde_json::json!({
        "model": model,
        "prompt_ids": prompt,
        "generated_ids": ids,
        "text": text,
        "stop_reason": stop_reason,
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "load_s": timings.load_s,
        "compile_s": timings.compile_s,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "prefill_tok_s": stats.prefill_tok_s(),
        "decode_tok_s": stats.decode_tok_s(),
    })
}

/// Set by the first Ctrl-C during `kiln generate`: generation stops after the current token and
/// the command ends as usual (text so far, throughput line), with exit code 130. A second Ctrl-C
/// terminates at once.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: `signal` is async-signal-safe; the next Ctrl-C gets the default action.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
    }
}

/// Installs the Ctrl-C handler of [`INTERRUPTED`].
fn catch_interrupt() {
    #[cfg(unix)]
    // SAFETY: the handler only stores to an atomic and calls `signal`, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
}

fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}
