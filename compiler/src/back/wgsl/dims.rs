//! The sizes of a dispatch: the `Dims` uniform every kernel reads (see [`super::kernel`]) and the
//! workgroup grid, computed at run time from the step's concrete shapes.

#![expect(
    clippy::indexing_slicing,
    reason = "`strides` indexes within the shape it was given; everything read from a step goes \
              through the checked `operand` and `axis` accessors"
)]

use super::attention;
use super::emit::WORKGROUP;
use super::{Options, projection};
use crate::graph::{Op, PackedAttention};

/// Row-major strides.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * shape[i + 1];
    }
    st
}

/// The `Dims` uniform of a step (16 `u32`s, `[0]` = threads) for concrete operand and output shapes
/// and `past` cached tokens (where positions start), for the kernel compiled with `options` (the
/// program's, [`super::Program::options`]: a projection's forms depend on them). Errors if a size
/// does not fit the kernels' 32-bit indexing.
pub fn dispatch(
    op: &Op,
    operands: &[Vec<usize>],
    out: &[usize],
    past: usize,
    options: &Options,
) -> Result<[u32; 16], String> {
    dims_of(op, operands, out, past, Some(options))
}

/// [`dispatch`] for the step's chunked kernel variant ([`super::kernel_chunked`]), which runs a
/// projection in its scalar forms only and attention one query row per invocation.
pub fn dispatch_chunked(op: &Op, operands: &[Vec<usize>], out: &[usize], past: usize) -> Result<[u32; 16], String> {
    dims_of(op, operands, out, past, None)
}

