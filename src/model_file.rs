//! The files a command reads: a spec, an artifact from `kiln compile` (told by its magic, standing
//! for the spec it stores) or a checkpoint (a Hugging Face model directory or a GGUF file, whose
//! spec is imported in memory), and the weights and tokenizer found beside a checkpoint.

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
