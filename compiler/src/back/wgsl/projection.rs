//! The projection kernel ([`Op::Linear`]): register-blocked tiles, in four forms chosen at
//! dispatch time from the shapes (see [`dims`]); one module holds all four, behind a branch on a
//! uniform size, so one kernel serves prefill and decode.
//!
//! The weight operand is read transposed, `[k, w]` ([`super::compile`] inserts the transpose, a
//! load-time fold for a constant weight, and pads `w` to a multiple of 4 for a plain projection), so that the
//! columns an invocation computes are adjacent floats of one weight row. Each invocation
//! accumulates its tile in registers over the whole of `k`, then gives each output its epilogue
//! (bias, activation, gate, rotation, residual). An RMSNorm prologue accumulates each row's sum of
//! squares in the same loop, from the values it loads anyway, and scales the sums after it (see
//! `rms_load`); a LayerNorm prologue computes the statistics of each of an invocation's rows
//! once, before its tile. No workgroup memory or barriers (slow to
//! synchronise on lavapipe).
//!
//! - **`vec4` GEMM** (prefill): [`VEC_GEMM_ROWS`] rows x [`VEC_GEMM_GROUPS`] groups of 4 columns,
//!   `x` and the weight read as `vec4`s. On lavapipe (Mesa 22.3) every storage load is issued lane
//!   by lane, one bounds check per component, so what counts is FMAs per component loaded: a
//!   tile of `R x C` does `R * C` per `R + C`.
//! - **`vec4` GEMV** (decode, up to [`GEMV_MAX_ROWS`] rows): one row x [`VEC_GEMV_GROUPS`] groups.
//! - A **RoPE epilogue** runs in the `vec4` forms when each rotation pair lies in an invocation's
//!   two groups of 4 columns (see `group_pair_fn`: heads starting on whole pairs of `vec4`s).
//! - **scalar GEMM / GEMV**: for `k` not a multiple of 4, a gated projection with `n` not one, or a
//!   RoPE epilogue whose pairs are not whole `vec4`s. Invocations compute *units*: one output column, or the two columns an
//!   epilogue combines (the gate and up columns; the two columns of a rotation, or two adjacent
//!   unrotated ones). In the GEMM form the 64 lanes of a workgroup take 64 rows and share their
//!   units, so weight loads are workgroup-uniform (which newer Mesa and GPUs serve as one load);
//!   in the GEMV form lanes take adjacent units of one row.
//!
//! - **split GEMV** (decode, and up to [`Options::split_rows`] rows, with [`Options::subgroups`]):
//!   a workgroup per row and [`SPLIT_GEMV_GROUPS`] (or [`Options::split_groups`]) groups of 4
//!   columns, its 64 lanes taking `k` 4 at a time (a block of 32 at a time for a quantized weight) 64 apart; each lane's partial sums are added by
//!   `row_sum4` (`super::reduce`), through subgroup operations, and the first lane writes the
//!   outputs. At one row the `vec4` GEMV runs `n / 4` invocations, too few to fill a GPU; the
//!   split form runs `16 n / SPLIT_GEMV_GROUPS`. A norm prologue's statistics are reduced the
//!   same way. A RoPE epilogue in whole `vec4`s runs it too: its unit of two groups (both columns
//!   of each pair, see `group_pair_fn`) is the split tile, so a rotating projection (a decoder's
//!   QKV) launches as many workgroups as a plain one of its shape. (Without it the rotating
//!   projection ran the `vec4` GEMV, `n / 8` invocations each walking all of `k`: two workgroups
//!   for SmolLM2's QKV, 43% of an H200's decode step.)
//!   The form exists only in a module compiled with subgroups (the plain one keeps the `vec4`
//!   GEMV, whose invocations each walk the whole of `k`), and [`dims`] picks it only then.
//!
//! - **split GEMM** (with subgroups, past the split GEMV's rows where the `vec4` GEMM would
//!   launch fewer than [`SPLIT_BELOW_WORKGROUPS`] workgroups: a prefill's or a training step's
//!   narrow projections): the split GEMV's workgroup over [`SPLIT_GEMM_ROWS`] rows, each lane
//!   accumulating every row of the tile over its share of `k`, each sum reduced by `row_sum4`;
//!   the weight's tile is read once for the workgroup's rows.
//!
//! With [`Options::f16_math`] and an f16 weight, the `vec4` loops (GEMM, GEMV and split GEMV)
//! multiply in f16: see [`Options::f16_math`] for what that costs.
//!
//! Every shape is handled (tiles past the last row or column compute clamped indices and skip
//! their stores), so there is no fallback kernel. Buffers are accessed through `ldK`/`ldKv`/`st`/
//! `stv` accessors (see [`bindings`]), which the chunked variant
//! ([`super::kernel::kernel_chunked`]) defines over chunk buffers.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::Options;
use super::emit::{Elem, WORKGROUP, activation, indent, lit};
use crate::graph::{Activation, PairStyle};
use crate::graph::{Op, Prologue, RopeCols};
use crate::lower::WeightFormat;

/// Rows per invocation in the scalar GEMM form (the workgroup covers `64 x GEMM_ROWS` rows).
pub const GEMM_ROWS: usize = 1;
/// Accumulators (output columns) per invocation in the scalar GEMM form: `GEMM_COLS / 2` units of
/// two.
pub const GEMM_COLS: usize = 8;
/// Accumulators per invocation in the scalar GEMV form.
pub const GEMV_COLS: usize = 4;
/// Up to this many rows run a GEMV form.
pub const GEMV_MAX_ROWS: usize = 4;
/// Rows per invocation in the `vec4` GEMM form.
pub const VEC_GEMM_ROWS: usize = 8;
/// Groups of 4 columns per invocation in the `vec4` GEMM form.
pub const VEC_GEMM_GROUPS: usize = 2;
/// Groups of 4 columns per invocation in the `vec4` GEMV form (one row each).
pub const VEC_GEMV_GROUPS: usize = 1;
/// Groups of 4 columns per workgroup in the split GEMV form (one row each), unless
/// [`Options::split_groups`] says otherwise; a rotating projection's always (its unit of two
/// groups, see `group_pair_fn`).
pub const SPLIT_GEMV_GROUPS: usize = 2;
/// The groups of 4 columns a split GEMV's workgroup may take ([`Options::split_groups`]).
pub const SPLIT_GROUPS: [usize; 3] = [1, 2, 4];
/// Rows up to which a hardware adapter's projections start with the split GEMV form
/// ([`Options::split_rows`]): a batched decode step's and a short prompt's. Above, the `vec4`
/// GEMM's tiles; at 64 rows SmolLM2's narrowest projection (576 columns) launches 64 x 72
/// workgroups of the split form (8 columns each) against 9 of the GEMM's. Tuned per adapter ([`SPLIT_ROWS`]).
pub const HARDWARE_SPLIT_ROWS: usize = 64;
/// Past [`GEMV_MAX_ROWS`] rows, the split GEMV runs (up to [`Options::split_rows`]) where the
/// `vec4` GEMM would launch fewer workgroups than this: half the SMs of a large GPU (an H100
/// has 132). Each split row reads the whole weight again: at 256, SmolLM2's head (49 152 x 576)
/// at 8 rows ran split, 3.47 ms of a 4.26 ms forward on an H100, where the GEMM's 96 workgroups
/// read it once (at 128 rows, 0.41 ms; BENCHMARKS.md, 2026-11-27).
pub const SPLIT_BELOW_WORKGROUPS: usize = 64;
/// The width `kiln tune` tries as [`Options::wide_gemv_from`]: a vocabulary head's (SmolLM2's
/// 49 152 columns, Gemma 3's 262 144), not a layer's projections (at most a few thousand).
pub const WIDE_GEMV_FROM: usize = 16384;
/// Rows a workgroup of the split GEMM form takes (see [`dims`]): each lane holds this many rows'
/// accumulators for each of the tile's groups of 4 columns.
pub const SPLIT_GEMM_ROWS: usize = 4;

/// The row limits `kiln tune` tries for the split GEMV form ([`Options::split_rows`]).
pub const SPLIT_ROWS: [usize; 4] = [GEMV_MAX_ROWS, 16, 64, 256];

/// The attributes of a projection.
#[derive(Clone, Copy)]
struct Linear {
    act: Option<Activation>,
    bias: bool,
    residual: bool,
    norm: Option<Prologue>,
    glu: bool,
    rope: Option<RopeCols>,
}

impl Linear {
    /// The attributes of `op`, which must be an [`Op::Linear`]: the public functions of this module
    /// are the projection cases of lowering, [`super::kernel::kernel`] and [`super::dispatch`], which
    /// all match on that variant before calling them.
    #[expect(clippy::panic, reason = "a precondition of this module's functions, met by every caller")]
    fn of(op: &Op) -> Linear {
        match *op {
            Op::Linear { act, bias, residual, norm, glu, rope } => Linear { act, bias, residual, norm, glu, rope },
            ref other => panic!("{} is not a projection", other.name()),
        }
    }

    /// Accumulators per unit: two for a gated or rotated unit.
    fn unit_cols(self) -> usize {
        if self.glu || self.rope.is_some() { 2 } else { 1 }
    }

    /// Units in a row of `n` outputs (a rotated unit writes two).
    fn units(self, n: usize) -> usize {
        if self.rope.is_some() { n / 2 } else { n }
    }

