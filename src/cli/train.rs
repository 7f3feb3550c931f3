//! `kiln train`: a model trained on pre-batched data (`--batches`), with its recipe from a file
//! (`--recipe`) and flags; a line of JSON per step (`--log`), checkpoints and the final weights
//! under the checkpoint's own tensor names (`-o`), which `run`, `generate` and `embed` read at once.
//!
//! Each checkpoint is two files, each written atomically: the weights (`OUT`) and, beside them,
//! the training state (`OUT` with `.state.safetensors`: the optimizer's moments, the step). A
//! run continued with `--resume OUT` takes up both and goes on exactly as the uninterrupted run
//! would have. Ctrl-C (or SIGTERM) stops a run after the step under way and writes a checkpoint
//! first; a step that fails (a non-finite loss) writes the weights before it.

use crate::exec::{Backend, training_device};
use crate::model_file::{load_spec, weights_for};
use crate::progress::Reporter;
use anyhow::{Context, Result, anyhow, bail};
use kiln_compiler::file::AppendLog;
use kiln_compiler::spec::BlockKind;
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::{Bytes, Recompute};
use kiln_runtime::train::batches::Batches;
use kiln_runtime::train::data::{
    ByteTokenizer, Corpus, CorpusOptions, Objective, Split, TextEncoder, check_vocab, tokenizer_beside,
};
use kiln_runtime::train::feed::Feed;
use kiln_runtime::train::init;
use kiln_runtime::train::trainer::counted;
use kiln_runtime::train::{Clip, Recipe, RecipeFile, StepLog, Trainer};
use kiln_runtime::{Checkpoint, read_tensors, write_tensors};
use serde_json::json;
use signal_hook::consts::{SIGINT, SIGTERM};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// `--objective`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ObjectiveArg {
    /// Next-token prediction.
    Causal,
    /// Masked-token prediction (15% of tokens; 80% masked, 10% random, 10% kept).
    Masked,
    /// Teacher-forced targets from sources (JSONL `source`/`target`).
    Seq2seq,
}

