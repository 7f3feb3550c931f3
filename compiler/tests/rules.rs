//! One differential test per rewrite rule: a small graph where the rule fires, run on the reference
//! interpreter before and after optimization (agreeing within 1e-5), and a check that it fired.

use kiln_compiler::graph::{Activation, Dim, Graph, InputRole, Op, PackedAttention, PairStyle, Scalar, Sym};
use kiln_compiler::interp::{random_params, run};
use kiln_compiler::optimize::{CostModel, Limits, dispatches, explain, optimize_with, rules};
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

/// Optimizes `g` with every rule, checks `rule` fired, the outputs are unchanged and the
/// optimized graph dispatches fewer kernels.
fn check(rule: &str, g: &Graph) -> Graph {
    let opt = check_same(rule, g);
    assert!(
        kiln_compiler::optimize::dispatches(&opt) < kiln_compiler::optimize::dispatches(g),
        "`{rule}`: the optimized graph is not smaller"
    );
    opt
}

/// As [`check`], for rules that remove nodes without removing dispatches (reshapes).
fn check_nodes(rule: &str, g: &Graph) -> Graph {
    let opt = check_same(rule, g);
    assert!(opt.g.node_count() < g.g.node_count(), "`{rule}`: the optimized graph is not smaller");
    opt
}

fn check_same(rule: &str, g: &Graph) -> Graph {
    check_with(rule, g, &CostModel::default())
}

/// As [`check`], under a given cost model.
fn check_with(rule: &str, g: &Graph, model: &CostModel) -> Graph {
    check_inputs(rule, g, model, &inputs())
}

/// As [`check_with`], on given inputs.
fn check_inputs(rule: &str, g: &Graph, model: &CostModel, inputs: &HashMap<String, Tensor>) -> Graph {
    let (opt, report) = optimize_with(g, &Limits::default(), model, &rules::phases()).unwrap();
    assert!(report.applied.get(rule).copied().unwrap_or(0) > 0, "`{rule}` did not fire: {:?}", report.applied);
    check_provenance(rule, &opt, &report);
    let params = random_params(g, 3).unwrap();
    let before = run(g, &params, inputs).unwrap();
    let after = run(&opt, &params, inputs).unwrap();
    for ((_, a), (_, b)) in before.iter().zip(&after) {
        let err = a.max_abs_diff(b);
        assert!(err <= 1e-5, "`{rule}`: outputs differ by {err}: {:?} vs {:?}", a.shape, b.shape);
    }
    opt
}

/// Rules that may fire without the optimized graph keeping a node they made: an elimination's
/// result is a node the graph already had (`permute(permute(x)) = x`), so nothing records it;
/// an enabling form may lose to another derivation of the same op (the weights stacked the other
/// way round, the heads of a whole projection rather than of its slices, an input's gradient read
/// from a transposed weight the forward makes anyway).
const UNNAMED: &[&str] = &[
    "permute-permute",
    "permute-identity",
    "reshape-reshape",
    "reshape-identity",
    "concat-assoc",
    "append-assoc",
    "slice-whole",
    "heads-split-whole",
    // Its `matmul_t` becomes a `linear` (named by `matmul-to-linear`), or loses to the product
    // reading the transposed weight the forward computes anyway.
    "matmul-transposed-weight",
];

/// Provenance: every rule `explain` names for an op of `opt` fired, and `rule` (which fired) is
/// named by an op it made, unless it is one of [`UNNAMED`].
fn check_provenance(rule: &str, opt: &Graph, report: &kiln_compiler::optimize::Report) {
    let mut named = std::collections::BTreeSet::new();
    for n in opt.g.node_indices() {
        for r in explain(opt, n) {
            assert!(report.applied.contains_key(r), "`{r}` is named but did not fire: {:?}", report.applied);
            named.insert(r);
        }
    }
    if !UNNAMED.contains(&rule) {
        assert!(named.contains(rule), "`{rule}` fired but no op names it: {named:?}");
    }
}

/// The names of the optimized graph's ops.
fn ops(g: &Graph) -> Vec<String> {
    g.g.node_weights().map(|n| n.op.name()).collect()
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
    attention_graph_with(kv_heads, false, None)
}

/// Attention over projections of one input, with biases and RoPE if asked.
fn attention_graph_with(kv_heads: usize, bias: bool, rope: Option<PairStyle>) -> Graph {
    attention_step_graph(kv_heads, bias, rope, false)
}

/// [`attention_graph_with`], and with `cached` a decoder step's: the keys and values appended to
/// caches `past_k`, `past_v` (the presents are outputs too).
fn attention_step_graph(kv_heads: usize, bias: bool, rope: Option<PairStyle>, cached: bool) -> Graph {
    let heads = 4;
    let hd = D / heads;
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let split = |g: &mut Graph, name: &str, h: usize| {
        let w = g.param(name, &[h * hd, D]);
        let mut y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        if bias {
            let b = g.param(&format!("{name}.bias"), &[h * hd]);
            y = g.add(Op::Add, &[y, b]).unwrap();
        }
        let y = g
            .add(
                Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(h), Dim::Fixed(hd)] },
                &[y],
            )
            .unwrap();
        g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap()
    };
    let mut q = split(&mut g, "q", heads);
    let mut k = split(&mut g, "k", kv_heads);
    let mut v = split(&mut g, "v", kv_heads);
    if let Some(style) = rope {
        let op = Op::Rope { theta: Scalar(100.0), rotary_dim: hd, style };
        q = g.add(op.clone(), &[q]).unwrap();
        k = g.add(op, &[k]).unwrap();
    }
    if cached {
        let role = InputRole::Cache { kv_heads, head_dim: hd, window: None };
        for (name, x) in [("past_k", &mut k), ("past_v", &mut v)] {
            let past = g.add(Op::Input { name: name.into(), role, seq: Sym::Past }, &[]).unwrap();
            *x = g.add(Op::Concat { axis: 2 }, &[past, *x]).unwrap();
            g.outputs.push((name.replace("past", "present"), *x));
        }
    }
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

