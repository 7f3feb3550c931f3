//! Errors that belong to a line of the spec. A tensor the weight map names wrongly (missing from
//! the checkpoint, misshapen, or not storable in its quantized form) is the fault of a weight-map
//! entry: it is rendered like a spec error, at that entry in `[weights.tensors]`, or at
//! `weights.preset` when the entry is the preset's (for an artifact, in the spec it stores; for a
//! built-in name, in the built-in spec).

use kiln_compiler::diag::Diagnostic;
use kiln_compiler::spec::SpanIndex;
use kiln_runtime::WeightError;
use kiln_runtime::device::LoadError;
use std::path::Path;

/// `err` rendered at the weight-map entry of `spec` (a spec file) it concerns, if it is a weight
/// error about a parameter that the spec maps.
pub fn weight_error(err: &anyhow::Error, spec: &Path) -> Option<String> {
    let weight = err.chain().find_map(|e| match e.downcast_ref::<LoadError>() {
        Some(LoadError::Weights(weight)) => Some(weight),
        _ => e.downcast_ref::<WeightError>(),
    })?;
    let (param, message, help) = match weight {
        WeightError::MissingTensor { param, tensor, path, nearest } => (
            param,
            format!("tensor `{tensor}` (for parameter `{param}`) is not in `{}`", path.display()),
            (!nearest.is_empty()).then(|| format!("nearest names in the file: {}", nearest.join(", "))),
        ),
        WeightError::Shape { param, .. } | WeightError::Quantized { param, .. } => (param, weight.to_string(), None),
        _ => return None,
    };
    // An artifact points into the spec it stores; a file that is neither has no line to point at.
    let (file, source) = match kiln_compiler::artifact::Artifact::sniff(spec) {
        true => {
            let art = kiln_compiler::artifact::Artifact::read(spec).ok()?;
            (art.spec_file, art.spec_source)
        }
        false => match crate::models::builtin_name(spec) {
            Some(name) => (crate::models::label(name), crate::models::spec(name)?.to_string()),
            None => (spec.display().to_string(), std::fs::read_to_string(spec).ok()?),
        },
    };
    let resolved = kiln_compiler::spec::load(&file, &source).ok()?;
    let entry = resolved.weights.resolve(param)?;
    let index = SpanIndex::new(&source);
    let (span, key) = match index.value(&format!("weights.tensors.{}", entry.template)) {
        Some(span) => (span, format!("weights.tensors.\"{}\"", entry.template)),
        None => {
            let preset = resolved.weights.preset.as_deref().unwrap_or("?");
            (index.value("weights.preset")?, format!("weights.preset (preset `{preset}`'s entry `{}`)", entry.template))
        }
    };
    let mut d = Diagnostic::new("the weight map names the checkpoint's tensors", message).with_span(span).with_key(key);
    d.help = help;
    Some(d.render(&file, &source))
}
