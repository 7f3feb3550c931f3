//! Fused attention on the CPU ([`Op::Attention`], [`Op::PackedAttention`]): for each query row,
//! `softmax(mask(alibi(q·k * scale))) @ v` per head, the heads merged into `[b, s, h * d]`, with
//! the interpreter's semantics (masked scores are the most negative float, so a row whose every
//! key is masked averages all values uniformly).
//!
//! Two forms, by the number of query rows:
//!
//! - **Rows** (a decode step, short prompts): a task owns one query row, walks the keys its row
//!   may attend (causal rows stop at their own position, window rows start at their earliest
//!   key; under a block pattern, the key blocks of its query block), and keeps one row of scores
//!   per query head of a key/value group, so every key and value row loaded serves all the
//!   group's heads (grouped-query attention shares its loads). Where the rows' tasks are fewer
//!   than two a thread and the keys many (a decode step of a model with few key/value heads
//!   over a long context), a task owns a part of a row's keys instead, and the parts' softmax
//!   statistics are combined per head after (flash-decoding; `key_parts`).
//! - **Blocks** (prefill, from `MIN_BLOCK_ROWS` (16) rows): a task owns up to `TILE_ROWS` (64) query
//!   rows of one key/value head — under a block pattern, one query block — and per query head
//!   runs two GEMMs through the `gemm` crate per range of keys the block attends (one range by
//!   position; a block pattern's attended key blocks) — scores, then probabilities times values
//!   — with each row's softmax over its own keys in between, the second GEMM writing the rows'
//!   columns of the output in place (tasks own disjoint blocks of it). At most `TILE_ROWS` rows
//!   of scores exist at once per task; the full score matrix never does, and a block pattern's
//!   time per token does not grow with the sequence.
//!
//! The pool's threads take rows or blocks.
//!
//! Both ops read their tensors through `Layout`s — strides of batch, head and row and a first
//! column — so `attention` over `[b, h, s, d]` tensors and `packed_attention` over one packed
//! projection `[b, s, width]` are the same loop.

use super::{Arg, CpuError, R, debug_span};
use kiln_compiler::graph::{Op, PackedAttention, ScoreMods};
use kiln_compiler::semantics::{alibi_slopes, attended_blocks, relative_bucket, score_operands};
use rayon::prelude::*;

/// Where element `d` of head `h`, row `t`, batch `b` of a tensor is: `b * batch + h * head + t *
/// row + col + d`.
#[derive(Clone, Copy, Debug)]
struct Layout {
    batch: usize,
    head: usize,
    row: usize,
    col: usize,
}

impl Layout {
    fn at(&self, b: usize, h: usize, t: usize) -> usize {
        b * self.batch + h * self.head + t * self.row + self.col
    }
}

/// The output `[b, s, width]` of an attention step, which the prefill form's tasks write in
/// place: each task its own rows (one sequence's block of query rows) and its own columns (its
/// key/value head's query heads), so no two write the same element.
#[derive(Clone, Copy)]
struct Output {
    ptr: *mut f32,
    len: usize,
    width: usize,
}

// SAFETY: an `Output` is only written through by tasks that own disjoint blocks of it (see
// `Rows::block`), while the slice it was made from is borrowed by `run`.
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

/// Query rows per task of the prefill form: large enough that its two GEMMs run the `gemm`
/// crate's kernels at speed.
const TILE_ROWS: usize = 64;

/// The fewest query rows that take the prefill form (fewer run one task per row).
const MIN_BLOCK_ROWS: usize = 16;

/// The geometry and options of one attention step.
struct Geometry {
    b: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    /// Query rows.
    s: usize,
    /// Key rows.
    t: usize,
    scale: f32,
    alibi: bool,
    causal: bool,
    window: Option<usize>,
    mods: ScoreMods,
}

impl Geometry {
    /// The geometry of packed attention `p` over `b` batches of `s` query rows and `t` key rows.
    fn packed(p: &PackedAttention, b: usize, s: usize, t: usize) -> Geometry {
        let PackedAttention { heads, kv_heads, head_dim: d, alibi, causal, window, mods, .. } = *p;
        Geometry { b, heads, kv_heads, d, s, t, scale: p.scale.0, alibi, causal, window, mods }
    }
}

