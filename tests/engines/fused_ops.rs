//! The fused ops (`linear` with its prologues and epilogues, `masked_softmax`, `attention`,
//! `packed_attention`, `heads`, `add_norm`): on the interpreter each one
//! equals the composition of primitive ops that defines it, and their WGSL kernels (plain, and
//! chunked over small buffers) agree with the interpreter on wgpu, as do the CPU backend's
//! kernels.
//!
//! Every case is a tiny graph of parameters (random, except key masks, which are set to patterns
//! that hide some keys and every key of some rows) feeding the fused op, output `fused`, and the
//! same computation from primitive ops, output `unfused`.

use crate::common;

use kiln_compiler::graph::{
    Activation, BlockPattern, Bucketing, Dim, Graph, NodeIndex, Op, PackedAttention, PairStyle, Prologue, RopeCols,
    Rotation, Scalar, ScoreMods,
};
use kiln_compiler::interp;
use kiln_compiler::lower::{Options, lower_with};
use kiln_compiler::semantics;
use kiln_compiler::tensor::Tensor;
use kiln_runtime::{Gpu, GpuModel};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Allowed difference, relative to `max(1, max |value|)`, between a backend (wgpu, cpu) and the
/// interpreter.
const GPU_TOLERANCE: f32 = 1e-5;

/// Allowed difference between a fused op and its composition on the interpreter (which evaluates
/// the fused op as exactly that composition).
const INTERP_TOLERANCE: f32 = 1e-6;

/// A device whose buffers hold at most 64 floats, so most tensors here are split into chunks and
/// the chunked kernel variants run.
fn chunked_gpu() -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Option<Arc<Gpu>>> = OnceLock::new();
    GPU.get_or_init(|| common::gpu_with_buffer_limit(256)).clone()
}

fn assert_close(what: &str, expected: &Tensor, got: &Tensor, tolerance: f32) {
    let scale = expected.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let err = expected.max_abs_diff(got);
    assert!(err <= tolerance * scale, "{what}: differs by {err:e} (max |x| {scale})");
}

