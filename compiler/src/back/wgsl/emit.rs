//! What every WGSL kernel is made of: element types, literals, activations, the numerical
//! helpers, and the bodies of the one-thread-per-element ops (every op but the projection and the
//! blocked attention, which have modules of their own). [`super::kernel`] assembles modules from
//! these parts.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::scores;
use crate::graph::{Activation, BlockPattern, Bucketing, Op, PackedAttention, PairStyle, Scalar, ScoreMods};
use crate::lower::WeightFormat;
// The attention bodies here keep an output row in a private array this wide (as the blocked
// kernel does, `super::attention`).
use super::target::MAX_ATTENTION_HEAD_DIM;

/// `text` with every line indented by four spaces.
pub(super) fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

/// Threads per workgroup of every kernel.
pub const WORKGROUP: u32 = 64;
// The tiled products (`gemm`) run in the cooperative entry: their lanes are its.
const _: () = assert!(super::gemm::LANES == WORKGROUP);

/// The loop header of a cooperative kernel's lane over its row's `d` elements (see
/// [`cooperative`]).
const LANES: &str = "for (var j = lane; j < d; j = j + 64u)";

/// Whether `op`'s kernel runs a workgroup per row (the norms, the softmaxes, the heads
/// normalized per head, the cross-entropy and its gradient, the gather's backward, the norms' and
/// the softmax's gradients, a norm's gain gradient and a sum over rows per block of columns; see
/// `partials`): its body runs with `wg`, the row, and `lane`, the invocation's index in the
/// workgroup, and (see [`reduces`]) reduces the row with `row_sum` and `row_max`
/// (`super::reduce`). One thread per row, as on a CPU adapter, leaves a GPU's row a few
/// hundred dependent loads long (124 µs for a 576-wide RMSNorm on an H100).
pub fn cooperative(op: &Op) -> bool {
    transposes(op)
        || matches!(
            op,
            Op::RmsNorm { .. }
                | Op::LayerNorm { .. }
                | Op::AddNorm { .. }
                | Op::Softmax
                | Op::MaskedSoftmax { .. }
                | Op::Heads { norm: Some(_), .. }
                | Op::CrossEntropy { .. }
                | Op::CrossEntropyGrad { .. }
                | Op::GatherGrad
                | Op::NormGainGrad { .. }
                | Op::SumRows
                | Op::NormGrad { .. }
                | Op::SoftmaxGrad
        )
        || super::gemm::tiled(op)
}

/// Whether a [`cooperative`] kernel reduces across its workgroup (all but the gather's backward
/// and the sum over rows, whose lanes each own columns of what they write, and the transposes).
pub fn reduces(op: &Op) -> bool {
    cooperative(op) && !matches!(op, Op::GatherGrad | Op::SumRows) && !super::gemm::tiled(op) && !transposes(op)
}

/// Side of a transpose's tile ([`transposes`]).
pub const TRANSPOSE_TILE: usize = 32;
// The transpose's body is written for 32 x 32 tiles and 64 lanes, two rows a step.
const _: () = assert!(TRANSPOSE_TILE == 32 && WORKGROUP == 64);

/// Whether `op` is a permutation that swaps the last two axes and keeps the others (a stack of
/// matrix transposes: the backward's `P^T` and `dS^T`): it runs a workgroup per
/// [`TRANSPOSE_TILE`]-square tile of a matrix, staged through workgroup memory, so that both its
/// reads and its writes are of consecutive addresses. A thread per output element read the input
/// a row stride apart at each step (on the H100, GPT-2 small's step spent 4.2 ms in its
/// permutes, ~25 µs each; BENCHMARKS.md, 2026-11-27).
pub fn transposes(op: &Op) -> bool {
    match op {
        Op::Permute { perm } => match perm.split_last_chunk::<2>() {
            Some((lead, &[a, b])) => {
                lead.iter().enumerate().all(|(i, &p)| i == p) && a == lead.len() + 1 && b == lead.len()
            }
            None => false,
        },
        _ => false,
    }
}

/// Element type of a buffer as the kernel sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// `f32`.
    F32,
    /// `i32` (token ids and positions).
    I32,
    /// `f16` (a projection weight stored as f16; see [`crate::lower::format`]).
    F16,
    /// A projection weight of GGUF Q8_0 blocks, as `u32` words (see [`crate::lower::format`]).
    Q8_0,
    /// A projection weight of GGUF Q4_1 blocks, as `u32` words (see [`crate::lower::format`]).
    Q4_1,
    /// A projection weight of GGUF Q5_0 blocks, as `u32` words (see [`crate::lower::format`]).
    Q5_0,
    // GGUF's name (ggml's `GGML_TYPE_Q4_K`), as `WeightFormat` spells it.
    #[allow(non_camel_case_types)]
    /// A projection weight of GGUF Q4_K super-blocks, as `u32` words (see [`crate::lower::format`]).
    Q4_K,
    // GGUF's name (ggml's `GGML_TYPE_Q6_K`), as `WeightFormat` spells it.
    #[allow(non_camel_case_types)]
    /// A projection weight of GGUF Q6_K super-blocks, as `u32` words (see [`crate::lower::format`]).
    Q6_K,
}

impl From<WeightFormat> for Elem {
    fn from(f: WeightFormat) -> Elem {
        match f {
            WeightFormat::F32 => Elem::F32,
            WeightFormat::F16 => Elem::F16,
            WeightFormat::Q8_0 => Elem::Q8_0,
            WeightFormat::Q4_1 => Elem::Q4_1,
            WeightFormat::Q5_0 => Elem::Q5_0,
            WeightFormat::Q4_K => Elem::Q4_K,
            WeightFormat::Q6_K => Elem::Q6_K,
        }
    }
}

impl Elem {
    /// The WGSL type of one element of the buffer.
    pub(super) fn wgsl(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::I32 => "i32",
            Elem::F16 => "f16",
            Elem::Q8_0 | Elem::Q4_1 | Elem::Q5_0 | Elem::Q4_K | Elem::Q6_K => "u32",
        }
    }
}

/// A float literal WGSL accepts (always with a decimal point or exponent).
pub(super) fn lit(x: f32) -> String {
    let s = format!("{x:?}");
    if s.contains('.') || s.contains('e') || s.contains("inf") || s.contains("NaN") { s } else { format!("{s}.0") }
}

/// Numerical helpers shared by the kernels.
pub(super) const HELPERS: &str = "\
// erf by Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7).
fn erf_(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-x * x);
    return select(-y, y, x >= 0.0);
}
// tanh clamped so no implementation overflows exp inside it.
fn tanh_(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }
";

pub(super) fn activation(act: Activation, x: &str) -> String {
    match act {
        Activation::Relu => format!("max({x}, 0.0)"),
        Activation::Gelu => format!("0.5 * {x} * (1.0 + erf_({x} * 0.70710678118654752))"),
        Activation::GeluTanh => {
            format!("0.5 * {x} * (1.0 + tanh_(0.79788456080286536 * ({x} + 0.044715 * {x} * {x} * {x})))")
        }
        Activation::Silu => format!("{x} / (1.0 + exp(-{x}))"),
    }
}

/// Statements declaring `dact`, the derivative of `act` at `x`
/// ([`crate::semantics::activation_derivative`], in f32).
pub(super) fn activation_derivative(act: Activation) -> &'static str {
    match act {
        Activation::Relu => "let dact = select(0.0, 1.0, x > 0.0);",
        Activation::Gelu => {
            "let dact = 0.5 * (1.0 + erf_(x * 0.70710678118654752)) + x * exp(-0.5 * x * x) * 0.39894228040143268;"
        }
        Activation::GeluTanh => {
            "let t = tanh_(0.79788456080286536 * (x + 0.044715 * x * x * x));\n\
             let dact = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.79788456080286536 * (1.0 + 0.134145 * x * x);"
        }
        Activation::Silu => "let s = 1.0 / (1.0 + exp(-x));\nlet dact = s * (1.0 + x * (1.0 - s));",
    }
}

/// The literals of a cross-entropy's label smoothing `eps`: the label's weight `1 - eps` and `eps`.
pub(super) fn smoothing_literals(eps: f32) -> (String, String) {
    (lit((1.0 - f64::from(eps)) as f32), lit(eps))
}

