//! Per-adapter cost models. The optimizer's choices depend on what a dispatch, a byte and a FLOP
//! cost on the device ([`CostModel`]); the built-in wgpu model was measured on lavapipe, where a
//! dispatch is cheap next to arithmetic, and a discrete GPU wants the opposite trades. So the
//! constants [`crate::measure`] takes on an adapter (`kiln bench calibrate`) are cached by the
//! adapter's name under `cost-models/` in kiln's data directory (`$KILN_DATA`, default
//! `~/.cache/kiln`), one small JSON file each, and every command that optimizes for wgpu extracts
//! with the cached model of the adapter it will run on ([`crate::Device::cached_target`]). A
//! hardware adapter without one is calibrated at its first use (a few seconds, once); a software
//! one (lavapipe) uses the built-in model, which was measured on it.

use kiln_compiler::optimize::CostModel;
use kiln_compiler::target::Target;
use std::path::{Path, PathBuf};

/// What can go wrong reading, finding or saving a cached cost model.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    /// A file could not be read.
    #[error("cannot read `{}`", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A cached model is not JSON.
    #[error("the cost model `{}` is not valid JSON: delete it to recalibrate", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// A cached model lacks its constants.
    #[error("the cost model `{}` lacks positive `dispatch` and `flop`: delete it to recalibrate", path.display())]
    Constants {
        /// The file.
        path: PathBuf,
    },
    /// Saving needs a data directory.
    #[error("no data directory to keep the cost model in: set KILN_DATA")]
    NoDataDir,
    /// The data directory could not be created.
    #[error("cannot create `{}`", dir.display())]
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A model could not be written.
    #[error("cannot write the cost model `{}`", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A model could not be encoded.
    #[error("cannot encode the cost model")]
    Encode(#[source] serde_json::Error),
    /// No cached model matches a pattern.
    #[error(
        "no cost model is cached for an adapter matching `{pattern}` (in {}): run `kiln bench calibrate \
         --adapter {pattern}` on the machine that has it, or copy its file here",
        dir.as_ref().map_or_else(|| "no data directory".to_string(), |d| d.display().to_string())
    )]
    NotCached {
        /// The pattern.
        pattern: String,
        /// Where the models were looked for.
        dir: Option<PathBuf>,
    },
    /// Several cached models match a pattern.
    #[error("`{pattern}` matches several cached adapters: {}",
        names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "))]
    Ambiguous {
        /// The pattern.
        pattern: String,
        /// The adapters it matches.
        names: Vec<String>,
    },
}

/// Where cached cost models live: `cost-models` in kiln's data directory
/// ([`crate::data_dir`], where `scripts/fetch-models` keeps the models); `None` when the
/// environment names none.
pub fn dir() -> Option<PathBuf> {
    crate::data_dir().map(|d| d.join("cost-models"))
}

/// The file name of an adapter's model in `dir`: its name in lowercase, runs of other characters
/// as `-` (an adapter's tunings are named the same way, `crate::tune`).
pub(crate) fn file_of(dir: &Path, adapter: &str) -> PathBuf {
    let mut slug = String::new();
    for c in adapter.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    dir.join(format!("{}.json", slug.trim_matches('-')))
}

/// The cached model of the adapter named exactly `adapter`, if one was saved.
pub fn load(adapter: &str) -> Result<Option<CostModel>, CostError> {
    match dir() {
        Some(dir) => read(&file_of(&dir, adapter)),
        None => Ok(None),
    }
}

/// wgpu's target with the cost model cached for the adapter named exactly `adapter`, else the
/// built-in one.
pub fn target_of(adapter: &str) -> Result<Target, CostError> {
    Ok(load(adapter)?.map_or_else(Target::wgpu, wgpu_with))
}

/// wgpu's target for the adapter named exactly `adapter` from what is cached: its cost model, else
/// on a software adapter (`software`) the built-in one, which was measured there; `None` for a
/// hardware adapter without a cached model, which wants calibrating.
pub fn cached(adapter: &str, software: bool) -> Result<Option<Target>, CostError> {
    Ok(match load(adapter)? {
        Some(cost) => Some(wgpu_with(cost)),
        None if software => Some(Target::wgpu()),
        None => None,
    })
}