/// Arguments of `kiln train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// A spec (TOML), or a checkpoint (a Hugging Face model directory or a GGUF file) whose spec
    /// is imported and whose weights are the starting point. Several: variants trained one after
    /// the other on the same data, seed and batches, `-o` a directory that gets each one's
    /// weights and log (named after the spec) and `curves.svg`, their loss curves together.
    #[arg(required = true, num_args = 1..)]
    models: Vec<PathBuf>,
    /// The starting weights (safetensors, or GGUF, dequantized), under the names the spec's
    /// weight map gives (default: MODEL's, if a checkpoint or a fetched built-in model; else the
    /// spec's `weights.path`; else drawn as its `[init]` says).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Pre-batched data (safetensors): `input_ids`, `labels` (-100 where no loss is taken) and,
    /// where the model reads them, `attention_mask`, `token_type_ids`, `src_ids`, `src_mask`,
    /// `decoder_input_ids`, each `[steps, batch, seq]`, trained on in order; and an evaluation
    /// batch under the same names prefixed `eval_`.
    #[arg(long, conflicts_with = "data")]
    batches: Option<PathBuf>,
    /// Text to train on: a text file, a directory of `.txt`/`.md` files (a document each) or a
    /// JSONL file (`text`, or `source`/`target` pairs), tokenized once (and cached) with the
    /// model's tokenizer; random windows of `seq` tokens, seeded, a validation split held out.
    #[arg(long, num_args = 1..)]
    data: Vec<PathBuf>,
    /// The tokenizer for `--data`: a `tokenizer.json` or a GGUF file (default: the one beside a
    /// checkpoint given as MODEL, else bytes: ids 0..=255).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The objective for `--data` (default: `causal` for a decoder, `masked` for an encoder,
    /// `seq2seq` for an encoder-decoder).
    #[arg(long, value_enum)]
    objective: Option<ObjectiveArg>,
    /// The recipe (over the spec's `[train]` section): a TOML or JSON file with `steps, batch, seq, lr, min_lr, warmup_steps, betas,
    /// eps, weight_decay, clip, frozen, label_smoothing, optimizer, momentum, schedule,
    /// accumulate, decay_1d, eval_every, checkpoint_every, recompute, memory_budget` (flags below
    /// override it).
    #[arg(long)]
    recipe: Option<PathBuf>,
    /// Steps (optimizer updates).
    #[arg(long)]
    steps: Option<usize>,
    /// Sequences per micro-batch.
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (`--data`).
    #[arg(long)]
    seq: Option<usize>,
    /// Micro-batches per step, their gradients averaged (weighted by the tokens each counts).
    #[arg(long)]
    accumulate: Option<usize>,
    /// The seed of the data's windows and masks.
    #[arg(long)]
    seed: Option<u64>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Learning rate at the end of the decay.
    #[arg(long)]
    min_lr: Option<f64>,
    /// Steps of linear warm-up.
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// Global gradient-norm clipping (`none` for no clipping).
    #[arg(long)]
    clip: Option<String>,
    /// Label smoothing.
    #[arg(long)]
    label_smoothing: Option<f64>,
    /// Tensors or parameters to keep fixed: names or globs (`model.embed_tokens.*`); repeatable.
    #[arg(long)]
    frozen: Vec<String>,
    /// Evaluate on the `eval_` batch every N steps (and always after the last).
    #[arg(long)]
    eval_every: Option<usize>,
    /// Write a checkpoint every N steps (and always after the last).
    #[arg(long)]
    checkpoint_every: Option<usize>,
    /// Where to write one JSON line per step (`step`, `loss`, `grad_norm`, `lr`, `tokens`,
    /// `seconds`), a line per evaluation (`step`, `eval_loss`), and last the final `eval_loss`.
    #[arg(long)]
    log: Option<PathBuf>,
    /// Where to write the trained weights (safetensors, under the checkpoint's tensor names); the
    /// training state goes beside it (`.state.safetensors`). With several models, a directory.
    #[arg(short, long)]
    output: PathBuf,
    /// Stop after this many steps (of the recipe's) with a checkpoint, to continue later with
    /// `--resume`: the run goes on as if it had not stopped (the schedule is the whole run's).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Continue the run whose checkpoint this is (weights, and the state beside them).
    #[arg(long, conflicts_with = "weights")]
    resume: Option<PathBuf>,
    /// Recompute the activations of blocks in the backward instead of keeping them from the
    /// forward: `all`, `none`, or a number of blocks (the cheapest to recompute for the memory
    /// they free). Slower steps, less memory (`kiln check` shows both).
    #[arg(long)]
    recompute: Option<Recompute>,
    /// Recompute the fewest blocks that bring a step's memory (weights, gradients, optimizer
    /// state, activations, as `kiln check` counts them) within this: `4GiB`, `800MB`, bytes.
    #[arg(long, conflicts_with = "recompute")]
    memory_budget: Option<Bytes>,
    /// Where the training step runs: the native CPU kernels (`cpu`, the default), the reference
    /// interpreter (`interp`) or the WGSL kernels on a GPU adapter (`wgpu`).
    #[arg(long, value_parser = crate::exec::BackendParser, default_value = "cpu")]
    backend: Backend,
    /// Threads of the CPU backend (default: one per core available).
    #[arg(long)]
    threads: Option<usize>,
}

impl TrainArgs {
    /// The (first) model file.
    pub fn model(&self) -> &Path {
        self.models.first().map_or(Path::new(""), PathBuf::as_path)
    }

    /// The recipe: the spec's `[train]` (`declared`), then the `--recipe` file's keys over it,
    /// then the flags over both.
    fn recipe(&self, declared: Option<RecipeFile>) -> Result<Recipe> {
        let file = match &self.recipe {
            Some(path) => RecipeFile::from_path(path)?,
            None => RecipeFile::default(),
        };
        let file = declared.unwrap_or_default().merge(file);
        let clip = match self.clip.as_deref() {
            None => None,
            Some("none" | "off") => Some(Clip::Off),
            Some(v) => Some(Clip::Norm(v.parse().map_err(|_| anyhow!("--clip {v}: a number, or `none`"))?)),
        };
        let flags = RecipeFile {
            steps: self.steps,
            batch: self.batch,
            seq: self.seq,
            accumulate: self.accumulate,
            seed: self.seed,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            clip,
            label_smoothing: self.label_smoothing,
            frozen: (!self.frozen.is_empty()).then(|| self.frozen.clone()),
            eval_every: self.eval_every,
            checkpoint_every: self.checkpoint_every,
            recompute: self.recompute,
            memory_budget: self.memory_budget,
            ..RecipeFile::default()
        };
        Ok(file.merge(flags).resolve()?)
    }
}

