//! `kiln inspect`: a stage of the compiled model as text, DOT, SVG or PNG (drawn by Graphviz's
//! `dot` when it is installed), optimizer statistics, fusion explanations, or a self-contained
//! HTML report of all of them (`--html`, see [`crate::html`]).

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use kiln_compiler::back::wgsl;
use kiln_compiler::graph::print::{self, DotOptions};
use kiln_compiler::graph::{Graph, Sym};
use kiln_compiler::{FrontEnd, lower, optimize};
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::progress::Reporter;

/// `kiln inspect`'s arguments.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// The spec (TOML).
    spec: PathBuf,
    /// Which stage to print.
    #[arg(long, value_enum, default_value_t = Stage::Graph)]
    stage: Stage,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Write to this file instead of standard output.
    #[arg(short, long)]
    output: Option<PathBuf>,
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
    /// With `--html`: run the optimized plan on wgpu and time every dispatch (the median of 5).
    #[arg(long, requires = "html")]
    profile: bool,
    /// With `--profile`: weights (safetensors or GGUF) instead of random ones (times do not depend
    /// on the values).
    #[arg(long, requires = "profile")]
    weights: Option<PathBuf>,
    /// With `--html`: tokens of the (batch 1) input that bytes, FLOPs and times are given for.
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// With `--profile`: GPU adapter (as for `run`).
    #[arg(long, requires = "profile")]
    adapter: Option<String>,
    /// The backend the optimized graph is extracted for (its cost model and kernel limits), as
    /// `kiln run` picks it by default; the HTML report and the `wgsl` stage are wgpu's.
    #[arg(long, value_enum, default_value_t = crate::Backend::Auto)]
    backend: crate::Backend,
}

impl InspectArgs {
    /// The optimizer's target: the named backend's, or for `auto` the one `kiln run` would pick.
    fn target(&self) -> Result<kiln_compiler::target::Target> {
        let backend = match self.backend {
            crate::Backend::Auto if kiln_runtime::Gpu::hardware_adapter().is_some() => crate::Backend::Wgpu,
            crate::Backend::Auto => crate::Backend::Cpu,
            crate::Backend::Interp => bail!("the interpreter is not a compilation target: --backend cpu or wgpu"),
            other => other,
        };
        Ok(backend.optimizer_target())
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
}

/// A stage of the compiled model.
#[derive(Clone, Copy, ValueEnum)]
enum Stage {
    /// The graph as built from the spec, before optimization.
    Graph,
    /// The graph after the e-graph optimizer.
    Optimized,
    /// The lowered plan: steps, buffers and the WGSL of every kernel.
    Wgsl,
}

/// How a stage is printed.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Deterministic text, one node per line.
    Text,
    /// Graphviz DOT.
    Dot,
    /// SVG drawn by Graphviz `dot` (DOT text when `dot` is not installed).
    Svg,
    /// PNG drawn by Graphviz `dot` (DOT text when `dot` is not installed).
    Png,
}

/// `3` -> `3..4`; `0..2` -> `0..2`.
fn parse_layers(s: &str) -> Result<Range<usize>, String> {
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
            bail!("--layers {}..{} is out of range: `{}` has {n} blocks (0..{n})", range.start, range.end, graph.name)
        }
        _ => Ok(()),
    }
}

/// The DOT `inspect` draws: fused ops marked, a legend, the blocks `layers` keeps.
pub fn dot(graph: &Graph, layers: &Option<Range<usize>>) -> String {
    print::dot_with(graph, &DotOptions { fused: true, layers: layers.clone(), legend: true })
}