/// The condition that the `i32` label `label` takes a loss: not `ignore` (as the label buffers
/// hold it: clamped to `i32`, see the runtime's upload) and within the vocabulary `v` (the
/// runtime refuses any other label before a run; a kernel skips it rather than read outside its
/// row).
pub(super) fn counted_label(label: &str, ignore: i64) -> String {
    let ignore = ignore.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
    // `-2147483648` is not a WGSL literal (the negation of an out-of-range one).
    let ignore = if ignore == i64::from(i32::MIN) { "(-2147483647 - 1)".to_string() } else { format!("{ignore}") };
    format!("{label} != {ignore} && {label} >= 0 && u32({label}) < v")
}

/// Statement reading the operand `in0`, which gives a backward op only its output's shape: a
/// pipeline's automatic bind group layout holds only the bindings its kernel reads, and the
/// runtime binds every operand.
const SHAPE_ONLY: &str =
    "// in0 gives the shape only; it is read so that the pipeline's layout binds it.\n_ = in0[0];\n";

/// The kernel body of a one-thread-per-element op: runs once per thread `i < dim(0)`. `None` for
/// ops that need no kernel (inputs, parameters, reshapes) and for projections ([`super::projection`]).
pub(super) fn body(op: &Op, operands: usize) -> Option<String> {
    Some(match op {
        Op::Input { .. } | Op::Param { .. } | Op::Reshape { .. } | Op::After => return None,
        // No kernel (see `dims`).
        Op::SquareSums | Op::ClipScale { .. } | Op::AdamW { .. } | Op::Sgd { .. } => return None,
        // ---- The backward ops (autodiff) and the loss. Every reduction runs in a fixed order
        // (no atomics), so a step's gradients are the same from run to run.
        // One thread per output element, summing its `n` inputs in order.
        Op::SumAxis { .. } => "let n = dim(1u);\nlet inner = dim(2u);\nlet o = i / inner;\nlet j = i % inner;\n\
             var acc = 0.0;\nfor (var t = 0u; t < n; t = t + 1u) { acc = acc + in0[(o * n + t) * inner + j]; }\nout[i] = acc;"
            .into(),
        Op::ActGrad(act) => format!("let x = in0[i];\n{}\nout[i] = in1[i] * dact;", activation_derivative(*act)),
        Op::Rsqrt => "out[i] = 1.0 / sqrt(in0[i]);".into(),
        // A workgroup per table row ([`cooperative`]), each lane owning the columns `lane, lane +
        // 64, ...` of it: the rows of `dy` whose id is this row's added in id order, as the
        // interpreter adds them, to zeros or to the base's row. The id test is uniform across
        // the workgroup.
        Op::GatherGrad => format!(
            "{SHAPE_ONLY}let d = dim(1u);\nlet n = dim(2u);\nlet base = wg * d;\n{LANES} {{ out[base + j] = {start}; }}\n\
             for (var t = 0u; t < n; t = t + 1u) {{\n    if (in1[t] == i32(wg)) {{\n        \
             {LANES} {{ out[base + j] = out[base + j] + in2[t * d + j]; }}\n    }}\n}}",
            start = if operands > 3 { "in3[base + j]" } else { "0.0" }
        ),
        // Two dispatches, or one in a chunked step (`partials`).
        Op::CrossEntropy { .. } | Op::NormGainGrad { .. } | Op::SumRows => return super::partials::whole_body(op),
        // A workgroup per row ([`cooperative`]): the counted rows (the lanes striding the labels),
        // the row's maximum and exponentials' sum, then `dy / counted * (softmax - target)` per
        // element, zero in a row that takes no loss.
        Op::CrossEntropyGrad { smoothing, ignore_index } => {
            let (keep, eps) = smoothing_literals(smoothing.0);
            format!(
                "let rows = dim(1u);\nlet v = dim(2u);\nlet base = wg * v;\nvar c = 0.0;\n\
                 for (var t = lane; t < rows; t = t + 64u) {{ let l = in1[t]; if ({counts_l}) {{ c = c + 1.0; }} }}\n\
                 let counted = row_sum(lane, c);\nvar mx = -3.40282347e38;\n\
                 for (var j = lane; j < v; j = j + 64u) {{ mx = max(mx, in0[base + j]); }}\nmx = row_max(lane, mx);\n\
                 var se = 0.0;\nfor (var j = lane; j < v; j = j + 64u) {{ se = se + exp(in0[base + j] - mx); }}\n\
                 let sum = row_sum(lane, se);\nlet label = in1[wg];\nlet counts = {counts};\nlet scale = in2[0] / counted;\n\
                 for (var j = lane; j < v; j = j + 64u) {{\n    \
                 let goal = select(0.0, {keep}, i32(j) == label) + {eps} / f32(v);\n    \
                 out[base + j] = select(0.0, scale * (exp(in0[base + j] - mx) / sum - goal), counts);\n}}",
                counts_l = counted_label("l", *ignore_index),
                counts = counted_label("label", *ignore_index),
            )
        }
        // One thread per table element `(bucket r, head h)`: every query/key pair of bucket `r`
        // (bucketed as the forward op), its `dy` over the planes of head `h` added.
        Op::RelativeBiasGrad { buckets, max_distance, bidirectional } => {
            let bucketing = Bucketing { buckets: *buckets, max_distance: *max_distance, bidirectional: *bidirectional };
            format!(
                "{SHAPE_ONLY}let heads = dim(1u);\nlet q = dim(2u);\nlet k = dim(3u);\nlet planes = dim(4u);\nlet r = i / heads;\n\
                 let h = i % heads;\nvar acc = 0.0;\nfor (var qq = 0u; qq < q; qq = qq + 1u) {{\n    \
                 let qi = qq + (k - min(q, k));\n    for (var ki = 0u; ki < k; ki = ki + 1u) {{\n{}{}\
                 if (bk == r) {{\n            for (var m = h; m < planes; m = m + heads) {{ acc = acc + in1[(m * q + qq) * k + ki]; }}\n        }}\n    }}\n}}\nout[i] = acc;",
                indent(&scores::bucket(bucketing, "ki", "qi")),
                "        ",
            )
        }
        // A workgroup per row ([`cooperative`]): the row's dot product, then each element.
        Op::SoftmaxGrad => format!(
            "let d = dim(1u);\nlet base = wg * d;\nvar dot = 0.0;\n{LANES} {{ dot = dot + in0[base + j] * in1[base + j]; }}\n\
             dot = row_sum(lane, dot);\n{LANES} {{ out[base + j] = in0[base + j] * (in1[base + j] - dot); }}"
        ),
        // A workgroup per row ([`cooperative`]): its statistics, then the two means of the
        // gradient, then each element (plus the residual's gradient, a fourth operand). A
        // centred norm's mean and the gradient's are reduced; an RMSNorm's are 0.
        Op::NormGrad { rms, eps } => {
            let mean = match rms {
                true => "let mean = 0.0;\n".to_string(),
                false => format!("var s = 0.0;\n{LANES} {{ s = s + in0[base + j]; }}\nlet mean = row_sum(lane, s) / f32(d);\n"),
            };
            let mean_gx = if *rms { "0.0" } else { "row_sum(lane, sg) / f32(d)" };
            let residual = if operands > 3 { " + in3[base + j]" } else { "" };
            format!(
                "let d = dim(1u);\nlet base = wg * d;\n{mean}var q = 0.0;\n\
                 {LANES} {{ let c = in0[base + j] - mean; q = q + c * c; }}\n\
                 let r = 1.0 / sqrt(row_sum(lane, q) / f32(d) + {eps:?});\nvar sg = 0.0;\nvar sgx = 0.0;\n\
                 {LANES} {{\n    let gx = in2[base + j] * in1[j];\n    \
                 sg = sg + gx;\n    sgx = sgx + gx * (in0[base + j] - mean) * r;\n}}\n\
                 let mg = {mean_gx};\nlet mgx = row_sum(lane, sgx) / f32(d);\n\
                 {LANES} {{\n    let gx = in2[base + j] * in1[j];\n    \
                 out[base + j] = r * (gx - mg - (in0[base + j] - mean) * r * mgx){residual};\n}}",
                eps = eps.0
            )
        }
        // A workgroup per block of the output (`gemm`).
        Op::ContractRows | Op::MatMul { .. } | Op::MatMulActGrad { .. } => super::gemm::body(op, false),
        // `dy`'s rows (the first `dim(1)` elements), then zeros.
        Op::TruncateGrad => format!("{SHAPE_ONLY}if (i < dim(1u)) {{ out[i] = in1[i]; }} else {{ out[i] = 0.0; }}"),
        // One thread per row, selecting as [`Op::TopK`] does. Renormalized, the kept entries are
        // marked in the output first, then replaced by their gradient.
        Op::TopKGrad { k, renormalize } => {
            let rank = "    let x = in0[base + j];\n    var rank = 0u;\n    \
                 for (var l = 0u; l < e; l = l + 1u) {\n        let y = in0[base + l];\n        \
                 if (y > x || (y == x && l < j)) { rank = rank + 1u; }\n    }\n";
            match renormalize {
                false => format!(
                    "let e = dim(1u);\nlet base = i * e;\nfor (var j = 0u; j < e; j = j + 1u) {{\n{rank}    \
                     out[base + j] = select(0.0, in1[base + j], rank < {k}u);\n}}"
                ),
                true => format!(
                    "let e = dim(1u);\nlet base = i * e;\nvar sum = 0.0;\nvar sdx = 0.0;\n\
                     for (var j = 0u; j < e; j = j + 1u) {{\n{rank}    let kept = rank < {k}u;\n    \
                     if (kept) {{ sum = sum + x; sdx = sdx + in1[base + j] * x; }}\n    out[base + j] = select(0.0, 1.0, kept);\n}}\n\
                     let dot = sdx / sum;\nfor (var j = 0u; j < e; j = j + 1u) {{\n    \
                     out[base + j] = select(0.0, (in1[base + j] - dot) / sum, out[base + j] != 0.0);\n}}"
                ),
            }
        }
        Op::Positions { .. } => "out[i] = i32(i) + i32(dim(1u));".into(),
        Op::Sinusoid { dim, style } => {
            let (pair, is_cos) = match style {
                PairStyle::Interleaved => ("j / 2u", "(j % 2u) == 1u"),
                PairStyle::RotateHalf => ("j % half", "j >= half"),
            };
            format!(
                "let width = {dim}u;\nlet half = width / 2u;\nlet j = i % width;\nlet p = f32(in0[i / width]);\n\
                 let pair = {pair};\nlet angle = p / pow(10000.0, f32(2u * pair) / f32(width));\n\
                 out[i] = select(sin(angle), cos(angle), {is_cos});"
            )
        }
        Op::Gather => "let d = dim(1u);\nlet row = u32(in1[i / d]);\nout[i] = in0[row * d + i % d];".into(),
        // The table `[d, w]` (a projection's transposed weight, maybe f16).
        Op::GatherColumns { splits } => {
            // The piece holding the row (its first row and width baked/in the dims), then the
            // row's column in it.
            let n = splits.len();
            let mut s = format!("let d = dim(1u);\nlet id = u32(in{n}[i / d]);\nlet j = i % d;\n");
            let mut start = 0usize;
            for (p, rows) in splits.iter().enumerate() {
                let col = if start == 0 { "id".to_string() } else { format!("id - {start}u") };
                let read = format!("out[i] = f32(in{p}[j * dim({}u) + {col}]);", p + 2);
                s += &match (p, p + 1 == n) {
                    (_, true) if n == 1 => format!("{read}\n"),
                    (0, false) => format!("if (id < {}u) {{ {read} }}", start + rows),
                    (_, false) => format!(" else if (id < {}u) {{ {read} }}", start + rows),
                    (_, true) => format!(" else {{ {read} }}\n"),
                };
                start += rows;
            }
            s
        }
        Op::Add | Op::Mul => {
            let sym = if matches!(op, Op::Add) { "+" } else { "*" };
            format!(
                "var rem = i;\nvar ia = 0u;\nvar ib = 0u;\nfor (var ax: i32 = 3; ax >= 0; ax = ax - 1) {{\n    \
                 let u = u32(ax);\n    let c = rem % dim(1u + u);\n    rem = rem / dim(1u + u);\n    \
                 ia = ia + c * dim(5u + u);\n    ib = ib + c * dim(9u + u);\n}}\nout[i] = in0[ia] {sym} in1[ib];"
            )
        }
        Op::Scale { factor } => format!("out[i] = in0[i] * {};", lit(factor.0)),
        Op::Offset { value } => format!("out[i] = in0[i] + {};", lit(value.0)),
        Op::SoftCap { cap } => format!("out[i] = {c} * tanh_(in0[i] / {c});", c = lit(cap.0)),
        // The first rows of a row-major matrix are its first elements.
        Op::Truncate { .. } => "out[i] = in0[i];".into(),
        Op::RelativeBias { .. } => {
            let mods = ScoreMods { relative: Bucketing::of(op), ..ScoreMods::default() };
            format!(
                "let heads = dim(1u);\nlet q = dim(2u);\nlet k = dim(3u);\nlet ki = i % k;\nlet qi = (i / k) % q + (k - min(q, k));\n\
                 let h = i / (q * k);\nvar x = 0.0;\n{}out[i] = x;",
                scores::relative(&mods, "x", "ki", "qi", "h", "heads", "in0")
            )
        }
        Op::Act(act) => format!("let x = in0[i];\nout[i] = {};", activation(*act, "x")),
        // The norms run a workgroup per row ([`cooperative`]): lane `lane` takes elements `lane,
        // lane + 64, ...`, and `row_sum` adds the lanes' partial sums ([`super::reduce`]).
        Op::LayerNorm { eps } => {
            let bias = if operands == 3 { " + in2[j]" } else { "" };
            format!(
                "let d = dim(1u);\nlet base = wg * d;\nvar s = 0.0;\n{LANES} {{ s = s + in0[base + j]; }}\n\
                 let mean = row_sum(lane, s) / f32(d);\nvar v = 0.0;\n{LANES} {{ let c = in0[base + j] - mean; v = v + c * c; }}\n\
                 let inv = 1.0 / sqrt(row_sum(lane, v) / f32(d) + {});\n\
                 {LANES} {{ out[base + j] = (in0[base + j] - mean) * inv * in1[j]{bias}; }}",
                lit(eps.0)
            )
        }
        Op::RmsNorm { eps } => format!(
            "let d = dim(1u);\nlet base = wg * d;\nvar ms = 0.0;\n{LANES} {{ let x = in0[base + j]; ms = ms + x * x; }}\n\
             let inv = 1.0 / sqrt(row_sum(lane, ms) / f32(d) + {});\n{LANES} {{ out[base + j] = in0[base + j] * inv * in1[j]; }}",
            lit(eps.0)
        ),
        // A workgroup per row, as the norms: the row's maximum, then its exponentials (each lane
        // reads back only what it wrote) and their sum.
        Op::Softmax => format!(
            "let d = dim(1u);\nlet base = wg * d;\nvar mx = -3.40282347e38;\n{LANES} {{ mx = max(mx, in0[base + j]); }}\n\
             mx = row_max(lane, mx);\nvar sum = 0.0;\n\
             {LANES} {{ let e = exp(in0[base + j] - mx); out[base + j] = e; sum = sum + e; }}\n\
             sum = row_sum(lane, sum);\n{LANES} {{ out[base + j] = out[base + j] / sum; }}"
        ),
        // A workgroup per tile ([`transposes`]): each lane loads 16 elements of the tile's 32 x 32
        // block of the input (lanes 0-31 a row's 32 consecutive columns, 32-63 the next row's),
        // then writes 16 of the output's block, reading the staged tile across (its rows padded to
        // 33 so a column's elements fall in different banks).
        Op::Permute { .. } if transposes(op) => "let m = dim(1u);\nlet n = dim(2u);\nlet tm = dim(3u);\nlet tn = dim(4u);\n\
             let b = wg / (tm * tn);\nlet t = wg % (tm * tn);\nlet r0 = (t / tn) * 32u;\nlet c0 = (t % tn) * 32u;\n\
             let base = b * m * n;\nlet col = lane % 32u;\nlet row = lane / 32u;\n\
             for (var k = 0u; k < 32u; k = k + 2u) {\n    let r = r0 + row + k;\n    let c = c0 + col;\n    \
             if (r < m && c < n) { transpose_tile[(row + k) * 33u + col] = in0[base + r * n + c]; }\n}\n\
             workgroupBarrier();\n\
             for (var k = 0u; k < 32u; k = k + 2u) {\n    let c = c0 + row + k;\n    let r = r0 + col;\n    \
             if (r < m && c < n) { out[base + c * m + r] = transpose_tile[col * 33u + row + k]; }\n}"
            .into(),
        Op::Permute { .. } => "var rem = i;\nvar src = 0u;\nfor (var ax: i32 = 3; ax >= 0; ax = ax - 1) {\n    \
             let u = u32(ax);\n    let c = rem % dim(1u + u);\n    rem = rem / dim(1u + u);\n    src = src + c * dim(5u + u);\n}\n\
             out[i] = in0[src];"
            .into(),
        Op::Rope { theta, rotary_dim, style } => {
            let (freq, partner, sign) = match style {
                PairStyle::RotateHalf => {
                    ("j % half", "select(j - half, j + half, j < half)", "select(1.0, -1.0, j < half)")
                }
                PairStyle::Interleaved => ("j / 2u", "select(j - 1u, j + 1u, (j % 2u) == 0u)", "select(1.0, -1.0, (j % 2u) == 0u)"),
            };
            format!(
                "let s = dim(1u);\nlet d = dim(2u);\nlet rd = {rotary_dim}u;\nlet half = rd / 2u;\nlet j = i % d;\n\
                 if (j >= rd) {{ out[i] = in0[i]; return; }}\nlet pos = f32((i / d) % s + dim(3u));\n\
                 let inv = 1.0 / pow({}, f32(2u * ({freq})) / f32(rd));\nlet angle = pos * inv;\n\
                 let row = i - j;\nout[i] = in0[i] * cos(angle) + {sign} * in0[row + {partner}] * sin(angle);",
                lit(theta.0)
            )
        }
        Op::RepeatHeads { .. } => "let kv = dim(1u);\nlet t = dim(2u);\nlet sd = dim(3u);\n\
             let bi = i / (kv * t * sd);\nlet h = (i / sd) % (kv * t);\nout[i] = in0[(bi * kv + h / t) * sd + i % sd];"
            .into(),
        Op::Alibi => "let heads = dim(1u);\nlet q = dim(2u);\nlet k = dim(3u);\nlet ki = i % k;\n\
             let qi = (i / k) % q + (k - min(q, k));\nlet h = (i / (k * q)) % heads;\n\
             let slope = alibi_slope(h, heads);\nout[i] = in0[i] + slope * (f32(ki) - f32(qi));"
            .to_string()
            .replace("alibi_slope(h, heads)", ALIBI_SLOPE),
        Op::Mask { causal, window } => {
            let keep = keep_condition(*causal, *window, (operands == 2).then_some("in1"), &ScoreMods::default());
            format!(
                "let heads = dim(1u);\nlet q = dim(2u);\nlet k = dim(3u);\nlet ki = i % k;\n\
                 let qi = (i / k) % q + (k - min(q, k));\nlet b = i / (k * q * heads);\n\
                 out[i] = select(-3.40282347e38, in0[i], {keep});"
            )
        }
        Op::BlockSparseMask { .. } => {
            // `semantics::block_pattern` for this element's (query block, key block).
            let mods = ScoreMods { sparse: BlockPattern::of(op), ..ScoreMods::default() };
            format!(
                "let heads = dim(1u);\nlet q = dim(2u);\nlet k = dim(3u);\nlet ki = i % k;\n\
                 let qi = (i / k) % q + (k - min(q, k));\nlet b = i / (k * q * heads);\n{}\
                 out[i] = select(-3.40282347e38, in0[i], {});",
                scores::sparse_setup(&mods, "qi", "q", "k"),
                keep_condition(false, None, (operands == 2).then_some("in1"), &mods),
            )
        }
        Op::TopK { k, renormalize } => {
            let norm = if *renormalize { "v / sum" } else { "v" };
            format!(
                "let e = dim(1u);\nlet base = i * e;\nvar sum = 0.0;\n\
                 for (var j = 0u; j < e; j = j + 1u) {{\n    let x = in0[base + j];\n    var rank = 0u;\n    \
                 for (var l = 0u; l < e; l = l + 1u) {{\n        let y = in0[base + l];\n        \
                 if (y > x || (y == x && l < j)) {{ rank = rank + 1u; }}\n    }}\n    \
                 let v = select(0.0, x, rank < {k}u);\n    out[base + j] = v;\n    sum = sum + v;\n}}\n\
                 for (var j = 0u; j < e; j = j + 1u) {{ let v = out[base + j]; out[base + j] = {norm}; }}"
            )
        }
        Op::Slice { .. } | Op::Last { .. } => "let n = dim(1u);\nlet inner = dim(2u);\nlet start = dim(3u);\nlet len = dim(4u);\n\
             let o = i / (len * inner);\nlet r = i % (len * inner);\nout[i] = in0[o * n * inner + start * inner + r];"
            .into(),
        Op::MeanPool => "let s = dim(1u);\nlet d = dim(2u);\nlet bi = i / d;\nlet j = i % d;\nvar acc = 0.0;\nvar count = 0.0;\n\
             for (var t = 0u; t < s; t = t + 1u) {\n    let w = in1[bi * s + t];\n    count = count + w;\n    \
             acc = acc + w * in0[(bi * s + t) * d + j];\n}\nout[i] = acc / max(count, 1e-9);"
            .into(),
        Op::L2Normalize => "let d = dim(1u);\nlet base = i * d;\nvar ss = 0.0;\n\
             for (var j = 0u; j < d; j = j + 1u) { let x = in0[base + j]; ss = ss + x * x; }\n\
             let inv = 1.0 / max(sqrt(ss), 1e-12);\nfor (var j = 0u; j < d; j = j + 1u) { out[base + j] = in0[base + j] * inv; }"
            .into(),
        Op::Linear { .. } => return None,
        Op::PackedAttention(PackedAttention { scale, alibi, causal, window, mods, q, k, v, cached, appends, .. }) => {
            // As `attention`, with heads read in place from the packed rows (stride `w` per token);
            // `cached`: the queries only, keys and values from their own `[b, kv, t, d]` operands;
            // `appends`: those the `pr` rows before this step's, read in place in the packed rows,
            // and the threads past the attention's append them (see `append::append_copy`).
            let m = Mods::new(mods, if *cached { 3 } else { 1 }, operands);
            let score = |r: &str, buf: &str| {
                format!("let r = {r};\n    for (var c = 0u; c < d; c = c + 1u) {{ x = x + in0[q0 + c] * {buf}[r + c]; }}")
            };
            let value = |r: &str, buf: &str| {
                format!(
                    "let rv = {r};\n    for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] * corr + p * {buf}[rv + c]; }}"
                )
            };
            let mean = |r: &str, buf: &str| format!("for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] + {buf}[{r} + c]; }}");
            let (keys, score, value, mean) = if *appends {
                let new = |col: usize| format!("(b * s_len + ki - pr) * w + {col}u + kvh * d");
                let either = |f: &dyn Fn(&str, &str) -> String, buf: &str, col: usize| {
                    format!("if (ki < pr) {{\n    {}\n    }} else {{\n    {}\n    }}", f("k0 + ki * d", buf), f(&new(col), "in0"))
                };
                (
                    "let k0 = (b * kv + kvh) * pr * d;\n".to_string(),
                    either(&score, "in1", *k),
                    either(&value, "in2", *v),
                    either(&mean, "in2", *v),
                )
            } else if *cached {
                let r = |base: &str| format!("{base} + ki * d");
                (
                    "let k0 = (b * kv + kvh) * k * d;\nlet v0 = k0;\n".to_string(),
                    score(&r("k0"), "in1"),
                    value(&r("v0"), "in2"),
                    mean(&r("v0"), "in2"),
                )
            } else {
                let r = |base: &str| format!("{base} + ki * w");
                (
                    format!("let k0 = b * k * w + {k}u + kvh * d;\nlet v0 = b * k * w + {v}u + kvh * d;\n"),
                    score(&r("k0"), "in0"),
                    value(&r("v0"), "in0"),
                    mean(&r("v0"), "in0"),
                )
            };
            let keep = keep_condition(*causal, *window, m.mask.as_deref(), mods);
            let logit = m.logit(*alibi);
            let attention = format!(
                "let h = i % heads;\nlet si = (i / heads) % s_len;\nlet b = i / (heads * s_len);\n\
                 let qi = si + (k - min(s_len, k));\nlet q0 = (b * s_len + si) * w + {q}u + h * d;\n\
                 let kvh = h / (heads / kv);\n{keys}{setup}\
                 // Head dim <= {MAX_ATTENTION_HEAD_DIM} (the optimizer's side condition).\n\
                 var acc: array<f32, {MAX_ATTENTION_HEAD_DIM}>;\nvar m = -3.40282347e38;\nvar l = 0.0;\n\
                 for (var ki = 0u; ki < k; ki = ki + 1u) {{\n    if (!({keep})) {{ continue; }}\n    \
                 var x = 0.0;\n    {score}\n    x = x * {};\n{logit}    \
                 let m1 = max(m, x);\n    let corr = exp(m - m1);\n    let p = exp(x - m1);\n    l = l * corr + p;\n    \
                 {value}\n    m = m1;\n}}\n\
                 // Every key masked: the reference softmax over equal masked logits is uniform over all keys.\n\
                 if (l == 0.0) {{\n    for (var ki = 0u; ki < k; ki = ki + 1u) {{\n        \
                 {mean}\n    }}\n    \
                 l = f32(k);\n}}\nfor (var c = 0u; c < d; c = c + 1u) {{ out[i * d + c] = acc[c] / l; }}",
                lit(scale.0),
                setup = scores::sparse_setup(mods, "qi", "s_len", "k"),
            );
            let dims = "let heads = dim(1u);\nlet s_len = dim(2u);\nlet k = dim(3u);\nlet d = dim(4u);\nlet kv = dim(5u);\nlet w = dim(6u);\n";
            if *appends {
                format!(
                    "{dims}let pr = k - min(s_len, k);\n// Never in place (see `append::append_copy`).\nlet room = 0u;\n\
                     if (i < dim(9u)) {{\n{}}} else {{\n{}}}",
                    indent(&attention),
                    indent(&super::append::append_copy(*k, *v))
                )
            } else {
                format!("{dims}{attention}")
            }
        }
        Op::LowRank { start, heads, head_dim } => format!(
            "let n = dim(1u);\nlet r = dim(2u);\nlet w = dim(3u);\nlet c = i % {head_dim}u;\nlet ri = (i / {head_dim}u) % r;\n\
             let h = (i / ({head_dim}u * r)) % {heads}u;\nlet b = i / ({head_dim}u * r * {heads}u);\n\
             let col = {start}u + h * {head_dim}u + c;\nvar acc = 0.0;\n\
             for (var t = 0u; t < n; t = t + 1u) {{ acc = acc + in1[t * r + ri] * in0[(b * n + t) * w + col]; }}\nout[i] = acc;"
        ),
        Op::Heads { start, norm, rope, .. } => {
            // Token `t < p` comes from the cache; later ones from the packed rows, rotated at
            // position `past + t - p` (the rotation partner read from the same row). Without a
            // norm, one thread per output element; with one, a workgroup per head row
            // ([`cooperative`]): the lanes sum the row's squares once, then each writes its
            // elements `lane, lane + 64, ...`, normalized.
            let gain = usize::from(norm.is_some());
            let cached = operands == 2 + gain;
            let (x, g) = if cached { ("in1", "in2") } else { ("in0", "in1") };
            let mut body = String::from("let hn = dim(1u);\nlet p = dim(2u);\nlet s = dim(3u);\nlet d = dim(4u);\nlet w = dim(5u);\n");
            // The element `c` of output row `t` of head `h` of sequence `b`, stored at `o`.
            let row = format!("let row = (b * s + t - p) * w + {start}u + h * d;\n");
            // Element `j` of the head as the rotation reads it.
            let val = |j: &str| match norm {
                Some(_) => format!("({x}[row + {j}] * r * {g}[{j}])"),
                None => format!("{x}[row + {j}]"),
            };
            let new = match rope {
                None => format!("{row}out[o] = {};\n", val("c")),
                Some(r) => {
                    let (freq, partner, sign) = match r.style {
                        PairStyle::RotateHalf => {
                            ("c % half", "select(c - half, c + half, c < half)", "select(1.0, -1.0, c < half)")
                        }
                        PairStyle::Interleaved => {
                            ("c / 2u", "select(c - 1u, c + 1u, (c % 2u) == 0u)", "select(1.0, -1.0, (c % 2u) == 0u)")
                        }
                    };
                    format!(
                        "{row}let rd = {}u;\nlet half = rd / 2u;\nif (c >= rd) {{\n    out[o] = {};\n}} else {{\n    \
                         let pos = f32(t - p + dim(6u));\n    let inv = 1.0 / pow({}, f32(2u * ({freq})) / f32(rd));\n    \
                         let angle = pos * inv;\n    let pc = {partner};\n    out[o] = {} * cos(angle) + {sign} * {} * sin(angle);\n}}\n",
                        r.rotary_dim,
                        val("c"),
                        lit(r.theta.0),
                        val("c"),
                        val("pc")
                    )
                }
            };
            let element = match cached {
                true => format!(
                    "if (t < p) {{\n    out[o] = in0[((b * hn + h) * p + t) * d + c];\n}} else {{\n{}}}\n",
                    indent(&new)
                ),
                false => new,
            };
            // Appending in place (`dim(7u)`, the cache's rows of room per head, not 0): the output
            // is the cache itself, its heads that many rows apart, and only the `s` new rows are
            // written, after the `p` it holds (see `dims::heads_in_place`).
            body += "let cap = dim(7u);\nlet rows = select(p + s, s, cap != 0u);\nlet skip = select(0u, p, cap != 0u);\n";
            match norm {
                None => {
                    body += "let c = i % d;\nlet t = (i / d) % rows + skip;\nlet h = (i / (d * rows)) % hn;\nlet b = i / (d * rows * hn);\n\
                             let o = select(i, ((b * hn + h) * cap + t) * d + c, cap != 0u);\n";
                    body += &element;
                }
                Some(eps) => {
                    body += &format!(
                        "let t = wg % rows + skip;\nlet h = (wg / rows) % hn;\nlet b = wg / (rows * hn);\n\
                         let o0 = select(wg * d, ((b * hn + h) * cap + t) * d, cap != 0u);\n\
                         var ss = 0.0;\nif (t >= p) {{\n    {}    {LANES} {{ let v = {x}[row + j]; ss = ss + v * v; }}\n}}\n\
                         let r = 1.0 / sqrt(row_sum(lane, ss) / f32(d) + {});\n{LANES} {{\n    let c = j;\n    let o = o0 + c;\n{}}}",
                        row,
                        lit(eps.0),
                        indent(&element)
                    );
                }
            }
            body
        }
        Op::Concat { .. } => "let na = dim(1u);\nlet nb = dim(2u);\nlet inner = dim(3u);\n\
             let r = i % inner;\nlet j = (i / inner) % (na + nb);\nlet o = i / (inner * (na + nb));\n\
             if (j < na) { out[i] = in0[(o * na + j) * inner + r]; } else { out[i] = in1[(o * nb + j - na) * inner + r]; }"
            .into(),
        Op::MaskedSoftmax { scale, alibi, causal, window, mods } => {
            // A workgroup per row `i` of `k` scores ([`cooperative`]), lanes striding it; the
            // output row holds the masked logits, then their exponentials, then the probabilities
            // (each lane reads back only what it wrote).
            let m = Mods::new(mods, 1, operands);
            let mut logit = format!("    var x = in0[base + ki] * {};\n", lit(scale.0));
            logit += &m.logit(*alibi);
            let keep = keep_condition(*causal, *window, m.mask.as_deref(), mods);
            if keep != "true" {
                logit += &format!("    x = select(-3.40282347e38, x, {keep});\n");
            }
            let keys = "for (var ki = lane; ki < k; ki = ki + 64u)";
            format!(
                "let i = wg;\nlet heads = dim(1u);\nlet q = dim(2u);\nlet k = dim(3u);\nlet base = i * k;\n\
                 let qi = i % q + (k - min(q, k));\nlet h = (i / q) % heads;\nlet b = i / (q * heads);\n{}\
                 var mx = -3.40282347e38;\n{keys} {{\n{logit}    out[base + ki] = x;\n    mx = max(mx, x);\n}}\n\
                 mx = row_max(lane, mx);\n\
                 var sum = 0.0;\n{keys} {{ let e = exp(out[base + ki] - mx); out[base + ki] = e; sum = sum + e; }}\n\
                 sum = row_sum(lane, sum);\n{keys} {{ out[base + ki] = out[base + ki] / sum; }}",
                scores::sparse_setup(mods, "qi", "q", "k"),
            )
        }
        Op::Attention { scale, alibi, causal, window, mods } => {
            // One thread per query row (b, s, h), threads in output order: online softmax over the
            // keys, masked keys skipped, the weighted sum of values kept in a private array.
            let m = Mods::new(mods, 3, operands);
            let keep = keep_condition(*causal, *window, m.mask.as_deref(), mods);
            let logit = m.logit(*alibi);
            format!(
                "let heads = dim(1u);\nlet s_len = dim(2u);\nlet k = dim(3u);\nlet d = dim(4u);\nlet kv = dim(5u);\n\
                 let h = i % heads;\nlet si = (i / heads) % s_len;\nlet b = i / (heads * s_len);\n\
                 let qi = si + (k - min(s_len, k));\nlet q0 = ((b * heads + h) * s_len + si) * d;\n\
                 let kv0 = (b * kv + h / (heads / kv)) * k * d;\n{setup}\
                 // Head dim <= {MAX_ATTENTION_HEAD_DIM} (the optimizer's side condition).\n\
                 var acc: array<f32, {MAX_ATTENTION_HEAD_DIM}>;\nvar m = -3.40282347e38;\nvar l = 0.0;\n\
                 for (var ki = 0u; ki < k; ki = ki + 1u) {{\n    if (!({keep})) {{ continue; }}\n    \
                 let r = kv0 + ki * d;\n    var x = 0.0;\n    \
                 for (var c = 0u; c < d; c = c + 1u) {{ x = x + in0[q0 + c] * in1[r + c]; }}\n    x = x * {};\n{logit}    \
                 let m1 = max(m, x);\n    let corr = exp(m - m1);\n    let p = exp(x - m1);\n    l = l * corr + p;\n    \
                 for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] * corr + p * in2[r + c]; }}\n    m = m1;\n}}\n\
                 // Every key masked: the reference softmax over equal masked logits is uniform over all keys.\n\
                 if (l == 0.0) {{\n    for (var ki = 0u; ki < k; ki = ki + 1u) {{\n        \
                 for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] + in2[kv0 + ki * d + c]; }}\n    }}\n    \
                 l = f32(k);\n}}\nfor (var c = 0u; c < d; c = c + 1u) {{ out[i * d + c] = acc[c] / l; }}",
                lit(scale.0),
                setup = scores::sparse_setup(mods, "qi", "s_len", "k"),
            )
        }
        Op::AttentionGrad { scale, alibi, causal, window, mods } => {
            attention_grad(*scale, *alibi, *causal, *window, mods, operands, AttentionGradStage::Whole)
        }
        Op::AddNorm { rms, eps, after: true } => {
            // `b`'s row statistics first, then `a + norm(b)` per element.
            let bias = if operands == 4 { " + in3[j]" } else { "" };
            let stats = if *rms {
                format!("let mean = 0.0;\nvar ms = 0.0;\n{LANES} {{ let x = in1[base + j]; ms = ms + x * x; }}\n")
            } else {
                format!(
                    "var s = 0.0;\n{LANES} {{ s = s + in1[base + j]; }}\nlet mean = row_sum(lane, s) / f32(d);\n\
                     var ms = 0.0;\n{LANES} {{ let c = in1[base + j] - mean; ms = ms + c * c; }}\n"
                )
            };
            format!(
                "let d = dim(1u);\nlet base = wg * d;\n{stats}let inv = 1.0 / sqrt(row_sum(lane, ms) / f32(d) + {});\n\
                 {LANES} {{ out[base + j] = in0[base + j] + ((in1[base + j] - mean) * inv * in2[j]{bias}); }}",
                lit(eps.0)
            )
        }
        Op::AddNorm { rms, eps, .. } => {
            // The sum is written to the output row first (each lane reads back only what it
            // wrote), then normalised in place.
            if *rms {
                format!(
                    "let d = dim(1u);\nlet base = wg * d;\nvar ms = 0.0;\n\
                     {LANES} {{ let x = in0[base + j] + in1[base + j]; out[base + j] = x; ms = ms + x * x; }}\n\
                     let inv = 1.0 / sqrt(row_sum(lane, ms) / f32(d) + {});\n\
                     {LANES} {{ out[base + j] = out[base + j] * inv * in2[j]; }}",
                    lit(eps.0)
                )
            } else {
                let bias = if operands == 4 { " + in3[j]" } else { "" };
                format!(
                    "let d = dim(1u);\nlet base = wg * d;\nvar s = 0.0;\n\
                     {LANES} {{ let x = in0[base + j] + in1[base + j]; out[base + j] = x; s = s + x; }}\n\
                     let mean = row_sum(lane, s) / f32(d);\nvar v = 0.0;\n\
                     {LANES} {{ let c = out[base + j] - mean; v = v + c * c; }}\n\
                     let inv = 1.0 / sqrt(row_sum(lane, v) / f32(d) + {});\n\
                     {LANES} {{ out[base + j] = (out[base + j] - mean) * inv * in2[j]{bias}; }}",
                    lit(eps.0)
                )
            }
        }
    })
}

