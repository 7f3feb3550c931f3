//! `kiln import`: the spec of a checkpoint (a Hugging Face model directory or a GGUF file), checked
//! against its tensors. The spec records where the weights are (`weights.path`: relative to the
//! spec's directory when written to a file, absolute on stdout), so that the commands that read
//! weights find them without `--weights`. (How `run`, `generate` and `embed` take a checkpoint
//! where they take a spec is `model_file`'s.)

use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_runtime::import as ckpt_import;
use std::path::{Component, Path, PathBuf};

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
    let text = &with_weights_path(&imported.imported.text, &imported.weights, args.output.as_deref(), reporter);
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

/// `text` with `path = "..."` under `[weights]` (the table added if it has none): where `weights`
/// is, relative to the directory of `output` (absolute when the spec goes to stdout). A path
/// that TOML cannot hold as text (not UTF-8) is not recorded, which is said.
fn with_weights_path(text: &str, weights: &Path, output: Option<&Path>, reporter: &Reporter) -> String {
    let absolute = std::fs::canonicalize(weights).unwrap_or_else(|_| weights.to_path_buf());
    let recorded = match output.map(spec_dir) {
        Some(dir) => relative(&absolute, &dir),
        None => absolute,
    };
    let Some(recorded) = recorded.to_str() else {
        reporter.info(format_args!(
            "note: `{}` is not UTF-8, so the spec does not record it: give --weights",
            weights.display()
        ));
        return text.to_string();
    };
    let line = format!(
        "path = {}{}# kiln import: the checkpoint's weights (--weights overrides them)",
        toml::Value::String(recorded.to_string()),
        " ".repeat(4)
    );
    let mut lines: Vec<&str> = text.lines().collect();
    match lines.iter().position(|l| l.trim() == "[weights]") {
        Some(i) => lines.insert(i + 1, &line),
        None => return format!("{}\n[weights]\n{line}\n", text.trim_end()),
    }
    lines.join("\n") + "\n"
}

/// The canonical directory a spec written to `output` sits in.
fn spec_dir(output: &Path) -> PathBuf {
    let dir = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// `path` relative to `dir` (both absolute): the components after their common prefix, with a
/// `..` for each of `dir`'s left; `path` itself when they share nothing but the root (a spec in
/// /tmp naming `../../home/...` would break wherever it moved).
fn relative(path: &Path, dir: &Path) -> PathBuf {
    let (p, d): (Vec<Component>, Vec<Component>) = (path.components().collect(), dir.components().collect());
    let common = p.iter().zip(&d).take_while(|(a, b)| a == b).count();
    if common <= 1 {
        return path.to_path_buf();
    }
    let mut out = PathBuf::new();
    d.iter().skip(common).for_each(|_| out.push(".."));
    p.iter().skip(common).for_each(|c| out.push(c));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_recorded_relative_to_the_spec() {
        assert_eq!(relative(Path::new("/a/b/w.gguf"), Path::new("/a/b")), PathBuf::from("w.gguf"));
        assert_eq!(relative(Path::new("/a/b/w.gguf"), Path::new("/a/c/d")), PathBuf::from("../../b/w.gguf"));
        assert_eq!(relative(Path::new("/w.gguf"), Path::new("/a")), PathBuf::from("/w.gguf"));
    }
}
