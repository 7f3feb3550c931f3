//! `kiln bench kernels`: GFLOPS of the projection kernels, reference against fast, at prefill and
//! decode shapes, with their fused norm prologue and RoPE epilogue, and by weight format; on the
//! CPU, a decode GEMV streaming its weight from memory against the bandwidth the threads read.

use super::KernelArgs;
use crate::progress::Reporter;
use anyhow::Result;
use kiln_compiler::lower::{self, WeightFormat};
use kiln_runtime::Device;
use kiln_runtime::measure::{fusion_graph, projection_graph, time_kernel, time_kernel_with};

/// Runs `kiln bench kernels`.
pub fn run(args: KernelArgs, reporter: &Reporter) -> Result<()> {
    super::at_least_one(&[("--runs", args.runs)])?;
    kernels(&args.device.open(reporter, args.json)?, args.runs, args.json)
}

/// The formats compared on `device`: f32, f16 where the adapter has it, Q8_0, Q4_1.
fn formats(device: &Device) -> Vec<WeightFormat> {
    let mut v = vec![WeightFormat::F32];
    if let Device::Gpu(gpu) = device
        && gpu.supports_f16()
    {
        v.push(WeightFormat::F16);
    }
    v.extend([WeightFormat::Q8_0, WeightFormat::Q4_1]);
    v
}

/// One projection shape of `kiln bench kernels`.
struct Projection {
    what: &'static str,
    rows: usize,
    k: usize,
    n: usize,
}

