//! Reverse-mode autodiff ([`kiln_compiler::autodiff`]): every gradient rule against central
//! finite differences of the loss, both computed by the reference interpreter, at two or three
//! small shapes; tied parameters; the refusal of an op without a rule; a whole small model.
//!
//! Tolerance: the interpreter computes in f32, so a finite difference `(L(p + h) - L(p - h)) / 2h`
//! carries the loss's f32 rounding (about 1e-7 of |L|) divided by `2h`, besides its O(h^2)
//! truncation. With `h = 1e-2` and losses of order 1..10 both stay below 1e-3, so the gradients
//! are compared within 1e-2 of their scale (the largest magnitude of either), plus an absolute
//! 1e-3 for gradients near zero. A check in f64 is a later step.

use kiln_compiler::autodiff::{AutodiffError, gradients};
use kiln_compiler::graph::{Activation, Dim, Graph, Op, PairStyle, Scalar};
use kiln_compiler::interp::run;
use kiln_compiler::tensor::Tensor;
use petgraph::graph::NodeIndex;
use std::collections::HashMap;

const H: f32 = 1e-2;
const REL: f32 = 1e-2;
const ABS: f32 = 1e-3;

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn fixed(g: &Graph, n: NodeIndex) -> Vec<usize> {
    g.g[n].shape.iter().map(|d| if let Dim::Fixed(k) = d { *k } else { panic!("symbolic shape") }).collect()
}

/// Adds `loss = sum(y * w)`, `w` a parameter `loss.w` of random weights (so no gradient is
/// trivially constant, as the gradient of `sum(softmax(x))` would be) of `y`'s shape after its
/// last symbolic axis (broadcast over the symbolic ones).
fn with_loss(g: &mut Graph, y: NodeIndex) {
    let dims = &g.g[y].shape;
    let rank = dims.len();
    let first_fixed = dims.iter().rposition(|d| matches!(d, Dim::Sym(_))).map_or(0, |i| i + 1);
    let shape: Vec<usize> =
        dims[first_fixed..].iter().map(|d| if let Dim::Fixed(k) = d { *k } else { unreachable!() }).collect();
    let w = g.param("loss.w", &shape);
    let mut l = g.add(Op::Mul, &[y, w]).unwrap();
    for axis in 0..rank {
        l = g.add(Op::SumAxis { axis }, &[l]).unwrap();
    }
    g.outputs.push(("loss".into(), l));
}

/// Random values for every parameter of `g`, gains and all.
fn params_of(g: &Graph, seed: u64) -> HashMap<String, Tensor> {
    let mut p = HashMap::new();
    for (i, (n, name)) in g.params().into_iter().enumerate() {
        let shape = fixed(g, n);
        let len = shape.iter().product();
        p.entry(name.to_string()).or_insert_with(|| Tensor::f32(shape, values(seed + i as u64, len)));
    }
    p
}

fn loss(g: &Graph, params: &HashMap<String, Tensor>, inputs: &HashMap<String, Tensor>) -> f32 {
    let out = run(g, params, inputs).unwrap();
    out.iter().find(|(n, _)| n == "loss").unwrap().1.to_f32_vec()[0]
}

/// Checks the gradient of every parameter but `loss.w` against central differences.
fn check(g: &Graph, params: &HashMap<String, Tensor>, inputs: &HashMap<String, Tensor>, what: &str) {
    check_some(g, params, inputs, what, |name| name != "loss.w")
}

