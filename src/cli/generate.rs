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
use kiln_runtime::generate::{Session, Stats, Stop, generate, generate_after};
use kiln_runtime::{Engine, Memory, Message, Phase, Pick, Sampler, Tokenizer};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What `generate` and `chat` both take: the model, where its weights and tokenizer come from,
/// how tokens are chosen and where generation stops, and where it runs.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// The spec (TOML), an artifact from `kiln compile` (the spec it stores: generation runs
    /// the decoder's step graph with its key/value cache, built from it), or a checkpoint (a
    /// Hugging Face model directory or a GGUF file) whose spec is imported in memory.
    spec: PathBuf,
    /// Checkpoint (safetensors or GGUF); default: SPEC's, if a checkpoint.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Instead of a checkpoint: parameters drawn at random (seed 1), as `kiln run
    /// --random-weights` draws them, to try a spec without one. The output is noise.
    #[arg(long, conflicts_with = "weights")]
    random_weights: bool,
    /// The tokenizer: a `tokenizer.json`, or a GGUF file. Default: the checkpoint's (its
    /// directory's `tokenizer.json`, or the GGUF weights).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// A chat template (Jinja, as Hugging Face's `chat_template`) to render conversations with,
    /// instead of the tokenizer's own (for a model whose files carry none).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Most tokens to generate per answer. Default: 64 (`generate`), 512 (`chat`).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Stop after any of these token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    stop_ids: Vec<i64>,
    #[command(flatten)]
    exec: Exec,
}

impl ModelArgs {
    /// The model file.
    pub fn spec(&self) -> &Path {
        &self.spec
    }

    /// Whether `--print-spec` was given.
    pub fn print_spec(&self) -> bool {
        self.exec.print_spec
    }

    /// The model to embed with, pooled and normalized as asked (`kiln serve` of an embedding
    /// model): its spec, weights, tokenizer and backend; the generation options do not apply,
    /// and random weights are refused (embeddings of them mean nothing).
    pub fn into_embed_source(
        self,
        pooling: Option<crate::cli::embed::Pooling>,
        normalize: Option<bool>,
    ) -> Result<crate::cli::embed::EmbedSource> {
        if self.random_weights {
            bail!("--random-weights: serving embeddings needs the model's weights (give --weights, or its checkpoint)");
        }
        let ModelArgs { spec, weights, tokenizer, exec, .. } = self;
        Ok(crate::cli::embed::EmbedSource { spec, weights, tokenizer, pooling, normalize, exec })
    }
}

/// Arguments of `kiln generate`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("text").args(["prompt", "prompt_file", "batch_prompts"]).multiple(true)))]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text (tokenized with `--tokenizer`, or the GGUF weights' own tokenizer); `-`
    /// reads it from standard input. Given several times, each prompt is answered in turn.
    #[arg(
        long,
        allow_hyphen_values = true,
        required_unless_present_any = ["prompt_ids", "prompt_file", "batch_prompts", "messages"],
        conflicts_with_all = ["prompt_ids", "prompt_file", "batch_prompts", "messages"]
    )]
    prompt: Vec<String>,
    /// Instead of `--prompt`: read the prompt text from this file (`-`: standard input); one
    /// final newline is dropped.
    #[arg(long, conflicts_with_all = ["prompt_ids", "batch_prompts", "messages"])]
    prompt_file: Option<PathBuf>,
    /// Several prompts, one per line of this file (`-`: standard input; blank lines skipped),
    /// each answered in turn on the model loaded once; `--json` prints an array.
    #[arg(long, conflicts_with_all = ["prompt_ids", "messages"])]
    batch_prompts: Option<PathBuf>,
    /// A conversation to continue: a JSON array of messages, `{"role": "system" | "user" |
    /// "assistant", "content": "..."}` (OpenAI's shape), rendered with the chat template; the
    /// answer is the assistant's next turn. `-` reads it from standard input.
    #[arg(long, conflicts_with_all = ["prompt_ids", "chat", "system"])]
    messages: Option<PathBuf>,
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
    /// Print the generated ids (comma-separated) instead of text.
    #[arg(long)]
    print_ids: bool,
    /// Print one JSON document on stdout at the end instead of streaming (ids, text, why
    /// generation stopped, tokens/s); with several prompts, an array of them.
    #[arg(long, conflicts_with = "print_ids")]
    json: bool,
}

