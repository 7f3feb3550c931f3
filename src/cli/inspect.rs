//! `kiln inspect`: a stage of the compiled model as text, DOT, SVG or PNG (drawn by Graphviz's
//! `dot` when it is installed), optimizer statistics, fusion explanations, or a self-contained
//! HTML report of all of them (`--html`, see [`crate::html`]).

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use kiln_compiler::back::wgsl;
use kiln_compiler::graph::{Graph, Op, Sym, print};
use kiln_compiler::{FrontEnd, lower, optimize};
use kiln_runtime::{Storage, Weights};
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::exec::Backend;
use crate::progress::Reporter;
use crate::view::{Stats, dot, explanations, graphviz};

/// `kiln inspect`'s arguments.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// The spec (TOML), or an artifact from `kiln compile` (its stored spec; `--stage wgsl`: its
    /// own plan).
    spec: PathBuf,
    /// Which stage to print (default: graph).
    #[arg(long, value_enum)]
    stage: Option<Stage>,
    /// Output format (default: text).
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Write to this file instead of standard output (never the spec; an existing file only
    /// with `--force`).
    #[arg(short, long)]
    output: Option<PathBuf>,
    #[command(flatten)]
    force: crate::output::Force,
    /// With `--format dot|svg|png` or `--html`: draw only these blocks (`0..2`, half-open, or
    /// `3` for one); each run of the other blocks is drawn as one summary node.
    #[arg(long, value_parser = parse_layers)]
    layers: Option<Range<usize>>,
    /// With `--stage optimized`: list every fused op with the rules that produced it.
    #[arg(long)]
    explain: bool,
    /// Print optimizer statistics instead of a stage (dispatches before/after, blocks,
    /// intermediate bytes, e-graph size, optimize time).
    #[arg(long)]
    stats: bool,
    /// With `--stats`: print one JSON document on stdout instead of text.
    #[arg(long, requires = "stats")]
    json: bool,
    /// Which graph: the whole model, or those `kiln generate` runs.
    #[arg(long, value_enum, default_value_t = Which::Model)]
    graph: Which,
    /// Instead: write one self-contained HTML page to this file: the spec, both graphs, the
    /// kernels (estimated bytes and FLOPs, and time with `--profile`), their WGSL, the fusion
    /// explanations and the optimizer statistics.
    #[arg(long, conflicts_with_all = ["stats", "explain", "output"])]
    html: Option<PathBuf>,
    /// With `--html`: training logs of this model (`kiln train --log`), drawn as loss curves in a
    /// section of the report.
    #[arg(long, requires = "html", num_args = 1..)]
    training: Vec<PathBuf>,
    /// With `--html`: run the optimized plan on the report's engine (`--backend`, as `kiln run`
    /// picks it: a hardware GPU, else the CPU) and time every step (the median of 5).
    #[arg(long, requires = "html")]
    profile: bool,
    /// With `--html --profile` on the CPU: threads (default: one per core).
    #[arg(long, requires = "profile")]
    threads: Option<usize>,
    /// With `--profile`: weights (safetensors or GGUF) instead of random ones (times do not depend
    /// on the values).
    #[arg(long, requires = "profile")]
    weights: Option<PathBuf>,
    /// With `--html`: tokens of the (batch 1) input that the whole report counts at: the
    /// kernels' bytes, FLOPs and times, and the optimizer's intermediate bytes (default 32). With
    /// `--stage wgsl`: the tokens each step's workgroups are counted at (batch 1; default 32, and
    /// for `--graph step` the tokens already cached before its one new token).
    #[arg(long)]
    seq: Option<usize>,
    /// With `--profile`: GPU adapter (as for `run`). With `--stage optimized` or `--stats`: the
    /// graph as optimized for that adapter's cost model (cached by `kiln bench calibrate` or its
    /// first use; the adapter need not be on this machine). With `--stage wgsl`: the program as
    /// compiled there (its features, and the forms `kiln tune` chose for these shapes on it).
    #[arg(long)]
    adapter: Option<String>,
    /// With `--stage optimized`, `--stats` or `--html`: the backend the optimized graph is
    /// extracted for (its cost model and kernel limits; default: as `kiln run` picks it), and the
    /// one the HTML report lists the kernels of and profiles. The `wgsl` stage is wgpu's.
    #[arg(long, value_parser = crate::exec::BackendParser)]
    backend: Option<Backend>,
    /// With `--stage wgsl`: the program as compiled for a hardware adapter with subgroups (as `run`
    /// compiles it there): row reductions through subgroup operations, the split GEMV projection
    /// form, a decoder step's cache appends run in its attention's dispatch, and the attention's
    /// workgroup form.
    #[arg(long)]
    subgroups: bool,
}