/// The WGSL condition under which key `ki` is attended by query `qi` (of batch `b`, with `k` keys),
/// as [`Op::Mask`] decides it; `key_mask` names the `f32[b, k]` key-mask buffer, if any.
/// Where a fused softmax's or attention's optional operands are, and the statements its score
/// modifiers add after the scale.
struct Mods<'a> {
    mods: &'a ScoreMods,
    /// The key mask's buffer, if there is one.
    mask: Option<String>,
    /// The relative bias table's buffer, if there is one.
    table: Option<String>,
}

impl<'a> Mods<'a> {
    /// For an op with `fixed` operands before the optional key mask and table, and `operands` in all.
    fn new(mods: &'a ScoreMods, fixed: usize, operands: usize) -> Self {
        let (mask, table) = scores::optional_buffers(mods, fixed, operands);
        Mods { mods, mask, table }
    }

    /// Statements turning the scaled score `x` of key `ki` for query position `qi`, head `h` into
    /// its logit: soft-cap, ALiBi when `alibi`, relative bias.
    fn logit(&self, alibi: bool) -> String {
        let mut s = scores::softcap(self.mods, "x");
        if alibi {
            s += &format!("x = x + {ALIBI_SLOPE} * (f32(ki) - f32(qi));\n");
        }
        if let Some(t) = &self.table {
            s += &scores::relative(self.mods, "x", "ki", "qi", "h", "heads", t);
        }
        s.lines().map(|l| format!("    {l}\n")).collect()
    }
}

