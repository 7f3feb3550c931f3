//! `kiln new`: a commented starting spec of a kind (decoder, encoder, encoder-decoder), or a copy
//! of a built-in spec (`--from gpt2`), printed or written to a file.

use crate::models;
use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// Arguments of `kiln new`.
#[derive(clap::Args)]
pub struct NewArgs {
    /// The kind of model: `decoder`, `encoder` or `encoder-decoder` (not with --from).
    #[arg(required_unless_present = "from", conflicts_with = "from")]
    kind: Option<String>,
    /// Instead: a copy of this built-in spec (`kiln list` shows them).
    #[arg(long, value_name = "NAME")]
    from: Option<String>,
    /// Where to write the spec (default: stdout); an existing file only with `--force`.
    #[arg(short, long)]
    output: Option<PathBuf>,
    #[command(flatten)]
    force: crate::output::Force,
}

/// Runs `kiln new`, saying on `reporter` where the spec went.
pub fn run(args: NewArgs, reporter: &Reporter) -> Result<()> {
    if let Some(path) = &args.output {
        crate::output::check("--output", path, &[], args.force.force)?;
    }
    let text = match (&args.kind, &args.from) {
        (_, Some(name)) => match models::spec(name) {
            Some(source) => source.to_string(),
            None => bail!("no built-in spec `{name}`: {}", known(models::SPECS, name)),
        },
        (Some(kind), None) => match models::TEMPLATES.iter().find(|(k, _)| k == kind) {
            Some((_, source)) => source.to_string(),
            None => bail!("no kind of model `{kind}`: {}", known(models::TEMPLATES, kind)),
        },
        (None, None) => bail!("give a kind of model (decoder, encoder, encoder-decoder) or --from NAME"),
    };
    match &args.output {
        Some(path) => {
            kiln_compiler::file::write_atomic(path, text.as_bytes())
                .with_context(|| format!("cannot write `{}`", path.display()))?;
            reporter.info(format_args!("wrote `{}`: check it with `kiln check {}`", path.display(), path.display()));
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// The names of `table`, with the nearest to `word` first when there is one.
fn known(table: &[(&str, &str)], word: &str) -> String {
    let names = table.iter().map(|(n, _)| *n);
    match kiln_compiler::diag::did_you_mean(word, names.clone()) {
        Some(near) => format!("did you mean `{near}`?"),
        None => format!("known: {}", names.collect::<Vec<_>>().join(", ")),
    }
}