impl GenerateArgs {
    /// The model file.
    pub fn spec(&self) -> &Path {
        self.model.spec()
    }

    /// Whether `--print-spec` was given.
    pub fn print_spec(&self) -> bool {
        self.model.print_spec()
    }
}

/// What a command generating text wants of [`Model::open`].
pub struct Wants {
    /// The prompts are chat turns (a chat's sampling defaults, a chat template).
    pub chat: bool,
    /// A text prompt: a tokenizer is required.
    pub text: bool,
    /// Only ids are printed: no tokenizer is looked for unless `text`.
    pub ids_only: bool,
    /// `--json`: nothing informational on stderr.
    pub json: bool,
    /// `--max-new-tokens` when not given.
    pub max_new: usize,
}

/// A model opened for generation from [`ModelArgs`]: its spec, weights (or random ones),
/// tokenizer (with `--chat-template` applied), sampler and stop ids, the backend that will run it,
/// and the warnings about inputs that do not fit. [`Generator::load`] loads it.
pub struct Model {
    /// The spec and its graph.
    pub fe: FrontEnd,
    /// The checkpoint, or `None` with `--random-weights`.
    ckpt: Option<kiln_runtime::Checkpoint>,
    /// The weights' path (`None`: random).
    weights: Option<PathBuf>,
    /// The tokenizer, if any.
    pub tokenizer: Option<Tokenizer>,
    /// What runs, but likely not as meant (stderr, or `warnings` in JSON).
    pub warnings: Vec<String>,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// Where it runs (resolved).
    pub backend: Backend,
    adapter: Option<String>,
    threads: usize,
    no_optimize: bool,
    storage: WeightArgs,
    /// Most tokens per answer.
    pub max_new: usize,
    /// Generation stops after any of these (the tokenizer's end of sequence included).
    pub stop: Vec<i64>,
}

impl Model {
    /// Opens the model `args` name for a generation as `wants` says: the spec, the checkpoint (or
    /// random weights, with a note that the output is noise), the tokenizer, the sampler. Says on
    /// stderr which backend runs it and what does not fit (unless `wants.json`).
    pub fn open(args: ModelArgs, wants: Wants, reporter: &Reporter) -> Result<Model> {
        let ModelArgs {
            spec,
            weights,
            random_weights,
            tokenizer,
            chat_template,
            max_new_tokens,
            sampling,
            stop_ids,
            exec,
        } = args;
        let threads = exec.threads()?;
        let backend = exec.backend.resolve(exec.adapter.as_deref(), threads, reporter, wants.json);
        crate::exec::check_exec(&exec, backend)?;
        let Exec { adapter, no_optimize, weights: storage, .. } = exec;
        let fe = crate::model_file::load_spec(&spec)?;
        let vocab = fe.spec.spec.model.vocab;
        if let Some(bad) = stop_ids.iter().find(|&&id| id < 0 || id as u64 >= vocab) {
            bail!("--stop-ids: {bad} is not a token id of this model (its vocabulary is 0..{vocab})");
        }
        let weights = match (weights, random_weights) {
            (None, true) => None,
            (None, false) if crate::model_file::default_weights(&spec)?.is_none() => bail!(
                "give the weights: --weights CHECKPOINT, or --random-weights to try the spec (a checkpoint \
                 directory or GGUF file given as the model brings its own, a built-in real model its fetched \
                 ones, and a spec can record them as `weights.path`)"
            ),
            (weights, _) => Some(crate::model_file::weights_for(weights, &spec)?),
        };
        let sampling = sampling.resolve(wants.chat, weights.as_deref())?;
        // The tokenizer: the one named, the checkpoint's, or the GGUF weights' own (unless only ids
        // are printed).
        let named = crate::model_file::tokenizer_for(tokenizer, &spec);
        let path = match (named, &weights) {
            (Some(path), _) => Some(path),
            (None, Some(w)) if (wants.text || !wants.ids_only) && crate::model_file::is_gguf(w)? => Some(w.clone()),
            (None, _) => None,
        };
        let tokenizer = match &path {
            Some(path) => Some(open_tokenizer(path, chat_template.as_deref())?),
            None if chat_template.is_some() => {
                bail!("--chat-template needs a tokenizer: give --tokenizer (a tokenizer.json or GGUF file)")
            }
            None if wants.text => {
                bail!("a text prompt needs a tokenizer: give --tokenizer (a tokenizer.json or GGUF file)")
            }
            None => None,
        };
        let mut stop = stop_ids;
        let mut warnings = Vec::new();
        if let (Some(tok), Some(path)) = (&tokenizer, &path) {
            if tok.vocab_size() as u64 > vocab {
                bail!(
                    "the tokenizer has {} tokens but the model's vocabulary is {vocab}: is it this model's tokenizer?",
                    tok.vocab_size()
                );
            }
            warnings.extend(crate::model_file::tokenizer_warning(path, tok.vocab_size(), vocab));
            stop.extend(tok.eos_id().map(i64::from));
        }
        let ckpt = weights.as_deref().map(kiln_runtime::Checkpoint::open).transpose()?;
        match (&ckpt, &weights) {
            (Some(ckpt), Some(path)) => {
                if ckpt.gguf().is_none() {
                    crate::exec::check_blocks(storage, &format!("`{}` (safetensors)", path.display()))?;
                }
                warnings.extend(crate::model_file::unread_warning(path, &crate::model_file::unread_tensors(&fe, ckpt)));
            }
            _ => crate::exec::check_blocks(storage, "random weights")?,
        }
        if !wants.json {
            for warning in &warnings {
                eprintln!("warning: {warning}");
            }
            if weights.is_none() {
                eprintln!("note: --random-weights: the parameters are random, so the output is noise");
            }
        }
        Ok(Model {
            fe,
            ckpt,
            weights,
            tokenizer,
            warnings,
            sampling,
            backend,
            adapter,
            threads,
            no_optimize,
            storage,
            max_new: max_new_tokens.unwrap_or(wants.max_new),
            stop,
        })
    }