/// Draws DOT text with Graphviz (`format`: `svg`, `png`, ...). `None` when `dot` is not on the
/// `PATH`; an error when it fails.
pub fn graphviz(dot: &str, format: &str) -> Result<Option<Vec<u8>>> {
    let child = Command::new("dot")
        .arg(format!("-T{format}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("cannot start Graphviz `dot`"),
    };
    // Written from another thread: `dot` may fill its output pipe before it has read all its input.
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let text = dot.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().context("Graphviz `dot` failed")?;
    let written = writer.join().map_err(|_| anyhow::anyhow!("writing to Graphviz `dot` panicked"))?;
    if !out.status.success() {
        bail!("Graphviz `dot -T{format}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    written.context("cannot write to Graphviz `dot`")?;
    Ok(Some(out.stdout))
}

/// Optimizer statistics (`--stats`).
pub struct Stats {
    /// The model's graph name.
    pub model: String,
    /// Blocks in the spec.
    pub blocks: u64,
    /// The optimized graph.
    pub optimized: Graph,
    /// What the optimizer did.
    pub report: optimize::Report,
    /// Intermediate bytes placed (unoptimized, optimized) at batch 1, seq 128.
    pub intermediate_bytes: (u64, u64),
    /// Most bytes live at once (unoptimized, optimized) at batch 1, seq 128.
    pub live_peak_bytes: (u64, u64),
}

impl Stats {
    /// Optimizes `graph` for `target` and measures both graphs' plans.
    pub fn of(graph: &Graph, blocks: u64, target: &kiln_compiler::target::Target) -> Result<Stats> {
        let (optimized, report) = optimize::optimize_for(graph, target)?;
        let syms =
            HashMap::from([(Sym::Batch, 1), (Sym::Seq, 128), (Sym::SrcSeq, 128), (Sym::Past, 0), (Sym::Ctx, 128)]);
        let (before, after) = (lower::lower(graph), lower::lower(&optimized));
        Ok(Stats {
            model: graph.name.clone(),
            blocks,
            intermediate_bytes: (before.memory(&syms).0, after.memory(&syms).0),
            live_peak_bytes: (before.peak_live(&syms), after.peak_live(&syms)),
            optimized,
            report,
        })
    }

    /// As `--stats --json` prints them.
    pub fn json(&self) -> serde_json::Value {
        let r = &self.report;
        serde_json::json!({
            "model": self.model,
            "blocks": self.blocks,
            "dispatches": { "unoptimized": r.dispatches.0, "optimized": r.dispatches.1 },
            "intermediate_bytes": { "unoptimized": self.intermediate_bytes.0, "optimized": self.intermediate_bytes.1, "at": "batch 1, seq 128" },
            "live_peak_bytes": { "unoptimized": self.live_peak_bytes.0, "optimized": self.live_peak_bytes.1 },
            "egraph_nodes": r.egraph_nodes,
            "egraph_classes": r.egraph_classes,
            "optimize_ms": r.optimize_ms,
            "rules_applied": r.applied,
        })
    }

    /// As `--stats` prints them.
    pub fn text(&self) -> String {
        let r = &self.report;
        let mut s = format!("{}: {} blocks\n", self.model, self.blocks);
        s += &format!("  dispatches    {} -> {}\n", r.dispatches.0, r.dispatches.1);
        s += &format!(
            "  intermediates {} -> {} bytes (batch 1, seq 128; live peak {} -> {})\n",
            self.intermediate_bytes.0, self.intermediate_bytes.1, self.live_peak_bytes.0, self.live_peak_bytes.1
        );
        s += &format!("  e-graph       {} nodes, {} classes\n", r.egraph_nodes, r.egraph_classes);
        s += &format!("  optimize      {:.1} ms\n", r.optimize_ms);
        for (phase, iterations, why) in &r.phases {
            s += &format!("  phase {phase:<10} {iterations} iterations ({why})\n");
        }
        for (rule, n) in &r.applied {
            s += &format!("  rule {rule:<22} fired {n}x\n");
        }
        s
    }
}

/// Every fused op of `graph` with the rules that produced it: (op, scope, rules), in order.
pub fn explanations(graph: &Graph) -> Vec<(String, String, Vec<&'static str>)> {
    graph
        .order()
        .into_iter()
        .filter_map(|n| {
            let rules = optimize::explain(graph, n);
            (!rules.is_empty()).then(|| (graph.g[n].op.name(), graph.g[n].scope.clone(), rules))
        })
        .collect()
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
    let (source, mut fe) = crate::read_spec(&args.spec)?;
    match args.graph {
        Which::Model => {}
        Which::Step => fe.graph = kiln_compiler::graph::build::build_cached(&fe.spec)?,
        Which::Encoder => fe.graph = kiln_compiler::graph::build::build_encoder(&fe.spec)?,
    }
    check_layers(&fe.graph, &args.layers)?;
    if let Some(path) = &args.html {
        return html(&args, path, &source, &fe, reporter);
    }
    let out = args.output.as_deref();
    if args.stats {
        let stats = Stats::of(&fe.graph, fe.spec.layers(), &args.target()?)?;
        let text = match args.json {
            true => format!("{}\n", serde_json::to_string_pretty(&stats.json())?),
            false => stats.text(),
        };
        return emit(text.as_bytes(), out, false);
    }
    let graph = match args.stage {
        Stage::Optimized => optimize::optimize_for(&fe.graph, &args.target()?)?.0,
        _ => fe.graph.clone(),
    };
    if args.explain {
        let mut text = String::new();
        for (op, scope, rules) in explanations(&graph) {
            text += &format!("{op} in `{scope}` <- {}\n", rules.join(", "));
        }
        return emit(text.as_bytes(), out, false);
    }
    if args.layers.is_some() && matches!(args.format, Format::Text) {
        bail!("--layers applies to drawings: use --format dot, svg or png");
    }
    match (args.stage, args.format) {
        (Stage::Graph | Stage::Optimized, Format::Text) => emit(print::text(&graph).as_bytes(), out, false),
        (Stage::Graph | Stage::Optimized, Format::Dot) => emit(dot(&graph, &args.layers).as_bytes(), out, false),
        (Stage::Graph | Stage::Optimized, format @ (Format::Svg | Format::Png)) => {
            let text = dot(&graph, &args.layers);
            let name = if format == Format::Svg { "svg" } else { "png" };
            match graphviz(&text, name)? {
                Some(bytes) => emit(&bytes, out, format == Format::Png),
                None => {
                    eprintln!(
                        "note: Graphviz `dot` is not on the PATH, so this is the DOT text instead of {}; install graphviz to draw it",
                        name.to_uppercase()
                    );
                    emit(text.as_bytes(), out, false)
                }
            }
        }
        (Stage::Wgsl, Format::Text) => {
            let plan = lower::lower(&optimize::optimize(&fe.graph)?.0);
            emit(wgsl::compile(&plan, &wgsl::Options::default())?.kernels_text().as_bytes(), out, false)
        }
        (Stage::Wgsl, _) => bail!("the wgsl stage is text only; use --format text"),
    }
}

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

/// `--html`: builds the report (profiling the optimized plan with `--profile`) and writes it.
fn html(args: &InspectArgs, path: &Path, source: &str, fe: &FrontEnd, reporter: &Reporter) -> Result<()> {
    if args.seq == 0 {
        bail!("--seq must be at least 1");
    }
    let max = fe.spec.spec.model.max_positions as usize;
    if args.seq > max {
        bail!("--seq {} exceeds the model's {max} positions", args.seq);
    }
    let stats = Stats::of(&fe.graph, fe.spec.layers(), &kiln_compiler::target::Target::wgpu())?;
    let program = wgsl::compile(&lower::lower(&stats.optimized), &wgsl::Options::default())?;
    let profile = match args.profile {
        false => None,
        true => {
            let gpu = std::sync::Arc::new(kiln_runtime::Gpu::new(args.adapter.as_deref())?);
            let storage = crate::storage::WeightArgs::default();
            let (params, blocks) = crate::bench::params_for(fe, &stats.optimized, args.weights.as_deref(), storage)?;
            let model = crate::storage::gpu_model(&gpu, &stats.optimized, &params, &blocks, storage, reporter)?;
            let inputs =
                kiln_compiler::interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 1, args.seq)?;
            let mut runs = Vec::with_capacity(PROFILE_RUNS);
            for _ in 0..PROFILE_RUNS {
                runs.push(model.profile(&inputs).context("profiling the optimized plan")?);
            }
            let profile = median(runs);
            // The model may store weights differently from the plain lowering (quantized blocks
            // of a GGUF checkpoint): report the plan that ran.
            Some((gpu.describe(), model.program().clone(), profile))
        }
    };
    let page = crate::html::Report {
        spec_path: &args.spec.display().to_string(),
        source,
        graph: &fe.graph,
        stats: &stats,
        program: profile.as_ref().map_or(&program, |(_, program, _)| program),
        seq: args.seq,
        layers: &args.layers,
        profile: profile.as_ref().map(|(adapter, _, p)| (adapter.as_str(), p)),
    }
    .render()?;
    kiln_compiler::file::write_atomic(path, page.as_bytes())
        .with_context(|| format!("cannot write `{}`", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
