//! The projection ([`Op::Linear`]) on the CPU: `rope(act(norm(x) @ w^T + bias)) + residual`, or
//! the gated `act(gate) * up`, as the interpreter defines it.
//!
//! 1. **Prologue**: the rows of `x` normalised (RMSNorm or LayerNorm) into a scratch buffer.
//! 2. **Product**: for an f32 weight — transposed to `[k, n]` at load when constant (see
//!    `CpuModel::new`), else the plan's `[n, k]` read by strides — a GEMM through the `gemm` crate (packed,
//!    cache-blocked, AVX2/AVX-512 kernels chosen at run time, threaded over the pool). For a
//!    block-quantized weight (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K: `[rows, k]` blocks), the blocks are
//!    dequantized in registers and
//!    multiplied with the f32 activations ([`super::qdot_f32`]), or, opted into, each row of `x`
//!    is quantized to 8 bits per block of 32 and dotted with the weight rows in integer
//!    arithmetic ([`super::qdot`]); either way the pool's threads take blocks of weight rows,
//!    each block reused for every row of `x` while it is in cache, so the weight is read from
//!    memory once per call.
//! 3. **Epilogue**: per output row, while it is in cache: bias, activation or gate, RoPE on the
//!    rotated columns (at the row's position, see [`Positions`]), residual.

use super::isa::Implementation;
use super::math::{layer_norm_row, rms_norm_row};
use super::qdot::{self, Q8Acts, gemm as qgemm};
use super::qdot_f32;
use super::{Arg, CpuError, Positions, R};
use kiln_compiler::graph::Op;
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::semantics::{activation, rope_frequencies, rotate};
use rayon::prelude::*;

/// The most weight rows one task computes (for every row of `x`): 96 rows of a 576-wide Q4_1
/// weight are 40 KiB, which stay in L2 while every activation row passes over them.
const MAX_ROW_BLOCK: usize = 96;

/// Activation rows from which `--int8-activations` multiplies quantized weights by the integer
/// GEMM ([`qgemm`]): below, its vectors of 16 (or 8) rows are mostly padding, and the row dot
/// products or the f32 path run faster.
const INTEGER_GEMM_ROWS: usize = 8;

/// Multiply-adds below which the GEMM runs on one thread.
const GEMM_THREADING: usize = 1 << 18;

