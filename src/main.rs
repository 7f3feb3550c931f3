//! `kiln`: the command-line tool. Each subcommand is a thin layer over the compiler and runtime
//! crates; errors are printed (specs with their source line) and the exit code is non-zero.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use kiln_compiler::artifact;
use kiln_compiler::diag::SpecError;
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, lower, optimize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod bench;
mod costs;
mod diagnose;
mod diff;
mod embed;
mod generate;
mod html;
mod import;
mod inspect;
mod progress;
mod report;
mod run;
mod storage;
mod view;

use progress::Reporter;

#[derive(Parser)]
#[command(name = "kiln", version, about = "A declarative model-graph compiler for Transformer models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// No progress bars and no informational lines on stderr (errors are still printed).
    #[arg(short, long, global = true)]
    quiet: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a spec and print a summary (parameters, FLOPs per token, graph size).
    Check {
        /// The spec (TOML), or an artifact from `kiln compile` (the spec it stores).
        spec: PathBuf,
        /// Sequence length at which FLOPs per token are counted (1 to `max_positions`; default
        /// 128, or `max_positions` if smaller).
        #[arg(long)]
        seq: Option<usize>,
        /// Also read every parameter from this checkpoint (safetensors or GGUF) through the weight
        /// map and check it as a run would, without running; warn about the checkpoint's tensors
        /// the spec never reads.
        #[arg(long)]
        weights: Option<PathBuf>,
        /// Print one JSON document on stdout instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a stage of the compiled model (text, DOT, SVG or PNG), optimizer statistics, or an
    /// HTML report.
    Inspect(inspect::InspectArgs),
    /// Write the spec of a checkpoint (a Hugging Face model directory or a GGUF file), each value
    /// noting where it came from, and check it against the checkpoint's tensors.
    Import(import::ImportArgs),
    /// Compare two variants of a model (specs or artifacts): ops added, removed and changed per
    /// block, parameters, FLOPs per token, dispatches and intermediate bytes.
    Diff(diff::DiffArgs),
    /// Compile a spec into a runnable artifact (plan + spec + weight map; weights stay in their files).
    Compile {
        /// The spec (TOML).
        spec: PathBuf,
        /// Where to write the artifact.
        #[arg(short, long)]
        output: PathBuf,
        /// Lower the graph as built, without the e-graph optimizer.
        #[arg(long)]
        no_optimize: bool,
        /// The backend whose cost model and limits the optimizer extracts for (the artifact runs on
        /// any backend; `auto`: a hardware GPU when this machine has one, else `cpu`).
        #[arg(long = "for", value_enum, default_value_t = Backend::Wgpu)]
        target: Backend,
        /// Print one JSON document on stdout instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a model on inputs (a safetensors file, or ids given inline) with a checkpoint's
    /// weights or random ones, and write its outputs to a safetensors file.
    Run(run::RunArgs),
    /// Generate tokens from a decoder with a key/value cache, streaming them as they come.
    Generate {
        /// The spec (TOML), an artifact from `kiln compile` (the spec it stores: generation runs
        /// the decoder's step graph with its key/value cache, built from it), or a checkpoint (a
        /// Hugging Face model directory or a GGUF file) whose spec is imported in memory.
        spec: PathBuf,
        /// Checkpoint (safetensors or GGUF); default: SPEC's, if a checkpoint.
        #[arg(long)]
        weights: Option<PathBuf>,
        /// The prompt text (tokenized with `--tokenizer`, or the GGUF weights' own tokenizer).
        #[arg(long, required_unless_present = "prompt_ids", conflicts_with = "prompt_ids")]
        prompt: Option<String>,
        /// Wrap the prompt as a user message in the tokenizer's chat template.
        #[arg(long, requires = "prompt")]
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
        sampling: generate::SamplingArgs,
        /// Stop after any of these token ids, comma-separated.
        #[arg(long, value_delimiter = ',')]
        stop_ids: Vec<i64>,
        /// Print one JSON document on stdout at the end instead of streaming (ids, text, why
        /// generation stopped, tokens/s).
        #[arg(long, conflicts_with = "print_ids")]
        json: bool,
        #[command(flatten)]
        exec: Exec,
    },
    /// Embed sentences with an encoder spec that pools (`outputs.pooling = "mean"`) and print the
    /// vectors.
    Embed(embed::EmbedArgs),
    /// Measure (never a test): forward time of a spec unoptimized vs optimized on wgpu, side by
    /// side; or the optimizer's time at several depths; or the cost model's constants.
    Bench {
        /// The spec (random weights). Default: a GPT-2-small-sized decoder
        /// (`benches/specs/gpt2-small.toml`, built into kiln, so any directory will do).
        spec: Option<PathBuf>,
        /// Tokens per sequence.
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Sequences per batch.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Timed runs per variant (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Instead: time the optimizer on the spec at these depths (`--optimize-layers 30,96`).
        #[arg(long, value_delimiter = ',')]
        optimize_layers: Vec<u32>,
        /// Instead: measure the cost model's constants on the adapter.
        #[arg(long)]
        calibrate: bool,
        /// Instead: generation with the key/value cache, a prompt of `--seq` tokens then this many
        /// decode steps (prefill and decode tok/s, optimized graph).
        #[arg(long)]
        decode: Option<usize>,
        /// Time the optimized graph only (no unoptimized run beside it).
        #[arg(long)]
        optimized_only: bool,
        /// After the timed runs, time every step of each plan (unoptimized and optimized) by
        /// itself and print the time by op: where a forward pass spends it (wgpu: each dispatch,
        /// between device timestamps where the adapter has them).
        #[arg(long)]
        profile: bool,
        /// Real weights (safetensors or GGUF) instead of random ones.
        #[arg(long)]
        weights: Option<PathBuf>,
        /// Instead: GFLOPS of the projection kernels, reference vs fast, at prefill and decode
        /// shapes.
        #[arg(long)]
        kernels: bool,
        /// Instead: time and GFLOPS of the fused causal attention kernel at prefill shapes (MHA
        /// and grouped-query, sequences 128 to 1024), and block-sparse (BigBird) against dense
        /// bidirectional attention per token from 256 to 4096 tokens.
        #[arg(long)]
        attention: bool,
        /// Instead: a summary table over `--models` at `--seqs` (forward ms, tok/s, decode tok/s,
        /// dispatches, device memory) and the kernels' GFLOPS.
        #[arg(long)]
        table: bool,
        /// Specs of `--table`. Default: `benches/specs/gpt2-small.toml`, `models/smollm2-135m.toml`
        /// and `models/minilm-l6.toml` (built into kiln, so any directory will do).
        #[arg(long, value_delimiter = ',')]
        models: Vec<PathBuf>,
        /// Sequence lengths of `--table`.
        #[arg(long, value_delimiter = ',', default_value = "32,128")]
        seqs: Vec<usize>,
        /// Backend measured (as for `run`).
        #[arg(long, value_enum, default_value_t = Backend::Auto)]
        backend: Backend,
        /// GPU adapter (as for `run`).
        #[arg(long)]
        adapter: Option<String>,
        /// Threads of the CPU backend (as for `run`).
        #[arg(long)]
        threads: Option<usize>,
        #[command(flatten)]
        storage: storage::WeightArgs,
        /// Print one JSON document on stdout instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Where and how a model runs (`run`, `generate`, `embed`).
#[derive(clap::Args)]
struct Exec {
    /// Execution backend (default: a GPU adapter when the machine has one, else the native CPU
    /// kernels; lavapipe's software Vulkan only when asked for with `wgpu`).
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// GPU adapter to use: part of its name, or discrete / integrated / cpu (default: the
    /// `KILN_ADAPTER` environment variable, else the best adapter found). Implies `--backend wgpu`
    /// when no backend is named.
    #[arg(long)]
    adapter: Option<String>,
    /// Threads of the CPU backend (default: one per core available).
    #[arg(long)]
    threads: Option<usize>,
    /// Run the graph as built, without the e-graph optimizer.
    #[arg(long)]
    no_optimize: bool,
    /// Print the spec that runs (a checkpoint's imported spec) on stderr first.
    #[arg(long)]
    print_spec: bool,
    #[command(flatten)]
    weights: storage::WeightArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The fastest present: a hardware GPU adapter when there is one, else `cpu`.
    Auto,
    /// Native kernels on the host's cores (multithreaded; quantized weights kept as blocks).
    Cpu,
    /// Generated WGSL kernels on a GPU adapter through wgpu (lavapipe on machines without a GPU).
    Wgpu,
    /// The CPU reference interpreter.
    Interp,
}

impl Backend {
    /// The backend `self` stands for: `auto` resolved (to `wgpu` when an adapter is named, with
    /// `--adapter` or `KILN_ADAPTER`, or a hardware GPU is present; else `cpu`), said on stderr
    /// through `reporter` unless `json` output keeps stderr clean.
    fn resolve(self, adapter: Option<&str>, threads: usize, reporter: &Reporter, json: bool) -> Backend {
        if self != Backend::Auto {
            return self;
        }
        let named =
            adapter.map(str::to_string).or_else(|| std::env::var("KILN_ADAPTER").ok()).filter(|a| !a.is_empty());
        let (backend, why) = match (named, kiln_runtime::Gpu::hardware_adapter()) {
            (Some(a), _) => (Backend::Wgpu, format!("adapter `{a}` asked for")),
            (None, Some(gpu)) => (Backend::Wgpu, format!("GPU `{gpu}`")),
            (None, None) => (Backend::Cpu, format!("no GPU adapter; {threads} threads")),
        };
        if !json {
            reporter.info(format_args!("backend: {} ({why})", backend.name()));
        }
        backend
    }

    /// What the optimizer compiles for on this (resolved) backend: the CPU's cost model and limits
    /// for `cpu`; for `wgpu`, the cost model of the adapter `adapter` selects (cached by
    /// `costs`, calibrated at a hardware adapter's first use); the interpreter runs any graph and
    /// gets wgpu's built-in target, as artifacts do.
    fn optimizer_target(self, adapter: Option<&str>, reporter: &Reporter) -> Result<kiln_compiler::target::Target> {
        Ok(match self {
            Backend::Cpu => kiln_compiler::target::Target::cpu(),
            Backend::Wgpu => costs::wgpu_target(adapter, reporter)?,
            Backend::Auto | Backend::Interp => kiln_compiler::target::Target::wgpu(),
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Cpu => "cpu",
            Backend::Wgpu => "wgpu",
            Backend::Interp => "interp",
        }
    }
}

impl Exec {
    /// Threads of the CPU backend.
    fn threads(&self) -> Result<usize> {
        threads_or_default(self.threads)
    }
}

/// `--threads`, checked, or one per available core.
fn threads_or_default(threads: Option<usize>) -> Result<usize> {
    match threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) if n > 1024 => bail!("--threads {n} is more than 1024"),
        Some(n) => Ok(n),
        None => Ok(kiln_runtime::cpu::default_threads()),
    }
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`kiln inspect ... | head`) like other command-line tools,
    // instead of panicking on the next write.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // kiln ranks the adapters itself (`Gpu::new`, `--adapter`). Mesa's implicit device-select layer
    // only reorders them, and on a machine without a display session it prints "XDG_RUNTIME_DIR is
    // invalid" to stderr twice while probing for Wayland, which reads like an error from kiln and
    // spoils `--json --quiet` output. Turn the layer off unless the user has set its switch.
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        // SAFETY: no other thread exists yet, so nothing can read the environment concurrently.
        unsafe { std::env::set_var("NODEVICE_SELECT", "1") };
    }
    let cli = Cli::parse();
    let spec = spec_of(&cli.command).map(Path::to_path_buf);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            match err.downcast_ref::<SpecError>() {
                Some(spec_error) => eprint!("{}", spec_error.render()),
                None => match spec.and_then(|spec| diagnose::weight_error(&err, &spec)) {
                    Some(located) => eprint!("{located}"),
                    None => eprintln!("error: {err:#}"),
                },
            }
            ExitCode::FAILURE
        }
    }
}

