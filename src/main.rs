//! `kiln`: the command-line tool. Each subcommand is a thin layer over the compiler and runtime
//! crates; errors are printed (specs with their source line) and the exit code is non-zero.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use kiln_compiler::diag::SpecError;
use kiln_compiler::graph::print;
use kiln_compiler::{FrontEnd, interp};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "kiln", version, about = "A declarative model-graph compiler for Transformer models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a spec and print a summary (parameters, FLOPs per token, graph size).
    Check {
        /// The spec (TOML).
        spec: PathBuf,
        /// Sequence length at which FLOPs per token are counted.
        #[arg(long, default_value_t = 128)]
        seq: usize,
    },
    /// Print a stage of the compiled model.
    Inspect {
        /// The spec (TOML).
        spec: PathBuf,
        /// Which stage to print.
        #[arg(long, value_enum, default_value_t = Stage::Graph)]
        stage: Stage,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Run a model on inputs from a safetensors file and write its outputs to another.
    Run {
        /// The spec (TOML).
        spec: PathBuf,
        /// Checkpoint (safetensors) holding the weights under the names the spec's weight map gives.
        #[arg(long)]
        weights: PathBuf,
        /// Inputs (safetensors): `input_ids`, `attention_mask`, `token_type_ids`, or `src_ids`,
        /// `src_padding`, `tgt_ids`; other tensors are ignored.
        #[arg(long)]
        inputs: PathBuf,
        /// Where to write the outputs (`logits`, `last_hidden_state`, `sentence_embedding`).
        #[arg(long)]
        output: PathBuf,
        /// Execution backend.
        #[arg(long, value_enum, default_value_t = Backend::Interp)]
        backend: Backend,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Stage {
    /// The graph as built from the spec, before optimization.
    Graph,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// Deterministic text, one node per line.
    Text,
    /// Graphviz DOT.
    Dot,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    /// The CPU reference interpreter.
    Interp,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            match err.downcast_ref::<SpecError>() {
                Some(spec_error) => eprint!("{}", spec_error.render()),
                None => eprintln!("error: {err:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

fn load_spec(path: &Path) -> Result<FrontEnd> {
    let source = std::fs::read(path).with_context(|| format!("cannot read spec `{}`", path.display()))?;
    let source = String::from_utf8(source).map_err(|e| {
        anyhow::anyhow!(
            "spec `{}` is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    Ok(kiln_compiler::front_end(&path.display().to_string(), &source)?)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Check { spec, seq } => {
            let fe = load_spec(&spec)?;
            let s = print::summary(&fe.graph, seq);
            let m = &fe.spec.spec.model;
            println!("{}: ok", spec.display());
            println!(
                "  model        {} ({:?}, {} layers, d_model {}, vocab {})",
                m.name,
                m.kind,
                fe.spec.layers(),
                m.d_model,
                m.vocab
            );
            println!("  parameters   {} ({})", s.parameters, human(s.parameters as f64));
            println!("  FLOPs/token  {} (matmuls, forward at seq {})", human(s.flops_per_token), s.seq);
            println!("  graph        {} nodes ({} compute), {} edges", s.nodes, s.compute_nodes, s.edges);
            let inputs: Vec<&str> = fe.graph.inputs().iter().map(|(_, n, _)| *n).collect();
            let outputs: Vec<&str> = fe.graph.outputs.iter().map(|(n, _)| n.as_str()).collect();
            println!("  inputs       {}", inputs.join(", "));
            println!("  outputs      {}", outputs.join(", "));
            if let Some(p) = &fe.spec.weights.preset {
                println!("  weight map   preset `{p}`, {} entries", fe.spec.weights.entries.len());
            }
        }
        Command::Inspect { spec, stage, format } => {
            let fe = load_spec(&spec)?;
            let Stage::Graph = stage;
            match format {
                Format::Text => print!("{}", print::text(&fe.graph)),
                Format::Dot => print!("{}", print::dot(&fe.graph)),
            }
        }
        Command::Run { spec, weights, inputs, output, backend } => {
            let fe = load_spec(&spec)?;
            let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &weights)?;
            let given: HashMap<_, _> = kiln_runtime::read_tensors(&inputs)?;
            let Backend::Interp = backend;
            let outputs = interp::run(&fe.graph, &params, &given).context("run failed")?;
            if outputs.is_empty() {
                bail!("the model has no outputs");
            }
            kiln_runtime::write_tensors(&output, &outputs)?;
            for (name, t) in &outputs {
                println!("{name}: {}{:?}", t.dtype(), t.shape);
            }
            println!("wrote {}", output.display());
        }
    }
    Ok(())
}

/// `1234567` -> `1.23M`.
fn human(x: f64) -> String {
    let (v, unit) = match x {
        x if x >= 1e12 => (x / 1e12, "T"),
        x if x >= 1e9 => (x / 1e9, "G"),
        x if x >= 1e6 => (x / 1e6, "M"),
        x if x >= 1e3 => (x / 1e3, "k"),
        x => (x, ""),
    };
    format!("{v:.2}{unit}")
}