    /// The token ids of a conversation rendered with the chat template, a generation prompt
    /// for the assistant's turn after it.
    pub fn render(&self, messages: &[Message]) -> Result<Vec<i64>> {
        let tok = self.tokenizer.as_ref().context("a chat needs a tokenizer: give --tokenizer")?;
        let rendered = tok.apply_chat_template(messages, true).map_err(|e| match e {
            kiln_runtime::TokenizeError::NoChatTemplate => anyhow::anyhow!(
                "the tokenizer has no chat template: give one with --chat-template FILE (a Jinja template, as a \
                 Hugging Face `chat_template`)"
            ),
            e => e.into(),
        })?;
        Ok(tok.encode(&rendered, false)?.into_iter().map(i64::from).collect())
    }

    /// The ids of a text prompt: as a chat turn (`chat`, after a `system` turn if given), or as
    /// plain text with the tokenizer's special tokens.
    pub fn prompt_ids(&self, text: &str, chat: bool, system: Option<&str>) -> Result<Vec<i64>> {
        if chat {
            let mut messages = Vec::new();
            if let Some(system) = system {
                messages.push(Message::new("system", system));
            }
            messages.push(Message::new("user", text));
            return self.render(&messages);
        }
        let tok = self.tokenizer.as_ref().context("a text prompt needs a tokenizer: give --tokenizer")?;
        Ok(tok.encode(text, true)?.into_iter().map(i64::from).collect())
    }
}

/// The tokenizer at `path` (`bytes`: the byte tokenizer), its chat template replaced by the file
/// `template` if given, else, for a `tokenizer.json` without one, the template its directory
/// holds (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`, as transformers
/// finds it).
pub fn open_tokenizer(path: &Path, template: Option<&Path>) -> Result<Tokenizer> {
    let tok = match path == Path::new("bytes") {
        true => Tokenizer::bytes()?,
        false => Tokenizer::open(path).with_context(|| format!("cannot read the tokenizer in `{}`", path.display()))?,
    };
    if let Some(file) = template {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read the chat template `{}` (--chat-template)", file.display()))?;
        if text.trim().is_empty() {
            bail!("the chat template `{}` (--chat-template) is empty", file.display());
        }
        return Ok(tok.with_chat_template(text));
    }
    if tok.chat_template().is_some() || path.is_dir() {
        return Ok(tok);
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let jinja = dir.join("chat_template.jinja");
    if let Ok(text) = std::fs::read_to_string(&jinja) {
        return Ok(tok.with_chat_template(text));
    }
    let config = dir.join("tokenizer_config.json");
    let found = std::fs::read_to_string(&config)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.get("chat_template").and_then(|t| t.as_str()).map(str::to_string));
    Ok(match found {
        Some(text) => tok.with_chat_template(text),
        None => tok,
    })
}