    /// Groups of 4 columns per invocation of the `vec4` GEMV form: a rotation's two groups (see
    /// [`group_pair_fn`]).
    fn gemv_groups(self) -> usize {
        if self.rope.is_some() { 2 } else { VEC_GEMV_GROUPS }
    }
}

/// Whether a RoPE epilogue of `r` runs in the `vec4` forms: every rotated head starts on a pair of
/// whole `vec4`s, and a rotate-half head's pairs are whole `vec4`s apart, so an invocation's two
/// groups of 4 columns hold both columns of each rotation pair (see [`group_pair_fn`]).
fn vector_rope(r: RopeCols) -> bool {
    let aligned = r.start.is_multiple_of(8) && r.head_dim.is_multiple_of(8) && r.len.is_multiple_of(r.head_dim);
    match r.style {
        PairStyle::RotateHalf => aligned && r.rotary_dim.is_multiple_of(8),
        PairStyle::Interleaved => aligned && r.rotary_dim.is_multiple_of(4),
    }
}

/// The sizes of a projection dispatch (see [`super::dispatch`]):
/// `[threads, n, k, seq, past, m, tiles, form, w]`, where `m` is the number of rows, `w` the
/// width of the (transposed, possibly padded) weight's rows and `form` picks the code path:
/// 0 scalar GEMM, 1 scalar GEMV, 2 `vec4` GEMM, 3 `vec4` GEMV, 4 split GEMV (in place of 3 when
/// `options`, the kernel's, have [`Options::subgroups`]), 5 split GEMM (in place of 2 past the
/// split GEMV's rows where the `vec4` GEMM would launch too few workgroups, with subgroups too). The `vec4` forms need `k` and `w`
/// multiples of 4 (lowering pads the weight rows of a plain projection to one; a gated one needs
/// `n` a multiple of 4) and a RoPE epilogue's pairs in whole `vec4`s, if any. `tiles` is the
/// number of column tiles of a row
/// (group). Threads are whole workgroups; the kernel finds its tile from its workgroup index.
pub fn dims(op: &Op, operands: &[Vec<usize>], out: &[usize], past: usize, options: &Options) -> Vec<usize> {
    let p = Linear::of(op);
    let split = splits(op, options).then(|| Split {
        rows: options.split_rows.unwrap_or(GEMV_MAX_ROWS).max(1),
        groups: split_groups(p, options),
        wide_from: options.wide_gemv_from,
    });
    dims_with(op, operands, out, past, Some(gemm_tile(p, options)), split)
}

/// The name of the form `dims[7]` of a projection's sizes picks (see [`dims`]), for reports.
pub fn form_name(form: u32) -> &'static str {
    match form {
        0 => "scalar GEMM",
        1 => "scalar GEMV",
        2 => "vec4 GEMM",
        3 => "vec4 GEMV",
        4 => "split GEMV",
        5 => "split GEMM",
        _ => "unknown form",
    }
}

/// Where the split GEMV form runs: up to `rows` rows, `groups` groups of 4 columns a workgroup;
/// at a GEMV's rows, narrower than `wide_from` columns ([`Options::wide_gemv_from`]).
#[derive(Clone, Copy)]
struct Split {
    rows: usize,
    groups: usize,
    wide_from: Option<usize>,
}

/// Groups of 4 columns a split GEMV's workgroup takes: [`Options::split_groups`] if it is one of
/// [`SPLIT_GROUPS`], else [`SPLIT_GEMV_GROUPS`], which a rotating projection always takes.
fn split_groups(p: Linear, options: &Options) -> usize {
    match p.rope {
        Some(_) => SPLIT_GEMV_GROUPS,
        None => options.split_groups.filter(|g| SPLIT_GROUPS.contains(g)).unwrap_or(SPLIT_GEMV_GROUPS),
    }
}

/// The `vec4` GEMM form's tile, `(rows, groups of 4 columns)`: [`Options::gemm_tile`] if it is
/// one of [`GEMM_TILES`], else [`VEC_GEMM_ROWS`] x [`VEC_GEMM_GROUPS`]; a RoPE epilogue keeps two
/// groups (each rotation pair within an invocation's columns, see [`group_pair_fn`]).
fn gemm_tile(p: Linear, options: &Options) -> (usize, usize) {
    let (rows, groups) =
        options.gemm_tile.filter(|t| GEMM_TILES.contains(t)).unwrap_or((VEC_GEMM_ROWS, VEC_GEMM_GROUPS));
    (rows, if p.rope.is_some() { VEC_GEMM_GROUPS } else { groups })
}

