//! Reverse-mode autodiff ([`kiln_compiler::autodiff`]): every gradient rule against central
//! finite differences of the loss, both computed by the reference interpreter, at two or three
//! small shapes; tied parameters; the refusal of an op without a rule; a whole small model.
//!
//! Precision: both sides are computed in f64 by the interpreter's reference mode
//! ([`kiln_compiler::interp::run_f64`]): the loss at perturbed parameters and the gradient graph
//! that [`gradients`] builds. The difference is the plain central one, `(L(p + h) - L(p - h)) /
//! 2h` with `h = 1e-6` ([`H`]): its truncation, O(h^2), is about 1e-12 of the loss's third
//! derivative, and its rounding about 1e-16 |L| / h, a few 1e-10 for these losses of order 1.
//! Gradients are compared within [`REL`] = 2e-7 of their scale (the largest magnitude of either,
//! per parameter) plus [`ABS`] = 5e-9.
//!
//! Measured (`--nocapture` prints each parameter's worst error): over the 507 checked
//! parameters, the largest error is 3.4e-8 of the scale (5.2e-8 absolute, `layer_norm` at
//! d = 5), and no whole-model parameter's error exceeds 1.4e-9 absolute; gradients that are zero
//! exactly (a key bias, to which the softmax is blind) come out of the differences at 4.4e-10, the
//! rounding floor. The tolerances are about five times the worst of these. What remains is not
//! f64 rounding but the graphs' f32 attributes: the backward of a norm takes the mean as
//! `scale(sum, 1/d)` with `1/d` an f32 (0.2 is 1.5e-8 off), which the forward's f64 mean is not.
//! Under f32, these checks needed a tolerance of 1e-2 of the scale plus 1e-3, Richardson's
//! difference at `h = 1e-2`, and softened weights in places.
//!
//! Whole models built from specs cover the language: every attention, position, norm and
//! feed-forward form, each as a small model whose cross-entropy loss (the training objective)
//! is differentiated and checked on a sample of each parameter's elements.

use kiln_compiler::autodiff::{AutodiffError, blocks, gradients, gradients_recomputing};
use kiln_compiler::graph::{Activation, Dim, Graph, Op, PairStyle, Scalar};
use kiln_compiler::interp::run_f64;
use kiln_compiler::tensor::{Tensor, Tensor64};
use petgraph::graph::NodeIndex;
use std::collections::HashMap;

/// The step of the central differences.
const H: f64 = 1e-6;
/// The tolerance, relative to a parameter's gradient scale.
const REL: f64 = 2e-7;
/// The absolute tolerance, for gradients near zero.
const ABS: f64 = 5e-9;

type Params = HashMap<String, Tensor64>;

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f64 / (1u64 << 24) as f64) * 2.0 - 1.0
        })
        .collect()
}

