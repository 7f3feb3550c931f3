//! kiln-compiler: a Transformer spec, through four intermediate representations, to a
//! target-neutral plan and the WGSL kernels of its wgpu back end; and the CPU interpreter every
//! stage is checked against.
//!
//! The IRs, in the order data flows (each module's docs give its invariants):
//!
//! 1. **Spec** ([`spec`]): TOML text -> [`spec::Spec`] (serde, the keys as written) ->
//!    [`spec::Resolved`] (validated against [`spec::Limits`], every default filled in, the weight
//!    map resolved from its preset and overrides). Errors are [`diag::Diagnostic`]s located at the
//!    offending key's `line:column`, with a "did you mean" for misspelled keys and values.
//! 2. **Graph** ([`graph`]): [`spec::Resolved`] -> [`graph::Graph`], a petgraph dataflow graph of
//!    small, unfused tensor ops (matmul, add, softmax, norm, rope, ...) with inferred shapes.
//!    Model dimensions are concrete; batch and sequence lengths stay symbolic ([`graph::Sym`]).
//!    Parameters are nodes named by canonical names (`layers.{i}.attn.q.weight`) that the weight
//!    map binds to checkpoint tensors. Every node has a scope (`layers.3.attn`) for printing.
//! 3. **E-graph** ([`optimize`]): the graph as an [`egg`] e-graph over the language
//!    [`optimize::Kl`], where rewrite rules add fused ops (merged Q/K/V projections, projection
//!    epilogues, fused norms, masked softmax, whole attention) next to the ops they replace, and a
//!    [`optimize::CostModel`] extracts the cheapest equivalent graph. The result is again a
//!    [`graph::Graph`], whose fused nodes [`optimize::explain`] traces back to their rules.
//! 4. **Plan** ([`lower`]): [`graph::Graph`] -> [`lower::Plan`], the target-neutral program: a
//!    [`lower::Step`] per op in topological order, [`lower::Value`]s placed in buffers shared by
//!    liveness, and the folds evaluated once at load time. Each back end ([`back`]) compiles it at
//!    load time: [`back::wgsl::compile`] legalizes it for its kernels and generates one
//!    naga-validated WGSL [`back::wgsl::Kernel`] per distinct op, which `kiln-runtime` dispatches
//!    on wgpu; `kiln-runtime`'s CPU engine runs the same plan on native kernels.
//!
//! An [`artifact`] stores a plan with its spec and weight map in one versioned, checksummed file.
//! The [`interp`] module executes any graph, before or after optimization, in f32 on the CPU: the
//! definition of each op's meaning and the oracle for the optimizer and the kernels.
//! The pieces of that meaning the back ends compute the same way (block patterns, relative
//! buckets, norm rows, rotations, ALiBi slopes, activations) live in [`semantics`], which the
//! interpreter, the WGSL kernels and the CPU engine all follow.
//!
//! [`front_end`] runs stages 1 and 2 as one function; the CLI and the tests use it.
//!
//! **Architecture invariant**: this crate never depends on a GPU API. It produces IR and runs it on
//! the CPU; executing on a device is `kiln-runtime`'s job.
#![warn(missing_docs)]
// No panics on paths that input reaches: errors are values, and slices are read with `get`,
// patterns and iterators rather than `[]`. The few documented invariants that remain `expect`s or
// indexing say why they hold (`#[expect(..., reason)]`); tests may unwrap and index (clippy.toml).
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[cfg(test)]
mod architecture;
pub mod artifact;
pub mod autodiff;
pub mod back;
pub mod diag;
pub mod file;
pub mod graph;
pub mod interp;
pub mod lower;
pub mod memory;
pub mod optimize;
pub mod semantics;
pub mod spec;
pub mod target;
pub mod tensor;
pub mod train;

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
    let index = spec::SpanIndex::new(source);
    let fail_all = |diagnostics: Vec<Diagnostic>| SpecError { file: file.into(), source: source.into(), diagnostics };
    check_built(&spec, &graph, &index, &spec::Limits::default()).map_err(fail_all)?;
    graph.check().map_err(|e| {
        fail(Diagnostic::new("the graph is well-formed", format!("internal error, please report: {e}")))
    })?;
    check_weight_map(&spec, &graph, &index).map_err(fail_all)?;
    Ok(FrontEnd { spec, graph })
}

/// The spec's rules only its graph can check, all reported, in source order: the parameter count
/// bounds everything that will ever be allocated for weights (building is symbolic, so this is
/// cheap even for a huge spec), and every weight-map override names a parameter of the graph.
fn check_built(
    spec: &Resolved,
    graph: &Graph,
    index: &spec::SpanIndex,
    limits: &spec::Limits,
) -> Result<(), Vec<Diagnostic>> {
    let mut errors = Vec::new();
    let params = graph::build::param_elements(graph);
    if params > limits.parameters {
        errors.push(
            Diagnostic::new(
                "the parameter count is bounded",
                format!("the model would have {params} parameters, more than the limit {}", limits.parameters),
            )
            .with_key("model")
            .with_span(index.locate("model"))
            .with_help("check `model.d_model`, `model.vocab`, `model.layers` and `ffn.d_ff` for an extra digit"),
        );
    }
    // An override the graph never looks up is a mistake that would otherwise pass silently (a
    // tied head has no `head.weight`, a decoder-only model no `encoder.` parameters).
    let params = graph.params();
    let used: std::collections::BTreeSet<String> = params.iter().map(|(_, name)| template_of(name)).collect();
    for template in spec.spec.weights.tensors.keys() {
        if !params.iter().any(|(_, name)| spec::weightmap::match_template(template, name).is_some()) {
            let key = format!("weights.tensors.{template}");
            let help = diag::did_you_mean(template, used.iter().map(String::as_str))
                .map(|s| format!("did you mean `{s}`?"))
                .unwrap_or_else(|| "remove the entry; `kiln inspect` lists the model's parameters".into());
            errors.push(
                Diagnostic::new(
                    "weight-map keys name graph parameters",
                    format!("`{template}` is not a parameter of this model"),
                )
                .with_key(key.clone())
                .with_span(index.key(&key).unwrap_or_else(|| index.locate(&key)))
                .with_help(help),
            );
        }
    }
    errors.sort_by_key(|d| d.span.as_ref().map(|s| s.start));
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// Every parameter of the graph must have a weight-map entry (when the spec names a map at all).
fn check_weight_map(spec: &Resolved, graph: &Graph, index: &spec::SpanIndex) -> Result<(), Vec<Diagnostic>> {
    if spec.weights.entries.is_empty() {
        // No map: parameters are looked up under their canonical names (kiln's own checkpoints).
        return Ok(());
    }
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
    let mut parts = Vec::new();
    let mut prev = None;
    for part in param.split('.') {
        let numeric = part.chars().all(|c| c.is_ascii_digit());
        parts.push(match prev {
            Some("experts") if numeric => "{e}",
            Some(_) if numeric => "{i}",
            _ => part,
        });
        prev = Some(part);
    }
    parts.join(".")
}
