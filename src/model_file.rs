//! The files a command reads: a spec, an artifact from `kiln compile` (told by its magic, standing
//! for the spec it stores), a checkpoint (a Hugging Face model directory or a GGUF file, whose
//! spec is imported in memory) or the name of a built-in spec (`gpt2`: a name that is no file,
//! see [`crate::models`]); and the weights and tokenizer a model brings: a checkpoint's own, a
//! built-in real model's fetched into the data dir, or those a spec records (`weights.path`).

use crate::models;
use anyhow::{Context, Result, bail};
use kiln_compiler::FrontEnd;
use kiln_compiler::artifact::Artifact;
use kiln_runtime::import as ckpt_import;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// The front end of the spec at `path` (see [`read_spec`]).
pub fn load_spec(path: &Path) -> Result<FrontEnd> {
    Ok(read_spec(path)?.1)
}

/// Reads a spec file and runs the front end; returns the source too. An artifact from `kiln
/// compile` (told by its magic) stands for the spec it stores; a checkpoint directory or GGUF file
/// for its imported spec.
pub fn read_spec(path: &Path) -> Result<(String, FrontEnd)> {
    if Artifact::sniff(path) {
        let art = Artifact::read(path)?;
        let fe = kiln_compiler::front_end(&art.spec_file, &art.spec_source)?;
        return Ok((art.spec_source, fe));
    }
    let (source, label) = spec_text(path)?;
    let fe = kiln_compiler::front_end(&label, &source)?;
    Ok((source, fe))
}

/// A model file as `run` and `embed` read it: its spec's front end (an artifact's from the spec it
/// stores) and, for an artifact, the artifact, whose plan is what runs.
pub struct ModelFile {
    /// The spec, checked, and its unoptimized graph.
    pub fe: FrontEnd,
    /// The artifact, when the file is one.
    pub artifact: Option<Artifact>,
}

impl ModelFile {
    /// Reads a spec or an artifact (told apart by the artifact's magic).
    pub fn read(path: &Path) -> Result<ModelFile> {
        if Artifact::sniff(path) {
            let artifact = Artifact::read(path)?;
            let fe = kiln_compiler::front_end(&artifact.spec_file, &artifact.spec_source)?;
            return Ok(ModelFile { fe, artifact: Some(artifact) });
        }
        Ok(ModelFile { fe: load_spec(path)?, artifact: None })
    }
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
    } else if let Some(name) = models::builtin_name(path) {
        (models::spec(name).unwrap_or_default().to_string(), models::label(name))
    } else {
        if !path.exists() {
            bail!("cannot read spec `{}`: {}", path.display(), models::unknown_hint(path));
        }
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

/// `--weights`, or the weights `model` brings (see [`default_weights`]); an error naming the
/// ways to give them when it brings none.
pub fn weights_for(weights: Option<PathBuf>, model: &Path) -> Result<PathBuf> {
    if let Some(w) = weights {
        return Ok(w);
    }
    match default_weights(model)? {
        Some(w) => Ok(w),
        None => bail!(
            "--weights is required with the spec `{}` (a checkpoint directory or GGUF file brings its own, and a \
             spec can record them as `weights.path`, as `kiln import -o` does)",
            model.display()
        ),
    }
}

/// The weights `model` brings without `--weights`: a checkpoint's own; a built-in real model's,
/// fetched into the data dir (an error saying how to fetch them when they are not); the
/// checkpoint a spec or artifact records (`weights.path`, an error naming it when it is gone);
/// else `None`.
pub fn default_weights(model: &Path) -> Result<Option<PathBuf>> {
    if ckpt_import::is_checkpoint(model) {
        return Ok(Some(ckpt_import::weights_of(model)?));
    }
    if let Some(name) = models::builtin_name(model) {
        return Ok(models::fetched_files(name)?.map(|(weights, _)| weights));
    }
    recorded_weights(model)
}

/// The checkpoint a spec (or the spec an artifact stores) records as `weights.path`, resolved
/// against the directory of the spec (or of the artifact) unless absolute; an error naming it
/// when no such file exists. `None` when it records none, or cannot be read or parsed (the
/// front end reports that).
pub fn recorded_weights(model: &Path) -> Result<Option<PathBuf>> {
    let source = if Artifact::sniff(model) {
        match Artifact::read(model) {
            Ok(artifact) => artifact.spec_source,
            Err(_) => return Ok(None),
        }
    } else {
        match std::fs::read_to_string(model) {
            Ok(source) => source,
            Err(_) => return Ok(None),
        }
    };
    let Ok((spec, _)) = kiln_compiler::spec::parse_spec(&source) else { return Ok(None) };
    let Some(recorded) = spec.weights.path.filter(|p| !p.trim().is_empty()) else { return Ok(None) };
    let dir = model.parent().unwrap_or(Path::new(""));
    let path = dir.join(&recorded);
    if !path.exists() {
        bail!(
            "`{}` records its weights at `{recorded}` (`weights.path`), but `{}` does not exist: give --weights, \
             or fix `weights.path`",
            model.display(),
            path.display()
        );
    }
    Ok(Some(path))
}

/// The tokenizer `model` brings: `--tokenizer`; a model directory's `tokenizer.json` or a GGUF
/// file; a built-in real model's, fetched; or the one beside the weights the spec records (see
/// [`tokenizer_beside`]).
pub fn tokenizer_for(tokenizer: Option<PathBuf>, model: &Path) -> Option<PathBuf> {
    tokenizer.or_else(|| {
        if model.is_dir() {
            Some(model.join("tokenizer.json")).filter(|t| t.is_file())
        } else if ckpt_import::is_checkpoint(model) {
            Some(model.to_path_buf())
        } else if let Some(name) = models::builtin_name(model) {
            models::fetched_files(name).ok().flatten().map(|(_, tokenizer)| tokenizer)
        } else {
            tokenizer_beside(&recorded_weights(model).ok()??)
        }
    })
}

/// The tokenizer found beside a weights file: the file itself when it is GGUF (its metadata
/// holds one), else a `tokenizer.json` in its directory (a Hugging Face model directory's).
pub fn tokenizer_beside(weights: &Path) -> Option<PathBuf> {
    if is_gguf(weights).unwrap_or(false) {
        return Some(weights.to_path_buf());
    }
    let dir = if weights.is_dir() { weights } else { weights.parent()? };
    Some(dir.join("tokenizer.json")).filter(|t| t.is_file())
}

/// The text of the file at `path`, or of standard input for `-` (`what` names it in errors: `the
/// prompt`, `the sentences`).
pub fn read_text(path: &Path, what: &str) -> Result<String> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .with_context(|| format!("cannot read {what} from standard input"))?;
        return Ok(text);
    }
    std::fs::read_to_string(path).with_context(|| format!("cannot read {what} in `{}`", path.display()))
}