/// An attention's three gradients, as autodiff builds them for a causal attention with grouped
/// heads and without, as one `attention_grad` (on the CPU's target, costed at 2048 tokens where
/// it pays; every score modifier's chain is checked on whole models in `tests/autodiff.rs`).
#[test]
fn attention_grad() {
    use kiln_compiler::target::Target;
    for kv_heads in [4, 2] {
        let mut g = attention_graph(kv_heads);
        let c = g.outputs[0].1;
        let w = g.param("loss.w", &[D]);
        let mut loss = g.add(Op::Mul, &[c, w]).unwrap();
        for axis in 0..3 {
            loss = g.add(Op::SumAxis { axis }, &[loss]).unwrap();
        }
        g.outputs = vec![("loss".into(), loss)];
        let g = kiln_compiler::autodiff::gradients(&g, "loss", |name| name != "loss.w").unwrap();
        let target = Target { cost: CostModel { seq: 2048, ..CostModel::cpu() }, ..Target::cpu() };
        let (opt, report) =
            kiln_compiler::optimize::optimize_target(&g, &Limits::default(), &target, &rules::phases()).unwrap();
        assert!(report.applied.get("attention-grad").is_some_and(|&n| n > 0), "{:?}", report.applied);
        check_provenance("attention-grad", &opt, &report);
        assert_eq!(ops(&opt).iter().filter(|o| *o == "attention_grad").count(), 1, "{:?}", ops(&opt));
        assert!(!ops(&opt).contains(&"masked_softmax".to_string()), "the probabilities are kept: {:?}", ops(&opt));
        let params = random_params(&g, 3).unwrap();
        let (before, after) = (run(&g, &params, &inputs()).unwrap(), run(&opt, &params, &inputs()).unwrap());
        for ((name, a), (_, b)) in before.iter().zip(&after) {
            let scale = a.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let err = a.max_abs_diff(b);
            assert!(err <= 1e-5 * scale, "`{name}` differs by {err} (scale {scale})");
        }
    }
}

#[test]
fn attention_gqa() {
    check("attention-gqa", &attention_graph(2));
}

#[test]
fn attention_packed() {
    let opt = check("attention-packed", &attention_graph(4));
    assert!(ops(&opt).contains(&"packed_attention".to_string()), "{:?}", ops(&opt));
    // Three projections merged pairwise: the pairs stacked, then re-associated and re-sliced.
    for rule in ["shared-input-merge", "slice-slice", "concat-assoc"] {
        check(rule, &attention_graph(2));
    }
    let opt = check("shared-input-merge-bias", &attention_graph_with(2, true, None));
    assert!(ops(&opt).contains(&"packed_attention".to_string()), "{:?}", ops(&opt));
}

#[test]
fn attention_packed_rope() {
    // Heads of 2 columns rotate in the WGSL projection's scalar form, which the default model
    // prices at several times the `vec4` form: priced alike, the fusion pays.
    let alike = CostModel { scalar_projection: 1.0, ..CostModel::default() };
    for style in [PairStyle::RotateHalf, PairStyle::Interleaved] {
        let opt = check_with("attention-packed-rope", &attention_graph_with(2, false, Some(style)), &alike);
        assert!(ops(&opt).contains(&"linear_rope".to_string()), "{:?}", ops(&opt));
        let opt = check_with("attention-packed-rope-bias", &attention_graph_with(4, true, Some(style)), &alike);
        assert!(ops(&opt).contains(&"linear_bias_rope".to_string()), "{:?}", ops(&opt));
        // Under the default model the scalar form's price keeps the rotation out of the projection.
        let (opt, _) = optimize_with(
            &attention_graph_with(2, false, Some(style)),
            &Limits::default(),
            &CostModel::default(),
            &rules::phases(),
        )
        .unwrap();
        assert!(!ops(&opt).contains(&"linear_rope".to_string()), "{:?}", ops(&opt));
    }
}

/// A decoder step's attention over a cache: the rotation moves into the projection's epilogue,
/// the attention reads the rotated queries in place, and the caches append the rotated keys and
/// the values straight from the projection (the three rewritten together); without rotations the
/// attention alone is rewritten. Either way the two appends are those the WGSL back end runs in
/// the attention's own dispatch.
#[test]
fn attention_cached() {
    let alike = CostModel { scalar_projection: 1.0, ..CostModel::default() };
    let mut given = inputs();
    for (name, seed) in [("past_k", 0.7f32), ("past_v", 1.3)] {
        let values = (0..B * 2 * 3 * 2).map(|i| (i as f32 * seed).sin()).collect();
        given.insert(name.into(), Tensor::f32(vec![B, 2, 3, 2], values));
    }
    let cases = [
        ("attention-cached-rope", false, Some(PairStyle::RotateHalf), "linear_rope"),
        ("attention-cached-rope", false, Some(PairStyle::Interleaved), "linear_rope"),
        ("attention-cached-rope-bias", true, Some(PairStyle::RotateHalf), "linear_bias_rope"),
        ("attention-cached-rope-bias", true, Some(PairStyle::Interleaved), "linear_bias_rope"),
        ("attention-cached", false, None, "matmul_t"),
        ("attention-cached-bias", true, None, "linear_bias"),
    ];
    for (rule, bias, rope, projection) in cases {
        let g = attention_step_graph(2, bias, rope, true);
        let opt = check_inputs(rule, &g, &alike, &given);
        let names = ops(&opt);
        assert!(
            names.contains(&projection.to_string()) && names.contains(&"packed_attention".to_string()),
            "{names:?}"
        );
        assert!(!opt.g.node_weights().any(|n| matches!(n.op, Op::Heads { rope: Some(_), .. })), "{names:?}");
        // Past the embedding: the projection and the attention, which appends to the caches.
        assert_eq!(
            kiln_compiler::optimize::folded_appends(&opt).len(),
            2,
            "{}",
            kiln_compiler::graph::print::text(&opt)
        );
        assert_eq!(dispatches(&opt), 3, "{names:?}");
    }
}

/// What a score test puts between the scale and the softmax.
#[derive(Clone, Copy)]
enum Modifier {
    SoftCap,
    Relative { bidirectional: bool },
    Sparse,
}

