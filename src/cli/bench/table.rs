//! `kiln bench table`: one summary of kiln on a device over several models and sequence lengths
//! (forward ms, tok/s, decode tok/s, dispatches, device memory), and the kernels' GFLOPS.

use super::attention::{AttentionShape, attention_time};
use super::{BUILT_IN, DeviceArgs, bench_target, built_in};
use crate::exec::params_for;
use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_compiler::graph::Sym;
use kiln_compiler::graph::build::build_cached;
use kiln_compiler::lower::{self, WeightFormat};
use kiln_compiler::{FrontEnd, interp, optimize};
use kiln_runtime::measure::{median, projection_graph, time_kernel, time_ms};
use kiln_runtime::{Device, Storage, Weights};
use std::collections::HashMap;
use std::path::PathBuf;

/// Arguments of `kiln bench table`.
#[derive(clap::Args)]
pub struct TableArgs {
    /// The specs: files, or names of built-in specs (`kiln list`). Default:
    /// `benches/specs/gpt2-small.toml`, `smollm2-135m` and `minilm-l6` (all built into kiln).
    #[arg(long, value_delimiter = ',')]
    models: Vec<PathBuf>,
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "32,128")]
    seqs: Vec<usize>,
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `kiln bench table`.
pub fn run(args: TableArgs, reporter: &Reporter) -> Result<()> {
    super::at_least_one(&[("--runs", args.runs)])?;
    super::at_least_one(&args.seqs.iter().map(|&s| ("--seqs", s)).collect::<Vec<_>>())?;
    let device = args.device.open(reporter, args.json)?;
    let specs = match args.models.is_empty() {
        true => BUILT_IN.iter().map(|&(name, _)| Ok((name.to_string(), built_in(name)?.1))).collect(),
        false => args
            .models
            .iter()
            .map(|p| Ok((p.display().to_string(), crate::model_file::read_spec(p)?.1)))
            .collect::<Result<Vec<_>>>(),
    }?;
    table(&specs, &device, &args.seqs, args.runs, args.json)
}

/// One model of `kiln bench table`.
struct TableRow {
    model: String,
    seq: usize,
    forward_ms: f64,
    dispatches: usize,
    weight_bytes: u64,
    intermediate_bytes: u64,
    /// Decode tokens per second after a prompt of `seq` tokens (decoders only).
    decode_tok_s: Option<f64>,
}

