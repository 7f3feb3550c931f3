//! Importing a checkpoint: a Hugging Face model directory (`config.json` and one safetensors file)
//! or a GGUF file -> a spec ([`kiln_compiler::spec::import`] writes it), then checked against the
//! checkpoint's tensors through the same loader `kiln run` uses.

use crate::gguf::{self, Value};
use crate::weights::{Checkpoint, WeightError, graph_params, load_named};
use kiln_compiler::spec::PackDims;
use kiln_compiler::spec::import::{self, Hints, ImportError, Imported, MetaValue, SentencePooling};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Why a checkpoint could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportFailure {
    /// The directory lacks a file the import needs, or holds files it cannot read.
    #[error("{0}")]
    Layout(String),
    /// A file could not be read.
    #[error("cannot read `{path}`: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// The checkpoint's description names something kiln cannot express, or is malformed.
    #[error("{path}: {error}")]
    Import {
        /// The file described.
        path: PathBuf,
        /// What is wrong.
        error: ImportError,
    },
    /// The weights file could not be opened.
    #[error(transparent)]
    Weights(#[from] WeightError),
}

/// A checkpoint with its imported spec.
pub struct Checkpointed {
    /// The spec.
    pub imported: Imported,
    /// The weights file the spec maps.
    pub weights: PathBuf,
    /// The weights, read.
    pub checkpoint: Checkpoint,
}

/// Whether `path` is a checkpoint to import rather than a spec: a directory, or a GGUF file (by
/// its `.gguf` name or its magic).
pub fn is_checkpoint(path: &Path) -> bool {
    if path.is_dir() {
        return true;
    }
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
        && gguf::sniff(&magic)
}

/// Imports the checkpoint at `path`: a model directory or a GGUF file.
pub fn import(path: &Path) -> Result<Checkpointed, ImportFailure> {
    if path.is_dir() { import_dir(path) } else { import_gguf(path) }
}

/// The weights file of a checkpoint: a model directory's one safetensors file, or the GGUF file
/// itself.
pub fn weights_of(path: &Path) -> Result<PathBuf, ImportFailure> {
    if path.is_dir() { weights_file(path) } else { Ok(path.to_path_buf()) }
}

fn read(path: &Path) -> Result<String, ImportFailure> {
    std::fs::read_to_string(path).map_err(|error| ImportFailure::Io { path: path.into(), error })
}

/// A Hugging Face directory: `config.json`, the weights in one safetensors (or GGUF) file, and
/// a sentence-transformers pipeline if `modules.json` describes one.
fn import_dir(dir: &Path) -> Result<Checkpointed, ImportFailure> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(ImportFailure::Layout(format!(
            "`{}` has no config.json: kiln imports a Hugging Face model directory or a GGUF file",
            dir.display()
        )));
    }
    let weights = weights_file(dir)?;
    let checkpoint = Checkpoint::open(&weights)?;
    let hints = Hints {
        name: dir.file_name().map(|n| n.to_string_lossy().into_owned()),
        tensors: Some(checkpoint.names().into_iter().collect::<BTreeSet<_>>()),
        sentence_pooling: sentence_pooling(dir)?,
    };
    let imported = import::hf_config(&read(&config)?, &hints)
        .map_err(|error| ImportFailure::Import { path: config.clone(), error })?;
    Ok(Checkpointed { imported, weights, checkpoint })
}

/// The one weights file of a model directory.
fn weights_file(dir: &Path) -> Result<PathBuf, ImportFailure> {
    let standard = dir.join("model.safetensors");
    if standard.is_file() {
        return Ok(standard);
    }
    if dir.join("model.safetensors.index.json").is_file() {
        return Err(ImportFailure::Layout(format!(
            "`{}` holds a sharded checkpoint (model.safetensors.index.json); kiln reads its weights from one file",
            dir.display()
        )));
    }
    let entries = std::fs::read_dir(dir).map_err(|error| ImportFailure::Io { path: dir.into(), error })?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    found.sort();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(ImportFailure::Layout(format!("`{}` has no model.safetensors", dir.display()))),
        many => Err(ImportFailure::Layout(format!(
            "`{}` holds {} safetensors files and no model.safetensors; kiln reads its weights from one file",
            dir.display(),
            many.len()
        ))),
    }
}