/// Attention over projections of one input (or, unless `whole`, only its probabilities) with
/// `modifier` after the scale, a causal mask (not with a block pattern) and a key mask when `masked`.
fn modified_graph(modifier: Modifier, masked: bool, whole: bool) -> Graph {
    let (heads, hd) = (2, D / 2);
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let mask = masked.then(|| {
        let role = InputRole::KeyMask { pad_is_one: false };
        g.add(Op::Input { name: "attention_mask".into(), role, seq: Sym::Seq }, &[]).unwrap()
    });
    let split = |g: &mut Graph, name: &str| {
        let w = g.param(name, &[D, D]);
        let y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(heads), Dim::Fixed(hd)];
        let y = g.add(Op::Reshape { shape }, &[y]).unwrap();
        g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap()
    };
    let (q, k, v) = (split(&mut g, "q"), split(&mut g, "k"), split(&mut g, "v"));
    let s = g.add(Op::MatMul { transpose_b: true }, &[q, k]).unwrap();
    let mut s = g.add(Op::Scale { factor: Scalar(0.9) }, &[s]).unwrap();
    let mut causal = true;
    match modifier {
        Modifier::SoftCap => s = g.add(Op::SoftCap { cap: Scalar(1.5) }, &[s]).unwrap(),
        Modifier::Relative { bidirectional } => {
            causal = !bidirectional;
            let table = g.param("bias_table", &[6, heads]);
            let (q, k) = (Dim::Sym(Sym::Seq), Dim::Sym(Sym::Seq));
            let op = Op::RelativeBias { buckets: 6, max_distance: 4, bidirectional, q, k };
            let bias = g.add(op, &[table]).unwrap();
            s = g.add(Op::Add, &[s, bias]).unwrap();
        }
        Modifier::Sparse => {
            let op = Op::BlockSparseMask { block: 2, global: 1, window: 0, random: 1, seed: 3 };
            let operands: Vec<NodeIndex> = std::iter::once(s).chain(mask).collect();
            s = g.add(op, &operands).unwrap();
        }
    }
    if !matches!(modifier, Modifier::Sparse) && (masked || causal) {
        let operands: Vec<NodeIndex> = std::iter::once(s).chain(mask).collect();
        s = g.add(Op::Mask { causal, window: None }, &operands).unwrap();
    }
    let p = g.add(Op::Softmax, &[s]).unwrap();
    if !whole {
        g.outputs.push(("p".into(), p));
        return g;
    }
    let c = g.add(Op::MatMul { transpose_b: false }, &[p, v]).unwrap();
    let c = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[c]).unwrap();
    let c = g.add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(D)] }, &[c]).unwrap();
    g.outputs.push(("c".into(), c));
    g
}

/// The rule inputs plus a key mask hiding the last token of the second sequence.
fn masked_inputs() -> HashMap<String, Tensor> {
    let mut i = inputs();
    let mask = (0..B * S).map(|j| if j == B * S - 1 { 0.0 } else { 1.0 }).collect();
    i.insert("attention_mask".into(), Tensor::f32(vec![B, S], mask));
    i
}

/// Checks `rule` on the probabilities alone (the fused softmax) and on the whole attention (the
/// modifier carried into the attention kernel, packed or not).
fn check_modified(rule: &str, modifier: Modifier, masked: bool) {
    let model = CostModel::default();
    let opt = check_inputs(rule, &modified_graph(modifier, masked, false), &model, &masked_inputs());
    assert!(ops(&opt).contains(&"masked_softmax".to_string()), "{:?}", ops(&opt));
    let opt = check_inputs(rule, &modified_graph(modifier, masked, true), &model, &masked_inputs());
    let attention = opt.g.node_weights().find(|n| matches!(n.op, Op::Attention { .. } | Op::PackedAttention(_)));
    let Some(attention) = attention else { panic!("`{rule}`: no attention kernel in {:?}", ops(&opt)) };
    let mods = match &attention.op {
        Op::Attention { mods, .. } | Op::PackedAttention(PackedAttention { mods, .. }) => *mods,
        _ => unreachable!(),
    };
    assert!(!mods.is_plain(), "`{rule}`: the attention kernel lost the modifier: {:?}", attention.op);
    assert!(
        !ops(&opt).iter().any(|o| o == "softcap" || o == "relative_bias" || o == "block_sparse_mask"),
        "{:?}",
        ops(&opt)
    );
}

#[test]
fn softcap_fuses_into_attention() {
    check_modified("masked-softmax-softcap", Modifier::SoftCap, false);
    check_modified("masked-softmax-softcap", Modifier::SoftCap, true);
}

#[test]
fn scaled_softmax_softcap() {
    // Soft-capped scores with nothing masked (an encoder without padding).
    let mut g = softmax_graph(false, None);
    let softmax = g.outputs[0].1;
    let scaled = g.operands(softmax)[0];
    let capped = g.add(Op::SoftCap { cap: Scalar(2.0) }, &[scaled]).unwrap();
    let p = g.add(Op::Softmax, &[capped]).unwrap();
    g.outputs[0].1 = p;
    check("scaled-softmax-softcap", &g);
}

#[test]
fn relative_bias_fuses_into_attention() {
    check_modified("masked-softmax-relative", Modifier::Relative { bidirectional: false }, false);
    check_modified("masked-softmax-relative", Modifier::Relative { bidirectional: true }, true);
    check_modified("scaled-softmax-relative", Modifier::Relative { bidirectional: true }, false);
}

#[test]
fn block_sparsity_fuses_into_attention() {
    check_modified("sparse-softmax", Modifier::Sparse, true);
    check_modified("sparse-softmax-unmasked", Modifier::Sparse, false);
}

/// Linformer's key (and, if `both`, value) projections of one input, each projected along the
/// sequence by its own `[rows, r]` matrix cut to the sequence, as the graph builder writes them.
fn low_rank_graph(both: bool) -> Graph {
    let (heads, hd, r) = (2, D / 2, 3);
    let mut g = Graph::new("t");
    let x = input(&mut g);
    for name in if both { &["k", "v"][..] } else { &["k"][..] } {
        let name = *name;
        let w = g.param(name, &[D, D]);
        let y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(heads), Dim::Fixed(hd)];
        let y = g.add(Op::Reshape { shape }, &[y]).unwrap();
        let y = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap();
        // More rows than the cost model's sequence: only the first `n` are read.
        let e = g.param(&format!("{name}.proj"), &[4096, r]);
        let e = g.add(Op::Truncate { len: Dim::Sym(Sym::Seq) }, &[e]).unwrap();
        let t = g.add(Op::Permute { perm: vec![0, 1, 3, 2] }, &[y]).unwrap();
        let p = g.add(Op::MatMul { transpose_b: false }, &[t, e]).unwrap();
        let p = g.add(Op::Permute { perm: vec![0, 1, 3, 2] }, &[p]).unwrap();
        g.outputs.push((name.into(), p));
    }
    g
}

