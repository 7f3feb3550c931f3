//! `kiln bench attention`: time and GFLOPS of the fused causal attention kernel at prefill shapes
//! (MHA and grouped-query), and block-sparse (BigBird) against dense bidirectional attention.

use super::KernelArgs;
use crate::progress::Reporter;
use anyhow::Result;
use kiln_compiler::graph::{BlockPattern, Op, PackedAttention, Scalar, ScoreMods};
use kiln_compiler::lower::{self, WeightFormat};
use kiln_runtime::Device;
use kiln_runtime::measure::{chain, time_kernel};

/// Runs `kiln bench attention`.
pub fn run(args: KernelArgs, reporter: &Reporter) -> Result<()> {
    super::at_least_one(&[("--runs", args.runs)])?;
    attention_kernels(&args.device.open(reporter, args.json)?, args.runs, args.json)
}

/// One attention shape of `kiln bench kernels`.
pub(super) struct AttentionShape {
    pub(super) what: &'static str,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) seq: usize,
}

/// The time (ms) and GFLOPS of causal packed attention at shape `s`, its kernel alone (see
/// [`time_kernel`]). GFLOPS count the `q k` and `p v` products of the attended (query, key) pairs
/// only: `4 d` per pair and head.
pub(super) fn attention_time(device: &Device, s: &AttentionShape, runs: usize) -> Result<(f64, f64)> {
    let width = (s.heads + 2 * s.kv_heads) * s.head_dim;
    let attention = Op::PackedAttention(PackedAttention {
        scale: Scalar(1.0 / (s.head_dim as f32).sqrt()),
        alibi: false,
        causal: true,
        window: None,
        mods: Default::default(),
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        q: 0,
        k: s.heads * s.head_dim,
        v: (s.heads + s.kv_heads) * s.head_dim,
        cached: false,
        appends: false,
    });
    let options = lower::Options::default();
    let ms = time_kernel(device, &chain(width, &[(attention, None)])?, &options, WeightFormat::F32, s.seq, runs)?;
    let pairs = s.seq * (s.seq + 1) / 2;
    Ok((ms, 4.0 * (s.heads * s.head_dim * pairs) as f64 / (ms.max(1e-6) * 1e6)))
}

/// The BigBird pattern `kiln bench attention` times: BigBird-base's blocks of 64 with three
/// random blocks, one global block and one neighbour on each side.
const BIGBIRD: BlockPattern = BlockPattern { block: 64, global: 1, window: 1, random: 3, seed: 7 };

/// The time (ms) of bidirectional packed attention (12 heads of 64) over `seq` tokens, block-sparse
/// with [`BIGBIRD`]'s pattern or dense, its kernel alone (see [`time_kernel`]).
fn bidirectional_attention_time(device: &Device, seq: usize, sparse: bool, runs: usize) -> Result<f64> {
    let (heads, head_dim) = (12, 64);
    let width = 3 * heads * head_dim;
    let mods = ScoreMods { sparse: sparse.then_some(BIGBIRD), ..ScoreMods::default() };
    let attention = Op::PackedAttention(PackedAttention {
        scale: Scalar(1.0 / (head_dim as f32).sqrt()),
        alibi: false,
        causal: false,
        window: None,
        mods,
        heads,
        kv_heads: heads,
        head_dim,
        q: 0,
        k: heads * head_dim,
        v: 2 * heads * head_dim,
        cached: false,
        appends: false,
    });
    let options = lower::Options::default();
    Ok(time_kernel(device, &chain(width, &[(attention, None)])?, &options, WeightFormat::F32, seq, runs)?)
}

/// `kiln bench attention`: the fused causal attention kernel reading its heads from packed
/// `qkv` rows (as a prefill runs it), MHA and grouped-query, sequences 128 to 1024 (see
/// [`attention_time`]).
fn attention_kernels(device: &Device, runs: usize, json: bool) -> Result<()> {
    let shapes = [
        AttentionShape { what: "gpt2 (MHA)", heads: 12, kv_heads: 12, head_dim: 64, seq: 128 },
        AttentionShape { what: "gpt2 (MHA)", heads: 12, kv_heads: 12, head_dim: 64, seq: 512 },
        AttentionShape { what: "smollm2 (GQA 3:1)", heads: 9, kv_heads: 3, head_dim: 64, seq: 128 },
        AttentionShape { what: "smollm2 (GQA 3:1)", heads: 9, kv_heads: 3, head_dim: 64, seq: 512 },
        AttentionShape { what: "smollm2 (GQA 3:1)", heads: 9, kv_heads: 3, head_dim: 64, seq: 1024 },
    ];
    let mut rows = Vec::new();
    for s in &shapes {
        let (ms, gflops) = attention_time(device, s, runs)?;
        rows.push((s, ms, gflops));
    }
    // Block-sparse against dense: time per token flat against growing linearly.
    let mut sparse_rows = Vec::new();
    for seq in [256, 512, 1024, 2048, 4096] {
        let sparse = bidirectional_attention_time(device, seq, true, runs)?;
        let dense = bidirectional_attention_time(device, seq, false, runs)?;
        sparse_rows.push((seq, sparse, dense));
    }
    if json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|(s, ms, gflops)| {
                serde_json::json!({"shape": s.what, "heads": s.heads, "kv_heads": s.kv_heads,
                    "head_dim": s.head_dim, "seq": s.seq, "causal": true, "ms": ms, "gflops": gflops})
            })
            .collect();
        let sparse: Vec<serde_json::Value> = sparse_rows
            .iter()
            .map(|(seq, sparse, dense)| {
                serde_json::json!({"seq": seq, "heads": 12, "head_dim": 64, "block": BIGBIRD.block,
                    "global": BIGBIRD.global, "window": BIGBIRD.window, "random": BIGBIRD.random,
                    "sparse_ms": sparse, "dense_ms": dense,
                    "sparse_us_per_token": sparse * 1e3 / *seq as f64, "dense_us_per_token": dense * 1e3 / *seq as f64})
            })
            .collect();
        let out =
            serde_json::json!({"adapter": device.describe(), "runs": runs, "attention": rows, "block_sparse": sparse});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "causal attention kernel on {} (median of {runs}; GFLOPS = 4 d heads pairs / time)",
            device.describe()
        );
        println!("  {:<20} {:>6} {:>4} {:>4} {:>6} {:>10} {:>8}", "shape", "heads", "kv", "d", "seq", "ms", "GFLOPS");
        for (s, ms, gflops) in &rows {
            println!(
                "  {:<20} {:>6} {:>4} {:>4} {:>6} {:>10.2} {:>8.2}",
                s.what, s.heads, s.kv_heads, s.head_dim, s.seq, ms, gflops
            );
        }
        println!(
            "block-sparse (BigBird: blocks of {}, {} global, window {}, {} random) vs dense bidirectional attention, 12 heads of 64",
            BIGBIRD.block, BIGBIRD.global, BIGBIRD.window, BIGBIRD.random
        );
        println!(
            "  {:>6} {:>10} {:>10} {:>12} {:>12}",
            "seq", "sparse ms", "dense ms", "sparse µs/tok", "dense µs/tok"
        );
        for (seq, sparse, dense) in &sparse_rows {
            let per = |ms: f64| ms * 1e3 / *seq as f64;
            println!("  {seq:>6} {sparse:>10.2} {dense:>10.2} {:>12.2} {:>12.2}", per(*sparse), per(*dense));
        }
    }
    Ok(())
}