fn t64(shape: Vec<usize>, data: Vec<f64>) -> Tensor64 {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    Tensor64 { shape, data }
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
fn params_of(g: &Graph, seed: u64) -> Params {
    let mut p = HashMap::new();
    for (i, (n, name)) in g.params().into_iter().enumerate() {
        let shape = fixed(g, n);
        let len = shape.iter().product();
        p.entry(name.to_string()).or_insert_with(|| t64(shape, values(seed + i as u64, len)));
    }
    p
}

fn loss(g: &Graph, params: &Params, inputs: &HashMap<String, Tensor>) -> f64 {
    let out = run_f64(g, params, inputs).unwrap();
    out.iter().find(|(n, _)| n == "loss").unwrap().1.data[0]
}

/// Checks the gradient of every parameter but `loss.w` against central differences.
fn check(g: &Graph, params: &Params, inputs: &HashMap<String, Tensor>, what: &str) {
    check_some(g, params, inputs, what, |name| name != "loss.w")
}

fn check_some(
    g: &Graph,
    params: &Params,
    inputs: &HashMap<String, Tensor>,
    what: &str,
    wants: impl Fn(&str) -> bool + Copy,
) {
    check_sampled(g, params, inputs, what, wants, None);
}

/// [`check_some`] on all elements of each parameter, or with `sample` on that many of a larger
/// one (see [`sampled`]).
fn check_sampled(
    g: &Graph,
    params: &Params,
    inputs: &HashMap<String, Tensor>,
    what: &str,
    wants: impl Fn(&str) -> bool + Copy,
    sample: Option<usize>,
) {
    let grad = gradients(g, "loss", wants).unwrap_or_else(|e| panic!("{what}: {e}"));
    let out = run_f64(&grad, params, inputs).unwrap();
    let mut names: Vec<&String> = params.keys().filter(|n| wants(n)).collect();
    names.sort();
    assert!(!names.is_empty(), "{what}: nothing to check");
    for name in names {
        let ad =
            out.iter().find(|(n, _)| *n == format!("grad.{name}")).unwrap_or_else(|| panic!("{what}: no grad.{name}"));
        let ad = &ad.1.data;
        let p = &params[name];
        assert_eq!(ad.len(), p.data.len(), "{what}: grad.{name} has the wrong size");
        let len = p.data.len();
        let at: Vec<usize> = match sample {
            Some(n) if len > 2 * n => sampled(ad, n, name),
            _ => (0..len).collect(),
        };
        let fd: Vec<f64> = at.iter().map(|&i| difference(g, params, inputs, name, i)).collect();
        let scale = ad.iter().chain(&fd).fold(0.0f64, |m, v| m.max(v.abs()));
        let mut worst = (0.0f64, 0.0f64);
        for (&i, f) in at.iter().zip(&fd) {
            let a = ad[i];
            let err = (a - f).abs();
            worst = (worst.0.max(err), worst.1.max(err / scale.max(f64::MIN_POSITIVE)));
            assert!(
                err <= REL * scale + ABS,
                "{what}: grad.{name}[{i}] = {a:e}, finite differences give {f:e} (scale {scale:e}, error {:e} of it)",
                err / scale
            );
        }
        // Seen with `--nocapture`: the margins behind `REL` and `ABS`.
        eprintln!("{what}: grad.{name}: worst error {:.1e}, {:.1e} of the scale {scale:.2e}", worst.0, worst.1);
    }
}

/// The central difference of the loss in element `i` of parameter `name`, step [`H`].
fn difference(g: &Graph, params: &Params, inputs: &HashMap<String, Tensor>, name: &str, i: usize) -> f64 {
    let p = &params[name];
    let mut perturbed = params.clone();
    let mut at = |delta: f64| {
        let mut data = p.data.clone();
        data[i] += delta;
        // The step actually taken (`p + h` rounds), so that the difference divides by it.
        let taken = data[i] - p.data[i];
        perturbed.insert(name.to_string(), t64(p.shape.clone(), data));
        (loss(g, &perturbed, inputs), taken)
    };
    let ((up, h_up), (down, h_down)) = (at(H), at(-H));
    (up - down) / (h_up - h_down)
}

/// `n` element indices of a parameter spread by a hash of its name, plus the one of its largest
/// gradient `ad` (where a wrong rule shows most).
fn sampled(ad: &[f64], n: usize, name: &str) -> Vec<usize> {
    let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let mut at: Vec<usize> =
        values(seed, n).iter().map(|v| (((v + 1.0) / 2.0 * ad.len() as f64) as usize).min(ad.len() - 1)).collect();
    let largest = (0..ad.len()).max_by(|&i, &j| ad[i].abs().total_cmp(&ad[j].abs())).unwrap_or(0);
    at.push(largest);
    at.sort_unstable();
    at.dedup();
    at
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
        unary("window mask then softmax", &[shape], |g, p| {
            let m = g.add(Op::Mask { causal: false, window: Some(2) }, p).unwrap();
            g.add(Op::Softmax, &[m]).unwrap()
        });
        unary("alibi then softmax", &[shape], |g, p| {
            let m = g.add(Op::Alibi, p).unwrap();
            g.add(Op::Softmax, &[m]).unwrap()
        });
    }
}