/// The pooling of a sentence-transformers directory (`modules.json` with a `Pooling` module), as
/// the importer writes it into the spec: only the mean over tokens is a spec's. Another pooling
/// (CLS, the last token, several modes) leaves the spec without a `sentence_embedding` output, and
/// `kiln embed` pools the hidden states as the config says (or as `--pooling` overrides it).
fn sentence_pooling(dir: &Path) -> Result<Option<SentencePooling>, ImportFailure> {
    if !dir.join("modules.json").is_file() {
        return Ok(None);
    }
    let Some(pipeline) = sentence_pipeline(dir)? else { return Ok(None) };
    if pipeline.modes.iter().any(|m| m != "mean_tokens") {
        return Ok(None);
    }
    let normalize = pipeline.normalize.unwrap_or(false);
    Ok(Some(SentencePooling { normalize, max_seq_length: pipeline.max_seq_length }))
}

/// A sentence-transformers pipeline around a model: how it pools and whether it normalizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentencePipeline {
    /// The pooling modes switched on in the `Pooling` module's config (`mean_tokens`,
    /// `cls_token`, `lasttoken`, `max_tokens`, ...: `pooling_mode_` dropped).
    pub modes: Vec<String>,
    /// The `Pooling` module's config file.
    pub config: PathBuf,
    /// Whether a `Normalize` module follows the pooling: from `modules.json`; without it, true
    /// where a `2_Normalize` directory is, else unknown.
    pub normalize: Option<bool>,
    /// The longest input the pipeline embeds (`sentence_bert_config.json`: `max_seq_length`).
    pub max_seq_length: Option<u64>,
}

/// The sentence-transformers pipeline of the model directory `dir`: from `modules.json` (its
/// `Pooling` module's `config.json`, a `Normalize` module), or without it from a
/// `1_Pooling/config.json` alone; `None` when there is neither.
pub fn sentence_pipeline(dir: &Path) -> Result<Option<SentencePipeline>, ImportFailure> {
    let modules = dir.join("modules.json");
    let (sub, normalize) = if modules.is_file() {
        let invalid = |what: String| ImportFailure::Layout(format!("`{}`: {what}", modules.display()));
        let list: serde_json::Value =
            serde_json::from_str(&read(&modules)?).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let list = list.as_array().ok_or_else(|| invalid("not a list of modules".into()))?;
        let kind = |m: &serde_json::Value| m.get("type").and_then(|t| t.as_str()).unwrap_or("").to_string();
        let Some(pooling) = list.iter().find(|m| kind(m).ends_with(".Pooling")) else { return Ok(None) };
        let normalize = list.iter().any(|m| kind(m).ends_with(".Normalize"));
        (pooling.get("path").and_then(|p| p.as_str()).unwrap_or("1_Pooling").to_string(), Some(normalize))
    } else if dir.join("1_Pooling/config.json").is_file() {
        ("1_Pooling".to_string(), dir.join("2_Normalize").is_dir().then_some(true))
    } else {
        return Ok(None);
    };
    let config_path = dir.join(sub).join("config.json");
    let config: serde_json::Value = serde_json::from_str(&read(&config_path)?)
        .map_err(|e| ImportFailure::Layout(format!("`{}`: not valid JSON: {e}", config_path.display())))?;
    let on = serde_json::Value::Bool(true);
    let modes = config
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, v)| *v == &on)
        .filter_map(|(k, _)| k.strip_prefix("pooling_mode_").map(str::to_string))
        .collect();
    // The longest input the pipeline embeds, where its config says.
    let st_config = dir.join("sentence_bert_config.json");
    let max_seq_length = if st_config.is_file() {
        let config: serde_json::Value = serde_json::from_str(&read(&st_config)?)
            .map_err(|e| ImportFailure::Layout(format!("`{}`: not valid JSON: {e}", st_config.display())))?;
        config.get("max_seq_length").and_then(serde_json::Value::as_u64)
    } else {
        None
    };
    Ok(Some(SentencePipeline { modes, config: config_path, normalize, max_seq_length }))
}