/// [`Op::AttentionGrad`]'s kernel body: one thread per output row (`[3, b, h, s, d]` as rows of
/// `d`). A query gradient's thread walks its query's keys; a key's or value's walks every query.
/// Each needs the softmax statistics of the query rows it walks (the row's maximum, its
/// exponentials' sum and `rowsum(p * dp)`):
///
/// - `stage` [`AttentionGradStage::Whole`] (a chunked step's single dispatch): each thread
///   recomputes them for every query it walks, so a key row's work grows with the square of the
///   sequence: correct everywhere, fast nowhere long.
/// - [`AttentionGradStage::Rows`] and [`AttentionGradStage::Gradients`], the two dispatches of
///   the partial form (`partials`): the first writes every query row's three statistics to the
///   scratch buffer (`part`, [`attention_grad_statistics`]: a workgroup per query row), the second
///   reads them there ([`attention_grad_workgroups`]: a workgroup per output row), so the work of a row is linear
///   in the sequence: flash-attention's backward, the score matrix never held. Each gradient
///   element is the same arithmetic in the same order in every form.
pub(super) fn attention_grad(
    scale: Scalar,
    alibi: bool,
    causal: bool,
    window: Option<usize>,
    mods: &ScoreMods,
    operands: usize,
    stage: AttentionGradStage,
) -> String {
    let m = Mods::new(mods, 4, operands);
    let keep = keep_condition(causal, window, m.mask.as_deref(), mods);
    // `x`: the logit of key `ki` for query `qi`; `y`: its soft-capped score (before any bias).
    // What follows the dot `x` of the query and the key: the scale, the soft-cap (`y` the capped
    // score, before any bias), ALiBi and the relative bias.
    let mut scored = format!("x = x * {};\n{}let y = x;\n", lit(scale.0), scores::softcap(mods, "x"));
    if alibi {
        scored += &format!("x = x + {ALIBI_SLOPE} * (f32(ki) - f32(qi));\n");
    }
    if let Some(t) = &m.table {
        scored += &scores::relative(mods, "x", "ki", "qi", "h", "heads", t);
    }
    let logit = format!(
        "var x = 0.0;\nfor (var c = 0u; c < d; c = c + 1u) {{ x = x + in0[q0 + qi * d + c] * in1[kv0 + ki * d + c]; }}\n{scored}"
    );
    let logit: String = logit.lines().map(|l| format!("        {l}\n")).collect();
    let slope = match mods.softcap {
        Some(cap) => format!("        ds = ds * (y * y * {} + 1.0);\n", lit(-1.0 / (cap.0 * cap.0))),
        None => "        _ = y;\n".into(),
    };
    let setup = scores::sparse_setup(mods, "qi", "k", "k");
    if stage != AttentionGradStage::Whole {
        let walk = GradWalk { keep: &keep, setup: &setup, scored: &scored, slope: &slope };
        let bounded = m.mask.is_none() && mods.sparse.is_none() && window != Some(0);
        let bounds = WalkBounds::new(causal && bounded, window.filter(|_| bounded));
        return match stage {
            AttentionGradStage::Rows => attention_grad_statistics(&walk, &bounds),
            _ => attention_grad_workgroups(&walk, &bounds, scale),
        };
    }
    let dot = |a: &str, b: &str| format!("for (var c = 0u; c < d; c = c + 1u) {{ dp = dp + {a} * {b}; }}");
    let dp = dot("in3[q0 + qi * d + c]", "in2[kv0 + ki * d + c]");
    // Query `qi`'s statistics: `mx`, `l`, `uniform` and `dd`.
    let statistics = format!(
        "// The row's softmax: its maximum and sum over the kept keys, then sum(p * dp).\n\
         var mx = -3.40282347e38;\nvar l = 0.0;\n\
         for (var ki = 0u; ki < k; ki = ki + 1u) {{\n{logit}        if (!({keep})) {{ continue; }}\n        \
         let m1 = max(mx, x);\n        l = l * exp(mx - m1) + exp(x - m1);\n        mx = m1;\n    }}\n\
         // Every key masked: uniform over all keys (the reference softmax), its gradient gated to 0.\n\
         let uniform = l == 0.0;\nvar dd = 0.0;\n\
         for (var ki = 0u; ki < k; ki = ki + 1u) {{\n{logit}        \
         let p = select(select(0.0, exp(x - mx) / l, {keep}), 1.0 / f32(k), uniform);\n        \
         var dp = 0.0;\n        {dp}\n        dd = dd + p * dp;\n    }}\n"
    );
    format!(
        "{GRAD_SIZES}let which = i / rows;\nlet r = i % rows;\n{}\
         // Head dim <= {MAX_ATTENTION_HEAD_DIM} (the optimizer's side condition).\n\
         var acc: array<f32, {MAX_ATTENTION_HEAD_DIM}>;\n\
         let q_first = select(0u, own, which == 0u);\nlet q_last = select(k, own + 1u, which == 0u);\n\
         for (var qi = q_first; qi < q_last; qi = qi + 1u) {{\n{setup}{statistics}\
         // This thread's share: every key for a query's gradient, its own key for a key's or value's.\n\
         let k_first = select(own, 0u, which == 0u);\nlet k_last = select(own + 1u, k, which == 0u);\n\
         for (var ki = k_first; ki < k_last; ki = ki + 1u) {{\n{logit}        let kept = {keep};\n        \
         let p = select(select(0.0, exp(x - mx) / l, kept), 1.0 / f32(k), uniform);\n        \
         if (which == 2u) {{\n            for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] + p * in3[q0 + qi * d + c]; }}\n            \
         continue;\n        }}\n        var dp = 0.0;\n        {dp}\n        \
         var ds = select(0.0, p * (dp - dd), kept && !uniform);\n{slope}        ds = ds * {scale};\n        \
         if (which == 0u) {{\n            for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] + ds * in1[kv0 + ki * d + c]; }}\n        \
         }} else {{\n            for (var c = 0u; c < d; c = c + 1u) {{ acc[c] = acc[c] + ds * in0[q0 + qi * d + c]; }}\n        }}\n    \
         }}\n}}\nfor (var c = 0u; c < d; c = c + 1u) {{ out[i * d + c] = acc[c]; }}",
        grad_row("r"),
        scale = lit(scale.0),
    )
}