// A plan read from a file holds any op on any operands (`Plan::check` bounds indices, not
// typing), so this reads operands and axes with `operand` and `axis`: an ill-typed step is an
// error, not a panic. `options` is `None` for the chunked variant.
fn dims_of(
    op: &Op,
    operands: &[Vec<usize>],
    out: &[usize],
    past: usize,
    options: Option<&Options>,
) -> Result<[u32; 16], String> {
    let chunked = options.is_none();
    // Whether a tiled product may split its contraction (never in a chunked kernel).
    let split = options.is_some_and(|o| o.split_contractions);
    let total: usize = out.iter().product();
    let last = |s: &[usize]| s.last().copied().unwrap_or(1);
    let rows = |s: &[usize]| s.iter().product::<usize>() / last(s).max(1);
    let operand = |i: usize| -> Result<&[usize], String> {
        operands.get(i).map(Vec::as_slice).ok_or_else(|| format!("{} has no operand {i}", op.name()))
    };
    let axis = |s: &[usize], i: usize| -> Result<usize, String> {
        s.get(i).copied().ok_or_else(|| format!("{}: shape {s:?} has no axis {i}", op.name()))
    };
    // Axis `i` counted from the end (1: the last).
    let from_end = |s: &[usize], i: usize| match s.len().checked_sub(i) {
        Some(j) => axis(s, j),
        None => Err(format!("{}: shape {s:?} has fewer than {i} axes", op.name())),
    };
    let mut d: Vec<usize> = match op {
        // One thread per output element: [total, n, inner], `n` the summed axis's extent and
        // `inner` the elements after it.
        Op::SumAxis { axis: a } => {
            let x = operand(0)?;
            vec![total, axis(x, *a)?, x.iter().skip(a + 1).product()]
        }
        Op::ActGrad(_) | Op::Rsqrt => vec![total],
        // A workgroup per row (`emit::cooperative`): [rows * 64, d].
        Op::NormGrad { .. } | Op::SoftmaxGrad => vec![rows(out) * WORKGROUP as usize, last(out)],
        // Reductions over rows in two dispatches, or one where chunked (`partials`).
        Op::NormGainGrad { .. } | Op::SumRows | Op::CrossEntropy { .. } => {
            let x = operand(0)?;
            super::partials::dims(op, rows(x), last(x), chunked).unwrap_or_default()
        }
        // A workgroup per block of the output and slice of the rows (`gemm`): [lanes, k, n,
        // rows, 0, tile, slice_k, 1, slices], `dims[15]` = 1 where the rows are split.
        Op::ContractRows => {
            let a = operand(0)?;
            let l = super::gemm::launch(1, last(a), last(out), rows(a), split);
            product_dims(vec![l.lanes, last(a), last(out), rows(a), 0], l, 1)
        }
        // A workgroup per table row (`emit::cooperative`): [rows * 64, d, ids].
        Op::GatherGrad => vec![rows(out) * WORKGROUP as usize, last(out), operand(1)?.iter().product()],
        // A workgroup per row (`emit::cooperative`): [rows * 64, rows, vocab].
        Op::CrossEntropyGrad { .. } => vec![rows(out) * WORKGROUP as usize, rows(out), last(out)],
        // One thread per table element: [total, heads, q, k, planes] from dy [.., heads, q, k].
        Op::RelativeBiasGrad { .. } => {
            let dy = operand(1)?;
            let (q, k) = (from_end(dy, 2)?, from_end(dy, 1)?);
            vec![total, from_end(dy, 3)?, q, k, dy.iter().product::<usize>() / (q * k).max(1)]
        }
        // One thread per output element: [total, elements of dy].
        Op::TruncateGrad => {
            let dy: usize = operand(1)?.iter().product();
            if dy > total {
                return Err(format!("{}: more rows of dy than the matrix has", op.name()));
            }
            vec![total, dy]
        }
        Op::TopKGrad { .. } => vec![rows(out), last(out)],
        Op::Positions { .. } => vec![total, past],
        Op::Sinusoid { .. } | Op::Scale { .. } | Op::Offset { .. } | Op::SoftCap { .. } | Op::Act(_) => vec![total],
        Op::Truncate { .. } => {
            if total > operand(0)?.iter().product() {
                return Err(format!(
                    "{}: more rows asked than the matrix has (a sequence longer than its table)",
                    op.name()
                ));
            }
            vec![total]
        }
        Op::Gather => vec![total, last(out)],
        Op::GatherColumns { splits } => {
            let mut d = vec![total, last(out)];
            for p in 0..splits.len() {
                d.push(last(operand(p)?));
            }
            d
        }
        Op::MatMul { transpose_b } | Op::MatMulActGrad { transpose_b, .. } => {
            let (a, b) = (operand(0)?, operand(1)?);
            let (m, k) = (from_end(a, 2)?, from_end(a, 1)?);
            let n = if *transpose_b { from_end(b, 2)? } else { from_end(b, 1)? };
            // A workgroup per block of each batch's output and slice of `k` (`gemm`): [lanes, m,
            // n, k, b batched, tile, slice_k, batches, slices], `dims[15]` = 1 where `k` is split.
            let batches = total / (m * n).max(1);
            let l = super::gemm::launch(batches, m, n, k, split);
            product_dims(vec![l.lanes, m, n, k, usize::from(b.len() > 2)], l, batches)
        }
        Op::Add | Op::Mul => {
            // Right-align both operands to the output's rank (at most 4), broadcast axes stride 0.
            let pad = |s: &[usize]| -> Vec<usize> {
                let mut v = vec![1; 4 - s.len().min(4)];
                v.extend_from_slice(s);
                v
            };
            let o = pad(out);
            let bstrides = |s: &[usize]| -> Vec<usize> {
                let p = pad(s);
                let st = strides(&p);
                p.iter().zip(st).map(|(&n, st)| if n == 1 { 0 } else { st }).collect()
            };
            let mut v = vec![total];
            v.extend(&o);
            v.extend(bstrides(operand(0)?));
            v.extend(bstrides(operand(1)?));
            v
        }
        // A workgroup per row (`emit::cooperative`).
        Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Softmax => vec![rows(out) * WORKGROUP as usize, last(out)],
        Op::TopK { .. } | Op::L2Normalize => vec![rows(out), last(out)],
        // A workgroup per tile of each matrix (`emit::transposes`): [workgroups * 64, m, n, tiles
        // down, tiles across], `m x n` the input's matrices.
        Op::Permute { .. } if super::emit::transposes(op) => {
            let x = operand(0)?;
            let (m, n) = (axis(x, x.len().wrapping_sub(2))?, last(x));
            let side = super::emit::TRANSPOSE_TILE;
            let (tm, tn) = (m.div_ceil(side), n.div_ceil(side));
            let matrices = x.iter().product::<usize>() / (m * n).max(1);
            vec![matrices * tm * tn * WORKGROUP as usize, m, n, tm, tn]
        }
        Op::Permute { perm } => {
            let st = strides(operand(0)?);
            let mut o = vec![1; 4usize.saturating_sub(out.len())];
            o.extend_from_slice(out);
            let mut s = vec![0; 4usize.saturating_sub(out.len())];
            for &p in perm {
                s.push(axis(&st, p)?);
            }
            let mut v = vec![total];
            v.extend(o);
            v.extend(s);
            v
        }
        Op::Rope { .. } => vec![total, axis(out, 2)?, axis(out, 3)?, past],
        Op::RepeatHeads { times } => vec![total, axis(operand(0)?, 1)?, *times, axis(out, 2)? * axis(out, 3)?],
        Op::BlockSparseMask { block, .. } => {
            let blocks = axis(out, 2)?.max(axis(out, 3)?).div_ceil((*block).max(1));
            if blocks > 65_536 {
                return Err(format!("{}: {blocks} blocks, more than the kernel's 65536", op.name()));
            }
            vec![total, axis(out, 1)?, axis(out, 2)?, axis(out, 3)?]
        }
        Op::Alibi | Op::Mask { .. } | Op::RelativeBias { .. } => {
            vec![total, axis(out, 1)?, axis(out, 2)?, axis(out, 3)?]
        }
        Op::Slice { axis: a, start, len } => {
            let x = operand(0)?;
            let inner: usize = x.iter().skip(a + 1).product();
            vec![total, axis(x, *a)?, inner, *start, *len]
        }
        // The slice kernel, from the axis' last index.
        Op::Last { axis: a } => {
            let x = operand(0)?;
            let inner: usize = x.iter().skip(a + 1).product();
            let n = axis(x, *a)?;
            vec![total, n, inner, n.saturating_sub(1), 1]
        }
        Op::MeanPool => {
            let x = operand(0)?;
            vec![axis(out, 0)? * axis(out, 1)?, axis(x, 1)?, axis(x, 2)?]
        }
        // Tiles of outputs per invocation, whole workgroups: see `projection::dims`.
        Op::Linear { .. } if chunked => projection::scalar_dims(op, operands, out, past),
        Op::Linear { .. } => projection::dims(op, operands, out, past, options.unwrap_or(&Options::default())),
        // Chunked: one thread per query row, [b * s * h, h, s, s, d, kv, width] from qkv [b, s, width].
        Op::PackedAttention(PackedAttention { heads, kv_heads, head_dim, mods, cached, appends, .. }) => {
            let &[b, s, width] = operand(0)? else { return Err(format!("{}: qkv must be [b, s, width]", op.name())) };
            // Keys: the packed rows', or (cached) the key operand's `[b, kv, t, d]`, which
            // (appending) this step's rows follow.
            let t = if *cached { axis(operand(1)?, 2)? } else { s };
            let t = if *appends { t + s } else { t };
            let mut dims = if chunked {
                vec![b * s * heads, *heads, s, t, *head_dim, *kv_heads, width]
            } else {
                // Blocks of query rows and heads: see `attention::dims`.
                let g = attention::Geometry { heads: *heads, kv_heads: *kv_heads, head_dim: *head_dim };
                let below = options.map_or(0, |o| attention::workgroup_below(op, o));
                let split = options.and_then(|o| attention::split_keys(op, o));
                attention::dims(g, b, s, t, width, mods.sparse.is_some(), below, split)
            };
            if *appends {
                // The attention's threads, then one per element of each cache after the step
                // (see `append::append_copy`): [.., 9: attention threads, 10: cache elements].
                let n = b * kv_heads * t * head_dim;
                dims.resize(dims.len().max(11), 0);
                (dims[9], dims[10]) = (dims[0], n);
                dims[0] += 2 * n;
            }
            dims
        }
        // One thread per output element: [total, n, r, width] from x [b, n, width], e [rows, r].
        Op::LowRank { .. } => {
            let (x, e) = (operand(0)?, operand(1)?);
            if axis(x, 1)? > axis(e, 0)? {
                return Err(format!("{}: {} rows asked of a projection of {}", op.name(), axis(x, 1)?, axis(e, 0)?));
            }
            vec![total, axis(x, 1)?, axis(e, 1)?, axis(x, 2)?]
        }
        // One thread per output element: [threads, heads, p, s, d, width, past] with `p` tokens
        // from the cache operand (0 without one), `s` new ones from x [b, s, width].
        Op::Heads { norm, .. } => {
            let x = operand(operands.len().saturating_sub(1 + usize::from(norm.is_some())))?;
            let (s, width) = (axis(x, 1)?, axis(x, 2)?);
            let p =
                axis(out, 2)?.checked_sub(s).ok_or_else(|| format!("{}: more new rows than output rows", op.name()))?;
            // Normalized: a workgroup per head row (`emit::cooperative`).
            let threads = if norm.is_some() { rows(out) * WORKGROUP as usize } else { total };
            vec![threads, axis(out, 1)?, p, s, axis(out, 3)?, width, past]
        }
        Op::Concat { axis: a } => {
            let (x, y) = (operand(0)?, operand(1)?);
            let inner: usize = x.iter().skip(a + 1).product();
            vec![total, axis(x, *a)?, axis(y, *a)?, inner]
        }
        // A workgroup per row of scores [b, h, q, k] (`emit::cooperative`).
        Op::MaskedSoftmax { .. } => {
            vec![rows(out) * WORKGROUP as usize, axis(out, 1)?, axis(out, 2)?, axis(out, 3)?]
        }
        // Chunked: one thread per query row, [b * s * h, h, s, t, d, kv] from q [b, h, s, d], k [b, kv, t, d].
        Op::Attention { mods, .. } => {
            let (&[b, h, s, d], &[_, kv, t, ..]) = (operand(0)?, operand(1)?) else {
                return Err(format!("{}: q must be [b, h, s, d] and k [b, kv, t, d]", op.name()));
            };
            if chunked {
                vec![b * h * s, h, s, t, d, kv]
            } else {
                let g = attention::Geometry { heads: h, kv_heads: kv, head_dim: d };
                let below = options.map_or(0, |o| attention::workgroup_below(op, o));
                let split = options.and_then(|o| attention::split_keys(op, o));
                attention::dims(g, b, s, t, 0, mods.sparse.is_some(), below, split)
            }
        }
        // One thread per output row: [3 * b * h * s, h, s, d, kv, b * h * s] from q [b, h, s, d], k
        // [b, kv, s, d]; unchunked, a workgroup per query row first (its statistics into the
        // partials, `dims[15]` = 1), then per output row (`partials::combine_dims`).
        Op::AttentionGrad { .. } => {
            let (&[b, h, s, d], &[_, kv, ..]) = (operand(0)?, operand(1)?) else {
                return Err(format!("{}: q must be [b, h, s, d] and k [b, kv, s, d]", op.name()));
            };
            let rows = b * h * s;
            match chunked {
                true => vec![3 * rows, h, s, d, kv, rows],
                false => {
                    let mut v = vec![rows * WORKGROUP as usize, h, s, d, kv, rows];
                    v.resize(16, 0);
                    v[15] = 1;
                    v
                }
            }
        }
        Op::AddNorm { .. } => vec![rows(out) * WORKGROUP as usize, last(out)],
        Op::Input { .. } | Op::Param { .. } | Op::Reshape { .. } | Op::After => vec![0],
        // The optimizer's steps bind one chunk of their tensors per dispatch (`super::optim`),
        // which the runtime sizes itself.
        Op::SquareSums | Op::ClipScale { .. } | Op::AdamW { .. } | Op::Sgd { .. } => {
            return Err(format!("`{}` is dispatched per chunk of its tensors (see `wgsl::optim`)", op.name()));
        }
    };
    if total == 0
        && let Some(threads) = d.first_mut()
    {
        *threads = 0;
    }
    if d.len() > 16 {
        return Err(format!("{} needs {} sizes, more than 16", op.name(), d.len()));
    }
    let mut u = [0u32; 16];
    for (slot, &v) in u.iter_mut().zip(&d) {
        *slot = u32::try_from(v).map_err(|_| format!("{}: size {v} does not fit 32-bit indexing", op.name()))?;
    }
    // Indices inside a kernel reach the operand and output sizes; they must fit in u32 too.
    for s in operands.iter().map(|s| s.iter().product::<usize>()).chain([total]) {
        u32::try_from(s)
            .map_err(|_| format!("{}: a tensor of {s} elements does not fit 32-bit indexing", op.name()))?;
    }
    Ok(u)
}