/// A causal mask read only by a softmax passes the softmax's gradient through (it is 0 at every
/// masked key already); with a key mask, which may mask a whole row, the gate stays.
#[test]
fn a_mask_before_a_softmax_needs_no_gate() {
    let ops = |key_mask: bool| {
        let mut g = Graph::new("mask");
        let x = g.param("x", &[2, 1, 3, 3]);
        let mut operands = vec![x];
        if key_mask {
            operands.push(g.param("m", &[2, 3]));
        }
        let m = g.add(Op::Mask { causal: true, window: None }, &operands).unwrap();
        let y = g.add(Op::Softmax, &[m]).unwrap();
        with_loss(&mut g, y);
        let grads = gradients(&g, "loss", |n| n == "x").unwrap();
        grads.g.node_weights().map(|n| n.op.name()).collect::<Vec<_>>()
    };
    assert!(!ops(false).iter().any(|o| o == "relu_grad"), "{:?}", ops(false));
    assert!(ops(true).iter().any(|o| o == "relu_grad"), "{:?}", ops(true));
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
    let out = run_f64(&grad, &params_of(&g, 1), &none()).unwrap();
    assert_eq!(out[2].1.data, vec![0.0, 0.0]);
}

#[test]
fn an_op_without_a_rule_is_refused_by_name() {
    let mut g = Graph::new("refused");
    g.scope = "layers.0.ffn".into();
    let x = g.param("x", &[2, 4]);
    let w = g.param("w", &[3, 4]);
    let y = g.add(Op::linear(Some(Activation::Gelu), false, false), &[x, w]).unwrap();
    g.scope = String::new();
    with_loss(&mut g, y);
    let err = gradients(&g, "loss", |n| n == "x").unwrap_err();
    assert_eq!(err, AutodiffError::NoRule { op: "linear_gelu".into(), scope: "layers.0.ffn".into() });
    assert_eq!(err.to_string(), "no gradient rule for `linear_gelu` in `layers.0.ffn`");
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
        // Moderate weights: softmaxes and norms away from saturation.
        let mut params = params_of(&g, 11);
        for t in params.values_mut() {
            t.data.iter_mut().for_each(|v| *v *= 0.5);
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
        params.insert("mask".into(), t64(vec![b, s], m));
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
        params.insert("mask".into(), t64(vec![1, blocks], kept));
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

/// T5's relative position bias: the table's gradient gathers each bucket's pairs. The bias is
/// added to scores of a batch of two and softmaxed (so `dy` is summed over the batch and is not
/// constant); near and far distances, both directions, fewer queries than keys.
#[test]
fn relative_bias() {
    for (buckets, max_distance, bidirectional, heads, q, k) in
        [(8, 20, true, 2, 5, 5), (6, 10, false, 3, 3, 7), (4, 6, true, 1, 9, 9)]
    {
        let mut g = Graph::new("relative_bias");
        let table = g.param("table", &[buckets, heads]);
        let scores = g.param("scores", &[2, heads, q, k]);
        let op = Op::RelativeBias { buckets, max_distance, bidirectional, q: Dim::Fixed(q), k: Dim::Fixed(k) };
        let bias = g.add(op, &[table]).unwrap();
        let y = g.add(Op::Add, &[scores, bias]).unwrap();
        let y = g.add(Op::Softmax, &[y]).unwrap();
        with_loss(&mut g, y);
        check(&g, &params_of(&g, 13), &none(), "relative_bias");
    }
}

/// A table cut to its first rows, of a fixed count and of the sequence's (symbolic) length: the
/// rows cut off get zero gradient.
#[test]
fn truncate() {
    for (rows, len) in [(6, 4), (3, 3)] {
        unary("truncate", &[&[rows, 3]], |g, p| {
            let t = g.add(Op::Truncate { len: Dim::Fixed(len) }, p).unwrap();
            g.add(Op::Act(Activation::Silu), &[t]).unwrap()
        });
    }
    use kiln_compiler::graph::{InputRole, Sym};
    for (rows, seq) in [(8, 5), (4, 4)] {
        let mut g = Graph::new("truncate to the sequence");
        let input = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
        let tokens = g.param("tokens", &[5, 3]);
        let x = g.add(Op::Gather, &[tokens, input]).unwrap();
        let e = g.param("e", &[rows, 3]);
        let cut = g.add(Op::Truncate { len: Dim::Sym(Sym::Seq) }, &[e]).unwrap();
        let y = g.add(Op::Add, &[x, cut]).unwrap();
        let y = g.add(Op::Act(Activation::Silu), &[y]).unwrap();
        with_loss(&mut g, y);
        let ids: Vec<i64> = (0..2 * seq as i64).map(|i| (i * 3) % 5).collect();
        let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![2, seq], ids))]);
        check(&g, &params_of(&g, 17), &inputs, "truncate to the sequence");
    }
}