/// Runs `kiln generate`.
pub fn run(args: GenerateArgs, reporter: &Reporter) -> Result<()> {
    let GenerateArgs {
        model,
        prompt,
        prompt_file,
        batch_prompts,
        messages,
        chat,
        system,
        prompt_ids,
        decoder_start_id,
        print_ids,
        json,
    } = args;
    if model.chat_template.is_some() && !chat && messages.is_none() {
        bail!("--chat-template renders conversations: give it with --chat or --messages");
    }
    // Read before the model loads, so a bad file is said at once.
    let conversation = messages.as_deref().map(read_messages).transpose()?;
    let several = prompt.len() > 1 || batch_prompts.is_some();
    let texts = match batch_prompts {
        Some(file) => prompt_lines(&file)?,
        None if prompt.len() > 1 => {
            if prompt.iter().any(|p| p == "-") {
                bail!("--prompt -: standard input gives one prompt; with several, use --batch-prompts FILE");
            }
            prompt
        }
        None => prompt_text(prompt.into_iter().next(), prompt_file)?.into_iter().collect(),
    };
    let wants = Wants {
        chat: chat || conversation.is_some(),
        text: !texts.is_empty() || conversation.is_some(),
        ids_only: print_ids,
        json,
        max_new: 64,
    };
    let model = Model::open(model, wants, reporter)?;
    // Each prompt's ids, with its text when it has one.
    let prompts: Vec<(Option<&str>, Vec<i64>)> = match &conversation {
        Some((file, messages)) => {
            let ids = model.render(messages).with_context(|| format!("--messages {file}"))?;
            vec![(None, ids)]
        }
        None if texts.is_empty() => vec![(None, prompt_ids)],
        None => texts
            .iter()
            .map(|t| Ok((Some(t.as_str()), model.prompt_ids(t, chat, system.as_deref())?)))
            .collect::<Result<_>>()?,
    };
    let output = match (json, print_ids) {
        (true, _) => Output::Json,
        (false, true) => Output::Ids,
        (false, false) => Output::Text,
    };
    run_cli(&model, &prompts, several, decoder_start_id, output, reporter)
}

/// Prompts one per line of `file` (`-`: standard input), blank lines skipped (`--batch-prompts`).
fn prompt_lines(file: &Path) -> Result<Vec<String>> {
    let text = crate::model_file::read_text(file, "the prompts")?;
    let lines: Vec<String> =
        text.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    if lines.is_empty() {
        let from = match file.as_os_str() == "-" {
            true => "standard input".to_string(),
            false => format!("`{}`", file.display()),
        };
        bail!("--batch-prompts: {from} holds no prompt (one per line; blank lines are skipped)");
    }
    Ok(lines)
}

/// The roles a message of `--messages` may have.
const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Reads `--messages`: a JSON array of `{"role", "content"}` objects (OpenAI's shape; other keys
/// are ignored), at least one, each role one of [`ROLES`] and each content a string. Returns the
/// file's name as errors give it (`` `file` ``, or standard input) and the messages.
pub fn read_messages(file: &Path) -> Result<(String, Vec<Message>)> {
    let name = match file.as_os_str() == "-" {
        true => "standard input".to_string(),
        false => format!("`{}`", file.display()),
    };
    let text = crate::model_file::read_text(file, "the messages")?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("--messages: {name} is not valid JSON"))?;
    let Some(items) = value.as_array() else {
        bail!(
            "--messages: {name} holds {}, not an array of messages ([{{\"role\": \"user\", \"content\": \"...\"}}, ...])",
            json_kind(&value)
        );
    };
    if items.is_empty() {
        bail!("--messages: {name} holds an empty list: give at least one message");
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let n = i + 1;
        let Some(object) = item.as_object() else {
            bail!("--messages: {name}: message {n} is {}, not an object with `role` and `content`", json_kind(item));
        };
        let role = match object.get("role") {
            Some(serde_json::Value::String(role)) => role,
            Some(other) => bail!("--messages: {name}: message {n}'s `role` is {}, not a string", json_kind(other)),
            None => bail!("--messages: {name}: message {n} has no `role`"),
        };
        if !ROLES.contains(&role.as_str()) {
            bail!("--messages: {name}: message {n} has the role `{role}`; the roles are system, user and assistant");
        }
        let content = match object.get("content") {
            Some(serde_json::Value::String(content)) => content,
            Some(other) => bail!("--messages: {name}: message {n}'s `content` is {}, not a string", json_kind(other)),
            None => bail!("--messages: {name}: message {n} has no `content`"),
        };
        messages.push(Message::new(role.as_str(), content.as_str()));
    }
    Ok((name, messages))
}