#[test]
fn low_rank() {
    let opt = check("low-rank", &low_rank_graph(false));
    assert_eq!(ops(&opt).iter().filter(|o| *o == "low_rank").count(), 1, "{:?}", ops(&opt));
    // Where dispatches are dear, the two projections merge into one and each low-rank
    // projection reads its columns of the merged one.
    let gpu = CostModel { dispatch: 1e7, ..CostModel::default() };
    let opt = check_with("low-rank-slice", &low_rank_graph(true), &gpu);
    assert!(ops(&opt).contains(&"concat".to_string()), "{:?}", ops(&opt));
}

/// `act(x Wg^T [+ bg]) * (x Wu^T [+ bu])`, after a norm if asked.
fn gated_graph(bias: bool, norm: Option<bool>) -> Graph {
    let mut g = Graph::new("t");
    let mut x = input(&mut g);
    if let Some(rms) = norm {
        let gain = g.param("norm.weight", &[D]);
        x = if rms {
            g.add(Op::RmsNorm { eps: Scalar(1e-6) }, &[x, gain]).unwrap()
        } else {
            let beta = g.param("norm.bias", &[D]);
            g.add(Op::LayerNorm { eps: Scalar(1e-5) }, &[x, gain, beta]).unwrap()
        };
    }
    let proj = |g: &mut Graph, name: &str| {
        let w = g.param(name, &[12, D]);
        let mut y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        if bias {
            let b = g.param(&format!("{name}.bias"), &[12]);
            y = g.add(Op::Add, &[y, b]).unwrap();
        }
        y
    };
    let gate = proj(&mut g, "gate");
    let up = proj(&mut g, "up");
    let gate = g.add(Op::Act(Activation::Silu), &[gate]).unwrap();
    let y = g.add(Op::Mul, &[gate, up]).unwrap();
    g.outputs.push(("y".into(), y));
    g
}

#[test]
fn gated_linear() {
    let opt = check("gated-linear", &gated_graph(false, None));
    assert!(ops(&opt).contains(&"linear_glu_silu".to_string()), "{:?}", ops(&opt));
    check("gated-linear-bias", &gated_graph(true, None));
}

/// `norm(x)`: an RMSNorm if `rms`, else a LayerNorm with a bias.
fn normed(g: &mut Graph, x: NodeIndex, rms: bool) -> NodeIndex {
    let gain = g.param("norm.weight", &[D]);
    if rms {
        g.add(Op::RmsNorm { eps: Scalar(1e-6) }, &[x, gain]).unwrap()
    } else {
        let beta = g.param("norm.bias", &[D]);
        g.add(Op::LayerNorm { eps: Scalar(1e-5) }, &[x, gain, beta]).unwrap()
    }
}

/// `norm(x) W^T`, norm given by `rms`.
fn norm_linear_graph(rms: bool) -> Graph {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let h = normed(&mut g, x, rms);
    let w = g.param("w", &[12, D]);
    let y = g.add(Op::MatMul { transpose_b: true }, &[h, w]).unwrap();
    let y = g.add(Op::Act(Activation::Gelu), &[y]).unwrap();
    g.outputs.push(("y".into(), y));
    g
}

#[test]
fn norm_prologues() {
    // An RMSNorm prologue is one pass over the rows (the sum of squares beside the dot products),
    // so it pays everywhere; a LayerNorm prologue makes two more passes in every invocation, which
    // on lavapipe (the default, calibrated model) costs more than the dispatch it saves, and pays
    // where dispatches are dear (a discrete GPU).
    let (opt, _) =
        optimize_with(&norm_linear_graph(true), &Limits::default(), &CostModel::default(), &rules::phases()).unwrap();
    assert!(ops(&opt).contains(&"rms_norm_linear_gelu".to_string()), "{:?}", ops(&opt));
    let (opt, _) =
        optimize_with(&norm_linear_graph(false), &Limits::default(), &CostModel::default(), &rules::phases()).unwrap();
    assert!(ops(&opt).contains(&"layer_norm".to_string()), "{:?}", ops(&opt));
    let gpu = CostModel { dispatch: 1e7, ..CostModel::default() };
    let opt = check_with("norm-prologue-rms", &norm_linear_graph(true), &gpu);
    assert!(ops(&opt).contains(&"rms_norm_linear_gelu".to_string()), "{:?}", ops(&opt));
    let opt = check_with("norm-prologue-ln", &norm_linear_graph(false), &gpu);
    assert!(ops(&opt).contains(&"layer_norm_linear_gelu".to_string()), "{:?}", ops(&opt));
    let opt = check_with("norm-prologue-rms-x", &gated_graph(false, Some(true)), &gpu);
    assert!(ops(&opt).contains(&"rms_norm_linear_glu_silu".to_string()), "{:?}", ops(&opt));
    let opt = check_with("norm-prologue-ln-x", &gated_graph(false, Some(false)), &gpu);
    assert!(ops(&opt).contains(&"layer_norm_linear_glu_silu".to_string()), "{:?}", ops(&opt));
}

/// `norm(a + b)` with `a`, `b` two embeddings of the ids.
fn add_norm_graph(rms: bool) -> Graph {
    let mut g = Graph::new("t");
    let a = input(&mut g);
    let ids = g.inputs()[0].0;
    let t2 = g.param("table2", &[16, D]);
    let b = g.add(Op::Gather, &[t2, ids]).unwrap();
    let s = g.add(Op::Add, &[a, b]).unwrap();
    let gain = g.param("norm.weight", &[D]);
    let y = if rms {
        g.add(Op::RmsNorm { eps: Scalar(1e-6) }, &[s, gain]).unwrap()
    } else {
        let beta = g.param("norm.bias", &[D]);
        g.add(Op::LayerNorm { eps: Scalar(1e-5) }, &[s, gain, beta]).unwrap()
    };
    g.outputs.push(("y".into(), y));
    g
}

