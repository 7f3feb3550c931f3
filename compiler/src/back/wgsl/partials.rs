//! Kernels that reduce over rows in two dispatches of one module: the first writes partial results
//! into a scratch buffer (`part`, bound after the outputs), the second (`dims[15]` = 2, sized by
//! [`combine_dims`]) combines them in a fixed order. A reduction whose output is narrow — a
//! norm's gain gradient (one value per column, summed over every row), the cross-entropy (one
//! value) — otherwise runs on a few workgroups walking every row in turn: on an H200, GPT-2
//! small's 25 gain gradients took 1.14 s of a 1.55 s training step's kernels, its cross-entropy
//! 0.2 s (BENCHMARKS.md, 2026-11-27).
//!
//! The split attention (see [`super::attention`]) and the tiled products whose contraction is
//! split (see [`super::gemm`]) are the other kernels with partials; the functions here answer
//! for every op ([`has_partials`], [`combine_dims`], [`partials_bytes`]).
//! A step whose tensors are bound in chunks runs the single-dispatch form of the same op (the
//! chunked kernel binds no scratch buffer; `whole_body`), whose `dims[15]` is 0.
//!
//! - **Norm gain gradient** `sum over rows of dy * xhat` (LayerNorm's centred, RMSNorm's not): a
//!   workgroup per block of 64 columns and chunk of rows; for each row of its chunk the
//!   workgroup reduces the row's statistics (its lanes striding the row), then each lane adds its
//!   column's term. Sizes `[threads, rows, d, chunk, chunks, blocks]`; the partial sums are
//!   `chunks x d`, combined one thread per column in chunk order.
//! - **Sum over rows** `sum over rows of x` (a bias's gradient): the gain gradient's layout and
//!   sizes, each lane adding its column's element of each row of its chunk (no statistics).
//! - **Cross-entropy**: a workgroup per row writes the row's loss and whether it counts (`part[r]`,
//!   `part[rows + r]`); one workgroup sums both and writes their quotient. Sizes `[threads, rows,
//!   vocab]`.
//! - **Attention's backward** (`emit::attention_grad`): a workgroup per query row writes the row's
//!   softmax statistics (`part[3 r ..]`: maximum, sum, `rowsum(p * dp)`); then a workgroup per
//!   output row of the queries' gradient, and one per key row for the keys' and the values'
//!   gradients together, reads those of the rows it walks.
//!   Sizes `[threads, heads, s, d, kv heads, rows]`.

use super::Options;
use super::attention;
use super::emit::{AttentionGradStage, WORKGROUP, attention_grad, counted_label, indent, smoothing_literals};
use super::gemm;
use crate::graph::Op;

/// A norm gain gradient's partial form aims at about this many workgroups (an H100 has 132 SMs;
/// several workgroups each keep them busy).
const GAIN_GRAD_WORKGROUPS: usize = 512;

/// Fewest rows a gain gradient's workgroup takes in its partial form: each chunk adds a partial
/// sum per column for the combining dispatch to read.
const GAIN_GRAD_MIN_CHUNK: usize = 8;

/// Whether `op` is one of this module's reductions over rows (which always have partials, but
/// where chunked).
pub fn over_rows(op: &Op) -> bool {
    matches!(op, Op::NormGainGrad { .. } | Op::SumRows | Op::CrossEntropy { .. } | Op::AttentionGrad { .. })
}

/// Whether `op`'s kernel compiled with `options` binds a scratch buffer of partial results, which
/// a second dispatch combines (`geometry`: the step is an attention with a geometry, whose
/// kernel has partials when it splits its keys, see [`attention::has_partials`]; a tiled
/// product's where the options split contractions, [`Options::split_contractions`]).
pub fn has_partials(op: &Op, geometry: bool, options: &Options) -> bool {
    over_rows(op)
        || (gemm::tiled(op) && options.split_contractions)
        || (geometry && attention::has_partials(op, options))
}

