//! Temporary: where a CPU training step's time goes, by op.
use kiln_compiler::autodiff::gradients;
use kiln_compiler::lower;
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::{LOSS, Objective, loss_graph, on_tensors};
use kiln_runtime::cpu::CpuModel;
use kiln_runtime::train::init;
use std::collections::HashMap;

fn main() {
    let path = std::env::args().nth(1).unwrap();
    let batch: usize = std::env::args().nth(2).map_or(12, |s| s.parse().unwrap());
    let seq: usize = std::env::args().nth(3).map_or(64, |s| s.parse().unwrap());
    let threads: usize = std::env::args().nth(4).map_or(2, |s| s.parse().unwrap());
    let source = std::fs::read_to_string(&path).unwrap();
    let fe = kiln_compiler::front_end(&path, &source).unwrap();
    let params: HashMap<String, Tensor> = init::initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let dims = PackDims::of(&fe.spec);
    let (eval, _uses) =
        on_tensors(&loss_graph(&fe.graph, Objective { label_smoothing: 0.0 }).unwrap(), &fe.spec.weights, &dims)
            .unwrap();
    let graph = gradients(&eval, LOSS, |_| true).unwrap();
    let graph = if std::env::var("OPT").is_ok() {
        let t = std::time::Instant::now();
        let (g, report) = kiln_compiler::optimize::optimize_for(&graph, &kiln_compiler::target::Target::cpu()).unwrap();
        eprintln!(
            "optimized in {:.2}s: {:?} {:?} {:?}",
            t.elapsed().as_secs_f64(),
            report.applied,
            report.dispatches,
            report.phases
        );
        g
    } else {
        graph
    };
    let plan = if std::env::var("NOFOLD").is_ok() {
        lower::lower_with(&graph, lower::Options { fold_constants: false, ..Default::default() })
    } else {
        lower::lower(&graph)
    };
    let mut model = CpuModel::new(plan.clone(), &params, &HashMap::new(), threads, &()).unwrap();
    let vocab = fe.spec.spec.model.vocab as i64;
    let ids: Vec<i64> = (0..batch * seq).map(|i| (i as i64 * 7919) % vocab).collect();
    let labels: Vec<i64> = (0..batch * seq).map(|i| (i as i64 * 104729 + 3) % vocab).collect();
    let given = HashMap::from([
        ("input_ids".to_string(), Tensor::i64(vec![batch, seq], ids)),
        ("labels".to_string(), Tensor::i64(vec![batch, seq], labels)),
    ]);
    model.profile(&given).unwrap();
    let mut total = vec![0.0; plan.steps.len()];
    let runs = 5;
    for _ in 0..runs {
        let t = model.profile(&given).unwrap();
        for (a, b) in total.iter_mut().zip(t) {
            *a += b / runs as f64;
        }
    }
    let t0 = std::time::Instant::now();
    for _ in 0..runs {
        model.set_params(params.clone(), HashMap::new(), &()).unwrap();
    }
    let set = t0.elapsed().as_secs_f64() / runs as f64;
    let mut by: HashMap<String, (f64, usize)> = HashMap::new();
    for (s, t) in plan.steps.iter().zip(&total) {
        let shapes: Vec<String> = s.operands.iter().map(|&o| format!("{:?}", plan.values[o].shape)).collect();
        let key = format!(
            "{} {}",
            s.op.name(),
            if std::env::var("SHAPES").is_ok() { shapes.join(" ") } else { String::new() }
        );
        let e = by.entry(key).or_default();
        e.0 += t;
        e.1 += 1;
    }
    let mut v: Vec<_> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    let sum: f64 = total.iter().sum();
    println!(
        "steps {} total {:.2} ms, set_params {:.2} ms, folds {}",
        plan.steps.len(),
        sum * 1e3,
        set * 1e3,
        plan.folds.len()
    );
    for (k, (t, n)) in v.iter().take(40) {
        println!("{:8.2} ms {:4} {}", t * 1e3, n, k);
    }
}
