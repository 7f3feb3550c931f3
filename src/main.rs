//! `kiln`: the command-line tool. `main` parses the command line, runs the command (one module
//! each in [`cli`], a thin layer over the compiler and runtime crates) and renders its error: a
//! spec's with its source line, a weight map's at its entry; the exit code is then non-zero.

use clap::{Parser, Subcommand};
use kiln_compiler::diag::SpecError;
use std::path::Path;
use std::process::ExitCode;

mod cli;
mod curves;
mod diagnose;
mod exec;
mod html;
mod model_file;
mod models;
mod output;
mod progress;
mod report;
mod server;
mod view;

use cli::{
    bench, chat, check, compile, diff, embed, eval, fetch, generate, import, init, inspect, list, new, plot, run,
    serve, tokenize, train,
};
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
    Check(check::CheckArgs),
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
    Compile(compile::CompileArgs),
    /// Run a model on inputs (a safetensors file, or ids given inline) with a checkpoint's
    /// weights or random ones, and write its outputs to a safetensors file.
    Run(run::RunArgs),
    /// Generate tokens from a decoder with a key/value cache, streaming them as they come.
    Generate(generate::GenerateArgs),
    /// Chat with a decoder: a conversation kept across turns, rendered with its chat template,
    /// answers streamed (`/reset`, `/system`, `/help`, `/exit`; Ctrl-C stops an answer).
    Chat(chat::ChatArgs),
    /// Serve a model behind the OpenAI API: chat and text completions (streamed or not), or an
    /// embedding model's /v1/embeddings (requests batched together); /v1/models, /health and
    /// Prometheus /metrics, concurrent requests on one copy of the weights.
    Serve(serve::ServeArgs),
    /// Show how a model's tokenizer splits a text: token ids and pieces (or the text of ids).
    Tokenize(tokenize::TokenizeArgs),
    /// Embed sentences with an encoder spec that pools (`outputs.pooling = "mean"`) and print the
    /// vectors.
    Embed(embed::EmbedArgs),
    /// Draw a model's first weights as its spec's `[init]` says (normal matrices, scaled residual
    /// projections, unit norm gains, zero biases) and write them under the checkpoint's tensor names.
    Init(init::InitArgs),
    /// Train a model — a spec or a checkpoint — on pre-batched data with a recipe of AdamW or SGD
    /// steps, writing a JSON line per step and the weights under the checkpoint's tensor names.
    Train(train::TrainArgs),
    /// The loss and perplexity of a model on data, with no update.
    Eval(eval::EvalArgs),
    /// Draw training runs' loss curves (`kiln train --log` files) together, as SVG.
    Plot(plot::PlotArgs),
    /// Write a commented starting spec of a kind (decoder, encoder, encoder-decoder), or a copy of
    /// a built-in spec (`--from NAME`).
    New(new::NewArgs),
    /// List the specs built into kiln (usable by name from any directory: `kiln check gpt2`) and
    /// whether the real models' weights are fetched.
    List(list::ListArgs),
    /// Download a real model's weights and tokenizer (sha256-checked) into kiln's data dir, where
    /// its built-in name finds them (`kiln generate smollm2-135m`).
    Fetch(fetch::FetchArgs),
    /// Measure (never a test): forward and decode times, where a forward spends them, the
    /// kernels, the optimizer and the cost model's constants, one subcommand each.
    Bench(bench::BenchArgs),
    /// Time the WGSL kernels' forms on a GPU adapter for a model's shapes and cache the fastest
    /// that matches the interpreter: every later load of that model's shapes there uses it.
    Tune(bench::tune::TuneArgs),
}

impl Command {
    /// The spec (or artifact) file the command reads weights for, if any: where a weight map's
    /// error is rendered.
    fn weighed_spec(&self) -> Option<&Path> {
        match self {
            Command::Run(args) => Some(args.model()),
            Command::Train(args) => Some(args.model()),
            Command::Eval(args) => Some(args.model()),
            Command::Generate(args) => Some(args.spec()),
            Command::Chat(args) => Some(args.spec()),
            Command::Serve(args) => Some(args.spec()),
            Command::Bench(args) => args.spec(),
            Command::Tune(args) => args.spec(),
            Command::Embed(args) => Some(args.spec()),
            Command::Check(args) => args.weighed_spec(),
            Command::Init(_)
            | Command::New(_)
            | Command::List(_)
            | Command::Fetch(_)
            | Command::Plot(_)
            | Command::Inspect(_)
            | Command::Compile(_)
            | Command::Import(_)
            | Command::Diff(_)
            | Command::Tokenize(_) => None,
        }
    }

    /// Whether `--print-spec` was given.
    fn print_spec(&self) -> bool {
        match self {
            Command::Run(args) => args.print_spec(),
            Command::Generate(args) => args.print_spec(),
            Command::Chat(args) => args.print_spec(),
            Command::Embed(args) => args.print_spec(),
            _ => false,
        }
    }

    /// Runs the command, showing its progress on `reporter`.
    fn run(self, reporter: &Reporter) -> anyhow::Result<()> {
        model_file::print_specs(self.print_spec());
        match self {
            Command::Check(args) => check::run(args, reporter),
            Command::Inspect(args) => inspect::run(args, reporter),
            Command::Import(args) => import::run(args, reporter),
            Command::Diff(args) => diff::run(args),
            Command::Compile(args) => compile::run(args, reporter),
            Command::Run(args) => run::run(args, reporter),
            Command::Init(args) => init::run(args, reporter),
            Command::Train(args) => train::run(args, reporter),
            Command::Eval(args) => eval::run(args, reporter),
            Command::Plot(args) => plot::run(args),
            Command::Generate(args) => generate::run(args, reporter),
            Command::Chat(args) => chat::run(args, reporter),
            Command::Serve(args) => serve::run(args, reporter),
            Command::Tokenize(args) => tokenize::run(args),
            Command::Embed(args) => embed::run(args, reporter),
            Command::Bench(args) => bench::run(args, reporter),
            Command::Tune(args) => bench::tune::run(args, reporter),
            Command::New(args) => new::run(args, reporter),
            Command::List(args) => list::run(args),
            Command::Fetch(args) => fetch::run(args),
        }
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
    let spec = cli.command.weighed_spec().map(Path::to_path_buf);
    let reporter = Reporter::new(cli.quiet);
    match cli.command.run(&reporter) {
        Ok(()) => ExitCode::SUCCESS,
        // Ctrl-C stopped `generate`, which said so: the exit code shells give an interrupted command.
        Err(err) if err.is::<generate::Interrupted>() => ExitCode::from(130),
        Err(err) => {
            // Bars first, so none is left behind the message.
            drop(reporter);
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
