//! The optimizer on every model: the optimized graph computes what the unoptimized one does (on
//! the reference interpreter), with fewer dispatches.

use kiln_compiler::graph::Op;
use kiln_compiler::graph::print::block_of;
use kiln_compiler::interp::{random_params, run, sample_inputs};
use kiln_compiler::optimize::{explain, optimize};

#[test]
fn optimized_graphs_agree_with_unoptimized_ones() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let source = std::fs::read_to_string(&path).unwrap();
        let fe = kiln_compiler::front_end(&path.display().to_string(), &source).unwrap();
        let (opt, report) = optimize(&fe.graph).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        println!(
            "{}: dispatches {} -> {}, {:?}, {:.1} ms",
            fe.graph.name, report.dispatches.0, report.dispatches.1, report.applied, report.optimize_ms
        );
        assert!(report.dispatches.1 < report.dispatches.0, "{}: optimization removes dispatches", fe.graph.name);
        let params = random_params(&fe.graph, 5).unwrap();
        let inputs = sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 2, 5).unwrap();
        let before = run(&fe.graph, &params, &inputs).unwrap();
        let after = run(&opt, &params, &inputs).unwrap();
        for ((n, a), (m, b)) in before.iter().zip(&after) {
            assert_eq!(n, m);
            let err = a.max_abs_diff(b);
            assert!(
                err <= 1e-5 * a.as_f32().unwrap().iter().fold(1.0f32, |x, y| x.max(y.abs())),
                "{}: {n} differs by {err}",
                fe.graph.name
            );
        }
    }
}

/// A time limit of zero stops every rule phase after its first iteration (egg checks the limit
/// between iterations), and the optimizer falls back to the best graph the e-graph holds then:
/// valid, and computing what the unoptimized graph does, on every model.
#[test]
fn an_exhausted_time_limit_stops_every_phase_with_a_valid_graph() {
    use kiln_compiler::optimize::{CostModel, Limits, optimize_with, rules};
    let limits = Limits { time: std::time::Duration::ZERO, ..Limits::default() };
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let source = std::fs::read_to_string(&path).unwrap();
        let fe = kiln_compiler::front_end(&path.display().to_string(), &source).unwrap();
        let (opt, report) = optimize_with(&fe.graph, &limits, &CostModel::default(), &rules::phases()).unwrap();
        for (phase, iterations, reason) in &report.phases {
            assert!(reason.starts_with("TimeLimit"), "{}: phase {phase} stopped by {reason}", fe.graph.name);
            assert!(*iterations <= 1, "{}: phase {phase} ran {iterations} iterations", fe.graph.name);
        }
        opt.check().unwrap();
        let params = random_params(&fe.graph, 6).unwrap();
        let inputs = sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 1, 4).unwrap();
        let before = run(&fe.graph, &params, &inputs).unwrap();
        let after = run(&opt, &params, &inputs).unwrap();
        for ((n, a), (_, b)) in before.iter().zip(&after) {
            let scale = a.as_f32().unwrap().iter().fold(1.0f32, |x, y| x.max(y.abs()));
            assert!(a.max_abs_diff(b) <= 1e-5 * scale, "{}: {n} differs", fe.graph.name);
        }
    }
}

/// `scale-into-table` folds an embedding scale into the table only when nothing else reads it: a
/// tied head reads Gemma 3's table, so the scale stays after the gather (folding would hold a
/// second, scaled copy of the vocabulary's table); untied, the scale folds into the table.
#[test]
fn embedding_scales_fold_only_into_tables_nothing_else_reads() {
    use kiln_compiler::graph::Op;
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/gemma3.toml")).unwrap();
    for (tied, folded) in [(true, false), (false, true)] {
        let source = if tied { source.clone() } else { source.replace("[ffn]", "[head]\ntied = false\n\n[ffn]") };
        let fe = kiln_compiler::front_end("gemma3.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
        let (opt, report) = optimize(&fe.graph).unwrap();
        let gathers_scaled_table = opt
            .g
            .node_indices()
            .any(|n| opt.g[n].op == Op::Gather && matches!(opt.g[opt.operands(n)[0]].op, Op::Scale { .. }));
        assert_eq!(gathers_scaled_table, folded, "tied head: {tied}");
        assert_eq!(report.applied.contains_key("scale-into-table"), folded, "tied head: {tied}");
    }
}

/// Every model's specs, parsed.
fn models() -> Vec<kiln_compiler::FrontEnd> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models");
    let mut paths: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    paths
        .iter()
        .map(|path| kiln_compiler::front_end(&path.display().to_string(), &std::fs::read_to_string(path).unwrap()))
        .collect::<Result<_, _>>()
        .unwrap()
}

/// Provenance is what fired: on every model, each rule `explain` names for an op fired, and an op
/// of a kind the graph as built lacks (a fused op) names the rules that made it.
#[test]
fn explain_names_the_rules_that_fired() {
    for fe in models() {
        let name = &fe.graph.name;
        let (opt, report) = optimize(&fe.graph).unwrap();
        let built: std::collections::HashSet<(String, String)> =
            fe.graph.g.node_weights().map(|n| (n.op.name(), n.op.attrs())).collect();
        for n in opt.g.node_indices() {
            let node = &opt.g[n];
            let rules = explain(&opt, n);
            for r in &rules {
                assert!(report.applied.contains_key(*r), "{name}: `{r}` is named but did not fire");
            }
            if rules.is_empty() {
                let kind = (node.op.name(), node.op.attrs());
                assert!(built.contains(&kind), "{name}: {} in `{}` names no rule", kind.0, node.scope);
            }
        }
    }
}

/// With post-norm blocks the fused Q/K/V projection reads the previous block's output, and is
/// still credited to the attention it serves (the scope of the ops it replaces), never to the
/// block it reads from.
#[test]
fn fused_ops_take_the_scope_of_the_ops_they_replace() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/gpt2.toml");
    let source = std::fs::read_to_string(path).unwrap().replace("placement = \"pre\"", "placement = \"post\"");
    assert!(source.contains("placement = \"post\""));
    let fe = kiln_compiler::front_end("gpt2-post.toml", &source).unwrap();
    let (opt, _) = optimize(&fe.graph).unwrap();
    let mut projections = 0;
    for n in opt.g.node_indices() {
        let node = &opt.g[n];
        let rules = explain(&opt, n);
        if rules.contains(&"shared-input-merge-bias") && matches!(node.op, Op::Linear { .. }) {
            projections += 1;
            let part = block_of(&node.scope).map(|(_, _, part)| part);
            assert_eq!(part, Some("attn"), "the merged Q/K/V projection is in `{}`", node.scope);
        }
        if !rules.is_empty() {
            assert!(block_of(&node.scope).is_some() || node.scope == "head", "{} in `{}`", node.op.name(), node.scope);
        }
    }
    assert_eq!(projections, fe.spec.layers() as usize, "one merged projection per block");
}