/// The checkpoint's tensors that no parameter of `fe`'s graph reads through its weight map,
/// sorted: a spec that leaves part of a checkpoint unread (fewer layers than it has, a norm it
/// lacks) runs, but not as the checkpoint's model.
pub fn unread_tensors(fe: &FrontEnd, ckpt: &kiln_runtime::Checkpoint) -> Vec<String> {
    let read: std::collections::BTreeSet<String> = kiln_runtime::weights::graph_params(&fe.graph)
        .iter()
        .map(|(name, _)| fe.spec.weights.resolve(name).map_or_else(|| name.clone(), |r| r.tensor))
        .collect();
    ckpt.names().into_iter().filter(|n| !read.contains(n)).collect()
}

/// The warning about [`unread_tensors`] of the checkpoint at `path` (`None` when every tensor is
/// read): the first ten names, and how many more.
pub fn unread_warning(path: &Path, unused: &[String]) -> Option<String> {
    const SHOWN: usize = 10;
    if unused.is_empty() {
        return None;
    }
    let mut names: Vec<String> = unused.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
    if unused.len() > SHOWN {
        names.push(format!("and {} more", unused.len() - SHOWN));
    }
    Some(format!(
        "`{}` holds {} the spec never reads: {}",
        path.display(),
        crate::report::count(unused.len(), "tensor"),
        names.join(", ")
    ))
}

/// The warning for a tokenizer (at `path`, of `tokens` tokens) whose vocabulary is not the model's
/// (`vocab`): a smaller one still encodes, but is likely another model's (a tokenizer larger
/// than the model is an error, its ids would be out of range).
pub fn tokenizer_warning(path: &Path, tokens: usize, vocab: u64) -> Option<String> {
    (tokens as u64 != vocab).then(|| {
        format!(
            "the tokenizer `{}` has {tokens} tokens but the model's vocabulary is {vocab}: is it this model's \
             tokenizer? (a vocabulary padded past the tokenizer's is fine)",
            path.display()
        )
    })
}

/// Whether a file is GGUF (by its magic).
pub fn is_gguf(path: &Path) -> Result<bool> {
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot open `{}`", path.display()))?;
    Ok(file.read(&mut magic)? == 4 && kiln_runtime::gguf::sniff(&magic))
}

/// A spec's training step as `kiln train` builds it from the spec's own recipe (its `[train]`
/// section, or the defaults), and the recipe.
pub fn training_graph(fe: &FrontEnd) -> Result<(kiln_runtime::train::StepGraphs, kiln_compiler::train::Recipe)> {
    // The step does not depend on how many there are: a recipe without `steps` still says it.
    let file = fe.spec.spec.train.clone().unwrap_or_default();
    let steps = file.steps.or(Some(1));
    // A memory budget is met at the recipe's sequence length, or at `kiln check`'s default.
    let max = fe.spec.spec.model.max_positions as usize;
    let seq = file.seq.or(Some(max.min(128)));
    let recipe = kiln_compiler::train::RecipeFile { steps, seq, ..file }.resolve()?;
    let dims = kiln_compiler::spec::PackDims::of(&fe.spec);
    let graphs = kiln_runtime::train::step_graphs(&fe.graph, &fe.spec.weights, &dims, &recipe).map_err(Box::new)?;
    Ok((graphs, recipe))
}