impl InspectArgs {
    /// The optimizer's target: the named backend's, or for `auto` the one `kiln run` would pick.
    fn target(&self) -> Result<kiln_compiler::target::Target> {
        if let Some(adapter) = &self.adapter {
            return Ok(kiln_runtime::costs::cached_target(adapter)?);
        }
        let backend = match self.backend.unwrap_or(Backend::Auto) {
            Backend::Auto if kiln_runtime::Gpu::hardware_adapter().is_some() => Backend::Wgpu,
            Backend::Auto => Backend::Cpu,
            Backend::Interp => bail!("the interpreter is not a compilation target: --backend cpu or wgpu"),
            other => other,
        };
        Ok(match backend {
            // This machine's adapter's cached model, if any (inspecting calibrates nothing).
            Backend::Wgpu => match kiln_runtime::Gpu::chosen_adapter(None) {
                Ok((name, _)) => kiln_runtime::costs::target_of(&name)?,
                Err(_) => kiln_compiler::target::Target::wgpu(),
            },
            _ => kiln_compiler::target::Target::cpu(),
        })
    }

    /// Refuses the flags that would have no effect in the combination given, naming why.
    fn check(&self) -> Result<()> {
        let stage = self.stage.unwrap_or(Stage::Graph);
        let format = self.format.unwrap_or(Format::Text);
        let wgsl = matches!(stage, Stage::Wgsl) && self.html.is_none();
        if self.subgroups && !wgsl {
            bail!("--subgroups shows the WGSL kernels compiled for a device with subgroups: add --stage wgsl");
        }
        if self.seq.is_some() && !wgsl && self.html.is_none() {
            bail!(
                "--seq sets the tokens the HTML report or the wgsl stage's workgroups count at: add --html or --stage wgsl"
            );
        }
        if self.subgroups && self.adapter.is_some() {
            bail!("--adapter compiles the kernels with that adapter's own features: drop --subgroups");
        }
        if self.adapter.is_some() && !self.profile && !wgsl {
            if !(self.stats || matches!(stage, Stage::Optimized)) {
                bail!(
                    "--adapter picks the cost model the graph is optimized with: add --stage optimized or --stats (or, with --html, --profile; or --stage wgsl)"
                );
            }
            if self.backend.is_some_and(|b| b != Backend::Wgpu) {
                bail!("--adapter names a GPU adapter's cost model, which is wgpu's: drop --backend");
            }
        }
        if self.html.is_some() {
            if self.stage.is_some() || self.format.is_some() {
                bail!("the HTML report shows every stage in its own form: drop --stage and --format with --html");
            }
            return Ok(());
        }
        if self.stats {
            if self.stage.is_some() || self.format.is_some() || self.layers.is_some() {
                bail!(
                    "--stats compares the graph before and after optimization as text (--json: JSON): drop --stage, --format and --layers"
                );
            }
            return Ok(());
        }
        if self.explain {
            if !matches!(stage, Stage::Optimized) {
                bail!("--explain lists the fused ops of the optimized graph: add --stage optimized");
            }
            if self.format.is_some() || self.layers.is_some() {
                bail!(
                    "--explain prints a text list of fused ops: drop --format and --layers (drawings mark fused ops themselves)"
                );
            }
        }
        if self.layers.is_some() && format == Format::Text {
            bail!("--layers applies to drawings: use --format dot, svg or png");
        }
        match stage {
            Stage::Graph if self.backend.is_some() => {
                bail!(
                    "--backend chooses what the optimizer extracts for; the graph stage is not optimized: add --stage optimized"
                )
            }
            Stage::Wgsl if self.backend.is_some() => bail!("the wgsl stage is wgpu's plan and kernels: drop --backend"),
            Stage::Wgsl if format != Format::Text => bail!("the wgsl stage is text only; use --format text"),
            _ => Ok(()),
        }
    }
}

