//! Timing graphs and kernels on a [`Device`], and the cost model's constants measured from them.
//!
//! The optimizer's [`CostModel`] prices a dispatch, a byte moved and a projection FLOP; on a
//! device they are measured ([`constants`]) as differences between runs of small chain graphs
//! that differ only in that quantity, and a kernel's own time ([`time_kernel`]) is taken step by
//! step (device timestamps where wgpu has them). [`Device::calibrate`] caches the constants as an
//! adapter's cost model; `kiln bench` reports the same figures and times more kernels with them.

use crate::device::{Device, LoadError, Storage, Weights};
use crate::{Clock, Model, ModelError, QuantWeight};
use kiln_compiler::graph::{Graph, GraphError, InputRole, Op, Prologue, RopeCols, Scalar, Sym};
use kiln_compiler::interp;
use kiln_compiler::lower::{self, WeightFormat};
use kiln_compiler::memory::MemoryError;
use kiln_compiler::optimize::CostModel;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;
use std::time::Instant;

/// What can go wrong measuring.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    /// A measurement graph does not type.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// Random parameters could not be drawn.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Loading a measurement graph.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Running it.
    #[error(transparent)]
    Run(#[from] ModelError),
    /// Saving the constants as the adapter's cost model.
    #[error(transparent)]
    Cost(#[from] crate::costs::CostError),
    /// The threads of a measurement could not be started.
    #[error("could not start the measurement's threads: {0}")]
    Pool(String),
    /// A quantity too small to tell from noise at the largest size tried.
    #[error("{what} is not measurable on {device}: {t:.4} ms at size {size} vs {t0:.4} ms at {base}")]
    NotMeasurable {
        /// The quantity.
        what: &'static str,
        /// The device.
        device: String,
        /// The time at the largest size, in ms.
        t: f64,
        /// That size.
        size: usize,
        /// The time at the base size, in ms.
        t0: f64,
        /// The base size.
        base: usize,
    },
}

type R<T> = Result<T, MeasureError>;

/// The cost model's constants on a device: the time (ms) of one dispatch, of one byte moved by a
/// memory-bound kernel and of one projection FLOP, and [`CostModel::scalar_projection`].
#[derive(Clone, Copy, Debug)]
pub struct Constants {
    /// One dispatch, in ms.
    pub dispatch_ms: f64,
    /// One byte moved, in ms.
    pub byte_ms: f64,
    /// One projection FLOP, in ms.
    pub flop_ms: f64,
    /// The scalar projection form's time over the `vec4` form's.
    pub scalar_projection: f64,
}

impl Constants {
    /// The constants in the cost model's unit (one byte moved), as the optimizer takes them.
    pub fn cost_model(&self) -> CostModel {
        CostModel {
            dispatch: self.dispatch_ms / self.byte_ms,
            flop: self.flop_ms / self.byte_ms,
            scalar_projection: self.scalar_projection,
            ..CostModel::default()
        }
    }
}

/// The bytes per second `threads` threads read from memory, streaming: each sums its share of a
/// buffer of `bytes` (far larger than the caches), the fastest of `runs` passes. The bound of a
/// decode step on the CPU, whose weights stream through once (see
/// [`kiln_compiler::lower::Plan::weight_bytes_read`]).
pub fn read_bandwidth(threads: usize, bytes: usize, runs: usize) -> R<f64> {
    use rayon::prelude::*;
    const LANES: usize = 8;
    let words = (bytes / 8).next_multiple_of(LANES * threads.max(1));
    kiln_compiler::memory::check(|| "the read-bandwidth buffer".into(), 8 * words as u64)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| MeasureError::Pool(e.to_string()))?;
    // Distinct values, so no page is shared or left untouched.
    let buffer: Vec<u64> = (0..words as u64).collect();
    let share = words / threads.max(1);
    let mut best = f64::INFINITY;
    let mut total = 0u64;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let sum: u64 = pool.install(|| {
            buffer
                .par_chunks(share)
                .map(|part| {
                    // Independent lanes, so the adds vectorize and never wait on each other.
                    let mut lanes = [0u64; LANES];
                    for chunk in part.chunks_exact(LANES) {
                        for (l, &w) in lanes.iter_mut().zip(chunk) {
                            *l = l.wrapping_add(w);
                        }
                    }
                    lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
                .reduce(|| 0, u64::wrapping_add)
        });
        best = best.min(t.elapsed().as_secs_f64());
        total = total.wrapping_add(std::hint::black_box(sum));
    }
    std::hint::black_box(total);
    Ok(8.0 * words as f64 / best)
}

/// Median of a few timings (NaN for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The wall time of `f`, in milliseconds.
pub fn time_ms<E>(f: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Measures the cost model's constants on `device`, medians of `runs`: each as the difference
/// between runs that differ only in that quantity (grown until the difference is clear of noise).
pub fn constants(device: &Device, runs: usize) -> R<Constants> {
    let scale = || (Op::Scale { factor: Scalar(1.0001) }, None);
    // Dispatch: 201 vs 1 scale of 64 floats.
    let small = |n: usize| chain(64, &vec![scale(); n]);
    let dispatch_ms = (time_graph(device, &small(201)?, 1, runs)? - time_graph(device, &small(1)?, 1, runs)?) / 200.0;
    // Bytes: 8 scales of rows x 1024 floats (8 B moved per element), from 64 rows up.
    let wide = chain(1024, &vec![scale(); 8])?;
    let byte_ms =
        slope(device, &wide, 64, &[4096, 16384, 65536], |rows| 8.0 * 8.0 * 1024.0 * rows as f64, runs, "a byte moved")?;
    // FLOPs: a projection 1024 -> 1024, from 32 rows up.
    let lin = chain(1024, &[(Op::linear(None, false, false), Some(vec![1024, 1024]))])?;
    let flop_ms = slope(
        device,
        &lin,
        32,
        &[256, 2048, 16384],
        |rows| 2.0 * 1024.0 * 1024.0 * rows as f64,
        runs,
        "a matmul FLOP",
    )?;
    let scalar_projection = scalar_projection(device, runs)?;
    Ok(Constants { dispatch_ms, byte_ms, flop_ms, scalar_projection })
}

/// [`CostModel::scalar_projection`] on `device`: the time of a projection with a RoPE epilogue
/// in the scalar form over that in the `vec4` form (SmolLM2's packed QKV at 128 rows; the rotated
/// columns start at column 4 or 0, see [`fusion_graph`]), at least 1; 1 but on wgpu, whose
/// kernels alone have the two forms.
fn scalar_projection(device: &Device, runs: usize) -> R<f64> {
    if !matches!(device, Device::Gpu(_)) {
        return Ok(1.0);
    }
    let time = |start| {
        time_kernel(
            device,
            &fusion_graph(576, 960, true, Some(start))?,
            &lower::Options::default(),
            WeightFormat::F32,
            128,
            runs,
        )
    };
    Ok((time(4)? / time(0)?.max(1e-9)).max(1.0))
}

/// A graph `ids -> gather -> op chain -> one column`, for timing one kind of kernel: the gather
/// and the final slice are the only other dispatches.
pub fn chain(d: usize, ops: &[(Op, Option<Vec<usize>>)]) -> Result<Graph, GraphError> {
    let mut g = Graph::new("calibrate");
    let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[])?;
    let table = g.param("table", &[16, d]);
    let mut x = g.add(Op::Gather, &[table, ids])?;
    for (k, (op, weight)) in ops.iter().enumerate() {
        let mut operands = vec![x];
        if let Some(shape) = weight {
            operands.push(g.param(&format!("w{k}"), shape));
        }
        x = g.add(op.clone(), &operands)?;
    }
    // Read back one column only, so the copy to the host does not enter the timings.
    let y = g.add(Op::Slice { axis: 2, start: 0, len: 1 }, &[x])?;
    g.outputs.push(("y".into(), y));
    Ok(g)
}

/// The input of a [`chain`] graph: `seq` ids.
fn chain_inputs(seq: usize) -> HashMap<String, Tensor> {
    let ids = Tensor::i64(vec![1, seq], (0..seq as i64).map(|i| i % 16).collect());
    HashMap::from([("input_ids".to_string(), ids)])
}

/// Times the forward of `g` at `seq` tokens (median of `runs`), in milliseconds.
fn time_graph(device: &Device, g: &Graph, seq: usize, runs: usize) -> R<f64> {
    let params = interp::random_params(g, 2)?;
    let inputs = chain_inputs(seq);
    let blocks = HashMap::new();
    let model = device.load_plan(
        lower::lower(g),
        Weights::Given { params: &params, blocks: &blocks },
        Storage::default(),
        &(),
    )?;
    model.run(&inputs)?;
    let mut t = Vec::new();
    for _ in 0..runs {
        t.push(time_ms(|| model.run(&inputs).map(drop))?);
    }
    Ok(median(t))
}

/// The time per unit of work of `g` (ms), from runs at growing sizes: `base`, then the first of
/// `larger` at which the extra work takes at least half of the run's time (so the difference
/// stands clear of the fixed costs and their noise) gives the time difference over the work
/// difference. A fast device needs sizes a slow one would take seconds over; the last size is
/// used if none qualifies, and a difference that is not positive there is an error, not a
/// constant.
fn slope(
    device: &Device,
    g: &Graph,
    base: usize,
    larger: &[usize],
    work: impl Fn(usize) -> f64,
    runs: usize,
    what: &'static str,
) -> R<f64> {
    let t0 = time_graph(device, g, base, runs)?;
    let mut last = (base, t0);
    for &size in larger {
        let t = time_graph(device, g, size, runs)?;
        last = (size, t);
        if t - t0 >= 0.5 * t {
            break;
        }
    }
    let (size, t) = last;
    if t <= t0 {
        return Err(MeasureError::NotMeasurable { what, device: device.describe(), t, size, t0, base });
    }
    Ok((t - t0) / (work(size) - work(base)))
}

/// A graph `ids -> gather (x [1, rows, k]) -> rms_norm -> x @ w^T -> one column`, with the norm
/// in the projection's prologue when `fused`, and with a RoPE epilogue (heads of 64 from column
/// `rope`, over all but the last `n / 5` columns: the queries and keys of a packed QKV
/// projection; a column not a multiple of 8 takes the scalar form) when `rope` is given: the
/// prologue and epilogue of a decoder's attention input.
pub fn fusion_graph(k: usize, n: usize, fused: bool, rope: Option<usize>) -> Result<Graph, GraphError> {
    let mut g = Graph::new("fusion");
    let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[])?;
    let table = g.param("table", &[16, k]);
    let x = g.add(Op::Gather, &[table, ids])?;
    let gain = g.param("gain", &[k]);
    let w = g.param("w0", &[n, k]);
    let eps = Scalar(1e-5);
    let rotated = n - n / 5;
    let cols = RopeCols {
        theta: Scalar(10000.0),
        rotary_dim: 64,
        style: kiln_compiler::graph::PairStyle::RotateHalf,
        head_dim: 64,
        start: rope.unwrap_or(0),
        len: rotated - rotated % 64 - 64,
    };
    let linear = |norm, rope| Op::Linear { act: None, bias: false, residual: false, norm, glu: false, rope };
    let rope = rope.map(|_| cols);
    let y = if fused {
        let prologue = Some(Prologue { rms: true, eps, bias: false });
        g.add(linear(prologue, rope), &[x, gain, w])?
    } else {
        let normed = g.add(Op::RmsNorm { eps }, &[x, gain])?;
        g.add(linear(None, rope), &[normed, w])?
    };
    let y = g.add(Op::Slice { axis: 2, start: 0, len: 1 }, &[y])?;
    g.outputs.push(("y".into(), y));
    Ok(g)
}

