//! Native kernels for the cheap ops that run between projections: norms (and the fused residual
//! add + norm), residual adds, activations, scaling, embedding gathers, an encoder's mean pool
//! and the cached decoder's head split. Each computes what the interpreter computes for the op,
//! with the same arithmetic (norm and pool sums accumulated in f64), rows split over the pool's
//! threads when there are enough of them to pay for it.

use super::cache::CacheBuf;
use super::math::{layer_norm_row, rms_norm_row};
use super::{Arg, CpuError, LazyOut, Positions, R};
use kiln_compiler::graph::Op;
use kiln_compiler::semantics::{rope_frequencies, rotate};
use rayon::prelude::*;

/// Rows handed to one task at least (a decode step's few rows stay on one thread).
const MIN_ROWS: usize = 16;

/// Elements handed to one task at least by the kernels that copy or combine whole tensors.
const MIN_ELEMENTS: usize = 1 << 13;

/// Runs `op` natively if this module has a kernel for it (and its operands are in the form the
/// kernel takes), writing the result into `out`; `Ok(false)` leaves it to the interpreter.
pub fn forward(
    op: &Op,
    args: &[(Vec<usize>, Arg<'_>)],
    out: &mut LazyOut<'_>,
    shape: &[usize],
    positions: Positions<'_>,
) -> R<bool> {
    let f = |i: usize| -> R<&[f32]> {
        args.get(i).ok_or_else(|| CpuError::Operands(format!("operand {i} is missing")))?.1.f32("an operand")
    };
    let width = shape.last().copied().unwrap_or(1).max(1);
    match op {
        Op::RmsNorm { eps } => {
            let (x, gain) = (f(0)?, f(1)?);
            rows(out.get(), width, |r, o| {
                o.copy_from_slice(&x[r * width..][..width]);
                rms_norm_row(o, gain, eps.0);
            });
        }
        Op::LayerNorm { eps } => {
            let (x, gain) = (f(0)?, f(1)?);
            let bias = if args.len() > 2 { Some(f(2)?) } else { None };
            rows(out.get(), width, |r, o| {
                o.copy_from_slice(&x[r * width..][..width]);
                layer_norm_row(o, gain, bias, eps.0);
            });
        }
        Op::AddNorm { rms, eps, after } => {
            let (x, y, gain) = (f(0)?, f(1)?, f(2)?);
            if x.len() != y.len() {
                return Ok(false);
            }
            let bias = if args.len() > 3 { Some(f(3)?) } else { None };
            let norm = |o: &mut [f32]| match rms {
                true => rms_norm_row(o, gain, eps.0),
                false => layer_norm_row(o, gain, bias, eps.0),
            };
            rows(out.get(), width, |r, o| {
                let (a, b) = (&x[r * width..][..width], &y[r * width..][..width]);
                if *after {
                    // a + norm(b): the norm of b in the output row, then a added.
                    o.copy_from_slice(b);
                    norm(o);
                    for (o, &a) in o.iter_mut().zip(a) {
                        *o += a;
                    }
                } else {
                    for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                        *o = a + b;
                    }
                    norm(o);
                }
            });
        }
        Op::Add | Op::Mul => {
            let (x, y) = (f(0)?, f(1)?);
            let n = out_len(shape);
            // Same shapes, or the second operand one row broadcast over the first's rows (a
            // bias); other broadcasts are the interpreter's.
            let combine = |a: f32, b: f32| if matches!(op, Op::Add) { a + b } else { a * b };
            if x.len() == n && y.len() == n {
                rows(out.get(), width, |r, o| {
                    for ((o, &a), &b) in o.iter_mut().zip(&x[r * width..][..width]).zip(&y[r * width..][..width]) {
                        *o = combine(a, b);
                    }
                });
            } else if x.len() == n && y.len() == width && args[1].0.len() == 1 {
                rows(out.get(), width, |r, o| {
                    for ((o, &a), &b) in o.iter_mut().zip(&x[r * width..][..width]).zip(y) {
                        *o = combine(a, b);
                    }
                });
            } else if let Some((sx, sy)) = broadcast_strides(&args[0].0, &args[1].0, shape) {
                // Any other broadcast: each output row's start in either operand from the
                // strides (0 along a broadcast axis), the last axis read in place or repeated.
                let last = shape.len() - 1;
                let (inner_x, inner_y) = (sx[last] == 1, sy[last] == 1);
                rows(out.get(), width, |r, o| {
                    let (mut rem, mut bx, mut by) = (r, 0, 0);
                    for ax in (0..last).rev() {
                        let i = rem % shape[ax];
                        rem /= shape[ax];
                        bx += i * sx[ax];
                        by += i * sy[ax];
                    }
                    match (inner_x, inner_y) {
                        (true, true) => o
                            .iter_mut()
                            .zip(&x[bx..][..width])
                            .zip(&y[by..][..width])
                            .for_each(|((o, &a), &b)| *o = combine(a, b)),
                        (true, false) => {
                            let b = y[by];
                            o.iter_mut().zip(&x[bx..][..width]).for_each(|(o, &a)| *o = combine(a, b));
                        }
                        (false, true) => {
                            let a = x[bx];
                            o.iter_mut().zip(&y[by..][..width]).for_each(|(o, &b)| *o = combine(a, b));
                        }
                        (false, false) => o.fill(combine(x[bx], y[by])),
                    }
                });
            } else {
                return Ok(false);
            }
        }
        Op::Act(act) => {
            let x = f(0)?;
            rows(out.get(), width, |r, o| {
                o.copy_from_slice(&x[r * width..][..width]);
                super::math::apply(*act, o);
            });
        }
        Op::Scale { factor } => {
            let x = f(0)?;
            rows(out.get(), width, |r, o| {
                for (o, &a) in o.iter_mut().zip(&x[r * width..][..width]) {
                    *o = a * factor.0;
                }
            });
        }
        Op::Gather => {
            let Some((_, Arg::I64(ids))) = args.get(1) else { return Ok(false) };
            if let Some((_, Arg::Quant(q))) = args.first() {
                // A table kept as blocks: each looked-up row dequantized.
                let out = out.get();
                let mut rows = Vec::with_capacity(out.len());
                for &id in *ids {
                    let ok = usize::try_from(id).is_ok_and(|r| q.dequantize_row(r, &mut rows));
                    if !ok {
                        return Err(CpuError::Operands(format!("id {id} is outside the table's {} rows", q.rows)));
                    }
                }
                if rows.len() != out.len() {
                    return Err(CpuError::Operands(format!(
                        "{} rows of {} gathered for {}",
                        ids.len(),
                        q.k,
                        out.len()
                    )));
                }
                out.copy_from_slice(&rows);
                return Ok(true);
            }
            let table = f(0)?;
            // Ids were range-checked when the inputs were bound (`prepare::check_indices`);
            // positions are made in range. A bad id is still an error here, not a wild read.
            let rows_in_table = table.len() / width;
            let out = out.get();
            // Over the pool: a prompt's rows are megabytes (MiniLM's 32 x 128 tokens, 6 MB a
            // table), copied row by row from wherever the ids point.
            out.par_chunks_mut(width).zip(ids.par_iter()).with_min_len(MIN_ROWS).try_for_each(|(o, &id)| {
                let row = usize::try_from(id).ok().filter(|&r| r < rows_in_table).ok_or_else(|| {
                    CpuError::Operands(format!("id {id} is outside the table's {rows_in_table} rows"))
                })?;
                o.copy_from_slice(&table[row * width..][..width]);
                Ok::<(), CpuError>(())
            })?;
        }
        Op::GatherColumns { splits } => {
            // The table `[width, cols]` stored transposed, in pieces: each id a column of one.
            let Some(((_, Arg::I64(ids)), pieces)) = args.split_last() else { return Ok(false) };
            let mut tables = Vec::with_capacity(pieces.len());
            for ((shape, piece), &rows) in pieces.iter().zip(splits) {
                let (Arg::F32(t), &[d, cols]) = (piece, shape.as_slice()) else { return Ok(false) };
                if d != width || t.len() != d * cols || rows > cols {
                    return Ok(false);
                }
                tables.push((*t, cols, rows));
            }
            if tables.len() != splits.len() {
                return Ok(false);
            }
            let total: usize = splits.iter().sum();
            for (o, &id) in out.get().chunks_mut(width).zip(*ids) {
                let mut col = usize::try_from(id)
                    .ok()
                    .filter(|&c| c < total)
                    .ok_or_else(|| CpuError::Operands(format!("id {id} is outside the table's {total} rows")))?;
                let mut piece = tables.iter();
                let (table, cols) = loop {
                    match piece.next() {
                        Some(&(t, cols, rows)) if col < rows => break (t, cols),
                        Some(&(_, _, rows)) => col -= rows,
                        None => return Err(CpuError::Internal("a column gather's pieces miss a row".into())),
                    }
                };
                for (j, o) in o.iter_mut().enumerate() {
                    *o = table[j * cols + col];
                }
            }
        }
        Op::MeanPool => {
            // out[b, j] = sum_t m[b, t] x[b, t, j] / max(sum_t m[b, t], 1e-9): the mean of the
            // tokens the mask keeps, the sums in f64 in token order as the interpreter's (every
            // token's term added, a masked one's too: a NaN there is the interpreter's NaN).
            let (x, mask) = (f(0)?, f(1)?);
            let &[b, s, d] = args[0].0.as_slice() else { return Ok(false) };
            if x.len() != b * s * d || mask.len() != b * s || out_len(shape) != b * d || d == 0 {
                return Ok(false);
            }
            rows(out.get(), d, |r, o| {
                let mut acc = vec![0.0f64; d];
                let mut count = 0.0f64;
                for (&m, row) in mask[r * s..][..s].iter().zip(x[r * s * d..][..s * d].chunks_exact(d)) {
                    let w = f64::from(m);
                    count += w;
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += w * f64::from(v);
                    }
                }
                let count = count.max(1e-9);
                for (o, a) in o.iter_mut().zip(acc) {
                    *o = (a / count) as f32;
                }
            });
        }
        Op::Permute { perm } => {
            // out[i0, .., ir] = x[at the permuted indices]: a row of the output's last axis per
            // task, read through the input's strides.
            let [(in_shape, Arg::F32(x))] = args else { return Ok(false) };
            let r = in_shape.len();
            let valid = r > 0 && perm.len() == r && shape.len() == r && perm.iter().all(|&p| p < r);
            if !valid || x.len() != in_shape.iter().product::<usize>() {
                return Ok(false);
            }
            let mut strides = vec![1usize; r];
            for i in (0..r - 1).rev() {
                strides[i] = strides[i + 1] * in_shape[i + 1];
            }
            let step: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
            let last = shape[r - 1];
            let out = out.get();
            if last == 0 || out.is_empty() {
                return Ok(true);
            }
            let swaps_last_two =
                r >= 2 && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p) && perm[r - 2] == r - 1;
            if swaps_last_two && in_shape[r - 1] > 1 && in_shape[r - 2] > 1 {
                // A stack of matrix transposes, in square tiles: each tile's reads and writes stay
                // within a few cache lines (a row at a time would read each input line once per
                // element of it).
                let (m, n) = (in_shape[r - 2], in_shape[r - 1]);
                transpose_tiles(x, out, m, n);
                return Ok(true);
            }
            let rows_per_task = (MIN_ELEMENTS / last).max(MIN_ROWS);
            out.par_chunks_mut(last).with_min_len(rows_per_task).enumerate().for_each(|(row, o)| {
                let (mut rem, mut base) = (row, 0);
                for ax in (0..r - 1).rev() {
                    base += rem % shape[ax] * step[ax];
                    rem /= shape[ax];
                }
                match step[r - 1] {
                    1 => o.copy_from_slice(&x[base..][..last]),
                    s => o.iter_mut().enumerate().for_each(|(j, v)| *v = x[base + j * s]),
                }
            });
        }
        Op::Rope { theta, rotary_dim, style } => {
            // x [b, h, s, d]: row r at position r % s after its sequence's cached ones.
            let x = f(0)?;
            let Some(&s) = args.first().and_then(|(shape, _)| shape.get(2)) else { return Ok(false) };
            let per_sequence = s * args.first().and_then(|(shape, _)| shape.get(1)).copied().unwrap_or(1);
            if *rotary_dim > width || x.len() != out_len(shape) || s == 0 {
                return Ok(false);
            }
            let inv = rope_frequencies(theta.0, *rotary_dim);
            rows(out.get(), width, |r, o| {
                o.copy_from_slice(&x[r * width..][..width]);
                rotate(&mut o[..*rotary_dim], positions.at(r / per_sequence, r % s) as f32, &inv, *style);
            });
        }
        Op::Heads { start, heads, head_dim, norm, rope } => {
            // ([past [b, h, p, d],] x [b, s, width][, gain [d]]) -> [b, h, p + s, d].
            let (args, gain) = match (norm, args.split_last()) {
                (Some(eps), Some(((_, g), rest))) => (rest, Some((eps.0, g.f32("the gain")?))),
                _ => (args, None),
            };
            let (x_shape, x) = match args {
                [(s, x)] | [_, (s, x)] => (s, x.f32("x")?),
                _ => return Ok(false),
            };
            let cache = if args.len() == 2 { Some(f(0)?) } else { None };
            let (b, s, xw) = match x_shape.as_slice() {
                &[b, s, w] => (b, s, w),
                _ => return Ok(false),
            };
            let (h, d) = (*heads, *head_dim);
            let total = shape.get(2).copied().unwrap_or(0);
            let p = total.saturating_sub(s);
            let inv = rope.map(|r| (rope_frequencies(r.theta.0, r.rotary_dim), r));
            let out = out.get();
            for bi in 0..b {
                for hi in 0..h {
                    let dst = &mut out[(bi * h + hi) * total * d..][..total * d];
                    if let Some(cache) = cache {
                        dst[..p * d].copy_from_slice(&cache[(bi * h + hi) * p * d..][..p * d]);
                    }
                    for t in 0..s {
                        let row = &x[(bi * s + t) * xw + start + hi * d..][..d];
                        let o = &mut dst[(p + t) * d..][..d];
                        o.copy_from_slice(row);
                        if let Some((eps, gain)) = gain {
                            rms_norm_row(o, gain, eps);
                        }
                        if let Some((inv, r)) = &inv {
                            rotate(&mut o[..r.rotary_dim], positions.at(bi, t) as f32, inv, r.style);
                        }
                    }
                }
            }
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// Side of the square tiles [`transpose_tiles`] moves.
const TILE: usize = 32;

/// `out [.., n, m]` = `x [.., m, n]` with each matrix transposed, in [`TILE`]-square tiles; the
/// matrices and the tiles' rows of the output split over the pool.
pub(super) fn transpose_tiles(x: &[f32], out: &mut [f32], m: usize, n: usize) {
    let matrix = m * n;
    // One task: a band of TILE output rows (input columns) of one matrix.
    let bands = n.div_ceil(TILE);
    let min_bands = (MIN_ELEMENTS / (TILE * m).max(1)).max(1);
    let mut pieces: Vec<(usize, &mut [f32])> = Vec::with_capacity(out.len() / matrix.max(1) * bands);
    for (b, o) in out.chunks_mut(matrix).enumerate() {
        for (t, band) in o.chunks_mut(TILE * m).enumerate() {
            pieces.push((b * bands + t, band));
        }
    }
    pieces.into_par_iter().with_min_len(min_bands).for_each(|(piece, band)| {
        let (b, t) = (piece / bands, piece % bands);
        let src = &x[b * matrix..][..matrix];
        let c0 = t * TILE;
        let cols = band.len() / m;
        for r0 in (0..m).step_by(TILE) {
            let rows = TILE.min(m - r0);
            for c in 0..cols {
                let o = &mut band[c * m + r0..][..rows];
                for (i, v) in o.iter_mut().enumerate() {
                    *v = src[(r0 + i) * n + c0 + c];
                }
            }
        }
    });
}

/// The strides by which the two operands of a broadcasting binary op (numpy's rules: shapes
/// aligned at their last axes, an axis of 1 repeated) are read along each axis of the output
/// `shape`: 0 along a broadcast axis. `None` where the shapes do not broadcast to `shape`.
fn broadcast_strides(a: &[usize], b: &[usize], shape: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    let strides = |s: &[usize]| -> Option<Vec<usize>> {
        let lead = shape.len().checked_sub(s.len())?;
        let mut out = vec![0; shape.len()];
        let mut stride = 1;
        for (ax, &d) in s.iter().enumerate().rev() {
            let full = shape[lead + ax];
            if d == full {
                out[lead + ax] = if d == 1 { 0 } else { stride };
            } else if d != 1 {
                return None;
            }
            stride *= d;
        }
        Some(out)
    };
    if shape.is_empty() {
        return None;
    }
    Some((strides(a)?, strides(b)?))
}

fn out_len(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Runs `f(row index, output row)` over the rows of `out`, in parallel when there are many.
fn rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    out.par_chunks_mut(width).with_min_len(MIN_ROWS).enumerate().for_each(|(r, o)| f(r, o));
}

/// A `heads` step appending in place: the `s` rows per head it computes from `x` (`[b, s,
/// width]`) written into `buf` after the rows it holds, normalized with `gain` when the step has
/// a norm and rotated at positions `past + t` as the interpreter rotates them. Returns the rows per head `buf` holds once the run succeeds
/// (it commits them; until then the new rows are invisible).
pub fn append_heads(
    op: &Op,
    x_shape: &[usize],
    x: &[f32],
    gain: Option<&[f32]>,
    past: usize,
    buf: &mut CacheBuf,
) -> R<usize> {
    let bad = |m: String| CpuError::Operands(m);
    let Op::Heads { start, heads, head_dim: d, norm, rope } = *op else { return Err(bad("not a heads step".into())) };
    let norm = match (norm, gain) {
        (Some(eps), Some(g)) if g.len() == d => Some((eps.0, g)),
        (None, None) => None,
        _ => return Err(bad(format!("a heads step's norm needs one gain of {d}"))),
    };
    let &[b, s, width] = x_shape else { return Err(bad(format!("x {x_shape:?} is not [b, s, width]"))) };
    if buf.shape() != [b, heads, buf.len(), d] || start + heads * d > width || x.len() != b * s * width {
        return Err(bad(format!("x {x_shape:?} does not fit the cache {:?}", buf.shape())));
    }
    // A sliding window's cache holds only the latest rows (fewer than the position).
    let held = buf.len();
    if held > past {
        return Err(bad(format!("the cache holds {held} rows, the step starts at position {past}")));
    }
    buf.reserve(held + s)?;
    let inv = rope.map(|r| (rope_frequencies(r.theta.0, r.rotary_dim), r));
    for bi in 0..b {
        for hi in 0..heads {
            for t in 0..s {
                let from = (bi * s + t) * width + start + hi * d;
                let o = buf.row_mut(bi, hi, held + t);
                o.copy_from_slice(&x[from..from + d]);
                if let Some((eps, gain)) = norm {
                    rms_norm_row(o, gain, eps);
                }
                if let Some((inv, r)) = &inv {
                    rotate(&mut o[..r.rotary_dim], (past + t) as f32, inv, r.style);
                }
            }
        }
    }
    Ok(held + s)
}