/// Which graph `inspect` shows.
#[derive(Clone, Copy, ValueEnum)]
enum Which {
    /// The whole model, as `kiln run` runs it.
    Model,
    /// A decoder step with its key/value cache (`kiln generate`).
    Step,
    /// An encoder-decoder's encoder with its cross-attention keys and values (`kiln generate`).
    Encoder,
    /// The training step `kiln train` runs: the model's loss (with the `[train]` section's label
    /// smoothing), the gradients of every tensor it trains (all but the section's `frozen`
    /// ones), on the checkpoint's tensors, their norms and clipping, and the optimizer's update
    /// of each tensor (`adamw` or `sgd`, reading its state), as one graph.
    Train,
}

/// A stage of the compiled model.
#[derive(Clone, Copy, ValueEnum)]
enum Stage {
    /// The graph as built from the spec, before optimization.
    Graph,
    /// The graph after the e-graph optimizer.
    Optimized,
    /// The plan lowered for wgpu: its steps (op, scope, kernel), buffers, and the WGSL of every
    /// kernel (of the graph optimized for wgpu).
    Wgsl,
}

/// How a stage is printed.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Deterministic text, one node per line.
    Text,
    /// Graphviz DOT.
    Dot,
    /// SVG drawn by Graphviz `dot` (which must be installed).
    Svg,
    /// PNG drawn by Graphviz `dot` (which must be installed).
    Png,
}

/// `3` -> `3..4`; `0..2` -> `0..2`.
pub(crate) fn parse_layers(s: &str) -> Result<Range<usize>, String> {
    let number = |t: &str| {
        t.trim().parse::<usize>().map_err(|_| {
            format!("`{s}` is not a block index (`3`) or a half-open range of them (`0..2`): `{t}` is not a number")
        })
    };
    let range = match s.split_once("..") {
        Some((start, end)) => number(start)?..number(end)?,
        None => {
            let i = number(s)?;
            i..i.saturating_add(1)
        }
    };
    if range.is_empty() {
        return Err(format!("`{s}` selects no blocks: the end of a range is excluded, so it must exceed the start"));
    }
    Ok(range)
}

/// Checks that `layers` names blocks `graph` has.
pub fn check_layers(graph: &Graph, layers: &Option<Range<usize>>) -> Result<()> {
    let Some(range) = layers else { return Ok(()) };
    match print::block_count(graph) {
        0 => bail!("--layers {}..{}: `{}` has no blocks", range.start, range.end, graph.name),
        n if range.end > n => {
            let blocks = crate::report::count(n, "block");
            bail!("--layers {}..{} is out of range: `{}` has {blocks} (0..{n})", range.start, range.end, graph.name)
        }
        _ => Ok(()),
    }
}

/// Writes `bytes` to `output`, or to standard output; refuses binary bytes on a terminal.
fn emit(bytes: &[u8], output: Option<&Path>, binary: bool) -> Result<()> {
    if let Some(path) = output {
        return kiln_compiler::file::write_atomic(path, bytes)
            .with_context(|| format!("cannot write `{}`", path.display()));
    }
    let mut stdout = std::io::stdout().lock();
    if binary && stdout.is_terminal() {
        bail!("refusing to write PNG bytes to a terminal: give `-o FILE` or redirect the output");
    }
    stdout.write_all(bytes)?;
    Ok(stdout.flush()?)
}