/// A MoE router's top-k, plain and renormalized, on scores and on softmax probabilities. The
/// inputs are permutations of values at least 0.25 apart (logits, before a softmax): no
/// perturbation of the finite differences ([`H`]) crosses a selection boundary, where
/// the loss jumps and no difference approximates a gradient.
#[test]
fn top_k() {
    for (rows, e, k) in [(2, 4, 2), (3, 5, 3), (1, 6, 1)] {
        for renormalize in [false, true] {
            for through_softmax in [false, true] {
                let what = format!("top_k k={k} renormalize={renormalize} softmax={through_softmax}");
                let mut g = Graph::new(&what);
                let x = g.param("x", &[rows, e]);
                let mut y = x;
                if through_softmax {
                    y = g.add(Op::Softmax, &[y]).unwrap();
                }
                y = g.add(Op::TopK { k, renormalize }, &[y]).unwrap();
                with_loss(&mut g, y);
                let mut params = params_of(&g, 19);
                // Distinct, spread values; positive where renormalized without a softmax (the sum
                // of the kept entries must stay away from zero).
                let data: Vec<f64> = (0..rows * e)
                    .map(|i| {
                        let (r, c) = (i / e, i % e);
                        let rank = (c * 7 + r * 3) % e;
                        let base = if renormalize && !through_softmax { 0.5 } else { -0.6 };
                        base + 0.25 * rank as f64 + 0.01 * r as f64
                    })
                    .collect();
                params.insert("x".into(), t64(vec![rows, e], data));
                check(&g, &params, &none(), &what);
            }
        }
    }
}

// ---- The whole language: small models built from specs, their training loss differentiated.

/// A small spec: `[model]` of `kind` (vocab 24, d_model 16, `layers`) and the given sections.
fn spec(kind: &str, layers: u32, sections: &str) -> String {
    format!(
        "[model]\nname = \"t\"\nkind = \"{kind}\"\nvocab = 24\nd_model = 16\nlayers = {layers}\n\
         max_positions = 16\n{sections}"
    )
}

/// Random parameters for a model: gains near one (`*norm*` tensors), the rest in [-spread, spread)
/// (moderate, keeping softmaxes and norms away from saturation).
fn model_params(g: &Graph, seed: u64, spread: f64) -> Params {
    let mut params = params_of(g, seed);
    for (name, t) in params.iter_mut() {
        let norm = name.contains("norm");
        t.data.iter_mut().for_each(|v| *v = if norm { 1.0 + 0.25 * *v } else { spread * *v });
    }
    params
}

/// The model of `source`, its cross-entropy on sample inputs (batch 2, `seq` tokens, the last
/// of each row unlabelled and, with a padding mask, padded), label smoothing 0.1: every
/// parameter's gradient on a sample of 8 elements (and its largest), all of a small tensor's.
fn whole_model(what: &str, source: &str, seq: usize, seed: u64) {
    let (graph, params, inputs) = model(what, source, seq, seed, 0.5);
    check_sampled(&graph, &params, &inputs, what, |_| true, Some(8));
    same_when_recomputed(&graph, &params, &inputs, what);
    same_when_optimized(&graph, &params, &inputs, what);
}

