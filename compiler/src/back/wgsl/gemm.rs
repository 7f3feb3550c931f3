//! Tiled matrix products of two activations: [`Op::MatMul`] (batched, `b` transposed or not),
//! [`Op::MatMulActGrad`] (the same product, each output element times an activation's derivative
//! at the same element of a third operand as it is stored: the epilogue) and
//! [`Op::ContractRows`] (a weight's gradient, `aᵀ b` summed over every row).
//!
//! One workgroup of [`LANES`] lanes computes a [`TILE`] x [`TILE`] block of the output (or, for
//! an output of at least [`WIDE_FROM_BLOCKS`] blocks of [`WIDE_TILE`], one of those: the wide
//! form, twice the products per load; the dispatch's sizes say which): each step along the
//! contraction stages a `TILE` x [`TILE_K`] slice of `a` and a `TILE_K` x `TILE` slice of `b` in
//! workgroup memory (zeros past the edges), and each lane accumulates a 4 x 4 block from them (8
//! x 8 in the wide form). The lanes that load a slice read consecutive addresses of its operand's
//! contiguous axis, whichever that is (`a`'s contraction axis for a `matmul`, its output rows for
//! `contract_rows`), so both layouts load coalesced. The plain one-thread-per-element forms these
//! replace looped over the whole contraction for each element, reading `b` once per output row:
//! 342 GFLOPS on an H100 where the projection GEMM ran 15 TFLOPS (`kiln bench kernels`, its
//! reference column; BENCHMARKS.md, 2026-11-27).
//!
//! Each lane loads its elements of the next slices into registers while the workgroup multiplies
//! the slices staged before, every load issued before any of them is stored: a slice's loads
//! waited on one another, a round trip to memory each (at 64 lanes a workgroup and one or two
//! workgroups an SM, nothing else hides that latency).
//!
//! A long contraction over few blocks (fewer than [`FILL_WORKGROUPS`]; a gradient through a
//! vocabulary head: 72 blocks contracting 49 152) is split into slices, a workgroup per block and
//! slice: each slice writes its partial output to the scratch buffer `part` (see
//! `super::partials`), and a second dispatch adds the slices in order ([`launch`]; with
//! [`super::Options::split_contractions`], a hardware adapter's: on lavapipe the extra
//! workgroups cost more than the filled threads gained).
//!
//! Each output element sums its products in contraction order into one accumulator (per slice,
//! where split, the slices then added in order), as the plain forms did. The slices are held as
//! `vec4`s, four consecutive rows (or columns) of one contraction step each, so a lane reads its
//! 4 rows of `a` and 4 columns of `b` at a step in two loads from workgroup memory rather than
//! eight (the loads per product halve the FMAs' share of a GPU's issue slots otherwise); the
//! arithmetic is the same.

use super::emit::{activation_derivative, indent};
use crate::graph::Op;

/// Lanes of a workgroup: the cooperative kernels' (`emit::WORKGROUP`, asserted equal there).
pub const LANES: u32 = 64;

/// Output rows and columns of a workgroup's block: 32 x 32, each lane 4 x 4 of it.
pub const TILE: usize = 32;
/// The wide form's block, 64 x 64, each lane 8 x 8: twice the products per load from workgroup
/// memory, for outputs with enough of these blocks to fill a GPU ([`WIDE_FROM_BLOCKS`]).
pub const WIDE_TILE: usize = 64;
/// Blocks of [`WIDE_TILE`] an output needs (over its batches) to run the wide form: about two for
/// each SM of a large GPU (an H100 has 132), so the wide form never leaves one idle that the
/// narrow form would have used.
pub const WIDE_FROM_BLOCKS: usize = 256;
/// Contraction steps staged at a time.
pub const TILE_K: usize = 16;
// 64 lanes in an 8 x 8 grid, each `tile / 8` square, make either block; each lane loads
// `tile / 4` elements of each slice.
const _: () =
    assert!(LANES == 64 && TILE.is_multiple_of(32) && WIDE_TILE.is_multiple_of(32) && TILE_K * 4 == LANES as usize);

/// Whether `op` runs as a tiled product here.
pub fn tiled(op: &Op) -> bool {
    matches!(op, Op::MatMul { .. } | Op::MatMulActGrad { .. } | Op::ContractRows)
}

