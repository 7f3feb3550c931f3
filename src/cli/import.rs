//! `kiln import`: the spec of a checkpoint (a Hugging Face model directory or a GGUF file), checked
//! against its tensors. (How `run`, `generate` and `embed` take a checkpoint where they take a
//! spec is `model_file`'s.)

use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_runtime::import as ckpt_import;
use std::path::PathBuf;

/// Arguments of `kiln import`.
#[derive(clap::Args)]
pub struct ImportArgs {
    /// A Hugging Face model directory (config.json and model.safetensors) or a GGUF file.
    checkpoint: PathBuf,
    /// Where to write the spec (default: stdout); never the checkpoint's own files, and an
    /// existing file (a spec edited by hand) only with `--force`.
    #[arg(short, long)]
    output: Option<PathBuf>,
    #[command(flatten)]
    force: crate::output::Force,
}

/// Runs `kiln import`: writes the spec, then reports on stderr how it maps the checkpoint. Fails
/// (after writing the spec) when a parameter cannot be loaded from the checkpoint.
pub fn run(args: ImportArgs, reporter: &Reporter) -> Result<()> {
    if let Some(path) = &args.output {
        let weights = ckpt_import::weights_of(&args.checkpoint).ok();
        let mut read = vec![("the checkpoint", args.checkpoint.as_path())];
        read.extend(weights.as_deref().map(|w| ("the checkpoint's weights", w)));
        crate::output::check("--output", path, &read, args.force.force)?;
    }
    let imported = reporter.stage("importing", || ckpt_import::import(&args.checkpoint))?;
    let text = &imported.imported.text;
    match &args.output {
        Some(path) => kiln_compiler::file::write_atomic(path, text.as_bytes())
            .with_context(|| format!("cannot write `{}`", path.display()))?,
        None => print!("{text}"),
    }
    let report = reporter.stage("checking the weights", || ckpt_import::check(text, &imported.checkpoint))?;
    let weights = imported.weights.display();
    if report.problems.is_empty() {
        reporter.info(format_args!(
            "{}: all {} parameters found in `{weights}`, with the right shapes",
            imported.imported.family, report.params
        ));
    }
    if !report.unused.is_empty() {
        const SHOWN: usize = 8;
        let mut names = report.unused.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
        if report.unused.len() > SHOWN {
            names += &format!(", ... ({} more)", report.unused.len() - SHOWN);
        }
        reporter.info(format_args!("{} tensors of `{weights}` are not read by the spec: {names}", report.unused.len()));
    }
    if !report.problems.is_empty() {
        for problem in &report.problems {
            eprintln!("error: {problem}");
        }
        bail!(
            "{} of {} parameters could not be mapped to `{weights}` (the spec is written: edit its [weights] to fix them)",
            report.problems.len(),
            report.params
        );
    }
    Ok(())
}
