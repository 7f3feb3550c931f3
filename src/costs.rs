//! Per-adapter cost models. The optimizer's choices depend on what a dispatch, a byte and a FLOP
//! cost on the device (`CostModel`); the built-in wgpu model was measured on lavapipe, where a
//! dispatch is cheap next to arithmetic, and a discrete GPU wants the opposite trades. So the
//! constants `kiln bench --calibrate` measures on an adapter are cached by the adapter's name
//! under `cost-models/` in kiln's data directory (`$KILN_DATA`, default `~/.cache/kiln`), one
//! small JSON file each, and every
//! command that optimizes for wgpu extracts with the cached model of the adapter it will run on.
//! A hardware adapter without one is calibrated at its first use (a few seconds, once); a
//! software one (lavapipe) uses the built-in model, which was measured on it.

use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_compiler::optimize::CostModel;
use kiln_compiler::target::Target;
use std::path::PathBuf;

/// Where cached cost models live: `cost-models` in kiln's data directory
/// ([`kiln_runtime::data_dir`], where `scripts/fetch-models` keeps the models); `None` when the
/// environment names none.
pub fn dir() -> Option<PathBuf> {
    kiln_runtime::data_dir().map(|d| d.join("cost-models"))
}

/// The file name of an adapter's model in `dir`: its name in lowercase, runs of other characters
/// as `-`.
fn file_of(dir: &std::path::Path, adapter: &str) -> PathBuf {
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
pub fn load(adapter: &str) -> Result<Option<CostModel>> {
    match dir() {
        Some(dir) => read(&file_of(&dir, adapter)),
        None => Ok(None),
    }
}

/// wgpu's target with the cost model cached for the adapter named exactly `adapter`, else the
/// built-in one.
pub fn target_of(adapter: &str) -> Result<Target> {
    Ok(load(adapter)?.map_or_else(Target::wgpu, |cost| Target { cost, ..Target::wgpu() }))
}

fn read(path: &std::path::Path) -> Result<Option<CostModel>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("the cost model `{}` is not valid JSON: delete it to recalibrate", path.display()))?;
    let field = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).filter(|x| x.is_finite() && *x > 0.0);
    let (Some(dispatch), Some(flop)) = (field("dispatch"), field("flop")) else {
        bail!("the cost model `{}` lacks positive `dispatch` and `flop`: delete it to recalibrate", path.display());
    };
    // A model saved before `scalar_projection` was measured keeps the built-in one's.
    let scalar_projection = field("scalar_projection").unwrap_or(CostModel::default().scalar_projection);
    Ok(Some(CostModel { dispatch, flop, scalar_projection, ..CostModel::default() }))
}

/// Saves `model` as the cost model of `adapter`; returns the file.
pub fn save(adapter: &str, model: &CostModel) -> Result<PathBuf> {
    let Some(dir) = dir() else { bail!("no data directory to keep the cost model in: set KILN_DATA") };
    let path = file_of(&dir, adapter);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create `{}`", dir.display()))?;
    let doc = serde_json::json!({"adapter": adapter, "dispatch": model.dispatch, "flop": model.flop,
        "scalar_projection": model.scalar_projection});
    kiln_compiler::file::write_atomic(&path, serde_json::to_string_pretty(&doc)?.as_bytes())
        .with_context(|| format!("cannot write the cost model `{}`", path.display()))?;
    Ok(path)
}

/// The cached models whose adapter name contains `pattern` (case-insensitive), by name.
pub fn find(pattern: &str) -> Result<Vec<(String, CostModel)>> {
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

/// wgpu's optimizer target for the adapter `choice` selects (see `Gpu::new`): with the adapter's
/// cached cost model; a hardware adapter without one is calibrated now and cached; otherwise
/// (lavapipe, or no adapter) the built-in model.
pub fn wgpu_target(choice: Option<&str>, reporter: &Reporter) -> Result<Target> {
    let Ok((name, software)) = kiln_runtime::Gpu::chosen_adapter(choice) else { return Ok(Target::wgpu()) };
    if software || load(&name)?.is_some() {
        return target_of(&name);
    }
    let gpu = std::sync::Arc::new(kiln_runtime::Gpu::new(choice)?);
    let started = std::time::Instant::now();
    let cost = reporter
        .stage("calibrating the cost model", || crate::bench::measure(&crate::storage::Target::Gpu(gpu.clone())))?;
    let path = save(&name, &cost)?;
    reporter.info(format_args!(
        "cost model: `{name}` calibrated at its first use ({:.1} s; cached in {})",
        started.elapsed().as_secs_f64(),
        path.display()
    ));
    Ok(Target { cost, ..Target::wgpu() })
}

/// The target for a cached model named by `pattern` (`kiln inspect --adapter`): the adapter need
/// not be on this machine.
pub fn cached_target(pattern: &str) -> Result<Target> {
    let found = find(pattern)?;
    match found.as_slice() {
        [(_, cost)] => Ok(Target { cost: cost.clone(), ..Target::wgpu() }),
        [] => bail!(
            "no cost model is cached for an adapter matching `{pattern}` (in {}): run `kiln bench --calibrate \
             --adapter {pattern}` on the machine that has it, or copy its file here",
            dir().map_or_else(|| "no data directory".to_string(), |d| d.display().to_string())
        ),
        many => bail!(
            "`{pattern}` matches several cached adapters: {}",
            many.iter().map(|(n, _)| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        ),
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
        let dir = std::path::Path::new("models");
        assert_eq!(file_of(dir, "NVIDIA H100 80GB HBM3"), dir.join("nvidia-h100-80gb-hbm3.json"));
        assert_eq!(file_of(dir, "llvmpipe (LLVM 15.0.6, 256 bits)"), dir.join("llvmpipe-llvm-15-0-6-256-bits.json"));
    }
}