/// A graph `ids -> gather (x [1, rows, k]) -> x @ w^T -> one column`, or without the projection
/// (`n = None`).
pub fn projection_graph(k: usize, n: Option<usize>) -> Result<Graph, GraphError> {
    let projection = n.map(|n| (Op::MatMul { transpose_b: true }, Some(vec![n, k])));
    chain(k, projection.as_slice())
}

/// The time (ms, median of `runs`) of the kernels of a [`chain`] graph's measured ops alone — its
/// steps but the gather and the slice that frame them — each step timed by itself: on wgpu
/// between timestamps the device writes where it has them, else by the host around that step's
/// submission alone (see [`crate::GpuModel::profile`]); on the CPU by the host around the step.
/// A kernel's own time, never the difference of two runs (which load can make negative).
pub fn time_kernel(
    device: &Device,
    g: &Graph,
    options: &lower::Options,
    format: WeightFormat,
    seq: usize,
    runs: usize,
) -> R<f64> {
    time_kernel_with(device, g, options, format, seq, runs, false)
}

/// [`time_kernel`], with `int8` the CPU's quantized projections multiplied with int8 activations
/// ([`Storage::int8_activations`]).
pub fn time_kernel_with(
    device: &Device,
    g: &Graph,
    options: &lower::Options,
    format: WeightFormat,
    seq: usize,
    runs: usize,
    int8: bool,
) -> R<f64> {
    let (model, inputs) = chain_model(device, g, options, format, seq, int8)?;
    model.run(&inputs)?;
    let measured: Vec<usize> = (model.plan().steps.iter().enumerate())
        .filter(|(_, step)| !matches!(step.op, Op::Gather | Op::Slice { .. }))
        .map(|(i, _)| i)
        .collect();
    let mut t = Vec::new();
    for _ in 0..runs.max(1) {
        let seconds = step_seconds(&model, &inputs)?.0;
        t.push(measured.iter().map(|&i| seconds.get(i).copied().unwrap_or(0.0)).sum::<f64>() * 1e3);
    }
    Ok(median(t))
}