/// The workgroup memory of a tiled kernel (module scope), sized for the wide form's slices; and
/// for a product with an activation's gradient, the derivative as a function (`dact_`), which
/// each of a lane's stores calls.
pub fn declarations(op: &Op) -> String {
    let n = WIDE_TILE * TILE_K / 4;
    let mut s =
        format!("var<workgroup> tile_a: array<vec4<f32>, {n}>;\nvar<workgroup> tile_b: array<vec4<f32>, {n}>;\n");
    if let Op::MatMulActGrad { act, .. } = op {
        s += &format!("fn dact_(x: f32) -> f32 {{\n{}    return dact;\n}}\n", indent(activation_derivative(*act)));
    }
    s
}

/// The value a product stores for its element `o` (WGSL expressions): the sum itself, or for
/// [`Op::MatMulActGrad`] the sum times the activation's derivative at `x`'s element `o` (`in2`).
fn epilogue(op: &Op, sum: &str, o: &str) -> String {
    match op {
        Op::MatMulActGrad { .. } => format!("{sum} * dact_(in2[{o}])"),
        _ => sum.to_string(),
    }
}

/// How a tiled product runs for an `m` x `n` output in `batches` batches, contracting `k`: see
/// [`launch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Lanes of the first dispatch: one workgroup per block and slice.
    pub lanes: usize,
    /// The block's side, [`TILE`] or [`WIDE_TILE`].
    pub tile: usize,
    /// Contraction steps a slice takes (a multiple of [`TILE_K`], or the whole `k`).
    pub slice_k: usize,
    /// Slices of the contraction: above 1, each writes a partial product that a second dispatch
    /// adds in slice order (`dims[15]` = 1).
    pub slices: usize,
}

/// Workgroups a product aims at before it splits its contraction: about eight for each SM of a
/// large GPU (an H100 has 132). A 128 x 576 output (SmolLM2's gradient through its head, `k`
/// = 49 152) is 72 blocks: 72 workgroups each walking all of `k` left most of the device idle.
pub const FILL_WORKGROUPS: usize = 1024;

/// Fewest contraction steps a slice takes: each slice adds a partial output to write and read
/// again, so the contraction is split only where it is long against the output.
pub const MIN_SLICE_K: usize = 256;

/// Most bytes of partial products a split writes (a slice fewer, down to one, past it).
pub const MAX_PARTIAL_BYTES: usize = 64 << 20;

/// The launch of an `m` x `n` output in `batches` batches contracting `k` (see [`Launch`]): one
/// workgroup per block, of [`WIDE_TILE`] where there are at least [`WIDE_FROM_BLOCKS`] of
/// those, else of [`TILE`]; with `split`, where the blocks are fewer than [`FILL_WORKGROUPS`],
/// the contraction in slices of at least [`MIN_SLICE_K`] steps, enough to reach it.
pub fn launch(batches: usize, m: usize, n: usize, k: usize, split: bool) -> Launch {
    let blocks = |t: usize| batches * m.div_ceil(t) * n.div_ceil(t);
    let tile = if blocks(WIDE_TILE) >= WIDE_FROM_BLOCKS { WIDE_TILE } else { TILE };
    let blocks = blocks(tile).max(1);
    let outputs = (batches * m * n).max(1);
    let mut slices = match split {
        true => FILL_WORKGROUPS.div_ceil(blocks).min(k / MIN_SLICE_K).min(MAX_PARTIAL_BYTES / (4 * outputs)).max(1),
        false => 1,
    };
    let mut slice_k = k.max(1);
    if slices > 1 {
        slice_k = k.div_ceil(slices).next_multiple_of(TILE_K);
        slices = k.div_ceil(slice_k);
    }
    Launch { lanes: blocks * slices * LANES as usize, tile, slice_k, slices }
}

/// The sizes of the dispatch that adds a split product's partial results (`dims` the first's):
/// one lane per output element.
pub fn combine_dims(dims: &[u32; 16]) -> [u32; 16] {
    let mut c = *dims;
    c[15] = 2;
    c[0] = (dims[7] * dims[1] * dims[2]).next_multiple_of(LANES);
    c
}