/// The training state's file beside the weights at `weights`.
pub fn state_path(weights: &Path) -> PathBuf {
    let stem = weights.file_stem().map_or_else(|| "checkpoint".into(), |s| s.to_string_lossy().into_owned());
    weights.with_file_name(format!("{stem}.state.safetensors"))
}

/// Set by Ctrl-C (or SIGTERM): the run ends after the step under way, with a checkpoint; a
/// second one ends the process at once. Registered once per process.
fn interrupted() -> Result<Arc<AtomicBool>> {
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    if let Some(flag) = FLAG.get() {
        return Ok(flag.clone());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 130, flag.clone())?;
        signal_hook::flag::register(signal, flag.clone())?;
    }
    Ok(FLAG.get_or_init(|| flag).clone())
}

/// Runs `kiln train`: one model, or several compared.
pub fn run(args: TrainArgs, reporter: &Reporter) -> Result<()> {
    let [model] = args.models.as_slice() else { return compare(&args, reporter) };
    train_one(&args, model, &args.output, args.log.as_deref(), reporter).map(drop)
}

/// Several variants trained one after another into the directory `-o`, each on the same data,
/// seed and batches; then their curves drawn together.
fn compare(args: &TrainArgs, reporter: &Reporter) -> Result<()> {
    if args.resume.is_some() || args.stop_after.is_some() {
        bail!("--resume and --stop-after continue one run: give one model");
    }
    let dir = &args.output;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot make the directory `{}`", dir.display()))?;
    let mut stems: Vec<String> = Vec::new();
    for model in &args.models {
        let stem = model.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        if stems.contains(&stem) {
            bail!("two models are named `{stem}`: their outputs would share a name in `{}`", dir.display());
        }
        stems.push(stem);
    }
    let mut logs = Vec::new();
    for (model, stem) in args.models.iter().zip(&stems) {
        reporter.info(format_args!("training {}", model.display()));
        let log = dir.join(format!("{stem}.jsonl"));
        train_one(args, model, &dir.join(format!("{stem}.safetensors")), Some(&log), reporter)
            .with_context(|| format!("training `{}`", model.display()))?;
        logs.push(log);
    }
    let runs = logs.iter().map(|l| crate::curves::Run::read(l)).collect::<Result<Vec<_>>>()?;
    let svg = dir.join("curves.svg");
    let window = (args.steps.unwrap_or(0) / 50).max(1);
    kiln_compiler::file::write_atomic(&svg, crate::curves::svg(&runs, "training loss", window).as_bytes())
        .with_context(|| format!("cannot write `{}`", svg.display()))?;
    for run in &runs {
        let last = run.eval.last().map_or(String::new(), |e| format!("evaluation loss {:.4}", e.1));
        reporter.info(format_args!("{:24} {last}", run.name));
    }
    reporter.info(format_args!("curves: {}", svg.display()));
    Ok(())
}

