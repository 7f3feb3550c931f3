//! `kiln bench decode`: generation with the key/value cache, a prompt then decode steps: prefill
//! and decode tokens per second. An encoder-decoder's prompt is its source: encoded once per
//! generation (its time part of the prefill's), then decoded from the decoder's start token.

use super::{DeviceArgs, SpecArgs, Spread, at_least_one, bench_target, weight_bytes, weight_bytes_json};
use crate::exec::{WeightArgs, params_for};
use crate::progress::Reporter;
use anyhow::{Result, bail};
use kiln_compiler::graph::build::{build_cached, build_encoder};
use kiln_compiler::spec::BlockKind;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, optimize};
use kiln_runtime::{Device, Memory, Weights};
use std::collections::HashMap;
use std::path::PathBuf;

/// Arguments of `kiln bench decode`.
#[derive(clap::Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    spec: SpecArgs,
    /// Tokens of the prompt.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Decode steps after the prompt.
    #[arg(long)]
    steps: usize,
    /// Timed generations (the median is reported, with the fastest and slowest).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Sequences decoded together in each step (continuous batching's step, as `kiln serve` runs
    /// it): each prompt is run alone, then every decode step runs one token of each; tokens per
    /// second count every sequence's.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Real weights (safetensors or GGUF) instead of random ones.
    #[arg(long)]
    weights: Option<PathBuf>,
    #[command(flatten)]
    storage: WeightArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// Where the decode steps' time goes, by op (the CPU back end): each plan step's host time
    /// summed over every timed decode step, with the weights its steps read and the rate they
    /// read them at.
    #[arg(long)]
    profile: bool,
}

impl DecodeArgs {
    /// The spec file, if one is named.
    pub fn spec(&self) -> Option<&std::path::Path> {
        self.spec.path()
    }
}

/// The buffer the read bandwidth is measured on: far larger than any CPU's caches.
pub(super) const BANDWIDTH_BUFFER: usize = 1 << 29;

/// Runs `kiln bench decode`.
pub fn run(args: DecodeArgs, reporter: &Reporter) -> Result<()> {
    at_least_one(&[("--runs", args.runs), ("--seq", args.seq), ("--steps", args.steps), ("--batch", args.batch)])?;
    let device = args.device.open(reporter, args.json)?;
    let (_, fe) = args.spec.read()?;
    decode(&fe, &device, &args)
}