/// Runs `kiln inspect`.
pub fn run(args: InspectArgs, reporter: &Reporter) -> Result<()> {
    args.check()?;
    let mut read = vec![("the spec", args.spec.as_path())];
    read.extend(args.training.iter().map(|t| ("--training", t.as_path())));
    read.extend(args.weights.as_deref().map(|w| ("--weights", w)));
    for (flag, path) in [("--output", &args.output), ("--html", &args.html)] {
        if let Some(path) = path {
            crate::output::check(flag, path, &read, args.force.force)?;
        }
    }
    let (source, mut fe) = crate::model_file::read_spec(&args.spec)?;
    let artifact = kiln_compiler::artifact::Artifact::sniff(&args.spec);
    match args.graph {
        Which::Model => {}
        Which::Step => fe.graph = kiln_compiler::graph::build::build_cached(&fe.spec)?,
        Which::Encoder => fe.graph = kiln_compiler::graph::build::build_encoder(&fe.spec)?,
        Which::Train => {
            // The step every engine runs: the whole step, its update included; a recipe that
            // accumulates micro-batches runs the loss and gradients of each, the update after
            // them (on the host, or on wgpu by the device's optimizer).
            let (graphs, recipe) = crate::model_file::training_graph(&fe)?;
            fe.graph = match graphs.whole {
                Some(whole) if recipe.accumulate == 1 => whole,
                _ => graphs.step,
            };
        }
    }
    check_layers(&fe.graph, &args.layers)?;
    if let Some(path) = &args.html {
        return html(&args, path, &source, &fe, reporter);
    }
    let out = args.output.as_deref();
    if args.stats {
        let stats = Stats::of(&fe.graph, fe.spec.layers(), &args.target()?, crate::view::STATS_SEQ)?;
        let text = match args.json {
            true => format!("{}\n", serde_json::to_string_pretty(&stats.json())?),
            false => stats.text(),
        };
        return emit(text.as_bytes(), out, false);
    }
    let (stage, format) = (args.stage.unwrap_or(Stage::Graph), args.format.unwrap_or(Format::Text));
    if artifact && !matches!((stage, args.graph), (Stage::Wgsl, Which::Model) | (Stage::Graph, _)) {
        reporter.info(format_args!(
            "note: `{}` is an artifact: this is its spec's graph, optimized anew (`--stage wgsl` shows the artifact's own plan)",
            args.spec.display()
        ));
    }
    let graph = match stage {
        Stage::Optimized => optimize::optimize_for(&fe.graph, &args.target()?)?.0,
        _ => fe.graph.clone(),
    };
    if args.explain {
        let mut text = String::new();
        for (op, scope, rules) in explanations(&graph) {
            text += &format!("{op} in {} <- {}\n", kiln_compiler::graph::scope_name(&scope), rules.join(", "));
        }
        return emit(text.as_bytes(), out, false);
    }
    match (stage, format) {
        (Stage::Graph | Stage::Optimized, Format::Text) => emit(print::text(&graph).as_bytes(), out, false),
        (Stage::Graph | Stage::Optimized, Format::Dot) => emit(dot(&graph, &args.layers).as_bytes(), out, false),
        (Stage::Graph | Stage::Optimized, format @ (Format::Svg | Format::Png)) => {
            let text = dot(&graph, &args.layers);
            let name = if format == Format::Svg { "svg" } else { "png" };
            match graphviz(&text, name)? {
                Some(bytes) => emit(&bytes, out, format == Format::Png),
                None => bail!(
                    "Graphviz `dot` is not on the PATH, so there is no {} to write: install graphviz, or use --format dot for the DOT text",
                    name.to_uppercase()
                ),
            }
        }
        (Stage::Wgsl, Format::Text) => {
            // An artifact's own plan (the graph `kiln run` runs for it), else the spec's for wgpu.
            let plan = match artifact && matches!(args.graph, Which::Model) {
                true => kiln_compiler::artifact::Artifact::read(&args.spec)?.plan,
                false => lower::lower(&optimize::optimize(&fe.graph)?.0),
            };
            // On a named adapter: its features, and the forms `kiln tune` chose for these shapes
            // there (as every load of them there compiles them).
            let (options, device) = match &args.adapter {
                Some(name) => {
                    let kiln_runtime::Device::Gpu(gpu) = kiln_runtime::Device::gpu(Some(name))? else {
                        bail!("`{name}` opened no GPU adapter");
                    };
                    let options = kiln_runtime::tune::options_for(&gpu, &plan, gpu.options(), true)?;
                    let tuned = kiln_runtime::tune::cached(&gpu, &plan)?.is_some();
                    let how = if tuned { "forms tuned by `kiln tune`" } else { "its default forms: not tuned" };
                    (options, format!("{} ({how})", gpu.describe()))
                }
                None if args.subgroups => (wgsl::Options::hardware(), "a hardware adapter with subgroups".into()),
                None => (wgsl::Options::default(), "any adapter (plain WGSL)".into()),
            };
            let seq = args.seq.unwrap_or(32);
            let syms: HashMap<kiln_compiler::graph::Sym, usize> = match args.graph {
                Which::Step => [(Sym::Batch, 1), (Sym::Seq, 1), (Sym::Past, seq), (Sym::Ctx, seq + 1)].into(),
                _ => [(Sym::Batch, 1), (Sym::Seq, seq), (Sym::SrcSeq, seq), (Sym::Past, 0), (Sym::Ctx, seq)].into(),
            };
            let at = match args.graph {
                Which::Step => format!("batch 1, one new token after {seq} cached"),
                _ => format!("batch 1, {seq} tokens"),
            };
            let program = wgsl::compile(&plan, &options)?;
            emit(wgsl_text(&program, &device, &syms, &at).as_bytes(), out, false)
        }
        (Stage::Wgsl, _) => bail!("the wgsl stage is text only; use --format text"),
    }
}