#[test]
fn add_norm() {
    check("add-norm-rms", &add_norm_graph(true));
    check("add-norm-ln", &add_norm_graph(false));
    // Not when the sum is read elsewhere too: it would be computed twice.
    let mut g = add_norm_graph(true);
    let sum = g.g.node_indices().find(|&n| g.g[n].op == Op::Add).unwrap();
    g.outputs.push(("sum".into(), sum));
    let (_, report) = optimize_with(&g, &Limits::default(), &CostModel::default(), &rules::phases()).unwrap();
    assert!(!report.applied.contains_key("add-norm-rms"), "{:?}", report.applied);
}

/// `a + norm(b)` (a sandwich block's post-norm and residual) with `a`, `b` two embeddings of the
/// ids, the sum written either way round.
fn norm_add_graph(rms: bool, norm_first: bool) -> Graph {
    let mut g = Graph::new("t");
    let a = input(&mut g);
    let ids = g.inputs()[0].0;
    let t2 = g.param("table2", &[16, D]);
    let b = g.add(Op::Gather, &[t2, ids]).unwrap();
    let gain = g.param("norm.weight", &[D]);
    let normed = if rms {
        g.add(Op::RmsNorm { eps: Scalar(1e-6) }, &[b, gain]).unwrap()
    } else {
        let beta = g.param("norm.bias", &[D]);
        g.add(Op::LayerNorm { eps: Scalar(1e-5) }, &[b, gain, beta]).unwrap()
    };
    let y = if norm_first { g.add(Op::Add, &[normed, a]) } else { g.add(Op::Add, &[a, normed]) }.unwrap();
    g.outputs.push(("y".into(), y));
    g
}

#[test]
fn norm_add() {
    for (rule, rms, norm_first) in [
        ("norm-add-rms", true, false),
        ("norm-add-rms-r", true, true),
        ("norm-add-ln", false, false),
        ("norm-add-ln-r", false, true),
    ] {
        let opt = check(rule, &norm_add_graph(rms, norm_first));
        let fused = if rms { "rms_norm_add" } else { "layer_norm_add" };
        assert!(ops(&opt).contains(&fused.to_string()), "{rule}: {:?}", ops(&opt));
    }
}

/// `scale(f, q q^T)` with `q` a rotated head split of a projection: the scale moves through the
/// head split into the projection's weight, which is folded at load time.
fn scaled_scores_graph() -> Graph {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let heads = |g: &mut Graph, name: &str| {
        let w = g.param(name, &[D, D]);
        let q = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(2), Dim::Fixed(4)];
        let q = g.add(Op::Reshape { shape }, &[q]).unwrap();
        let q = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[q]).unwrap();
        g.add(Op::Rope { theta: Scalar(100.0), rotary_dim: 4, style: PairStyle::RotateHalf }, &[q]).unwrap()
    };
    let q = heads(&mut g, "q");
    let k = heads(&mut g, "k");
    let s = g.add(Op::MatMul { transpose_b: true }, &[q, k]).unwrap();
    let s = g.add(Op::Scale { factor: Scalar(0.5) }, &[s]).unwrap();
    g.outputs.push(("s".into(), s));
    g
}

#[test]
fn scale_folding() {
    let rules = [
        "scale-into-query",
        "scale-through-rope",
        "scale-through-permute",
        "scale-through-reshape",
        "scale-into-weight",
    ];
    for rule in rules {
        let opt = check(rule, &scaled_scores_graph());
        // The scale is gone, and each head split with its rotation is one `heads`.
        assert_eq!(dispatches(&opt), dispatches(&scaled_scores_graph()) - 3, "{:?}", ops(&opt));
    }
    // An embedding scale goes into the table.
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let y = g.add(Op::Scale { factor: Scalar(2.0) }, &[x]).unwrap();
    g.outputs.push(("y".into(), y));
    check("scale-into-table", &g);
    // Two scales become one.
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let x = g.add(Op::Act(Activation::Relu), &[x]).unwrap();
    let y = g.add(Op::Scale { factor: Scalar(2.0) }, &[x]).unwrap();
    let y = g.add(Op::Scale { factor: Scalar(-0.25) }, &[y]).unwrap();
    g.outputs.push(("y".into(), y));
    check("scale-scale", &g);
}

#[test]
fn transpose_and_reshape_elimination() {
    let four = |g: &mut Graph| {
        let x = input(g);
        let x = g.add(Op::Act(Activation::Relu), &[x]).unwrap();
        g.add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(2), Dim::Fixed(4)] }, &[x])
            .unwrap()
    };
    // A permutation undone: both permutes disappear.
    let mut g = Graph::new("t");
    let x = four(&mut g);
    let y = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[x]).unwrap();
    let y = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap();
    let y = g.add(Op::Act(Activation::Relu), &[y]).unwrap();
    g.outputs.push(("y".into(), y));
    check("permute-identity", &g);
    // Two permutations composed into one.
    let mut g = Graph::new("t");
    let x = four(&mut g);
    let y = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[x]).unwrap();
    let y = g.add(Op::Permute { perm: vec![0, 1, 3, 2] }, &[y]).unwrap();
    g.outputs.push(("y".into(), y));
    check("permute-permute", &g);
    // Reshape chains: one reshape, or none when the shape comes back.
    let mut g = Graph::new("t");
    let x = four(&mut g);
    let y = g.add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(8)] }, &[x]).unwrap();
    let y = g.add(Op::Act(Activation::Relu), &[y]).unwrap();
    g.outputs.push(("y".into(), y));
    check_nodes("reshape-identity", &g);
    let mut g = Graph::new("t");
    let x = four(&mut g);
    let y = g
        .add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(4), Dim::Fixed(2)] }, &[x])
        .unwrap();
    let y = g
        .add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(8), Dim::Fixed(1)] }, &[y])
        .unwrap();
    g.outputs.push(("y".into(), y));
    check_nodes("reshape-reshape", &g);
}