/// A [`chain`] graph loaded on `device` with random weights (projection weights `w*` stored in
/// `format`; with `int8`, multiplied with int8 activations), and its input of `seq` ids.
fn chain_model(
    device: &Device,
    g: &Graph,
    options: &lower::Options,
    format: WeightFormat,
    seq: usize,
    int8: bool,
) -> R<(Model, HashMap<String, Tensor>)> {
    let mut params = interp::random_params(g, 2)?;
    let mut blocks = HashMap::new();
    let mut options = options.clone();
    for (name, t) in params.iter_mut().filter(|(n, _)| n.starts_with('w')) {
        if let Some(q) = QuantWeight::quantize(format, t) {
            *t = q.dequantize();
            options.formats.insert(name.clone(), format);
            blocks.insert(name.clone(), q);
        }
    }
    let plan = lower::lower_with(g, options);
    let precision = match format {
        WeightFormat::F16 => crate::device::Precision::F16,
        _ => crate::device::Precision::F32,
    };
    let storage = Storage { precision, int8_activations: int8, ..Storage::default() };
    let model = device.load_plan(plan, Weights::Given { params: &params, blocks: &blocks }, storage, &())?;
    Ok((model, chain_inputs(seq)))
}

/// The seconds each step of `model`'s plan takes, each timed by itself (0 for a step with nothing
/// to compute), and the clock read: on wgpu [`crate::GpuModel::profile`]'s, on the CPU the host's
/// around each step.
pub fn step_seconds(model: &Model, inputs: &HashMap<String, Tensor>) -> Result<(Vec<f64>, &'static str), ModelError> {
    Ok(match model {
        Model::Gpu(m) => {
            let p = m.profile(inputs)?;
            let clock = match p.clock {
                Clock::Device => "device timestamps",
                Clock::Host => "host clock per dispatch",
            };
            (p.seconds.into_iter().map(|s| s.unwrap_or(0.0)).collect(), clock)
        }
        Model::Cpu(m) => (m.profile(inputs)?, "host clock per step"),
    })
}