/// The step optimized for the CPU computes what the unoptimized one does (in f64, within 1e-9 of
/// each output's scale), and every self-attention's backward there is one `attention_grad`
/// (the `attention-grad` rule's differential test over every attention form of the language:
/// each score modifier, grouped heads, padding; cross-attention and Linformer's projected keys
/// keep the unfused form).
fn same_when_optimized(graph: &Graph, params: &Params, inputs: &HashMap<String, Tensor>, what: &str) {
    use kiln_compiler::optimize::optimize_for;
    let plain = gradients(graph, "loss", |_| true).unwrap();
    // Costed at 2048 tokens, where the one op pays for every attention form here.
    use kiln_compiler::{optimize::CostModel, target::Target};
    let target = Target { cost: CostModel { seq: 2048, ..CostModel::cpu() }, ..Target::cpu() };
    let (opt, report) = optimize_for(&plain, &target).unwrap();
    let count = |g: &Graph, name: &str| g.g.node_indices().filter(|&n| g.g[n].op.name() == name).count();
    let self_attentions = graph
        .g
        .node_indices()
        .filter(|&n| {
            let shape = &graph.g[n].shape;
            graph.g[n].op == Op::Softmax && shape.len() == 4 && shape[2] == shape[3] && !what.contains("linformer")
        })
        .count();
    assert_eq!(count(&opt, "attention_grad"), self_attentions, "{what}: {:?}", report.applied);
    let (want, got) = (run_f64(&plain, params, inputs).unwrap(), run_f64(&opt, params, inputs).unwrap());
    for ((name, w), (n, g)) in want.iter().zip(&got) {
        assert_eq!(name, n, "{what}: outputs in another order");
        let scale = w.data.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = w.data.iter().zip(&g.data).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-9 * scale.max(1.0), "{what}: `{name}` differs by {err} when optimized (scale {scale})");
    }
}

/// The gradients with every block's activations recomputed in the backward are the gradients
/// without (the same ops on the same values: equal to the bit), and the step holds less at once
/// where there are two blocks or more.
fn same_when_recomputed(graph: &Graph, params: &Params, inputs: &HashMap<String, Tensor>, what: &str) {
    use kiln_compiler::train::step_memory;
    let all = blocks(graph);
    assert!(!all.is_empty(), "{what}: no blocks");
    let plain = gradients(graph, "loss", |_| true).unwrap();
    let recomputed = gradients_recomputing(graph, "loss", |_| true, &all).unwrap_or_else(|e| panic!("{what}: {e}"));
    let after = recomputed.g.node_indices().filter(|&n| recomputed.g[n].op == Op::After).count();
    assert!(after > 0, "{what}: nothing recomputed");
    let (want, got) = (run_f64(&plain, params, inputs).unwrap(), run_f64(&recomputed, params, inputs).unwrap());
    assert_eq!(want.len(), got.len(), "{what}: outputs");
    for ((name, w), (n, g)) in want.iter().zip(&got) {
        assert_eq!(name, n, "{what}: outputs in another order");
        assert!(w.data == g.data, "{what}: `{name}` differs when recomputed");
    }
    let memory = |g: &Graph| step_memory(g, 4, 16, 0, 0, 0).activations;
    let blocks_per_stack = all.iter().filter(|(stack, _)| *stack == all.first().unwrap().0).count();
    if blocks_per_stack >= 2 {
        assert!(
            memory(&recomputed) < memory(&plain),
            "{what}: recomputing holds {} bytes at once, keeping holds {}",
            memory(&recomputed),
            memory(&plain)
        );
    }
}

type Model = (Graph, Params, HashMap<String, Tensor>);

fn model(what: &str, source: &str, seq: usize, seed: u64, spread: f64) -> Model {
    use kiln_compiler::train::{Objective, loss_graph};
    let fe = kiln_compiler::front_end("t.toml", source).unwrap_or_else(|e| panic!("{what}: {}", e.render()));
    let graph = loss_graph(&fe.graph, Objective { label_smoothing: 0.1 }).unwrap();
    let inputs = kiln_compiler::interp::sample_inputs(&graph, fe.spec.spec.model.vocab as usize, 2, seq).unwrap();
    let params = model_params(&graph, seed, spread);
    (graph, params, inputs)
}