/// A JSON value's kind, with its article, for messages.
fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The prompt text: `--prompt` (`-`: standard input) or `--prompt-file` (`-` likewise), one final
/// newline of a file or standard input dropped (`echo` ends its text with one).
pub fn prompt_text(prompt: Option<String>, file: Option<PathBuf>) -> Result<Option<String>> {
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
    pub fn resolve(&self, chat: bool, weights: Option<&Path>) -> Result<Sampling> {
        let explicit = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        if self.greedy || (!chat && !explicit && self.repetition_penalty.is_none()) || self.temperature == Some(0.0) {
            let why = if self.greedy || self.temperature == Some(0.0) { "asked" } else { "the default without --chat" };
            return Ok(Sampling {
                sampler: Sampler::greedy(),
                report: serde_json::json!({"greedy": true}),
                line: format!("sampling: greedy ({why})"),
            });
        }
        let recommended = match weights {
            Some(weights) => recommended(weights)?,
            None => None,
        };
        let (base, source) = match (chat, recommended) {
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

/// The time spent before the prompt runs, apart from the prefill it would otherwise inflate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// Optimizing, lowering, reading and uploading the weights, in seconds.
    pub load_s: f64,
    /// Compiling the kernels' shaders (wgpu): building the pipelines, and a warm-up step that
    /// makes the driver finish what it defers to a first dispatch, in seconds.
    pub compile_s: f64,
}

/// A decoder loaded once for any number of generations: `generate`'s prompts, each a sequence of
/// its own, or `chat`'s turns, each continuing the key/value cache of the conversation so far.
pub struct Generator<'m> {
    model: &'m Model,
    session: Session,
    /// An encoder-decoder's encoder, run once per source.
    encoder: Option<Box<dyn Engine>>,
    /// Whether the kernels have run once (wgpu compiles some at their first dispatch).
    warm: bool,
    /// The sampler a new sequence starts with (each prompt as if it ran alone).
    sampler: Sampler,
    /// The sampler a chat's turns continue.
    running: Sampler,
    /// The token ids the session's cache holds, in order.
    cached: Vec<i64>,
    /// Loading's time, and the kernels' compiling.
    pub timings: Timings,
}

impl<'m> Generator<'m> {
    /// Builds the decoder's cached step graph (and an encoder-decoder's encoder), optimizes it
    /// for the backend unless `--no-optimize`, and loads it with the model's weights (its loading
    /// shown on `reporter`).
    pub fn load(model: &'m Model, reporter: &Reporter) -> Result<Generator<'m>> {
        let fe = &model.fe;
        let start = Instant::now();
        let compiled_before = reporter.seconds_in(Phase::Pipelines);
        let device = crate::exec::open(model.backend, model.adapter.as_deref(), model.threads)?;
        let optimizer = optimizer_target(&device, reporter)?;
        // Random parameters are drawn for the graph as built, as `kiln run` draws them, and read
        // by name by the cached step and the encoder alike.
        let random = match model.ckpt {
            Some(_) => HashMap::new(),
            None => kiln_compiler::interp::random_params(&fe.graph, 1)?,
        };
        let no_blocks = HashMap::new();
        // Builds, optimizes and loads one graph on the device.
        let engine_of = |graph: Graph| -> Result<Box<dyn Engine>> {
            let graph = match model.no_optimize {
                true => graph,
                false => reporter.stage("optimizing", || optimize::optimize_for(&graph, &optimizer))?.0,
            };
            let weights = match &model.ckpt {
                Some(ckpt) => Weights::Checkpoint(Reading::of(&fe.spec, ckpt)),
                None => Weights::Given { params: &random, blocks: &no_blocks },
            };
            Ok(device.load(&graph, weights, model.storage.storage(), reporter)?.into_engine())
        };
        let decoder = build_cached(&fe.spec)?;
        let outputs: Vec<String> = decoder.outputs.iter().map(|(n, _)| n.clone()).collect();
        let session = Session::new(engine_of(decoder)?, &outputs, fe.spec.spec.model.max_positions as usize)?;
        let encoder = match fe.spec.spec.model.kind == BlockKind::EncoderDecoder {
            true => Some(engine_of(build_encoder(&fe.spec)?)?),
            false => None,
        };
        let pipelines = reporter.seconds_in(Phase::Pipelines) - compiled_before;
        let timings = Timings { load_s: start.elapsed().as_secs_f64() - pipelines, compile_s: pipelines };
        let sampler = model.sampling.sampler.clone();
        Ok(Generator {
            model,
            session,
            encoder,
            warm: false,
            running: sampler.clone(),
            sampler,
            cached: Vec::new(),
            timings,
        })
    }

    /// Whether the model is an encoder-decoder (its prompt is the source).
    pub fn seq2seq(&self) -> bool {
        self.encoder.is_some()
    }

    /// The most tokens the model's context holds.
    pub fn max_positions(&self) -> usize {
        self.session.max_positions
    }

    /// The decoder's session, for a caller that steps it itself (`kiln serve`'s scheduler,
    /// which parks one sequence's cache and resumes another's between steps).
    pub fn session(&mut self) -> &mut Session {
        &mut self.session
    }

    /// A GPU driver may compile a pipeline's shader only at its first dispatch: one step (the
    /// sampling kernel's too) before the first prompt, forgotten after, keeps that out of the
    /// prefill; its time counts as compiling.
    pub(crate) fn warm_up(&mut self, first: i64) -> Result<()> {
        if self.warm || self.model.backend != Backend::Wgpu || self.model.max_new == 0 {
            return Ok(());
        }
        self.warm = true;
        let warm_up = Instant::now();
        self.session.sample(&[first], Pick { sampler: &mut Sampler::greedy(), seen: &[], logits: false })?;
        self.session.reset();
        self.timings.compile_s += warm_up.elapsed().as_secs_f64();
        Ok(())
    }

    /// Generates after `prompt` as a new sequence (an encoder-decoder's source, decoding from
    /// `decoder_start`, default 0), calling `on_token` with each new id.
    pub fn generate(
        &mut self,
        prompt: &[i64],
        decoder_start: Option<i64>,
        on_token: impl FnMut(i64) -> bool,
    ) -> Result<(Vec<i64>, Stats)> {
        let ids = decoder_prompt(&self.model.fe, prompt, decoder_start)?;
        self.session.reset();
        self.cached.clear();
        let encoding = Instant::now();
        if let Some(encoder) = &self.encoder {
            // Encode the source once; the decoder reads its keys and values at every step.
            let src = Tensor::i64(vec![1, prompt.len()], prompt.to_vec());
            let inputs = HashMap::from([("src_ids".to_string(), src)]);
            self.session.set_memory(Memory::encode(encoder.as_ref(), &inputs)?);
        }
        let encode_s = encoding.elapsed().as_secs_f64();
        self.warm_up(ids[0])?;
        let mut sampler = self.sampler.clone();
        let model = self.model;
        let generated = generate(&mut self.session, &ids, model.max_new, &mut sampler, &model.stop, on_token);
        let (answer, mut stats) = self.settle(&ids, generated)?;
        if stats.prefill_s > 0.0 {
            // An encoder-decoder's prompt is its source: encoding it is part of the prefill.
            stats.prefill_s += encode_s;
        }
        Ok((answer, stats))
    }

    /// A chat's next turn: generates after `ids`, the whole conversation rendered, running only
    /// what follows the tokens the cache already holds (all of it if the rendering no longer
    /// starts with them: a token boundary moved, the history changed). Returns the answer, its
    /// figures, and how many of `ids` the cache held.
    pub fn continue_with(
        &mut self,
        ids: &[i64],
        on_token: impl FnMut(i64) -> bool,
    ) -> Result<(Vec<i64>, Stats, usize)> {
        if self.seq2seq() {
            bail!("a chat needs a decoder; `{}` is an encoder-decoder", self.model.fe.graph.name);
        }
        check_ids(&self.model.fe, ids)?;
        if !ids.starts_with(&self.cached) || self.cached.len() >= ids.len() {
            self.session.reset();
            self.cached.clear();
        }
        self.warm_up(ids[0])?;
        let reused = self.cached.len();
        let (context, new) = ids.split_at(reused);
        let model = self.model;
        let generated =
            generate_after(&mut self.session, context, new, model.max_new, &mut self.running, &model.stop, on_token);
        let (answer, stats) = self.settle(ids, generated)?;
        Ok((answer, stats, reused))
    }

    /// Records what the cache holds after a generation over `ids`: `ids` and every new token but
    /// the last (never run); after an error, nothing (the cache is started over).
    fn settle(
        &mut self,
        ids: &[i64],
        generated: Result<(Vec<i64>, Stats), kiln_runtime::GenerateError>,
    ) -> Result<(Vec<i64>, Stats)> {
        match generated {
            Ok((answer, stats)) => {
                if stats.new_tokens > 0 {
                    self.cached = [ids, &answer[..answer.len() - 1]].concat();
                }
                Ok((answer, stats))
            }
            Err(e) => {
                self.session.reset();
                self.cached.clear();
                Err(e.into())
            }
        }
    }

    /// Forgets the conversation the cache holds.
    pub fn reset(&mut self) {
        self.session.reset();
        self.cached.clear();
    }
}

/// Refuses an empty prompt and ids outside the vocabulary.
fn check_ids(fe: &FrontEnd, ids: &[i64]) -> Result<()> {
    if ids.is_empty() {
        bail!("the prompt is empty: give --prompt or --prompt-ids");
    }
    let vocab = fe.spec.spec.model.vocab as i64;
    if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= vocab) {
        bail!("prompt token id {bad} is outside the vocabulary (0..{vocab})");
    }
    Ok(())
}

/// The ids the decoder starts from after `prompt` (checked): the prompt itself, or for an
/// encoder-decoder (whose prompt is the source) `decoder_start`, default 0.
fn decoder_prompt(fe: &FrontEnd, prompt: &[i64], decoder_start: Option<i64>) -> Result<Vec<i64>> {
    check_ids(fe, prompt)?;
    let vocab = fe.spec.spec.model.vocab as i64;
    match (fe.spec.spec.model.kind == BlockKind::EncoderDecoder, decoder_start) {
        (true, start) => {
            let start = start.unwrap_or(0);
            if start < 0 || start >= vocab {
                bail!("decoder start id {start} is outside the vocabulary (0..{vocab})");
            }
            Ok(vec![start])
        }
        (false, None) => Ok(prompt.to_vec()),
        (false, Some(_)) => bail!("--decoder-start-id is for encoder-decoder specs; this one is a decoder"),
    }
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

/// Streams the tokens `run` generates to stdout as `output` says — as text with a tokenizer, else
/// as comma-separated ids; nothing for JSON — and stops it when `stop_now` says so.
pub fn stream<T>(
    tokenizer: Option<&Tokenizer>,
    output: Output,
    stop_now: &dyn Fn() -> bool,
    run: impl FnOnce(&mut dyn FnMut(i64) -> bool) -> Result<T>,
) -> Result<T> {
    let mut out = std::io::stdout();
    match (output, tokenizer) {
        (Output::Json, _) => run(&mut |_| !stop_now()),
        (Output::Text, Some(tok)) => {
            let mut stream = tok.decode_stream(true);
            let mut failed = None;
            let generated = run(&mut |id| {
                let piece = u32::try_from(id).map_err(|_| anyhow::anyhow!("negative token id {id}"));
                match piece.and_then(|id| Ok(stream.step(id)?)) {
                    Ok(Some(text)) => {
                        let _ = write!(out, "{text}");
                        let _ = out.flush();
                        !stop_now()
                    }
                    Ok(None) => !stop_now(),
                    Err(e) => {
                        failed = Some(e);
                        false
                    }
                }
            })?;
            if let Some(e) = failed {
                return Err(e.context("cannot decode the generated tokens"));
            }
            Ok(generated)
        }
        (Output::Text | Output::Ids, _) => {
            let mut first = true;
            run(&mut |id| {
                let _ = write!(out, "{}{id}", if first { "" } else { "," });
                let _ = out.flush();
                first = false;
                !stop_now()
            })
        }
    }
}

/// The decoding line of a generation: prefill and decode tokens per second and why it stopped.
pub fn throughput(stats: &Stats) -> String {
    format!(
        "prefill: {}, {:.1} tok/s; decode: {}, {:.1} tok/s; stopped: {}",
        count(stats.prompt_tokens, "token"),
        stats.prefill_tok_s(),
        count(stats.new_tokens, "token"),
        stats.decode_tok_s(),
        stop_reason(stats.stop).replace('_', " ")
    )
}

/// The loading line: load time, and on wgpu the kernels' compiling.
pub fn load_line(timings: &Timings) -> String {
    let compile = match timings.compile_s > 0.0 {
        true => format!(" (compiling kernels {:.2} s)", timings.compile_s),
        false => String::new(),
    };
    format!("load: {:.2} s{compile}", timings.load_s + timings.compile_s)
}

/// Characters of a prompt quoted in the header above its answer when several are answered.
const QUOTED: usize = 60;

/// `kiln generate`: generates after each prompt in turn (`prompts`: the text, if any, and the
/// ids) on the model loaded once, and prints the new tokens as `output` says: streamed to stdout
/// as text (with a tokenizer) or comma-separated ids, or as one JSON document at the end (an
/// array of them when `several` prompts were asked for). With several, a text answer follows a
/// `### prompt N/M: ...` header and ids are one line per prompt. The throughput lines go to stderr
/// through `reporter` (which `--quiet` silences).
fn run_cli(
    model: &Model,
    prompts: &[(Option<&str>, Vec<i64>)],
    several: bool,
    decoder_start: Option<i64>,
    output: Output,
    reporter: &Reporter,
) -> Result<()> {
    for (_, prompt) in prompts {
        decoder_prompt(&model.fe, prompt, decoder_start)?;
    }
    catch_interrupt();
    let mut out = std::io::stdout();
    if output != Output::Json {
        reporter.info(format_args!("{}", model.sampling.line));
    }
    let mut generator = Generator::load(model, reporter)?;
    let mut documents = Vec::new();
    for (i, (given, prompt)) in prompts.iter().enumerate() {
        if several && output == Output::Text {
            let quoted = match given {
                Some(text) if text.chars().count() > QUOTED => {
                    format!("{}…", text.chars().take(QUOTED).collect::<String>())
                }
                Some(text) => text.to_string(),
                None => format!("{} ids", prompt.len()),
            };
            let _ = writeln!(out, "{}### prompt {}/{}: {quoted}", if i > 0 { "\n" } else { "" }, i + 1, prompts.len());
        }
        let (ids, stats) = stream(model.tokenizer.as_ref(), output, &interrupted, |on_token| {
            generator.generate(prompt, decoder_start, on_token)
        })?;
        if output == Output::Json {
            let text = match &model.tokenizer {
                Some(tok) => {
                    let ids: Vec<u32> = ids.iter().map(|&id| u32::try_from(id)).collect::<Result<_, _>>()?;
                    Some(tok.decode(&ids, true).context("cannot decode the generated tokens")?)
                }
                None => None,
            };
            let mut value = json(&model.fe.graph.name, prompt, &ids, text.as_deref(), &stats, &generator.timings);
            value["backend"] = model.backend.name().into();
            value["sampling"] = model.sampling.report.clone();
            value["warnings"] = model.warnings.clone().into();
            value["random_weights"] = model.weights.is_none().into();
            if several {
                value["prompt"] = (*given).into();
            }
            documents.push(value);
        } else {
            let _ = writeln!(out);
            if interrupted() {
                reporter.info(format_args!("interrupted: stopped after {}", count(stats.new_tokens, "token")));
            }
            let load = match i {
                0 => format!("{}; ", load_line(&generator.timings)),
                _ => String::new(),
            };
            if stats.prefill_s == 0.0 {
                reporter
                    .info(format_args!("{load}nothing generated: --max-new-tokens is 0, so the prompt was not run"));
            } else {
                reporter.info(format_args!("{load}{}", throughput(&stats)));
            }
        }
        if interrupted() {
            break;
        }
    }
    if output == Output::Json {
        // Every figure is in the document: nothing on stderr.
        let document = match several {
            true => serde_json::Value::Array(documents),
            false => documents.pop().unwrap_or_default(),
        };
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&document)?);
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