/// A cached decoder step's attention inputs: Q, K, V projections of one input split into heads,
/// Q and K rotated, K and V appended to a cache of 3 tokens.
#[test]
fn heads_of_a_cached_step() {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let (heads, kv_heads, hd) = (2, 1, 4);
    let role = InputRole::Cache { kv_heads, head_dim: hd, window: None };
    let past_k = g.add(Op::Input { name: "past_k".into(), role, seq: Sym::Past }, &[]).unwrap();
    let past_v = g.add(Op::Input { name: "past_v".into(), role, seq: Sym::Past }, &[]).unwrap();
    let rope = Op::Rope { theta: Scalar(10000.0), rotary_dim: hd, style: PairStyle::RotateHalf };
    let split = |g: &mut Graph, name: &str, n: usize, rotate: bool| {
        let w = g.param(name, &[n * hd, D]);
        let y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(n), Dim::Fixed(hd)];
        let y = g.add(Op::Reshape { shape }, &[y]).unwrap();
        let y = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap();
        if rotate { g.add(rope.clone(), &[y]).unwrap() } else { y }
    };
    let q = split(&mut g, "wq", heads, true);
    let k = split(&mut g, "wk", kv_heads, true);
    let v = split(&mut g, "wv", kv_heads, false);
    let k = g.add(Op::Concat { axis: 2 }, &[past_k, k]).unwrap();
    let v = g.add(Op::Concat { axis: 2 }, &[past_v, v]).unwrap();
    g.outputs = vec![("q".into(), q), ("present_k".into(), k), ("present_v".into(), v)];
    let mut given = inputs();
    let cache =
        |seed: f32| Tensor::f32(vec![B, kv_heads, 3, hd], (0..B * 3 * hd).map(|i| (i as f32 * seed).sin()).collect());
    given.insert("past_k".into(), cache(0.7));
    given.insert("past_v".into(), cache(1.3));
    let mut opt = None;
    for rule in ["heads-split", "heads-split-whole", "heads-rope", "heads-append"] {
        opt = Some(check_inputs(rule, &g, &CostModel::default(), &given));
    }
    let opt = opt.unwrap();
    // Past the embedding: one projection over the stacked weights and three `heads`, instead of
    // three projections, three transposes, two rotations and two concatenations.
    assert_eq!(dispatches(&g), 11, "{:?}", ops(&g));
    assert_eq!(dispatches(&opt), 5, "{:?}", ops(&opt));
}

/// A cached step whose input is normalized: after the merge the norm folds into the prologue of the
/// merged projection (`matmul_t` over the stacked weights, which `matmul-to-linear` never saw).
#[test]
fn norms_fold_into_a_merged_projection() {
    for rms in [true, false] {
        let mut g = Graph::new("t");
        let x = input(&mut g);
        let x = normed(&mut g, x, rms);
        let (heads, kv_heads, hd) = (2, 1, 4);
        let role = InputRole::Cache { kv_heads, head_dim: hd, window: None };
        let past_k = g.add(Op::Input { name: "past_k".into(), role, seq: Sym::Past }, &[]).unwrap();
        let split = |g: &mut Graph, name: &str, n: usize| {
            let w = g.param(name, &[n * hd, D]);
            let y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
            let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(n), Dim::Fixed(hd)];
            let y = g.add(Op::Reshape { shape }, &[y]).unwrap();
            g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap()
        };
        let q = split(&mut g, "wq", heads);
        let k = split(&mut g, "wk", kv_heads);
        let k = g.add(Op::Concat { axis: 2 }, &[past_k, k]).unwrap();
        g.outputs = vec![("q".into(), q), ("present_k".into(), k)];
        let mut given = inputs();
        given.insert(
            "past_k".into(),
            Tensor::f32(vec![B, kv_heads, 3, hd], (0..B * 3 * hd).map(|i| (i as f32 * 0.7).sin()).collect()),
        );
        // A LayerNorm prologue pays where dispatches are dear (see `norm_prologues`).
        let (rule, model) = if rms {
            ("norm-prologue-rms-m", CostModel::default())
        } else {
            ("norm-prologue-ln-m", CostModel { dispatch: 1e7, ..CostModel::default() })
        };
        let opt = check_inputs(rule, &g, &model, &given);
        let fused = if rms { "rms_norm_linear" } else { "layer_norm_linear" };
        assert!(ops(&opt).contains(&fused.to_string()), "{:?}", ops(&opt));
    }
}

/// A cached step with per-head query/key norms before the rotation (Gemma 3, Qwen3): each norm
/// folds into its `heads`, so the attention inputs are still one projection and three `heads`.
#[test]
fn heads_with_query_key_norms() {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let (heads, kv_heads, hd) = (2, 1, 4);
    let role = InputRole::Cache { kv_heads, head_dim: hd, window: None };
    let past_k = g.add(Op::Input { name: "past_k".into(), role, seq: Sym::Past }, &[]).unwrap();
    let rope = Op::Rope { theta: Scalar(10000.0), rotary_dim: hd, style: PairStyle::RotateHalf };
    let split = |g: &mut Graph, name: &str, n: usize| {
        let w = g.param(name, &[n * hd, D]);
        let y = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
        let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(Sym::Seq), Dim::Fixed(n), Dim::Fixed(hd)];
        let y = g.add(Op::Reshape { shape }, &[y]).unwrap();
        let y = g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[y]).unwrap();
        let gain = g.param(&format!("{name}_norm"), &[hd]);
        let y = g.add(Op::RmsNorm { eps: Scalar(1e-6) }, &[y, gain]).unwrap();
        g.add(rope.clone(), &[y]).unwrap()
    };
    let q = split(&mut g, "wq", heads);
    let k = split(&mut g, "wk", kv_heads);
    let k = g.add(Op::Concat { axis: 2 }, &[past_k, k]).unwrap();
    g.outputs = vec![("q".into(), q), ("present_k".into(), k)];
    let mut given = inputs();
    given.insert(
        "past_k".into(),
        Tensor::f32(vec![B, kv_heads, 3, hd], (0..B * 3 * hd).map(|i| (i as f32 * 0.7).sin()).collect()),
    );
    let opt = check_inputs("heads-norm", &g, &CostModel::default(), &given);
    let fused: Vec<&Op> =
        opt.g.node_indices().map(|n| &opt.g[n].op).filter(|op| matches!(op, Op::Heads { .. })).collect();
    assert_eq!(fused.len(), 2, "{:?}", ops(&opt));
    assert!(fused.iter().all(|op| matches!(op, Op::Heads { norm: Some(_), rope: Some(_), .. })), "{fused:?}");
    assert!(!ops(&opt).iter().any(|o| o.starts_with("rms_norm") || o.starts_with("rope")), "{:?}", ops(&opt));
}