/// A tiled product's sizes (see `gemm::body`): `first` (`dims[..5]`), then its launch's `[tile,
/// slice_k, batches, slices]`, and `dims[15]` = 1 where its contraction is split.
fn product_dims(mut first: Vec<usize>, l: super::gemm::Launch, batches: usize) -> Vec<usize> {
    first.extend([l.tile, l.slice_k, batches, l.slices]);
    if l.slices > 1 {
        first.resize(16, 0);
        first[15] = 1;
    }
    first
}

/// Workgroup grid for `threads` threads: `(x, y)` with `x <= max_x`.
pub fn workgroups(threads: u32, max_x: u32) -> (u32, u32) {
    let groups = threads.div_ceil(WORKGROUP).max(1);
    if groups <= max_x { (groups, 1) } else { (max_x, groups.div_ceil(max_x)) }
}

/// Makes the sizes `dims` of a `heads` step that appends to a cache (`op`, reading `p` cached
/// rows) append in place: its output is then the cache, with room for `cap >= p + s` rows per
/// head, which holds the `p` rows already, so only the `s` new rows of each head are computed and
/// written there (`dims[7]`, 0 otherwise; see `emit.rs`).
pub fn heads_in_place(op: &Op, dims: &mut [u32; 16], cap: u32) -> Result<(), String> {
    let Op::Heads { norm, .. } = op else { return Err(format!("{} does not append to a cache", op.name())) };
    let [threads, heads, p, s, d, ..] = *dims;
    let per_row = if norm.is_some() { WORKGROUP } else { d };
    let rows = heads.checked_mul(p + s).and_then(|r| r.checked_mul(per_row)).filter(|&r| r > 0);
    let Some(batch) = rows.map(|r| threads / r) else { return Ok(()) };
    if cap < p + s {
        return Err(format!("a cache with room for {cap} rows cannot hold {}", p + s));
    }
    dims[0] = batch * heads * s * per_row;
    dims[7] = cap;
    Ok(())
}

/// Makes the sizes `dims` of a cached attention that appends to the caches (`op`,
/// [`Op::PackedAttention`] with `appends`) append in place: its two extra outputs are then the
/// caches, with room for `room` rows per head, which hold the rows before the step already, so
/// its copying threads write only the step's new rows (`dims[13]`, 0 otherwise; see
/// `append::append_copy`).
pub fn appends_in_place(op: &Op, dims: &mut [u32; 16], room: u32) -> Result<(), String> {
    let Op::PackedAttention(PackedAttention { appends: true, .. }) = op else {
        return Err(format!("{} does not append to a cache", op.name()));
    };
    let (s, k, d, kv, attention, n) = (dims[2], dims[3], dims[4], dims[5], dims[9], dims[10]);
    if room < k {
        return Err(format!("a cache with room for {room} rows cannot hold {k}"));
    }
    let Some(batch) = kv.checked_mul(k).and_then(|r| r.checked_mul(d)).filter(|&r| r > 0).map(|r| n / r) else {
        return Ok(());
    };
    let new = batch * kv * s.min(k) * d;
    dims[10] = new;
    dims[0] = attention + 2 * new;
    dims[13] = room;
    Ok(())
}