/// The sizes of the second dispatch of a step whose first (`dims`) wrote partial results, `None`
/// where it wrote none (`dims[15]` not 1: a whole form, or an attention that did not split).
pub fn combine_dims(op: &Op, dims: &[u32; 16]) -> Option<[u32; 16]> {
    if dims[15] != 1 {
        return None;
    }
    let mut c = *dims;
    c[15] = 2;
    match op {
        // One thread per column.
        Op::NormGainGrad { .. } | Op::SumRows => c[0] = dims[5] * WORKGROUP,
        // One workgroup.
        Op::CrossEntropy { .. } => c[0] = WORKGROUP,
        // A workgroup per output row of the queries' gradient, and per pair of the keys' and the
        // values' (`emit::attention_grad_workgroups`).
        Op::AttentionGrad { .. } => c[0] = 2 * dims[5] * WORKGROUP,
        _ if gemm::tiled(op) => return Some(gemm::combine_dims(dims)),
        _ => return attention::combine_dims(dims),
    }
    Some(c)
}

/// Bytes of the scratch buffer a step sized `dims` writes its partial results to (0 if none).
pub fn partials_bytes(op: &Op, dims: &[u32; 16]) -> u64 {
    if dims[15] != 1 {
        return 0;
    }
    let floats = match op {
        Op::NormGainGrad { .. } | Op::SumRows => u64::from(dims[4]) * u64::from(dims[2]),
        Op::CrossEntropy { .. } => 2 * u64::from(dims[1]),
        Op::AttentionGrad { .. } => 3 * u64::from(dims[5]),
        _ if gemm::tiled(op) => return gemm::partials_bytes(dims),
        _ => return attention::partials_bytes(dims),
    };
    floats * 4
}

/// The sizes of `op` (an op of this module) over `rows` rows of `width` elements: its partial
/// form's (`dims[15]` = 1) unless `whole`. `None` for any other op.
pub(super) fn dims(op: &Op, rows: usize, width: usize, whole: bool) -> Option<Vec<usize>> {
    let lanes = WORKGROUP as usize;
    let mut d = match op {
        Op::NormGainGrad { .. } | Op::SumRows => {
            let blocks = width.div_ceil(lanes).max(1);
            let chunk = match whole {
                true => rows,
                false => rows.div_ceil(GAIN_GRAD_WORKGROUPS.div_ceil(blocks)).max(GAIN_GRAD_MIN_CHUNK),
            }
            .max(1);
            let chunks = rows.div_ceil(chunk).max(1);
            vec![blocks * chunks * lanes, rows, width, chunk, chunks, blocks]
        }
        Op::CrossEntropy { .. } => match whole {
            true => vec![lanes, rows, width],
            false => vec![rows.max(1) * lanes, rows, width],
        },
        _ => return None,
    };
    if !whole {
        d.resize(16, 0);
        d[15] = 1;
    }
    Some(d)
}

/// The second dispatch of the reductions to one value per column: a thread per column adds its
/// chunks' partial sums in chunk order.
const COMBINE_COLUMNS: &str = "let d = dim(2u);\nlet chunks = dim(4u);\nlet col = wg * 64u + lane;\nif (col < d) {\n    \
     var t = 0.0;\n    for (var c = 0u; c < chunks; c = c + 1u) { t = t + part[c * d + col]; }\n    out[col] = t;\n}";

/// The statements of the gain gradient's workgroup, up to `acc` (its lane's column's sum over the
/// workgroup's chunk of rows, `col` that column).
fn gain_grad_sums(rms: bool, eps: f32) -> String {
    let mean = match rms {
        true => "    let mean = 0.0;\n".to_string(),
        false => "    var s = 0.0;\n    for (var j = lane; j < d; j = j + 64u) { s = s + in0[base + j]; }\n    \
                  let mean = row_sum(lane, s) / f32(d);\n"
            .to_string(),
    };
    format!(
        "let rows = dim(1u);\nlet d = dim(2u);\nlet chunk = dim(3u);\nlet blocks = dim(5u);\n\
         let first = (wg / blocks) * chunk;\nlet last = min(first + chunk, rows);\nlet col = (wg % blocks) * 64u + lane;\n\
         var acc = 0.0;\nfor (var r = first; r < last; r = r + 1u) {{\n    let base = r * d;\n{mean}    \
         var q = 0.0;\n    for (var j = lane; j < d; j = j + 64u) {{ let c = in0[base + j] - mean; q = q + c * c; }}\n    \
         let rs = 1.0 / sqrt(row_sum(lane, q) / f32(d) + {eps:?});\n    \
         if (col < d) {{ acc = acc + in1[base + col] * (in0[base + col] - mean) * rs; }}\n}}\n"
    )
}