#[test]
fn model_gqa_rope_rotate_half_qk_norm_width() {
    let s = spec(
        "decoder",
        2,
        r#"
[positions]
kind = "rope"
theta = 100.0
[norm]
kind = "rmsnorm"
[attention]
heads = 4
kv_heads = 2
qk_norm = "width"
[ffn]
activation = "silu"
gated = true
d_ff = 24
[head]
tied = false
"#,
    );
    whole_model("gqa, rope rotate-half, width qk-norm", &s, 6, 21);
}

#[test]
fn model_mqa_rope_interleaved() {
    let s = spec(
        "decoder",
        1,
        r#"
[positions]
kind = "rope"
theta = 100.0
style = "interleaved"
[norm]
kind = "rmsnorm"
[attention]
heads = 4
kv_heads = 1
[ffn]
activation = "gelu"
d_ff = 24
"#,
    );
    whole_model("mqa, rope interleaved", &s, 6, 22);
}

#[test]
fn model_partial_rope_parallel_residual() {
    let s = spec(
        "decoder",
        2,
        r#"
[positions]
kind = "rope"
theta = 100.0
fraction = 0.5
[norm]
kind = "layernorm"
parallel_residual = true
[attention]
heads = 2
bias = true
[ffn]
activation = "gelu-tanh"
d_ff = 32
bias = true
[head]
tied = false
bias = true
"#,
    );
    whole_model("partial rope (rotary_dim 4 of 8), parallel residual", &s, 6, 23);
}

#[test]
fn model_alibi() {
    let s = spec(
        "decoder",
        2,
        r#"
[embedding]
norm = true
[positions]
kind = "alibi"
[attention]
heads = 4
bias = true
[ffn]
activation = "gelu-tanh"
bias = true
d_ff = 32
"#,
    );
    whole_model("alibi, embedding norm", &s, 6, 24);
}

#[test]
fn model_softcaps_head_qk_norm_sandwich_window() {
    let s = spec(
        "decoder",
        2,
        r#"
[embedding]
scale = "sqrt-d-model"
[positions]
kind = "rope"
theta = 100.0
global_theta = 1000.0
[norm]
kind = "rmsnorm"
placement = "sandwich"
gain_offset = 1.0
[attention]
heads = 2
kv_heads = 1
head_dim = 8
scale = 0.25
mask = "sliding-window"
window = 3
global_every = 2
qk_norm = "head"
softcap = 2.0
[ffn]
activation = "gelu-tanh"
gated = true
d_ff = 24
[head]
softcap = 3.0
"#,
    );
    whole_model("soft-caps, head qk-norm, sandwich norms, sliding window", &s, 6, 25);
}

/// GELU rather than ReLU: a whole model has many ReLU inputs, and one within a finite
/// difference's step of the kink would average two slopes (ReLU's rule is checked on its own).
#[test]
fn model_deepnorm() {
    let s = spec(
        "encoder",
        2,
        r#"
[norm]
kind = "layernorm"
placement = "deepnorm"
[attention]
heads = 2
bias = true
[ffn]
activation = "gelu"
d_ff = 32
bias = true
[head]
tied = false
[outputs]
logits = true
"#,
    );
    whole_model("deepnorm (post, alpha)", &s, 6, 26);
}

#[test]
fn model_t5_relative_bias_cross_attention_padding() {
    let s = spec(
        "encoder-decoder",
        2,
        r#"
[positions]
kind = "relative-bias"
buckets = 8
max_distance = 12
[norm]
kind = "rmsnorm"
eps = 1e-6
[attention]
heads = 2
head_dim = 8
scale = 1.0
padding_mask = true
[ffn]
activation = "gelu-tanh"
gated = true
d_ff = 24
"#,
    );
    // T5 scales no logits (scale 1.0): at weights of +-0.5 the second layer's softmaxes are sharp
    // enough that the loss curves within a step of 1e-2 (f32's differences of one embedding
    // element went -0.13, 2.217, 2.274, 2.203, 2.195 at h = 3e-2 .. 3e-4, converging to the rule's
    // 2.194); at f64's step of 1e-6 it does not, and the weights need not be softened.
    let (graph, params, inputs) = model("t5", &s, 6, 27, 0.5);
    check_sampled(&graph, &params, &inputs, "t5: relative bias, cross-attention, padding", |_| true, Some(8));
    same_when_recomputed(&graph, &params, &inputs, "t5");
    same_when_optimized(&graph, &params, &inputs, "t5");
}