fn check_some(
    g: &Graph,
    params: &HashMap<String, Tensor>,
    inputs: &HashMap<String, Tensor>,
    what: &str,
    wants: impl Fn(&str) -> bool + Copy,
) {
    let grad = gradients(g, "loss", wants).unwrap_or_else(|e| panic!("{what}: {e}"));
    let out = run(&grad, params, inputs).unwrap();
    let mut names: Vec<&String> = params.keys().filter(|n| wants(n)).collect();
    names.sort();
    assert!(!names.is_empty(), "{what}: nothing to check");
    for name in names {
        let ad =
            out.iter().find(|(n, _)| *n == format!("grad.{name}")).unwrap_or_else(|| panic!("{what}: no grad.{name}"));
        let ad = ad.1.to_f32_vec();
        let p = &params[name];
        assert_eq!(ad.len(), p.len(), "{what}: grad.{name} has the wrong size");
        let mut fd = Vec::with_capacity(p.len());
        for i in 0..p.len() {
            let mut perturbed = params.clone();
            let mut at = |delta: f32| {
                let mut data = p.to_f32_vec();
                data[i] += delta;
                perturbed.insert(name.clone(), Tensor::f32(p.shape.clone(), data));
                loss(g, &perturbed, inputs)
            };
            let (up, down) = (at(H), at(-H));
            fd.push((up - down) / (2.0 * H));
        }
        let scale = ad.iter().chain(&fd).fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (a, f)) in ad.iter().zip(&fd).enumerate() {
            assert!(
                (a - f).abs() <= REL * scale + ABS,
                "{what}: grad.{name}[{i}] = {a}, finite differences give {f} (scale {scale})"
            );
        }
    }
}

fn none() -> HashMap<String, Tensor> {
    HashMap::new()
}

/// `y = op(params...)`, with the loss, checked.
fn unary(what: &str, shapes: &[&[usize]], op: impl Fn(&mut Graph, &[NodeIndex]) -> NodeIndex) {
    let mut g = Graph::new(what);
    let ps: Vec<NodeIndex> = shapes.iter().enumerate().map(|(i, s)| g.param(&format!("p{i}"), s)).collect();
    let y = op(&mut g, &ps);
    with_loss(&mut g, y);
    check(&g, &params_of(&g, 7), &none(), what);
}

fn op1(op: Op) -> impl Fn(&mut Graph, &[NodeIndex]) -> NodeIndex {
    move |g, p| g.add(op.clone(), p).unwrap()
}

#[test]
fn matmul() {
    for tb in [false, true] {
        let op = Op::MatMul { transpose_b: tb };
        let w = |k: usize, n: usize| if tb { [n, k] } else { [k, n] };
        unary("matmul shared", &[&[2, 3], &w(3, 4)], op1(op.clone()));
        unary("matmul shared batched", &[&[2, 3, 4], &w(4, 2)], op1(op.clone()));
        let b = w(3, 2);
        unary("matmul batched", &[&[2, 2, 3], &[2, b[0], b[1]]], op1(op.clone()));
    }
}

#[test]
fn broadcasting_add_and_mul() {
    for op in [Op::Add, Op::Mul] {
        unary("same shape", &[&[2, 3], &[2, 3]], op1(op.clone()));
        unary("trailing", &[&[2, 3, 4], &[4]], op1(op.clone()));
        unary("middle ones", &[&[2, 3, 4], &[3, 1]], op1(op.clone()));
        unary("both ways", &[&[2, 1, 4], &[3, 1]], op1(op.clone()));
    }
}

#[test]
fn scale_offset_and_sum() {
    for shape in [&[3][..], &[2, 3, 2]] {
        unary("scale", &[shape], op1(Op::Scale { factor: Scalar(-1.5) }));
        unary("offset", &[shape], op1(Op::Offset { value: Scalar(0.5) }));
        unary("sum_axis", &[shape], op1(Op::SumAxis { axis: 0 }));
    }
}