/// A shared weight's gradient summed over the batch (`sum_b x_b^T dy_b`, as autodiff builds it)
/// becomes one product over every row.
#[test]
fn weight_grad_rows() {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let w = g.param("w", &[6, D]);
    let dy = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
    let xt = g.add(Op::Permute { perm: vec![0, 2, 1] }, &[x]).unwrap();
    let per_batch = g.add(Op::MatMul { transpose_b: false }, &[xt, dy]).unwrap();
    let summed = g.add(Op::SumAxis { axis: 0 }, &[per_batch]).unwrap();
    let dw = g.add(Op::Reshape { shape: vec![Dim::Fixed(D), Dim::Fixed(6)] }, &[summed]).unwrap();
    g.outputs.push(("dw".into(), dw));
    let opt = check("weight-grad-rows", &g);
    assert!(ops(&opt).contains(&"contract_rows".to_string()), "{:?}", ops(&opt));
    assert!(!ops(&opt).iter().any(|o| o == "sum_axis" || o == "permute"), "{:?}", ops(&opt));
}

/// An activation's gradient at the product that brings it the upstream gradient (`act'(h) *
/// (dy @ W)`, the input gradient of the projection the activation feeds, `W` read as stored or
/// transposed) becomes that product with the derivative as its epilogue, for every activation.
#[test]
fn act_grad_epilogue() {
    for act in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
        for transpose_b in [false, true] {
            let mut g = Graph::new("t");
            let x = input(&mut g);
            let w1 = g.param("w1", &[6, D]);
            let h = g.add(Op::MatMul { transpose_b: true }, &[x, w1]).unwrap();
            let dy = g.add(Op::Act(Activation::Silu), &[x]).unwrap();
            let w2 = g.param("w2", if transpose_b { &[6, D] } else { &[D, 6] });
            let dh = g.add(Op::MatMul { transpose_b }, &[dy, w2]).unwrap();
            let dx = g.add(Op::ActGrad(act), &[h, dh]).unwrap();
            g.outputs.push(("dx".into(), dx));
            let rule = if transpose_b { "act-grad-epilogue-t" } else { "act-grad-epilogue" };
            let opt = check(rule, &g);
            let fused = Op::MatMulActGrad { act, transpose_b }.name();
            assert!(ops(&opt).contains(&fused), "{fused}: {:?}", ops(&opt));
            assert!(!ops(&opt).iter().any(|o| o.ends_with("_grad") && *o != fused), "{:?}", ops(&opt));
        }
    }
}

/// A bias's gradient as autodiff builds it — the upstream gradient summed over the batch, then
/// the sequence, the kept axes reshaped away — becomes one sum over every row.
#[test]
fn bias_grad_rows() {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let dy = g.add(Op::Act(Activation::Relu), &[x]).unwrap();
    let over_batch = g.add(Op::SumAxis { axis: 0 }, &[dy]).unwrap();
    let over_seq = g.add(Op::SumAxis { axis: 1 }, &[over_batch]).unwrap();
    let db = g.add(Op::Reshape { shape: vec![Dim::Fixed(D)] }, &[over_seq]).unwrap();
    g.outputs.push(("db".into(), db));
    let opt = check("bias-grad-rows", &g);
    assert!(ops(&opt).contains(&"sum_rows".to_string()), "{:?}", ops(&opt));
    assert!(!ops(&opt).iter().any(|o| o == "sum_axis"), "{:?}", ops(&opt));

    // Sums that keep a leading axis (the batch's, then the columns') are left alone.
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let over_batch = g.add(Op::SumAxis { axis: 0 }, &[x]).unwrap();
    let over_columns = g.add(Op::SumAxis { axis: 2 }, &[over_batch]).unwrap();
    let db = g.add(Op::Reshape { shape: vec![Dim::Sym(Sym::Seq)] }, &[over_columns]).unwrap();
    g.outputs.push(("db".into(), db));
    let (opt, _) = optimize_with(&g, &Limits::default(), &CostModel::default(), &rules::phases()).unwrap();
    assert!(!ops(&opt).contains(&"sum_rows".to_string()), "{:?}", ops(&opt));
}

/// A weight stored `[in, out]` (GPT-2's `Conv1D`), read transposed by the forward: its gradient
/// comes out in its own layout, and the input's gradient reads it in place — no transposes.
#[test]
fn weight_grad_transposed_and_matmul_transposed_weight() {
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let stored = g.param("w", &[D, 6]);
    let w = g.add(Op::Permute { perm: vec![1, 0] }, &[stored]).unwrap();
    let dy = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
    // The input's gradient: dy @ W.
    let dx = g.add(Op::MatMul { transpose_b: false }, &[dy, w]).unwrap();
    g.outputs.push(("dx".into(), dx));
    // The stored tensor's gradient: (sum_b dy_b^T x_b)^T.
    let dyt = g.add(Op::Permute { perm: vec![0, 2, 1] }, &[dy]).unwrap();
    let per_batch = g.add(Op::MatMul { transpose_b: false }, &[dyt, x]).unwrap();
    let summed = g.add(Op::SumAxis { axis: 0 }, &[per_batch]).unwrap();
    let dw = g.add(Op::Reshape { shape: vec![Dim::Fixed(6), Dim::Fixed(D)] }, &[summed]).unwrap();
    let dstored = g.add(Op::Permute { perm: vec![1, 0] }, &[dw]).unwrap();
    g.outputs.push(("dstored".into(), dstored));
    for rule in ["weight-grad-transposed", "matmul-transposed-weight"] {
        let opt = check_same(rule, &g);
        let permutes = ops(&opt).iter().filter(|o| *o == "permute").count();
        assert!(permutes <= 1, "`{rule}`: {:?}", ops(&opt));
    }
}