/// The spec (or artifact) file a command reads weights for, if any.
fn spec_of(command: &Command) -> Option<&Path> {
    match command {
        Command::Run(args) => Some(args.model()),
        Command::Generate { spec, .. } => Some(spec),
        Command::Bench { spec, .. } => spec.as_deref(),
        Command::Embed(args) => Some(args.spec()),
        Command::Check { spec, weights: Some(_), .. } => Some(spec),
        Command::Check { .. }
        | Command::Inspect { .. }
        | Command::Compile { .. }
        | Command::Import(_)
        | Command::Diff(_) => None,
    }
}

fn load_spec(path: &Path) -> Result<FrontEnd> {
    Ok(read_spec(path)?.1)
}

/// Reads a spec file and runs the front end; returns the source too. An artifact from `kiln
/// compile` (told by its magic) stands for the spec it stores; a checkpoint directory or GGUF file
/// for its imported spec.
fn read_spec(path: &Path) -> Result<(String, FrontEnd)> {
    if artifact::Artifact::sniff(path) {
        let art = artifact::Artifact::read(path)?;
        let fe = kiln_compiler::front_end(&art.spec_file, &art.spec_source)?;
        return Ok((art.spec_source, fe));
    }
    let (source, label) = import::spec_text(path)?;
    let fe = kiln_compiler::front_end(&label, &source)?;
    Ok((source, fe))
}

