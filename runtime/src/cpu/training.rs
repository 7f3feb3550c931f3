//! Native kernels for the ops a training step adds to a forward pass: batched matrix products
//! (activations times activations, and the products of a backward pass, with an activation's
//! gradient applied over the output where the optimizer fused it), a weight's gradient over
//! every row, sums over an axis (a gradient reduced over the axes its operand was broadcast
//! along) and over every row (a bias's gradient), activation derivatives, the loss and its
//! gradient; and the ops a training step keeps unfused, which inference runs inside fused kernels
//! (softmax and masks, whose probabilities the backward reads; slices, concatenations, offsets
//! and reciprocal square roots).
//! Each computes what the interpreter computes for the op (`tests/engines/fused_ops.rs` holds
//! them to it); an operand layout a kernel does not take is left to the interpreter.

use super::linear::{gemm_at_b, gemm_f32, gemm_rhs_strided};
use super::{Arg, CpuError, LazyOut, R};
use kiln_compiler::graph::Op;
use rayon::prelude::*;

/// Elements handed to one task at least by the elementwise kernels.
const MIN_ELEMENTS: usize = 1 << 14;

/// Elements of a product's output its activation-gradient epilogue stages at a time.
const EPILOGUE: usize = 256;

/// Columns of a sum handed to one task when the kept rows are too few to split the work.
const COLUMNS: usize = 256;