/// Runs an attention step into `out` (`[b, s, heads * d]`).
pub fn forward(op: &Op, args: &[(Vec<usize>, Arg<'_>)], out: &mut [f32], shape: &[usize]) -> R<()> {
    let bad = |m: &str| CpuError::Operands(m.to_string());
    match *op {
        Op::Attention { scale, alibi, causal, window, mods } => {
            let [(qs, q), (ks, k), (vs, v), rest @ ..] = args else { return Err(bad("attention needs q, k and v")) };
            let (&[b, h, s, d], &[_, kv, t, _]) = (qs.as_slice(), ks.as_slice()) else {
                return Err(bad("q must be [b, h, s, d] and k [b, kv, t, d]"));
            };
            if kv == 0 || h % kv != 0 || vs != ks {
                return Err(bad("key/value heads must divide the query heads, and v be shaped as k"));
            }
            let g = Geometry { b, heads: h, kv_heads: kv, d, s, t, scale: scale.0, alibi, causal, window, mods };
            let ql = Layout { batch: h * s * d, head: s * d, row: d, col: 0 };
            let (mask, table) = optional(rest, &g)?;
            let (k, v) = (heads_of(k, kv, t, d, "k")?, heads_of(v, kv, t, d, "v")?);
            run(&g, (q.f32("q")?, ql), k, v, mask, table, out, shape)
        }
        // The WGSL back end's form; a neutral plan, which the CPU runs, never has it.
        Op::PackedAttention(PackedAttention { appends: true, .. }) => {
            Err(bad("appends to the caches, which only the WGSL back end's plans do"))
        }
        Op::PackedAttention(p) if p.cached => {
            // Queries in place in the packed rows; keys and values from the cache operands.
            let [(xs, x), (ks, k), (vs, v), rest @ ..] = args else {
                return Err(bad("cached packed attention needs its projection, keys and values"));
            };
            let (&[b, s, width], &[_, kv, t, d]) = (xs.as_slice(), ks.as_slice()) else {
                return Err(bad("qkv must be [b, s, width] and k [b, kv, t, d]"));
            };
            if kv != p.kv_heads || d != p.head_dim || p.heads % kv != 0 || vs != ks || p.q + p.heads * d > width {
                return Err(bad("the heads do not fit the packed projection and the cache"));
            }
            let g = Geometry::packed(&p, b, s, t);
            let ql = Layout { batch: s * width, head: d, row: width, col: p.q };
            let (mask, table) = optional(rest, &g)?;
            let (k, v) = (heads_of(k, kv, t, d, "k")?, heads_of(v, kv, t, d, "v")?);
            run(&g, (x.f32("qkv")?, ql), k, v, mask, table, out, shape)
        }
        Op::PackedAttention(p) => {
            let [(xs, x), rest @ ..] = args else { return Err(bad("packed attention needs its projection")) };
            let &[b, s, width] = xs.as_slice() else { return Err(bad("qkv must be [b, s, width]")) };
            let d = p.head_dim;
            if p.kv_heads == 0
                || p.heads % p.kv_heads != 0
                || p.q + p.heads * d > width
                || p.k + p.kv_heads * d > width
                || p.v + p.kv_heads * d > width
            {
                return Err(bad("the heads do not fit the packed projection"));
            }
            let g = Geometry::packed(&p, b, s, s);
            let at = |col| Layout { batch: s * width, head: d, row: width, col };
            let x = x.f32("qkv")?;
            let (mask, table) = optional(rest, &g)?;
            run(&g, (x, at(p.q)), (x, at(p.k)), (x, at(p.v)), mask, table, out, shape)
        }
        _ => Err(bad("not an attention op")),
    }
}

/// Linformer's low-rank projection ([`Op::LowRank`]) into `out` (`[b, heads, r, head_dim]`): per
/// batch and head, one GEMM `E[..n]^T X_h` reading the head's columns of the packed rows in place.
pub fn low_rank(op: &Op, args: &[(Vec<usize>, Arg<'_>)], out: &mut [f32], shape: &[usize]) -> R<()> {
    let bad = |m: String| CpuError::Operands(m);
    let &Op::LowRank { start, heads, head_dim } = op else { return Err(bad("not a low-rank projection".into())) };
    let [(xs, x), (es, e)] = args else { return Err(bad("low_rank takes x and e".into())) };
    let (&[b, n, width], &[rows, r]) = (xs.as_slice(), es.as_slice()) else {
        return Err(bad("x must be [b, n, width] and e [rows, r]".into()));
    };
    let (x, e) = (x.f32("x")?, e.f32("e")?);
    if n > rows {
        return Err(bad(format!("{n} rows asked of a low-rank projection of {rows}: the sequence is longer than it")));
    }
    if start + heads * head_dim > width
        || shape != [b, heads, r, head_dim]
        || out.len() != b * heads * r * head_dim
        || x.len() != b * n * width
        || e.len() != rows * r
    {
        return Err(bad(format!("operands do not fit low_rank into {shape:?}")));
    }
    out.par_chunks_mut((r * head_dim).max(1)).enumerate().for_each(|(bh, o)| {
        let (bi, h) = (bh / heads, bh % heads);
        // SAFETY: `o` holds r x head_dim; `e` holds n x r (n <= rows), read transposed; `x` holds
        // the n rows of batch `bi`, this head's head_dim columns at stride `width` (all checked above).
        debug_span("low-rank output", o.len(), 0, (r, head_dim), (head_dim, 1));
        debug_span("low-rank projection", e.len(), 0, (n, r), (r, 1));
        debug_span("low-rank rows", x.len(), bi * n * width + start + h * head_dim, (n, width), (head_dim, 1));
        unsafe {
            gemm::gemm(
                r,
                head_dim,
                n,
                o.as_mut_ptr(),
                1,
                head_dim as isize,
                false,
                e.as_ptr(),
                r as isize,
                1,
                x.as_ptr().add(bi * n * width + start + h * head_dim),
                1,
                width as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
    Ok(())
}

/// A `[b, heads, rows, d]` operand and its layout: contiguous, or a cache buffer with room for
/// more rows per head (read in place through its head stride).
fn heads_of<'a>(x: &Arg<'a>, heads: usize, rows: usize, d: usize, what: &str) -> R<(&'a [f32], Layout)> {
    match *x {
        Arg::Cache { data, cap } if cap >= rows => {
            Ok((data, Layout { batch: heads * cap * d, head: cap * d, row: d, col: 0 }))
        }
        _ => Ok((x.f32(what)?, Layout { batch: heads * rows * d, head: rows * d, row: d, col: 0 })),
    }
}

/// An attention step's key mask and relative bias table, each if it has one.
type Optional<'a> = (Option<&'a [f32]>, Option<&'a [f32]>);

/// The optional key mask `[b, t]` and relative bias table `[buckets, heads]` (last, when the
/// geometry's modifiers have one).
fn optional<'a>(rest: &[(Vec<usize>, Arg<'a>)], g: &Geometry) -> R<Optional<'a>> {
    let (mask, table) = score_operands(rest, &g.mods);
    if rest.len() > 1 + usize::from(table.is_some()) {
        return Err(CpuError::Operands("attention takes at most a key mask and a bias table".into()));
    }
    let mask = match mask {
        None => None,
        Some((_, m)) => Some(sized(m.f32("the key mask")?, "a key mask", [g.b, g.t], " keys")?),
    };
    let table = match (table, g.mods.relative) {
        (Some((_, t)), Some(r)) => Some(sized(t.f32("the bias table")?, "a bias table", [r.buckets, g.heads], "")?),
        (None, Some(_)) => return Err(CpuError::Operands("a relative bias without its table".into())),
        _ => None,
    };
    Ok((mask, table))
}

/// `x`, the elements of a `[rows, cols]` operand, if it holds that many; the error names it
/// (`what`, then `unit` after the shape).
fn sized<'a>(x: &'a [f32], what: &str, [rows, cols]: [usize; 2], unit: &str) -> R<&'a [f32]> {
    if x.len() != rows * cols {
        return Err(CpuError::Operands(format!("{what} of {} elements for [{rows}, {cols}]{unit}", x.len())));
    }
    Ok(x)
}

#[expect(clippy::too_many_arguments, reason = "the operands of one attention step, each with its layout")]
fn run(
    g: &Geometry,
    (q, ql): (&[f32], Layout),
    (k, kl): (&[f32], Layout),
    (v, vl): (&[f32], Layout),
    mask: Option<&[f32]>,
    table: Option<&[f32]>,
    out: &mut [f32],
    shape: &[usize],
) -> R<()> {
    let (b, h, kv, d, s, t) = (g.b, g.heads, g.kv_heads, g.d, g.s, g.t);
    let width = h * d;
    let last = |l: &Layout, heads: usize, rows: usize| {
        if b * heads * rows * d == 0 { 0 } else { l.at(b - 1, heads - 1, rows - 1) + d }
    };
    if shape != [b, s, width]
        || out.len() != b * s * width
        || q.len() < last(&ql, h, s)
        || k.len() < last(&kl, kv, t)
        || v.len() < last(&vl, kv, t)
    {
        return Err(CpuError::Operands(format!("operands do not fit attention into {shape:?}")));
    }
    if out.is_empty() {
        return Ok(());
    }
    let group = h / kv;
    let slopes = if g.alibi { alibi_slopes(h) } else { Vec::new() };
    // The absolute position of query row 0 among the keys (queries are the last `s` of `t`).
    let offset = t - s.min(t);
    let rows = Rows { g, q: (q, ql), k: (k, kl), v: (v, vl), mask, table, slopes: &slopes, group, offset };
    // Prefill: blocks of query rows per key/value head, each against the keys its rows attend —
    // one range for a causal or windowed block, the attended key blocks of a block pattern (its
    // query blocks are the row blocks, so every row of one attends the same keys).
    let tile = match g.mods.sparse {
        Some(p) => p.block.max(1),
        None => TILE_ROWS,
    };
    // (A block pattern's row blocks are its query blocks only when the queries start on a block.)
    if s >= MIN_BLOCK_ROWS && offset % tile == 0 {
        let blocks = s.div_ceil(tile);
        let dst = Output { ptr: out.as_mut_ptr(), len: out.len(), width };
        (0..b * kv * blocks).into_par_iter().for_each_init(Vec::new, |scratch, task| {
            let (bi, kvh, rb) = (task / (kv * blocks), task / blocks % kv, task % blocks);
            // SAFETY: the tasks' (sequence, row block, key/value head) triples are distinct, so
            // their blocks of `out` are disjoint; `out` is `[b, s, width]` (checked above) and
            // outlives the loop.
            unsafe { rows.block(bi, kvh, rb * tile..((rb + 1) * tile).min(s), scratch, dst) }
        });
        return Ok(());
    }
    // Decoding and short rows: a task per query row and key/value head (a decode step's one row
    // spread over the threads by its heads), each writing its heads' columns of the row — or,
    // where those are too few to keep the threads busy and the keys are many, a task per row,
    // head and part of the keys, the parts' softmax statistics combined after (flash-decoding).
    let tasks = b * s * kv;
    let parts = key_parts(tasks, t, rayon::current_num_threads());
    if parts > 1 {
        let len = t.div_ceil(parts);
        let partials: Vec<Partial> = (0..tasks * parts)
            .into_par_iter()
            .map_init(
                || vec![0.0f32; group * t],
                |scores, i| {
                    let (task, p) = (i / parts, i % parts);
                    rows.part(task / kv, task % kv, p * len..((p + 1) * len).min(t), scores)
                },
            )
            .collect();
        out.par_chunks_mut(group * d)
            .zip(partials.par_chunks(parts))
            .enumerate()
            .for_each(|(task, (o, parts))| rows.combine(task / kv, task % kv, parts, o));
        return Ok(());
    }
    out.par_chunks_mut(group * d).enumerate().for_each_init(
        || (vec![0.0f32; group * t], vec![0.0f32; group * d]),
        |(scores, acc), (task, o)| rows.run(task / kv, task % kv, o, scores, acc),
    );
    Ok(())
}

/// Keys ahead of the one being scored whose row is asked for ([`prefetch_rows`]).
#[cfg(target_arch = "x86_64")]
const PREFETCH_KEYS: usize = 8;

/// Asks for key row `ti + PREFETCH_KEYS` and value row `ti` of key/value head `kvh` (a hint: the
/// rows need not exist), into L2. A decode step's keys and values are cold — every projection's
/// weights since the layer's last step have passed through the caches — so the scores waited
/// on memory key by key, and the values' pass after them again; asked for ahead, the values
/// arrive during the scores. (SmolLM2-135M's decode attention on 2 threads of the Intel Xeon,
/// 2026-11-28: 45 -> 33-36 µs a layer at 32-130 keys.)
#[inline(always)]
fn prefetch_rows(rows: &Rows<'_>, bi: usize, kvh: usize, ti: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let d = rows.g.d;
        let key = rows.k.0.as_ptr().wrapping_add(rows.k.1.at(bi, kvh, ti + PREFETCH_KEYS));
        let value = rows.v.0.as_ptr().wrapping_add(rows.v.1.at(bi, kvh, ti));
        for at in (0..d).step_by(16) {
            // SAFETY: SSE is in every x86-64 CPU; a prefetch dereferences nothing.
            unsafe {
                super::isa::x86::prefetch(key.wrapping_add(at).cast());
                super::isa::x86::prefetch(value.wrapping_add(at).cast());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (rows, bi, kvh, ti);
}

/// The fewest keys a part of a row's keys holds ([`key_parts`]): at 64, SmolLM2-135M's 3
/// key/value heads were not split below 128 keys, and 2 threads took them 2 to 1 (its decode
/// attention 45 -> 31 µs a layer at 32-130 keys with 32, 2026-11-28, Intel Xeon).
const MIN_PART_KEYS: usize = 32;

/// Into how many parts the keys of each of `tasks` rows and key/value heads are split over
/// `threads` threads: enough for two tasks a thread, each part at least [`MIN_PART_KEYS`]
/// keys; 1 (no split) where the tasks alone are that many.
fn key_parts(tasks: usize, keys: usize, threads: usize) -> usize {
    if tasks == 0 || tasks >= 2 * threads {
        return 1;
    }
    (2 * threads).div_ceil(tasks).min(keys / MIN_PART_KEYS).max(1)
}

/// One part of the keys of a query row's heads of one key/value head ([`Rows::part`]): per
/// head, the largest logit over the part's keys and the sum of the exponentials shifted by it
/// (negative infinity and 0 for a part with none of the row's keys), and those exponentials times
/// the values, summed (`group * d`).
struct Partial {
    stats: Vec<(f32, f64)>,
    acc: Vec<f32>,
}

/// What every query row of one attention step reads.
struct Rows<'a> {
    g: &'a Geometry,
    q: (&'a [f32], Layout),
    k: (&'a [f32], Layout),
    v: (&'a [f32], Layout),
    mask: Option<&'a [f32]>,
    table: Option<&'a [f32]>,
    slopes: &'a [f32],
    group: usize,
    offset: usize,
}

impl Rows<'_> {
    /// The logits of query row `si` of batch `bi` for the query heads of key/value head `kvh`
    /// against `keys` (in order), into `scores` (head `j`'s at `j * t`, one a key): scaled,
    /// soft-capped, with ALiBi's and a relative bias's terms; a key the key mask hides at the
    /// most negative float.
    #[inline(always)]
    fn scores(&self, bi: usize, si: usize, kvh: usize, keys: impl Iterator<Item = usize>, scores: &mut [f32]) {
        let (g, (q, ql), (k, kl)) = (self.g, self.q, self.k);
        let (t, d) = (g.t, g.d);
        let qi = si + self.offset;
        let heads = kvh * self.group..(kvh + 1) * self.group;
        for (e, ti) in keys.enumerate() {
            prefetch_rows(self, bi, kvh, ti);
            let krow = &k[kl.at(bi, kvh, ti)..][..d];
            let masked = self.mask.is_some_and(|m| m[bi * t + ti] == 0.0);
            let bucket = g
                .mods
                .relative
                .map(|r| relative_bucket(ti as i64 - qi as i64, r.bidirectional, r.buckets, r.max_distance));
            for (j, hq) in heads.clone().enumerate() {
                let qrow = &q[ql.at(bi, hq, si)..][..d];
                let mut x = dot(qrow, krow) * g.scale;
                if let Some(cap) = g.mods.softcap {
                    x = cap.0 * (x / cap.0).tanh();
                }
                if g.alibi {
                    x += self.slopes[hq] * (ti as f32 - qi as f32);
                }
                if let (Some(b), Some(table)) = (bucket, self.table) {
                    x += table[b * g.heads + hq];
                }
                scores[j * t + e] = if masked { f32::MIN } else { x };
            }
        }
    }

    /// [`Rows::part_inner`], compiled with AVX2 and FMA where the CPU has them.
    fn part(&self, row: usize, kvh: usize, keys: std::ops::Range<usize>, scores: &mut [f32]) -> Partial {
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa().avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time); the callee is the safe body
            // compiled with them (checked indexing only): no bound to state.
            return unsafe { self.part_avx2(row, kvh, keys, scores) };
        }
        self.part_inner(row, kvh, keys, scores)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn part_avx2(&self, row: usize, kvh: usize, keys: std::ops::Range<usize>, scores: &mut [f32]) -> Partial {
        self.part_inner(row, kvh, keys, scores)
    }

    /// The statistics of query row `row`'s heads of key/value head `kvh` over the keys in
    /// `part` that the row attends ([`Partial`]): the logits as [`Rows::row`] computes them
    /// (masked keys at the most negative float), with scratch `scores` (`group * t`).
    #[inline(always)]
    fn part_inner(&self, row: usize, kvh: usize, part: std::ops::Range<usize>, scores: &mut [f32]) -> Partial {
        let (g, (v, vl)) = (self.g, self.v);
        let (s, t, d) = (g.s, g.t, g.d);
        let (bi, si) = (row / s, row % s);
        let ranges: Vec<(usize, usize)> = self
            .key_ranges(si)
            .into_iter()
            .filter_map(|(a, z)| {
                let (a, z) = (a.max(part.start), z.min(part.end));
                (a < z).then_some((a, z))
            })
            .collect();
        let n: usize = ranges.iter().map(|&(a, z)| z - a).sum();
        let keys = || ranges.iter().flat_map(|&(a, z)| a..z);
        let heads = kvh * self.group..(kvh + 1) * self.group;
        let mut out = Partial { stats: vec![(f32::NEG_INFINITY, 0.0); self.group], acc: vec![0.0; self.group * d] };
        if n == 0 {
            return out;
        }
        self.scores(bi, si, kvh, keys(), scores);
        for j in 0..heads.len() {
            let sc = &mut scores[j * t..][..n];
            let max = max_of(sc);
            super::math::exp_shifted(sc, max);
            let a = &mut out.acc[j * d..][..d];
            for (ti, &p) in keys().zip(sc.iter()) {
                add_scaled(a, &v[vl.at(bi, kvh, ti)..][..d], p);
            }
            out.stats[j] = (max, sum_of(sc));
        }
        out
    }

    /// Query row `row`'s heads of key/value head `kvh` into `o` from the [`Partial`]s of its
    /// keys: per head, with `M` the largest of the parts' maxima, `sum_p acc_p * e^(m_p - M) /
    /// sum_p l_p * e^(m_p - M)`; a row whose every key is masked (or that attends none) is the
    /// mean of all the values, as the interpreter's softmax makes it.
    fn combine(&self, row: usize, kvh: usize, parts: &[Partial], o: &mut [f32]) {
        let (g, (v, vl)) = (self.g, self.v);
        let (d, t) = (g.d, g.t);
        let bi = row / g.s;
        for j in 0..self.group {
            let o = &mut o[j * d..][..d];
            o.fill(0.0);
            let top = parts.iter().map(|p| p.stats[j].0).fold(f32::NEG_INFINITY, f32::max);
            if top <= f32::MIN {
                for ti in 0..t {
                    add_scaled(o, &v[vl.at(bi, kvh, ti)..][..d], 1.0);
                }
                o.iter_mut().for_each(|x| *x /= t as f32);
                continue;
            }
            let weights: Vec<f64> = parts.iter().map(|p| f64::from(p.stats[j].0 - top).exp()).collect();
            let sum: f64 = parts.iter().zip(&weights).map(|(p, w)| p.stats[j].1 * w).sum();
            for (p, &w) in parts.iter().zip(&weights) {
                add_scaled(o, &p.acc[j * d..][..d], (w / sum) as f32);
            }
        }
    }

    /// The heads of key/value head `kvh` of query row `row` (of `b * s`) into `o` (their
    /// `group * d` columns of the row), with scratch `scores` (`group * t`) and `acc` (`group *
    /// d`): the AVX2/FMA build of the loop where the CPU has it.
    fn run(&self, row: usize, kvh: usize, o: &mut [f32], scores: &mut [f32], acc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa().avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time); the callee is the safe body
            // compiled with them (checked indexing only): no bound to state.
            unsafe { self.row_avx2(row, kvh, o, scores, acc) };
            return;
        }
        self.row(row, kvh, o, scores, acc)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn row_avx2(&self, row: usize, kvh: usize, o: &mut [f32], scores: &mut [f32], acc: &mut [f32]) {
        self.row(row, kvh, o, scores, acc)
    }

    /// Query rows `rows` of batch `bi` for the query heads of key/value head `kvh`, written into
    /// their rows and the head's `group * d` columns of `out`, through the `gemm` crate: per
    /// query head, the scores `Q K^T` of the block's rows against every key any of them attends
    /// (one GEMM, with the scale), the softmax of each row over its own keys (the others, and
    /// masked keys, at -inf), then `P V` (a second GEMM, straight into `out`). `p` is scratch
    /// for the probabilities.
    ///
    /// # Safety
    ///
    /// `out` is the step's `[b, s, heads * d]` output, and no other thread reads or writes these
    /// rows' columns of this key/value head while the call runs.
    unsafe fn block(&self, bi: usize, kvh: usize, rows: std::ops::Range<usize>, p: &mut Vec<f32>, out: Output) {
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa().avx512f {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked at run time); the callee is the
            // body compiled with them; `out` as the caller's.
            return unsafe { self.block_avx512(bi, kvh, rows, p, out) };
        }
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa().avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time); `out` as the caller's.
            return unsafe { self.block_avx2(bi, kvh, rows, p, out) };
        }
        // SAFETY: the caller's.
        unsafe { self.block_inner(bi, kvh, rows, p, out) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_avx2(&self, bi: usize, kvh: usize, rows: std::ops::Range<usize>, p: &mut Vec<f32>, out: Output) {
        // SAFETY: the caller's.
        unsafe { self.block_inner(bi, kvh, rows, p, out) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn block_avx512(&self, bi: usize, kvh: usize, rows: std::ops::Range<usize>, p: &mut Vec<f32>, out: Output) {
        // SAFETY: the caller's.
        unsafe { self.block_inner(bi, kvh, rows, p, out) }
    }

    /// The keys query row `si` may attend by position, `[lo, hi)`: causal rows stop at their own
    /// position, window rows start at their earliest key.
    fn positions(&self, si: usize) -> (usize, usize) {
        let (g, qi) = (self.g, si + self.offset);
        let hi = if g.causal { (qi + 1).min(g.t) } else { g.t };
        let lo = g.window.map_or(0, |w| (qi + 1).saturating_sub(w)).min(hi);
        (lo, hi)
    }

    /// The keys a row attends, as ascending ranges: by position, or the key blocks of its query
    /// block under a block pattern.
    fn key_ranges(&self, si: usize) -> Vec<(usize, usize)> {
        let (g, t) = (self.g, self.g.t);
        match g.mods.sparse {
            Some(p) => {
                let block = p.block.max(1);
                let blocks = g.s.max(t).div_ceil(block);
                let qb = (si + self.offset) / block;
                // Blocks past the keys (a query block beyond them) attend nothing there.
                (attended_blocks(&p, qb, blocks).into_iter())
                    .map(|kb| ((kb * block).min(t), ((kb + 1) * block).min(t)))
                    .filter(|(a, z)| a < z)
                    .collect()
            }
            None => vec![self.positions(si)],
        }
    }

    /// [`Rows::block`]'s body, built for the baseline, for AVX2/FMA and for AVX-512.
    ///
    /// # Safety
    ///
    /// As [`Rows::block`].
    #[inline(always)]
    unsafe fn block_inner(&self, bi: usize, kvh: usize, rows: std::ops::Range<usize>, p: &mut Vec<f32>, out: Output) {
        let (g, (q, ql), (k, kl), (v, vl)) = (self.g, self.q, self.k, self.v);
        let (s, t, d, group) = (g.s, g.t, g.d, self.group);
        // The block's keys: the union of its rows' ranges (one range by position; a block
        // pattern's rows all share their query block's), each range at a column offset of `p`.
        let ranges: Vec<(usize, usize)> = match g.mods.sparse {
            Some(_) => self.key_ranges(rows.start),
            None => {
                let (first, last) = (self.positions(rows.start), self.positions(rows.end - 1));
                vec![(first.0.min(last.0), first.1.max(last.1))]
            }
        };
        let n: usize = ranges.iter().map(|&(a, z)| z - a).sum();
        let keys = || ranges.iter().flat_map(|&(a, z)| a..z);
        let m = rows.len();
        p.clear();
        p.resize(m * n, 0.0);
        // Per row of the block: 1 / the softmax's sum, or `None` for a row whose every key is
        // masked.
        let mut inv: Vec<Option<f32>> = vec![None; m];
        // The key mask of this sequence over the block's keys, once per block.
        let masked: Option<Vec<bool>> = self.mask.map(|mask| keys().map(|ti| mask[bi * t + ti] != 0.0).collect());
        // This block's rows of `out`, `out.width` apart, from its first row's first column of
        // this key/value head.
        let first = (bi * s + rows.start) * out.width + kvh * group * d;
        for j in 0..group {
            let hq = kvh * group + j;
            let mut col = 0;
            for &(k0, k1) in &ranges {
                // SAFETY: `q` holds the block's rows of head `hq` at stride `ql.row`, `k` and `v`
                // its keys `k0..k1` of head `kvh` at strides `kl.row` / `vl.row` (checked by
                // `run`), `p` holds m x n with these keys' columns at `col..col + k1 - k0`.
                debug_assert!(
                    k0 <= k1 && k1 <= t && col + (k1 - k0) <= n,
                    "keys {k0}..{k1} of {t}, column {col} of {n}"
                );
                debug_span("attention scores", p.len(), col, (m, n), (k1 - k0, 1));
                debug_span("attention queries", q.len(), ql.at(bi, hq, rows.start), (m, ql.row), (d, 1));
                debug_span("attention keys", k.len(), kl.at(bi, kvh, k0), (k1 - k0, kl.row), (d, 1));
                unsafe {
                    gemm::gemm(
                        m,
                        k1 - k0,
                        d,
                        p.as_mut_ptr().add(col),
                        1,
                        n as isize,
                        false,
                        q.as_ptr().add(ql.at(bi, hq, rows.start)),
                        1,
                        ql.row as isize,
                        k.as_ptr().add(kl.at(bi, kvh, k0)),
                        kl.row as isize,
                        1,
                        0.0,
                        g.scale,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                col += k1 - k0;
            }
            for (i, si) in rows.clone().enumerate() {
                let row = &mut p[i * n..][..n];
                let (a, z) = self.logits(si, hq, &ranges, row, masked.as_deref(), None);
                let max = max_of(row);
                if z == a || max <= f32::MIN {
                    // Every key masked: written below, after `P V` (this row's zeros add nothing).
                    row.fill(0.0);
                    inv[i] = None;
                    continue;
                }
                // Numerators here; each output row is divided by its sum after `P V` (d values
                // a row rather than n).
                super::math::exp_shifted(row, max);
                inv[i] = Some((1.0 / sum_of(row)) as f32);
            }
            // This head's columns of the block's rows.
            let head = first + j * d;
            debug_span("attention output", out.len, head, (m, out.width), (d, 1));
            let mut col = 0;
            for &(k0, k1) in &ranges {
                // SAFETY: as above; the block's rows of `out` are `out.width` apart, this head's
                // columns at `head` (inside `out`: debug-checked above, and `run` checked that
                // `out` is `[b, s, width]`), written by this task alone (the caller's). The first
                // range's product overwrites them, the others add to it.
                debug_span("attention probabilities", p.len(), col, (m, n), (k1 - k0, 1));
                debug_span("attention values", v.len(), vl.at(bi, kvh, k0), (k1 - k0, vl.row), (d, 1));
                unsafe {
                    gemm::gemm(
                        m,
                        d,
                        k1 - k0,
                        out.ptr.add(head),
                        1,
                        out.width as isize,
                        col > 0,
                        p.as_ptr().add(col),
                        1,
                        n as isize,
                        v.as_ptr().add(vl.at(bi, kvh, k0)),
                        1,
                        vl.row as isize,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                col += k1 - k0;
            }
            for (i, inv) in inv.iter().enumerate() {
                // SAFETY: row `i` of this head's columns, inside `out` as above and this task's.
                let o = unsafe { std::slice::from_raw_parts_mut(out.ptr.add(head + i * out.width), d) };
                match *inv {
                    Some(r) => o.iter_mut().for_each(|x| *x *= r),
                    None => {
                        // Every key masked: uniform over all keys, as the interpreter's softmax.
                        o.fill(0.0);
                        for ti in 0..t {
                            add_scaled(o, &v[vl.at(bi, kvh, ti)..][..d], 1.0 / t as f32);
                        }
                    }
                }
            }
        }
    }

    /// Turns `row`, query row `si`'s scaled scores for head `hq` over the keys `ranges` (in
    /// order), into logits: keys outside the row's own range (by position), or hidden by
    /// `masked` (a key mask over the same keys), at -inf; the score modifiers on the others.
    /// With `capped`, the soft-capped scores (before any bias) are copied there too (zeros outside
    /// the row's range). Returns the
    /// columns `[a, z)` of the row's own range. (Whole slices and branch-free selects where it
    /// can.)
    #[inline(always)]
    fn logits(
        &self,
        si: usize,
        hq: usize,
        ranges: &[(usize, usize)],
        row: &mut [f32],
        masked: Option<&[bool]>,
        capped: Option<&mut [f32]>,
    ) -> (usize, usize) {
        let g = self.g;
        let qi = si + self.offset;
        let keys = || ranges.iter().flat_map(|&(a, z)| a..z);
        let n = row.len();
        let (a, z) = match (g.mods.sparse, ranges.first()) {
            (None, Some(&(first, _))) => {
                let (lo, hi) = self.positions(si);
                (lo - first, hi - first)
            }
            _ => (0, n),
        };
        row[..a].fill(f32::NEG_INFINITY);
        row[z..].fill(f32::NEG_INFINITY);
        if let Some(cap) = g.mods.softcap {
            row[a..z].iter_mut().for_each(|x| *x = cap.0 * (*x / cap.0).tanh());
            if let Some(c) = capped {
                // (0 outside the row's range, where its probabilities are 0 too.)
                c.fill(0.0);
                c[a..z].copy_from_slice(&row[a..z]);
            }
        }
        if g.alibi {
            let slope = self.slopes[hq];
            for (ti, x) in keys().zip(row.iter_mut()).skip(a).take(z - a) {
                *x += slope * (ti as f32 - qi as f32);
            }
        }
        if let (Some(table), Some(r)) = (self.table, g.mods.relative) {
            for (ti, x) in keys().zip(row.iter_mut()).skip(a).take(z - a) {
                let bucket = relative_bucket(ti as i64 - qi as i64, r.bidirectional, r.buckets, r.max_distance);
                *x += table[bucket * g.heads + hq];
            }
        }
        if let Some(keep) = masked {
            for (x, &keep) in row[a..z].iter_mut().zip(&keep[a..z]) {
                *x = if keep { *x } else { f32::NEG_INFINITY };
            }
        }
        (a, z)
    }

    #[inline(always)]
    fn row(&self, row: usize, kvh: usize, o: &mut [f32], scores: &mut [f32], acc: &mut [f32]) {
        let (g, (v, vl)) = (self.g, self.v);
        let (s, t, d) = (g.s, g.t, g.d);
        let (bi, si) = (row / s, row % s);
        // Keys this row attends (only those are visited); a key mask hides more within them.
        let ranges = self.key_ranges(si);
        let n: usize = ranges.iter().map(|&(a, z)| z.saturating_sub(a)).sum();
        let keys = || ranges.iter().flat_map(|&(a, z)| a..z);
        let heads = kvh * self.group..(kvh + 1) * self.group;
        // Scores for every head of the group, one key row at a time.
        self.scores(bi, si, kvh, keys(), scores);
        for j in 0..heads.len() {
            let sc = &mut scores[j * t..][..n];
            let max = max_of(sc);
            let a = &mut acc[j * d..][..d];
            a.fill(0.0);
            let o = &mut o[j * d..][..d];
            if n == 0 || max == f32::MIN {
                // Every key masked: the interpreter's softmax is uniform over all keys.
                for ti in 0..t {
                    add_scaled(a, &v[vl.at(bi, kvh, ti)..][..d], 1.0);
                }
                for (o, &a) in o.iter_mut().zip(a.iter()) {
                    *o = a / t as f32;
                }
                continue;
            }
            super::math::exp_shifted(sc, max);
            let sum = sum_of(sc);
            for (ti, &p) in keys().zip(sc.iter()) {
                let p = (p as f64 / sum) as f32;
                add_scaled(a, &v[vl.at(bi, kvh, ti)..][..d], p);
            }
            o.copy_from_slice(a);
        }
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums, so the loop vectorizes without reassociating one chain.
    let mut acc = [0.0f32; 8];
    let (ca, ra) = a.as_chunks::<8>();
    let (cb, rb) = b.as_chunks::<8>();
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// The largest element (NaNs passed over, as `f32::max` does), with sixteen running maxima so the
/// reduction is not one serial chain; a compare and select, which compiles to one `vmaxps` a
/// vector (`f32::max`'s NaN handling costs two more). The maxima are folded in halves (a tree of
/// four steps, not a chain of sixteen compares: a row of 128 scores spent as long folding its
/// maxima as finding them).
#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let (chunks, rest) = x.as_chunks::<16>();
    for c in chunks {
        for (m, &v) in m.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    for (m, &v) in m.iter_mut().zip(rest) {
        *m = if v > *m { v } else { *m };
    }
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            m[i] = if m[i + w] > m[i] { m[i + w] } else { m[i] };
        }
    }
    m[0]
}

/// The sum in f64 (as the interpreter's softmax sums), over eight partial sums folded in halves.
#[inline(always)]
fn sum_of(x: &[f32]) -> f64 {
    let mut s = [0.0f64; 8];
    let (chunks, rest) = x.as_chunks::<8>();
    for c in chunks {
        for (s, &v) in s.iter_mut().zip(c) {
            *s += v as f64;
        }
    }
    for (s, &v) in s.iter_mut().zip(rest) {
        *s += v as f64;
    }
    let mut w = 8;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            s[i] += s[i + w];
        }
    }
    s[0]
}

#[inline(always)]
fn add_scaled(acc: &mut [f32], x: &[f32], p: f32) {
    for (a, &x) in acc.iter_mut().zip(x) {
        *a += p * x;
    }
}

/// Query rows per tile of the backward: the scores, their gradients and the soft-cap's slopes of
/// one tile are held at once (`3 * BACKWARD_ROWS * keys` floats).
const BACKWARD_ROWS: usize = 64;

/// The gradients of an attention ([`Op::AttentionGrad`]) into `out` (`[3, b, h, s, d]`): one task
/// per batch and query head, which owns that head's rows of all three gradients and walks its
/// query rows in tiles of `BACKWARD_ROWS`. Per tile, through the `gemm` crate: the scores `Q
/// K^T` against the keys the tile attends, each row's logits and softmax in place, `dP = dO
/// V^T`, the score gradients `dS = P (dP - rowsum(P dP))` (times the soft-cap's slope and the
/// scale) in place of `dP`, then `dQ = dS K` for the tile's rows and `dK += dS^T Q`, `dV += P^T
/// dO` for its keys. Nothing of the score matrix outlives its tile.
pub fn backward(op: &Op, args: &[(Vec<usize>, Arg<'_>)], out: &mut [f32], shape: &[usize]) -> R<()> {
    let bad = |m: &str| CpuError::Operands(m.to_string());
    let Op::AttentionGrad { scale, alibi, causal, window, mods } = *op else {
        return Err(bad("not an attention's gradient"));
    };
    let [(qs, q), (ks, k), (vs, v), (dos, dout), rest @ ..] = args else {
        return Err(bad("an attention's gradient needs q, k, v and the output's gradient"));
    };
    let (&[b, h, s, d], &[_, kv, t, _]) = (qs.as_slice(), ks.as_slice()) else {
        return Err(bad("q must be [b, h, s, d] and k [b, kv, t, d]"));
    };
    if kv == 0
        || h % kv != 0
        || vs != ks
        || dos != qs
        || t != s
        || shape != [3, b, h, s, d]
        || out.len() != 3 * b * h * s * d
    {
        return Err(bad("operands do not fit an attention's gradient"));
    }
    let g = Geometry { b, heads: h, kv_heads: kv, d, s, t, scale: scale.0, alibi, causal, window, mods };
    let (mask, table) = optional(rest, &g)?;
    let ql = Layout { batch: h * s * d, head: s * d, row: d, col: 0 };
    let (k, v) = (heads_of(k, kv, t, d, "k")?, heads_of(v, kv, t, d, "v")?);
    let (q, dout) = (q.f32("q")?, dout.f32("the output's gradient")?);
    if q.len() != b * h * s * d || dout.len() != q.len() || k.0.len() < b * kv * t * d || v.0.len() < b * kv * t * d {
        return Err(bad("operands do not fit an attention's gradient"));
    }
    if out.is_empty() {
        return Ok(());
    }
    let slopes = if alibi { alibi_slopes(h) } else { Vec::new() };
    let rows = Rows { g: &g, q: (q, ql), k, v, mask, table, slopes: &slopes, group: h / kv, offset: 0 };
    let head = s * d;
    let (dq, rest) = out.split_at_mut(b * h * head);
    let (dk, dv) = rest.split_at_mut(b * h * head);
    dq.par_chunks_mut(head)
        .zip(dk.par_chunks_mut(head))
        .zip(dv.par_chunks_mut(head))
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (task, ((dq, dk), dv))| {
            rows.backward(task / h, task % h, (dout, ql), [dq, dk, dv], scratch)
        });
    Ok(())
}

/// A matrix read by strides out of a slice: element `(i, j)` at `data[at + i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    at: usize,
    cs: usize,
    rs: usize,
}

/// `dst[m x n] (+)= beta * lhs[m x k] @ rhs[k x n]` on this thread, `dst`'s element `(i, j)` at
/// `at + i * rs + j` of its slice (added to with `accumulate`, else overwritten): one `gemm` call
/// of the attention backward's tiles. Every span is checked in debug builds.
fn product(
    dst: &mut [f32],
    (at, rs): (usize, usize),
    (m, n, k): (usize, usize, usize),
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    accumulate: bool,
    beta: f32,
) {
    debug_span("tile product output", dst.len(), at, (m, rs), (n, 1));
    debug_span("tile product left", lhs.data.len(), lhs.at, (m, lhs.rs), (k, lhs.cs));
    debug_span("tile product right", rhs.data.len(), rhs.at, (k, rhs.rs), (n, rhs.cs));
    // SAFETY: `gemm` writes `dst[at + i * rs + j]` (i < m, j < n) and reads `lhs` and `rhs` at
    // the strided spans checked above — within their slices by the callers' shapes (`backward`
    // checks the operands' sizes, the tiles and key ranges lie within them). `dst` is a distinct
    // `&mut`, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(at),
            1,
            rs as isize,
            accumulate,
            lhs.data.as_ptr().add(lhs.at),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr().add(rhs.at),
            rhs.cs as isize,
            rhs.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// A backward task's tiles: probabilities, score gradients, soft-cap slopes.
#[derive(Default)]
struct Scratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    capped: Vec<f32>,
}

impl Rows<'_> {
    /// The gradients of query head `hq` of batch `bi` ([`backward`]) into `dq`, `dk`, `dv` (each
    /// `[s, d]`): the AVX2/FMA build where the CPU has it.
    fn backward(&self, bi: usize, hq: usize, dout: (&[f32], Layout), grads: [&mut [f32]; 3], scratch: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa().avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time); the callee is the safe body
            // compiled with them (its `gemm` calls state and check their own bounds).
            unsafe { self.backward_avx2(bi, hq, dout, grads, scratch) };
            return;
        }
        self.backward_inner(bi, hq, dout, grads, scratch)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn backward_avx2(
        &self,
        bi: usize,
        hq: usize,
        dout: (&[f32], Layout),
        grads: [&mut [f32]; 3],
        scratch: &mut Scratch,
    ) {
        self.backward_inner(bi, hq, dout, grads, scratch)
    }

    #[inline(always)]
    fn backward_inner(
        &self,
        bi: usize,
        hq: usize,
        (dout, dl): (&[f32], Layout),
        [dq, dk, dv]: [&mut [f32]; 3],
        scratch: &mut Scratch,
    ) {
        let (g, (q, ql), (k, kl), (v, vl)) = (self.g, self.q, self.k, self.v);
        let (s, t, d) = (g.s, g.t, g.d);
        let kvh = hq / self.group;
        dq.fill(0.0);
        dk.fill(0.0);
        dv.fill(0.0);
        let tile = match g.mods.sparse {
            Some(p) => p.block.max(1),
            None => BACKWARD_ROWS,
        };
        let Scratch { p, ds, capped } = scratch;
        for r0 in (0..s).step_by(tile) {
            let rows = r0..(r0 + tile).min(s);
            let m = rows.len();
            // The tile's keys, as the forward's tiles take them.
            let ranges: Vec<(usize, usize)> = match g.mods.sparse {
                Some(_) => self.key_ranges(rows.start),
                None => {
                    let (first, last) = (self.positions(rows.start), self.positions(rows.end - 1));
                    vec![(first.0.min(last.0), first.1.max(last.1))]
                }
            };
            let n: usize = ranges.iter().map(|&(a, z)| z - a).sum();
            let masked: Option<Vec<bool>> = self
                .mask
                .map(|mask| ranges.iter().flat_map(|&(a, z)| a..z).map(|ti| mask[bi * t + ti] != 0.0).collect());
            for buf in [&mut *p, &mut *ds] {
                buf.clear();
                buf.resize(m * n, 0.0);
            }
            capped.clear();
            if g.mods.softcap.is_some() {
                capped.resize(m * n, 0.0);
            }
            // Scores and the output's gradient against the values, range by range (`backward`
            // checked the operands' sizes; the ranges lie within the keys).
            let qt = Strided { data: q, at: ql.at(bi, hq, r0), cs: 1, rs: ql.row };
            let ot = Strided { data: dout, at: dl.at(bi, hq, r0), cs: 1, rs: dl.row };
            let mut col = 0;
            for &(k0, k1) in &ranges {
                let w = k1 - k0;
                debug_assert!(k0 <= k1 && k1 <= t && col + w <= n, "keys {k0}..{k1} of {t}, column {col} of {n}");
                let keys = Strided { data: k, at: kl.at(bi, kvh, k0), cs: kl.row, rs: 1 };
                let values = Strided { data: v, at: vl.at(bi, kvh, k0), cs: vl.row, rs: 1 };
                product(p, (col, n), (m, w, d), qt, keys, false, g.scale);
                product(ds, (col, n), (m, w, d), ot, values, false, 1.0);
                col += w;
            }
            // Per row: probabilities in `p`, score gradients in `ds` (over `dp`).
            let mut uniform = Vec::new();
            for (i, si) in rows.clone().enumerate() {
                let row = &mut p[i * n..][..n];
                let cap_row = if capped.is_empty() { None } else { Some(&mut capped[i * n..][..n]) };
                let (a, z) = self.logits(si, hq, &ranges, row, masked.as_deref(), cap_row);
                let max = max_of(row);
                let grad = &mut ds[i * n..][..n];
                if z == a || max <= f32::MIN {
                    // Every key masked: the softmax is uniform over all keys and its gradient is
                    // gated to zero; the values' gradients get the row below.
                    row.fill(0.0);
                    grad.fill(0.0);
                    uniform.push(si);
                    continue;
                }
                super::math::exp_shifted(row, max);
                let inv = (1.0 / sum_of(row)) as f32;
                row.iter_mut().for_each(|x| *x *= inv);
                // The softmax's gradient `p (dp - rowsum(p dp))` as the interpreter's (and the
                // CPU's unfused `softmax_grad`) computes it: the dot and the difference in f64.
                // Under a sharp softmax `dp - dot` cancels nearly to zero; in f32 the step's key
                // and query gradients drifted 0.5% from the interpreter's on a model whose own
                // rounding moved them by 3e-6 (the `train` fuzz target, 2026-11-28).
                let dot = super::math::dot_f64(row, grad);
                let scale = g.scale;
                let softmax_grad = |dp: f32, p: f32| (f64::from(p) * (f64::from(dp) - dot)) as f32;
                match g.mods.softcap {
                    Some(cap) => {
                        let minus = -1.0 / (cap.0 * cap.0);
                        for ((dp, &p), &y) in grad.iter_mut().zip(row.iter()).zip(&capped[i * n..][..n]) {
                            *dp = softmax_grad(*dp, p) * (y * y * minus + 1.0) * scale;
                        }
                    }
                    None => {
                        for (dp, &p) in grad.iter_mut().zip(row.iter()) {
                            *dp = softmax_grad(*dp, p) * scale;
                        }
                    }
                }
            }
            let mut col = 0;
            for &(k0, k1) in &ranges {
                let w = k1 - k0;
                // `dq`, `dk` and `dv` hold `[s, d]` (s == t, checked by `backward`).
                let keys = Strided { data: k, at: kl.at(bi, kvh, k0), cs: 1, rs: kl.row };
                let grads = Strided { data: ds, at: col, cs: 1, rs: n };
                let grads_t = Strided { cs: n, rs: 1, ..grads };
                let probs_t = Strided { data: p, at: col, cs: n, rs: 1 };
                // dQ[tile] += dS K[range]; dK[range] += dS^T Q[tile]; dV[range] += P^T dO[tile]
                product(dq, (r0 * d, d), (m, d, w), grads, keys, true, 1.0);
                product(dk, (k0 * d, d), (w, d, m), grads_t, qt, true, 1.0);
                product(dv, (k0 * d, d), (w, d, m), probs_t, ot, true, 1.0);
                col += w;
            }
            for si in uniform {
                let o = &dout[dl.at(bi, hq, si)..][..d];
                for row in dv.chunks_mut(d) {
                    add_scaled(row, o, 1.0 / t as f32);
                }
            }
        }
    }
}