/// Runs a projection step: `args` as [`Op::Linear`] lists them, the result (`shape`, `[.., n]`)
/// written into `out`.
pub fn forward(
    op: &Op,
    args: &[(Vec<usize>, Arg<'_>)],
    out: &mut [f32],
    shape: &[usize],
    positions: Positions<'_>,
    threads: usize,
    int8: bool,
) -> R<()> {
    let Op::Linear { act, bias, residual, norm, glu, rope } = *op else {
        return Err(CpuError::Operands("not a projection".into()));
    };
    let bad = |m: String| CpuError::Operands(m);
    let mut next = args.iter();
    let mut take = |what: &str| next.next().ok_or_else(|| bad(format!("the {what} operand is missing")));
    let (x_shape, x) = take("input")?;
    let x = x.f32("the input")?;
    let k = x_shape.last().copied().unwrap_or(0);
    let norm = match norm {
        Some(p) => {
            let gain = take("norm gain")?.1.f32("the norm gain")?;
            let nbias = if p.bias { Some(take("norm bias")?.1.f32("the norm bias")?) } else { None };
            Some((p, gain, nbias))
        }
        None => None,
    };
    let (_, w) = take("weight")?;
    let w_arg = *w;
    let b = if bias { Some(take("bias")?.1.f32("the bias")?) } else { None };
    let res = if residual { Some(take("residual")?.1.f32("the residual")?) } else { None };
    let n = shape.last().copied().unwrap_or(0);
    let mw = if glu { 2 * n } else { n };
    if k == 0 || n == 0 || x.len() % k != 0 {
        return Err(bad(format!("input {x_shape:?} cannot be projected to {shape:?}")));
    }
    let m = x.len() / k;
    if out.len() != m * n
        || b.is_some_and(|b| b.len() != mw)
        || res.is_some_and(|r| r.len() != m * n)
        || norm.is_some_and(|(_, g, nb)| g.len() != k || nb.is_some_and(|nb| nb.len() != k))
    {
        return Err(bad(format!("operands do not fit a projection of {x_shape:?} to {shape:?}")));
    }

    // 1. Prologue.
    let normed: Vec<f32>;
    let x: &[f32] = match norm {
        Some((p, gain, nbias)) => {
            let mut t = vec![0.0; x.len()];
            t.par_chunks_mut(k).zip(x.par_chunks(k)).with_min_len(8).for_each(|(o, row)| {
                o.copy_from_slice(row);
                match p.rms {
                    true => rms_norm_row(o, gain, p.eps.0),
                    false => layer_norm_row(o, gain, nbias, p.eps.0),
                }
            });
            normed = t;
            &normed
        }
        None => x,
    };

    // 2. Product: y [m, mw], straight into `out` when no gate halves it.
    let mut scratch: Vec<f32> = if glu { vec![0.0; m * mw] } else { Vec::new() };
    let y: &mut [f32] = if glu { &mut scratch } else { &mut *out };
    match w_arg {
        Arg::F32(w) => {
            if w.len() != mw * k {
                return Err(bad(format!("an f32 weight of {} elements is not [{mw}, {k}]", w.len())));
            }
            gemm_f32(m, mw, k, x, w, None, y, threads);
        }
        Arg::Transposed { data, ld } => {
            if ld < mw || k.checked_sub(1).is_some_and(|r| data.len() < r * ld + mw) {
                let len = data.len();
                return Err(bad(format!("a transposed weight of {len} elements (row stride {ld}) is not [{k}, {mw}]")));
            }
            gemm_f32(m, mw, k, x, data, Some(ld), y, threads);
        }
        Arg::Quant(q) => {
            if q.k != k || q.rows != mw {
                return Err(bad(format!("a [{}, {}] {} weight does not project {k} to {mw}", q.rows, q.k, q.format)));
            }
            quantized(q, m, x, y, int8)?;
        }
        Arg::I64(_) | Arg::Cache { .. } => return Err(bad("the weight must be f32 or quantized blocks".into())),
    }

    // 3. Epilogue, row by row.
    let seq = x_shape.len().checked_sub(2).and_then(|i| x_shape.get(i)).copied().unwrap_or(1).max(1);
    let rope = rope.map(|r| (rope_frequencies(r.theta.0, r.rotary_dim), r));
    let epilogue = |i: usize, o: &mut [f32], y: &[f32]| {
        if glu {
            let (gate, up) = y.split_at(n);
            match (b, act) {
                (None, Some(a)) => super::math::gate(a, gate, up, o),
                _ => {
                    for j in 0..n {
                        let (mut g, mut u) = (gate[j], up[j]);
                        if let Some(b) = b {
                            g += b[j];
                            u += b[n + j];
                        }
                        o[j] = act.map_or(g, |a| activation(a, g)) * u;
                    }
                }
            }
        } else {
            if let Some(b) = b {
                for (o, &b) in o.iter_mut().zip(b) {
                    *o += b;
                }
            }
            if let Some(a) = act {
                super::math::apply(a, o);
            }
        }
        if let Some((inv, r)) = &rope {
            let pos = positions.at(i / seq, i % seq) as f32;
            for head in o[r.start..r.start + r.len].chunks_mut(r.head_dim) {
                rotate(&mut head[..r.rotary_dim], pos, inv, r.style);
            }
        }
        if let Some(res) = res {
            for (o, &r) in o.iter_mut().zip(&res[i * n..][..n]) {
                *o += r;
            }
        }
    };
    if glu {
        out.par_chunks_mut(n)
            .zip(scratch.par_chunks(mw))
            .enumerate()
            .with_min_len(8)
            .for_each(|(i, (o, y))| epilogue(i, o, y));
    } else if b.is_some() || act.is_some() || rope.is_some() || res.is_some() {
        out.par_chunks_mut(n).enumerate().with_min_len(8).for_each(|(i, o)| epilogue(i, o, &[]));
    }
    Ok(())
}

/// The `gemm` crate's threading for a product of `work` multiply-adds on `threads` threads: none
/// below [`GEMM_THREADING`].
fn parallelism(threads: usize, work: usize) -> gemm::Parallelism {
    if threads > 1 && work >= GEMM_THREADING { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None }
}

/// `y [m, n] = x [m, k] @ w^T` for `w` `[n, k]` — or, `transposed: Some(ld)`, `x @ w` for `w`
/// `[k, n]` in rows of `ld` elements — through the `gemm` crate.
#[expect(clippy::too_many_arguments, reason = "a GEMM's sizes and layout")]
pub fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    w: &[f32],
    transposed: Option<usize>,
    y: &mut [f32],
    threads: usize,
) {
    // The k x n right-hand side: `w` transposed, `[k, n]` in rows of `ld` (column stride 1, row
    // stride ld), or `w` [n, k] read by strides (column stride k, row stride 1).
    let strides = match transposed {
        Some(ld) => (1, ld),
        None => (k, 1),
    };
    gemm_rhs_strided(m, n, k, x, w, strides, y, threads);
}

/// `y [m, n] = x [m, k] @ rhs`, the `k x n` right-hand side's element `(l, j)` at
/// `w[l * strides.1 + j * strides.0]` (column stride, row stride).
#[expect(clippy::too_many_arguments, reason = "a GEMM's sizes, operands and strides")]
pub fn gemm_rhs_strided(
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    w: &[f32],
    (rhs_cs, rhs_rs): (usize, usize),
    y: &mut [f32],
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let parallelism = parallelism(threads, m * n * k);
    // SAFETY: `gemm` writes `y[i * n + j]` for i < m, j < n, and reads `x[i * k + l]` and
    // `w[l * rhs_rs + j * rhs_cs]` for l < k: the spans below, inside the slices (the caller's
    // shapes, checked here in every build: this is a safe public function). `y` does not alias
    // the inputs (a distinct `&mut`).
    super::check_span("linear output", y.len(), 0, (m, n), (n, 1));
    super::check_span("linear input", x.len(), 0, (m, k), (k, 1));
    super::check_span("linear weight", w.len(), 0, (k, rhs_rs), (n, rhs_cs));
    if m == 1 && matches!(parallelism, gemm::Parallelism::Rayon(_)) {
        // The `gemm` crate runs a product of one row as a GEMV on the calling thread, whatever
        // its parallelism, so a decode step's f32 projections read memory at one core's rate (on
        // the H100 lease's host, 11 GB/s of the 108 its 16 cores read). Here the pool's threads
        // take ranges of the contraction — contiguous ranges of the rows of a constant weight,
        // stored transposed (`[k, n]`) — and their partial rows are added in range order (so
        // the sums' order depends on the thread count, as the GEMM's own threading does). On
        // this 2-core machine, where one core nearly reads the memory's rate, it measured no
        // faster; splitting the columns instead was slower (SmolLM2 f32 decode 44 -> 35 tok/s).
        let parts = threads.max(1);
        let span = k.div_ceil(parts);
        let partial: Vec<Vec<f32>> = (0..k.div_ceil(span))
            .into_par_iter()
            .map(|t| {
                let l0 = t * span;
                let len = span.min(k - l0);
                let mut y = vec![0.0f32; n];
                // The same product over steps `l0 .. l0 + len` on this thread (its spans checked
                // again there; `l0 * rhs_rs` is inside `w`, checked above).
                gemm_rhs_strided(1, n, len, &x[l0..l0 + len], &w[l0 * rhs_rs..], (rhs_cs, rhs_rs), &mut y, 1);
                y
            })
            .collect();
        y.copy_from_slice(&partial[0]);
        for p in &partial[1..] {
            y.iter_mut().zip(p).for_each(|(y, p)| *y += p);
        }
        return;
    }
    if let gemm::Parallelism::Rayon(parts) = parallelism {
        // The crate's own threading divides these products poorly: at a forward's 128 rows,
        // GPT-2's `[128, 3072] @ [3072, 768]` ran 159-173 GFLOPS on two threads (one thread
        // alone: 113), its `[128, 768] @ [768, 768]` 172-177 (BENCHMARKS.md, 2026-11-28).
        // Instead each of the pool's threads takes a range of whole column panels and runs the
        // crate on its own (228-233 and 211-212 GFLOPS); a product too narrow for that gives
        // each thread a range of rows (two or four parts measured alike; BENCHMARKS.md). Each
        // output element is still one of the crate's sums over `k`, blocked by the shape it is
        // given: the order of a sum may depend on the thread count, as it did with the crate's
        // own threading.
        let span = n.div_ceil(parts).next_multiple_of(PANEL_COLUMNS);
        if span < n {
            let out = SendPtr(y.as_mut_ptr());
            (0..n.div_ceil(span)).into_par_iter().for_each(|p| {
                let j0 = p * span;
                let cols = span.min(n - j0);
                debug_assert!(j0 + cols <= n && (j0 + cols - 1) * rhs_cs < w.len(), "column range {j0}+{cols} of {n}");
                // SAFETY: columns `j0 .. j0 + cols` of every row of `y` (inside it: `j0 + cols
                // <= n`, the spans checked above), which no other task writes; the weight's
                // columns from `j0`, element `(l, j)` at `(j0 + j) * rhs_cs + l * rhs_rs`, inside
                // `w` for `j < cols` (the whole weight's span, checked above).
                unsafe {
                    gemm_one_thread(m, cols, k, out.get().add(j0), n, x, w.as_ptr().add(j0 * rhs_cs), (rhs_cs, rhs_rs))
                };
            });
            return;
        }
        let rows = m.div_ceil(parts);
        if rows < m {
            y.par_chunks_mut(rows * n).zip(x.par_chunks(rows * k)).for_each(|(y, x)| {
                gemm_rhs_strided(y.len() / n, n, k, x, w, (rhs_cs, rhs_rs), y, 1);
            });
            return;
        }
    }
    // SAFETY: as checked above.
    unsafe { gemm_one_thread(m, n, k, y.as_mut_ptr(), n, x, w.as_ptr(), (rhs_cs, rhs_rs)) };
}

/// Columns a thread's share of a product's output is a multiple of: whole micro-panels of the
/// crate's AVX-512 f32 kernel (and of its narrower ones).
const PANEL_COLUMNS: usize = 16;

/// A raw pointer handed to the pool's tasks, each of which writes its own elements through it.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

// SAFETY: the pointer is only dereferenced by tasks that write disjoint elements (see its uses).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so that closures capture the `Send` wrapper, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `y [m, n] (row stride ldy) = x [m, k] @ rhs` on the calling thread, the right-hand side's
/// element `(l, j)` at `w[l * rhs_rs + j * rhs_cs]`.
///
/// # Safety
/// `y` must be valid for writes of `y[i * ldy + j]` and `w` for reads of `w[l * rhs_rs + j *
/// rhs_cs]` (i < m, j < n, l < k), no other thread accessing those elements of `y`; `x` holds `m *
/// k` elements (checked in debug builds).
#[expect(clippy::too_many_arguments, reason = "a GEMM's sizes, operands and strides")]
unsafe fn gemm_one_thread(
    m: usize,
    n: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
    x: &[f32],
    w: *const f32,
    (rhs_cs, rhs_rs): (usize, usize),
) {
    debug_assert!(x.len() >= m * k, "a GEMM's input of {} elements is not [{m}, {k}]", x.len());
    // SAFETY: the caller's bounds; `x` is `[m, k]` in rows of `k`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y,
            1,
            ldy as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w,
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `y [m, n] = a^T @ b` for `a` `[rows, m]` and `b` `[rows, n]` (both row-major): the products
/// of rows summed over every row ([`kiln_compiler::graph::Op::ContractRows`], a weight's
/// gradient), through the `gemm` crate, `a` read transposed by strides.
pub fn gemm_at_b(m: usize, n: usize, rows: usize, a: &[f32], b: &[f32], y: &mut [f32], threads: usize) {
    let parallelism = parallelism(threads, m * n * rows);
    if m == 0 || n == 0 {
        return;
    }
    if rows == 0 {
        y.fill(0.0);
        return;
    }
    // SAFETY: `gemm` writes `y[i * n + j]` for i < m, j < n, and reads `a[l * m + i]` and
    // `b[l * n + j]` for l < rows: the spans below, inside the slices (checked here in every
    // build: this is a safe public function). `y` does not alias the inputs (a distinct `&mut`).
    super::check_span("row products' output", y.len(), 0, (m, n), (n, 1));
    super::check_span("row products' a", a.len(), 0, (rows, m), (m, 1));
    super::check_span("row products' b", b.len(), 0, (rows, n), (n, 1));
    unsafe {
        gemm::gemm(
            m,
            n,
            rows,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            m as isize,
            1,
            b.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `y [m, rows] = x [m, k] @ q^T`, from the blocks: with `int8`, each row of `x` quantized once to
/// 8 bits per block of 32 and multiplied in integer arithmetic — from [`INTEGER_GEMM_ROWS`] rows
/// by the integer GEMM ([`qgemm`]), below by row dot products ([`qdot`]); otherwise with the f32
/// activations ([`exact`]). The weight's rows go in blocks over the pool ([`row_block`]).
///
/// Row dot products of Q5_0 and the K-quants (SIMD kernels that unpacked each block's factors
/// again for every activation row, a row at a time; removed, [`qdot`] keeps their scalar
/// reference) lost to the f32 path wherever measured: where no integer GEMM runs (a CPU without AVX2) or
/// below its rows, the f32 path, which dequantizes a tile of 4 rows once for all the activation
/// rows, ran faster — past one row (Gemma 3 270M on 2 AVX-512 VNNI cores, 2026-11-27: 4
/// sequences decoded together 121 against 162 tok/s) and at one row too (its decode with `int8`,
/// 2026-11-28: 40.3-40.6 tok/s through the row products against 49.9-50.1 with these formats on
/// the f32 path, on the Intel Xeon; the AMD EPYC's int8 decode had also trailed its f32 one) —
/// so those formats take it there even with `int8` (f32 activations: exact, not approximate).
/// Q8_0 and Q4_1 tile their dot products over weight rows and keep them.
fn quantized(q: &crate::quant::QuantWeight, m: usize, x: &[f32], y: &mut [f32], int8: bool) -> R<()> {
    let (k, rows) = (q.k, q.rows);
    let tiled = matches!(q.format, WeightFormat::Q8_0 | WeightFormat::Q4_1);
    let gemm = if int8 && m >= INTEGER_GEMM_ROWS { qgemm::Impl::for_rows(q.format, m) } else { None };
    if !int8 || (!tiled && gemm.is_none()) {
        return exact(q, m, x, y);
    }
    let stride = q.format.row_words(k).ok_or_else(|| CpuError::Operands(format!("{} is not quantized", q.format)))?;
    let acts: Vec<Q8Acts> = x
        .par_chunks(k)
        .with_min_len(4)
        .map(|row| {
            let mut a = Q8Acts::new();
            a.quantize(row);
            a
        })
        .collect();
    let words = |r0: usize| q.words.get(r0 * stride..).unwrap_or_default();
    if let Some(imp) = gemm {
        let x = qgemm::Acts::pack(imp, q.format, acts);
        by_row_blocks(rows, m, y, |r0, len, out| qgemm::gemm_rows(q.format, words(r0), k, &x, out, len));
        return Ok(());
    }
    by_row_blocks(rows, m, y, |r0, len, out| {
        for (a, o) in acts.iter().zip(out.chunks_mut(len)) {
            qdot::dot_rows(q.format, words(r0), k, a, o);
        }
    });
    Ok(())
}

/// `y [m, rows] = x [m, k] @ q^T` with f32 activations, each weight block dequantized in
/// registers ([`qdot_f32`]): the interpreter's products on the dequantized weight, up to
/// summation order. The pool's threads take blocks of weight rows ([`row_block`]), each
/// dequantized once for every row of `x`.
fn exact(q: &crate::quant::QuantWeight, m: usize, x: &[f32], y: &mut [f32]) -> R<()> {
    let (k, rows) = (q.k, q.rows);
    let stride = q.format.row_words(k).ok_or_else(|| CpuError::Operands(format!("{} is not quantized", q.format)))?;
    let words = |r0: usize| q.words.get(r0 * stride..).unwrap_or_default();
    by_row_blocks(rows, m, y, |r0, len, out| qdot_f32::gemm_rows_f32(q.format, words(r0), k, x, m, out, len));
    Ok(())
}

/// Rows a task of [`by_row_blocks`] computes of `rows` weight rows: as many blocks for each of
/// `threads` threads, each at most [`MAX_ROW_BLOCK`] rows and a multiple of `tile` rows, so that
/// the threads finish together. (A fixed 96 split Gemma 3's 640 rows into 7 blocks, 4 on one
/// thread against 3; here 8 of 80 rows when decoding.)
fn row_block(rows: usize, threads: usize, tile: usize) -> usize {
    let per_thread = rows.div_ceil(threads.max(1));
    let tasks = per_thread.div_ceil(MAX_ROW_BLOCK).max(1);
    per_thread.div_ceil(tasks).next_multiple_of(tile.max(1)).max(1)
}

/// Runs `kernel(r0, len, out)` for every block of weight rows ([`row_block`]) over the pool,
/// `out` holding `m` rows of `len` results (columns `r0 .. r0 + len` of `y [m, rows]`): for one
/// row of `x` straight into `y`, otherwise into a buffer per block, written into place after.
fn by_row_blocks(rows: usize, m: usize, y: &mut [f32], kernel: impl Fn(usize, usize, &mut [f32]) + Sync) {
    let threads = rayon::current_num_threads();
    if m == 1 {
        let block = row_block(rows, threads, qdot_f32::TILE);
        y.par_chunks_mut(block).enumerate().for_each(|(c, o)| kernel(c * block, o.len(), o));
        return;
    }
    let block = row_block(rows, threads, qdot_f32::Impl::best().prefill_rows());
    let blocks: Vec<Vec<f32>> = (0..rows.div_ceil(block))
        .into_par_iter()
        .map(|c| {
            let r0 = c * block;
            let len = block.min(rows - r0);
            let mut part = vec![0.0; m * len];
            kernel(r0, len, &mut part);
            part
        })
        .collect();
    scatter(&blocks, block, m, rows, y);
}

/// Writes per-block results (`m` rows of up to `block` columns each, block `c` holding columns
/// `c * block ..`) into `y [m, rows]`.
fn scatter(blocks: &[Vec<f32>], block: usize, m: usize, rows: usize, y: &mut [f32]) {
    for (c, part) in blocks.iter().enumerate() {
        let r0 = c * block;
        let len = block.min(rows - r0);
        for (i, p) in part.chunks(len).take(m).enumerate() {
            y[i * rows + r0..][..len].copy_from_slice(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_ROW_BLOCK, gemm_f32, row_block};

    /// Blocks are whole tiles, at most the maximum, and as many for each thread: SmolLM2's and
    /// Gemma 3's widths on two threads; and any width on any threads whole tiles of at most the
    /// maximum.
    #[test]
    fn row_blocks_split_evenly_over_the_threads() {
        for (rows, threads, tile, block) in
            [(576, 2, 4, 96), (640, 2, 4, 80), (640, 2, 12, 84), (3072, 2, 12, 96), (49152, 2, 4, 96), (7, 4, 4, 4)]
        {
            assert_eq!(row_block(rows, threads, tile), block, "{rows} rows, {threads} threads, tiles of {tile}");
        }
        for rows in [1, 5, 100, 577, 4096, 262144] {
            for threads in [1, 2, 3, 16] {
                let b = row_block(rows, threads, 4);
                assert!(b.is_multiple_of(4) && b <= MAX_ROW_BLOCK, "{rows} rows, {threads} threads: {b}");
            }
        }
    }

    #[test]
    fn gemm_f32_reads_the_layouts_it_is_given() {
        // x [2, 3] @ w^T for w [2, 3], and the same with w stored transposed ([3, 2]).
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = [1.0, 0.0, -1.0, 0.5, 0.5, 0.5];
        let wt = [1.0, 0.5, 0.0, 0.5, -1.0, 0.5];
        for (w, transposed) in [(&w, None), (&wt, Some(2))] {
            let mut y = [0.0; 4];
            gemm_f32(2, 2, 3, &x, w, transposed, &mut y, 1);
            assert_eq!(y, [-2.0, 3.0, -2.0, 7.5]);
        }
    }

    /// A product of one row over the pool's threads (ranges of its contraction, the last one
    /// short, their partial rows added) is the one-thread product, in both layouts: exactly, for
    /// these sums of small integers.
    #[test]
    fn one_row_over_the_threads_is_the_one_thread_product() {
        let (k, n) = (600, 1000);
        let x: Vec<f32> = (0..k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 11) as f32 - 5.0).collect();
        let mut wt = vec![0.0f32; k * (n + 3)];
        for j in 0..n {
            for l in 0..k {
                wt[l * (n + 3) + j] = w[j * k + l];
            }
        }
        let exact: Vec<f32> = (0..n).map(|j| (0..k).map(|l| x[l] * w[j * k + l]).sum()).collect();
        for (w, transposed) in [(&w, None), (&wt, Some(n + 3))] {
            let (mut one, mut many) = (vec![0.0; n], vec![0.0; n]);
            gemm_f32(1, n, k, &x, w, transposed, &mut one, 1);
            gemm_f32(1, n, k, &x, w, transposed, &mut many, 3);
            assert_eq!(one, many, "{transposed:?}");
            assert_eq!(many, exact, "{transposed:?}: small integers sum exactly");
        }
    }

    /// A product over the pool's threads — ranges of whole column panels (the last one short),
    /// or, too narrow for that, ranges of rows — is the exact product in both layouts (sums of
    /// small integers, exact in any order).
    #[test]
    fn products_over_the_threads_are_the_exact_products() {
        // (m, n, k): columns in three ranges of 336, 336 and 328; ten columns, rows in three
        // ranges; one thread below the threading threshold.
        for (m, n, k) in [(40, 1000, 300), (500, 10, 300), (3, 5, 7)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 11) as f32 - 5.0).collect();
            let ld = n + 3;
            let mut wt = vec![0.0f32; k * ld];
            for j in 0..n {
                for l in 0..k {
                    wt[l * ld + j] = w[j * k + l];
                }
            }
            let exact: Vec<f32> =
                (0..m * n).map(|e| (0..k).map(|l| x[e / n * k + l] * w[e % n * k + l]).sum()).collect();
            for (w, transposed) in [(&w, None), (&wt, Some(ld))] {
                for threads in [1, 2, 3] {
                    let mut y = vec![f32::NAN; m * n];
                    gemm_f32(m, n, k, &x, w, transposed, &mut y, threads);
                    assert_eq!(y, exact, "{m} x {n} x {k}, {transposed:?}, {threads} threads");
                }
            }
        }
    }

    /// Every build checks every operand's span before the `gemm` crate's raw-pointer access.
    #[test]
    fn gemm_f32_operands_one_short_are_refused() {
        let (x, w) = (vec![1.0f32; 6], vec![1.0f32; 6]);
        for (what, xl, wl, yl, transposed) in [
            ("linear input", 5, 6, 4, None),
            ("linear weight", 6, 5, 4, None),
            ("linear weight", 6, 5, 4, Some(2)),
            ("linear output", 6, 6, 3, None),
        ] {
            let err = std::panic::catch_unwind(|| {
                let mut y = vec![0.0f32; yl];
                gemm_f32(2, 2, 3, &x[..xl], &w[..wl], transposed, &mut y, 1);
            })
            .expect_err(what);
            let msg = err.downcast_ref::<String>().map_or("", String::as_str);
            assert!(msg.starts_with(what), "{what}: {msg}");
        }
    }
}