/// Generation with the key/value cache on the device (optimized graph, greedy): a prompt of
/// `prompt` tokens, then `steps` decode steps; prefill and decode tokens per second, medians of
/// `runs` generations.
fn decode(fe: &FrontEnd, device: &Device, args: &DecodeArgs) -> Result<()> {
    let DecodeArgs { seq: prompt, steps, runs, json, storage, batch, profile, .. } = *args;
    let weights = args.weights.as_deref();
    use kiln_runtime::Sampler;
    use kiln_runtime::generate::{Session, generate};
    let cached = optimize::optimize_for(&build_cached(&fe.spec)?, &bench_target(device))?.0;
    let encoder_decoder = fe.spec.spec.model.kind == BlockKind::EncoderDecoder;
    if encoder_decoder && batch > 1 {
        bail!(
            "--batch decodes several prompts together; `{}` is an encoder-decoder, whose prompt is its source",
            fe.graph.name
        );
    }
    // An encoder-decoder's parameters are drawn for the whole model (the encoder's too), which
    // the decoder's step and the encoder each read by name.
    let drawn_for = if encoder_decoder { &fe.graph } else { &cached };
    let (params, blocks) = params_for(fe, drawn_for, weights, storage.storage())?;
    let encoder = match encoder_decoder {
        true => {
            let graph = optimize::optimize_for(&build_encoder(&fe.spec)?, &bench_target(device))?.0;
            let weights = Weights::Given { params: &params, blocks: &blocks };
            Some(device.load(&graph, weights, storage.storage(), &())?.into_engine())
        }
        false => None,
    };
    let outputs: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let mut model =
        device.model(&cached, Weights::Given { params: &params, blocks: &blocks }, storage.storage(), &())?;
    let dispatches = model.plan().steps.len();
    // With `--profile`, each step's op and the weights it reads, and the sums of its times.
    let plan = model.plan();
    let steps_read: Vec<(String, String, u64)> = (plan.steps.iter().enumerate())
        .map(|(i, s)| (s.op.name(), s.scope.clone(), plan.step_weight_bytes(i)))
        .collect();
    let recorder = match (&mut model, profile) {
        (kiln_runtime::Model::Cpu(m), true) => Some(m.record_step_times()),
        (_, true) => bail!(
            "--profile times the CPU back end's steps; on wgpu, `kiln bench profile` times each dispatch of a forward"
        ),
        (_, false) => None,
    };
    let clear = || {
        if let Some(Ok(mut r)) = recorder.as_ref().map(|r| r.lock()) {
            r.clear();
        }
    };
    // The decode steps' sums over every run, each run's added when it ends.
    let mut profiled = kiln_runtime::StepTimes { seconds: vec![0.0; steps_read.len()], runs: 0 };
    let add_run = |profiled: &mut kiln_runtime::StepTimes| {
        if let Some(Ok(r)) = recorder.as_ref().map(|r| r.lock()) {
            profiled.seconds.iter_mut().zip(&r.seconds).for_each(|(t, s)| *t += s);
            profiled.runs += r.runs;
        }
    };
    // On wgpu, the kernels' forms the model was built with (the adapter's defaults, or what
    // `kiln tune` chose for these shapes there).
    let forms = match &model {
        kiln_runtime::Model::Gpu(m) => Some(m.program().options.describe()),
        kiln_runtime::Model::Cpu(_) => None,
    };
    let device_weights = (weight_bytes(&model), weight_bytes_json(&model));
    // On the CPU, a decode step streams its weights from memory once: the bytes it reads and how
    // fast these threads can read them bound its speed.
    let bound = match device {
        Device::Cpu { threads } => {
            let bandwidth = kiln_runtime::measure::read_bandwidth(*threads, BANDWIDTH_BUFFER, 10)?;
            Some((model.plan().weight_bytes_read(1), bandwidth))
        }
        Device::Gpu(_) | Device::Interp => None,
    };
    let mut session = Session::new(model.into(), &outputs, usize::MAX)?;
    let vocab = fe.spec.spec.model.vocab as i64;
    let ids: Vec<i64> = (0..prompt as i64).map(|i| (i * 7919 + 13) % vocab).collect();
    if prompt + steps > fe.spec.spec.model.max_positions as usize {
        bail!("{prompt} + {steps} tokens exceed the model's {} positions", fe.spec.spec.model.max_positions);
    }
    let (mut prefill, mut decode, mut host) = (Vec::new(), Vec::new(), Vec::new());
    // On a device, the host's share of each decode step: its time up to the step's submission.
    let clock = session.host_clock();
    for _ in 0..runs {
        if batch > 1 {
            let (p, d, h) = decode_together(&mut session, clock.as_ref(), &ids, steps, batch, vocab, &clear)?;
            prefill.push(p);
            decode.push(d);
            host.extend(h);
            add_run(&mut profiled);
            continue;
        }
        // A fresh cache per run; the pipelines and weights are shared. The clock is read at the
        // first token (after the prefill) and at the end: the decode steps' share.
        let (mut after_prefill, mut first) = (None, true);
        let on_token = |_| {
            after_prefill = after_prefill.or_else(|| clock.as_ref().map(|c| c.read()));
            // The prompt's run is not a decode step's: the profile's sums start here.
            if std::mem::take(&mut first) {
                clear();
            }
            true
        };
        // An encoder-decoder's source encoded, then decoded from the start token (0).
        let started = std::time::Instant::now();
        if let Some(encoder) = &encoder {
            let src = HashMap::from([("src_ids".to_string(), Tensor::i64(vec![1, prompt], ids.clone()))]);
            session.set_memory(Memory::encode(encoder.as_ref(), &src)?);
        }
        let encode_s = started.elapsed().as_secs_f64();
        let decoder_prompt = if encoder.is_some() { &[0][..] } else { &ids[..] };
        let (_, stats) = generate(&mut session, decoder_prompt, steps + 1, &mut Sampler::greedy(), &[], on_token)?;
        prefill.push(prompt as f64 / (encode_s + stats.prefill_s).max(f64::MIN_POSITIVE));
        decode.push(stats.decode_tok_s());
        add_run(&mut profiled);
        if let (Some(c), Some((s0, n0))) = (&clock, after_prefill) {
            let (s1, n1) = c.read();
            host.push(1e6 * (s1 - s0) / n1.saturating_sub(n0).max(1) as f64);
        }
        session.reset();
    }
    let (prefill, decode) = (Spread::of(&prefill), Spread::of(&decode));
    // The weights' read rate at the median decode speed, and its share of the measured bandwidth.
    let read = bound.map(|(bytes, bandwidth)| {
        let rate = bytes as f64 * decode.median / batch as f64;
        (bytes, bandwidth, rate, rate / bandwidth)
    });
    let host = (!host.is_empty()).then(|| Spread::of(&host));
    let by_op = recorder.is_some().then(|| OpProfile::of(&steps_read, &profiled));
    if json {
        let out = serde_json::json!({
            "model": fe.graph.name, "backend": device.name(), "adapter": device.describe(), "prompt_tokens": prompt, "decode_steps": steps, "batch": batch,
            "runs": runs, "dispatches_per_step": dispatches, "prefill_tok_s": prefill.median, "decode_tok_s": decode.median,
            "prefill_tok_s_min": prefill.min, "prefill_tok_s_max": prefill.max, "decode_tok_s_min": decode.min, "decode_tok_s_max": decode.max,
            "weights": weights.map(|w| w.display().to_string()), "weight_bytes": device_weights.1,
            "host_us_per_step": host.as_ref().map(|h| h.median), "kernel_forms": forms,
            "host_us_per_step_min": host.as_ref().map(|h| h.min), "host_us_per_step_max": host.as_ref().map(|h| h.max),
            "weight_bytes_per_step": read.map(|r| r.0), "read_bandwidth_gb_s": read.map(|r| r.1 / 1e9),
            "decode_read_gb_s": read.map(|r| r.2 / 1e9), "decode_bandwidth_fraction": read.map(|r| r.3),
            "profile": by_op.as_ref().map(|p| p.json()),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{} generating on {} (median of {}, fastest..slowest in brackets; {dispatches} dispatches per step)",
            fe.graph.name,
            device.describe(),
            crate::report::count(runs, "run")
        );
        if let Some(forms) = &forms {
            println!("  kernel forms: {forms}");
        }
        if batch > 1 {
            println!(
                "  {batch} sequences decoded together; tokens per second count every sequence's, from the second step"
            );
        }
        println!("  prefill {prompt} tokens: {} tok/s", prefill.text(1));
        println!("  decode {steps} steps:    {} tok/s", decode.text(2));
        if let Some(h) = &host {
            println!(
                "  host per decode step: {} µs (binding, encoding and submitting; the rest is the device)",
                h.text(0)
            );
        }
        println!("  weights on the device: {}", device_weights.0);
        if let Some((bytes, bandwidth, rate, fraction)) = read {
            println!(
                "  a decode step reads {} of weights (once for the batch): {:.1} GB/s at the median, {:.0}% of the \
                 {:.1} GB/s these threads read from memory",
                kiln_compiler::memory::human(bytes),
                rate / 1e9,
                100.0 * fraction,
                bandwidth / 1e9
            );
        }
        if let Some(p) = &by_op {
            p.print();
        }
    }
    Ok(())
}

/// `--profile`'s table: per op, the plan's steps of it, their host time per decode step, and the
/// weights they read per step and the rate they read them at.
struct OpProfile {
    /// Decode steps summed.
    runs: usize,
    /// (op, plan steps, seconds per decode step, weight bytes per decode step), slowest first.
    rows: Vec<(String, usize, f64, u64)>,
    /// The slowest plan steps: (step, op, scope, seconds per decode step, weight bytes).
    slowest: Vec<(usize, String, String, f64, u64)>,
}

/// Plan steps `--profile` lists by name, slowest first.
const SLOWEST_STEPS: usize = 8;

/// Weights of `bytes` read in `seconds`, as `--profile` prints them: the size and the GB/s;
/// `None` for a step that reads none.
fn read(bytes: u64, seconds: f64) -> Option<(String, String)> {
    (bytes > 0).then(|| {
        let rate = bytes as f64 / seconds.max(f64::MIN_POSITIVE) / 1e9;
        (kiln_compiler::memory::human(bytes), format!("{rate:.1}"))
    })
}

impl OpProfile {
    /// The table of `steps` (each plan step's op, scope and the weight bytes it reads) timed by
    /// `times`.
    fn of(steps: &[(String, String, u64)], times: &kiln_runtime::StepTimes) -> OpProfile {
        let per = times.runs.max(1) as f64;
        let mut by_op: HashMap<&str, (usize, f64, u64)> = HashMap::new();
        for ((op, _, bytes), &s) in steps.iter().zip(&times.seconds) {
            let e = by_op.entry(op).or_default();
            *e = (e.0 + 1, e.1 + s, e.2 + bytes);
        }
        let mut rows: Vec<_> = by_op.into_iter().map(|(op, (n, s, b))| (op.to_string(), n, s / per, b)).collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        let mut slowest: Vec<_> = (steps.iter().zip(&times.seconds).enumerate())
            .map(|(i, ((op, scope, bytes), &s))| (i, op.clone(), scope.clone(), s / per, *bytes))
            .collect();
        slowest.sort_by(|a, b| b.3.total_cmp(&a.3).then(a.0.cmp(&b.0)));
        slowest.truncate(SLOWEST_STEPS);
        OpProfile { runs: times.runs, rows, slowest }
    }

    fn total(&self) -> f64 {
        self.rows.iter().map(|r| r.2).sum()
    }

    fn print(&self) {
        let total = self.total();
        println!(
            "  profile of a decode step ({} summed; host clock per plan step, its kernel's threads included), {:.3} ms in steps:",
            crate::report::count(self.runs, "decode step"),
            1e3 * total
        );
        println!(
            "    {:<28} {:>6} {:>10} {:>7} {:>14} {:>8}",
            "op", "steps", "ms a step", "share", "weights a step", "GB/s"
        );
        for (op, n, s, bytes) in &self.rows {
            let share = 100.0 * s / total.max(f64::MIN_POSITIVE);
            let (weights, rate) = read(*bytes, *s).unwrap_or_default();
            println!("    {op:<28} {n:>6} {:>10.3} {share:>6.1}% {weights:>14} {rate:>8}", 1e3 * s);
        }
        println!("    slowest steps:");
        for (i, op, scope, s, bytes) in &self.slowest {
            let read = read(*bytes, *s).map_or(String::new(), |(weights, rate)| format!(", {weights} at {rate} GB/s"));
            println!("      step {i:<4} {op:<28} {scope:<24} {:>8.1} µs{read}", 1e6 * s);
        }
    }

    fn json(&self) -> serde_json::Value {
        let rows: Vec<_> = (self.rows.iter())
            .map(|(op, n, s, bytes)| {
                serde_json::json!({ "op": op, "steps": n, "ms_per_step": 1e3 * s, "weight_bytes_per_step": bytes })
            })
            .collect();
        let slowest: Vec<_> = (self.slowest.iter())
            .map(|(i, op, scope, s, bytes)| {
                serde_json::json!({ "step": i, "op": op, "scope": scope, "us_per_step": 1e6 * s, "weight_bytes": bytes })
            })
            .collect();
        serde_json::json!({ "decode_steps": self.runs, "ms_in_steps": 1e3 * self.total(), "ops": rows, "slowest_steps": slowest })
    }
}

/// One run of `batch` sequences: each prompt (`ids`, rotated by the sequence's index so that no
/// two are alike) prefilled alone and parked, then `steps` decode steps running one greedy token
/// of every sequence together. Prompt and decode tokens per second over all the sequences, and
/// on a device the host's microseconds per batched step (`clock` read after the prompts).
/// `clear_profile` is called before the first timed step.
fn decode_together(
    session: &mut kiln_runtime::Session,
    clock: Option<&kiln_runtime::gpu::HostClock>,
    ids: &[i64],
    steps: usize,
    batch: usize,
    vocab: i64,
    clear_profile: &dyn Fn(),
) -> Result<(f64, f64, Option<f64>)> {
    let greedy = |logits: &[f32]| kiln_runtime::Sampler::greedy().sample(logits, &[]);
    let start = std::time::Instant::now();
    let (mut parked, mut next) = (Vec::with_capacity(batch), Vec::with_capacity(batch));
    for s in 0..batch as i64 {
        let prompt: Vec<i64> = ids.iter().map(|&t| (t + s) % vocab).collect();
        next.push(greedy(&session.forward(&prompt)?));
        parked.push(session.park());
    }
    let prefill = (batch * ids.len()) as f64 / start.elapsed().as_secs_f64();
    // Timed from the second step where there are several: the first builds the batched forms'
    // pipelines (`Variant::AtStarts`, made at first use on a device).
    let (mut before, mut start, mut timed) = (clock.map(|c| c.read()), std::time::Instant::now(), steps);
    for step in 0..steps {
        if step == 1 {
            (before, start, timed) = (clock.map(|c| c.read()), std::time::Instant::now(), steps - 1);
        }
        // The profile's sums start with the timed steps (the first where there is one alone).
        if step == steps.min(2) - 1 {
            clear_profile();
        }
        let mut seqs: Vec<_> = parked.iter_mut().zip(&next).map(|(p, &t)| (p, t)).collect();
        let Some(rows) = session.forward_batch(&mut seqs)? else {
            bail!(
                "--batch: this model's step cannot decode sequences together on this back end (it reads more than token ids and caches)"
            );
        };
        next = rows.iter().map(|l| greedy(l)).collect();
    }
    let decode = (batch * timed) as f64 / start.elapsed().as_secs_f64().max(1e-9);
    let host = clock.zip(before).map(|(c, (s0, n0))| {
        let (s1, n1) = c.read();
        1e6 * (s1 - s0) / n1.saturating_sub(n0).max(1) as f64
    });
    Ok((prefill, decode, host))
}