/// wgpu's target with the cost model `cost`.
pub fn wgpu_with(cost: CostModel) -> Target {
    Target { cost, ..Target::wgpu() }
}

fn read(path: &Path) -> Result<Option<CostModel>, CostError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| CostError::Read { path: path.to_path_buf(), source })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| CostError::Json { path: path.to_path_buf(), source })?;
    let field = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).filter(|x| x.is_finite() && *x > 0.0);
    let (Some(dispatch), Some(flop)) = (field("dispatch"), field("flop")) else {
        return Err(CostError::Constants { path: path.to_path_buf() });
    };
    // A model saved before `scalar_projection` was measured keeps the built-in one's.
    let scalar_projection = field("scalar_projection").unwrap_or(CostModel::default().scalar_projection);
    Ok(Some(CostModel { dispatch, flop, scalar_projection, ..CostModel::default() }))
}

/// Saves `model` as the cost model of `adapter`; returns the file.
pub fn save(adapter: &str, model: &CostModel) -> Result<PathBuf, CostError> {
    let dir = dir().ok_or(CostError::NoDataDir)?;
    let path = file_of(&dir, adapter);
    std::fs::create_dir_all(&dir).map_err(|source| CostError::CreateDir { dir: dir.clone(), source })?;
    let doc = serde_json::json!({"adapter": adapter, "dispatch": model.dispatch, "flop": model.flop,
        "scalar_projection": model.scalar_projection});
    let text = serde_json::to_string_pretty(&doc).map_err(CostError::Encode)?;
    kiln_compiler::file::write_atomic(&path, text.as_bytes())
        .map_err(|source| CostError::Write { path: path.clone(), source })?;
    Ok(path)
}

/// The cached models whose adapter name contains `pattern` (case-insensitive), by name.
pub fn find(pattern: &str) -> Result<Vec<(String, CostModel)>, CostError> {
    let mut found = Vec::new();
    let Some(Ok(entries)) = dir().map(std::fs::read_dir) else { return Ok(found) };
    for entry in entries.flatten() {
        let path = entry.path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let name = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("adapter").and_then(|a| a.as_str()).map(str::to_string));
        if let Some(name) = name.filter(|n| n.to_lowercase().contains(&pattern.to_lowercase()))
            && let Some(model) = read(&path)?
        {
            found.push((name, model));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

/// The target for a cached model named by `pattern` (`kiln inspect --adapter`): the adapter need
/// not be on this machine.
pub fn cached_target(pattern: &str) -> Result<Target, CostError> {
    let mut found = find(pattern)?;
    match found.len() {
        1 => Ok(found.pop().map_or_else(Target::wgpu, |(_, cost)| wgpu_with(cost))),
        0 => Err(CostError::NotCached { pattern: pattern.to_string(), dir: dir() }),
        _ => {
            Err(CostError::Ambiguous { pattern: pattern.to_string(), names: found.into_iter().map(|f| f.0).collect() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_model_reads_back_and_a_bad_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("kiln-costs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        kiln_compiler::file::write_atomic(&good, br#"{"adapter": "A", "dispatch": 5000.0, "flop": 0.5}"#).unwrap();
        let model = read(&good).unwrap().unwrap();
        assert_eq!((model.dispatch, model.flop), (5000.0, 0.5));
        let bad = dir.join("bad.json");
        kiln_compiler::file::write_atomic(&bad, br#"{"adapter": "B", "dispatch": -1.0}"#).unwrap();
        assert!(read(&bad).unwrap_err().to_string().contains("delete it to recalibrate"));
        assert!(read(&dir.join("none.json")).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn adapter_names_become_file_names() {
        let dir = Path::new("models");
        assert_eq!(file_of(dir, "NVIDIA H100 80GB HBM3"), dir.join("nvidia-h100-80gb-hbm3.json"));
        assert_eq!(file_of(dir, "llvmpipe (LLVM 15.0.6, 256 bits)"), dir.join("llvmpipe-llvm-15-0-6-256-bits.json"));
    }
}
