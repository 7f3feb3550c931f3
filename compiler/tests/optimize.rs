//! The optimizer on every model: the optimized graph computes what the unoptimized one does (on
//! the reference interpreter), with fewer dispatches.

use kiln_compiler::interp::{random_params, run, sample_inputs};
use kiln_compiler::optimize::optimize;

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
