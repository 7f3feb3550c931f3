//! Tiled matrix products of two activations: [`Op::MatMul`] (batched, `b` transposed or not) and
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
//! Each output element sums its products in contraction order into one accumulator, as the plain
//! forms did. The slices are held as `vec4`s, four consecutive rows (or columns) of one
//! contraction step each, so a lane reads its 4 rows of `a` and 4 columns of `b` at a step in
//! two loads from workgroup memory rather than eight (the loads per product halve the FMAs'
//! share of a GPU's issue slots otherwise); the arithmetic is the same.

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
    matches!(op, Op::MatMul { .. } | Op::ContractRows)
}

/// The workgroup memory of a tiled kernel (module scope), sized for the wide form's slices.
pub fn declarations() -> String {
    let n = WIDE_TILE * TILE_K / 4;
    format!("var<workgroup> tile_a: array<vec4<f32>, {n}>;\nvar<workgroup> tile_b: array<vec4<f32>, {n}>;\n")
}

/// Lanes (the first size, a multiple of [`LANES`]) and block size for an `m` x `n` output in
/// `batches` batches: one workgroup per block, of [`WIDE_TILE`] where there are at least
/// [`WIDE_FROM_BLOCKS`] of those, else of [`TILE`].
pub fn lanes(batches: usize, m: usize, n: usize) -> (usize, usize) {
    let blocks = |t: usize| batches * m.div_ceil(t) * n.div_ceil(t);
    let tile = if blocks(WIDE_TILE) >= WIDE_FROM_BLOCKS { WIDE_TILE } else { TILE };
    (blocks(tile) * LANES as usize, tile)
}

/// How a kernel reads one operand's element `(r, c)` of its `rows` x `cols` slice: the WGSL
/// index expression, and whether consecutive `c` (true) or consecutive `r` are adjacent in memory.
struct Operand {
    index: &'static str,
    contiguous_cols: bool,
}

/// The body of `op`'s tiled kernel (`wg` and `lane` as the cooperative entry defines them), for
/// the sizes of `dims`: a `matmul`'s `[lanes, m, n, k, b batched, tile]`, a `contract_rows'`
/// `[lanes, k, n, rows, 0, tile]`; both block forms, the one `tile` names run (a condition
/// uniform over the dispatch).
pub fn body(op: &Op) -> String {
    let indent = |s: String| s.lines().map(|l| format!("    {l}\n")).collect::<String>();
    match (form(op, WIDE_TILE), form(op, TILE)) {
        (Some(wide), Some(narrow)) => {
            format!("if (dim(5u) == {WIDE_TILE}u) {{\n{}}} else {{\n{}}}", indent(wide), indent(narrow))
        }
        _ => String::new(),
    }
}

/// The body of `op`'s kernel for blocks of `t` x `t` (`t / 8` square a lane); `None` for an op
/// that is not a tiled product.
fn form(op: &Op, t: usize) -> Option<String> {
    // The sizes, and the output's blocks (of each batch).
    let sizes = format!(
        "let m = dim(1u);\nlet n = dim(2u);\nlet k = dim(3u);\nlet tiles_n = (n + {t1}u) / {t}u;\n\
         let blocks = ((m + {t1}u) / {t}u) * tiles_n;\n",
        t1 = t - 1
    );
    // Each operand's element as `(row, kk)` of `a` and `(kk, col)` of `b`.
    let (setup, a, b) = match op {
        Op::MatMul { transpose_b } => (
            "let bi = wg / blocks;\nlet a0 = bi * m * k;\nlet b0 = select(0u, bi * k * n, dim(4u) == 1u);\nlet o0 = bi * m * n;\n",
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
    // along the operand's contiguous axis.
    let split = |along_k: bool| match along_k {
        true => format!("let u = e / {tk}u;\n        let v = e % {tk}u;"),
        false => format!("let v = e / {t}u;\n        let u = e % {t}u;"),
    };
    let a_split = split(a.contiguous_cols);
    let b_split = split(!b.contiguous_cols);
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
    Some(format!(
        "{sizes}{setup}let tile = wg % blocks;\nlet r0 = (tile / tiles_n) * {t}u;\nlet c0 = (tile % tiles_n) * {t}u;\n\
         let lr = (lane / 8u) * {per}u;\nlet lc = (lane % 8u) * {per}u;\nvar acc: array<vec4<f32>, {n_acc}>;\n\
         for (var k0 = 0u; k0 < k; k0 = k0 + {tk}u) {{\n    \
             for (var s = 0u; s < {loads}u; s = s + 1u) {{\n        let e = lane + s * {lanes}u;\n        {a_split}\n        \
                 let row = r0 + u;\n        let kk = k0 + v;\n        var x = 0.0;\n        \
                 if (row < m && kk < k) {{ x = in0[{ai}]; }}\n        let at = v * {t}u + u;\n        tile_a[at / 4u][at % 4u] = x;\n    }}\n    \
             for (var s = 0u; s < {loads}u; s = s + 1u) {{\n        let e = lane + s * {lanes}u;\n        {b_split}\n        \
                 let col = c0 + u;\n        let kk = k0 + v;\n        var y = 0.0;\n        \
                 if (col < n && kk < k) {{ y = in1[{bi}]; }}\n        let at = v * {t}u + u;\n        tile_b[at / 4u][at % 4u] = y;\n    }}\n    \
             workgroupBarrier();\n    \
             for (var v = 0u; v < {tk}u; v = v + 1u) {{\n{step}    }}\n    \
             workgroupBarrier();\n}}\n\
         for (var r = 0u; r < {per}u; r = r + 1u) {{\n    let row = r0 + lr + r;\n    \
             for (var c = 0u; c < {per}u; c = c + 1u) {{\n        let col = c0 + lc + c;\n        \
                 if (row < m && col < n) {{ out[o0 + row * n + col] = acc[r * {quads}u + c / 4u][c % 4u]; }}\n    }}\n}}\n",
        n_acc = per * quads,
        ai = a.index,
        bi = b.index,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wide form where an output has enough 64 x 64 blocks, over its batches; else 32 x 32.
    #[test]
    fn block_sizes() {
        // GPT-2 small's MLP weight gradient, 768 x 3 072: 12 x 48 wide blocks.
        assert_eq!(lanes(1, 768, 3072), (576 * 64, 64));
        // nanoGPT's, 128 x 512: 8 wide blocks, too few; 64 narrow ones.
        assert_eq!(lanes(1, 128, 512), (64 * 64, 32));
        // Batches count: 8 x 7 x 6 wide blocks.
        assert_eq!(lanes(8, 400, 330), (336 * 64, 64));
    }
}