/// `--stage wgsl`: the plan's steps (each with its op, scope, kernel — a projection's with the
/// form it runs — and the workgroups it launches at the sizes `syms`, described as `at`) and buffers, then every kernel's WGSL; the first lines
/// say which device the program is compiled for and which forms its kernels take.
fn wgsl_text(program: &wgsl::Program, device: &str, syms: &HashMap<Sym, usize>, at: &str) -> String {
    let plan = &program.plan;
    let mut text = format!(
        "// plan `{}`: {}, {}, {} shared buffers, {} ({})\n// compiled for {device}; workgroups at {at}\n",
        plan.name,
        crate::report::count(plan.steps.len(), "step"),
        crate::report::count(plan.folds.len(), "load-time fold"),
        plan.slots,
        crate::report::count(program.kernels.len(), "kernel"),
        program.options.describe(),
    );
    let past = syms.get(&Sym::Past).copied().unwrap_or(0);
    for (i, step) in plan.steps.iter().enumerate() {
        let shape = |v: usize| kiln_compiler::lower::resolve(&plan.values[v].shape, syms);
        let operands: Vec<Vec<usize>> = step.operands.iter().map(|&v| shape(v)).collect();
        let workgroups =
            |dims: &[u32; 16]| crate::report::count(dims[0].div_ceil(wgsl::WORKGROUP) as usize, "workgroup");
        // An optimizer's step binds one chunk of its tensors per dispatch (`wgsl::optim`).
        let optimizer = match step.op {
            Op::SquareSums => Some(SQUARES_LAUNCH),
            Op::ClipScale { .. } => Some("one workgroup"),
            Op::AdamW { .. } | Op::Sgd { .. } => {
                Some("a dispatch per chunk of the tensor, written in place with its state")
            }
            _ => None,
        };
        let dims = wgsl::dispatch(&step.op, &operands, &shape(step.output), past, &program.options);
        let launch = match optimizer {
            Some(how) => how.to_string(),
            None => match &dims {
                // A split attention dispatches again to combine its key ranges, a reduction over
                // chunks of rows its chunks.
                Ok(dims) if dims[0] > 0 => match wgsl::partials::combine_dims(&step.op, dims) {
                    Some(second) if wgsl::partials::over_rows(&step.op) => {
                        format!("{}, then {} combining them", workgroups(dims), workgroups(&second))
                    }
                    Some(second) => format!(
                        "{} ({} key ranges), then {} combining them",
                        workgroups(dims),
                        dims[14],
                        workgroups(&second)
                    ),
                    None => workgroups(dims),
                },
                Ok(_) => "no dispatch".into(),
                Err(e) => format!("no launch at these sizes: {e}"),
            },
        };
        let mut kernel = program.step_kernels.get(i).map_or_else(|| "-".to_string(), |k| format!("kernel {k}"));
        // A projection's form at these sizes (`wgsl::projection::dims`).
        if let (Op::Linear { .. }, Ok(dims)) = (&step.op, &dims) {
            kernel += &format!(" ({})", wgsl::projection::form_name(dims[7]));
        }
        let scope = kiln_compiler::graph::scope_name(&step.scope);
        // What a step writes besides its output: the caches a cached attention appends to.
        let also: Vec<String> = step
            .also
            .iter()
            .map(|&v| match plan.outputs.iter().find(|(_, o)| *o == v) {
                Some((name, _)) => format!("`{name}`"),
                None => format!("value {v}"),
            })
            .collect();
        let also = if also.is_empty() { String::new() } else { format!(" (also writes {})", also.join(", ")) };
        text += &format!("// step {i}: {} in {scope} -> {kernel}, {launch}{also}\n", step.op.name());
    }
    text + &program.kernels_text()
}

