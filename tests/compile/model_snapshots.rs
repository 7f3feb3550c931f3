//! Snapshots of every IR stage for every spec in `models/`, driven by a glob: a new spec gets its
//! snapshots without new test code. Invariants are asserted before anything is snapshotted.

use kiln_compiler::front_end;
use kiln_compiler::graph::print;

#[test]
fn graph_of_every_model() {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"));
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| {
        insta::glob!("../../models", "*.toml", |path| {
            let name = format!("models/{}", path.file_name().unwrap().to_string_lossy());
            let source = std::fs::read_to_string(path).unwrap();
            let fe = front_end(&name, &source).unwrap_or_else(|e| panic!("{}", e.render()));

            // Invariants first: a well-typed acyclic graph, every parameter mapped to a tensor,
            // and a printer that gives the same text twice.
            fe.graph.check().unwrap_or_else(|e| panic!("{name}: {e}"));
            for (_, param) in fe.graph.params() {
                assert!(
                    fe.spec.weights.entries.is_empty() || fe.spec.weights.resolve(param).is_some(),
                    "{name}: `{param}` has no weight-map entry"
                );
            }
            let text = print::text(&fe.graph);
            assert_eq!(text, print::text(&fe.graph), "{name}: printer is not deterministic");

            let s = print::summary(&fe.graph, 128);
            let mut weights = String::new();
            for (_, param) in fe.graph.params() {
                if let Some(r) = fe.spec.weights.resolve(param) {
                    weights += &format!("{param} <- {}\n", r.tensor);
                }
            }
            let snapshot = format!(
                "## Summary\nparameters: {}\nmatmul FLOPs/token at seq 128: {}\nnodes: {} ({} compute), edges: {}\n\n## Weights\n{weights}\n## Graph\n{text}",
                s.parameters, s.flops_per_token, s.nodes, s.compute_nodes, s.edges
            );
            insta::assert_snapshot!("graph", snapshot);

            // The plan compiled for wgpu: every kernel is validated by naga inside `compile`; check
            // again here, then snapshot.
            let plan = kiln_compiler::lower::lower(&fe.graph);
            let program = kiln_compiler::back::wgsl::compile(&plan, &Default::default())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            for k in &program.kernels {
                kiln_compiler::back::wgsl::validate(&k.wgsl).unwrap_or_else(|e| panic!("{name}: {}: {e}", k.name));
            }
            let steps: Vec<String> = program
                .plan
                .steps
                .iter()
                .zip(&program.step_kernels)
                .map(|(s, k)| format!("{} kernel {k} ({}) -> v{}", s.scope, s.op.name(), s.output))
                .collect();
            let plan_text = format!(
                "## Plan
{} kernels, {} dispatches, {} shared buffers
{}

## Kernels
{}",
                program.kernels.len(),
                program.plan.steps.len(),
                program.plan.slots,
                steps.join("\n"),
                program.kernels_text()
            );
            insta::assert_snapshot!("wgsl", plan_text);

            // The optimized graph: checked, then snapshotted with the provenance of its fused ops.
            let (opt, report) = kiln_compiler::optimize::optimize(&fe.graph).unwrap_or_else(|e| panic!("{name}: {e}"));
            opt.check().unwrap_or_else(|e| panic!("{name}: optimized graph: {e}"));
            let mut explain = String::new();
            for n in opt.order() {
                let rules = kiln_compiler::optimize::explain(&opt, n);
                if !rules.is_empty() {
                    explain += &format!("{} in {} <- {}\n", opt.g[n].op.name(), opt.g[n].scope, rules.join(", "));
                }
            }
            let optimized = format!(
                "## Dispatches\n{} -> {}\n\n## Rules applied\n{:?}\n\n## Fused ops\n{explain}\n## Graph\n{}",
                report.dispatches.0,
                report.dispatches.1,
                report.applied,
                print::text(&opt)
            );
            insta::assert_snapshot!("optimized", optimized);
        });
    });
}

#[test]
fn dot_output_is_well_formed() {
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/llama.toml")).unwrap();
    let fe = front_end("models/llama.toml", &source).unwrap();
    let dot = print::dot(&fe.graph);
    assert!(dot.starts_with("digraph \"llama\" {"));
    assert!(dot.trim_end().ends_with('}'));
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());
    assert!(dot.contains("label=\"layers.0\""), "blocks are drawn as clusters");
    assert!(dot.contains("label=\"attn\""), "a block's parts are drawn as clusters inside it");
    assert!(dot.contains("out_logits"));
}