/// Bytes of a split product's partial results: a whole output per slice.
pub fn partials_bytes(dims: &[u32; 16]) -> u64 {
    u64::from(dims[8]) * u64::from(dims[7]) * u64::from(dims[1]) * u64::from(dims[2]) * 4
}

/// How a kernel reads one operand's element `(r, c)` of its `rows` x `cols` slice: the WGSL
/// index expression, and whether consecutive `c` (true) or consecutive `r` are adjacent in memory.
struct Operand {
    index: &'static str,
    contiguous_cols: bool,
}

/// The body of `op`'s tiled kernel (`wg` and `lane` as the cooperative entry defines them), for
/// the sizes of `dims`: a `matmul`'s `[lanes, m, n, k, b batched, tile, slice_k, batches,
/// slices]`, a `contract_rows'` `[lanes, k, n, rows, 0, tile, slice_k, 1, slices]`; both block
/// forms, the one `tile` names run (a condition uniform over the dispatch). With `partials` (the
/// kernel binds `part`), a split product's slices write their partial outputs there where
/// `dims[15]` is 1, and a second dispatch (`dims[15]` = 2) adds them in slice order; without
/// (a chunked step's kernel), `slices` is 1.
pub fn body(op: &Op, partials: bool) -> String {
    let forms = match (form(op, WIDE_TILE, partials), form(op, TILE, partials)) {
        (Some(wide), Some(narrow)) => {
            format!("if (dim(5u) == {WIDE_TILE}u) {{\n{}}} else {{\n{}}}", indent(&wide), indent(&narrow))
        }
        _ => return String::new(),
    };
    match partials {
        true => format!(
            "if (dim(15u) == 2u) {{\n    let total = dim(7u) * dim(1u) * dim(2u);\n    let e = wg * {LANES}u + lane;\n    \
             if (e < total) {{\n        var t = 0.0;\n        \
             for (var s = 0u; s < dim(8u); s = s + 1u) {{ t = t + part[s * total + e]; }}\n        out[e] = {};\n    }}\n\
             }} else {{\n{}}}",
            epilogue(op, "t", "e"),
            indent(&forms)
        ),
        false => forms,
    }
}