/// The `vec4` GEMM tiles the kernel can take ([`Options::gemm_tile`]), `(rows, groups of 4
/// columns)`: at most 64 accumulators an invocation.
pub const GEMM_TILES: [(usize, usize); 6] = [(4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (16, 1)];

/// Whether the kernel of projection `op` compiled with `options` has the split GEMV form: with
/// subgroups, wherever it has the `vec4` forms (a RoPE epilogue's pairs in whole `vec4`s, see
/// `vector_rope`).
pub fn splits(op: &Op, options: &Options) -> bool {
    options.subgroups && Linear::of(op).rope.is_none_or(vector_rope)
}

// A rotated unit is two groups of 4 columns (see `group_pair_fn`): the split tile's width, so a
// rotating split GEMV runs as many workgroups as a plain one of the same shape.
const _: () = assert!(SPLIT_GEMV_GROUPS == 2);

/// [`dims`] restricted to the scalar forms, the only ones of the chunked kernel ([`body_scalar`]).
pub fn scalar_dims(op: &Op, operands: &[Vec<usize>], out: &[usize], past: usize) -> Vec<usize> {
    dims_with(op, operands, out, past, None, None)
}

/// `tile`: the `vec4` GEMM form's, where the kernel has the `vec4` forms (`None`: the scalar
/// forms only); `split`: where the kernel has the split GEMV form, its rows and width.
fn dims_with(
    op: &Op,
    operands: &[Vec<usize>],
    out: &[usize],
    past: usize,
    tile: Option<(usize, usize)>,
    split: Option<Split>,
) -> Vec<usize> {
    let p = Linear::of(op);
    let n = out.last().copied().unwrap_or(1);
    let last_dim = |i: usize| operands.get(i).and_then(|shape| shape.last()).copied().unwrap_or(1);
    let k = last_dim(0);
    let w = last_dim(operand_indices(p).0);
    let m = out.iter().product::<usize>() / n.max(1);
    let seq = out.get(out.len().wrapping_sub(2)).copied().unwrap_or(1);
    let gemv = m <= GEMV_MAX_ROWS;
    let vector = tile.is_some() && vector_ok(p, k, w, n);
    let (gemm_rows, gemm_groups) = tile.unwrap_or((VEC_GEMM_ROWS, VEC_GEMM_GROUPS));
    // Past a decode step's rows, only where the `vec4` GEMM would launch too few workgroups to
    // fill a GPU: each split row reads the weight again, which a wide projection's GEMM (a head
    // of 49 152 columns: 384 workgroups at 32 rows) does not need.
    let gemm_launch = n.div_ceil(4).div_ceil(gemm_groups) * m.div_ceil(gemm_rows);
    let few = gemm_launch.div_ceil(WORKGROUP as usize) < SPLIT_BELOW_WORKGROUPS;
    let split_gemv = split.filter(|s| {
        let wide = s.wide_from.is_some_and(|c| n >= c);
        vector
            && m <= s.rows
            && match gemv {
                true => !wide,
                false => few,
            }
    });
    // Past the split GEMV's rows, where the GEMM would still launch too few workgroups (a
    // prefill's narrow projection: SmolLM2's 576 columns at 128 rows, 18 workgroups of the GEMM
    // on an H100's 132 SMs, 0.48 ms each; BENCHMARKS.md, 2026-11-28): the split GEMM, a
    // workgroup per [`SPLIT_GEMM_ROWS`] rows and tile of columns, its lanes splitting `k`.
    let split_gemm = split.filter(|s| vector && !gemv && m > s.rows && few);
    let (form, tiles, groups) = if let Some(split) = split_gemv {
        let tiles = n.div_ceil(4).div_ceil(split.groups);
        (4, tiles, tiles * m)
    } else if let Some(split) = split_gemm {
        let tiles = n.div_ceil(4).div_ceil(split.groups);
        (5, tiles, tiles * m.div_ceil(SPLIT_GEMM_ROWS))
    } else if vector {
        let (rows, cols) = if gemv { (1, p.gemv_groups()) } else { (gemm_rows, gemm_groups) };
        let tiles = n.div_ceil(4).div_ceil(cols);
        (if gemv { 3 } else { 2 }, tiles, (tiles * m.div_ceil(rows)).div_ceil(64))
    } else if gemv {
        let tiles = p.units(n).div_ceil(64 * (GEMV_COLS / p.unit_cols()).max(1));
        (1, tiles, tiles * m)
    } else {
        let tiles = p.units(n).div_ceil((GEMM_COLS / p.unit_cols()).max(1));
        (0, tiles, tiles * m.div_ceil(64 * GEMM_ROWS))
    };
    let threads = groups * WORKGROUP as usize;
    vec![threads, n, k, seq, past, m, tiles, form, w]
}

/// Whether the `vec4` forms serve projection `p` of `k` inputs and `n` outputs whose transposed
/// weight rows are `w` wide.
fn vector_ok(p: Linear, k: usize, w: usize, n: usize) -> bool {
    k.is_multiple_of(4)
        && w.is_multiple_of(4)
        && (!p.glu || n.is_multiple_of(4))
        && p.rope.is_none_or(|r| vector_rope(r) && n.is_multiple_of(4))
}

/// Whether projection `op` (an [`Op::Linear`]) from `k` inputs to `n` outputs runs a `vec4`
/// form here (at any number of rows) rather than a scalar one, which is several times slower
/// (`kiln bench kernels`): what the cost model needs to price the op as it will run.
pub fn vector_form(op: &Op, k: usize, n: usize) -> bool {
    let p = Linear::of(op);
    let w = if p.glu {
        2 * n
    } else if pads_weight(op, n) {
        n.next_multiple_of(4)
    } else {
        n
    };
    vector_ok(p, k, w, n)
}

/// Whether lowering pads the transposed weight of `op` from `n` columns to a multiple of 4, so the
/// `vec4` forms apply (the padding columns' outputs are never stored).
pub fn pads_weight(op: &Op, n: usize) -> bool {
    matches!(op, Op::Linear { glu: false, rope: None, .. }) && !n.is_multiple_of(4) && n >= 4
}

/// The bindings of a projection kernel whose operands have device element types `elems`: the
/// output and every f32 operand an array of `vec4<f32>` read through accessors: `ldK(e)` (a
/// float), `ldKv(q)` (the `q`-th `vec4`), `st(e, v)`, `stv(q, v)`. Buffers are allocated in
/// multiples of 16 bytes, so every float of a tensor is inside some `vec4`. An f16 weight has the
/// same accessors over `array<vec4<f16>>`, converting to f32 (the module starts with `enable f16;`,
/// see [`super::kernel::kernel`]), and `ldKh(q)`, the `vec4<f16>` unconverted; a quantized weight (see
/// [`crate::lower::format`]) is an `array<u32>` read through `qsK(row, b)` (block `b`'s scale, `row` the
/// row's first word), `qmK(row, b)` (Q4_1 and Q4_K: its minimum term) and `qvK(row, b, t)`
/// (elements `4t .. 4t + 4` of block `b`, unscaled: Q8_0's signed bytes sign-extended by shifts,
/// Q4_1's and Q4_K's nibbles by shifts and a mask, Q5_0's nibbles with their fifth bits, less 16).
/// A block is 32 elements, so a K-quant's block is a sub-block: Q4_K's scale is `d * sc` and its
/// minimum `-(dmin * m)`, the 6-bit pair unpacked from the super-block's packed bytes by `qkK`;
/// Q6_K's scale is the super-block's `d`, and its `qvK` returns the quants less 32 times their
/// 16-element sub-block's 8-bit scale (an exact integer).
pub fn bindings(elems: &[Elem]) -> String {
    let mut s = String::from("@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;\n");
    s += "fn st(e: u32, v: f32) { out[e >> 2u][e & 3u] = v; }\n";
    s += "fn stv(q: u32, v: vec4<f32>) { out[q] = v; }\n";
    for (k, elem) in elems.iter().enumerate() {
        let b = k + 2;
        s += &match elem {
            Elem::F16 => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<vec4<f16>>;\n\
                 fn ld{k}(e: u32) -> f32 {{ return f32(in{k}[e >> 2u][e & 3u]); }}\n\
                 fn ld{k}v(q: u32) -> vec4<f32> {{ return vec4<f32>(in{k}[q]); }}\n\
                 fn ld{k}h(q: u32) -> vec4<f16> {{ return in{k}[q]; }}\n"
            ),
            // Words per row: `nb = k / 32` scales, then the quants (see `format`).
            Elem::Q8_0 => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<u32>;\n\
                 fn qs{k}(row: u32, b: u32) -> f32 {{ return bitcast<f32>(in{k}[row + b]); }}\n\
                 fn qv{k}(row: u32, b: u32, t: u32) -> vec4<f32> {{\n    \
                 let w = bitcast<i32>(in{k}[row + dim(2u) / 32u + 8u * b + t]);\n    \
                 return vec4<f32>((vec4<i32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));\n}}\n"
            ),
            // Words per row: `nb` scales, `nb` minimums, then the quants.
            Elem::Q4_1 => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<u32>;\n\
                 fn qs{k}(row: u32, b: u32) -> f32 {{ return bitcast<f32>(in{k}[row + b]); }}\n\
                 fn qm{k}(row: u32, b: u32) -> f32 {{ return bitcast<f32>(in{k}[row + dim(2u) / 32u + b]); }}\n\
                 fn qv{k}(row: u32, b: u32, t: u32) -> vec4<f32> {{\n    \
                 let w = in{k}[row + dim(2u) / 16u + 4u * b + (t & 3u)];\n    \
                 return vec4<f32>((vec4<u32>(w) >> (vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>((t >> 2u) * 4u))) & vec4<u32>(15u));\n}}\n"
            ),
            // Words per row: `nb` scales, `nb` words of fifth bits, then Q4_1's quant words.
            Elem::Q5_0 => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<u32>;\n\
                 fn qs{k}(row: u32, b: u32) -> f32 {{ return bitcast<f32>(in{k}[row + b]); }}\n\
                 fn qv{k}(row: u32, b: u32, t: u32) -> vec4<f32> {{\n    \
                 let nb = dim(2u) / 32u;\n    \
                 let w = in{k}[row + 2u * nb + 4u * b + (t & 3u)];\n    \
                 let lo = (vec4<u32>(w) >> (vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>((t >> 2u) * 4u))) & vec4<u32>(15u);\n    \
                 let hi = ((vec4<u32>(in{k}[row + nb + b] >> (4u * t)) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(4u);\n    \
                 return vec4<f32>(vec4<i32>(lo | hi) - vec4<i32>(16));\n}}\n"
            ),
            // Words per row: `ns = k / 256` scales `d`, `ns` minimum scales `dmin`, 3 words of
            // packed 6-bit scales and minimums per super-block, then 32 quant words per
            // super-block (sub-block `b` in nibble `b % 2` of words `8 (b / 2)..`).
            Elem::Q4_K => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<u32>;\n\
                 fn qk{k}(row: u32, b: u32) -> vec2<f32> {{\n    \
                 let base = row + 2u * (dim(2u) / 256u) + 3u * (b / 8u);\n    \
                 let j = b % 8u;\n    \
                 let i = 8u * (j & 3u);\n    \
                 let lo = (in{k}[base] >> i) & 255u;\n    \
                 let mid = (in{k}[base + 1u] >> i) & 255u;\n    \
                 let hi = (in{k}[base + 2u] >> i) & 255u;\n    \
                 if (j < 4u) {{ return vec2<f32>(f32(lo & 63u), f32(mid & 63u)); }}\n    \
                 return vec2<f32>(f32((hi & 15u) | ((lo >> 6u) << 4u)), f32((hi >> 4u) | ((mid >> 6u) << 4u)));\n}}\n\
                 fn qs{k}(row: u32, b: u32) -> f32 {{ return bitcast<f32>(in{k}[row + b / 8u]) * qk{k}(row, b).x; }}\n\
                 fn qm{k}(row: u32, b: u32) -> f32 {{\n    \
                 return -(bitcast<f32>(in{k}[row + dim(2u) / 256u + b / 8u]) * qk{k}(row, b).y);\n}}\n\
                 fn qv{k}(row: u32, b: u32, t: u32) -> vec4<f32> {{\n    \
                 let w = in{k}[row + 5u * (dim(2u) / 256u) + 8u * (b / 2u) + t];\n    \
                 return vec4<f32>((vec4<u32>(w) >> (vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(4u * (b & 1u)))) & vec4<u32>(15u));\n}}\n"
            ),
            // Words per row: `ns` scales `d`, 4 words of 8-bit scales per super-block, 32 words
            // of `ql` per super-block, then 16 words of `qh` per super-block.
            Elem::Q6_K => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<u32>;\n\
                 fn qs{k}(row: u32, b: u32) -> f32 {{ return bitcast<f32>(in{k}[row + b / 8u]); }}\n\
                 fn qv{k}(row: u32, b: u32, t: u32) -> vec4<f32> {{\n    \
                 let ns = dim(2u) / 256u;\n    \
                 let s = b / 8u;\n    \
                 let h = (b % 8u) / 4u;\n    \
                 let c = b % 4u;\n    \
                 let lo = in{k}[row + 5u * ns + 32u * s + 16u * h + 8u * (c % 2u) + t];\n    \
                 let hi = in{k}[row + 37u * ns + 16u * s + 8u * h + t];\n    \
                 let at = vec4<u32>(0u, 8u, 16u, 24u);\n    \
                 let q = ((vec4<u32>(lo) >> (at + vec4<u32>(4u * (c / 2u)))) & vec4<u32>(15u)) | (((vec4<u32>(hi) >> (at + vec4<u32>(2u * c))) & vec4<u32>(3u)) << vec4<u32>(4u));\n    \
                 let si = 2u * (b % 8u) + (t >> 2u);\n    \
                 let sc = bitcast<i32>(in{k}[row + ns + 4u * s + si / 4u] << (24u - 8u * (si % 4u))) >> 24u;\n    \
                 return vec4<f32>((vec4<i32>(q) - vec4<i32>(32)) * sc);\n}}\n"
            ),
            Elem::F32 | Elem::I32 => format!(
                "@group(0) @binding({b}) var<storage, read> in{k}: array<vec4<f32>>;\n\
                 fn ld{k}(e: u32) -> f32 {{ return in{k}[e >> 2u][e & 3u]; }}\n\
                 fn ld{k}v(q: u32) -> vec4<f32> {{ return in{k}[q]; }}\n"
            ),
        };
    }
    s
}