/// The sizes every form of [`attention_grad`] reads: `[threads, heads, k, d, kv, rows]`.
const GRAD_SIZES: &str =
    "let heads = dim(1u);\nlet k = dim(2u);\nlet d = dim(3u);\nlet kv = dim(4u);\nlet rows = dim(5u);\n";

/// Statements placing query row `r` (of `rows`) of [`attention_grad`]: its head `h`, batch `b`,
/// its query `own` of `k`, and where its head's queries (`q0`) and its group's keys (`kv0`) start.
fn grad_row(r: &str) -> String {
    format!(
        "let own = {r} % k;\nlet h = ({r} / k) % heads;\nlet b = {r} / (k * heads);\n\
         let q0 = (b * heads + h) * k * d;\nlet kv0 = (b * kv + h / (heads / kv)) * k * d;\n"
    )
}

/// The pieces of [`attention_grad`]'s walk that [`attention_grad_workgroups`] shares: the keep
/// condition of key `ki` for query `qi`, the block pattern's setup for `qi`, the statements after
/// the dot `x` (the scale, the soft-cap with `y` the capped score, the biases), and the soft-cap's
/// slope applied to `ds`.
struct GradWalk<'a> {
    keep: &'a str,
    setup: &'a str,
    scored: &'a str,
    slope: &'a str,
}