/// One fused op over parameters (name, shape); a parameter named `key_mask` gets the values
/// `key_mask` (1 = attend) instead of random ones.
struct Case {
    name: String,
    op: Op,
    operands: Vec<(&'static str, Vec<usize>)>,
    key_mask: Option<Vec<f32>>,
}

impl Case {
    fn new(name: String, op: Op, operands: &[(&'static str, &[usize])], key_mask: Option<Vec<f32>>) -> Case {
        Case { name, op, operands: operands.iter().map(|(n, s)| (*n, s.to_vec())).collect(), key_mask }
    }
}

/// A fused softmax's attributes, to compose from primitive ops.
struct Softmax {
    scale: Scalar,
    alibi: bool,
    causal: bool,
    window: Option<usize>,
    mods: ScoreMods,
}

impl Softmax {
    /// `softmax(mask(bias(alibi(softcap(scores * scale)))))` over scores `[b, heads, q, k]`,
    /// `rest` the optional key mask and bias table.
    fn compose(&self, g: &mut Graph, scores: NodeIndex, rest: &[NodeIndex], (q, k): (usize, usize)) -> NodeIndex {
        let mut add = |op: Op, operands: &[NodeIndex]| g.add(op, operands).unwrap_or_else(|e| panic!("{e}"));
        let (mask, table) = semantics::score_operands(rest, &self.mods);
        let mut y = add(Op::Scale { factor: self.scale }, &[scores]);
        if let Some(cap) = self.mods.softcap {
            y = add(Op::SoftCap { cap }, &[y]);
        }
        if self.alibi {
            y = add(Op::Alibi, &[y]);
        }
        if let (Some(r), Some(&table)) = (self.mods.relative, table) {
            let op = r.bias(Dim::Fixed(q), Dim::Fixed(k));
            let bias = add(op, &[table]);
            y = add(Op::Add, &[y, bias]);
        }
        let operands: Vec<NodeIndex> = std::iter::once(y).chain(mask.copied()).collect();
        y = match self.mods.sparse {
            Some(p) => add(p.mask(), &operands),
            None => add(Op::Mask { causal: self.causal, window: self.window }, &operands),
        };
        add(Op::Softmax, &[y])
    }
}

/// Builds every case's fused op and its primitive composition into one graph (so the GPU model
/// compiles each distinct kernel once), checks each pair against each other on the interpreter
/// and both against the interpreter on wgpu, plainly and, if `chunked`, over small buffers.
fn check(cases: &[Case], chunked: bool) {
    let (g, params, expected) = evaluate(cases);
    let devices = [("wgpu", common::gpu()), ("wgpu, chunked", if chunked { chunked_gpu() } else { None })];
    for (device, gpu) in devices {
        let Some(gpu) = gpu else { continue };
        // Unfolded: every op here reads parameters alone, and would otherwise be evaluated at load
        // time by the interpreter instead of running its kernel.
        let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
        let model = GpuModel::new(gpu, plan, &params).unwrap();
        let got = model.run(&HashMap::new()).unwrap_or_else(|e| panic!("{device}: {e}"));
        for (k, ((out, want), (_, got))) in expected.iter().zip(&got).enumerate() {
            assert_close(&format!("{}: `{out}` on {device}", cases[k / 2].name), want, got, GPU_TOLERANCE);
        }
    }
    on_the_cpu(cases, &g, &params, &expected);
}

/// The CPU backend's kernels on [`evaluate`]'s graph, on one thread and on three (rows and heads
/// split unevenly), against the interpreter's outputs.
fn on_the_cpu(cases: &[Case], g: &Graph, params: &HashMap<String, Tensor>, expected: &[(String, Tensor)]) {
    let plan = lower_with(g, Options { fold_constants: false, ..Options::default() });
    for threads in [1, 3] {
        let model = kiln_runtime::CpuModel::new(plan.clone(), params, &HashMap::new(), threads, &()).unwrap();
        let got = model.run(&HashMap::new()).unwrap_or_else(|e| panic!("cpu: {e}"));
        for (k, ((out, want), (_, got))) in expected.iter().zip(&got).enumerate() {
            let what = format!("{}: `{out}` on cpu, {threads} threads", cases[k / 2].name);
            assert_close(&what, want, got, GPU_TOLERANCE);
        }
    }
}

/// The fused ops of [`check`]'s cases on wgpu alone (their compositions checked on the
/// interpreter only), the kernels compiled with each of `forms` (forms the adapter would not be
/// given by default, such as a hardware adapter's); the model of each.
fn check_forms(cases: &[Case], forms: &[kiln_compiler::back::wgsl::Options]) -> Vec<GpuModel> {
    let (mut g, params, expected) = evaluate(cases);
    g.outputs.retain(|(name, _)| name.ends_with(".fused"));
    let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
    let gpu = common::gpu().expect("the caller checked for an adapter");
    let mut models = Vec::new();
    for options in forms {
        let form = options.describe();
        let model = GpuModel::with_progress(gpu.clone(), &plan, options, &params, &HashMap::new(), &())
            .unwrap_or_else(|e| panic!("{form}: {e}"));
        let got = model.run(&HashMap::new()).unwrap_or_else(|e| panic!("{form}: {e}"));
        for ((case, want), (out, got)) in cases.iter().zip(expected.iter().step_by(2)).zip(&got) {
            assert_close(&format!("{}: `{out}` on wgpu ({form})", case.name), &want.1, got, GPU_TOLERANCE);
        }
        models.push(model);
    }
    models
}

/// The graph of [`check`]'s cases (outputs `caseN.fused`, `caseN.unfused`), its parameters, and
/// its outputs on the interpreter, each fused op checked against its composition there.
fn evaluate(cases: &[Case]) -> (Graph, HashMap<String, Tensor>, Vec<(String, Tensor)>) {
    let mut g = Graph::new("fused");
    for (c, case) in cases.iter().enumerate() {
        let name = &case.name;
        let a: Vec<_> = case.operands.iter().map(|(n, shape)| g.param(&format!("case{c}.{n}"), shape)).collect();
        let fused = g.add(case.op.clone(), &a).unwrap_or_else(|e| panic!("{name}: {e}"));
        macro_rules! add {
            ($op:expr, $($x:expr),+) => {
                g.add($op, &[$($x),+]).unwrap_or_else(|e| panic!("{name}: {e}"))
            };
        }
        let unfused = match &case.op {
            Op::Linear { act, bias, residual, norm, glu, rope } => {
                let mut next = 1;
                let x = match norm {
                    None => a[0],
                    Some(p) if p.rms => {
                        next = 2;
                        add!(Op::RmsNorm { eps: p.eps }, a[0], a[1])
                    }
                    Some(p) if p.bias => {
                        next = 3;
                        add!(Op::LayerNorm { eps: p.eps }, a[0], a[1], a[2])
                    }
                    Some(p) => {
                        next = 2;
                        add!(Op::LayerNorm { eps: p.eps }, a[0], a[1])
                    }
                };
                let mut y = add!(Op::MatMul { transpose_b: true }, x, a[next]);
                if *bias {
                    y = add!(Op::Add, y, a[next + 1]);
                }
                let rank = case.operands[0].1.len();
                let m = case.operands[next].1[0];
                if *glu {
                    let gate = add!(Op::Slice { axis: rank - 1, start: 0, len: m / 2 }, y);
                    let up = add!(Op::Slice { axis: rank - 1, start: m / 2, len: m / 2 }, y);
                    let gate = match act {
                        Some(act) => add!(Op::Act(*act), gate),
                        None => gate,
                    };
                    y = add!(Op::Mul, gate, up);
                } else if let Some(act) = act {
                    y = add!(Op::Act(*act), y);
                }
                if let Some(r) = rope {
                    // Split the rotated columns into heads, rotate them with `rope`, put them back.
                    let x = &case.operands[0].1;
                    let (b, s, n) = (x[0], x[1], if *glu { m / 2 } else { m });
                    let heads = r.len / r.head_dim;
                    let cols = add!(Op::Slice { axis: 2, start: r.start, len: r.len }, y);
                    let split = vec![Dim::Fixed(b), Dim::Fixed(s), Dim::Fixed(heads), Dim::Fixed(r.head_dim)];
                    let t = add!(Op::Reshape { shape: split }, cols);
                    let t = add!(Op::Permute { perm: vec![0, 2, 1, 3] }, t);
                    let t = add!(Op::Rope { theta: r.theta, rotary_dim: r.rotary_dim, style: r.style }, t);
                    let t = add!(Op::Permute { perm: vec![0, 2, 1, 3] }, t);
                    let mut rotated =
                        add!(Op::Reshape { shape: vec![Dim::Fixed(b), Dim::Fixed(s), Dim::Fixed(r.len)] }, t);
                    if r.start > 0 {
                        let head = add!(Op::Slice { axis: 2, start: 0, len: r.start }, y);
                        rotated = add!(Op::Concat { axis: 2 }, head, rotated);
                    }
                    if r.start + r.len < n {
                        let tail = add!(Op::Slice { axis: 2, start: r.start + r.len, len: n - r.start - r.len }, y);
                        rotated = add!(Op::Concat { axis: 2 }, rotated, tail);
                    }
                    y = rotated;
                }
                if *residual {
                    y = add!(Op::Add, y, *a.last().unwrap());
                }
                y
            }
            Op::Heads { start, heads, head_dim, norm, rope } => {
                let gain = usize::from(norm.is_some());
                let xi = a.len() - 1 - gain;
                let x = &case.operands[xi].1;
                let cols = add!(Op::Slice { axis: 2, start: *start, len: heads * head_dim }, a[xi]);
                let split = vec![Dim::Fixed(x[0]), Dim::Fixed(x[1]), Dim::Fixed(*heads), Dim::Fixed(*head_dim)];
                let t = add!(Op::Reshape { shape: split }, cols);
                let mut t = add!(Op::Permute { perm: vec![0, 2, 1, 3] }, t);
                if let Some(eps) = norm {
                    t = add!(Op::RmsNorm { eps: *eps }, t, a[a.len() - 1]);
                }
                if let Some(r) = rope {
                    t = add!(Op::Rope { theta: r.theta, rotary_dim: r.rotary_dim, style: r.style }, t);
                }
                if xi == 1 { add!(Op::Concat { axis: 2 }, a[0], t) } else { t }
            }
            Op::PackedAttention(p) => {
                let x = &case.operands[0].1;
                let (b, s) = (x[0], x[1]);
                let mut split = |start: usize, count: usize| {
                    let cols = add!(Op::Slice { axis: 2, start, len: count * p.head_dim }, a[0]);
                    let shape = vec![Dim::Fixed(b), Dim::Fixed(s), Dim::Fixed(count), Dim::Fixed(p.head_dim)];
                    let t = add!(Op::Reshape { shape }, cols);
                    add!(Op::Permute { perm: vec![0, 2, 1, 3] }, t)
                };
                let qh = split(p.q, p.heads);
                // Cached: keys and values are operands of their own.
                let (kh, vh, rest) = match p.cached {
                    true => (a[1], a[2], &a[3..]),
                    false => (split(p.k, p.kv_heads), split(p.v, p.kv_heads), &a[1..]),
                };
                let op = p.unpacked();
                let operands: Vec<_> = [qh, kh, vh].into_iter().chain(rest.iter().copied()).collect();
                g.add(op, &operands).unwrap_or_else(|e| panic!("{name}: {e}"))
            }
            Op::MaskedSoftmax { scale, alibi, causal, window, mods } => {
                let sh = &case.operands[0].1;
                let soft = Softmax { scale: *scale, alibi: *alibi, causal: *causal, window: *window, mods: *mods };
                soft.compose(&mut g, a[0], &a[1..], (sh[2], sh[3]))
            }
            Op::Attention { scale, alibi, causal, window, mods } => {
                let (q, k) = (&case.operands[0].1, &case.operands[1].1);
                let (b, h, s, d, kv, t) = (q[0], q[1], q[2], q[3], k[1], k[2]);
                let (mut k, mut v) = (a[1], a[2]);
                if kv < h {
                    k = add!(Op::RepeatHeads { times: h / kv }, k);
                    v = add!(Op::RepeatHeads { times: h / kv }, v);
                }
                let y = add!(Op::MatMul { transpose_b: true }, a[0], k);
                let soft = Softmax { scale: *scale, alibi: *alibi, causal: *causal, window: *window, mods: *mods };
                let mut y = soft.compose(&mut g, y, &a[3..], (s, t));
                y = add!(Op::MatMul { transpose_b: false }, y, v);
                y = add!(Op::Permute { perm: vec![0, 2, 1, 3] }, y);
                add!(Op::Reshape { shape: vec![Dim::Fixed(b), Dim::Fixed(s), Dim::Fixed(h * d)] }, y)
            }
            Op::AttentionGrad { scale, alibi, causal, window, mods } => {
                // The backward autodiff builds for the unfused attention.
                let (q, k) = (&case.operands[0].1, &case.operands[1].1);
                let (b, h, s, d, kv) = (q[0], q[1], q[2], q[3], k[1]);
                let (mut k, mut v) = (a[1], a[2]);
                if kv < h {
                    k = add!(Op::RepeatHeads { times: h / kv }, k);
                    v = add!(Op::RepeatHeads { times: h / kv }, v);
                }
                let scores = add!(Op::MatMul { transpose_b: true }, a[0], k);
                let soft = Softmax { scale: *scale, alibi: *alibi, causal: *causal, window: *window, mods: *mods };
                let p = soft.compose(&mut g, scores, &a[4..], (s, s));
                let dp = add!(Op::MatMul { transpose_b: true }, a[3], v);
                let mut ds = add!(Op::SoftmaxGrad, p, dp);
                let (mask, _) = semantics::score_operands(&a[4..], mods);
                let zeros = add!(Op::Scale { factor: Scalar(0.0) }, scores);
                let ones = add!(Op::Offset { value: Scalar(1.0) }, zeros);
                let mut gate = vec![ones];
                gate.extend(mask.copied());
                let gate = match mods.sparse {
                    Some(pattern) => g.add(pattern.mask(), &gate).unwrap(),
                    None => g.add(Op::Mask { causal: *causal, window: *window }, &gate).unwrap(),
                };
                ds = add!(Op::ActGrad(Activation::Relu), gate, ds);
                if let Some(cap) = mods.softcap {
                    let y = add!(Op::Scale { factor: *scale }, scores);
                    let y = add!(Op::SoftCap { cap }, y);
                    let y2 = add!(Op::Mul, y, y);
                    let minus = add!(Op::Scale { factor: Scalar(-1.0 / (cap.0 * cap.0)) }, y2);
                    let slope = add!(Op::Offset { value: Scalar(1.0) }, minus);
                    ds = add!(Op::Mul, ds, slope);
                }
                ds = add!(Op::Scale { factor: *scale }, ds);
                let transpose = Op::Permute { perm: vec![0, 1, 3, 2] };
                let dq = add!(Op::MatMul { transpose_b: false }, ds, k);
                let dst = add!(transpose.clone(), ds);
                let dk = add!(Op::MatMul { transpose_b: false }, dst, a[0]);
                let pt = add!(transpose, p);
                let dv = add!(Op::MatMul { transpose_b: false }, pt, a[3]);
                let one = vec![Dim::Fixed(1), Dim::Fixed(b), Dim::Fixed(h), Dim::Fixed(s), Dim::Fixed(d)];
                let [dq, dk, dv] = [dq, dk, dv].map(|x| add!(Op::Reshape { shape: one.clone() }, x));
                let qk = add!(Op::Concat { axis: 0 }, dq, dk);
                add!(Op::Concat { axis: 0 }, qk, dv)
            }
            Op::LowRank { start, heads, head_dim } => {
                let x = &case.operands[0].1;
                let (b, n) = (x[0], x[1]);
                let cols = add!(Op::Slice { axis: 2, start: *start, len: heads * head_dim }, a[0]);
                let shape = vec![Dim::Fixed(b), Dim::Fixed(n), Dim::Fixed(*heads), Dim::Fixed(*head_dim)];
                let y = add!(Op::Reshape { shape }, cols);
                let y = add!(Op::Permute { perm: vec![0, 2, 3, 1] }, y);
                let cut = add!(Op::Truncate { len: Dim::Fixed(n) }, a[1]);
                let y = add!(Op::MatMul { transpose_b: false }, y, cut);
                add!(Op::Permute { perm: vec![0, 1, 3, 2] }, y)
            }
            Op::AddNorm { rms, eps, after } => {
                let x = if *after { a[1] } else { add!(Op::Add, a[0], a[1]) };
                let normed = match (rms, a.len()) {
                    (true, _) => add!(Op::RmsNorm { eps: *eps }, x, a[2]),
                    (false, 3) => add!(Op::LayerNorm { eps: *eps }, x, a[2]),
                    (false, _) => add!(Op::LayerNorm { eps: *eps }, x, a[2], a[3]),
                };
                if *after { add!(Op::Add, a[0], normed) } else { normed }
            }
            other => panic!("{} is not a fused op", other.name()),
        };
        g.outputs.push((format!("case{c}.fused"), fused));
        g.outputs.push((format!("case{c}.unfused"), unfused));
    }
    g.check().unwrap();

    let mut params = interp::random_params(&g, 7).unwrap();
    for (c, case) in cases.iter().enumerate() {
        if let Some(m) = &case.key_mask {
            let name = format!("case{c}.key_mask");
            let shape = params[&name].shape.clone();
            params.insert(name, Tensor::f32(shape, m.clone()));
        }
    }
    let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
    for (case, pair) in cases.iter().zip(expected.chunks(2)) {
        let what = format!("{}: fused vs unfused on the interpreter", case.name);
        assert_close(&what, &pair[1].1, &pair[0].1, INTERP_TOLERANCE);
    }
    (g, params, expected)
}

#[test]
fn linear_with_every_epilogue() {
    let mut cases = Vec::new();
    let acts =
        [None, Some(Activation::Gelu), Some(Activation::GeluTanh), Some(Activation::Silu), Some(Activation::Relu)];
    for act in acts {
        for (bias, residual) in [(false, false), (true, false), (false, true), (true, true)] {
            let op = Op::linear(act, bias, residual);
            for x in [&[2, 3, 16][..], &[5, 16]] {
                let mut out = x.to_vec();
                *out.last_mut().unwrap() = 12;
                let mut operands: Vec<(&str, &[usize])> = vec![("x", x), ("w", &[12, 16])];
                if bias {
                    operands.push(("b", &[12]));
                }
                if residual {
                    operands.push(("r", &out));
                }
                cases.push(Case::new(format!("{} x{x:?}", op.name()), op.clone(), &operands, None));
            }
        }
    }
    check(&cases, true);
}

/// Key mask for `batch` rows of `keys` keys: the first row hides every third key, the second
/// hides every key (so all its query rows are fully masked), further rows attend everywhere.
fn key_mask(batch: usize, keys: usize) -> Vec<f32> {
    (0..batch * keys)
        .map(|i| match i / keys {
            0 => f32::from(i % 3 != 1),
            1 => 0.0,
            _ => 1.0,
        })
        .collect()
}

#[test]
fn masked_softmax_with_every_mask() {
    let scale = Scalar(2.5);
    let mut cases = Vec::new();
    // (heads, queries, keys): more keys than queries (a cache), fewer, and a non-power-of-two head
    // count for the ALiBi slopes.
    for (h, q, k) in [(4, 3, 5), (4, 5, 3), (6, 4, 4)] {
        for alibi in [false, true] {
            for (causal, window) in [(false, None), (true, None), (true, Some(2)), (false, Some(1))] {
                for masked in [false, true] {
                    let op = Op::MaskedSoftmax { scale, alibi, causal, window, mods: ScoreMods::default() };
                    let (scores, mask) = ([2, h, q, k], [2, k]);
                    let mut operands: Vec<(&str, &[usize])> = vec![("scores", &scores)];
                    if masked {
                        operands.push(("key_mask", &mask));
                    }
                    let name = format!("{} {} h={h} q={q} k={k} masked={masked}", op.name(), op.attrs());
                    cases.push(Case::new(name, op, &operands, masked.then(|| key_mask(2, k))));
                }
            }
        }
    }
    check(&cases, true);
}

#[test]
fn attention_mha_gqa_and_mqa_with_every_mask() {
    // (batch, heads, kv heads, queries, keys, head_dim).
    let shapes = [
        (2, 4, 4, 3, 5, 8),  // multi-head, a cache longer than the queries
        (2, 4, 2, 5, 3, 8),  // grouped-query, more queries than keys
        (3, 4, 1, 4, 4, 16), // multi-query
        (2, 6, 3, 3, 6, 4),  // non-power-of-two heads (ALiBi slopes)
        // Blocks of query rows (see `kiln_compiler::back::wgsl::attention`), with partial blocks and
        // key tiles; too large for the chunked test's 256-byte buffers.
        (1, 4, 4, 19, 23, 16), // multi-head, 8 rows per block
        (2, 6, 2, 9, 10, 16),  // grouped-query, 2 rows x 3 heads per block
        (1, 3, 1, 70, 75, 8),  // 70 rows past 5 cached keys: the CPU's rows form (not on a block)
        // The CPU's prefill form (blocks of 64 query rows, their per-head products and
        // softmax): two blocks, the second partial; and a grouped-query block after 64 cached
        // keys (queries starting on a block).
        (1, 3, 1, 70, 70, 8),
        (1, 4, 2, 20, 84, 16),
        // A decode step over many keys and few key/value heads: the CPU's parts of the keys
        // (2 of 150 with 3 threads; the second sequence every key masked), their statistics
        // combined.
        (2, 4, 2, 1, 300, 8),
    ];
    let (mut cases, mut blocked) = (Vec::new(), Vec::new());
    for (b, h, kv, s, t, d) in shapes {
        let cases = if s > 5 || t > 100 { &mut blocked } else { &mut cases };
        let scale = Scalar(1.5 / (d as f32).sqrt());
        for alibi in [false, true] {
            for (causal, window) in [(false, None), (true, None), (true, Some(2)), (false, Some(3))] {
                for masked in [false, true] {
                    let op = Op::Attention { scale, alibi, causal, window, mods: ScoreMods::default() };
                    let (q, k, mask) = ([b, h, s, d], [b, kv, t, d], [b, t]);
                    let mut operands: Vec<(&str, &[usize])> = vec![("q", &q), ("k", &k), ("v", &k)];
                    if masked {
                        operands.push(("key_mask", &mask));
                    }
                    let name =
                        format!("{} {} b={b} h={h} kv={kv} s={s} t={t} d={d} masked={masked}", op.name(), op.attrs());
                    cases.push(Case::new(name, op, &operands, masked.then(|| key_mask(b, t))));
                }
            }
        }
    }
    check(&cases, true);
    check(&blocked, false);
}

/// The score modifiers the tests combine with every form: a soft-cap, a relative position bias
/// both ways, and a block pattern (bidirectional only; with global, window and random blocks).
fn modifiers() -> Vec<(bool, ScoreMods)> {
    let relative = |bidirectional| Some(Bucketing { buckets: 6, max_distance: 5, bidirectional });
    let sparse = Some(BlockPattern { block: 2, global: 1, window: 1, random: 2, seed: 5 });
    vec![
        (true, ScoreMods { softcap: Some(Scalar(1.5)), ..ScoreMods::default() }),
        (false, ScoreMods { softcap: Some(Scalar(1.5)), ..ScoreMods::default() }),
        (true, ScoreMods { relative: relative(false), ..ScoreMods::default() }),
        (false, ScoreMods { relative: relative(true), ..ScoreMods::default() }),
        (false, ScoreMods { sparse, ..ScoreMods::default() }),
        (false, ScoreMods { softcap: Some(Scalar(2.0)), relative: relative(true), sparse }),
    ]
}

#[test]
fn softcap_relative_bias_and_block_pattern_in_every_kernel() {
    let (mut cases, mut blocked) = (Vec::new(), Vec::new());
    for (causal, mods) in modifiers() {
        let heads = |h: usize| if mods.relative.is_some() { vec![6, h] } else { vec![] };
        for masked in [false, true] {
            // The masked softmax, over more keys than queries (a cache) and fewer.
            for (h, q, k) in [(4, 3, 5), (2, 5, 3)] {
                let op = Op::MaskedSoftmax { scale: Scalar(1.3), alibi: false, causal, window: None, mods };
                let (scores, mask, table) = ([2, h, q, k], [2, k], heads(h));
                let mut operands: Vec<(&str, &[usize])> = vec![("scores", &scores)];
                if masked {
                    operands.push(("key_mask", &mask));
                }
                if !table.is_empty() {
                    operands.push(("table", &table));
                }
                let name = format!("{} {} h={h} q={q} k={k} masked={masked}", op.name(), op.attrs());
                cases.push(Case::new(name, op, &operands, masked.then(|| key_mask(2, k))));
            }
            if !masked {
                // The attention kernels run with the key mask only (its paths include the
                // others'), to keep the number of distinct kernels lavapipe compiles down.
                continue;
            }
            // Attention: a decode step, a short prompt, blocks of query rows (wgpu) and the CPU's
            // prefill form.
            // (And a decode step over 300 keys, which the CPU splits into parts.)
            for (b, h, kv, s, t, d) in [
                (2, 4, 2, 1, 9, 8),
                (2, 4, 4, 3, 5, 8),
                (1, 4, 4, 19, 23, 16),
                (1, 3, 1, 70, 75, 8),
                (2, 4, 2, 1, 300, 8),
            ] {
                let cases = if s > 5 || t > 100 { &mut blocked } else { &mut cases };
                let op = Op::Attention { scale: Scalar(0.6), alibi: false, causal, window: None, mods };
                let (q, k, mask, table) = ([b, h, s, d], [b, kv, t, d], [b, t], heads(h));
                let mut operands: Vec<(&str, &[usize])> = vec![("q", &q), ("k", &k), ("v", &k)];
                if masked {
                    operands.push(("key_mask", &mask));
                }
                if !table.is_empty() {
                    operands.push(("table", &table));
                }
                let name = format!("{} {} b={b} h={h} kv={kv} s={s} t={t} masked={masked}", op.name(), op.attrs());
                cases.push(Case::new(name, op, &operands, masked.then(|| key_mask(b, t))));
            }
            // Packed attention, short and in blocks of rows.
            for seq in [5, 13] {
                let cases = if seq > 5 { &mut blocked } else { &mut cases };
                let (h, kv, d) = (4, 2, 8);
                let op = Op::PackedAttention(PackedAttention {
                    scale: Scalar(0.4),
                    alibi: false,
                    causal,
                    window: None,
                    mods,
                    heads: h,
                    kv_heads: kv,
                    head_dim: d,
                    q: 0,
                    k: h * d,
                    v: (h + kv) * d,
                    cached: false,
                    appends: false,
                });
                let (x, mask, table) = ([2, seq, (h + 2 * kv) * d], [2, seq], heads(h));
                let mut operands: Vec<(&str, &[usize])> = vec![("qkv", &x)];
                if masked {
                    operands.push(("key_mask", &mask));
                }
                if !table.is_empty() {
                    operands.push(("table", &table));
                }
                let name = format!("{} seq={seq} masked={masked}", op.attrs());
                cases.push(Case::new(name, op, &operands, masked.then(|| key_mask(2, seq))));
            }
        }
    }
    check(&cases, true);
    check(&blocked, false);
    // The blocked forms at every key tile `kiln tune` may choose.
    use kiln_compiler::back::wgsl::{self, attention::KEY_TILES};
    if common::gpu().is_some() {
        let forms: Vec<wgsl::Options> = (KEY_TILES.iter())
            .map(|&t| wgsl::Options { attention_key_tile: Some(t), ..wgsl::Options::default() })
            .collect();
        check_forms(&blocked, &forms);
    }
}

/// Attention's backward with every mask and modifier, grouped heads and padding: at short
/// sequences on wgpu in both forms (the chunked step's single dispatch, whose key rows recompute
/// every query's statistics, and the two dispatches of the statistics in partials), and longer
/// ones — over several of the CPU's tiles of query rows and a block pattern's blocks, several of
/// the gradients' workgroup chunks of 64 rows (the last short, bounded by the masks or not), and
/// heads wider than the workgroup — in the two-dispatch form and on the CPU.
#[test]
fn attention_grad_with_every_mask_and_modifier() {
    let (mut tiny, mut short, mut long) = (Vec::new(), Vec::new(), Vec::new());
    let plain = [(false, false, None), (true, true, None), (false, true, Some(2)), (true, false, Some(3))]
        .map(|(alibi, causal, window)| (alibi, causal, window, ScoreMods::default()));
    let modified = modifiers().into_iter().map(|(causal, mods)| (false, causal, None, mods));
    for (alibi, causal, window, mods) in plain.into_iter().chain(modified) {
        let table = |h: usize| if mods.relative.is_some() { vec![6, h] } else { vec![] };
        for masked in [false, true] {
            // (The last two are wider than a workgroup's 64 lanes: each lane owns several columns
            // of its row's gradient, up to the largest head kiln compiles.)
            let shapes = [(2, 4, 2, 5, 8), (1, 2, 1, 9, 4), (1, 3, 1, 70, 8), (2, 2, 2, 130, 4), (1, 2, 1, 67, 80)];
            let widest = (1, 2, 1, 5, kiln_compiler::back::wgsl::target::MAX_ATTENTION_HEAD_DIM);
            for (b, h, kv, s, d) in shapes.into_iter().chain([widest]) {
                // (The chunked form at 64 floats a chunk binds too many buffers past the tiny.)
                let cases = match s {
                    ..=5 => &mut short,
                    6..=9 => &mut tiny,
                    _ => &mut long,
                };
                if s > 9 && !masked && d < 64 {
                    continue;
                }
                let op = Op::AttentionGrad { scale: Scalar(0.6), alibi, causal, window, mods };
                let (q, k, mask, table) = ([b, h, s, d], [b, kv, s, d], [b, s], table(h));
                let mut operands: Vec<(&str, &[usize])> = vec![("q", &q), ("k", &k), ("v", &k), ("dout", &q)];
                if masked {
                    operands.push(("key_mask", &mask));
                }
                if !table.is_empty() {
                    operands.push(("table", &table));
                }
                let name = format!("{} {} b={b} h={h} kv={kv} s={s} masked={masked}", op.name(), op.attrs());
                cases.push(Case::new(name, op, &operands, masked.then(|| key_mask(b, s))));
            }
        }
    }
    check(&tiny, true);
    check(&short, false);
    check(&long, false);
}

#[test]
fn low_rank_projection() {
    // (heads, head_dim, first column, width, sequence, rows of e, r): whole rows, a column range
    // of wider rows, and a sequence shorter than e.
    let mut cases = Vec::new();
    for (heads, hd, start, width, n, rows, r) in [(2, 4, 0, 8, 5, 5, 3), (3, 4, 8, 24, 4, 7, 2), (1, 8, 4, 12, 6, 9, 5)]
    {
        let op = Op::LowRank { start, heads, head_dim: hd };
        let (x, e) = ([2, n, width], [rows, r]);
        cases.push(Case::new(format!("{} {}", op.name(), op.attrs()), op, &[("x", &x), ("e", &e)], None));
    }
    check(&cases, true);
}

#[test]
fn attention_at_the_largest_head_dim() {
    let d = kiln_compiler::back::wgsl::target::MAX_ATTENTION_HEAD_DIM;
    let op = Op::Attention {
        scale: Scalar(1.0 / (d as f32).sqrt()),
        alibi: false,
        causal: true,
        window: None,
        mods: ScoreMods::default(),
    };
    let operands: [(&str, &[usize]); 4] =
        [("q", &[2, 2, 3, d]), ("k", &[2, 1, 4, d]), ("v", &[2, 1, 4, d]), ("key_mask", &[2, 4])];
    // Not chunked: at 64 floats a chunk, this needs more storage buffers than adapters allow.
    check(&[Case::new(format!("attention d={d}"), op, &operands, Some(key_mask(2, 4)))], false);
}

#[test]
fn add_norm_rms_and_layer_with_and_without_bias() {
    let mut cases = Vec::new();
    for (rms, bias) in [(true, false), (false, false), (false, true)] {
        for (eps, after) in [(1e-5, false), (1e-6, false), (1e-5, true), (1e-6, true)] {
            let op = Op::AddNorm { rms, eps: Scalar(eps), after };
            let mut operands: Vec<(&str, &[usize])> =
                vec![("a", &[2, 3, 24]), ("b", &[2, 3, 24]), ("norm.weight", &[24])];
            if bias {
                operands.push(("norm.bias", &[24]));
            }
            cases.push(Case::new(format!("{} eps={eps} bias={bias}", op.name()), op, &operands, None));
        }
    }
    check(&cases, true);
}

#[test]
fn linear_with_norm_prologues_gated_and_rotated_epilogues() {
    let norms = [
        None,
        Some(Prologue { rms: true, eps: Scalar(1e-6), bias: false }),
        Some(Prologue { rms: false, eps: Scalar(1e-5), bias: true }),
        Some(Prologue { rms: false, eps: Scalar(1e-5), bias: false }),
    ];
    // Heads of 8 columns at columns 4..20 of 24; a partial and a full rotation, both pair layouts.
    let ropes = [
        RopeCols {
            theta: Scalar(10000.0),
            rotary_dim: 4,
            style: PairStyle::RotateHalf,
            head_dim: 8,
            start: 4,
            len: 16,
        },
        RopeCols { theta: Scalar(500.0), rotary_dim: 8, style: PairStyle::Interleaved, head_dim: 8, start: 0, len: 24 },
    ];
    let mut cases = Vec::new();
    for norm in norms {
        for (bias, residual) in [(false, false), (true, true)] {
            let mut ops = vec![
                Op::Linear { act: Some(Activation::Silu), bias, residual, norm, glu: true, rope: None },
                Op::Linear { act: Some(Activation::Gelu), bias, residual, norm, glu: false, rope: None },
            ];
            for rope in ropes {
                ops.push(Op::Linear { act: None, bias, residual, norm, glu: false, rope: Some(rope) });
            }
            for op in ops {
                let Op::Linear { glu, .. } = op else { unreachable!() };
                let (x, w, b, r): (&[usize], &[usize], &[usize], &[usize]) = if glu {
                    (&[2, 3, 16], &[48, 16], &[48], &[2, 3, 24])
                } else {
                    (&[2, 3, 16], &[24, 16], &[24], &[2, 3, 24])
                };
                let mut operands: Vec<(&str, &[usize])> = vec![("x", x)];
                if let Some(p) = norm {
                    operands.push(("norm.weight", &[16]));
                    if p.bias {
                        operands.push(("norm.bias", &[16]));
                    }
                }
                operands.push(("w", w));
                if bias {
                    operands.push(("b", b));
                }
                if residual {
                    operands.push(("r", r));
                }
                cases.push(Case::new(format!("{} {}", op.name(), op.attrs()), op, &operands, None));
            }
        }
    }
    check(&cases, true);
}

/// Heads read out of packed rows at a column offset, RMS-normalized per head or not, rotated (both
/// pair layouts, whole or partial heads) or not, alone or appended to a cache of 3 tokens; batch
/// 2, 4 new tokens. Heads of 8 and of 72 (wider than the 64 lanes of the normalizing kernel's
/// workgroup, so each lane takes several elements).
#[test]
fn heads_split_rotate_and_append() {
    let (mut cases, mut wide) = (Vec::new(), Vec::new());
    let rotations = [
        None,
        Some(Rotation { theta: Scalar(10000.0), rotary_dim: 8, style: PairStyle::RotateHalf }),
        Some(Rotation { theta: Scalar(100.0), rotary_dim: 4, style: PairStyle::Interleaved }),
        Some(Rotation { theta: Scalar(500.0), rotary_dim: 6, style: PairStyle::RotateHalf }),
    ];
    for (heads, start, width, head_dim) in [(2, 0, 16, 8), (3, 8, 40, 8), (2, 4, 150, 72)] {
        for rope in rotations {
            for past in [false, true] {
                for norm in [None, Some(Scalar(1e-6))] {
                    let op = Op::Heads { start, heads, head_dim, norm, rope };
                    let (cache, x) = ([2, heads, 3, head_dim], [2, 4, width]);
                    let mut operands: Vec<(&str, &[usize])> = Vec::new();
                    if past {
                        operands.push(("past", &cache));
                    }
                    operands.push(("x", &x));
                    let gain = [head_dim];
                    if norm.is_some() {
                        operands.push(("gain", &gain));
                    }
                    let name = format!("{} {} past={past}", op.name(), op.attrs());
                    let cases = if head_dim > 8 { &mut wide } else { &mut cases };
                    cases.push(Case::new(name, op, &operands, None));
                }
            }
        }
    }
    check(&cases, true);
    // Too large for the chunked test's 256-byte buffers.
    check(&wide, false);
}

#[test]
fn packed_attention_mha_and_gqa_with_masks() {
    let (mut cases, mut blocked) = (Vec::new(), Vec::new());
    let (mut steps, mut small_steps) = (Vec::new(), Vec::new());
    // (heads, kv heads, head_dim, q, k, v column offsets, width, sequence), batch 2.
    for (h, kv, d, q, k, v, width, seq) in [
        (4, 4, 8, 0, 32, 64, 96, 5),
        (4, 2, 8, 8, 40, 56, 80, 5),
        (3, 1, 4, 4, 0, 16, 20, 5),
        // Too large for the chunked test's 256-byte buffers:
        (4, 4, 16, 0, 64, 128, 192, 13), // blocks of 8 rows, the last partial
        (6, 2, 16, 0, 96, 128, 160, 7),  // blocks of 2 rows x 3 heads
        (4, 2, 16, 0, 64, 96, 128, 70),  // the CPU's prefill form: two blocks of query rows
    ] {
        let cases = if seq > 5 { &mut blocked } else { &mut cases };
        for (causal, window) in [(false, None), (true, None), (true, Some(2))] {
            for masked in [false, true] {
                let op = Op::PackedAttention(PackedAttention {
                    scale: Scalar(0.4),
                    alibi: false,
                    causal,
                    window,
                    mods: ScoreMods::default(),
                    heads: h,
                    kv_heads: kv,
                    head_dim: d,
                    q,
                    k,
                    v,
                    cached: false,
                    appends: false,
                });
                let (x, mask) = ([2, seq, width], [2, seq]);
                let mut operands: Vec<(&str, &[usize])> = vec![("qkv", &x)];
                if masked {
                    operands.push(("key_mask", &mask));
                }
                cases.push(Case::new(
                    format!("{} masked={masked}", op.attrs()),
                    op.clone(),
                    &operands,
                    masked.then(|| key_mask(2, seq)),
                ));
                // A decoder step's: the queries packed, the keys and values a cache of 3 earlier
                // tokens and these.
                let mut cached = op;
                if let Op::PackedAttention(PackedAttention { cached: c, .. }) = &mut cached {
                    *c = true;
                }
                let (t, cache) = (3 + seq, [2, kv, 3 + seq, d]);
                let mask = [2, t];
                let mut operands: Vec<(&str, &[usize])> = vec![("qkv", &x), ("k", &cache), ("v", &cache)];
                if masked {
                    operands.push(("key_mask", &mask));
                }
                // Only the narrowest fits the chunked test's bindings.
                let steps = if kv * d <= 4 { &mut small_steps } else { &mut steps };
                steps.push(Case::new(
                    format!("{} masked={masked}", cached.attrs()),
                    cached,
                    &operands,
                    masked.then(|| key_mask(2, t)),
                ));
            }
        }
    }
    check(&cases, true);
    check(&blocked, false);
    check(&small_steps, true);
    check(&steps, false);
}

/// The options of a hardware adapter (with the attention's workgroup form), in plain and, where
/// the adapter has them, subgroup reductions; with the attention's keys unsplit, and split every
/// 16 keys (so rows of 17 keys and more take several workgroups, and a second dispatch combines
/// them).
fn hardware_forms(gpu: &Gpu) -> Vec<kiln_compiler::back::wgsl::Options> {
    let hardware = kiln_compiler::back::wgsl::Options {
        attention_split_keys: Some(16),
        ..kiln_compiler::back::wgsl::Options::hardware()
    };
    let plain = kiln_compiler::back::wgsl::Options { subgroups: false, ..hardware };
    let unsplit = kiln_compiler::back::wgsl::Options { attention_split_keys: None, ..plain };
    if gpu.supports_subgroups() { vec![unsplit, plain, hardware] } else { vec![unsplit, plain] }
}

/// Asserts that every attention step of `model` (compiled with `options`) ran the workgroup form:
/// its kernel has it and its dispatch, at the step's shapes, picks it; and, with its keys split,
/// that those over more keys than a split takes were split, with a second dispatch to combine.
fn assert_workgroup_form(model: &GpuModel, options: &kiln_compiler::back::wgsl::Options) {
    use kiln_compiler::back::wgsl;
    let program = model.program();
    let plan = &program.plan;
    let (mut attentions, mut split) = (0, 0);
    for (i, step) in plan.steps.iter().enumerate() {
        if !matches!(step.op, Op::Attention { .. } | Op::PackedAttention(_)) {
            continue;
        }
        attentions += 1;
        let kernel = program.kernel_of(i).unwrap();
        assert!(kernel.wgsl.contains("dim(7u) == 2u"), "{}: no workgroup form", step.op.attrs());
        let shape = |v: usize| kiln_compiler::lower::resolve(&plan.values[v].shape, &HashMap::new());
        let operands: Vec<Vec<usize>> = step.operands.iter().map(|&v| shape(v)).collect();
        let dims = wgsl::dispatch(&step.op, &operands, &shape(step.output), 0, options).unwrap();
        assert_eq!(dims[7], 2, "{}: form {} dispatched", step.op.attrs(), dims[7]);
        assert_eq!(kernel.partials, options.attention_split_keys.is_some(), "{}", step.op.attrs());
        let keys = dims[3] as usize;
        match (options.attention_split_keys, wgsl::attention::combine_dims(&dims)) {
            (Some(n), Some(second)) => {
                assert!(keys > n && dims[14] as usize == keys.div_ceil(n).min(wgsl::attention::MAX_SPLITS));
                // The attention's threads: all, or those before the cache appends' (`dims[9]`).
                let attention = if dims[9] != 0 { dims[9] } else { dims[0] };
                assert_eq!(second[0] * dims[14], attention, "{}: one combining workgroup per row", step.op.attrs());
                split += 1;
            }
            (Some(n), None) => assert!(keys <= n, "{}: {keys} keys not split", step.op.attrs()),
            (None, second) => assert!(second.is_none()),
        }
    }
    assert!(attentions > 0, "no attention step");
    if options.attention_split_keys.is_none() {
        assert_eq!(split, 0);
    }
}

/// The attention kernels' workgroup form (a hardware adapter's, forced here: a workgroup per
/// query row and head, its lanes taking the keys 64 at a time) against the interpreter, on every
/// layout — attention, packed, a decoder step's packed attention over its caches — with
/// multi-head, grouped-query and multi-query heads, heads wider than the workgroup (80: two
/// columns a lane), one query row (a decode step) and a few, over 1 key, keys short of a chunk,
/// a chunk, one past it and two chunks and a part, under every mask (causal, sliding window, a
/// key padding mask that hides every key of one batch row) and score modifier (ALiBi, soft-cap,
/// relative bias both ways, block pattern), with plain and subgroup reductions.
#[test]
fn attention_workgroup_form_on_every_layout_and_modifier() {
    let Some(gpu) = common::gpu() else { return };
    let plain = ScoreMods::default();
    // (alibi, causal, window, modifiers)
    let mut variants = vec![(false, false, None, plain), (true, true, None, plain), (false, true, Some(3), plain)];
    variants.push((true, false, Some(70), plain));
    variants.extend(modifiers().into_iter().map(|(causal, mods)| (false, causal, None, mods)));
    let mut cases = Vec::new();
    for (alibi, causal, window, mods) in variants {
        let table = |h: usize| if mods.relative.is_some() { vec![6, h] } else { vec![] };
        let mut push = |name: String, op: Op, mut operands: Vec<(&'static str, Vec<usize>)>, b: usize, t: usize| {
            operands.push(("key_mask", vec![b, t]));
            let heads = match &op {
                Op::Attention { .. } => operands[0].1[1],
                Op::PackedAttention(PackedAttention { heads, .. }) => *heads,
                _ => unreachable!(),
            };
            let table = table(heads);
            if !table.is_empty() {
                operands.push(("table", table));
            }
            let operands: Vec<(&str, &[usize])> = operands.iter().map(|(n, s)| (*n, s.as_slice())).collect();
            cases.push(Case::new(format!("{name} {}", op.attrs()), op, &operands, Some(key_mask(b, t))));
        };
        // Attention: (batch, heads, kv heads, rows, keys, head_dim).
        for (b, h, kv, s, t, d) in [(2, 4, 4, 3, 130, 16), (2, 3, 1, 1, 64, 80)] {
            let op = Op::Attention { scale: Scalar(0.7), alibi, causal, window, mods };
            let operands = vec![("q", vec![b, h, s, d]), ("k", vec![b, kv, t, d]), ("v", vec![b, kv, t, d])];
            push(format!("attention b={b} h={h} kv={kv} s={s} t={t} d={d}"), op, operands, b, t);
        }
        // Packed attention: a decoder step's over its caches (1, 7, 64, 65 and 130 keys with
        // this step's), and a few rows attending each other.
        let (h, kv, d) = (6, 2, 8);
        let width = (h + 2 * kv) * d;
        let packed = |cached| {
            Op::PackedAttention(PackedAttention {
                scale: Scalar(0.4),
                alibi,
                causal,
                window,
                mods,
                heads: h,
                kv_heads: kv,
                head_dim: d,
                q: 0,
                k: h * d,
                v: (h + kv) * d,
                cached,
                appends: false,
            })
        };
        for t in [1, 7, 64, 65, 130] {
            let operands = vec![("qkv", vec![2, 1, width]), ("k", vec![2, kv, t, d]), ("v", vec![2, kv, t, d])];
            push(format!("cached decode past={}", t - 1), packed(true), operands, 2, t);
        }
        push("packed seq=5".into(), packed(false), vec![("qkv", vec![2, 5, width])], 2, 5);
    }
    let forms = hardware_forms(&gpu);
    for (model, options) in check_forms(&cases, &forms).iter().zip(&forms) {
        assert_workgroup_form(model, options);
    }
}

/// The projection kernel's forms (see `kiln_compiler::back::wgsl::projection`): `vec4` GEMM and GEMV
/// (`k` and `n` multiples of 4), scalar GEMM and GEMV (`k` or `n` not, or a RoPE epilogue), at
/// row counts that leave partial tiles, plainly and chunked.
#[test]
fn linear_kernel_forms_at_every_shape() {
    let ops = common::projection_ops();
    // (rows: [batch, seq], k, n): GEMM over several row tiles, GEMV, k or n not a multiple of 4;
    // then small enough for the chunked device (at most 32 chunks of 64 floats per dispatch).
    // n = 26 and 10: a plain projection's weight is padded to whole `vec4`s.
    let large: [(&[usize], usize, usize); 7] = [
        (&[2, 37], 16, 24),
        (&[1, 3], 16, 24),
        (&[1, 1], 20, 28),
        (&[2, 37], 18, 24),
        (&[1, 2], 18, 24),
        (&[3, 9], 16, 26),
        (&[1, 2], 16, 10),
    ];
    let small: [(&[usize], usize, usize); 5] =
        [(&[1, 6], 8, 24), (&[1, 5], 6, 24), (&[1, 2], 8, 24), (&[1, 1], 6, 24), (&[1, 6], 8, 10)];
    check(&projection_cases(&ops, &large), false);
    check(&projection_cases(&ops, &small), true);
    // Every prefill tile `kiln tune` may choose, at the shapes whose rows leave partial tiles.
    use kiln_compiler::back::wgsl::{self, projection::GEMM_TILES};
    if common::gpu().is_some() {
        let forms: Vec<wgsl::Options> =
            GEMM_TILES.iter().map(|&t| wgsl::Options { gemm_tile: Some(t), ..wgsl::Options::default() }).collect();
        check_forms(&projection_cases(&ops, &large[..1]), &forms);
    }
    // The split GEMV form past a decode step's rows (`split_rows`), as a hardware adapter runs a
    // short prompt's and a batched step's projections: 27 rows split at 64 (74 take the split
    // GEMM, the `vec4` GEMM's launch being small), every shape split at 256, and past 4 rows
    // (27 and 74) the split GEMM, its last block of 4 rows partial; the workgroups 4, 8 and 16
    // columns wide (`split_groups`); the decode rows of the wide ones unsplit.
    if common::gpu().is_some_and(|gpu| gpu.supports_subgroups()) {
        let mut forms: Vec<wgsl::Options> = [(64, 1), (256, 4), (4, 2)]
            .iter()
            .map(|&(rows, groups)| wgsl::Options {
                subgroups: true,
                split_rows: Some(rows),
                split_groups: Some(groups),
                ..wgsl::Options::default()
            })
            .collect();
        // And the `vec4` GEMV of a module with subgroups, where a decode step's projection is at
        // least `wide_gemv_from` columns wide (here every one 24 wide or more).
        forms.push(wgsl::Options { subgroups: true, wide_gemv_from: Some(24), ..wgsl::Options::default() });
        check_forms(&projection_cases(&ops, &large), &forms);
    }
}

/// Every op of `ops` at every shape `(rows, k, n)` (rotated ones at `n` = 24 only).
fn projection_cases(ops: &[Op], shapes: &[(&[usize], usize, usize)]) -> Vec<Case> {
    let mut cases = Vec::new();
    for op in ops {
        let Op::Linear { bias, residual, norm, glu, rope, .. } = op.clone() else { unreachable!() };
        for &(rows, k, n) in shapes {
            if rope.is_some() && n != 24 {
                continue; // the rotated columns are laid out for 24
            }
            let x: Vec<usize> = rows.iter().copied().chain([k]).collect();
            let out: Vec<usize> = rows.iter().copied().chain([n]).collect();
            let m = if glu { 2 * n } else { n };
            let (w, b, g) = (vec![m, k], vec![m], vec![k]);
            let mut operands: Vec<(&str, &[usize])> = vec![("x", &x)];
            if let Some(p) = norm {
                operands.push(("norm.weight", &g));
                if p.bias {
                    operands.push(("norm.bias", &g));
                }
            }
            operands.push(("w", &w));
            if bias {
                operands.push(("b", &b));
            }
            if residual {
                operands.push(("r", &out));
            }
            cases.push(Case::new(format!("{} {} x{x:?} n {n}", op.name(), op.attrs()), op.clone(), &operands, None));
        }
    }
    cases
}

/// Allowed difference of the f16-math projection form from the interpreter on the weights rounded
/// to f16 (the activations rounded to f16 too, each 4 products summed in f16), relative to
/// `max(1, max |value|)`: measured 1.9e-4 to 5.5e-4 on lavapipe (k = 320).
const F16_MATH_TOLERANCE: f32 = 2e-3;

/// The kernels that reduce a row — layer and RMS norm, add + norm, softmax, masked softmax, heads
/// normalized per head, and the projection's GEMV forms (one row and three, with a norm prologue,
/// gated, rotating) — in every form
/// the device features allow (plain WGSL, subgroup reductions, f16 weights, f16 arithmetic, with
/// and without subgroups), against the interpreter. Rows are wider than a workgroup and not a
/// multiple of it, so lanes take uneven shares; `k` = 320 gives the split GEMV's lanes 1 or 2
/// `vec4`s each. Each model's kernels are checked to be the form asked for.
#[test]
fn every_device_form_of_norms_softmax_and_gemv() {
    use kiln_compiler::back::wgsl;
    let Some(gpu) = common::gpu() else { return };
    let (k, n, d) = (320, 40, 300);
    let mut g = Graph::new("forms");
    let eps = Scalar(1e-5);
    let x1 = g.param("x1", &[1, 1, k]);
    let x3 = g.param("x3", &[3, k]);
    let x13 = g.param("x13", &[1, 3, k]);
    let r13 = g.param("r13", &[1, 3, n]);
    let gain = g.param("gain", &[k]);
    let shift = g.param("shift", &[k]);
    let w = g.param("w", &[n, k]);
    let wg = g.param("wg", &[2 * n, k]);
    let b = g.param("b", &[n]);
    let rows = g.param("rows", &[4, d]);
    let other = g.param("other", &[4, d]);
    let dgain = g.param("dgain", &[d]);
    let dshift = g.param("dshift", &[d]);
    let scores = g.param("scores", &[2, 2, 3, 130]);
    let mask = g.param("key_mask", &[2, 130]);
    let packed = g.param("packed", &[1, 3, d]);
    let hgain = g.param("hgain", &[d / 2]);
    let mut add = |name: &str, op: Op, operands: &[NodeIndex]| {
        let y = g.add(op, operands).unwrap_or_else(|e| panic!("{name}: {e}"));
        g.outputs.push((name.to_string(), y));
    };
    let rms = Some(Prologue { rms: true, eps, bias: false });
    let layer = Some(Prologue { rms: false, eps, bias: true });
    add("gemv", Op::linear(None, false, false), &[x1, w]);
    let gated =
        Op::Linear { act: Some(Activation::Silu), bias: false, residual: false, norm: rms, glu: true, rope: None };
    add("gemv rms-norm gated", gated, &[x1, gain, wg]);
    let normed =
        Op::Linear { act: Some(Activation::Gelu), bias: true, residual: false, norm: layer, glu: false, rope: None };
    add("gemv 3 rows layer-norm", normed, &[x3, gain, shift, w, b]);
    // Rotating GEMVs (a decoder's QKV projection) over 3 positions: heads of 16, the last 8
    // columns unrotated; rotate-half with a norm prologue, interleaved with bias and residual.
    let rope =
        RopeCols { theta: Scalar(1e4), rotary_dim: 8, style: PairStyle::RotateHalf, head_dim: 16, start: 0, len: 32 };
    let rotating = Op::Linear { act: None, bias: false, residual: false, norm: rms, glu: false, rope: Some(rope) };
    add("gemv 3 positions rms-norm rope", rotating, &[x13, gain, w]);
    let rope = RopeCols { style: PairStyle::Interleaved, rotary_dim: 16, start: 8, ..rope };
    let rotating = Op::Linear { act: None, bias: true, residual: true, norm: None, glu: false, rope: Some(rope) };
    add("gemv 3 positions rope interleaved", rotating, &[x13, w, b, r13]);
    add("layer_norm", Op::LayerNorm { eps }, &[rows, dgain, dshift]);
    add("rms_norm", Op::RmsNorm { eps }, &[rows, dgain]);
    add("add_norm", Op::AddNorm { rms: false, eps, after: false }, &[rows, other, dgain, dshift]);
    add("add_norm after", Op::AddNorm { rms: true, eps, after: true }, &[rows, other, dgain]);
    add("softmax", Op::Softmax, &[rows]);
    add(
        "heads rms-norm",
        Op::Heads { start: 0, heads: 2, head_dim: d / 2, norm: Some(eps), rope: None },
        &[packed, hgain],
    );
    let masked =
        Op::MaskedSoftmax { scale: Scalar(0.5), alibi: true, causal: true, window: None, mods: ScoreMods::default() };
    add("masked_softmax", masked, &[scores, mask]);
    g.check().unwrap();

    let mut params = interp::random_params(&g, 11).unwrap();
    params.insert("key_mask".into(), Tensor::f32(vec![2, 130], key_mask(2, 130)));
    let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
    // The interpreter on the projection weights rounded to f16, for the f16 forms.
    let mut rounded = params.clone();
    for name in ["w", "wg"] {
        let t = &params[name];
        let values = t.as_f32().unwrap().iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        rounded.insert(name.into(), Tensor::f32(t.shape.clone(), values));
    }
    let expected_f16 = interp::run(&g, &rounded, &HashMap::new()).unwrap();

    let plain = wgsl::Options::default();
    let subgroups = wgsl::Options { subgroups: true, ..plain };
    let f16 = wgsl::Options { f16_weights: true, ..plain };
    let f16_math = wgsl::Options { f16_math: true, ..f16 };
    let forms = [
        plain,
        subgroups,
        f16,
        wgsl::Options { subgroups: true, ..f16 },
        f16_math,
        wgsl::Options { subgroups: true, ..f16_math },
    ];
    let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
    for options in forms {
        let form = options.describe();
        let needs = (options.f16_weights && !gpu.supports_f16()) || (options.subgroups && !gpu.supports_subgroups());
        let model = GpuModel::with_progress(gpu.clone(), &plan, &options, &params, &HashMap::new(), &());
        if needs {
            let e = model.err().expect("refused without the device feature").to_string();
            assert!(e.contains("feature"), "{form}: {e}");
            eprintln!("skipping {form}: the adapter lacks it");
            continue;
        }
        let model = model.unwrap_or_else(|e| panic!("{form}: {e}"));
        // The kernels are the form asked for.
        let wgsl: String = model.program().kernels.iter().map(|k| k.wgsl.as_str()).collect();
        assert_eq!(wgsl.contains("subgroupAdd"), options.subgroups, "{form}");
        assert_eq!(wgsl.contains("form == 4u"), options.subgroups, "{form}: the split GEMV form");
        for kernel in model.program().kernels.iter().filter(|k| k.name.contains("rope")) {
            assert_eq!(kernel.wgsl.contains("form == 4u"), options.subgroups, "{form}: the rotating split GEMV");
        }
        assert_eq!(wgsl.contains("vec4<f16>(x0)"), options.f16_math, "{form}: f16 arithmetic");
        let got = model.run(&HashMap::new()).unwrap_or_else(|e| panic!("{form}: {e}"));
        let want = if options.f16_weights { &expected_f16 } else { &expected };
        for ((out, want), (_, got)) in want.iter().zip(&got) {
            let tolerance =
                if options.f16_math && out.starts_with("gemv") { F16_MATH_TOLERANCE } else { GPU_TOLERANCE };
            let scale = want.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
            println!("{form}: `{out}` differs by {:e} relative", want.max_abs_diff(got) / scale);
            assert_close(&format!("`{out}` ({form})"), want, got, tolerance);
        }
    }
}

/// A decoder step's cached attention and the two cache appends it reads, which the WGSL back end
/// runs as one dispatch (`appends`: the attention reads the caches before the step and this
/// step's rows in place, and its threads past the attention's write the caches after it): the
/// attention and both caches equal the interpreter's, plainly and chunked, with an empty cache
/// or not, causal, windowed or not, with a key mask or not; and as a hardware adapter's program
/// runs it, the attention in its workgroup form, over 1 key and caches past a chunk of 64.
#[test]
fn cached_attention_appends_in_its_own_dispatch() {
    // (heads, kv heads, head_dim, batch, rows, cached rows, on the chunked device too)
    let shapes = [
        (2, 1, 4, 1, 5, 3, true),
        (2, 1, 4, 1, 1, 6, true),
        (4, 2, 8, 2, 1, 6, false),
        (4, 2, 8, 2, 4, 0, false),
        (6, 2, 16, 2, 7, 2, false),
        (4, 4, 8, 2, 13, 5, false),
        // A first token (1 key), and caches past a chunk of the workgroup form's 64 keys.
        (4, 2, 8, 2, 1, 0, false),
        (4, 2, 8, 2, 1, 70, false),
        (4, 2, 8, 1, 2, 63, false),
    ];
    for (h, kv, d, b, s, p, chunked) in shapes {
        for (causal, window) in [(true, None), (true, Some(3)), (false, None)] {
            for masked in [false, true] {
                let what = format!(
                    "h={h} kv={kv} d={d} b={b} s={s} past={p} causal={causal} window={window:?} masked={masked}"
                );
                let width = (h + 2 * kv) * d;
                let mut g = Graph::new("step");
                let qkv = g.param("qkv", &[b, s, width]);
                let mut append = |name: &str, start: usize| {
                    let past = g.param(name, &[b, kv, p, d]);
                    g.add(Op::Heads { start, heads: kv, head_dim: d, norm: None, rope: None }, &[past, qkv]).unwrap()
                };
                let (present_k, present_v) = (append("past_k", h * d), append("past_v", (h + kv) * d));
                let mut operands = vec![qkv, present_k, present_v];
                if masked {
                    operands.push(g.param("key_mask", &[b, p + s]));
                }
                let op = Op::PackedAttention(PackedAttention {
                    scale: Scalar(0.4),
                    alibi: false,
                    causal,
                    window,
                    mods: ScoreMods::default(),
                    heads: h,
                    kv_heads: kv,
                    head_dim: d,
                    q: 0,
                    k: h * d,
                    v: (h + kv) * d,
                    cached: true,
                    appends: false,
                });
                let attention = g.add(op, &operands).unwrap();
                g.outputs = vec![
                    ("attention".into(), attention),
                    ("present_k".into(), present_k),
                    ("present_v".into(), present_v),
                ];
                let mut params = interp::random_params(&g, 5).unwrap();
                if masked {
                    params.insert("key_mask".into(), Tensor::f32(vec![b, p + s], key_mask(b, p + s)));
                }
                let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
                let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
                let options = kiln_compiler::back::wgsl::Options { fold_appends: true, ..Default::default() };
                let program = kiln_compiler::back::wgsl::compile(&plan, &options).unwrap();
                let steps: Vec<(String, usize)> =
                    program.plan.steps.iter().map(|s| (s.op.attrs(), s.also.len())).collect();
                assert!(
                    matches!(steps.as_slice(), [(attrs, 2)] if attrs.contains("cached appends")),
                    "{what}: {steps:?}"
                );
                let mut devices = vec![
                    ("wgpu", common::gpu(), options),
                    ("wgpu, chunked", chunked.then(chunked_gpu).flatten(), options),
                ];
                // A hardware adapter's program: the attention in its workgroup form.
                if let Some(hardware) = common::gpu().and_then(|gpu| hardware_forms(&gpu).pop()) {
                    devices.push(("wgpu, workgroup form", common::gpu(), hardware));
                }
                for (device, gpu, options) in devices {
                    let Some(gpu) = gpu else { continue };
                    let model = GpuModel::with_progress(gpu, &plan, &options, &params, &HashMap::new(), &()).unwrap();
                    assert_eq!(model.program().plan.steps.len(), 1, "{what}: folded");
                    if options.attention_workgroups {
                        assert_workgroup_form(&model, &options);
                    }
                    let got = model.run(&HashMap::new()).unwrap_or_else(|e| panic!("{what} on {device}: {e}"));
                    for ((name, want), (_, got)) in expected.iter().zip(&got) {
                        assert_close(&format!("{what}: `{name}` on {device}"), want, got, GPU_TOLERANCE);
                    }
                }
            }
        }
    }
}

/// Values for every parameter of `g`, spread over [-2, 2) differently for each.
fn spread_params(g: &Graph) -> HashMap<String, Tensor> {
    g.params()
        .into_iter()
        .enumerate()
        .map(|(i, (n, name))| {
            let shape: Vec<usize> = g.g[n].shape.iter().map(|d| if let Dim::Fixed(k) = d { *k } else { 0 }).collect();
            let len = shape.iter().product();
            let values = (0..len).map(|j| (((i * 131 + j * 71) % 97) as f32 / 97.0 - 0.5) * 4.0).collect();
            (name.to_string(), Tensor::f32(shape, values))
        })
        .collect()
}

/// The ops a training step adds (matrix products of activations, in both layouts, one matrix or
/// a stack of them on the right, and with an activation's gradient as their epilogue; sums over
/// each axis; every activation's derivative): the CPU
/// backend's native kernels agree with the interpreter, on one thread and on three.
#[test]
fn training_ops_on_the_cpu_equal_the_interpreter() {
    let mut g = Graph::new("training");
    let add = |g: &mut Graph, name: &str, op: Op, operands: &[(&str, &[usize])]| {
        let a: Vec<_> = operands.iter().map(|(n, s)| g.param(&format!("{name}.{n}"), s)).collect();
        let y = g.add(op, &a).unwrap_or_else(|e| panic!("{name}: {e}"));
        g.outputs.push((name.to_string(), y));
    };
    for (t, transpose_b) in [false, true].into_iter().enumerate() {
        let b: &[usize] = if transpose_b { &[5, 7] } else { &[7, 5] };
        add(&mut g, &format!("matmul{t}.one"), Op::MatMul { transpose_b }, &[("a", &[2, 3, 4, 7]), ("b", b)]);
        let bs: &[usize] = if transpose_b { &[2, 3, 5, 7] } else { &[2, 3, 7, 5] };
        add(&mut g, &format!("matmul{t}.stack"), Op::MatMul { transpose_b }, &[("a", &[2, 3, 4, 7]), ("b", bs)]);
    }
    for axis in 0..3 {
        add(&mut g, &format!("sum{axis}"), Op::SumAxis { axis }, &[("x", &[3, 5, 7])]);
    }
    // Sums split over blocks of columns (few kept rows, many columns), and over many rows.
    add(&mut g, "sum.columns", Op::SumAxis { axis: 1 }, &[("x", &[2, 9, 700])]);
    add(&mut g, "sum.rows", Op::SumAxis { axis: 1 }, &[("x", &[300, 9, 1])]);
    for act in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
        add(&mut g, &format!("grad.{}", act.name()), Op::ActGrad(act), &[("x", &[4, 33]), ("dy", &[4, 33])]);
    }
    add(&mut g, "grad.long", Op::ActGrad(Activation::GeluTanh), &[("x", &[3, 7000]), ("dy", &[3, 7000])]);
    // Products with an activation's gradient as their epilogue, both layouts of `b`, every
    // activation; and one whose output spans several of the epilogue's tasks, the last short.
    for (t, transpose_b) in [false, true].into_iter().enumerate() {
        let b: &[usize] = if transpose_b { &[5, 7] } else { &[7, 5] };
        for act in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            let op = Op::MatMulActGrad { act, transpose_b };
            add(
                &mut g,
                &format!("matmul{t}.{}_grad", act.name()),
                op,
                &[("a", &[2, 3, 4, 7]), ("b", b), ("x", &[2, 3, 4, 5])],
            );
        }
        let b: &[usize] = if transpose_b { &[300, 7] } else { &[7, 300] };
        let op = Op::MatMulActGrad { act: Activation::Gelu, transpose_b };
        add(&mut g, &format!("matmul{t}.gelu_grad.long"), op, &[("a", &[3, 41, 7]), ("b", b), ("x", &[3, 41, 300])]);
    }
    // A bias's gradient over rows in several of the kernel's fixed chunks, the last one short.
    add(&mut g, "sum_rows.chunks", Op::SumRows, &[("x", &[3, 300, 70])]);
    // A norm's gain gradient over rows wider than a block of columns.
    let op = Op::NormGainGrad { rms: false, eps: Scalar(1e-5) };
    add(&mut g, "norm_gain_grad.wide", op, &[("x", &[3, 5, 600]), ("dy", &[3, 5, 600])]);
    // Weights' gradients: the products of rows over every leading axis, one and two of them.
    add(&mut g, "contract_rows.3", Op::ContractRows, &[("a", &[4, 9, 7]), ("b", &[4, 9, 5])]);
    add(&mut g, "contract_rows.2", Op::ContractRows, &[("a", &[30, 70]), ("b", &[30, 90])]);
    // Broadcasting sums and products: a value per row, a row per matrix, a column, both ways.
    let pairs: [(&[usize], &[usize]); 5] = [
        (&[3, 5, 7], &[3, 5, 1]),
        (&[3, 5, 1], &[3, 5, 7]),
        (&[3, 5, 7], &[5, 1]),
        (&[3, 1, 7], &[5, 1]),
        (&[3, 5, 7], &[1]),
    ];
    for (i, (a, b)) in pairs.into_iter().enumerate() {
        add(&mut g, &format!("add.b{i}"), Op::Add, &[("a", a), ("b", b)]);
        add(&mut g, &format!("mul.b{i}"), Op::Mul, &[("a", a), ("b", b)]);
    }
    // Transposes (the last axis read with a stride) and moves of whole rows.
    for perm in [vec![0, 2, 1], vec![1, 0, 2], vec![2, 1, 0]] {
        let name = format!("permute.{}", perm.iter().map(|p| p.to_string()).collect::<String>());
        add(&mut g, &name, Op::Permute { perm }, &[("x", &[6, 40, 90])]);
    }
    let params = spread_params(&g);
    let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
    let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
    let mut by_threads = Vec::new();
    for threads in [1, 3] {
        let model = kiln_runtime::CpuModel::new(plan.clone(), &params, &HashMap::new(), threads, &()).unwrap();
        let got = model.run(&HashMap::new()).unwrap();
        for ((name, want), (_, got)) in expected.iter().zip(&got) {
            assert_close(&format!("`{name}` on cpu, {threads} threads"), want, got, GPU_TOLERANCE);
        }
        by_threads.push(got);
    }
    // The sums over rows add their chunks in a fixed order, whatever the threads.
    for ((name, one), (_, three)) in by_threads[0].iter().zip(&by_threads[1]) {
        if name.starts_with("sum_rows") {
            assert_eq!(one, three, "`{name}` on 1 and 3 threads");
        }
    }
    // And every op the wgpu test below holds to the interpreter (the loss and its gradient with
    // ignored labels, the unfused softmax, masks, slices, concatenations and RoPE).
    for wide in [true, false] {
        let (g, params, inputs) = training_ops(wide);
        let expected = interp::run(&g, &params, &inputs).unwrap();
        let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
        let model = kiln_runtime::CpuModel::new(plan, &params, &HashMap::new(), 2, &()).unwrap();
        let got = model.run(&inputs).unwrap();
        for ((name, want), (_, got)) in expected.iter().zip(&got) {
            assert_close(&format!("`{name}` on cpu"), want, got, GPU_TOLERANCE);
        }
    }
}

/// The ops a training step adds, on wgpu (plainly, and over buffers of 64 floats, where the
/// tensors are split and the chunked kernel variants run) against the interpreter: matrix
/// products of activations in both layouts (in both block forms of the tiled kernel, and with the
/// contraction split in slices; and with an activation's gradient as their epilogue), sums over
/// each axis and over every row (a bias's gradient, over rows in several chunks too), every
/// activation's derivative,
/// `rsqrt`, and the backward ops — the norms' (their gain gradients over few rows and over rows
/// in several chunks: the two-dispatch form, `partials`, and chunked the one-dispatch form), the
/// gather's (rows of `dy` added by id, repeated ids among them), the cross-entropy and its
/// gradient (a third of the labels ignored, with and without
/// label smoothing, a vocabulary narrower and one wider than a workgroup), the relative bias's,
/// the truncation's and top-k's — at sizes that are not multiples of the 64-wide workgroups
/// (smaller ones chunked, as a step binds at most 32 buffers). Within [`GPU_TOLERANCE`] of
/// `max(1, max |x|)`, as every GPU kernel here: the kernels sum in f32 where the interpreter sums
/// some of these (sums, log-sum-exp, the relative bias's gradient) in f64. On lavapipe the
/// largest difference is 1.2e-6 of the scale, in the 4550-term sums of `relative_bias_grad`.
#[test]
fn training_ops_on_wgpu_equal_the_interpreter() {
    let Some(gpu) = common::gpu() else { return };
    // The adapter's options, then with the contractions split (a hardware adapter's).
    let split = kiln_compiler::back::wgsl::Options { split_contractions: true, ..gpu.options() };
    let runs = [
        ("wgpu", Some(gpu.clone()), true, gpu.options()),
        ("wgpu, contractions split", Some(gpu.clone()), true, split),
        ("wgpu, chunked", chunked_gpu(), false, gpu.options()),
    ];
    for (device, gpu, wide, options) in runs {
        let Some(gpu) = gpu else { continue };
        let options = kiln_compiler::back::wgsl::Options { binding_bytes: gpu.options().binding_bytes, ..options };
        let (g, params, inputs) = training_ops(wide);
        let expected = interp::run(&g, &params, &inputs).unwrap();
        let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
        let model = GpuModel::with_progress(gpu, &plan, &options, &params, &HashMap::new(), &()).unwrap();
        if wide && options.split_contractions {
            assert_splits(&model, &options);
        }
        let got = model.run(&inputs).unwrap_or_else(|e| panic!("{device}: {e}"));
        let mut worst = (0.0f32, String::new());
        for ((name, want), (_, got)) in expected.iter().zip(&got) {
            let scale = want.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
            if want.max_abs_diff(got) / scale > worst.0 {
                worst = (want.max_abs_diff(got) / scale, name.clone());
            }
            assert_close(&format!("`{name}` on {device}"), want, got, GPU_TOLERANCE);
        }
        eprintln!("{device}: largest difference {:e} of the scale, `{}`", worst.0, worst.1);
    }
}

/// Asserts that the products of `model` (compiled with `options`, which split contractions) whose
/// contraction is long over few blocks run split: a second dispatch adds their slices.
fn assert_splits(model: &GpuModel, options: &kiln_compiler::back::wgsl::Options) {
    use kiln_compiler::back::wgsl;
    let program = model.program();
    let plan = &program.plan;
    let mut split = 0;
    for (i, step) in plan.steps.iter().enumerate() {
        if !wgsl::gemm::tiled(&step.op) {
            continue;
        }
        assert!(program.kernel_of(i).unwrap().partials, "{}: no partials bound", step.scope);
        let shape = |v: usize| kiln_compiler::lower::resolve(&plan.values[v].shape, &HashMap::new());
        let operands: Vec<Vec<usize>> = step.operands.iter().map(|&v| shape(v)).collect();
        let dims = wgsl::dispatch(&step.op, &operands, &shape(step.output), 0, options).unwrap();
        let combine = wgsl::partials::combine_dims(&step.op, &dims);
        assert_eq!(combine.is_some(), dims[8] > 1, "{}: {dims:?}", step.scope);
        split += usize::from(combine.is_some());
    }
    // `matmul{0,1}.split`, `matmul0.split.shared`, `contract_rows.split` (a product by a shared
    // transposed `b`, `matmul1.split.shared`, is lowered to a projection) and
    // `matmul{0,1}.gelu_grad.split`.
    assert!(split >= 6, "{split} products split");
}

/// [`training_ops_on_wgpu_equal_the_interpreter`]'s graph, its parameters and its inputs: rows
/// wider than a workgroup if `wide`, else small enough to split into at most 32 buffers of 64
/// floats.
fn training_ops(wide: bool) -> (Graph, HashMap<String, Tensor>, HashMap<String, Tensor>) {
    use kiln_compiler::graph::{InputRole, Sym};
    // An odd width, over 64 if `wide`; a larger one.
    let (w, big) = if wide { (67, 130) } else { (7, 13) };
    let mut g = Graph::new("training");
    let out = |g: &mut Graph, name: &str, op: Op, operands: &[NodeIndex]| {
        let y = g.add(op, operands).unwrap_or_else(|e| panic!("{name}: {e}"));
        g.outputs.push((name.to_string(), y));
    };
    // `x * x + 0.5`: a positive operand (of `rsqrt`, of a renormalizing top-k's selection).
    let positive = |g: &mut Graph, x: NodeIndex| {
        let sq = g.add(Op::Mul, &[x, x]).unwrap();
        g.add(Op::Offset { value: Scalar(0.5) }, &[sq]).unwrap()
    };
    for (t, transpose_b) in [false, true].into_iter().enumerate() {
        let a = g.param(&format!("matmul{t}.a"), &[2, 3, 4, w]);
        let b = g.param(&format!("matmul{t}.b"), &if transpose_b { [5, w] } else { [w, 5] });
        out(&mut g, &format!("matmul{t}.one"), Op::MatMul { transpose_b }, &[a, b]);
        let bs = g.param(&format!("matmul{t}.bs"), &if transpose_b { [2, 3, 5, w] } else { [2, 3, w, 5] });
        out(&mut g, &format!("matmul{t}.stack"), Op::MatMul { transpose_b }, &[a, bs]);
    }
    for (shape, axes) in [(vec![3usize, 5, 7], &[0usize, 1, 2][..]), (vec![2, w, 5], &[1]), (vec![big, 3], &[0, 1])] {
        let x = g.param(&format!("sum{shape:?}"), &shape);
        for &axis in axes {
            out(&mut g, &format!("sum{shape:?}.{axis}"), Op::SumAxis { axis }, &[x]);
        }
    }
    // Transposes of the last two axes (a workgroup per 32 x 32 tile, cut at every edge; a matrix,
    // a stack, a stack of stacks) and a permutation that keeps the last axis.
    let mut permutes: Vec<(Vec<usize>, Vec<usize>)> = vec![(vec![2, 5, 7], vec![0, 2, 1]), (vec![3, 4], vec![1, 0])];
    if wide {
        permutes.extend([
            (vec![3, 37, 45], vec![0, 2, 1]),
            (vec![70, 33], vec![1, 0]),
            (vec![2, 3, 33, 70], vec![0, 1, 3, 2]),
            (vec![2, 3, 9, 5], vec![0, 2, 1, 3]),
        ]);
    }
    for (shape, perm) in permutes {
        let x = g.param(&format!("permute{shape:?}{perm:?}.x"), &shape);
        out(&mut g, &format!("permute{shape:?}{perm:?}"), Op::Permute { perm }, &[x]);
    }
    // A bias's gradient, the sum over every leading axis: of a matrix, of a stack, and (wide) over
    // enough rows that the WGSL kernel's workgroups take them in several chunks, the last short,
    // and over more than 64 columns.
    let mut sums = vec![vec![5usize, w], vec![2, 3, w]];
    if wide {
        sums.extend([vec![3, 45, w], vec![2, 9, big]]);
    }
    for shape in sums {
        let x = g.param(&format!("sum_rows{shape:?}.x"), &shape);
        out(&mut g, &format!("sum_rows{shape:?}"), Op::SumRows, &[x]);
    }
    for act in [Activation::Relu, Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
        let x = g.param(&format!("grad.{}.x", act.name()), &[4, w]);
        let dy = g.param(&format!("grad.{}.dy", act.name()), &[4, w]);
        out(&mut g, &format!("grad.{}", act.name()), Op::ActGrad(act), &[x, dy]);
        // The product with the derivative as its epilogue, `b` in both layouts.
        for (t, transpose_b) in [false, true].into_iter().enumerate() {
            let a = g.param(&format!("matmul{t}.{}_grad.a", act.name()), &[2, 3, 4, w]);
            let b = g.param(&format!("matmul{t}.{}_grad.b", act.name()), &if transpose_b { [5, w] } else { [w, 5] });
            let x = g.param(&format!("matmul{t}.{}_grad.x", act.name()), &[2, 3, 4, 5]);
            let op = Op::MatMulActGrad { act, transpose_b };
            out(&mut g, &format!("matmul{t}.{}_grad", act.name()), op, &[a, b, x]);
        }
    }
    let x = g.param("rsqrt.x", &[3, w]);
    let x = positive(&mut g, x);
    out(&mut g, "rsqrt", Op::Rsqrt, &[x]);
    // A softmax's input gradient from its output.
    let (y, dy) = (g.param("softmax_grad.y", &[2, 3, w]), g.param("softmax_grad.dy", &[2, 3, w]));
    out(&mut g, "softmax_grad", Op::SoftmaxGrad, &[y, dy]);
    // The input's gradient of a row norm, centred or not.
    let (x, gain, dy) =
        (g.param("norm_grad.x", &[2, 3, w]), g.param("norm_grad.gain", &[w]), g.param("norm_grad.dy", &[2, 3, w]));
    for rms in [false, true] {
        out(&mut g, &format!("norm_grad.{rms}"), Op::NormGrad { rms, eps: Scalar(1e-5) }, &[x, gain, dy]);
        // With the residual path's gradient added in the same pass.
        let op = Op::NormGrad { rms, eps: Scalar(1e-5) };
        out(&mut g, &format!("norm_grad.{rms}.residual"), op, &[x, gain, dy, x]);
        out(&mut g, &format!("norm_gain_grad.{rms}"), Op::NormGainGrad { rms, eps: Scalar(1e-5) }, &[x, dy]);
    }
    // A gain gradient over enough rows that its workgroups take them in several chunks, the last
    // one short (`partials`).
    if wide {
        let (x, dy) = (g.param("norm_gain_grad.many.x", &[3, 45, w]), g.param("norm_gain_grad.many.dy", &[3, 45, w]));
        for rms in [false, true] {
            let op = Op::NormGainGrad { rms, eps: Scalar(1e-5) };
            out(&mut g, &format!("norm_gain_grad.many.{rms}"), op, &[x, dy]);
        }
    }
    // A weight's gradient: the products of rows over every leading axis.
    let a = g.param("contract_rows.a", &[2, 3, w]);
    let b = g.param("contract_rows.b", &[2, 3, 5]);
    out(&mut g, "contract_rows", Op::ContractRows, &[a, b]);
    // Products over several of the tiled kernels' 32 x 32 blocks of output (and 16-deep steps of
    // the contraction), cut at every edge.
    if wide {
        for (t, transpose_b) in [false, true].into_iter().enumerate() {
            let a = g.param(&format!("matmul{t}.blocks.a"), &[2, 70, w]);
            let b = g.param(&format!("matmul{t}.blocks.b"), &if transpose_b { [2, 45, w] } else { [2, w, 45] });
            out(&mut g, &format!("matmul{t}.blocks"), Op::MatMul { transpose_b }, &[a, b]);
        }
        let a = g.param("contract_rows.blocks.a", &[3, 25, 70]);
        let b = g.param("contract_rows.blocks.b", &[3, 25, 45]);
        out(&mut g, "contract_rows.blocks", Op::ContractRows, &[a, b]);
        // Outputs of more than `gemm::WIDE_FROM_BLOCKS` blocks of 64 x 64, which run the wide
        // form, cut at every edge.
        for (t, transpose_b) in [false, true].into_iter().enumerate() {
            let a = g.param(&format!("matmul{t}.wide.a"), &[8, 400, w]);
            let b = g.param(&format!("matmul{t}.wide.b"), &if transpose_b { [8, 330, w] } else { [8, w, 330] });
            out(&mut g, &format!("matmul{t}.wide"), Op::MatMul { transpose_b }, &[a, b]);
        }
        let a = g.param("contract_rows.wide.a", &[5, 1100]);
        let b = g.param("contract_rows.wide.b", &[5, 1000]);
        out(&mut g, "contract_rows.wide", Op::ContractRows, &[a, b]);
        // Long contractions over few blocks, which run in slices added by a second dispatch
        // (`gemm::launch`), the last slice short and cut within a 16-deep step: `k` of 1 000 in 3
        // slices over 2 batches, and over one `b` shared by 3; 1 400 rows in 5.
        for (t, transpose_b) in [false, true].into_iter().enumerate() {
            let a = g.param(&format!("matmul{t}.split.a"), &[2, 37, 1000]);
            let b = g.param(&format!("matmul{t}.split.b"), &if transpose_b { [2, 45, 1000] } else { [2, 1000, 45] });
            out(&mut g, &format!("matmul{t}.split"), Op::MatMul { transpose_b }, &[a, b]);
            let a = g.param(&format!("matmul{t}.split.shared.a"), &[3, 37, 1000]);
            let b = g.param(&format!("matmul{t}.split.shared.b"), &if transpose_b { [45, 1000] } else { [1000, 45] });
            out(&mut g, &format!("matmul{t}.split.shared"), Op::MatMul { transpose_b }, &[a, b]);
        }
        let a = g.param("contract_rows.split.a", &[2, 700, 40]);
        let b = g.param("contract_rows.split.b", &[2, 700, 45]);
        out(&mut g, "contract_rows.split", Op::ContractRows, &[a, b]);
        // The product with an activation's gradient in its epilogue: over several blocks, in the
        // wide form, and split (the derivative applied where the slices are added).
        for (t, transpose_b) in [false, true].into_iter().enumerate() {
            for (form, [batches, m, k, n]) in
                [("blocks", [3, 70, w, 45]), ("wide", [8, 400, w, 330]), ("split", [3, 37, 1000, 45])]
            {
                let name = format!("matmul{t}.gelu_grad.{form}");
                let a = g.param(&format!("{name}.a"), &[batches, m, k]);
                let b = g.param(&format!("{name}.b"), &if transpose_b { [n, k] } else { [k, n] });
                let x = g.param(&format!("{name}.x"), &[batches, m, n]);
                out(&mut g, &name, Op::MatMulActGrad { act: Activation::Gelu, transpose_b }, &[a, b, x]);
            }
        }
    }

    // Ids and labels are inputs `[batch, seq]`; `dy` and the logits are rows gathered by
    // `token_type_ids` (all different).
    let mut input = |name: &str, role| g.add(Op::Input { name: name.into(), role, seq: Sym::Seq }, &[]).unwrap();
    let (ids, rows, labels) = (
        input("input_ids", InputRole::Ids),
        input("token_type_ids", InputRole::TokenTypes),
        input("labels", InputRole::Labels),
    );
    let table = g.param("gather_grad.table", &[11, w]);
    let src = g.param("gather_grad.src", &[18, w]);
    let dy = g.add(Op::Gather, &[src, rows]).unwrap();
    out(&mut g, "gather_grad", Op::GatherGrad, &[table, ids, dy]);
    // Added to a tied table's other gradient.
    let base = g.param("gather_grad.base", &[11, w]);
    out(&mut g, "gather_grad.base", Op::GatherGrad, &[table, ids, dy, base]);
    // A gather from a table stored transposed (the WGSL back end's for a tied head), with a
    // padding column past the rows the ids name.
    let columns = g.param("gather_columns.table", &[w, 19]);
    out(&mut g, "gather_columns", Op::GatherColumns { splits: vec![18] }, &[columns, ids]);
    // In three pieces (the last padded), as a split head's transposed weight.
    let pieces = [
        g.param("gather_columns.0", &[w, 8]),
        g.param("gather_columns.1", &[w, 4]),
        g.param("gather_columns.2", &[w, 8]),
    ];
    let op = Op::GatherColumns { splits: vec![8, 4, 6] };
    out(&mut g, "gather_columns.pieces", op, &[pieces[0], pieces[1], pieces[2], ids]);
    let dloss = g.param("cross_entropy.dy", &[1]);
    for vocab in [w, big] {
        let src = g.param(&format!("cross_entropy{vocab}.src"), &[18, vocab]);
        let logits = g.add(Op::Gather, &[src, rows]).unwrap();
        for smoothing in [Scalar(0.0), Scalar(0.1)] {
            let (name, ignore_index) = (format!("cross_entropy{vocab}.{}", smoothing.0), -100);
            out(&mut g, &name, Op::CrossEntropy { smoothing, ignore_index }, &[logits, labels]);
            let op = Op::CrossEntropyGrad { smoothing, ignore_index };
            out(&mut g, &format!("{name}.grad"), op, &[logits, labels, dloss]);
        }
    }
    let (q, k) = if wide { (65, 70) } else { (5, 6) };
    for (buckets, max_distance, bidirectional, heads, dy) in
        [(8, 20, true, 3, vec![2usize, 3, 5, 7]), (16, 40, false, 2, vec![1, 2, q, k])]
    {
        let table = g.param(&format!("relative_bias_grad{buckets}.table"), &[buckets, heads]);
        let dy = g.param(&format!("relative_bias_grad{buckets}.dy"), &dy);
        let op = Op::RelativeBiasGrad { buckets, max_distance, bidirectional };
        out(&mut g, &format!("relative_bias_grad{buckets}"), op, &[table, dy]);
    }
    for (rows, len, cols) in [(9, 4, 6), (w + 3, w, 3)] {
        let x = g.param(&format!("truncate_grad{rows}.x"), &[rows, cols]);
        let dy = g.param(&format!("truncate_grad{rows}.dy"), &[len, cols]);
        out(&mut g, &format!("truncate_grad{rows}"), Op::TruncateGrad, &[x, dy]);
    }
    for (renormalize, k, shape) in [(false, 3, [5usize, 9]), (true, 3, [5, 9]), (true, 2, [w, 4])] {
        let name = format!("top_k_grad.{renormalize}.{shape:?}");
        let x = g.param(&format!("{name}.x"), &shape);
        let x = if renormalize { positive(&mut g, x) } else { x };
        let dy = g.param(&format!("{name}.dy"), &shape);
        out(&mut g, &name, Op::TopKGrad { k, renormalize }, &[x, dy]);
    }
    // The ops a training step keeps unfused: softmax over masked scores (the queries the last of
    // the keys; a key mask), slices and concatenations on each axis, offsets, RoPE.
    let scores = g.param("scores", &[2, 3, 4, w]);
    let key_mask = g.param("scores.key_mask", &[2, w]);
    // 0 (masked) where the parameter is not positive.
    let key_mask = g.add(Op::Act(Activation::Relu), &[key_mask]).unwrap();
    for (causal, window) in [(true, None), (true, Some(3)), (false, Some(2))] {
        let name = format!("mask.{causal}.{window:?}");
        let masked = g.add(Op::Mask { causal, window }, &[scores]).unwrap();
        out(&mut g, &format!("{name}.softmax"), Op::Softmax, &[masked]);
        out(&mut g, &format!("{name}.keys"), Op::Mask { causal, window }, &[scores, key_mask]);
    }
    for (axis, start, len) in [(0, 1, 1), (2, 1, 2), (3, 3, w - 4)] {
        out(&mut g, &format!("slice.{axis}"), Op::Slice { axis, start, len }, &[scores]);
    }
    for axis in 0..4 {
        out(&mut g, &format!("concat.{axis}"), Op::Concat { axis }, &[scores, scores]);
    }
    out(&mut g, "offset", Op::Offset { value: Scalar(0.25) }, &[scores]);
    let heads = g.param("rope.x", &[2, 3, 5, 8]);
    for (style, rotary_dim) in [(PairStyle::RotateHalf, 8), (PairStyle::Interleaved, 4)] {
        let op = Op::Rope { theta: Scalar(10000.0), rotary_dim, style };
        out(&mut g, &format!("rope.{}.{rotary_dim}", style.name()), op, &[heads]);
    }

    let params = spread_params(&g);
    let ids = |f: &dyn Fn(i64) -> i64| Tensor::i64(vec![2, 9], (0..18).map(f).collect());
    let inputs = HashMap::from([
        // Repeated ids, and a row no id names (0).
        ("input_ids".to_string(), ids(&|t| 1 + (t * 7) % 10)),
        ("token_type_ids".to_string(), ids(&|t| (t * 5) % 18)),
        // A third of the labels ignored.
        ("labels".to_string(), ids(&|t| [-100, 3, (t * 11) % 7][t as usize % 3])),
    ]);
    (g, params, inputs)
}