/// The storage format of the weight operand of projection `op`, from its operands' device types.
pub fn weight_format(op: &Op, elems: &[Elem]) -> WeightFormat {
    let p = Linear::of(op);
    match elems.get(operand_indices(p).0) {
        Some(Elem::F16) => WeightFormat::F16,
        Some(Elem::Q8_0) => WeightFormat::Q8_0,
        Some(Elem::Q4_1) => WeightFormat::Q4_1,
        Some(Elem::Q5_0) => WeightFormat::Q5_0,
        Some(Elem::Q4_K) => WeightFormat::Q4_K,
        Some(Elem::Q6_K) => WeightFormat::Q6_K,
        _ => WeightFormat::F32,
    }
}

/// Module-scope function of the kernel: the columns of unit `u` as `(c0, c1, rotated, t)`, `t`
/// the rotation's frequency index.
pub fn unit_fn(op: &Op) -> String {
    let p = Linear::of(op);
    let body = if let Some(r) = p.rope {
        // Pairs: within a rotated head (columns start .. start + len), the first `rotary_dim / 2`
        // units of each head are rotation pairs, the rest adjacent pairs of unrotated columns.
        let (p0, p1) = match r.style {
            PairStyle::RotateHalf => ("base + t", format!("base + t + {}u", r.rotary_dim / 2)),
            PairStyle::Interleaved => ("base + 2u * t", "base + 2u * t + 1u".to_string()),
        };
        format!(
            "    var c0 = 2u * u;\n    var c1 = c0 + 1u;\n    var rot = 0u;\n    var t = 0u;\n    \
             if (c0 >= {start}u && c0 < {end}u) {{\n        let rel = u - {half_start}u;\n        \
             let base = {start}u + (rel / {half_hd}u) * {hd}u;\n        t = rel % {half_hd}u;\n        \
             if (t < {half_rd}u) {{\n            rot = 1u;\n            c0 = {p0};\n            c1 = {p1};\n        \
             }} else {{\n            c0 = base + {rd}u + 2u * (t - {half_rd}u);\n            c1 = c0 + 1u;\n        }}\n    }}\n    \
             return vec4<u32>(c0, c1, rot, t);\n",
            start = r.start,
            end = r.start + r.len,
            half_start = r.start / 2,
            half_hd = r.head_dim / 2,
            hd = r.head_dim,
            half_rd = r.rotary_dim / 2,
            rd = r.rotary_dim,
        )
    } else if p.glu {
        "    return vec4<u32>(u, u + n, 0u, 0u);\n".to_string()
    } else {
        "    return vec4<u32>(u, 0u, 0u, 0u);\n".to_string()
    };
    let mut s = format!(
        "// The output columns of unit `u` of a row of `n`: (c0, c1, rotated, t).\nfn unit_cols(u: u32, n: u32) -> vec4<u32> {{\n{body}}}\n"
    );
    if let Some(r) = p.rope.filter(|&r| vector_rope(r)) {
        s += &group_pair_fn(r);
    }
    s
}

/// Module-scope functions of a `vec4` form with a RoPE epilogue, whose invocations each compute
/// two groups of 4 columns (a *unit*): `group_pair(u)`, unit `u`'s groups as `(g0, g1, rotated,
/// f)`, and, for interleaved pairs, `rot_group(y, g, pos)`, group `g`'s values rotated in place.
///
/// Rotate-half pairs column `i` of a head with column `i + rotary_dim / 2`, so a rotated unit is
/// group `t` of a head and the group `rotary_dim / 8` after it, `f = 4 t` being the frequency
/// index of its first column; the unrotated columns of a head (past `rotary_dim`) and those outside
/// the rotated range are units of two adjacent groups. Interleaved pairs are adjacent columns,
/// inside one group, so every unit is two adjacent groups, each rotated by itself.
fn group_pair_fn(r: RopeCols) -> String {
    let (start, end, hd, rd) = (r.start, r.start + r.len, r.head_dim, r.rotary_dim);
    match r.style {
        PairStyle::RotateHalf => format!(
            "fn group_pair(u: u32) -> vec4<u32> {{\n    var g0 = 2u * u;\n    var g1 = g0 + 1u;\n    var rot = 0u;\n    var f = 0u;\n    \
             if (g0 >= {gs}u && g0 < {ge}u) {{\n        let rel = u - {us}u;\n        \
             let base = {gs}u + (rel / {hu}u) * {hg}u;\n        let t = rel % {hu}u;\n        \
             if (t < {ru}u) {{\n            rot = 1u;\n            g0 = base + t;\n            g1 = g0 + {ru}u;\n            f = 4u * t;\n        \
             }} else {{\n            g0 = base + {rg}u + 2u * (t - {ru}u);\n            g1 = g0 + 1u;\n        }}\n    }}\n    \
             return vec4<u32>(g0, g1, rot, f);\n}}\n",
            gs = start / 4,
            ge = end / 4,
            us = start / 8,
            hu = hd / 8,
            hg = hd / 4,
            ru = rd / 8,
            rg = rd / 4,
        ),
        PairStyle::Interleaved => format!(
            "fn group_pair(u: u32) -> vec4<u32> {{ return vec4<u32>(2u * u, 2u * u + 1u, 0u, 0u); }}\n\
             fn rot_group(y: vec4<f32>, g: u32, pos: f32) -> vec4<f32> {{\n    let c = 4u * g;\n    \
             if (c < {start}u || c >= {end}u || (c - {start}u) % {hd}u >= {rd}u) {{ return y; }}\n    \
             let i = f32(((c - {start}u) % {hd}u) / 2u);\n    \
             let angle = pos / pow(vec2<f32>({theta}), vec2<f32>(2.0 * i, 2.0 * i + 2.0) / {rd}.0);\n    \
             let cs = cos(angle);\n    let sn = sin(angle);\n    \
             return vec4<f32>(y.x * cs.x - y.y * sn.x, y.y * cs.x + y.x * sn.x, y.z * cs.y - y.w * sn.y, y.w * cs.y + y.z * sn.y);\n}}\n",
            theta = lit(r.theta.0),
        ),
    }
}

/// Module-scope declarations of a projection whose epilogue rotates (RoPE): `position(row)`, the
/// position of output row `row` of `[b, s]` rows. From the sizes, `past + row % s`, one
/// position for the whole batch; or, with `starts` (a batched step of sequences at different
/// positions, see `kernel::kernel_at_starts`), `starts[row / s] + row % s`, each sequence's from
/// a binding after the operands (`binding`).
pub fn position_fn(op: &Op, starts: Option<usize>) -> String {
    if !matches!(op, Op::Linear { rope: Some(_), .. }) {
        return String::new();
    }
    match starts {
        None => "fn position(row: u32) -> f32 { return f32(row % dim(3u) + dim(4u)); }\n".to_string(),
        Some(binding) => format!(
            "@group(0) @binding({binding}) var<storage, read> starts: array<u32>;\n\
             fn position(row: u32) -> f32 {{ return f32(row % dim(3u) + starts[row / dim(3u)]); }}\n"
        ),
    }
}

/// The kernel body; runs with `wg` (the workgroup's index) and `lane` (its invocation's index in
/// the workgroup) defined, and, with the split GEMV form ([`splits`]), the reductions of
/// `super::reduce`.
pub fn body(op: &Op, format: WeightFormat, options: &Options) -> String {
    body_with(op, true, format, options)
}

/// The kernel body with the scalar forms only: the chunked variant, whose every load selects a
/// chunk, stays small enough for lavapipe to compile quickly (see [`scalar_dims`]).
pub fn body_scalar(op: &Op) -> String {
    body_with(op, false, WeightFormat::F32, &Options::default())
}

fn body_with(op: &Op, vectors: bool, format: WeightFormat, options: &Options) -> String {
    let p = Linear::of(op);
    let pair = p.unit_cols() == 2;
    let mut s = String::from(
        "let n = dim(1u);\nlet k = dim(2u);\nlet m = dim(5u);\nlet tiles = dim(6u);\nlet form = dim(7u);\n",
    );
    s += "let wn = dim(8u);\n";
    let per = format.row_multiple();
    if let Some(words) = format.row_words(per) {
        // Words per row of a quantized weight (see `format`).
        s += &format!("let rw = {words}u * (k / {per}u);\n");
    }
    let gemm_units = (GEMM_COLS / p.unit_cols()).max(1);
    let gemv_units = (GEMV_COLS / p.unit_cols()).max(1);
    let gemm_rows: Vec<String> =
        (0..GEMM_ROWS).map(|r| format!("grp * {}u + {}u + lane", 64 * GEMM_ROWS, 64 * r)).collect();
    let gemm_unit: Vec<String> = (0..gemm_units).map(|j| format!("tile * {gemm_units}u + {j}u")).collect();
    let gemv_unit: Vec<String> =
        (0..gemv_units).map(|j| format!("tile * {}u + {}u + lane", 64 * gemv_units, 64 * j)).collect();
    let scalar_head = format!(
        "let tile = wg % tiles;\nlet grp = wg / tiles;\nlet units = {};\n",
        if p.rope.is_some() { "n / 2u" } else { "n" }
    );
    s += "if (form == 0u) {\n";
    s += &indent(&(scalar_head.clone() + &scalar_tile(p, pair, &gemm_rows, &gemm_unit, format)));
    s += "} else if (form == 1u) {\n";
    s += &indent(&(scalar_head + &scalar_tile(p, pair, &["grp".to_string()], &gemv_unit, format)));
    if vectors && p.rope.is_none_or(vector_rope) {
        let f16_math = options.f16_math && format == WeightFormat::F16;
        s += "} else if (form == 2u) {\n";
        let (rows, groups) = gemm_tile(p, options);
        s += &indent(&vector_tile(p, Tile::rows(rows, groups), format, f16_math));
        if splits(op, options) {
            let groups = split_groups(p, options);
            s += "} else if (form == 4u) {\n";
            s += &indent(&vector_tile(p, Tile::split(1, groups), format, f16_math));
            s += "} else if (form == 5u) {\n";
            s += &indent(&vector_tile(p, Tile::split(SPLIT_GEMM_ROWS, groups), format, f16_math));
        }
        s += "} else {\n";
        s += &indent(&vector_tile(p, Tile::rows(1, p.gemv_groups()), format, f16_math));
    }
    s += "}";
    s
}