/// Runs `op` natively if this module has a kernel for it; `Ok(false)` leaves it to the
/// interpreter.
pub fn forward(op: &Op, args: &[(Vec<usize>, Arg<'_>)], out: &mut LazyOut<'_>, threads: usize) -> R<bool> {
    let operand = |i: usize| f32_operand(args, i);
    match op {
        Op::MatMul { transpose_b } => product(*transpose_b, args, out, threads),
        Op::MatMulActGrad { act, transpose_b } => {
            let (_, x) = operand(2)?;
            if !product(*transpose_b, args, out, threads)? {
                return Ok(false);
            }
            let y = out.get();
            if x.len() != y.len() {
                return Err(CpuError::Operands(format!("{} of {} outputs by x of {}", op.name(), y.len(), x.len())));
            }
            // The derivative over the product's output in place, each task's elements staged
            // through a buffer of `EPILOGUE` (the derivative's kernel reads its upstream gradient
            // and writes its result through distinct slices), in the same arithmetic as
            // `Op::ActGrad` on the product.
            y.par_chunks_mut(MIN_ELEMENTS).zip(x.par_chunks(MIN_ELEMENTS)).for_each(|(y, x)| {
                let mut dy = [0.0f32; EPILOGUE];
                for (y, x) in y.chunks_mut(EPILOGUE).zip(x.chunks(EPILOGUE)) {
                    let dy = &mut dy[..y.len()];
                    dy.copy_from_slice(y);
                    super::math::backward(*act, x, dy, y);
                }
            });
            Ok(true)
        }
        Op::ContractRows => {
            let ((sa, a), (sb, b)) = (operand(0)?, operand(1)?);
            let (Some(&k), Some(&n)) = (sa.last(), sb.last()) else { return Ok(false) };
            let rows = a.len() / k.max(1);
            let y = out.get();
            if y.len() != k * n || a.len() != rows * k || b.len() != rows * n {
                return Ok(false);
            }
            gemm_at_b(k, n, rows, a, b, y, threads);
            Ok(true)
        }
        Op::SumAxis { axis } => {
            let (s, x) = operand(0)?;
            let Some(&len) = s.get(*axis) else { return Ok(false) };
            let inner: usize = s.get(axis + 1..).map_or(1, |t| t.iter().product());
            let outer: usize = s.get(..*axis).map_or(1, |t| t.iter().product());
            let y = out.get();
            if y.len() != outer * inner || x.len() != outer * len * inner || y.is_empty() {
                return Ok(y.is_empty() && x.len() == outer * len * inner);
            }
            // Each kept element is accumulated in f64 in index order along the axis, as the
            // interpreter does, a row of the axis at a time (contiguous reads). The work splits
            // over the kept rows when there are enough, else over blocks of columns.
            let sum = |o: usize, j0: usize, out: &mut [f32]| {
                let mut acc = vec![0.0f64; out.len()];
                for i in 0..len {
                    let row = &x[(o * len + i) * inner + j0..][..out.len()];
                    acc.iter_mut().zip(row).for_each(|(a, &v)| *a += f64::from(v));
                }
                out.iter_mut().zip(acc).for_each(|(o, a)| *o = a as f32);
            };
            if inner == 1 {
                // A sum per row (a row norm's statistics): contiguous, no buffer.
                let rows_per_task = (MIN_ELEMENTS / len.max(1)).max(1);
                y.par_iter_mut().with_min_len(rows_per_task).enumerate().for_each(|(o, out)| {
                    *out = x[o * len..][..len].iter().map(|&v| f64::from(v)).sum::<f64>() as f32;
                });
            } else if outer >= 4 * rayon::current_num_threads() || inner < 2 * COLUMNS {
                let rows_per_task = (MIN_ELEMENTS / (len * inner).max(1)).max(1);
                y.par_chunks_mut(inner).with_min_len(rows_per_task).enumerate().for_each(|(o, row)| sum(o, 0, row));
            } else {
                for (o, row) in y.chunks_mut(inner).enumerate() {
                    row.par_chunks_mut(COLUMNS).enumerate().for_each(|(c, out)| sum(o, c * COLUMNS, out));
                }
            }
            Ok(true)
        }
        Op::SumRows => {
            let (s, x) = operand(0)?;
            let Some(&n) = s.last() else { return Ok(false) };
            let y = out.get();
            if y.len() != n || n == 0 || x.len() % n != 0 {
                return Ok(false);
            }
            // The rows in chunks of a fixed size (whatever the threads, so the result is too),
            // each chunk's column sums in f64 in row order, then the chunks' sums added in order.
            let chunk = (MIN_ELEMENTS / n).max(1) * n;
            let parts: Vec<Vec<f64>> = x
                .par_chunks(chunk)
                .map(|rows| {
                    let mut acc = vec![0.0f64; n];
                    for row in rows.chunks_exact(n) {
                        acc.iter_mut().zip(row).for_each(|(a, &v)| *a += f64::from(v));
                    }
                    acc
                })
                .collect();
            let mut total = vec![0.0f64; n];
            for p in parts {
                total.iter_mut().zip(p).for_each(|(t, p)| *t += p);
            }
            y.iter_mut().zip(total).for_each(|(y, t)| *y = t as f32);
            Ok(true)
        }
        Op::ActGrad(act) => {
            let ((_, x), (_, dy)) = (operand(0)?, operand(1)?);
            let y = out.get();
            if x.len() != y.len() || dy.len() != y.len() {
                return Ok(false);
            }
            y.par_chunks_mut(MIN_ELEMENTS)
                .zip(x.par_chunks(MIN_ELEMENTS).zip(dy.par_chunks(MIN_ELEMENTS)))
                .for_each(|(o, (x, dy))| super::math::backward(*act, x, dy, o));
            Ok(true)
        }
        Op::Softmax => {
            let (s, x) = operand(0)?;
            let Some(&d) = s.last() else { return Ok(false) };
            let y = out.get();
            if y.len() != x.len() || d == 0 {
                return Ok(y.is_empty());
            }
            let block = d * (MIN_ELEMENTS / d).max(1);
            y.par_chunks_mut(block).zip(x.par_chunks(block)).for_each(|(o, rows)| {
                o.copy_from_slice(rows);
                super::math::softmax_rows(o, d);
            });
            Ok(true)
        }
        Op::Mask { causal, window } => {
            // Scores [b, h, q, k] (the queries the last q of the k positions), the most negative
            // float where the mask or the key mask ([b, k], 0 = masked) drops the key.
            let Some(scores) = Scores::of(args, *causal, *window)? else { return Ok(false) };
            let y = out.get();
            if y.len() != scores.x.len() {
                return Ok(false);
            }
            scores.rows(y, |_, _, o, row, keep| {
                o.copy_from_slice(row);
                keep.hide(o);
            });
            Ok(true)
        }
        Op::MaskedSoftmax { scale, alibi, causal, window, mods } if mods.is_plain() && args.len() <= 2 => {
            // The interpreter's scale, ALiBi bias, mask and softmax, one row at a time.
            let Some(scores) = Scores::of(args, *causal, *window)? else { return Ok(false) };
            let y = out.get();
            if y.len() != scores.x.len() {
                return Ok(false);
            }
            let slopes = alibi.then(|| kiln_compiler::semantics::alibi_slopes(scores.h));
            let scale = scale.0;
            scores.rows(y, |head, qi, o, row, keep| {
                match slopes.as_ref().map(|s| s[head]) {
                    Some(slope) => {
                        for (ki, (o, &v)) in o.iter_mut().zip(row).enumerate() {
                            *o = v * scale + slope * (ki as f32 - qi as f32);
                        }
                    }
                    None => o.iter_mut().zip(row).for_each(|(o, &v)| *o = v * scale),
                }
                keep.hide(o);
            });
            let block = scores.k * (MIN_ELEMENTS / scores.k).max(1);
            y.par_chunks_mut(block).for_each(|rows| super::math::softmax_rows(rows, scores.k));
            Ok(true)
        }
        Op::Offset { value } => {
            let (_, x) = operand(0)?;
            let y = out.get();
            if y.len() != x.len() {
                return Ok(false);
            }
            let value = value.0;
            y.par_chunks_mut(MIN_ELEMENTS).zip(x.par_chunks(MIN_ELEMENTS)).for_each(|(o, x)| {
                o.iter_mut().zip(x).for_each(|(o, &x)| *o = x + value);
            });
            Ok(true)
        }
        Op::Rsqrt => {
            let (_, x) = operand(0)?;
            let y = out.get();
            if y.len() != x.len() {
                return Ok(false);
            }
            // In f64, as the interpreter computes it.
            y.iter_mut().zip(x).for_each(|(o, &x)| *o = (1.0 / f64::from(x).sqrt()) as f32);
            Ok(true)
        }
        Op::Slice { axis, start, len } => {
            let (s, x) = operand(0)?;
            let Some(&n) = s.get(*axis) else { return Ok(false) };
            let inner: usize = s.get(axis + 1..).map_or(1, |t| t.iter().product());
            let outer: usize = s.get(..*axis).map_or(1, |t| t.iter().product());
            let (start, len) = (*start, *len);
            let y = out.get();
            if start + len > n || y.len() != outer * len * inner || x.len() != outer * n * inner {
                return Ok(false);
            }
            let piece = (len * inner).max(1);
            y.par_chunks_mut(piece).enumerate().with_min_len((MIN_ELEMENTS / piece).max(1)).for_each(|(o, y)| {
                y.copy_from_slice(&x[(o * n + start) * inner..][..y.len()]);
            });
            Ok(true)
        }
        Op::Concat { axis } => {
            let ((sa, a), (_, b)) = (operand(0)?, operand(1)?);
            let outer: usize = sa.get(..*axis).map_or(1, |t| t.iter().product());
            let (ia, ib) = (a.len() / outer.max(1), b.len() / outer.max(1));
            let y = out.get();
            if y.len() != a.len() + b.len() || ia * outer != a.len() || ib * outer != b.len() {
                return Ok(false);
            }
            let piece = (ia + ib).max(1);
            y.par_chunks_mut(piece).enumerate().with_min_len((MIN_ELEMENTS / piece).max(1)).for_each(|(o, y)| {
                let (ya, yb) = y.split_at_mut(ia);
                ya.copy_from_slice(&a[o * ia..][..ia]);
                yb.copy_from_slice(&b[o * ib..][..ib]);
            });
            Ok(true)
        }
        Op::CrossEntropy { smoothing, ignore_index } | Op::CrossEntropyGrad { smoothing, ignore_index } => {
            let (s, x) = operand(0)?;
            let Some((_, Arg::I64(labels))) = args.get(1) else { return Ok(false) };
            let Some(&vocab) = s.last() else { return Ok(false) };
            if vocab == 0 || x.len() != labels.len() * vocab {
                return Ok(false);
            }
            // A label outside the vocabulary, or none counted, is the interpreter's error.
            let ignore = *ignore_index;
            if labels.iter().any(|&l| l != ignore && usize::try_from(l).map_or(true, |l| l >= vocab)) {
                return Ok(false);
            }
            let counted = labels.iter().filter(|&&l| l != ignore).count();
            if counted == 0 {
                return Ok(false);
            }
            let eps = f64::from(smoothing.0);
            // A counted row's exponentials less its maximum (into `scratch`) and their sum in
            // f64: its log-sum-exp is `max + ln(sum)`. Vector loops: the maximum in sixteen
            // lanes, the sums in eight (a chain of dependent f64 additions was most of the
            // step's cross-entropy over GPT-2's 50257-wide rows).
            let exps = |row: &[f32], scratch: &mut [f32]| -> (f64, f64) {
                let (max, sum) = super::math::softmax_stats(row, scratch);
                (f64::from(max), sum)
            };
            let y = out.get();
            if matches!(op, Op::CrossEntropy { .. }) {
                // The mean of the rows' losses, added in row order as the interpreter adds them.
                let losses: Vec<f64> = x
                    .par_chunks(vocab)
                    .zip(labels.par_iter())
                    .filter(|(_, l)| **l != ignore)
                    .map_init(
                        || vec![0.0f32; vocab],
                        |scratch, (row, &l)| {
                            let (max, sum) = exps(row, scratch);
                            // The mean even unsmoothed: `0 * mean` is NaN for an infinite logit, as
                            // in the interpreter.
                            let mean = super::math::sum_row(row) / vocab as f64;
                            let lse = max + sum.ln();
                            let at = row.get(usize::try_from(l).unwrap_or(usize::MAX)).copied().unwrap_or(f32::NAN);
                            lse - (1.0 - eps) * f64::from(at) - eps * mean
                        },
                    )
                    .collect();
                if y.len() != 1 {
                    return Ok(false);
                }
                y[0] = (losses.iter().sum::<f64>() / counted as f64) as f32;
                return Ok(true);
            }
            let Some((_, dy)) = args.get(2).map(|(s, a)| (s, a.f32("dy"))) else { return Ok(false) };
            let Some(&dy) = dy?.first() else { return Ok(false) };
            if y.len() != x.len() {
                return Ok(false);
            }
            let scale = f64::from(dy) / counted as f64;
            let uniform = eps / vocab as f64;
            y.par_chunks_mut(vocab).zip(x.par_chunks(vocab)).zip(labels.par_iter()).for_each(|((o, row), &l)| {
                if l == ignore {
                    o.fill(0.0);
                    return;
                }
                // The exponentials in the output row, then each scaled by the row's sum:
                // softmax(x) = exp(x - max) / sum.
                let (_, sum) = exps(row, o);
                let inv = 1.0 / sum;
                let label = usize::try_from(l).unwrap_or(usize::MAX);
                let at_label = o.get(label).copied();
                super::math::cross_entropy_grad_row(o, inv, scale, uniform);
                if let (Some(e), Some(o)) = (at_label, o.get_mut(label)) {
                    *o = (scale * (f64::from(e) * inv - ((1.0 - eps) + uniform))) as f32;
                }
            });
            Ok(true)
        }
        Op::NormGainGrad { rms, eps } => {
            let ((s, x), (_, dy)) = (operand(0)?, operand(1)?);
            let Some(&d) = s.last() else { return Ok(false) };
            let y = out.get();
            if d == 0 || y.len() != d || dy.len() != x.len() || x.len() % d != 0 {
                return Ok(false);
            }
            let (rms, eps) = (*rms, f64::from(eps.0));
            // Each row's mean and reciprocal deviation (over the rows), then each block of columns
            // summed over the rows in order, in f64 as the interpreter sums them.
            let stats: Vec<(f64, f64)> = x
                .par_chunks(d)
                .with_min_len((MIN_ELEMENTS / d).max(1))
                .map(|row| super::math::norm_stats(row, rms, eps))
                .collect();
            // A block of columns per thread at least (a norm's rows are narrow).
            let block = d.div_ceil(rayon::current_num_threads()).clamp(16, COLUMNS);
            y.par_chunks_mut(block).enumerate().for_each(|(c, out)| {
                let j0 = c * block;
                let mut acc = vec![0.0f64; out.len()];
                for ((row, dy), &(mean, r)) in x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(&stats) {
                    let (row, dy) = (&row[j0..j0 + out.len()], &dy[j0..j0 + out.len()]);
                    super::math::norm_gain_row(&mut acc, row, dy, mean, r);
                }
                out.iter_mut().zip(acc).for_each(|(o, a)| *o = a as f32);
            });
            Ok(true)
        }
        Op::SoftmaxGrad => {
            let ((s, y), (_, dy)) = (operand(0)?, operand(1)?);
            let Some(&n) = s.last() else { return Ok(false) };
            let o = out.get();
            if n == 0 || o.len() != y.len() || dy.len() != y.len() {
                return Ok(o.is_empty());
            }
            // Each row's dot product in f64, as the interpreter (in eight running sums).
            o.par_chunks_mut(n)
                .zip(y.par_chunks(n).zip(dy.par_chunks(n)))
                .with_min_len((MIN_ELEMENTS / n).max(1))
                .for_each(|(o, (y, dy))| super::math::softmax_grad_row(o, y, dy));
            Ok(true)
        }
        Op::NormGrad { rms, eps } => {
            let ((_, x), (_, gain), (_, dy)) = (operand(0)?, operand(1)?, operand(2)?);
            let residual = if args.len() > 3 { Some(operand(3)?.1) } else { None };
            let d = gain.len();
            let y = out.get();
            if d == 0 || y.len() != x.len() || dy.len() != x.len() || x.len() % d != 0 {
                return Ok(false);
            }
            if residual.is_some_and(|r| r.len() != x.len()) {
                return Ok(false);
            }
            let (rms, eps) = (*rms, f64::from(eps.0));
            // Per row, in f64 as the interpreter: the statistics, the two means of the
            // gradient, then each element.
            y.par_chunks_mut(d)
                .zip(x.par_chunks(d).zip(dy.par_chunks(d)))
                .with_min_len((MIN_ELEMENTS / d).max(1))
                .for_each(|(o, (row, dy))| super::math::norm_grad_row(o, row, dy, gain, rms, eps));
            if let Some(residual) = residual {
                y.par_chunks_mut(MIN_ELEMENTS).zip(residual.par_chunks(MIN_ELEMENTS)).for_each(|(o, r)| {
                    o.iter_mut().zip(r).for_each(|(o, &r)| *o += r);
                });
            }
            Ok(true)
        }
        Op::GatherGrad => {
            // (table [rows, d], ids, dy [.., d][, base]) -> [rows, d]: dy's rows added into the
            // rows their ids name (of zeros, or of `base`), in id order (as the interpreter adds
            // them).
            let (s, _) = operand(0)?;
            let (Some((_, Arg::I64(ids))), Ok((_, dy))) = (args.get(1), operand(2)) else { return Ok(false) };
            let &[rows, d] = s else { return Ok(false) };
            let y = out.get();
            let in_range = ids.iter().all(|&id| usize::try_from(id).is_ok_and(|r| r < rows));
            if y.len() != rows * d || dy.len() != ids.len() * d || !in_range || d == 0 {
                return Ok(false);
            }
            match args.get(3) {
                // A tied table's other gradient, the sum's start.
                Some((_, base)) => {
                    let base = base.f32("the base")?;
                    if base.len() != y.len() {
                        return Ok(false);
                    }
                    y.par_chunks_mut(1 << 16).zip(base.par_chunks(1 << 16)).for_each(|(c, b)| c.copy_from_slice(b));
                }
                None => y.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0)),
            }
            for (&id, row) in ids.iter().zip(dy.chunks_exact(d)) {
                let o = &mut y[id as usize * d..][..d];
                o.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
            }
            Ok(true)
        }
        Op::SquareSums => {
            let xs: Vec<&[f32]> = args.iter().map(|(_, a)| a.f32("a gradient")).collect::<R<_>>()?;
            let y = out.get();
            if y.len() != xs.len() {
                return Ok(false);
            }
            y.copy_from_slice(&square_sums(&xs));
            Ok(true)
        }
        Op::AdamW { .. } | Op::Sgd { .. } => {
            // The pure form (the stacked result); a training step's runs write the update in
            // place of the tensors instead (`CpuModel::run_lent`).
            let xs: Vec<&[f32]> = args.iter().map(|(_, a)| a.f32("an operand")).collect::<R<_>>()?;
            let state = xs.len().saturating_sub(4);
            let (Some(&p), Some(&g), Some(&[scale]), Some(&constants)) =
                (xs.first(), xs.get(1), xs.get(2 + state), xs.get(3 + state))
            else {
                return Ok(false);
            };
            let y = out.get();
            let n = p.len();
            if y.len() != (1 + state) * n || g.len() != n || xs[2..2 + state].iter().any(|x| x.len() != n) {
                return Ok(false);
            }
            for (to, from) in y.chunks_mut(n.max(1)).zip(std::iter::once(p).chain(xs[2..2 + state].iter().copied())) {
                to.copy_from_slice(from);
            }
            let (p, rest) = y.split_at_mut(n);
            let update = InPlace { op, p, state: rest.chunks_mut(n.max(1)).collect(), g };
            update_in_place(vec![update], *scale, constants)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Elements of a tensor an optimizer's update hands to one task, and whose squares
/// [`square_sums`] sums as one piece.
const PIECE: usize = 1 << 15;

/// The sum of the squares of each of `xs` ([`Op::SquareSums`]): each tensor's pieces of
/// `PIECE` elements summed in f64 over the threads, the pieces' sums added in order.
pub fn square_sums(xs: &[&[f32]]) -> Vec<f32> {
    let pieces: Vec<(usize, &[f32])> =
        xs.iter().enumerate().flat_map(|(i, x)| x.chunks(PIECE).map(move |p| (i, p))).collect();
    let sums: Vec<f64> = pieces.par_iter().map(|&(_, p)| super::math::sum_squares(p, 1.0)).collect();
    let mut out = vec![0.0f64; xs.len()];
    for (&(i, _), s) in pieces.iter().zip(sums) {
        out[i] += s;
    }
    out.into_iter().map(|s| s as f32).collect()
}

/// One tensor's part of an optimizer step run in place ([`update_in_place`]): the update op
/// ([`Op::AdamW`] or [`Op::Sgd`]), the tensor, its state in the op's order (AdamW's moments,
/// SGD's momentum buffer) and its gradient.
pub struct InPlace<'a> {
    /// The update.
    pub op: &'a Op,
    /// The tensor's elements.
    pub p: &'a mut [f32],
    /// Its optimizer state, each as many elements.
    pub state: Vec<&'a mut [f32]>,
    /// Its gradient.
    pub g: &'a [f32],
}

/// Runs `updates` in place with the step's clipping factor `scale` ([`Op::ClipScale`]) and
/// constants (the update ops' operands after the tensors'), every tensor's pieces in one
/// parallel pass, each element as [`kiln_compiler::semantics`] computes it. Returns whether a
/// step was taken: `false`, and nothing written, where `scale` is NaN.
pub fn update_in_place(updates: Vec<InPlace<'_>>, scale: f32, constants: &[f32]) -> R<bool> {
    use kiln_compiler::semantics::{AdamStep, SgdStep, UpdateStep, update_step};
    let bad = |m: String| CpuError::Operands(m);
    if scale.is_nan() {
        return Ok(false);
    }
    // One kind of task per update: its constants and its pieces.
    enum Piece<'p> {
        Adam(AdamStep, &'p mut [f32], &'p [f32], &'p mut [f32], &'p mut [f32]),
        Sgd(SgdStep, &'p mut [f32], &'p [f32], Option<&'p mut [f32]>),
    }
    let mut pieces: Vec<Piece<'_>> = Vec::new();
    for u in updates {
        let n = u.p.len();
        if u.g.len() != n || u.state.iter().any(|s| s.len() != n) {
            return Err(bad(format!("an update of {n} elements given a gradient or state of another size")));
        }
        let mut state = u.state.into_iter();
        let what = || format!("`{}` with {} constants is not an optimizer's update", u.op.name(), constants.len());
        match update_step(u.op, scale, constants).ok_or_else(|| bad(what()))? {
            UpdateStep::AdamW(c) => {
                let (Some(m), Some(v)) = (state.next(), state.next()) else {
                    return Err(bad("AdamW takes two moments".into()));
                };
                let parts =
                    u.p.chunks_mut(PIECE).zip(u.g.chunks(PIECE)).zip(m.chunks_mut(PIECE).zip(v.chunks_mut(PIECE)));
                pieces.extend(parts.map(|((p, g), (m, v))| Piece::Adam(c, p, g, m, v)));
            }
            UpdateStep::Sgd(c) => {
                let buf = state.next();
                if c.momentum.is_some() != buf.is_some() {
                    return Err(bad("SGD with momentum takes a buffer, without none".into()));
                }
                match buf {
                    Some(b) => pieces.extend(
                        u.p.chunks_mut(PIECE)
                            .zip(u.g.chunks(PIECE))
                            .zip(b.chunks_mut(PIECE))
                            .map(|((p, g), b)| Piece::Sgd(c, p, g, Some(b))),
                    ),
                    None => pieces
                        .extend(u.p.chunks_mut(PIECE).zip(u.g.chunks(PIECE)).map(|(p, g)| Piece::Sgd(c, p, g, None))),
                }
            }
        }
    }
    // Element by element (the pieces split over the threads change nothing).
    pieces.into_par_iter().for_each(|piece| match piece {
        Piece::Adam(c, p, g, m, v) => super::math::adamw(c, p, g, m, v),
        Piece::Sgd(c, p, g, Some(b)) => {
            for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                (*p, *b) = kiln_compiler::semantics::sgd(c, *p, g, *b);
            }
        }
        Piece::Sgd(c, p, g, None) => {
            for (p, &g) in p.iter_mut().zip(g) {
                *p = kiln_compiler::semantics::sgd(c, *p, g, 0.0).0;
            }
        }
    });
    Ok(true)
}

/// `y = a @ b` (`b` transposed with `transpose_b`) for [`Op::MatMul`]'s operands, natively where
/// the layouts allow: `Ok(false)` leaves the product to the interpreter.
fn product(transpose_b: bool, args: &[(Vec<usize>, Arg<'_>)], out: &mut LazyOut<'_>, threads: usize) -> R<bool> {
    let operand = |i: usize| f32_operand(args, i);
    // A right-hand matrix read in place from a parameter stored transposed (a weight view,
    // `b[i][j] = data[j * ld + i]`): the one product of all the rows, by strides.
    if let Some((sb, Arg::Transposed { data, ld })) = args.get(1) {
        let (sa, a) = operand(0)?;
        let (Some((batch, m, k)), &[r0, r1]) = (matrices(sa), sb.as_slice()) else {
            return Err(CpuError::Operands(format!("a product of {sa:?} by a weight view {sb:?}")));
        };
        // `b` [r0, r1]: element (i, j) at `data[j * ld + i]`; the right-hand side is `b`, or
        // `b^T` for `matmul_t`, as (column, row) strides of a `k x n` matrix.
        let (kb, n, strides) = if transpose_b { (r1, r0, (1, *ld)) } else { (r0, r1, (*ld, 1)) };
        let y = out.get();
        if kb != k || y.len() != batch * m * n || a.len() != batch * m * k {
            return Err(CpuError::Operands(format!("a product of {sa:?} by a weight view {sb:?}")));
        }
        gemm_rhs_strided(batch * m, n, k, a, data, strides, y, threads);
        return Ok(true);
    }
    let ((sa, a), (sb, b)) = (operand(0)?, operand(1)?);
    let (Some((batch, m, k)), Some((b_batch, r0, r1))) = (matrices(sa), matrices(sb)) else {
        return Ok(false);
    };
    let (kb, n) = if transpose_b { (r1, r0) } else { (r0, r1) };
    if kb != k {
        return Ok(false);
    }
    let y = out.get();
    if y.len() != batch * m * n || a.len() != batch * m * k {
        return Ok(false);
    }
    // `gemm_f32`'s `transposed` says the right-hand side is stored `[k, n]`.
    let stored_kn = !transpose_b;
    if b_batch == 1 {
        // One weight for every batch: one product of all the rows.
        gemm_f32(batch * m, n, k, a, b, stored_kn.then_some(n), y, threads);
    } else if b_batch == batch && b.len() == batch * k * n {
        y.par_chunks_mut((m * n).max(1))
            .zip(a.par_chunks((m * k).max(1)))
            .zip(b.par_chunks((k * n).max(1)))
            .for_each(|((y, a), b)| gemm_f32(m, n, k, a, b, stored_kn.then_some(n), y, 1));
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// Operand `i`'s shape and f32 elements.
fn f32_operand<'a>(args: &'a [(Vec<usize>, Arg<'_>)], i: usize) -> R<(&'a [usize], &'a [f32])> {
    let (s, a) = args.get(i).ok_or_else(|| CpuError::Operands(format!("operand {i} is missing")))?;
    Ok((s.as_slice(), a.f32("an operand")?))
}

/// A stack of matrices `[.., rows, cols]` as `(matrices, rows, cols)`; `None` below rank 2.
fn matrices(shape: &[usize]) -> Option<(usize, usize, usize)> {
    let (lead, last) = shape.split_at(shape.len().checked_sub(2)?);
    let &[rows, cols] = last else { return None };
    Some((lead.iter().product(), rows, cols))
}

/// Attention scores `[b, h, q, k]` (the queries the last `q` of the `k` positions) and what hides a
/// key from a query: the causal mask, the sliding window, the key mask (`[b, k]`, 0 = hidden).
struct Scores<'a> {
    x: &'a [f32],
    key_mask: Option<&'a [f32]>,
    h: usize,
    q: usize,
    k: usize,
    causal: bool,
    window: Option<usize>,
}

impl<'a> Scores<'a> {
    /// The scores and key mask of a mask op's operands (`scores[, key_mask]`); `None` where the
    /// shape or the key mask's length is not the layout the kernels take.
    fn of(args: &'a [(Vec<usize>, Arg<'a>)], causal: bool, window: Option<usize>) -> R<Option<Scores<'a>>> {
        let f32s = |i: usize| -> R<Option<(&'a [usize], &'a [f32])>> {
            args.get(i).map(|(s, a)| Ok((s.as_slice(), a.f32("an operand")?))).transpose()
        };
        let Some((shape, x)) = f32s(0)? else { return Err(CpuError::Operands("operand 0 is missing".into())) };
        let key_mask = f32s(1)?.map(|(_, m)| m);
        let &[b, h, q, k] = shape else { return Ok(None) };
        let fits = k > 0 && x.len() == b * h * q * k && key_mask.is_none_or(|m| m.len() == b * k);
        Ok(fits.then_some(Scores { x, key_mask, h, q, k, causal, window }))
    }

    /// Runs `f(head, query position, output row, score row, keep)` over every row in parallel,
    /// `keep` saying which keys the query sees.
    fn rows(&self, y: &mut [f32], f: impl Fn(usize, usize, &mut [f32], &[f32], Keep<'_>) + Sync) {
        let Scores { x, key_mask, h, q, k, causal, window } = *self;
        let offset = k.saturating_sub(q);
        y.par_chunks_mut(k).zip(x.par_chunks(k)).enumerate().with_min_len((MIN_ELEMENTS / k).max(1)).for_each(
            |(r, (o, row))| {
                let (bi, head, qi) = (r / (h * q), (r / q) % h, r % q + offset);
                // Keys in `lo..hi` pass the causal mask and the window.
                let hi = if causal { qi + 1 } else { k };
                let lo = window.map_or(0, |w| (qi + 1).saturating_sub(w));
                let keep = Keep { lo, hi, mask: key_mask.map(|m| &m[bi * k..][..k]) };
                f(head, qi, o, row, keep);
            },
        );
    }
}

/// The keys one query sees: those in `lo..hi` the key mask does not hide.
#[derive(Clone, Copy)]
struct Keep<'a> {
    lo: usize,
    hi: usize,
    mask: Option<&'a [f32]>,
}

impl Keep<'_> {
    /// The most negative float at every key of the row `o` the query does not see.
    fn hide(self, o: &mut [f32]) {
        let len = o.len();
        o.iter_mut().take(self.lo).for_each(|v| *v = f32::MIN);
        o.iter_mut().skip(self.hi.min(len)).for_each(|v| *v = f32::MIN);
        if let Some(mask) = self.mask {
            o.iter_mut().zip(mask).filter(|(_, m)| **m == 0.0).for_each(|(v, _)| *v = f32::MIN);
        }
    }
}
