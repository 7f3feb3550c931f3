//! kiln-compiler: Transformer spec -> graph IR -> (optimized graph -> kernels, in later stages).
//!
//! The pipeline, one module per stage, in the order data flows:
//!
//! 1. [`spec`]: TOML text -> [`spec::Spec`] (serde) -> [`spec::Resolved`] (validated, defaults filled),
//!    with [`diag::Diagnostic`]s located at `line:column`.
//! 2. [`graph`]: [`spec::Resolved`] -> [`graph::Graph`], a petgraph dataflow graph of tensor-level ops
//!    whose shapes are inferred, batch and sequence symbolic. Printers for text and DOT.
//! 3. [`interp`]: the CPU reference interpreter that executes any graph in f32; the oracle every
//!    later stage is checked against.
//! 4. [`lower`]: [`graph::Graph`] -> [`lower::Plan`]: one naga-validated WGSL kernel per op, buffers
//!    shared by liveness; what the runtime executes on a GPU.
//!
//! [`front_end`] runs stages 1 and 2 as one function; the CLI and the tests use it.
//!
//! **Architecture invariant**: this crate never depends on a GPU API. It produces IR and runs it on
//! the CPU; executing on a device is `kiln-runtime`'s job.
#![warn(missing_docs)]

pub mod artifact;
pub mod diag;
pub mod graph;
pub mod interp;
pub mod lower;
pub mod optimize;
pub mod spec;
pub mod tensor;

use diag::{Diagnostic, SpecError};
use graph::Graph;
use spec::Resolved;

/// A spec through the front end: validated, and built into a checked graph.
#[derive(Clone, Debug)]
pub struct FrontEnd {
    /// The validated spec with defaults resolved.
    pub spec: Resolved,
    /// The unoptimized graph.
    pub graph: Graph,
}

/// Parse -> validate -> build -> check. `file` names the source in error messages.
pub fn front_end(file: &str, source: &str) -> Result<FrontEnd, SpecError> {
    let spec = spec::load(file, source)?;
    let fail = |d: Diagnostic| SpecError { file: file.into(), source: source.into(), diagnostics: vec![d] };
    let graph = graph::build::build(&spec).map_err(|e| {
        fail(Diagnostic::new("shapes are consistent", format!("impossible shape: {e}")).with_span(0..0))
    })?;
    graph.check().map_err(|e| {
        fail(Diagnostic::new("the graph is well-formed", format!("internal error, please report: {e}")))
    })?;
    check_weight_map(&spec, &graph, source).map_err(|d| SpecError {
        file: file.into(),
        source: source.into(),
        diagnostics: d,
    })?;
    Ok(FrontEnd { spec, graph })
}

/// Every parameter of the graph must have a weight-map entry (when the spec names a map at all).
fn check_weight_map(spec: &Resolved, graph: &Graph, source: &str) -> Result<(), Vec<Diagnostic>> {
    if spec.weights.entries.is_empty() {
        // No map: parameters are looked up under their canonical names (kiln's own checkpoints).
        return Ok(());
    }
    let index = spec::SpanIndex::new(source);
    // One error per missing template, not per layer.
    let mut seen = std::collections::HashSet::new();
    let templates: Vec<String> = graph
        .params()
        .iter()
        .filter(|(_, name)| spec.weights.resolve(name).is_none())
        .map(|(_, name)| template_of(name))
        .filter(|t| seen.insert(t.clone()))
        .collect();
    let missing: Vec<Diagnostic> = templates
        .iter()
        .map(|template| {
            Diagnostic::new(
                "every parameter has a weight-map entry",
                format!("parameter `{template}` has no entry in the weight map"),
            )
            .with_key("weights.preset")
            .with_span(index.locate("weights.preset"))
            .with_help(format!("add it under [weights.tensors], e.g. \"{template}\" = \"<tensor name>\""))
        })
        .collect();
    if missing.is_empty() { Ok(()) } else { Err(missing) }
}

/// `layers.3.attn.q.weight` -> `layers.{i}.attn.q.weight` (and `{e}` for experts).
pub fn template_of(param: &str) -> String {
    let mut parts: Vec<String> = param.split('.').map(str::to_string).collect();
    for i in 1..parts.len() {
        if parts[i].chars().all(|c| c.is_ascii_digit()) {
            parts[i] = match parts[i - 1].as_str() {
                "experts" => "{e}".into(),
                _ => "{i}".into(),
            };
        }
    }
    parts.join(".")
}