/// Operand indices: (weight, bias, residual).
fn operand_indices(p: Linear) -> (usize, usize, usize) {
    let wi = 1 + p.norm.map_or(0, |n| 1 + usize::from(n.bias));
    (wi, wi + 1, wi + 1 + usize::from(p.bias))
}

/// The shape of a `vec4` tile: `rows` consecutive rows times `groups` consecutive groups of 4
/// columns, an invocation's own (`split` false) or, split, its workgroup's, each lane taking `k`
/// 64 apart.
#[derive(Clone, Copy)]
struct Tile {
    rows: usize,
    groups: usize,
    split: bool,
}

impl Tile {
    fn rows(rows: usize, groups: usize) -> Tile {
        Tile { rows, groups, split: false }
    }

    /// The split forms' tile, `rows` rows (1: the split GEMV) by `groups` groups of 4 columns.
    fn split(rows: usize, groups: usize) -> Tile {
        Tile { rows, groups, split: true }
    }

    /// The header of a loop over `index` below `end` (the lane's share when split).
    fn walk(self, index: &str, end: &str) -> String {
        match self.split {
            true => format!("for (var {index} = lane; {index} < {end}; {index} = {index} + 64u)"),
            false => format!("for (var {index} = 0u; {index} < {end}; {index} = {index} + 1u)"),
        }
    }
}

/// A `vec4` tile (see [`Tile`]), `k` read 4 at a time. Invocations (workgroups when split) are
/// numbered across workgroups, column groups fastest. A quantized weight is read by
/// [`quant_loop`] instead of the transposed-weight loop ([`vector_loop`], which multiplies in
/// f16 with `f16_math`, see [`Options::f16_math`]).
fn vector_tile(p: Linear, tile: Tile, format: WeightFormat, f16_math: bool) -> String {
    let (_, bi, ri) = operand_indices(p);
    let Tile { rows, groups, .. } = tile;
    let mut s = if tile.split {
        format!("let t = wg;\nlet gb = (t % tiles) * {groups}u;\nlet r0 = (t / tiles) * {rows}u;\n")
    } else {
        format!("let t = wg * 64u + lane;\nlet gb = (t % tiles) * {groups}u;\nlet r0 = (t / tiles) * {rows}u;\n")
    };
    s += "let nq = (n + 3u) / 4u;\nlet kq = k / 4u;\nlet wq = wn / 4u;\n";
    for r in 0..rows {
        s += &format!("let a{r} = min(r0 + {r}u, m - 1u) * kq;\n");
        s += &if tile.split { split_stats(p.norm, r) } else { vector_stats(p.norm, r) };
    }
    if p.rope.is_some() {
        // One unit of two groups (see `group_pair_fn`).
        s += "let pg = group_pair(t % tiles);\nlet g0 = min(pg.x, nq - 1u);\nlet g1 = min(pg.y, nq - 1u);\n";
    } else {
        for j in 0..groups {
            s += &format!("let g{j} = min(gb + {j}u, nq - 1u);\n");
        }
    }
    for r in 0..rows {
        for j in 0..groups {
            s += &format!("var y{r}_{j} = vec4<f32>(0.0);\n");
            if p.glu {
                s += &format!("var z{r}_{j} = vec4<f32>(0.0);\n");
            }
        }
    }
    if format.quantized() {
        s += &quant_loop(p, tile, format);
    } else {
        s += &vector_loop(p, tile, f16_math);
    }
    let last = if tile.split {
        // Every lane's partial sums added (an RMSNorm prologue's sum of squares too); the first
        // lane finishes.
        for r in 0..rows {
            if p.norm.is_some_and(|n| n.rms) {
                s += &format!("ss{r} = row_sum4(lane, ss{r});\n");
            }
            for j in 0..groups {
                s += &format!("y{r}_{j} = row_sum4(lane, y{r}_{j});\n");
                if p.glu {
                    s += &format!("z{r}_{j} = row_sum4(lane, z{r}_{j});\n");
                }
            }
        }
        " && lane == 0u"
    } else {
        ""
    };
    for r in 0..rows {
        let accs = (0..groups).flat_map(|j| {
            let gate = p.glu.then(|| format!("z{r}_{j}"));
            std::iter::once(format!("y{r}_{j}")).chain(gate)
        });
        s += &rms_scale(p.norm, r, "dot(ss{r}, vec4<f32>(1.0))", accs);
    }
    let act = |a: Activation, v: &str| {
        format!(
            "vec4<f32>({}, {}, {}, {})",
            activation(a, &format!("{v}.x")),
            activation(a, &format!("{v}.y")),
            activation(a, &format!("{v}.z")),
            activation(a, &format!("{v}.w"))
        )
    };
    if let Some(rope) = p.rope {
        for r in 0..rows {
            s += &vector_rope_epilogue(p, rope, r, last);
        }
        return s;
    }
    for r in 0..rows {
        for j in 0..groups {
            s += &format!(
                "if (r0 + {r}u < m && gb + {j}u < nq{last}) {{\n    let row = r0 + {r}u;\n    var y = y{r}_{j};\n"
            );
            // The aligned epilogue, whole `vec4`s.
            let mut aligned = String::new();
            if p.bias {
                aligned += &format!("y = y + ld{bi}v(g{j});\n");
            }
            if p.glu {
                aligned += &format!("var z = z{r}_{j};\n");
                if p.bias {
                    aligned += &format!("z = z + ld{bi}v(nq + g{j});\n");
                }
                let gate = p.act.map_or("y".to_string(), |a| act(a, "y"));
                aligned += &format!("y = {gate} * z;\n");
            } else if let Some(a) = p.act {
                aligned += &format!("y = {};\n", act(a, "y"));
            }
            if p.residual {
                aligned += &format!("y = y + ld{ri}v(row * nq + g{j});\n");
            }
            aligned += &format!("stv(row * nq + g{j}, y);\n");
            if p.glu {
                s += &indent(&aligned);
            } else {
                // `n` not a multiple of 4 (a padded weight): one column at a time.
                let mut single = format!(
                    "for (var i = 0u; i < 4u; i = i + 1u) {{\n    let c = 4u * g{j} + i;\n    if (c < n) {{\n        var v = y[i];\n"
                );
                if p.bias {
                    single += &format!("        v = v + ld{bi}(c);\n");
                }
                if let Some(a) = p.act {
                    single += &format!("        v = {};\n", activation(a, "v"));
                }
                if p.residual {
                    single += &format!("        v = v + ld{ri}(row * n + c);\n");
                }
                single += "        st(row * n + c, v);\n    }\n}\n";
                s += &indent(&format!("if (n % 4u != 0u) {{\n{}}} else {{\n{}}}\n", indent(&single), indent(&aligned)));
            }
            s += "}\n";
        }
    }
    s
}

/// The epilogue of row `r` of a `vec4` tile with a RoPE epilogue: its two groups `g0`, `g1`
/// (from `pg = group_pair(..)`) with bias and activation, rotated together (rotate-half) or each
/// by itself (interleaved), the residual added; `last` a further condition of the store (the
/// split form's first lane).
fn vector_rope_epilogue(p: Linear, rope: RopeCols, r: usize, last: &str) -> String {
    let (_, bi, ri) = operand_indices(p);
    let mut s =
        format!("if (r0 + {r}u < m{last}) {{\n    let row = r0 + {r}u;\n    var ya = y{r}_0;\n    var yb = y{r}_1;\n");
    if p.bias {
        s += &format!("    ya = ya + ld{bi}v(g0);\n    yb = yb + ld{bi}v(g1);\n");
    }
    if let Some(a) = p.act {
        let act = |v: &str| {
            let c = |f: &str| activation(a, &format!("{v}.{f}"));
            format!("vec4<f32>({}, {}, {}, {})", c("x"), c("y"), c("z"), c("w"))
        };
        s += &format!("    ya = {};\n    yb = {};\n", act("ya"), act("yb"));
    }
    s += "    let pos = position(row);\n";
    match rope.style {
        PairStyle::RotateHalf => {
            s += &format!(
                "    if (pg.z == 1u) {{\n        let f = vec4<f32>(f32(pg.w), f32(pg.w + 1u), f32(pg.w + 2u), f32(pg.w + 3u));\n        \
                 let angle = pos / pow(vec4<f32>({}), 2.0 * f / {}.0);\n        let c = cos(angle);\n        let sn = sin(angle);\n        \
                 let ra = ya * c - yb * sn;\n        yb = yb * c + ya * sn;\n        ya = ra;\n    }}\n",
                lit(rope.theta.0),
                rope.rotary_dim
            );
        }
        PairStyle::Interleaved => s += "    ya = rot_group(ya, g0, pos);\n    yb = rot_group(yb, g1, pos);\n",
    }
    if p.residual {
        s += &format!("    ya = ya + ld{ri}v(row * nq + g0);\n    yb = yb + ld{ri}v(row * nq + g1);\n");
    }
    s += "    if (pg.x < nq) { stv(row * nq + g0, ya); }\n    if (pg.y < nq) { stv(row * nq + g1, yb); }\n}\n";
    s
}