/// `kiln bench kernels`: GFLOPS of the projection kernel against the reference, the product of
/// two activations (`matmul_t` over `[out, in]` weights: the tiled kernel of `wgsl::gemm` on a
/// device, what attention's unfused scores and a training step's backward run), same shapes,
/// same run: a prefill GEMM and decode GEMVs. Each time is the projection's kernel alone (see
/// [`time_kernel`]).
fn kernels(device: &Device, runs: usize, json: bool) -> Result<()> {
    let shapes = [
        Projection { what: "prefill GEMM", rows: 1024, k: 1024, n: 1024 },
        Projection { what: "prefill GEMM (gpt2 mlp)", rows: 128, k: 768, n: 3072 },
        Projection { what: "decode GEMV", rows: 1, k: 576, n: 1536 },
        Projection { what: "decode GEMV (gpt2 qkv)", rows: 1, k: 768, n: 2304 },
    ];
    let reference = lower::Options { fast_projections: false, ..lower::Options::default() };
    let fast = lower::Options::default();
    let f32 = WeightFormat::F32;
    let mut rows = Vec::new();
    for s in &shapes {
        let g = projection_graph(s.k, Some(s.n))?;
        let old = time_kernel(device, &g, &reference, f32, s.rows, runs)?;
        let new = time_kernel(device, &g, &fast, f32, s.rows, runs)?;
        let gflops = |ms: f64| 2.0 * (s.rows * s.k * s.n) as f64 / (ms.max(1e-6) * 1e6);
        rows.push((s, old, new, gflops(old), gflops(new)));
    }
    // The norm prologue and the RoPE epilogue at SmolLM2's packed QKV projection (576 -> 960):
    // the norm as its own kernel, then in the projection's prologue, then with the rotation too.
    let mut fusions = Vec::new();
    for m in [1, 16, 128] {
        let (k, n) = (576, 960);
        let time = |fused, rope| time_kernel(device, &fusion_graph(k, n, fused, rope)?, &fast, f32, m, runs);
        let scalar_rope = time(true, Some(4))?;
        fusions.push((m, k, n, time(false, None)?, time(true, None)?, time(true, Some(0))?, scalar_rope));
    }
    // Weight formats at the decode GEMV and a prefill GEMM of SmolLM2's MLP (576 -> 1536): GB/s
    // counts the weight's bytes on the device (what a GEMV is bound by).
    let mut by_format = Vec::new();
    for (what, m) in [("decode GEMV", 1), ("prefill GEMM", 128)] {
        let (k, n) = (576, 1536);
        let g = projection_graph(k, Some(n))?;
        for format in formats(device) {
            let ms = time_kernel(device, &g, &fast, format, m, runs)?;
            let bytes = format.bytes(n, k);
            let gb_s = bytes as f64 / (ms.max(1e-6) * 1e6);
            let gflops = 2.0 * (m * k * n) as f64 / (ms.max(1e-6) * 1e6);
            by_format.push((what, m, k, n, format, ms, bytes, gb_s, gflops));
        }
    }
    // A decode GEMV whose weight streams from memory, far past the caches: Gemma 3's 262144 x 640
    // head in Q8_0 (180 MB), the largest product of its decode step, with f32 activations (the
    // default) and with int8 ones (`--int8-activations`), beside the bandwidth the threads read
    // from memory. The CPU only (a GPU's decode is timed by `bench decode`).
    let mut streaming = Vec::new();
    if let Device::Cpu { threads } = device {
        let (k, n, format) = (640, 262_144, WeightFormat::Q8_0);
        let read = kiln_runtime::measure::read_bandwidth(*threads, super::decode::BANDWIDTH_BUFFER, 10)? / 1e9;
        for (acts, int8) in [("f32", false), ("int8", true)] {
            let ms = time_kernel_with(device, &projection_graph(k, Some(n))?, &fast, format, 1, runs, int8)?;
            let bytes = format.bytes(n, k);
            streaming.push((k, n, format, acts, ms, bytes, bytes as f64 / (ms.max(1e-6) * 1e6), read));
        }
    }
    // Quantized prefill on the CPU: each block format at a shape of Gemma 3 270M's layers (Q4_1
    // at SmolLM2's MLP, whose blocks Gemma has none of) and a 32-token prompt, with f32
    // activations (the default) and with int8 ones (`--int8-activations`: the integer GEMM);
    // and the decode GEMV of each at the same shape (f32 activations: the default), its rate
    // over the weight's bytes (in cache: the kernel's own rate, not the memory's).
    let (mut int8_prefill, mut decode_by_format) = (Vec::new(), Vec::new());
    if let Device::Cpu { .. } = device {
        let m = 32;
        for (format, k, n) in [
            (WeightFormat::Q8_0, 640, 1536),
            (WeightFormat::Q4_1, 576, 1536),
            (WeightFormat::Q5_0, 640, 2048),
            (WeightFormat::Q4_K, 1024, 640),
            (WeightFormat::Q6_K, 2048, 640),
        ] {
            let g = projection_graph(k, Some(n))?;
            let time = |int8| time_kernel_with(device, &g, &fast, format, m, runs, int8);
            let (f32_ms, int8_ms) = (time(false)?, time(true)?);
            int8_prefill.push((format, m, k, n, f32_ms, int8_ms));
            let ms = time_kernel_with(device, &g, &fast, format, 1, runs, false)?;
            let bytes = format.bytes(n, k);
            decode_by_format.push((format, k, n, ms, bytes, bytes as f64 / (ms.max(1e-6) * 1e6)));
        }
    }
    let gflops = |m: usize, k: usize, n: usize, ms: f64| 2.0 * (m * k * n) as f64 / (ms.max(1e-6) * 1e6);
    if json {
        let int8_prefill: Vec<serde_json::Value> = int8_prefill
            .iter()
            .map(|&(f, m, k, n, f32_ms, int8_ms)| {
                serde_json::json!({"format": f.name(), "m": m, "k": k, "n": n, "f32_ms": f32_ms, "int8_ms": int8_ms,
                    "f32_gflops": gflops(m, k, n, f32_ms), "int8_gflops": gflops(m, k, n, int8_ms)})
            })
            .collect();
        let streaming: Vec<serde_json::Value> = streaming
            .iter()
            .map(|(k, n, f, acts, ms, bytes, gb_s, read)| {
                serde_json::json!({"shape": "decode GEMV from memory (Gemma 3's head)", "m": 1, "k": k, "n": n,
                    "format": f.name(), "activations": acts, "ms": ms, "weight_bytes": bytes, "weight_gb_s": gb_s,
                    "read_bandwidth_gb_s": read})
            })
            .collect();
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|(s, old, new, go, gn)| {
                serde_json::json!({"shape": s.what, "m": s.rows, "k": s.k, "n": s.n,
                    "reference_ms": old, "fast_ms": new, "reference_gflops": go, "fast_gflops": gn})
            })
            .collect();
        let formats: Vec<serde_json::Value> = by_format
            .iter()
            .map(|(what, m, k, n, f, ms, bytes, gb_s, gflops)| {
                serde_json::json!({"shape": what, "m": m, "k": k, "n": n, "format": f.name(), "ms": ms,
                    "weight_bytes": bytes, "weight_gb_s": gb_s, "gflops": gflops})
            })
            .collect();
        let fusions: Vec<serde_json::Value> = fusions
            .iter()
            .map(|(m, k, n, apart, prologue, rope, scalar)| {
                serde_json::json!({"m": m, "k": k, "n": n, "norm_then_projection_ms": apart,
                    "prologue_ms": prologue, "prologue_rope_ms": rope, "prologue_rope_scalar_ms": scalar})
            })
            .collect();
        let decode_by_format: Vec<serde_json::Value> = decode_by_format
            .iter()
            .map(|(f, k, n, ms, bytes, gb_s)| {
                serde_json::json!({"format": f.name(), "m": 1, "k": k, "n": n, "ms": ms, "weight_bytes": bytes,
                    "weight_gb_s": gb_s})
            })
            .collect();
        let out = serde_json::json!({"adapter": device.describe(), "runs": runs, "projections": rows,
            "weight_formats": formats, "fusions": fusions, "streaming": streaming, "int8_prefill": int8_prefill,
            "quantized_decode": decode_by_format});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("projection kernels on {} (median of {runs}; GFLOPS = 2 m k n / time)", device.describe());
        println!(
            "  {:<24} {:>5} {:>5} {:>5} {:>12} {:>10} {:>12} {:>10} {:>8}",
            "shape", "m", "k", "n", "reference ms", "GFLOPS", "fast ms", "GFLOPS", "speedup"
        );
        for (s, old, new, go, gn) in &rows {
            println!(
                "  {:<24} {:>5} {:>5} {:>5} {:>12.2} {:>10.2} {:>12.2} {:>10.2} {:>7.1}x",
                s.what,
                s.rows,
                s.k,
                s.n,
                old,
                go,
                new,
                gn,
                old / new
            );
        }
        println!("norm prologue and RoPE epilogue (fast kernel; ms of every kernel between input and output)");
        println!(
            "  {:>5} {:>5} {:>5} {:>15} {:>12} {:>9} {:>16} {:>14}",
            "m", "k", "n", "norm + proj ms", "prologue ms", "+rope ms", "+rope scalar ms", "prologue gain"
        );
        for (m, k, n, apart, prologue, rope, scalar) in &fusions {
            println!(
                "  {m:>5} {k:>5} {n:>5} {apart:>15.3} {prologue:>12.3} {rope:>9.3} {scalar:>16.3} {:>13.2}x",
                apart / prologue
            );
        }
        println!("weight formats (fast kernel; GB/s = weight bytes / time)");
        println!(
            "  {:<24} {:>5} {:>5} {:>5} {:>6} {:>10} {:>12} {:>8} {:>10} {:>9}",
            "shape", "m", "k", "n", "format", "ms", "weight bytes", "GB/s", "GFLOPS", "vs f32"
        );
        for (what, m, k, n, f, ms, bytes, gb_s, gflops) in &by_format {
            let f32_ms = by_format.iter().find(|r| r.0 == *what && r.4 == WeightFormat::F32).map_or(*ms, |r| r.5);
            println!(
                "  {what:<24} {m:>5} {k:>5} {n:>5} {:>6} {ms:>10.3} {bytes:>12} {gb_s:>8.2} {gflops:>10.2} {:>8.2}x",
                f.name(),
                f32_ms / ms
            );
        }
        for (k, n, f, acts, ms, bytes, gb_s, read) in &streaming {
            println!(
                "decode GEMV from memory (Gemma 3's head): {k} -> {n}, {}, {acts} activations, {ms:.2} ms, \
                 {bytes} weight bytes, {gb_s:.1} GB/s = {:.0}% of the {read:.1} GB/s these threads read",
                f.name(),
                100.0 * gb_s / read
            );
        }
        if !int8_prefill.is_empty() {
            println!("quantized prefill GEMM, f32 activations against int8 ones (--int8-activations)");
            println!(
                "  {:>6} {:>5} {:>5} {:>5} {:>10} {:>10} {:>10} {:>10} {:>8}",
                "format", "m", "k", "n", "f32 ms", "GFLOPS", "int8 ms", "GFLOPS", "speedup"
            );
            for &(f, m, k, n, f32_ms, int8_ms) in &int8_prefill {
                println!(
                    "  {:>6} {m:>5} {k:>5} {n:>5} {f32_ms:>10.3} {:>10.2} {int8_ms:>10.3} {:>10.2} {:>7.2}x",
                    f.name(),
                    gflops(m, k, n, f32_ms),
                    gflops(m, k, n, int8_ms),
                    f32_ms / int8_ms
                );
            }
            println!("quantized decode GEMV, f32 activations (GB/s = weight bytes / time, the weight in cache)");
            println!(
                "  {:>6} {:>5} {:>5} {:>5} {:>10} {:>12} {:>8}",
                "format", "m", "k", "n", "ms", "weight bytes", "GB/s"
            );
            for (f, k, n, ms, bytes, gb_s) in &decode_by_format {
                println!("  {:>6} {:>5} {k:>5} {n:>5} {ms:>10.4} {bytes:>12} {gb_s:>8.2}", f.name(), 1);
            }
        }
    }
    Ok(())
}