/// `kiln bench table`: one summary of kiln on an adapter. For each spec (random seeded
/// weights) and sequence length: the optimized forward time, tokens per second, dispatches,
/// device memory (weights, and intermediates as placed at that length), and for decoders the
/// decode rate with the device-resident cache; then the kernels' GFLOPS (the projection at a
/// prefill and a decode shape, causal attention). Every figure is a median of `runs`.
fn table(specs: &[(String, FrontEnd)], device: &Device, seqs: &[usize], runs: usize, json: bool) -> Result<()> {
    use kiln_runtime::Sampler;
    use kiln_runtime::generate::{Session, generate};
    let decode_steps = 8;
    let mut rows = Vec::new();
    for (path, fe) in specs {
        let optimized = optimize::optimize_for(&fe.graph, &bench_target(device))?.0;
        let (params, blocks) = params_for(fe, &optimized, None, Storage::default())?;
        let model =
            device.model(&optimized, Weights::Given { params: &params, blocks: &blocks }, Storage::default(), &())?;
        let weight_bytes: u64 = model.weight_bytes().iter().map(|(_, b)| b).sum();
        let plan = model.plan();
        let dispatches = plan.steps.len();
        let slots = |seq: usize| -> u64 {
            let syms = HashMap::from([(Sym::Batch, 1), (Sym::Seq, seq), (Sym::Past, 0), (Sym::SrcSeq, seq)]);
            plan.slot_sizes(&syms).iter().sum()
        };
        let intermediate: Vec<u64> = seqs.iter().map(|&s| slots(s)).collect();
        let decoder = fe.spec.spec.model.kind == kiln_compiler::spec::BlockKind::Decoder;
        let cached = if decoder {
            let g = optimize::optimize_for(&build_cached(&fe.spec)?, &bench_target(device))?.0;
            let outputs: Vec<String> = g.outputs.iter().map(|(n, _)| n.clone()).collect();
            let params = params_for(fe, &g, None, Storage::default())?.0;
            let step = device.model(
                &g,
                Weights::Given { params: &params, blocks: &HashMap::new() },
                Storage::default(),
                &(),
            )?;
            Some(Session::new(step.into(), &outputs, usize::MAX)?)
        } else {
            None
        };
        let mut session = cached;
        for (&seq, &intermediate_bytes) in seqs.iter().zip(&intermediate) {
            if seq + decode_steps > fe.spec.spec.model.max_positions as usize {
                bail!("{path}: {seq} tokens exceed the model's {} positions", fe.spec.spec.model.max_positions);
            }
            let inputs = interp::sample_inputs(&fe.graph, fe.spec.spec.model.vocab as usize, 1, seq)?;
            model.run(&inputs).with_context(|| format!("{path}: warm-up run at {seq} tokens"))?;
            let mut t = Vec::new();
            for _ in 0..runs {
                t.push(time_ms(|| model.run(&inputs).map(drop))?);
            }
            let decode_tok_s = match &mut session {
                Some(session) => {
                    let vocab = fe.spec.spec.model.vocab as i64;
                    let ids: Vec<i64> = (0..seq as i64).map(|i| (i * 7919 + 13) % vocab).collect();
                    let mut rates = Vec::new();
                    for _ in 0..runs {
                        let (_, stats) =
                            generate(session, &ids, decode_steps + 1, &mut Sampler::greedy(), &[], |_| true)?;
                        rates.push(stats.decode_tok_s());
                        session.reset();
                    }
                    Some(median(rates))
                }
                None => None,
            };
            rows.push(TableRow {
                model: fe.graph.name.clone(),
                seq,
                forward_ms: median(t),
                dispatches,
                weight_bytes,
                intermediate_bytes,
                decode_tok_s,
            });
        }
    }
    // Kernels: the fast projection at a prefill and a decode shape, causal attention (GQA 3:1).
    let gqa = AttentionShape { what: "smollm2", heads: 9, kv_heads: 3, head_dim: 64, seq: 512 };
    let fast = lower::Options::default();
    let projection = |rows: usize, k: usize, n: usize| -> Result<f64> {
        let ms = time_kernel(device, &projection_graph(k, Some(n))?, &fast, WeightFormat::F32, rows, runs)?;
        Ok(2.0 * (rows * k * n) as f64 / (ms.max(1e-6) * 1e6))
    };
    let (gemm, gemv) = (projection(1024, 1024, 1024)?, projection(1, 576, 1536)?);
    let attention = attention_time(device, &gqa, runs)?.1;
    let tok_s = |r: &TableRow| r.seq as f64 / (r.forward_ms / 1e3);
    if json {
        let models: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"model": r.model, "seq": r.seq, "forward_ms": r.forward_ms, "prefill_tok_s": tok_s(r),
                    "decode_tok_s": r.decode_tok_s, "dispatches": r.dispatches, "weight_bytes": r.weight_bytes,
                    "intermediate_bytes": r.intermediate_bytes})
            })
            .collect();
        let out = serde_json::json!({
            "backend": device.name(), "adapter": device.describe(), "runs": runs, "batch": 1, "decode_steps": decode_steps, "models": models,
            "kernels_gflops": {"projection_gemm_1024": gemm, "projection_gemv_576x1536": gemv, "attention_causal_gqa_512": attention},
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("kiln on {} (optimized graphs, random weights, batch 1, median of {runs})", device.describe());
    println!(
        "  {:<7} {:<14} {:>5} {:>11} {:>10} {:>11} {:>10} {:>9} {:>13}",
        "backend", "model", "seq", "forward ms", "tok/s", "decode t/s", "dispatch", "weights", "intermediates"
    );
    for r in &rows {
        let decode = r.decode_tok_s.map_or("-".to_string(), |d| format!("{d:.2}"));
        println!(
            "  {:<7} {:<14} {:>5} {:>11.1} {:>10.1} {:>11} {:>10} {:>9} {:>13}",
            device.name(),
            r.model,
            r.seq,
            r.forward_ms,
            tok_s(r),
            decode,
            r.dispatches,
            kiln_compiler::memory::human(r.weight_bytes),
            kiln_compiler::memory::human(r.intermediate_bytes),
        );
    }
    println!("  kernels: projection 1024x1024x1024 {gemm:.2} GFLOPS, decode GEMV 576x1536 {gemv:.2} GFLOPS,");
    println!("           causal attention (9 heads, 3 kv, d 64, seq 512) {attention:.2} GFLOPS");
    Ok(())
}