/// The statements of a sum over rows' workgroup (the gain gradient's layout), up to `acc` (its
/// lane's column's sum over the workgroup's chunk of rows, in row order; `col` that column).
fn row_sums() -> &'static str {
    "let rows = dim(1u);\nlet d = dim(2u);\nlet chunk = dim(3u);\nlet blocks = dim(5u);\n\
     let first = (wg / blocks) * chunk;\nlet last = min(first + chunk, rows);\nlet col = (wg % blocks) * 64u + lane;\n\
     var acc = 0.0;\nif (col < d) {\n    for (var r = first; r < last; r = r + 1u) { acc = acc + in0[r * d + col]; }\n}\n"
}

/// The cross-entropy of row `r` (`base` its first logit) in the lanes of a workgroup: `loss` and
/// `counts`.
fn cross_entropy_row(smoothing: f32, ignore_index: i64, indent: &str) -> String {
    let (keep, eps) = smoothing_literals(smoothing);
    [
        "var mx = -3.40282347e38;".to_string(),
        "for (var j = lane; j < v; j = j + 64u) { mx = max(mx, in0[base + j]); }".into(),
        "mx = row_max(lane, mx);".into(),
        "var se = 0.0;".into(),
        "var sx = 0.0;".into(),
        "for (var j = lane; j < v; j = j + 64u) { let x = in0[base + j]; se = se + exp(x - mx); sx = sx + x; }".into(),
        "let lse = mx + log(row_sum(lane, se));".into(),
        "let mean = row_sum(lane, sx) / f32(v);".into(),
        "let label = in1[r];".into(),
        format!("let counts = {};", counted_label("label", ignore_index)),
        format!(
            "var loss = 0.0;\n{indent}if (counts) {{ loss = lse - {keep} * in0[base + u32(label)] - {eps} * mean; }}"
        ),
    ]
    .iter()
    .map(|l| format!("{indent}{l}\n"))
    .collect()
}

/// The single-dispatch body of `op` (an op of this module; `None` for another), as a chunked
/// step runs it: the gain gradient's workgroups each take every row (`dims[3]` = rows); the
/// cross-entropy's one workgroup walks the rows, adding the counted rows' losses.
pub(super) fn whole_body(op: &Op) -> Option<String> {
    Some(match op {
        Op::NormGainGrad { rms, eps } => format!("{}if (col < d) {{ out[col] = acc; }}", gain_grad_sums(*rms, eps.0)),
        Op::SumRows => format!("{}if (col < d) {{ out[col] = acc; }}", row_sums()),
        Op::CrossEntropy { smoothing, ignore_index } => format!(
            "let rows = dim(1u);\nlet v = dim(2u);\nvar total = 0.0;\nvar counted = 0.0;\n\
             for (var r = 0u; r < rows; r = r + 1u) {{\n    let base = r * v;\n{}    \
             total = total + loss;\n    counted = counted + select(0.0, 1.0, counts);\n}}\n\
             if (lane == 0u) {{ out[0] = total / counted; }}",
            cross_entropy_row(smoothing.0, *ignore_index, "    ")
        ),
        _ => return None,
    })
}

