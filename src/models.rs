//! The models built into the binary, so that kiln works outside its checkout: every spec of
//! `models/` by name (`kiln check gpt2`), the real models `kiln fetch` caches in kiln's data dir
//! (`scripts/fetch-models.json`, the one list that `scripts/fetch-models` reads too), and the
//! starting specs of `kiln new`.

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every spec of `models/`, by its file name without `.toml`.
pub const SPECS: &[(&str, &str)] = &[
    ("bert", include_str!("../models/bert.toml")),
    ("bigbird", include_str!("../models/bigbird.toml")),
    ("bloom", include_str!("../models/bloom.toml")),
    ("gemma3", include_str!("../models/gemma3.toml")),
    ("gemma3-270m", include_str!("../models/gemma3-270m.toml")),
    ("gpt2", include_str!("../models/gpt2.toml")),
    ("linformer", include_str!("../models/linformer.toml")),
    ("llama", include_str!("../models/llama.toml")),
    ("minilm-l6", include_str!("../models/minilm-l6.toml")),
    ("mixtral", include_str!("../models/mixtral.toml")),
    ("nanogpt-shakespeare", include_str!("../models/nanogpt-shakespeare.toml")),
    ("smollm2-135m", include_str!("../models/smollm2-135m.toml")),
    ("t5", include_str!("../models/t5.toml")),
    ("vaswani", include_str!("../models/vaswani.toml")),
];

/// The starting specs of `kiln new`, by kind.
pub const TEMPLATES: &[(&str, &str)] = &[
    ("decoder", include_str!("templates/decoder.toml")),
    ("encoder", include_str!("templates/encoder.toml")),
    ("encoder-decoder", include_str!("templates/encoder-decoder.toml")),
];

/// The list of fetchable models, as `scripts/fetch-models.json` holds it.
pub const FETCH_LIST: &str = include_str!("../scripts/fetch-models.json");

/// The program that fetches them (`scripts/fetch_models.py`), run by `kiln fetch`.
pub const FETCH_PROGRAM: &str = include_str!("../scripts/fetch_models.py");

/// The source of the built-in spec `name`.
pub fn spec(name: &str) -> Option<&'static str> {
    SPECS.iter().find(|(n, _)| *n == name).map(|(_, source)| *source)
}

/// The label a built-in spec goes by in messages (`gpt2 (built in)`).
pub fn label(name: &str) -> String {
    format!("{name} (built in)")
}

/// Whether `path` names a built-in spec rather than a file: it is one of [`SPECS`]' names and no
/// file or directory of that name exists (a file by that name wins).
pub fn builtin_name(path: &Path) -> Option<&'static str> {
    let name = path.to_str()?;
    let (name, _) = SPECS.iter().find(|(n, _)| *n == name)?;
    (!path.exists()).then_some(name)
}

/// The hint for a model argument that is neither a file nor a built-in name: the nearest
/// built-in name, or where to find them.
pub fn unknown_hint(path: &Path) -> String {
    let suggestion = path.to_str().and_then(|p| kiln_compiler::diag::did_you_mean(p, SPECS.iter().map(|(n, _)| *n)));
    match suggestion {
        Some(name) => format!("no such file, nor a built-in spec: did you mean `{name}`? (`kiln list` shows them)"),
        None => "no such file, nor a built-in spec (`kiln list` shows them; `kiln new` starts a spec)".into(),
    }
}

/// A model `kiln fetch` caches: where its files are and how to get them.
#[derive(Clone, Debug, Deserialize)]
pub struct Fetchable {
    /// The short name `scripts/fetch-models` also takes (`minilm`).
    pub alias: String,
    /// The weights file, in the model's directory of the data dir.
    pub weights: String,
    /// The tokenizer (a `tokenizer.json`, or the GGUF weights themselves).
    pub tokenizer: String,
}

/// The fetchable models by name (a built-in spec's name).
pub fn fetchable() -> Result<BTreeMap<String, Fetchable>> {
    serde_json::from_str(FETCH_LIST).context("the built-in list of fetchable models is malformed")
}

/// A fetchable model by its name or alias, with its name.
pub fn find_fetchable(name: &str) -> Result<Option<(String, Fetchable)>> {
    Ok(fetchable()?.into_iter().find(|(n, f)| n == name || f.alias == name))
}

/// kiln's data dir (`KILN_DATA`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`).
pub fn data_dir() -> Result<PathBuf> {
    kiln_runtime::data_dir().context("kiln's data dir is unknown: set KILN_DATA (or HOME)")
}

/// The fetched file `file` of the model `name`, or an error saying how to fetch it.
pub fn fetched(name: &str, file: &str) -> Result<PathBuf> {
    let path = data_dir()?.join(name).join(file);
    if !path.is_file() {
        bail!(
            "`{name}`'s weights are not fetched (no `{}`): run `kiln fetch {name}`, or give --weights",
            path.display()
        );
    }
    Ok(path)
}

/// The weights and tokenizer of the built-in model `name`, fetched into the data dir; `None` for a
/// built-in spec that has no checkpoint to fetch (the fixtures' sizes).
pub fn fetched_files(name: &str) -> Result<Option<(PathBuf, PathBuf)>> {
    let Some((name, f)) = fetchable()?.into_iter().find(|(n, _)| n == name) else { return Ok(None) };
    Ok(Some((fetched(&name, &f.weights)?, fetched(&name, &f.tokenizer)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_file_is_built_in_and_every_fetchable_model_has_a_spec() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.unwrap().path().file_name()?.to_str()?.strip_suffix(".toml").map(str::to_string))
            .collect();
        files.sort();
        let names: Vec<&str> = SPECS.iter().map(|(n, _)| *n).collect();
        assert_eq!(files, names, "models/*.toml and SPECS differ");
        for name in fetchable().unwrap().keys() {
            assert!(spec(name).is_some(), "fetchable `{name}` has no built-in spec");
        }
        for (_, source) in SPECS.iter().chain(TEMPLATES) {
            kiln_compiler::front_end("built-in", source).unwrap_or_else(|e| panic!("{}", e.render()));
        }
    }
}