/// The body of `op`'s kernel for blocks of `t` x `t` (`t / 8` square a lane); `None` for an op
/// that is not a tiled product. Each lane loads its elements of the next slices (`TILE_K` steps
/// of the contraction) into registers, all its loads issued together, while the workgroup
/// multiplies the slices staged before.
fn form(op: &Op, t: usize, partials: bool) -> Option<String> {
    // The sizes, the output's blocks (of each batch), and the workgroup's batch and slice of the
    // contraction.
    let sizes = format!(
        "let m = dim(1u);\nlet n = dim(2u);\nlet k = dim(3u);\nlet tiles_n = (n + {t1}u) / {t}u;\n\
         let blocks = ((m + {t1}u) / {t}u) * tiles_n;\nlet batches = dim(7u);\nlet bi = (wg / blocks) % batches;\n\
         let slice = wg / (blocks * batches);\nlet k_first = slice * dim(6u);\nlet k_end = min(k, k_first + dim(6u));\n",
        t1 = t - 1
    );
    // Each operand's element as `(row, kk)` of `a` and `(kk, col)` of `b`.
    let (setup, a, b) = match op {
        Op::MatMul { transpose_b } | Op::MatMulActGrad { transpose_b, .. } => (
            "let a0 = bi * m * k;\nlet b0 = select(0u, bi * k * n, dim(4u) == 1u);\nlet o0 = bi * m * n;\n",
            Operand { index: "a0 + row * k + kk", contiguous_cols: true },
            match transpose_b {
                true => Operand { index: "b0 + col * k + kk", contiguous_cols: false },
                false => Operand { index: "b0 + kk * n + col", contiguous_cols: true },
            },
        ),
        // Row `c` of the output is column `c` of `a`: `a`'s element (c, r) is `in0[r * m + c]`.
        Op::ContractRows => (
            "let o0 = 0u;\n",
            Operand { index: "kk * m + row", contiguous_cols: false },
            Operand { index: "kk * n + col", contiguous_cols: true },
        ),
        _ => return None,
    };
    let (tk, lanes, per, loads) = (TILE_K, LANES, t / 8, t / 4);
    // `vec4`s of a lane's row of accumulators.
    let quads = per / 4;
    // Element `e` of a slice (`t` x `TILE_K` of `a`, `TILE_K` x `t` of `b`) as its position
    // along the tile's rows or columns (`u`) and along the contraction (`v`): consecutive `e` step
    // along the operand's contiguous axis. Each lane's elements `lane + s * lanes`, found once.
    let place = |name: &str, along_k: bool| -> String {
        (0..loads)
            .map(|s| {
                let e = format!("(lane + {}u)", s * lanes as usize);
                let (u, v) = match along_k {
                    true => (format!("{e} / {tk}u"), format!("{e} % {tk}u")),
                    false => (format!("{e} % {t}u"), format!("{e} / {t}u")),
                };
                format!("let {name}u{s} = {u};\nlet {name}v{s} = {v};\n")
            })
            .collect()
    };
    let places = place("a", a.contiguous_cols) + &place("b", !b.contiguous_cols);
    // The lane's elements of the slices at contraction step `k1` into registers (zeros past the
    // edges and past the workgroup's slice of the contraction), then into workgroup memory.
    let load = |k1: &str| -> String {
        let mut s = String::new();
        for i in 0..loads {
            s += &format!(
                "{{\n    let row = r0 + au{i};\n    let kk = {k1} + av{i};\n    ra{i} = 0.0;\n    \
                 if (row < m && kk < k_end) {{ ra{i} = in0[{ai}]; }}\n}}\n",
                ai = a.index
            );
        }
        for i in 0..loads {
            s += &format!(
                "{{\n    let col = c0 + bu{i};\n    let kk = {k1} + bv{i};\n    rb{i} = 0.0;\n    \
                 if (col < n && kk < k_end) {{ rb{i} = in1[{bi}]; }}\n}}\n",
                bi = b.index
            );
        }
        s
    };
    let stage: String = (0..loads)
        .map(|i| {
            format!(
                "tile_a[(av{i} * {t}u + au{i}) / 4u][au{i} % 4u] = ra{i};\n\
                 tile_b[(bv{i} * {t}u + bu{i}) / 4u][bu{i} % 4u] = rb{i};\n"
            )
        })
        .collect();
    let registers: String = (0..loads).map(|i| format!("var ra{i} = 0.0;\nvar rb{i} = 0.0;\n")).collect();
    // One contraction step: the lane's `per` rows of `a` and `per` columns of `b` in `quads`
    // loads each, then each accumulator's product.
    let mut step = String::new();
    for q in 0..quads {
        step += &format!("        let x{q} = tile_a[(v * {t}u + lr) / 4u + {q}u];\n");
        step += &format!("        let y{q} = tile_b[(v * {t}u + lc) / 4u + {q}u];\n");
    }
    for r in 0..per {
        let x = format!("x{}.{}", r / 4, ["x", "y", "z", "w"][r % 4]);
        for q in 0..quads {
            let i = r * quads + q;
            step += &format!("        acc[{i}] = acc[{i}] + {x} * y{q};\n");
        }
    }
    // The lane's outputs, each written where it is inside the output. Unrolled, so the
    // accumulators are only ever indexed by constants: an array indexed at run time (a loop's
    // `acc[r * quads + c / 4][c % 4]`) may be placed in memory rather than registers by a GPU's
    // compiler, which then serves every product of the contraction from there.
    let mut stores: String = (0..per).map(|r| format!("let row{r} = r0 + lr + {r}u;\n")).collect();
    stores += &(0..per).map(|c| format!("let col{c} = c0 + lc + {c}u;\n")).collect::<String>();
    for r in 0..per {
        for c in 0..per {
            let value = format!("acc[{}].{}", r * quads + c / 4, ["x", "y", "z", "w"][c % 4]);
            let o = format!("o0 + row{r} * n + col{c}");
            // A split product's slices store their partial sums; the epilogue is the combine's.
            let store = match partials {
                true => format!(
                    "let o = {o}; if (dim(15u) == 1u) {{ part[slice * batches * m * n + o] = {value}; }} \
                     else {{ out[o] = {}; }}",
                    epilogue(op, &value, "o")
                ),
                false => format!("out[{o}] = {};", epilogue(op, &value, &o)),
            };
            stores += &format!("if (row{r} < m && col{c} < n) {{ {store} }}\n");
        }
    }
    Some(format!(
        "{sizes}{setup}let tile = wg % blocks;\nlet r0 = (tile / tiles_n) * {t}u;\nlet c0 = (tile % tiles_n) * {t}u;\n\
         let lr = (lane / 8u) * {per}u;\nlet lc = (lane % 8u) * {per}u;\nvar acc: array<vec4<f32>, {n_acc}>;\n\
         {places}{registers}{first}\
         for (var k0 = k_first; k0 < k_end; k0 = k0 + {tk}u) {{\n{stage}    workgroupBarrier();\n{next}    \
             for (var v = 0u; v < {tk}u; v = v + 1u) {{\n{step}    }}\n    \
             workgroupBarrier();\n}}\n\
         {stores}",
        n_acc = per * quads,
        first = load("k_first"),
        stage = indent(&stage),
        next = indent(&load(&format!("k0 + {tk}u"))),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wide form where an output has enough 64 x 64 blocks, over its batches; else 32 x 32.
    #[test]
    fn block_sizes() {
        let blocks = |l: Launch| (l.lanes / 64, l.tile);
        // GPT-2 small's MLP weight gradient, 768 x 3 072: 12 x 48 wide blocks.
        assert_eq!(blocks(launch(1, 768, 3072, 512, false)), (576, 64));
        // nanoGPT's, 128 x 512: 8 wide blocks, too few; 64 narrow ones.
        assert_eq!(blocks(launch(1, 128, 512, 768, false)), (64, 32));
        // Batches count: 8 x 7 x 6 wide blocks.
        assert_eq!(blocks(launch(8, 400, 330, 64, false)), (336, 64));
    }

    /// A long contraction over few blocks is split into slices of whole `TILE_K` steps, at least
    /// `MIN_SLICE_K` long, covering `k` exactly; a short one, or one over enough blocks, is not.
    #[test]
    fn slices() {
        // SmolLM2's gradient through its head: 128 x 576 (4 x 18 narrow blocks), k = 49 152.
        let l = launch(1, 128, 576, 49152, true);
        assert_eq!((l.tile, l.slices, l.slice_k), (32, 15, 3280));
        assert_eq!(l.lanes, 72 * 15 * 64);
        assert!(
            l.slice_k.is_multiple_of(TILE_K) && l.slice_k * (l.slices - 1) < 49152 && l.slice_k * l.slices >= 49152
        );
        // nanoGPT's weight gradient, 128 x 512 over 768 rows: 64 blocks, slices of 256 rows.
        let l = launch(1, 128, 512, 768, true);
        assert_eq!((l.slices, l.slice_k), (3, 256));
        // Too short to split, enough blocks, or not asked to.
        assert_eq!(launch(1, 128, 512, 500, true).slices, 1);
        assert_eq!(launch(1, 4096, 4096, 1 << 16, true).slices, 1);
        assert_eq!(launch(1, 1024, 1024, 1 << 16, true).slices, 4);
        assert_eq!(launch(1, 128, 576, 49152, false), Launch { lanes: 72 * 64, tile: 32, slice_k: 49152, slices: 1 });
        // The partial products stay within their bound.
        for (b, m, n) in [(1, 1000, 1000), (64, 64, 64), (1, 1, 1 << 20)] {
            let l = launch(b, m, n, 1 << 24, true);
            assert!(l.slices * b * m * n * 4 <= MAX_PARTIAL_BYTES.max(b * m * n * 4));
        }
        // Dims of the second dispatch and the scratch buffer's bytes.
        let mut dims = [0u32; 16];
        dims[..9].copy_from_slice(&[4608 * 15, 128, 576, 49152, 0, 32, 3280, 1, 15]);
        dims[15] = 1;
        let c = combine_dims(&dims);
        assert_eq!((c[0], c[15]), (128 * 576, 2));
        assert_eq!(partials_bytes(&dims), 15 * 128 * 576 * 4);
    }
}