#[test]
fn shape_ops() {
    unary("reshape", &[&[2, 6]], op1(Op::Reshape { shape: vec![Dim::Fixed(3), Dim::Fixed(4)] }));
    unary("reshape 3-D", &[&[2, 3, 2]], op1(Op::Reshape { shape: vec![Dim::Fixed(6), Dim::Fixed(2)] }));
    unary("permute", &[&[2, 3, 4]], op1(Op::Permute { perm: vec![2, 0, 1] }));
    unary("permute 4-D", &[&[1, 2, 3, 2]], op1(Op::Permute { perm: vec![0, 2, 1, 3] }));
    unary("slice middle", &[&[2, 5]], op1(Op::Slice { axis: 1, start: 1, len: 3 }));
    unary("slice start", &[&[4, 3]], op1(Op::Slice { axis: 0, start: 0, len: 2 }));
    unary("slice end", &[&[2, 3, 4]], op1(Op::Slice { axis: 2, start: 2, len: 2 }));
    unary("concat", &[&[2, 3], &[2, 2]], op1(Op::Concat { axis: 1 }));
    unary("concat axis 0", &[&[1, 3], &[2, 3]], op1(Op::Concat { axis: 0 }));
    unary("repeat_heads", &[&[1, 2, 3, 2]], op1(Op::RepeatHeads { times: 2 }));
    unary("repeat_heads 3", &[&[2, 1, 2, 2]], op1(Op::RepeatHeads { times: 3 }));
}

#[test]
fn activations() {
    for act in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
        unary(act.name(), &[&[2, 5]], op1(Op::Act(act)));
        unary(act.name(), &[&[3, 2, 2]], op1(Op::Act(act)));
    }
}

#[test]
fn softmax_softcap_mask_alibi() {
    for shape in [&[2, 4][..], &[1, 2, 3, 3]] {
        unary("softmax", &[shape], op1(Op::Softmax));
        unary("softcap", &[shape], |g, p| {
            let x = g.add(Op::Scale { factor: Scalar(3.0) }, p).unwrap();
            g.add(Op::SoftCap { cap: Scalar(2.0) }, &[x]).unwrap()
        });
    }
    for shape in [&[1, 2, 3, 3][..], &[2, 1, 2, 4]] {
        unary("causal mask then softmax", &[shape], |g, p| {
            let m = g.add(Op::Mask { causal: true, window: None }, p).unwrap();
            g.add(Op::Softmax, &[m]).unwrap()
        });
        unary("alibi then softmax", &[shape], |g, p| {
            let m = g.add(Op::Alibi, p).unwrap();
            g.add(Op::Softmax, &[m]).unwrap()
        });
    }
}

/// A parameter used twice, and two parameter nodes of one name, get the sum of their uses.
#[test]
fn tied_parameters_sum_their_uses() {
    let mut g = Graph::new("tied");
    let w = g.param("w", &[3, 3]);
    let y = g.add(Op::MatMul { transpose_b: true }, &[w, w]).unwrap();
    with_loss(&mut g, y);
    check(&g, &params_of(&g, 3), &none(), "w @ w^T");

    let mut g = Graph::new("tied nodes");
    let x = g.param("x", &[2, 3]);
    let w1 = g.param("w", &[3, 3]);
    let w2 = g.param("w", &[3, 3]);
    let h = g.add(Op::MatMul { transpose_b: false }, &[x, w1]).unwrap();
    let y = g.add(Op::MatMul { transpose_b: true }, &[h, w2]).unwrap();
    with_loss(&mut g, y);
    let grad = gradients(&g, "loss", |n| n == "w").unwrap();
    assert_eq!(grad.outputs.iter().filter(|(n, _)| n.starts_with("grad.")).count(), 1, "one gradient per name");
    check_some(&g, &params_of(&g, 4), &none(), "x @ w @ w^T", |n| n == "w");
}

/// Only wanted parameters get gradients; one the loss ignores gets an exact zero.
#[test]
fn only_wanted_parameters() {
    let mut g = Graph::new("frozen");
    let a = g.param("a", &[2, 2]);
    let b = g.param("b", &[2, 2]);
    let unused = g.param("unused", &[2]);
    let _ = g.add(Op::Scale { factor: Scalar(2.0) }, &[unused]).unwrap();
    let y = g.add(Op::Mul, &[a, b]).unwrap();
    with_loss(&mut g, y);
    let grad = gradients(&g, "loss", |n| n != "b" && n != "loss.w").unwrap();
    let names: Vec<&str> = grad.outputs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["loss", "grad.a", "grad.unused"]);
    let out = run(&grad, &params_of(&g, 1), &none()).unwrap();
    assert_eq!(out[2].1.to_f32_vec(), vec![0.0, 0.0]);
}