/// The parameters a plan needs, with their shapes.
fn plan_params(plan: &lower::Plan) -> Vec<(String, Vec<usize>)> {
    plan.values
        .iter()
        .filter_map(|v| match &v.storage {
            lower::Storage::Param(name) => Some((name.clone(), lower::resolve(&v.shape, &HashMap::new()))),
            _ => None,
        })
        .collect()
}

/// Runs a compiled plan (an artifact's: its weights are f32) on wgpu.
fn run_plan_wgpu(
    plan: lower::Plan,
    params: &HashMap<String, Tensor>,
    given: &HashMap<String, Tensor>,
    adapter: Option<&str>,
    reporter: &Reporter,
) -> Result<Vec<(String, Tensor)>> {
    let gpu = std::sync::Arc::new(kiln_runtime::Gpu::new(adapter)?);
    let options = gpu.options();
    let model = kiln_runtime::GpuModel::with_progress(gpu, &plan, &options, params, &HashMap::new(), reporter)?;
    Ok(model.run(given)?)
}

/// Lowers `graph` and runs it on `backend` (wgpu or cpu), its weights stored as `exec` says
/// (quantized blocks kept by default).
fn run_compiled(
    spec: &kiln_compiler::spec::Resolved,
    graph: &kiln_compiler::graph::Graph,
    ckpt: &kiln_runtime::Checkpoint,
    given: &HashMap<String, Tensor>,
    exec: &Exec,
    backend: Backend,
    reporter: &Reporter,
) -> Result<Vec<(String, Tensor)>> {
    let target = storage::Target::new(backend, exec.adapter.as_deref(), exec.threads()?)?;
    let model = target.load(spec, graph, ckpt, exec.weights, reporter)?;
    Ok(model.run(given)?)
}