/// How `inspect` says a squared norms' step launches (see `wgsl::optim::sum_squares`).
const SQUARES_LAUNCH: &str = "a dispatch per four chunks of the gradients, then one adding each tensor's";
const _: () = assert!(wgsl::optim::SQUARES_SLOTS == 4, "SQUARES_LAUNCH names the slots");

/// Profiles taken for `--profile`; the report gives each step's median.
const PROFILE_RUNS: usize = 5;

/// Per step, the median of several profiles (of one plan, on one clock).
fn median(runs: Vec<kiln_runtime::Profile>) -> kiln_runtime::Profile {
    let clock = runs[0].clock;
    let seconds = (0..runs[0].seconds.len())
        .map(|i| {
            let mut times: Vec<f64> = runs.iter().filter_map(|r| r.seconds[i]).collect();
            times.sort_by(f64::total_cmp);
            times.get(times.len() / 2).copied()
        })
        .collect();
    kiln_runtime::Profile { clock, seconds }
}

/// The engine `kiln run` resolves `--backend` to (`auto`: a hardware GPU adapter if present or
/// one is named, else the CPU), which the report is about.
fn report_engine(args: &InspectArgs, reporter: &Reporter) -> Result<Backend> {
    let threads = crate::exec::threads_or_default(args.threads)?;
    match args.backend.unwrap_or(Backend::Auto).resolve(args.adapter.as_deref(), threads, reporter, false) {
        Backend::Interp => bail!("the interpreter has no kernels to report: --backend cpu or wgpu"),
        backend => Ok(backend),
    }
}