/// The rows the backward's workgroups walk: the keys `lo_q .. hi_q` of query `own`, the queries
/// `lo_k .. hi_k` of key `own` (WGSL expressions of `own` and `k`), bounded by a causal mask and
/// a window where given (see [`attention_grad_workgroups`]), else every row.
struct WalkBounds {
    lo_q: String,
    hi_q: String,
    lo_k: String,
    hi_k: String,
}

impl WalkBounds {
    fn new(causal: bool, window: Option<usize>) -> Self {
        let mut b = WalkBounds { lo_q: "0u".into(), hi_q: "k".into(), lo_k: "0u".into(), hi_k: "k".into() };
        if causal {
            b.hi_q = "own + 1u".into();
            b.lo_k = "own".into();
        }
        if let Some(w) = window {
            b.lo_q = format!("own + 1u - min(own + 1u, {w}u)");
            b.hi_k = format!("min(k, own + {w}u)");
        }
        b
    }
}

/// The first dispatch of [`Op::AttentionGrad`]'s partial form: a workgroup per query row writes
/// the row's softmax statistics to `part` (its maximum, its exponentials' sum, and `rowsum(p *
/// dp)`). The query and its output's gradient are loaded into workgroup memory; each lane walks
/// every 64th key of the row ([`WalkBounds`]'s), keeping an online maximum and sum, combined
/// across the lanes (`row_max`, `row_sum`); then `p * dp` likewise. A thread per query row
/// walked the row alone (on an H100, SmolLM2's 128-token step ran 1 152 such threads a layer).
fn attention_grad_statistics(walk: &GradWalk, bounds: &WalkBounds) -> String {
    let GradWalk { keep, setup, scored, .. } = walk;
    let WalkBounds { lo_q, hi_q, .. } = bounds;
    let max = MAX_ATTENTION_HEAD_DIM;
    let dot = |acc: &str, offset: &str, other: &str| {
        format!(
            "var {acc} = 0.0;\nfor (var c = 0u; c < d; c = c + 1u) {{ {acc} = {acc} + ag_own[{offset}c] * {other}[kv0 + ki * d + c]; }}\n"
        )
    };
    let logit = format!("{}{scored}", dot("x", "", "in1"));
    let body = format!(
        "let r = wg;\n{}let qi = own;\n\
         for (var c = lane; c < d; c = c + 64u) {{\n    ag_own[c] = in0[q0 + qi * d + c];\n    \
         ag_own[{max}u + c] = in3[q0 + qi * d + c];\n}}\nworkgroupBarrier();\n{setup}\
         let lo = {lo_q};\nlet hi = {hi_q};\n\
         // The lane's keys' softmax: its maximum and sum, then the row's.\n\
         var mx = -3.40282347e38;\nvar l = 0.0;\n\
         for (var ki = lo + lane; ki < hi; ki = ki + 64u) {{\n{}    if (!({keep})) {{ continue; }}\n    \
         let m1 = max(mx, x);\n    l = l * exp(mx - m1) + exp(x - m1);\n    mx = m1;\n}}\n\
         let row_mx = row_max(lane, mx);\nlet sum = row_sum(lane, l * exp(mx - row_mx));\n\
         // Every key masked: uniform over all keys (the reference softmax), its gradient gated to 0.\n\
         let uniform = sum == 0.0;\nvar dd = 0.0;\n\
         for (var ki = lo + lane; ki < hi; ki = ki + 64u) {{\n{}    \
         let p = select(select(0.0, exp(x - row_mx) / sum, {keep}), 1.0 / f32(k), uniform);\n{}    dd = dd + p * dp;\n}}\n\
         let row_dd = row_sum(lane, dd);\n\
         if (lane == 0u) {{\n    part[3u * r] = row_mx;\n    part[3u * r + 1u] = sum;\n    part[3u * r + 2u] = row_dd;\n}}\n",
        grad_row("r"),
        indent(&logit),
        indent(&logit),
        indent(&dot("dp", &format!("{max}u + "), "in2")),
    );
    format!("{GRAD_SIZES}if (wg < rows) {{\n{}}}", indent(&body))
}