/// Trains `model` with `args`, writing the weights to `output` and the log to `log`; returns
/// the final evaluation loss, if there is evaluation data.
fn train_one(
    args: &TrainArgs,
    model: &Path,
    output: &Path,
    log: Option<&Path>,
    reporter: &Reporter,
) -> Result<Option<f64>> {
    for path in [Some(output), log].into_iter().flatten() {
        kiln_compiler::file::check_writable(path).with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    let fe = load_spec(model)?;
    let mut recipe = args.recipe(fe.spec.spec.train.clone())?;
    let mut feed = feed(args, model, &fe, &recipe, reporter)?;
    if recipe.memory_budget.is_some() && recipe.seq.is_none() {
        // The budget is met at the length the data comes in.
        recipe.seq = feed.seq();
    }
    // A checkpoint's own weights, a fetched built-in model's, or those the spec records.
    let brought = match (&args.resume, &args.weights) {
        (None, None) => crate::model_file::default_weights(model)?,
        _ => None,
    };
    // Neither the weights nor the log may replace a file the run reads (`--resume` continues
    // into its own checkpoint, and a later run may write over an earlier one's output).
    let mut read: Vec<(&str, &Path)> = vec![("the model", model)];
    read.extend(args.weights.as_deref().map(|w| ("--weights", w)));
    read.extend(brought.as_deref().map(|w| ("the model's weights", w)));
    read.extend(args.batches.as_deref().map(|b| ("--batches", b)));
    read.extend(args.data.iter().map(|d| ("--data", d.as_path())));
    read.extend(args.tokenizer.as_deref().map(|t| ("--tokenizer", t)));
    read.extend(args.recipe.as_deref().map(|r| ("--recipe", r)));
    crate::output::check("-o", output, &read, true)?;
    if let Some(log) = log {
        crate::output::check("--log", log, &read, true)?;
    }
    let tensors: HashMap<String, Tensor> = match (&args.resume, &args.weights) {
        (Some(path), _) => Checkpoint::open(path)?.all()?,
        (None, Some(path)) => Checkpoint::open(path)?.all()?,
        (None, None) if brought.is_some() => Checkpoint::open(&weights_for(brought, model)?)?.all()?,
        (None, None) => {
            for line in init::describe(&fe.spec) {
                reporter.info(format_args!("init: {line}"));
            }
            init::initialize(&fe.spec, &fe.graph)?.into_iter().collect()
        }
    };
    let device = training_device(args.backend, args.threads)?;
    let mut trainer = reporter.stage("building the training graph", || {
        Trainer::new(device, &fe.graph, &fe.spec.weights, &PackDims::of(&fe.spec), recipe.clone(), tensors)
            .map_err(Box::new)
    })?;
    if let (recomputed @ 1.., blocks) = trainer.recomputed() {
        reporter.info(format_args!("recomputing the activations of {recomputed} of {blocks} blocks in the backward"));
    }
    if let Some(path) = &args.resume {
        let state = read_tensors(&state_path(path))
            .with_context(|| format!("--resume: the training state beside `{}`", path.display()))?;
        trainer.load_state(&state)?;
        feed.restore(&state)?;
    }
    let mut log = match log {
        Some(path) => Some(Log::open(path, trainer.steps_done())?),
        None => None,
    };
    let eval_batches = feed.eval()?;
    let evaluate = |trainer: &mut Trainer| -> Result<Option<f64>> {
        if eval_batches.is_empty() {
            return Ok(None);
        }
        let (mut sum, mut n) = (0.0, 0u64);
        for b in &eval_batches {
            let c = counted(b);
            sum += trainer.eval(b)? * c as f64;
            n += c;
        }
        Ok(Some(sum / n.max(1) as f64))
    };
    let interrupted = interrupted()?;
    let bar = reporter.steps(recipe.steps as u64, trainer.steps_done() as u64);
    let started = Instant::now();
    let first = trainer.steps_done();
    let mut tokens = 0u64;
    let end = args.stop_after.map_or(recipe.steps, |n| n.min(recipe.steps));
    while trainer.steps_done() < end {
        let s = trainer.steps_done();
        let t0 = Instant::now();
        let micro = feed.step(s, recipe.accumulate)?;
        let logged = match trainer.step(&micro) {
            Ok(l) => l,
            Err(e) => {
                // The step changed nothing: the weights before it are the last good ones.
                let saved = save(&mut trainer, &feed, output).map(|()| output.display().to_string());
                return Err(anyhow!(e).context(match saved {
                    Ok(path) => format!("training stopped; the weights before step {s} are in `{path}`"),
                    Err(_) => "training stopped".to_string(),
                }));
            }
        };
        tokens += logged.tokens;
        if let Some(log) = &mut log {
            log.step(&logged, t0.elapsed().as_secs_f64())?;
        }
        let done = trainer.steps_done();
        let last = done == recipe.steps;
        let eval_loss = match recipe.eval_every {
            Some(n) if done.is_multiple_of(n) && !last => evaluate(&mut trainer)?,
            _ => None,
        };
        if let (Some(log), Some(l)) = (&mut log, eval_loss) {
            log.line(&json!({ "step": done, "eval_loss": l }))?;
        }
        let rate = tokens as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.show(done as u64, &progress_message(&logged, eval_loss, rate));
        if recipe.checkpoint_every.is_some_and(|n| done.is_multiple_of(n)) && !last {
            save(&mut trainer, &feed, output)?;
        }
        if done == end && !last {
            bar.finish();
            save(&mut trainer, &feed, output)?;
            reporter.info(format_args!(
                "stopped after step {done} of {}; continue with `--resume {}`",
                recipe.steps,
                output.display()
            ));
            return Ok(None);
        }
        if interrupted.load(Ordering::Relaxed) && !last {
            bar.finish();
            save(&mut trainer, &feed, output)?;
            bail!(
                "interrupted after step {done} of {}: the checkpoint is in `{}`; continue with `--resume {}`",
                recipe.steps,
                output.display(),
                output.display()
            );
        }
    }
    bar.finish();
    let eval_loss = evaluate(&mut trainer)?;
    if let (Some(log), Some(l)) = (&mut log, eval_loss) {
        log.line(&json!({ "eval_loss": l }))?;
    }
    save(&mut trainer, &feed, output)?;
    let seconds = started.elapsed().as_secs_f64();
    reporter.info(format_args!(
        "trained steps {}..{} in {seconds:.1} s ({:.0} tokens/s){}; weights: {}",
        first + 1,
        recipe.steps,
        tokens as f64 / seconds.max(1e-9),
        eval_loss.map_or(String::new(), |l| format!(", eval loss {l:.4}")),
        output.display()
    ));
    Ok(eval_loss)
}

/// Where the run's batches come from: `--batches`, or `--data` read with the model's tokenizer
/// and prepared for its objective.
fn feed(
    args: &TrainArgs,
    model: &Path,
    fe: &kiln_compiler::FrontEnd,
    recipe: &Recipe,
    reporter: &Reporter,
) -> Result<Feed> {
    match (&args.batches, &args.data) {
        (Some(path), _) => {
            let batches = Batches::new(read_tensors(path)?).with_context(|| format!("batches `{}`", path.display()))?;
            batches.check_steps(recipe.steps).with_context(|| format!("batches `{}`", path.display()))?;
            Ok(Feed::Batches(batches))
        }
        (None, data) if !data.is_empty() => {
            let corpus = open_corpus(data, args.tokenizer.as_deref(), model, fe, recipe, args.objective)?;
            reporter.info(format_args!(
                "data: {} tokens in {} documents ({}), {} validation windows",
                corpus.tokens(),
                corpus.items(),
                if corpus.reused() { "tokenized before" } else { "tokenized now" },
                corpus.split_windows(Split::Validation)
            ));
            Ok(Feed::Corpus { corpus: Box::new(corpus), batch: recipe.batch, eval_batches: recipe.eval_batches })
        }
        _ => bail!("give the data: --data FILE|DIR|JSONL (text), or --batches FILE (pre-batched)"),
    }
}

/// `data` tokenized with the model's tokenizer (`tokenizer`, or the one beside a checkpoint, or
/// bytes) as windows of the recipe's `seq` (default: the model's positions, at most 256) for
/// `objective` (default: the model's kind's: next-token for a decoder, masked tokens for an
/// encoder, teacher-forced targets for an encoder-decoder).
pub fn open_corpus(
    data: &[PathBuf],
    tokenizer: Option<&Path>,
    model: &Path,
    fe: &kiln_compiler::FrontEnd,
    recipe: &Recipe,
    objective: Option<ObjectiveArg>,
) -> Result<Corpus> {
    let encoder: Box<dyn TextEncoder> = match tokenizer {
        Some(path) => tokenizer_beside(path)?,
        None if kiln_runtime::import::is_checkpoint(model) => tokenizer_beside(model)?,
        None => Box::new(ByteTokenizer),
    };
    let vocab = fe.spec.spec.model.vocab as usize;
    // A tokenizer that can make ids the model has no row for is the wrong tokenizer, even where
    // this corpus happens not to use them.
    check_vocab(encoder.vocab_size(), vocab).with_context(|| format!("the {}", encoder.describe()))?;
    let kind = fe.spec.spec.model.kind;
    let objective = match objective.unwrap_or(match kind {
        BlockKind::Decoder => ObjectiveArg::Causal,
        BlockKind::Encoder => ObjectiveArg::Masked,
        BlockKind::EncoderDecoder => ObjectiveArg::Seq2seq,
    }) {
        ObjectiveArg::Causal => Objective::Causal,
        ObjectiveArg::Masked => {
            let mask_id = ["[MASK]", "<mask>"].iter().find_map(|t| encoder.token_id(t)).ok_or_else(|| {
                anyhow!(
                    "masked-token training needs a mask token: the {} has no `[MASK]` or `<mask>`",
                    encoder.describe()
                )
            })?;
            Objective::Masked { prob: 0.15, mask_id }
        }
        ObjectiveArg::Seq2seq => Objective::Seq2Seq { start_id: encoder.pad_id() },
    };
    let max = fe.spec.spec.model.max_positions as usize;
    let seq = recipe.seq.unwrap_or(max.min(256));
    if seq > max {
        bail!("recipe: `seq` = {seq} is longer than the model's {max} positions");
    }
    let options = CorpusOptions { seed: recipe.seed, ..CorpusOptions::new(seq, objective) };
    let corpus = Corpus::open(data, encoder.as_ref(), options)?;
    corpus.check_vocab(vocab)?;
    Ok(corpus)
}

/// The bar's message after a step.
fn progress_message(step: &StepLog, eval_loss: Option<f64>, tokens_per_s: f64) -> String {
    let eval = eval_loss.map_or(String::new(), |l| format!(" eval {l:.4}"));
    format!("loss {:.4}{eval} lr {:.2e} {:.0} tok/s", step.loss, step.lr, tokens_per_s)
}

/// Writes the trainer's weights to `path` and its state (the optimizer's, the step, the
/// position in the data) beside them, each atomically.
fn save(trainer: &mut Trainer, feed: &Feed, path: &Path) -> Result<()> {
    let mut weights: Vec<(String, Tensor)> = trainer.tensors()?.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    // The state first: weights without their state are still a checkpoint `run` reads; a state
    // without its weights is not.
    let mut state = trainer.state()?;
    state.extend(feed.state());
    write_tensors(&state_path(path), &state)?;
    write_tensors(path, &weights)?;
    Ok(())
}

/// The per-step log: a JSON line per step, evaluation and summary.
struct Log {
    out: AppendLog,
    path: PathBuf,
}

impl Log {
    /// The log at `path` for a run that starts at step `from`: a new one (`from` 0), or the log a
    /// resumed run continues, cut to the lines of the steps before `from` (a checkpoint may be
    /// older than the last lines logged, which the resumed run logs again).
    fn open(path: &Path, from: usize) -> Result<Log> {
        let kept = match from {
            0 => String::new(),
            _ => std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    let v: Option<serde_json::Value> = serde_json::from_str(l).ok();
                    let step = v.as_ref().and_then(|v| v.get("step")).and_then(serde_json::Value::as_u64);
                    // A step line counts its step from 0; an evaluation, the steps done before it.
                    match (step, v.as_ref().and_then(|v| v.get("loss"))) {
                        (Some(s), Some(_)) => (s as usize) < from,
                        (Some(s), None) => (s as usize) <= from,
                        (None, _) => false,
                    }
                })
                .map(|l| format!("{l}\n"))
                .collect(),
        };
        kiln_compiler::file::write_atomic(path, kept.as_bytes())
            .with_context(|| format!("cannot write the log `{}`", path.display()))?;
        let out = AppendLog::open(path).with_context(|| format!("cannot open the log `{}`", path.display()))?;
        Ok(Log { out, path: path.into() })
    }

    fn step(&mut self, s: &StepLog, seconds: f64) -> Result<()> {
        self.line(&json!({
            "step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr, "tokens": s.tokens, "seconds": seconds
        }))
    }

    /// Each line is on disk as it is made: a run stopped midway keeps its log.
    fn line(&mut self, v: &serde_json::Value) -> Result<()> {
        self.out.line(&v.to_string()).with_context(|| format!("cannot write the log `{}`", self.path.display()))
    }
}