#[test]
fn model_linformer() {
    for (shared, seed) in [(false, 28), (true, 29)] {
        let s = spec(
            "encoder",
            1,
            &format!(
                r#"
[attention]
heads = 2
low_rank = 4
low_rank_shared = {shared}
[ffn]
d_ff = 32
bias = true
[head]
tied = false
[outputs]
logits = true
"#
            ),
        );
        whole_model(&format!("linformer (shared {shared})"), &s, 6, seed);
    }
}

#[test]
fn model_block_sparse_padding() {
    let s = spec(
        "encoder",
        1,
        r#"
[norm]
placement = "post"
[attention]
heads = 2
bias = true
padding_mask = true
[attention.block_sparse]
block = 2
global = 1
window = 0
random = 1
seed = 3
[ffn]
d_ff = 32
bias = true
[outputs]
logits = true
"#,
    );
    whole_model("block-sparse (bigbird), padding", &s, 8, 30);
}

#[test]
fn model_bert_padding_token_types() {
    let s = spec(
        "encoder",
        2,
        r#"
[embedding]
norm = true
token_types = 2
[norm]
kind = "layernorm"
placement = "post"
[attention]
heads = 2
bias = true
padding_mask = true
[ffn]
activation = "gelu"
d_ff = 32
bias = true
[outputs]
logits = true
"#,
    );
    whole_model("encoder with padded positions, token types", &s, 6, 31);
}

/// The smallest gap, over every row of every top-k's input, between the k-th largest entry and
/// the next: how far a perturbation may move the router's probabilities before a selection
/// changes.
fn top_k_gap(graph: &Graph, params: &Params, inputs: &HashMap<String, Tensor>) -> f64 {
    let mut g = graph.clone();
    let mut ks = Vec::new();
    for n in graph.g.node_indices() {
        if let Op::TopK { k, .. } = graph.g[n].op {
            let probs = graph.operands(n)[0];
            g.outputs.push((format!("router.{}", ks.len()), probs));
            ks.push(k);
        }
    }
    assert!(!ks.is_empty(), "no top_k in the model");
    let out = run_f64(&g, params, inputs).unwrap();
    let mut gap = f64::INFINITY;
    for (i, &k) in ks.iter().enumerate() {
        let t = &out.iter().find(|(n, _)| *n == format!("router.{i}")).unwrap().1;
        let e = *t.shape.last().unwrap();
        for row in t.data.chunks(e) {
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            gap = gap.min(sorted[k - 1] - sorted[k]);
        }
    }
    gap
}

/// A mixture of experts, top-2 of 4 renormalized: gradients reach the router (through the kept
/// probabilities and their renormalization) and the chosen experts. The parameters are the first
/// seed's whose every routing decision has a margin of at least 0.02 in probability: a finite
/// difference's perturbation ([`H`] of one weight) moves a probability far less, so no
/// selection flips between the loss evaluations (where the loss jumps and a difference
/// approximates nothing).
#[test]
fn model_moe_top2_renormalized() {
    let s = spec(
        "decoder",
        2,
        r#"
[positions]
kind = "rope"
theta = 100.0
[norm]
kind = "rmsnorm"
[attention]
heads = 2
kv_heads = 1
[ffn]
activation = "silu"
gated = true
d_ff = 16
[moe]
experts = 4
top_k = 2
renormalize = true
[head]
tied = false
"#,
    );
    let what = "moe top-2 of 4, renormalized";
    let (graph, params, inputs) = (40..80)
        .map(|seed| model(what, &s, 5, seed, 0.5))
        .find(|(g, p, i)| top_k_gap(g, p, i) >= 0.02)
        .expect("a seed whose routing has a margin");
    check_sampled(&graph, &params, &inputs, what, |_| true, Some(8));
}