/// A GGUF file: the spec from its metadata.
fn import_gguf(path: &Path) -> Result<Checkpointed, ImportFailure> {
    let mut head = Vec::new();
    if let Ok(file) = std::fs::File::open(path) {
        let _ = std::io::Read::read_to_end(&mut std::io::Read::take(file, 4096), &mut head);
    }
    if let Some(what) = crate::weights::text_kind(&head) {
        return Err(ImportFailure::Layout(format!(
            "`{}` is {what}, not a checkpoint: kiln imports a Hugging Face model directory or a GGUF file{}",
            path.display(),
            if what.contains("spec") { " (a spec is checked with `kiln check`, and runs as it is)" } else { "" }
        )));
    }
    let checkpoint = Checkpoint::open(path)?;
    let Some(file) = checkpoint.gguf() else {
        return Err(ImportFailure::Layout(format!(
            "`{}` is neither a model directory nor a GGUF file",
            path.display()
        )));
    };
    let meta: BTreeMap<String, MetaValue> = file.metadata().iter().map(|(k, v)| (k.clone(), meta_value(v))).collect();
    let tensors: BTreeMap<String, Vec<usize>> =
        file.tensors().iter().map(|t| (t.name().to_string(), t.shape().to_vec())).collect();
    let imported = import::gguf(&meta, &tensors, &Hints::default())
        .map_err(|error| ImportFailure::Import { path: path.into(), error })?;
    Ok(Checkpointed { imported, weights: path.into(), checkpoint })
}

/// A GGUF value as the importer reads it.
fn meta_value(v: &Value) -> MetaValue {
    match v {
        Value::F32(x) => MetaValue::Float(f64::from(*x)),
        Value::F64(x) => MetaValue::Float(*x),
        Value::Bool(b) => MetaValue::Bool(*b),
        Value::String(s) => MetaValue::Str(s.clone()),
        Value::Array(a) => MetaValue::Array(a.len()),
        other => match (other.as_u64(), other.as_i64()) {
            (Some(u), _) => MetaValue::Uint(u),
            (None, Some(i)) => MetaValue::Int(i),
            (None, None) => MetaValue::Array(0),
        },
    }
}

/// What checking an imported spec against its checkpoint found.
pub struct Report {
    /// Parameters of the spec's graph.
    pub params: usize,
    /// Why each parameter that could not be loaded was not (missing tensor, wrong shape, ...).
    pub problems: Vec<WeightError>,
    /// Tensors of the checkpoint that no parameter reads (a task head, a tied copy, ...).
    pub unused: Vec<String>,
}

/// Checks every parameter of `spec` (a spec's text) against `checkpoint`: each is loaded as `kiln
/// run` would load it (found, unpacked, of the right shape), one at a time.
pub fn check(spec: &str, checkpoint: &Checkpoint) -> Result<Report, kiln_compiler::diag::SpecError> {
    let fe = kiln_compiler::front_end("imported spec", spec)?;
    let dims = PackDims::of(&fe.spec);
    let params = graph_params(&fe.graph);
    let mut problems = Vec::new();
    let mut read = BTreeSet::new();
    for param in &params {
        let tensor = fe.spec.weights.resolve(&param.0).map_or_else(|| param.0.clone(), |r| r.tensor);
        read.insert(tensor);
        if let Err(e) = load_named(&fe.spec.weights, &dims, std::slice::from_ref(param), checkpoint) {
            problems.push(e);
        }
    }
    let unused = checkpoint.names().into_iter().filter(|n| !read.contains(n)).collect();
    Ok(Report { params: params.len(), problems, unused })
}