/// The gradients of three projections by row slices of one packed weight (a query-key-value
/// weight's parts), as autodiff sums them: the weight's gradient as one product over the stacked
/// output gradients, the input's as one product over the whole weight — either order of the sum.
#[test]
fn stacked_projection_grads() {
    for reversed in [false, true] {
        let mut g = Graph::new("t");
        let x = input(&mut g);
        let packed = g.param("w", &[3 * D, D]);
        let parts: Vec<NodeIndex> =
            (0..3).map(|i| g.add(Op::Slice { axis: 0, start: i * D, len: D }, &[packed]).unwrap()).collect();
        // Each part's output gradient, distinct values of the input's rows.
        let dys: Vec<NodeIndex> = (0..3)
            .map(|i| {
                let y = g.add(Op::MatMul { transpose_b: true }, &[x, parts[i]]).unwrap();
                g.add(Op::Act(Activation::Relu), &[y]).unwrap()
            })
            .collect();
        // The weight's gradient: the parts' gradients stacked by rows.
        let dws: Vec<NodeIndex> = dys.iter().map(|&dy| g.add(Op::ContractRows, &[dy, x]).unwrap()).collect();
        let dw01 = g.add(Op::Concat { axis: 0 }, &[dws[0], dws[1]]).unwrap();
        let dw = g.add(Op::Concat { axis: 0 }, &[dw01, dws[2]]).unwrap();
        g.outputs.push(("dw".into(), dw));
        // The input's gradient: the parts' input gradients summed, in either order.
        let dxs: Vec<NodeIndex> =
            (0..3).map(|i| g.add(Op::MatMul { transpose_b: false }, &[dys[i], parts[i]]).unwrap()).collect();
        let order = if reversed { [2, 1, 0] } else { [0, 1, 2] };
        let first = g.add(Op::Add, &[dxs[order[0]], dxs[order[1]]]).unwrap();
        let dx = g.add(Op::Add, &[first, dxs[order[2]]]).unwrap();
        g.outputs.push(("dx".into(), dx));
        let rules: &[&str] = if reversed {
            &["input-grads-stacked-r", "append-assoc", "slice-whole", "weight-grads-stacked"]
        } else {
            &["input-grads-stacked", "slice-whole", "weight-grads-stacked"]
        };
        for rule in rules {
            let opt = check(rule, &g);
            let count = |name: &str| ops(&opt).iter().filter(|o| *o == name).count();
            assert_eq!(count("contract_rows"), 1, "`{rule}`: {:?}", ops(&opt));
            assert_eq!(count("add"), 0, "`{rule}`: {:?}", ops(&opt));
        }
    }
}

/// A tied table's two gradients — the head's product and the gather's scatter — summed by the
/// scatter, either way round.
#[test]
fn gather_grad_base() {
    for (rule, left) in [("gather-grad-base", true), ("gather-grad-base-r", false)] {
        let mut g = Graph::new("t");
        let x = input(&mut g);
        let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
        let table = g.param("table", &[16, D]);
        let dy = g.add(Op::Act(Activation::Relu), &[x]).unwrap();
        let scattered = g.add(Op::GatherGrad, &[table, ids, dy]).unwrap();
        let head = g.add(Op::ContractRows, &[dy, x]).unwrap();
        let head = g.add(Op::Reshape { shape: vec![Dim::Fixed(D), Dim::Fixed(D)] }, &[head]).unwrap();
        let head = g.add(Op::Concat { axis: 0 }, &[head, head]).unwrap();
        let sum = if left {
            g.add(Op::Add, &[head, scattered]).unwrap()
        } else {
            g.add(Op::Add, &[scattered, head]).unwrap()
        };
        g.outputs.push(("dtable".into(), sum));
        let opt = check(rule, &g);
        assert!(!ops(&opt).contains(&"add".to_string()), "`{rule}`: {:?}", ops(&opt));
    }
}

/// A norm's input gradient and the residual path's gradient to the same input, added (as
/// autodiff sums a pre-norm block's two uses of its input, either way round), become one pass.
#[test]
fn norm_grad_residual() {
    for (rule, left) in [("norm-grad-residual", false), ("norm-grad-residual-left", true)] {
        for rms in [false, true] {
            let mut g = Graph::new("t");
            let x = input(&mut g);
            let gain = g.param("gain", &[D]);
            let w = g.param("w", &[D, D]);
            let dy = g.add(Op::MatMul { transpose_b: true }, &[x, w]).unwrap();
            let r = g.add(Op::Act(Activation::Relu), &[dy]).unwrap();
            let dx = g.add(Op::NormGrad { rms, eps: Scalar(1e-5) }, &[x, gain, dy]).unwrap();
            let sum = if left { g.add(Op::Add, &[r, dx]).unwrap() } else { g.add(Op::Add, &[dx, r]).unwrap() };
            g.outputs.push(("dx".into(), sum));
            let opt = check(rule, &g);
            assert!(!ops(&opt).contains(&"add".to_string()), "`{rule}`: {:?}", ops(&opt));
        }
    }
    // A residual broadcast into the input (a bias's shape) is no residual of it.
    let mut g = Graph::new("t");
    let x = input(&mut g);
    let gain = g.param("gain", &[D]);
    let dx = g.add(Op::NormGrad { rms: false, eps: Scalar(1e-5) }, &[x, gain, x]).unwrap();
    let sum = g.add(Op::Add, &[dx, gain]).unwrap();
    g.outputs.push(("dx".into(), sum));
    let (opt, _) = kiln_compiler::optimize::optimize(&g).unwrap();
    assert!(ops(&opt).contains(&"add".to_string()), "{:?}", ops(&opt));
}

#[test]
fn every_rule_has_a_test() {
    let source = include_str!("rules.rs");
    for rule in rules::all() {
        let name = rule.name.to_string();
        // Named in a `check(...)` call, or in a list of rules the test passes to `check`.
        let tested = source.contains(&format!("\"{name}\""));
        assert!(tested, "rule `{name}` has no differential test");
    }
}

#[test]
fn limits_stop_the_optimizer_with_a_valid_graph() {
    let g = attention_graph(2);
    let limits = Limits { nodes: 10, iterations: 1, time: std::time::Duration::from_millis(1) };
    let (opt, report) = optimize_with(&g, &limits, &CostModel::default(), &rules::phases()).unwrap();
    opt.check().unwrap();
    assert!(report.phases.iter().all(|(_, iters, _)| *iters <= 1), "{:?}", report.phases);
    let params = random_params(&g, 1).unwrap();
    let before = run(&g, &params, &inputs()).unwrap();
    let after = run(&opt, &params, &inputs()).unwrap();
    assert!(before[0].1.max_abs_diff(&after[0].1) <= 1e-5);
}