/// The loop of a `vec4` tile over a transposed f32/f16 weight: `k` 4 at a time. With `f16_math`
/// (an f16 weight), the weights stay f16, each `x` is rounded to f16 and the four products of a
/// column are summed in f16 before the f32 accumulator takes them.
fn vector_loop(p: Linear, tile: Tile, f16_math: bool) -> String {
    let (wi, _, _) = operand_indices(p);
    let Tile { rows, groups, .. } = tile;
    let (load, x) = if f16_math { ("h", "xh") } else { ("v", "x") };
    let mut s = String::new();
    s += &tile.walk("kk", "kq");
    s += " {\n";
    s += &norm_loads(p.norm, "    ");
    for r in 0..rows {
        s += &rms_load(p.norm, r, &format!("ld0v(a{r} + kk)"), "v", "    ");
        s += &format!("    let x{r} = {};\n", vector_x(p.norm, r));
        if f16_math {
            s += &format!("    let xh{r} = vec4<f16>(x{r});\n");
        }
    }
    s += "    let wr = kk * 4u * wq;\n";
    for i in 0..4 {
        for j in 0..groups {
            s += &format!("    let w{i}_{j} = ld{wi}{load}(wr + {i}u * wq + g{j});\n");
            if p.glu {
                s += &format!("    let u{i}_{j} = ld{wi}{load}(wr + {i}u * wq + nq + g{j});\n");
            }
        }
    }
    for r in 0..rows {
        for j in 0..groups {
            let sum = |acc: &str, w: &str| {
                let dot =
                    format!("{x}{r}.x * {w}0_{j} + {x}{r}.y * {w}1_{j} + {x}{r}.z * {w}2_{j} + {x}{r}.w * {w}3_{j}");
                let dot = if f16_math { format!("vec4<f32>({dot})") } else { dot };
                format!("    {acc}{r}_{j} = {acc}{r}_{j} + {dot};\n")
            };
            s += &sum("y", "w");
            if p.glu {
                s += &sum("z", "u");
            }
        }
    }
    s += "}\n";
    s
}

/// The `vec4` input of row `r` at `vec4` index `kk` (normalised by the prologue; `gain` and
/// `shift` in scope).
fn vector_x(norm: Option<Prologue>, r: usize) -> String {
    match norm {
        None => format!("ld0v(a{r} + kk)"),
        Some(n) if n.rms => format!("v{r} * gain"),
        Some(n) if n.bias => format!("(ld0v(a{r} + kk) - mean{r}) * inv{r} * gain + shift"),
        Some(_) => format!("(ld0v(a{r} + kk) - mean{r}) * inv{r} * gain"),
    }
}

/// The loop of a `vec4` tile over a quantized weight's rows (see [`crate::lower::format`]): block by
/// block, the unscaled quants of each column dotted with the inputs, then scaled once per block
/// (`y += scale * dot(x, q)`, plus `min * sum(x)` for Q4_1 and Q4_K). Column `c`'s row is clamped to the
/// last real column (its outputs past `n` are never stored); a gated projection's up column is
/// row `c + n`.
fn quant_loop(p: Linear, tile: Tile, format: WeightFormat) -> String {
    let (wi, _, _) = operand_indices(p);
    let Tile { rows, groups, .. } = tile;
    let mins = format.has_mins();
    let mut s = String::new();
    // Row bases of every column (and of its up column).
    for j in 0..groups {
        for i in 0..4 {
            s += &format!("let qr{j}_{i} = min(4u * g{j} + {i}u, n - 1u) * rw;\n");
            if p.glu {
                s += &format!("let ur{j}_{i} = (min(4u * g{j} + {i}u, n - 1u) + n) * rw;\n");
            }
        }
    }
    let accs: &[&str] = if p.glu { &["y", "z"] } else { &["y"] };
    s += &tile.walk("b", "k / 32u");
    s += " {\n";
    for r in 0..rows {
        if mins {
            s += &format!("    var xs{r} = vec4<f32>(0.0);\n");
        }
        for j in 0..groups {
            for a in accs {
                s += &format!("    var d{a}{r}_{j} = vec4<f32>(0.0);\n");
            }
        }
    }
    s += "    for (var qt = 0u; qt < 8u; qt = qt + 1u) {\n        let kk = b * 8u + qt;\n";
    s += &norm_loads(p.norm, "        ");
    for r in 0..rows {
        s += &rms_load(p.norm, r, &format!("ld0v(a{r} + kk)"), "v", "        ");
        s += &format!("        let x{r} = {};\n", vector_x(p.norm, r));
        if mins {
            s += &format!("        xs{r} = xs{r} + x{r};\n");
        }
    }
    for j in 0..groups {
        for a in accs {
            let base = if *a == "y" { "qr" } else { "ur" };
            for i in 0..4 {
                s += &format!("        let w{a}{j}_{i} = qv{wi}({base}{j}_{i}, b, qt);\n");
            }
            for r in 0..rows {
                s += &format!(
                    "        d{a}{r}_{j} = d{a}{r}_{j} + vec4<f32>(dot(x{r}, w{a}{j}_0), dot(x{r}, w{a}{j}_1), dot(x{r}, w{a}{j}_2), dot(x{r}, w{a}{j}_3));\n"
                );
            }
        }
    }
    s += "    }\n";
    for j in 0..groups {
        for a in accs {
            let base = if *a == "y" { "qr" } else { "ur" };
            let v = |f: &str| {
                format!(
                    "vec4<f32>({f}{wi}({base}{j}_0, b), {f}{wi}({base}{j}_1, b), {f}{wi}({base}{j}_2, b), {f}{wi}({base}{j}_3, b))"
                )
            };
            s += &format!("    let s{a}{j} = {};\n", v("qs"));
            if mins {
                s += &format!("    let m{a}{j} = {};\n", v("qm"));
            }
            for r in 0..rows {
                let shift = if mins { format!(" + m{a}{j} * dot(xs{r}, vec4<f32>(1.0))") } else { String::new() };
                s += &format!("    {a}{r}_{j} = {a}{r}_{j} + s{a}{j} * d{a}{r}_{j}{shift};\n");
            }
        }
    }
    s += "}\n";
    s
}

/// Row statistics of the norm prologue for row `r` of a split tile: as [`vector_stats`], the
/// workgroup's lanes taking the row's `vec4`s 64 apart and adding their shares with `row_sum`.
fn split_stats(norm: Option<Prologue>, r: usize) -> String {
    let lanes = "for (var kk = lane; kk < kq; kk = kk + 64u)";
    match norm {
        None => String::new(),
        // One pass, as `vector_stats`: each lane's sum of squares, added after the loop.
        Some(p) if p.rms => format!("var ss{r} = vec4<f32>(0.0);\n"),
        Some(p) => format!(
            "var sum{r} = vec4<f32>(0.0);\n{lanes} {{ sum{r} = sum{r} + ld0v(a{r} + kk); }}\n\
             let mean{r} = row_sum(lane, dot(sum{r}, vec4<f32>(1.0))) / f32(k);\nvar sq{r} = vec4<f32>(0.0);\n\
             {lanes} {{ let c = ld0v(a{r} + kk) - mean{r}; sq{r} = sq{r} + c * c; }}\n\
             let inv{r} = 1.0 / sqrt(row_sum(lane, dot(sq{r}, vec4<f32>(1.0))) / f32(k) + {});\n",
            lit(p.eps.0)
        ),
    }
}

/// Row statistics of the norm prologue for row `r` of a `vec4` tile (its `vec4`s at `a{r}`).
fn vector_stats(norm: Option<Prologue>, r: usize) -> String {
    match norm {
        None => String::new(),
        // One pass: the sum of squares accumulates beside the dot products (see `rms_load`).
        Some(p) if p.rms => format!("var ss{r} = vec4<f32>(0.0);\n"),
        Some(p) => format!(
            "var sum{r} = vec4<f32>(0.0);\nfor (var kk = 0u; kk < kq; kk = kk + 1u) {{ sum{r} = sum{r} + ld0v(a{r} + kk); }}\n\
             let mean{r} = dot(sum{r}, vec4<f32>(1.0)) / f32(k);\nvar sq{r} = vec4<f32>(0.0);\n\
             for (var kk = 0u; kk < kq; kk = kk + 1u) {{ let c = ld0v(a{r} + kk) - mean{r}; sq{r} = sq{r} + c * c; }}\n\
             let inv{r} = 1.0 / sqrt(dot(sq{r}, vec4<f32>(1.0)) / f32(k) + {});\n",
            lit(p.eps.0)
        ),
    }
}