#[test]
fn an_op_without_a_rule_is_refused_by_name() {
    let mut g = Graph::new("refused");
    g.scope = "layers.0.moe".into();
    let x = g.param("x", &[2, 4]);
    let y = g.add(Op::TopK { k: 2, renormalize: false }, &[x]).unwrap();
    g.scope = String::new();
    with_loss(&mut g, y);
    let err = gradients(&g, "loss", |n| n == "x").unwrap_err();
    assert_eq!(err, AutodiffError::NoRule { op: "top_k".into(), scope: "layers.0.moe".into() });
    assert_eq!(err.to_string(), "no gradient rule for `top_k` in `layers.0.moe`");
    // Not on a path from a wanted parameter: no rule needed.
    assert!(gradients(&g, "loss", |n| n == "loss.w").is_ok());
}

#[test]
fn the_loss_must_be_one_element() {
    let mut g = Graph::new("not scalar");
    let x = g.param("x", &[2]);
    g.outputs.push(("loss".into(), x));
    assert!(matches!(gradients(&g, "loss", |_| true), Err(AutodiffError::NotScalar { .. })));
    assert!(matches!(gradients(&g, "nope", |_| true), Err(AutodiffError::NoLoss(_))));
}

#[test]
fn norms() {
    for shape in [&[2, 4][..], &[2, 3, 5]] {
        let d = *shape.last().unwrap();
        unary("rms_norm", &[shape, &[d]], op1(Op::RmsNorm { eps: Scalar(1e-5) }));
        unary("layer_norm", &[shape, &[d]], op1(Op::LayerNorm { eps: Scalar(1e-5) }));
        unary("layer_norm with bias", &[shape, &[d], &[d]], op1(Op::LayerNorm { eps: Scalar(1e-5) }));
    }
}

#[test]
fn rope() {
    for style in [PairStyle::RotateHalf, PairStyle::Interleaved] {
        for (shape, rotary_dim) in [(&[1, 2, 3, 4][..], 4), (&[2, 1, 3, 6], 4), (&[1, 1, 5, 8], 8)] {
            unary("rope", &[shape], op1(Op::Rope { theta: Scalar(100.0), rotary_dim, style }));
        }
    }
}

/// An embedding lookup with repeated ids: rows named twice get both gradients, rows named by no
/// id get none.
#[test]
fn gather() {
    use kiln_compiler::graph::{InputRole, Sym};
    for (rows, ids) in [(5, vec![0i64, 3, 3, 1, 0, 3]), (3, vec![2, 2])] {
        let mut g = Graph::new("gather");
        let input = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
        let table = g.param("table", &[rows, 3]);
        let y = g.add(Op::Gather, &[table, input]).unwrap();
        // Rows apart: each row's own weights, so that repeated ids are told apart.
        let w = g.param("w", &[3, 3]);
        let y = g.add(Op::MatMul { transpose_b: false }, &[y, w]).unwrap();
        let y = g.add(Op::Act(Activation::Silu), &[y]).unwrap();
        with_loss(&mut g, y);
        let n = ids.len();
        let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, n], ids))]);
        check(&g, &params_of(&g, 5), &inputs, "gather");
    }
}

const GPT2: &str = r#"
[model]
name = "tiny-gpt2"
kind = "decoder"
vocab = 11
d_model = 8
layers = 1
max_positions = 8

[positions]
kind = "learned"

[norm]
kind = "layernorm"
eps = 1e-5
placement = "pre"

[attention]
heads = 2
bias = true

[ffn]
activation = "gelu-tanh"
bias = true

[head]
tied = true

[weights]
preset = "gpt2"
"#;