/// The named parameters from a checkpoint as f32, shown on `reporter`.
fn load_f32(
    map: &kiln_compiler::spec::WeightMap,
    dims: &PackDims,
    names: &[(String, Vec<usize>)],
    ckpt: &kiln_runtime::Checkpoint,
    reporter: &Reporter,
) -> Result<HashMap<String, Tensor>> {
    Ok(kiln_runtime::weights::load_named_with_progress(map, dims, names, ckpt, reporter)?)
}

fn run(cli: Cli) -> Result<()> {
    let reporter = Reporter::new(cli.quiet);
    import::print_specs(match &cli.command {
        Command::Run(args) => args.print_spec(),
        Command::Generate { exec, .. } => exec.print_spec,
        Command::Embed(args) => args.print_spec(),
        _ => false,
    });
    match cli.command {
        Command::Import(args) => import::run(args, &reporter)?,
        Command::Check { spec, seq, weights, json } => {
            let fe = load_spec(&spec)?;
            let seq = report::check_seq(&fe, seq)?;
            let weights = weights.map(|w| report::check_weights(&fe, &w, &reporter)).transpose()?;
            report::check(&spec, &fe, seq, weights.as_ref(), json)?
        }
        Command::Inspect(args) => inspect::run(args, &reporter)?,
        Command::Diff(args) => diff::run(args)?,
        Command::Compile { spec, output, no_optimize, target, json } => {
            kiln_compiler::file::check_writable(&output)
                .with_context(|| format!("cannot write the artifact to `{}`", output.display()))?;
            let (source, mut fe) = read_spec(&spec)?;
            if !no_optimize {
                let target = target.resolve(None, 1, &reporter, json).optimizer_target(None, &reporter)?;
                fe.graph = reporter.stage("optimizing", || optimize::optimize_for(&fe.graph, &target))?.0;
            }
            let artifact =
                reporter.stage("lowering", || artifact::compile(&spec.display().to_string(), &source, &fe))?;
            artifact.write(&output)?;
            report::compile(&output, &artifact.plan, !no_optimize, json)?;
        }
        Command::Run(args) => run::run(args, &reporter)?,
        Command::Generate {
            spec,
            weights,
            prompt,
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
        } => {
            let threads = exec.threads()?;
            let backend = exec.backend.resolve(exec.adapter.as_deref(), threads, &reporter, json);
            run::check_exec(&exec, backend)?;
            let Exec { adapter, no_optimize, weights: storage, .. } = exec;
            let fe = load_spec(&spec)?;
            let (weights, tokenizer) = (import::weights_for(weights, &spec)?, import::tokenizer_for(tokenizer, &spec));
            let sampling = sampling.resolve(chat, &weights)?;
            let text = prompt.as_deref().map(|text| generate::TextPrompt { text, chat, system: system.as_deref() });
            let req = generate::Request {
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
                (true, _) => generate::Output::Json,
                (false, true) => generate::Output::Ids,
                (false, false) => generate::Output::Text,
            };
            generate::run_cli(&fe, req, text, tokenizer.as_deref(), output, &reporter)?;
        }
        Command::Embed(args) => embed::run(args, &reporter)?,
        Command::Bench {
            spec,
            seq,
            batch,
            runs,
            optimize_layers,
            calibrate,
            decode,
            optimized_only,
            profile,
            weights,
            kernels,
            attention,
            table,
            models,
            seqs,
            backend,
            adapter,
            threads,
            storage,
            json,
        } => {
            let backend = backend.resolve(adapter.as_deref(), threads_or_default(threads)?, &reporter, json);
            if backend == Backend::Interp {
                bail!(
                    "kiln bench measures compiled plans: --backend cpu or wgpu (the interpreter is the oracle, not a target)"
                );
            }
            let target = storage::Target::new(backend, adapter.as_deref(), threads_or_default(threads)?)?;
            if calibrate {
                return bench::calibrate(&target, json);
            }
            if kernels {
                return bench::kernels(&target, runs, json);
            }
            if table {
                let specs = match models.is_empty() {
                    true => bench::BUILT_IN
                        .iter()
                        .map(|&(name, _)| Ok((name.to_string(), bench::built_in(name)?.1)))
                        .collect(),
                    false => models
                        .iter()
                        .map(|p| Ok((p.display().to_string(), read_spec(p)?.1)))
                        .collect::<Result<Vec<_>>>(),
                }?;
                return bench::table(&specs, &target, &seqs, runs, json);
            }
            if attention {
                return bench::attention_kernels(&target, runs, json);
            }
            let (name, (source, fe)) = match &spec {
                Some(path) => (path.display().to_string(), read_spec(path)?),
                None => (bench::BUILT_IN[0].0.to_string(), bench::built_in(bench::BUILT_IN[0].0)?),
            };
            if !optimize_layers.is_empty() {
                return bench::optimize_time(&source, &name, &optimize_layers, json);
            }
            if let Some(steps) = decode {
                return bench::decode(&fe, &target, weights.as_deref(), storage, seq, steps, runs, json);
            }
            bench::forward(&fe, &target, weights.as_deref(), storage, batch, seq, runs, optimized_only, json)?;
            if profile {
                bench::profile(&fe, &target, weights.as_deref(), storage, batch, seq, optimized_only)?;
            }
        }
    }
    Ok(())
}