/// A scalar tile: rows `rows` (raw indices, possibly past the last) times units `units`.
/// A quantized weight is read by [`scalar_quant_loop`].
fn scalar_tile(p: Linear, pair: bool, rows: &[String], units: &[String], format: WeightFormat) -> String {
    let (wi, _, _) = operand_indices(p);
    let mut s = String::new();
    for (r, row) in rows.iter().enumerate() {
        s += &format!("let rr{r} = {row};\nlet a{r} = min(rr{r}, m - 1u) * k;\n");
        s += &norm_stats(p.norm, r);
    }
    for (j, unit) in units.iter().enumerate() {
        s += &format!("let uu{j} = {unit};\nlet cs{j} = unit_cols(min(uu{j}, units - 1u), n);\n");
    }
    let halves: &[usize] = if pair { &[0, 1] } else { &[0] };
    for r in 0..rows.len() {
        for j in 0..units.len() {
            for h in halves {
                s += &format!("var y{r}_{j}_{h} = 0.0;\n");
            }
        }
    }
    if format.quantized() {
        s += &scalar_quant_loop(p, rows.len(), units.len(), halves, format);
    } else {
        s += "for (var kk = 0u; kk < k; kk = kk + 1u) {\n";
        for r in 0..rows.len() {
            s += &rms_load(p.norm, r, &format!("ld0(a{r} + kk)"), "s", "    ");
            s += &format!("    let x{r} = {};\n", x_value(p.norm, r));
        }
        s += "    let wr = kk * wn;\n";
        for j in 0..units.len() {
            for &h in halves {
                let c = if h == 0 { "x" } else { "y" };
                s += &format!("    let w{j}_{h} = ld{wi}(wr + cs{j}.{c});\n");
                for r in 0..rows.len() {
                    s += &format!("    y{r}_{j}_{h} = y{r}_{j}_{h} + x{r} * w{j}_{h};\n");
                }
            }
        }
        s += "}\n";
    }
    for r in 0..rows.len() {
        let accs = (0..units.len()).flat_map(|j| halves.iter().map(move |h| format!("y{r}_{j}_{h}")));
        s += &rms_scale(p.norm, r, "ss{r}", accs);
    }
    for r in 0..rows.len() {
        for j in 0..units.len() {
            s += &format!("if (rr{r} < m && uu{j} < units) {{\n");
            s += &format!(
                "    let row = rr{r};\n    let c0 = cs{j}.x;\n    let c1 = cs{j}.y;\n    var y0 = y{r}_{j}_0;\n"
            );
            if pair {
                s += &format!("    var y1 = y{r}_{j}_1;\n");
            }
            if p.rope.is_some() {
                s += &format!("    let rot = cs{j}.z;\n    let t = cs{j}.w;\n");
            }
            s += &indent(&epilogue(p));
            s += "}\n";
        }
    }
    s
}

/// The loop of a scalar tile over a quantized weight: as [`quant_loop`], block by block and
/// `vec4` by `vec4` of the row (`k`, a multiple of 32, lets rows be read as `vec4`s), each unit
/// column's row read from its own block row.
fn scalar_quant_loop(p: Linear, rows: usize, units: usize, halves: &[usize], format: WeightFormat) -> String {
    let (wi, _, _) = operand_indices(p);
    let mins = format.has_mins();
    let mut s = String::new();
    for r in 0..rows {
        s += &format!("let av{r} = a{r} / 4u;\n");
    }
    for j in 0..units {
        for &h in halves {
            let c = if h == 0 { "x" } else { "y" };
            s += &format!("let rb{j}_{h} = cs{j}.{c} * rw;\n");
        }
    }
    s += "for (var b = 0u; b < k / 32u; b = b + 1u) {\n";
    for r in 0..rows {
        if mins {
            s += &format!("    var xs{r} = vec4<f32>(0.0);\n");
        }
        for j in 0..units {
            for &h in halves {
                s += &format!("    var d{r}_{j}_{h} = 0.0;\n");
            }
        }
    }
    s += "    for (var qt = 0u; qt < 8u; qt = qt + 1u) {\n        let kk = b * 8u + qt;\n";
    s += &norm_loads(p.norm, "        ");
    for r in 0..rows {
        s += &rms_load(p.norm, r, &format!("ld0v(av{r} + kk)"), "d", "        ");
        s += &format!(
            "        let x{r} = {};\n",
            vector_x(p.norm, r).replace(&format!("a{r} + kk"), &format!("av{r} + kk"))
        );
        if mins {
            s += &format!("        xs{r} = xs{r} + x{r};\n");
        }
    }
    for j in 0..units {
        for &h in halves {
            s += &format!("        let w{j}_{h} = qv{wi}(rb{j}_{h}, b, qt);\n");
            for r in 0..rows {
                s += &format!("        d{r}_{j}_{h} = d{r}_{j}_{h} + dot(x{r}, w{j}_{h});\n");
            }
        }
    }
    s += "    }\n";
    for j in 0..units {
        for &h in halves {
            for r in 0..rows {
                let shift =
                    if mins { format!(" + qm{wi}(rb{j}_{h}, b) * dot(xs{r}, vec4<f32>(1.0))") } else { String::new() };
                s += &format!("    y{r}_{j}_{h} = y{r}_{j}_{h} + qs{wi}(rb{j}_{h}, b) * d{r}_{j}_{h}{shift};\n");
            }
        }
    }
    s += "}\n";
    s
}

/// Row statistics of the norm prologue for row `r` (its elements at `a{r}`).
fn norm_stats(norm: Option<Prologue>, r: usize) -> String {
    match norm {
        None => String::new(),
        Some(p) if p.rms => format!("var ss{r} = 0.0;\n"),
        Some(p) => format!(
            "var mean{r} = 0.0;\nfor (var kk = 0u; kk < k; kk = kk + 1u) {{ mean{r} = mean{r} + ld0(a{r} + kk); }}\n\
             mean{r} = mean{r} / f32(k);\nvar sq{r} = 0.0;\n\
             for (var kk = 0u; kk < k; kk = kk + 1u) {{ let c = ld0(a{r} + kk) - mean{r}; sq{r} = sq{r} + c * c; }}\n\
             let inv{r} = 1.0 / sqrt(sq{r} / f32(k) + {});\n",
            lit(p.eps.0)
        ),
    }
}

/// Element `kk` of row `r` of the (normalised) input.
fn x_value(norm: Option<Prologue>, r: usize) -> String {
    match norm {
        None => format!("ld0(a{r} + kk)"),
        Some(p) if p.rms => format!("v{r} * ld1(kk)"),
        Some(p) if p.bias => format!("(ld0(a{r} + kk) - mean{r}) * inv{r} * ld1(kk) + ld2(kk)"),
        Some(_) => format!("(ld0(a{r} + kk) - mean{r}) * inv{r} * ld1(kk)"),
    }
}

/// The epilogue of one scalar unit: `y0` (and `y1`) accumulated for columns `c0` (and `c1`) of
/// `row`.
fn epilogue(p: Linear) -> String {
    let (_, bi, ri) = operand_indices(p);
    let mut s = String::new();
    if p.bias {
        s += &format!("y0 = y0 + ld{bi}(c0);\n");
        if p.glu || p.rope.is_some() {
            s += &format!("y1 = y1 + ld{bi}(c1);\n");
        }
    }
    if p.glu {
        let gate = p.act.map_or("y0".to_string(), |a| activation(a, "y0"));
        s += &format!("y0 = ({gate}) * y1;\n");
    } else if let Some(a) = p.act {
        s += &format!("y0 = {};\n", activation(a, "y0"));
        if p.rope.is_some() {
            s += &format!("y1 = {};\n", activation(a, "y1"));
        }
    }
    if let Some(r) = p.rope {
        s += &format!(
            "if (rot == 1u) {{\n    let pos = position(row);\n    \
             let angle = pos / pow({}, f32(2u * t) / {}.0);\n    let c = cos(angle);\n    let sn = sin(angle);\n    \
             let r0 = y0 * c - y1 * sn;\n    y1 = y1 * c + y0 * sn;\n    y0 = r0;\n}}\n",
            lit(r.theta.0),
            r.rotary_dim
        );
        if p.residual {
            s += &format!("y0 = y0 + ld{ri}(row * n + c0);\ny1 = y1 + ld{ri}(row * n + c1);\n");
        }
        s += "st(row * n + c0, y0);\nst(row * n + c1, y1);\n";
    } else {
        if p.residual {
            s += &format!("y0 = y0 + ld{ri}(row * n + c0);\n");
        }
        s += "st(row * n + c0, y0);\n";
    }
    s
}

/// An RMSNorm prologue's load of element (or `vec4`) `load` of row `r` as `v{r}`, its square
/// added to the row's sum of squares `ss{r}`: `sum` says how (`"v"`: a `vec4` sum of `vec4`s,
/// `"s"`: a float sum of floats, `"d"`: a float sum of `vec4`s). Nothing for other prologues.
///
/// RMSNorm scales a row by one factor, so the projection of the normalised row is the
/// projection of `x * gain` times that factor: the kernel reads each row once, accumulating
/// the dot products and the sum of squares together, and scales the sums after the loop
/// ([`rms_scale`]). No invocation makes a second pass over its rows for their statistics.
fn rms_load(norm: Option<Prologue>, r: usize, load: &str, sum: &str, indent: &str) -> String {
    if !norm.is_some_and(|n| n.rms) {
        return String::new();
    }
    let add = if sum == "d" { format!("dot(v{r}, v{r})") } else { format!("v{r} * v{r}") };
    format!("{indent}let v{r} = {load};\n{indent}ss{r} = ss{r} + {add};\n")
}