/// The two-dispatch body of `op` (an op of this module; `None` for another; `operands` its
/// operand count): the partial results where `dims[15]` is 1, their combination where it is 2 (a
/// condition uniform over the dispatch, so the reductions inside stay in uniform control flow).
pub(super) fn partial_body(op: &Op, operands: usize) -> Option<String> {
    if gemm::tiled(op) {
        return Some(gemm::body(op, true));
    }
    let (first, combine) = match op {
        Op::AttentionGrad { scale, alibi, causal, window, mods } => {
            let stage = |stage| attention_grad(*scale, *alibi, *causal, *window, mods, operands, stage);
            (stage(AttentionGradStage::Rows), stage(AttentionGradStage::Gradients))
        }
        Op::NormGainGrad { rms, eps } => (
            format!("{}if (col < d) {{ part[(wg / blocks) * d + col] = acc; }}", gain_grad_sums(*rms, eps.0)),
            COMBINE_COLUMNS.to_string(),
        ),
        Op::SumRows => (
            format!("{}if (col < d) {{ part[(wg / blocks) * d + col] = acc; }}", row_sums()),
            COMBINE_COLUMNS.to_string(),
        ),
        Op::CrossEntropy { smoothing, ignore_index } => (
            format!(
                "let rows = dim(1u);\nlet v = dim(2u);\nlet r = wg;\nlet base = r * v;\n{}\
                 if (lane == 0u) {{ part[r] = loss; part[rows + r] = select(0.0, 1.0, counts); }}",
                cross_entropy_row(smoothing.0, *ignore_index, "")
            ),
            "let rows = dim(1u);\nvar t = 0.0;\nvar c = 0.0;\n\
             for (var r = lane; r < rows; r = r + 64u) { t = t + part[r]; c = c + part[rows + r]; }\n\
             let total = row_sum(lane, t);\nlet counted = row_sum(lane, c);\n\
             if (lane == 0u) { out[0] = total / counted; }"
                .to_string(),
        ),
        _ => return None,
    };
    Some(format!("if (dim(15u) == 2u) {{\n{}}} else {{\n{}}}", indent(&combine), indent(&first)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Scalar;

    /// A gain gradient's partial form splits its rows into chunks that fill a GPU, each a
    /// workgroup per 64 columns; its whole form (a chunked step's) one chunk of every row.
    #[test]
    fn gain_gradient_sizes() {
        let op = Op::NormGainGrad { rms: false, eps: Scalar(1e-5) };
        let dims = |rows, d, whole| {
            let mut u = [0u32; 16];
            for (s, v) in u.iter_mut().zip(super::dims(&op, rows, d, whole).unwrap()) {
                *s = v as u32;
            }
            u
        };
        // GPT-2 small's step: 512 rows of 768, 12 blocks of columns, chunks of 12 rows.
        let d = dims(512, 768, false);
        assert_eq!(&d[..6], &[12 * 43 * 64, 512, 768, 12, 43, 12]);
        assert_eq!(combine_dims(&op, &d).unwrap()[0], 12 * 64);
        assert_eq!(partials_bytes(&op, &d), 43 * 768 * 4);
        // Few rows: at least 8 a chunk.
        assert_eq!(&dims(20, 67, false)[..6], &[2 * 3 * 64, 20, 67, 8, 3, 2]);
        // Whole: no partials, no second dispatch.
        let w = dims(512, 768, true);
        assert_eq!((&w[..6], w[15]), (&[12 * 64, 512, 768, 512, 1, 12][..], 0));
        assert_eq!((combine_dims(&op, &w), partials_bytes(&op, &w)), (None, 0));
        // No rows: one chunk, which writes zeros.
        assert_eq!(&dims(0, 64, false)[..6], &[64, 0, 64, 8, 1, 1]);
    }

    /// Attention's backward: a workgroup per query row writes its three statistics, then a
    /// workgroup per query row and one per key row; chunked, one dispatch of a thread per output
    /// row (three per query row).
    #[test]
    fn attention_gradient_sizes() {
        use crate::graph::ScoreMods;
        let op = Op::AttentionGrad {
            scale: Scalar(0.125),
            alibi: false,
            causal: true,
            window: None,
            mods: ScoreMods::default(),
        };
        let (q, k) = (vec![2, 4, 9, 8], vec![2, 2, 9, 8]);
        let out = [3, 2, 4, 9, 8];
        let dims = super::super::dims::dispatch(
            &op,
            &[q.clone(), k.clone(), k.clone(), q.clone()],
            &out,
            0,
            &Options::default(),
        )
        .unwrap();
        assert_eq!((&dims[..6], dims[15]), (&[72 * 64, 4, 9, 8, 2, 72][..], 1));
        assert_eq!(combine_dims(&op, &dims).unwrap()[0], 2 * 72 * 64);
        assert_eq!(partials_bytes(&op, &dims), 3 * 72 * 4);
        let chunked = super::super::dims::dispatch_chunked(&op, &[q.clone(), k.clone(), k, q], &out, 0).unwrap();
        assert_eq!((&chunked[..6], chunked[15]), (&[3 * 72, 4, 9, 8, 2, 72][..], 0));
        assert_eq!((combine_dims(&op, &chunked), partials_bytes(&op, &chunked)), (None, 0));
    }
}