/// Workgroup memory of [`attention_grad_workgroups`]: the workgroup's own two rows (up to
/// [`MAX_ATTENTION_HEAD_DIM`] each), then a chunk's probabilities and score gradients.
pub(super) fn attention_grad_declarations() -> String {
    format!(
        "var<workgroup> ag_own: array<f32, {}>;\nvar<workgroup> ag_chunk: array<f32, {}>;\n",
        2 * MAX_ATTENTION_HEAD_DIM,
        2 * WORKGROUP
    )
}

/// The second dispatch of [`Op::AttentionGrad`]'s partial form: a workgroup per output row, of a
/// query's gradient (`dq`, walking the keys) or of a key's and its value's together (`dk`, `dv`,
/// walking the queries: the pair shares each score), reading the walked queries' softmax
/// statistics from `part`. The workgroup loads its own rows (the query and its output's gradient,
/// or the key and the value) into workgroup memory, then walks the other side in chunks of 64:
///
/// - each lane takes one walked row: its score (a dot with the own row), probability `p`, the
///   dot `dp` of the output's gradient with the value, and `ds = p (dp - rowsum(p dp))`, into
///   workgroup memory;
/// - the lanes then own output columns (`lane`, `lane + 64`, ... below the head width) and add
///   the chunk's rows in order (`dq += ds k`, `dk += ds q`, `dv += p do`), reading each walked row
///   by consecutive addresses.
///
/// A thread per output row (the whole form) kept its head-wide accumulator in a private array
/// (local memory on a GPU) and ran `3 b h s` threads each walking the sequence alone: on an H100
/// 4.25 ms of SmolLM2's 128-token training step a layer (BENCHMARKS.md, 2026-11-28). Every sum
/// is in the same order as there (dots over the head in column order, the walked rows in order).
///
/// `causal` and `window` (given only where no row can have every key masked: no key mask, no
/// block pattern, a window of at least one) bound the walk to the pairs the masks keep; otherwise
/// every pair is visited and the keep condition decides, as a row with no key kept is uniform
/// over all keys.
fn attention_grad_workgroups(walk: &GradWalk, bounds: &WalkBounds, scale: Scalar) -> String {
    let GradWalk { keep, setup, scored, slope } = walk;
    let WalkBounds { lo_q, hi_q, lo_k, hi_k } = bounds;
    let max = MAX_ATTENTION_HEAD_DIM;
    let columns = max / WORKGROUP as usize;
    let decls: String = (0..columns).map(|j| format!("var a{j} = 0.0;\nvar v{j} = 0.0;\n")).collect();
    let adds: String = (0..columns)
        .map(|j| {
            format!(
                "{{\n    let c = lane + {o}u;\n    if (c < d) {{\n        if (which == 0u) {{\n            \
                 a{j} = a{j} + ds * in1[kv0 + row * d + c];\n        }} else {{\n            \
                 v{j} = v{j} + p * in3[q0 + row * d + c];\n            a{j} = a{j} + ds * in0[q0 + row * d + c];\n        \
                 }}\n    }}\n}}\n",
                o = j * WORKGROUP as usize
            )
        })
        .collect();
    let stores: String = (0..columns)
        .map(|j| {
            format!(
                "{{\n    let c = lane + {o}u;\n    if (c < d) {{\n        if (which == 0u) {{\n            \
                 out[r * d + c] = a{j};\n        }} else {{\n            out[(rows + r) * d + c] = a{j};\n            \
                 out[(2u * rows + r) * d + c] = v{j};\n        }}\n    }}\n}}\n",
                o = j * WORKGROUP as usize
            )
        })
        .collect();
    let lane_work = format!(
        "let qi = select(t, own, which == 0u);\nlet ki = select(own, t, which == 0u);\n{setup}\
         let at = 3u * ((b * heads + h) * k + qi);\n\
         let mx = part[at];\nlet l = part[at + 1u];\nlet dd = part[at + 2u];\nlet uniform = l == 0.0;\n\
         var x = 0.0;\nvar dp = 0.0;\n\
         if (which == 0u) {{\n    \
         for (var c = 0u; c < d; c = c + 1u) {{ x = x + ag_own[c] * in1[kv0 + ki * d + c]; }}\n}} else {{\n    \
         for (var c = 0u; c < d; c = c + 1u) {{ x = x + in0[q0 + qi * d + c] * ag_own[c]; }}\n}}\n\
         {scored}let kept = {keep};\n\
         let p = select(select(0.0, exp(x - mx) / l, kept), 1.0 / f32(k), uniform);\n\
         if (which == 0u) {{\n    \
         for (var c = 0u; c < d; c = c + 1u) {{ dp = dp + ag_own[{max}u + c] * in2[kv0 + ki * d + c]; }}\n}} else {{\n    \
         for (var c = 0u; c < d; c = c + 1u) {{ dp = dp + in3[q0 + qi * d + c] * ag_own[{max}u + c]; }}\n}}\n\
         var ds = select(0.0, p * (dp - dd), kept && !uniform);\n{slope}ds = ds * {scale};\n\
         pw = p;\ndw = ds;\n",
        slope = slope.trim_start(),
        scale = lit(scale.0),
    );
    let chunk = format!(
        "let t = c0 + lane;\nvar pw = 0.0;\nvar dw = 0.0;\nif (t < hi) {{\n{}}}\n\
         ag_chunk[lane] = pw;\nag_chunk[64u + lane] = dw;\nworkgroupBarrier();\n\
         let n = min(64u, hi - c0);\nfor (var e = 0u; e < n; e = e + 1u) {{\n    \
         let p = ag_chunk[e];\n    let ds = ag_chunk[64u + e];\n    let row = c0 + e;\n{}}}\nworkgroupBarrier();\n",
        indent(&lane_work),
        indent(&adds),
    );
    let body = format!(
        "let which = wg / rows;\nlet r = wg % rows;\n{}\
         // The own rows: the query and its output's gradient, or the key and the value.\n\
         for (var c = lane; c < d; c = c + 64u) {{\n    \
         ag_own[c] = select(in1[kv0 + own * d + c], in0[q0 + own * d + c], which == 0u);\n    \
         ag_own[{max}u + c] = select(in2[kv0 + own * d + c], in3[q0 + own * d + c], which == 0u);\n}}\n\
         workgroupBarrier();\n{decls}\
         let lo = select({lo_k}, {lo_q}, which == 0u);\nlet hi = select({hi_k}, {hi_q}, which == 0u);\n\
         for (var c0 = lo; c0 < hi; c0 = c0 + 64u) {{\n{}}}\n{stores}",
        grad_row("r"),
        indent(&chunk),
    );
    format!("{GRAD_SIZES}if (wg < 2u * rows) {{\n{}}}", indent(&body))
}