/// After the loop of an RMSNorm prologue: row `r`'s factor `inv{r}` from its sum of squares
/// (`total`, a WGSL expression in `{r}`), and each accumulator of the row in `accs` scaled by it.
fn rms_scale(norm: Option<Prologue>, r: usize, total: &str, accs: impl Iterator<Item = String>) -> String {
    let Some(p) = norm.filter(|n| n.rms) else { return String::new() };
    let total = total.replace("{r}", &r.to_string());
    let mut s = format!("let inv{r} = 1.0 / sqrt({total} / f32(k) + {});\n", lit(p.eps.0));
    for a in accs {
        s += &format!("{a} = {a} * inv{r};\n");
    }
    s
}

/// The loads of a norm prologue's gain (and shift) `vec4`s at `kk`, indented by `indent`.
fn norm_loads(norm: Option<Prologue>, indent: &str) -> String {
    match norm {
        None => String::new(),
        Some(n) if n.bias => format!("{indent}let gain = ld1v(kk);\n{indent}let shift = ld2v(kk);\n"),
        Some(_) => format!("{indent}let gain = ld1v(kk);\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Scalar;

    fn rope(style: PairStyle, start: usize, head_dim: usize, rotary_dim: usize) -> Op {
        let rope = RopeCols { theta: Scalar(1e4), rotary_dim, style, head_dim, start, len: 8 * head_dim };
        Op::Linear { act: None, bias: false, residual: false, norm: None, glu: false, rope: Some(rope) }
    }

    /// On a hardware adapter's options, a short prompt's projections run the split GEMV where the
    /// `vec4` GEMM would launch too few workgroups, and a wide one (a vocabulary head) the GEMM;
    /// a decode step's always the split form; past `split_rows`, the GEMM.
    #[test]
    fn few_rows_split_where_the_gemm_would_not_fill_a_gpu() {
        let options = Options::hardware();
        let form = |m: usize, k: usize, n: usize| {
            let d = dims(&Op::linear(None, false, false), &[vec![m, k], vec![k, n]], &[m, n], 0, &options);
            (d[7], d[0] / WORKGROUP as usize)
        };
        // SmolLM2's attention output at 32 rows: 72 column tiles of 8 a row, 2 304 workgroups
        // split, where the GEMM's would be 5.
        assert_eq!(form(32, 576, 576), (4, 32 * 72));
        assert_eq!(form(1, 576, 576), (4, 72));
        // Narrower workgroups where the options say so: 144 a row.
        let narrow = Options { split_groups: Some(1), ..options };
        let d = dims(&Op::linear(None, false, false), &[vec![1, 576], vec![576, 576]], &[1, 576], 0, &narrow);
        assert_eq!((d[7], d[0] / WORKGROUP as usize), (4, 144));
        // Its head at 32 rows: the GEMM launches 384 workgroups, enough; at 8 rows 96, enough
        // too (split, each of the 8 rows would read the 113 MB weight again).
        assert_eq!(form(32, 576, 49_152).0, 2);
        assert_eq!(form(8, 576, 49_152), (2, 96));
        // Its MLP at 8 rows: the GEMM's 3 workgroups, too few.
        assert_eq!(form(8, 576, 1536).0, 4);
        // Past the rows the split GEMV takes: the GEMM where it launches workgroups enough,
        // else the split GEMM (SmolLM2's attention output at 128 rows: the GEMM's 18 workgroups,
        // or 72 tiles of 8 columns by 32 blocks of 4 rows).
        assert_eq!(form(HARDWARE_SPLIT_ROWS + 1, 576, 49_152).0, 2);
        assert_eq!(form(128, 576, 576), (5, 72 * 32));
        assert_eq!(form(HARDWARE_SPLIT_ROWS + 1, 576, 576), (5, 72 * 17));
        assert_eq!(form(4096, 384, 384).0, 2);
        // Without subgroups, no split form at all.
        let plain = Options { subgroups: false, ..options };
        let d = dims(&Op::linear(None, false, false), &[vec![32, 576], vec![576, 576]], &[32, 576], 0, &plain);
        assert_eq!(d[7], 2);
        // A decode step's head split by default (6 144 workgroups of 8 columns); from
        // `wide_gemv_from` columns in the `vec4` GEMV (a lane per 4 columns: 192 workgroups),
        // the layers' projections still split, and more rows as before.
        assert_eq!(form(1, 576, 49_152), (4, 6144));
        let wide = Options { wide_gemv_from: Some(WIDE_GEMV_FROM), ..options };
        let form_wide = |m: usize, n: usize| {
            let d = dims(&Op::linear(None, false, false), &[vec![m, 576], vec![576, n]], &[m, n], 0, &wide);
            (d[7], d[0] / WORKGROUP as usize)
        };
        assert_eq!(form_wide(1, 49_152), (3, 192));
        assert_eq!(form_wide(4, 49_152), (3, 4 * 192));
        assert_eq!(form_wide(1, 1536), (4, 192));
        assert_eq!(form_wide(8, 49_152), (2, 96));
    }

    #[test]
    fn rotations_of_whole_vec4_pairs_run_the_vec4_forms() {
        // SmolLM2's packed QKV (heads of 64 from column 0), and a partial rotation.
        assert!(vector_form(&rope(PairStyle::RotateHalf, 0, 64, 64), 576, 960));
        assert!(vector_form(&rope(PairStyle::RotateHalf, 64, 64, 32), 576, 960));
        assert!(vector_form(&rope(PairStyle::Interleaved, 0, 64, 4), 576, 960));
        // Pairs split across `vec4`s, or inputs not whole `vec4`s: the scalar forms.
        assert!(!vector_form(&rope(PairStyle::RotateHalf, 4, 64, 64), 576, 960));
        assert!(!vector_form(&rope(PairStyle::RotateHalf, 0, 64, 4), 576, 960));
        assert!(!vector_form(&rope(PairStyle::RotateHalf, 0, 2, 2), 8, 16));
        assert!(!vector_form(&rope(PairStyle::RotateHalf, 0, 64, 64), 578, 960));
        // The dispatch sizes agree: form 2 (`vec4` GEMM) at 128 rows, 3 (`vec4` GEMV) at one.
        let op = rope(PairStyle::RotateHalf, 0, 64, 64);
        let at =
            |rows: usize| dims(&op, &[vec![1, rows, 576], vec![576, 960]], &[1, rows, 960], 0, &Options::default())[7];
        assert_eq!((at(128), at(1)), (2, 3));
        // With subgroups, one row runs the split GEMV (form 4), as many workgroups as the same
        // projection without the rotation.
        let subgroups = Options { subgroups: true, ..Options::default() };
        let split = |op: &Op| dims(op, &[vec![1, 1, 576], vec![576, 960]], &[1, 1, 960], 0, &subgroups);
        let (rotating, plain) = (split(&op), split(&Op::linear(None, false, false)));
        assert_eq!((rotating[7], plain[7]), (4, 4));
        assert_eq!(rotating[0], plain[0]);
        assert_eq!(rotating[0] / WORKGROUP as usize, 960 / 8);
    }

    /// A batched step's rotating projection (`kernel_at_starts`) is the same kernel but for where
    /// a row's position comes from: each sequence's first position, from a binding after the
    /// operands, rather than the sizes' one `past`. In both pair styles, the vector and scalar
    /// forms, f32 and quantized weights, with and without subgroups; no other op has one.
    #[test]
    fn kernels_at_starts_differ_only_in_where_positions_come_from() {
        use super::super::kernel::{kernel, kernel_at_starts};
        use super::super::validate;
        let ops = [
            rope(PairStyle::RotateHalf, 0, 64, 64),
            rope(PairStyle::Interleaved, 0, 64, 4),
            rope(PairStyle::RotateHalf, 4, 64, 64),
        ];
        let subgroups = Options { subgroups: true, ..Options::default() };
        for op in &ops {
            for elems in [[Elem::F32, Elem::F32], [Elem::F32, Elem::Q8_0]] {
                for options in [Options::default(), subgroups] {
                    let at_starts = kernel_at_starts(op, &elems, Elem::F32, &options).unwrap();
                    validate(&at_starts).unwrap_or_else(|e| panic!("{op:?} {elems:?}: {e}"));
                    let binding = "@group(0) @binding(4) var<storage, read> starts: array<u32>;\n";
                    let position =
                        "fn position(row: u32) -> f32 { return f32(row % dim(3u) + starts[row / dim(3u)]); }";
                    assert!(at_starts.contains(binding) && at_starts.contains(position), "{at_starts}");
                    let from_sizes = at_starts
                        .replace(binding, "")
                        .replace(position, "fn position(row: u32) -> f32 { return f32(row % dim(3u) + dim(4u)); }");
                    assert_eq!(from_sizes, kernel(op, &elems, Elem::F32, None, &options).unwrap());
                }
            }
        }
        let plain = Op::linear(None, false, false);
        assert_eq!(kernel_at_starts(&plain, &[Elem::F32, Elem::F32], Elem::F32, &Options::default()), None);
    }
}
