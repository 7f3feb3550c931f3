//! One differential test per rewrite rule: a small graph where the rule fires, run on the reference
//! interpreter before and after optimization (agreeing within 1e-5), and a check that it fired.

use kiln_compiler::graph::{Dim, Graph, InputRole, Op, Scalar, Sym};
use kiln_compiler::interp::{random_params, run};
use kiln_compiler::optimize::{CostModel, Limits, optimize_with, rules};
use kiln_compiler::spec::Activation;
use kiln_compiler::tensor::Tensor;
use petgraph::graph::NodeIndex;
use std::collections::HashMap;

const B: usize = 2;
const S: usize = 5;
const D: usize = 8;

fn input(g: &mut Graph) -> NodeIndex {
    let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
    let table = g.param("table", &[16, D]);
    g.add(Op::Gather, &[table, ids]).unwrap()
}

fn inputs() -> HashMap<String, Tensor> {
    HashMap::from([(
        "input_ids".to_string(),
        Tensor::i64(vec![B, S], (0..(B * S) as i64).map(|i| (i * 5 + 3) % 16).collect()),
    )])
}

/// Optimizes `g` with every rule, checks `rule` fired and the outputs are unchanged.
fn check(rule: &str, g: &Graph) {
    let (opt, report) = optimize_with(g, &Limits::default(), &CostModel::default(), &rules::phases()).unwrap();
    assert!(report.applied.get(rule).copied().unwrap_or(0) > 0, "`{rule}` did not fire: {:?}", report.applied);
    let params = random_params(g, 3);
    let before = run(g, &params, &inputs()).unwrap();
    let after = run(&opt, &params, &inputs()).unwrap();
    for ((_, a), (_, b)) in before.iter().zip(&after) {
        let err = a.max_abs_diff(b);
        assert!(err <= 1e-5, "`{rule}`: outputs differ by {err}");
    }
    assert!(
        kiln_compiler::optimize::dispatches(&opt) < kiln_compiler::optimize::dispatches(g),
        "`{rule}`: the optimized graph is not smaller"
    );
}

fn linear_graph(bias: bool, act: Option<Activation>, residual_left: Option<bool>) -> Graph {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let w = g.param("w", &[D, D]);
    let mut y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
    if bias {
        let b = g.param("b", &[D]);
        y = g.add(Op::Add, &[y, b]).unwrap();
    }
    if let Some(a) = act {
        y = g.add(Op::Act(a), &[y]).unwrap();
    }
    if let Some(left) = residual_left {
        y = if left { g.add(Op::Add, &[x, y]).unwrap() } else { g.add(Op::Add, &[y, x]).unwrap() };
    }
    g.outputs.push(("y".into(), y));
    g
}

#[test]
fn matmul_to_linear() {
    // A plain projection feeding an activation so the linear form is the cheaper one.
    check("matmul-to-linear", &linear_graph(false, Some(Activation::Relu), None));
}

#[test]
fn linear_bias() {
    check("linear-bias", &linear_graph(true, None, None));
}

#[test]
fn linear_act() {
    for act in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
        check("linear-act", &linear_graph(true, Some(act), None));
    }
}

#[test]
fn linear_residual() {
    check("linear-residual", &linear_graph(true, None, Some(true)));
}

#[test]
fn linear_residual_r() {
    check("linear-residual-r", &linear_graph(false, Some(Activation::Gelu), Some(false)));
}

/// Scores of shape [B, H, S, S] from the input, then the softmax variant asked for.
fn softmax_graph(alibi: bool, mask: Option<(bool, Option<usize>)>) -> Graph {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let q = g
        .add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(2), Dim::Fixed(4)] }, &[x])
        .unwrap();
    let q = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[q]).unwrap();
    let s = g.add(Op::MatMul { transpose_b: true }, &[q, q]).unwrap();
    let mut s = g.add(Op::Scale { factor: Scalar(0.5) }, &[s]).unwrap();
    if alibi {
        s = g.add(Op::Alibi, &[s]).unwrap();
    }
    if let Some((causal, window)) = mask {
        s = g.add(Op::Mask { causal, window }, &[s]).unwrap();
    }
    let p = g.add(Op::Softmax, &[s]).unwrap();
    g.outputs.push(("p".into(), p));
    g
}

#[test]
fn masked_softmax() {
    check("masked-softmax", &softmax_graph(false, Some((true, None))));
    check("masked-softmax", &softmax_graph(false, Some((true, Some(2)))));
}

#[test]
fn masked_softmax_alibi() {
    check("masked-softmax-alibi", &softmax_graph(true, Some((true, None))));
}

#[test]
fn scaled_softmax() {
    check("scaled-softmax", &softmax_graph(false, None));
}

#[test]
fn scaled_softmax_alibi() {
    check("scaled-softmax-alibi", &softmax_graph(true, None));
}

fn attention_graph(kv_heads: usize) -> Graph {
    let heads = 4;
    let hd = D / heads;
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let split = |g: &mut Graph, name: &str, h: usize| {
        let w = g.param(name, &[h * hd, D]);
        let y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        let y = g
            .add(
                Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(h), Dim::Fixed(hd)] },
                &[y],
            )
            .unwrap();
        g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap()
    };
    let q = split(&mut g, "q", heads);
    let mut k = split(&mut g, "k", kv_heads);
    let mut v = split(&mut g, "v", kv_heads);
    if kv_heads < heads {
        k = g.add(Op::RepeatHeads { times: heads / kv_heads }, &[k]).unwrap();
        v = g.add(Op::RepeatHeads { times: heads / kv_heads }, &[v]).unwrap();
    }
    let s = g.add(Op::MatMul { transpose_b: true }, &[q, k]).unwrap();
    let s = g.add(Op::Scale { factor: Scalar(0.7) }, &[s]).unwrap();
    let s = g.add(Op::Mask { causal: true, window: None }, &[s]).unwrap();
    let p = g.add(Op::Softmax, &[s]).unwrap();
    let c = g.add(Op::MatMul { transpose_b: false }, &[p, v]).unwrap();
    let c = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[c]).unwrap();
    let c = g.add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(D)] }, &[c]).unwrap();
    g.outputs.push(("c".into(), c));
    g
}

#[test]
fn attention() {
    check("attention", &attention_graph(4));
}

#[test]
fn attention_gqa() {
    check("attention-gqa", &attention_graph(2));
}

#[test]
fn every_rule_has_a_test() {
    let source = include_str!("rules.rs");
    for rule in rules::all() {
        let name = rule.name.to_string();
        assert!(source.contains(&format!("check(\"{name}\"")), "rule `{name}` has no differential test");
    }
}

#[test]
fn limits_stop_the_optimizer_with_a_valid_graph() {
    let g = attention_graph(2);
    let limits = Limits { nodes: 10, iterations: 1, time: std::time::Duration::from_millis(1) };
    let (opt, report) = optimize_with(&g, &limits, &CostModel::default(), &rules::phases()).unwrap();
    opt.check().unwrap();
    assert!(report.phases.iter().all(|(_, iters, _)| *iters <= 1), "{:?}", report.phases);
    let params = random_params(&g, 1);
    let before = run(&g, &params, &inputs()).unwrap();
    let after = run(&opt, &params, &inputs()).unwrap();
    assert!(before[0].1.max_abs_diff(&after[0].1) <= 1e-5);
}
