//! `kiln import`: the spec of a checkpoint (a Hugging Face model directory or a GGUF file), checked
//! against its tensors; and the hook by which `run`, `generate` and `embed` take a checkpoint where
//! they take a spec (imported in memory, its weights and tokenizer found beside it).

use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_runtime::import as ckpt_import;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Arguments of `kiln import`.
#[derive(clap::Args)]
pub struct ImportArgs {
    /// A Hugging Face model directory (config.json and model.safetensors) or a GGUF file.
    checkpoint: PathBuf,
    /// Where to write the spec (default: stdout).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

/// Runs `kiln import`: writes the spec, then reports on stderr how it maps the checkpoint. Fails
/// (after writing the spec) when a parameter cannot be loaded from the checkpoint.
pub fn run(args: ImportArgs, reporter: &Reporter) -> Result<()> {
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

/// Set by `--print-spec`: [`spec_text`] then prints each spec it reads to stderr.
static PRINT_SPEC: AtomicBool = AtomicBool::new(false);

/// Asks [`spec_text`] to show every spec it reads (`--print-spec`).
pub fn print_specs(on: bool) {
    PRINT_SPEC.store(on, Ordering::Relaxed);
}

/// The text of the spec at `path`, and the name it goes by in messages: the file itself, or a
/// checkpoint's imported spec.
pub fn spec_text(path: &Path) -> Result<(String, String)> {
    let (text, label) = if ckpt_import::is_checkpoint(path) {
        let imported = ckpt_import::import(path)?;
        (imported.imported.text, format!("{} (imported)", path.display()))
    } else {
        let source = std::fs::read(path).with_context(|| format!("cannot read spec `{}`", path.display()))?;
        let source = String::from_utf8(source).map_err(|e| {
            anyhow::anyhow!(
                "spec `{}` is not UTF-8 text (invalid byte at offset {})",
                path.display(),
                e.utf8_error().valid_up_to()
            )
        })?;
        (source, path.display().to_string())
    };
    if PRINT_SPEC.load(Ordering::Relaxed) {
        eprintln!("# --- spec: {label}\n{}# --- end of spec", text);
    }
    Ok((text, label))
}

/// `--weights`, or the weights of `model` when it is a checkpoint.
pub fn weights_for(weights: Option<PathBuf>, model: &Path) -> Result<PathBuf> {
    if let Some(w) = weights {
        return Ok(w);
    }
    if !ckpt_import::is_checkpoint(model) {
        bail!("--weights is required with a spec (it is optional with a checkpoint directory or GGUF file)");
    }
    Ok(ckpt_import::weights_of(model)?)
}

/// The tokenizer beside a checkpoint: `tokenizer.json` in a model directory, or the GGUF file.
pub fn tokenizer_for(tokenizer: Option<PathBuf>, model: &Path) -> Option<PathBuf> {
    tokenizer.or_else(|| {
        if model.is_dir() {
            Some(model.join("tokenizer.json")).filter(|t| t.is_file())
        } else {
            ckpt_import::is_checkpoint(model).then(|| model.to_path_buf())
        }
    })
}