const LLAMA: &str = r#"
[model]
name = "tiny-llama"
kind = "decoder"
vocab = 11
d_model = 8
layers = 1
max_positions = 8

[positions]
kind = "rope"
theta = 10000.0

[norm]
kind = "rmsnorm"
eps = 1e-6

[attention]
heads = 2
kv_heads = 1

[ffn]
activation = "silu"
gated = true
d_ff = 12

[head]
tied = false

[weights]
preset = "llama"
"#;

/// Whole small decoders as the front end builds them (unoptimized), loss = sum(logits * w):
/// every parameter's gradient, the tied embedding's included, against central differences.
#[test]
fn whole_small_models() {
    for (name, source) in [("gpt2", GPT2), ("llama", LLAMA)] {
        let fe = kiln_compiler::front_end("t.toml", source).unwrap_or_else(|e| panic!("{}", e.render()));
        let mut g = fe.graph;
        let logits = g.outputs.iter().find(|(n, _)| n == "logits").unwrap().1;
        with_loss(&mut g, logits);
        // Moderate weights keep the softmaxes and norms away from saturation, where f32 finite
        // differences lose their digits.
        let mut params = params_of(&g, 11);
        for t in params.values_mut() {
            *t = Tensor::f32(t.shape.clone(), t.to_f32_vec().iter().map(|v| v * 0.5).collect());
        }
        let ids = vec![1i64, 4, 4, 9, 0, 2];
        let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![2, 3], ids))]);
        check(&g, &params, &inputs, name);
    }
}

/// The encoder-side ops: a key-masked block-sparse mask, mean pooling, L2 normalization.
#[test]
fn encoder_ops() {
    for shape in [&[2, 3][..], &[1, 4]] {
        unary("l2_normalize", &[shape], op1(Op::L2Normalize));
    }
    // The masks are parameters the gradient is not asked of (fixed shapes, unlike an input's).
    for (b, s, d, m) in [(1, 3, 2, vec![1.0, 1.0, 0.0]), (2, 2, 3, vec![1.0, 0.0, 1.0, 1.0])] {
        let mut g = Graph::new("mean_pool");
        let x = g.param("x", &[b, s, d]);
        let mask = g.param("mask", &[b, s]);
        let y = g.add(Op::MeanPool, &[x, mask]).unwrap();
        with_loss(&mut g, y);
        let mut params = params_of(&g, 2);
        params.insert("mask".into(), Tensor::f32(vec![b, s], m));
        check_some(&g, &params, &none(), "mean_pool", |n| n == "x");
    }
    for (blocks, kept) in [(4, vec![1.0; 4]), (6, vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.0])] {
        let mut g = Graph::new("block_sparse_mask");
        let x = g.param("x", &[1, 2, blocks, blocks]);
        let mask = g.param("mask", &[1, blocks]);
        let op = Op::BlockSparseMask { block: 2, global: 1, window: 0, random: 0, seed: 1 };
        let y = g.add(op, &[x, mask]).unwrap();
        let y = g.add(Op::Softmax, &[y]).unwrap();
        with_loss(&mut g, y);
        let mut params = params_of(&g, 9);
        params.insert("mask".into(), Tensor::f32(vec![1, blocks], kept));
        check_some(&g, &params, &none(), "block_sparse_mask", |n| n == "x");
    }
}

/// Fused ops (the optimizer's) are refused by name for now: gradients are taken before fusion.
#[test]
fn fused_ops_are_refused_by_name() {
    let mut g = Graph::new("fused");
    let x = g.param("x", &[2, 4]);
    let w = g.param("w", &[3, 4]);
    let y = g.add(Op::linear(Some(Activation::Gelu), false, false), &[x, w]).unwrap();
    with_loss(&mut g, y);
    let err = gradients(&g, "loss", |n| n == "w").unwrap_err();
    assert_eq!(err, AutodiffError::NoRule { op: "linear_gelu".into(), scope: String::new() });
}