/// Which of [`attention_grad`]'s forms a kernel body is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AttentionGradStage {
    /// One dispatch, every thread recomputing its queries' statistics.
    Whole,
    /// The partial form's first dispatch: each query row's statistics into `part`.
    Rows,
    /// The partial form's second dispatch: the gradients, the statistics read from `part`.
    Gradients,
}

/// Whether key `ki` is kept for query position `qi`: by the causal and window mask, the key mask
/// in buffer `key_mask`, and a block pattern in `mods` (whose [`scores::sparse_setup`] the kernel
/// ran). `true` when nothing is masked.
fn keep_condition(causal: bool, window: Option<usize>, key_mask: Option<&str>, mods: &ScoreMods) -> String {
    let mut keep = Vec::new();
    if causal {
        keep.push("ki <= qi".to_string());
    }
    if let Some(w) = window {
        keep.push(format!("ki + {w}u > qi"));
    }
    if let Some(m) = key_mask {
        keep.push(format!("{m}[b * k + ki] != 0.0"));
    }
    if mods.sparse.is_some() {
        keep.push(scores::sparse_keep(mods, "ki"));
    }
    if keep.is_empty() { "true".into() } else { keep.join(" && ") }
}

/// ALiBi slope of head `h` of `heads` (Press et al.), computed in the kernel so the text does not
/// depend on the head count: geometric from `2^(-8/n)` for the largest power of two `n <= heads`,
/// then the odd powers of `2^(-4/n)` for the remaining heads.
pub(super) const ALIBI_SLOPE: &str = "select(pow(pow(2.0, -4.0 / f32(1u << firstLeadingBit(heads))), f32(2u * (h - (1u << firstLeadingBit(heads))) + 1u)), pow(pow(2.0, -8.0 / f32(1u << firstLeadingBit(heads))), f32(h + 1u)), h < (1u << firstLeadingBit(heads)))";