/// `--html`: builds the report for the engine that runs the model (see [`report_engine`]):
/// the graph optimized for it, its plan, and with `--profile` the time of every step there.
fn html(args: &InspectArgs, path: &Path, source: &str, fe: &FrontEnd, reporter: &Reporter) -> Result<()> {
    let seq = args.seq.unwrap_or(32);
    if seq == 0 {
        bail!("--seq must be at least 1");
    }
    let max = fe.spec.spec.model.max_positions as usize;
    if seq > max {
        bail!("--seq {seq} exceeds the model's {max} positions");
    }
    let backend = report_engine(args, reporter)?;
    let threads = crate::exec::threads_or_default(args.threads)?;
    let target = match backend {
        Backend::Wgpu => kiln_compiler::target::Target::wgpu(),
        _ => kiln_compiler::target::Target::cpu(),
    };
    let stats = Stats::of(&fe.graph, fe.spec.layers(), &target, seq)?;
    let inputs = || kiln_compiler::interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 1, seq);
    let params = || crate::exec::params_for(fe, &stats.optimized, args.weights.as_deref(), Storage::default());
    let (engine, profile) = match backend {
        Backend::Wgpu => {
            let program = wgsl::compile(&lower::lower(&stats.optimized), &wgsl::Options::default())?;
            match args.profile {
                false => (crate::html::Engine::Wgpu { program: Box::new(program), adapter: None }, None),
                true => {
                    let device = kiln_runtime::Device::gpu(args.adapter.as_deref())?;
                    let (params, blocks) = params()?;
                    let weights = Weights::Given { params: &params, blocks: &blocks };
                    let (kiln_runtime::Device::Gpu(gpu), kiln_runtime::Model::Gpu(model)) =
                        (&device, device.model(&stats.optimized, weights, Storage::default(), reporter)?)
                    else {
                        bail!("the profile is wgpu's");
                    };
                    let inputs = inputs()?;
                    let mut runs = Vec::with_capacity(PROFILE_RUNS);
                    for _ in 0..PROFILE_RUNS {
                        runs.push(model.profile(&inputs).context("profiling the optimized plan")?);
                    }
                    // The model may store weights differently from the plain lowering (quantized
                    // blocks of a GGUF checkpoint): report the plan that ran.
                    let engine = crate::html::Engine::Wgpu {
                        program: Box::new(model.program().clone()),
                        adapter: Some(gpu.describe()),
                    };
                    (engine, Some(median(runs)))
                }
            }
        }
        _ => match args.profile {
            false => (crate::html::Engine::Cpu { plan: lower::lower(&stats.optimized), threads }, None),
            true => {
                let device = kiln_runtime::Device::Cpu { threads };
                let (params, blocks) = params()?;
                let weights = Weights::Given { params: &params, blocks: &blocks };
                let kiln_runtime::Model::Cpu(model) =
                    device.model(&stats.optimized, weights, Storage::default(), reporter)?
                else {
                    bail!("the profile is the CPU's");
                };
                let inputs = inputs()?;
                let mut runs = Vec::with_capacity(PROFILE_RUNS);
                for _ in 0..PROFILE_RUNS {
                    let seconds = model.profile(&inputs).context("profiling the optimized plan")?;
                    runs.push(kiln_runtime::Profile {
                        clock: kiln_runtime::Clock::Host,
                        seconds: seconds.into_iter().map(Some).collect(),
                    });
                }
                (crate::html::Engine::Cpu { plan: model.plan().clone(), threads }, Some(median(runs)))
            }
        },
    };
    let training = args.training.iter().map(|p| crate::curves::Run::read(p)).collect::<Result<Vec<_>>>()?;
    let page = crate::html::Report {
        training: &training,
        spec_path: &args.spec.display().to_string(),
        source,
        graph: &fe.graph,
        stats: &stats,
        engine: &engine,
        seq,
        layers: &args.layers,
        profile: profile.as_ref(),
    }
    .render()?;
    kiln_compiler::file::write_atomic(path, page.as_bytes())
        .with_context(|| format!("cannot write `{}`", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
