//! Native kernels for the ops a training step adds to a forward pass: batched matrix products
//! (activations times activations, and the products of a backward pass), sums over an axis (a
//! gradient reduced over the axes its operand was broadcast along) and activation derivatives.
//! Each computes what the interpreter computes for the op (`tests/engines/fused_ops.rs` holds
//! them to it); an operand layout a kernel does not take is left to the interpreter.

use super::linear::{gemm_at_b, gemm_f32};
use super::{Arg, CpuError, LazyOut, R};
use kiln_compiler::graph::Op;
use rayon::prelude::*;

/// Elements handed to one task at least by the elementwise kernels.
const MIN_ELEMENTS: usize = 1 << 14;

/// Columns of a sum handed to one task when the kept rows are too few to split the work.
const COLUMNS: usize = 256;

/// Runs `op` natively if this module has a kernel for it; `Ok(false)` leaves it to the
/// interpreter.
pub fn forward(op: &Op, args: &[(Vec<usize>, Arg<'_>)], out: &mut LazyOut<'_>, threads: usize) -> R<bool> {
    let operand = |i: usize| -> R<(&[usize], &[f32])> {
        let (s, a) = args.get(i).ok_or_else(|| CpuError::Operands(format!("operand {i} is missing")))?;
        Ok((s.as_slice(), a.f32("an operand")?))
    };
    match op {
        Op::MatMul { transpose_b } => {
            let ((sa, a), (sb, b)) = (operand(0)?, operand(1)?);
            let (Some((batch, m, k)), Some((b_batch, r0, r1))) = (matrices(sa), matrices(sb)) else {
                return Ok(false);
            };
            let (kb, n) = if *transpose_b { (r1, r0) } else { (r0, r1) };
            if kb != k {
                return Ok(false);
            }
            let y = out.get();
            if y.len() != batch * m * n || a.len() != batch * m * k {
                return Ok(false);
            }
            // `gemm_f32`'s `transposed` says the right-hand side is stored `[k, n]`.
            let stored_kn = !*transpose_b;
            if b_batch == 1 {
                // One weight for every batch: one product of all the rows.
                gemm_f32(batch * m, n, k, a, b, stored_kn, y, threads);
            } else if b_batch == batch && b.len() == batch * k * n {
                y.par_chunks_mut((m * n).max(1))
                    .zip(a.par_chunks((m * k).max(1)))
                    .zip(b.par_chunks((k * n).max(1)))
                    .for_each(|((y, a), b)| gemm_f32(m, n, k, a, b, stored_kn, y, 1));
            } else {
                return Ok(false);
            }
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
        _ => Ok(false),
    }
}

/// A stack of matrices `[.., rows, cols]` as `(matrices, rows, cols)`; `None` below rank 2.
fn matrices(shape: &[usize]) -> Option<(usize, usize, usize)> {
    let (lead, last) = shape.split_at(shape.len().checked_sub(2)?);
    let &[rows, cols] = last else { return None };
    Some((lead.iter().product(), rows, cols))
}
