//! Projection weights stored as Q8_0, Q4_1 or Q5_0 blocks or Q4_K or Q6_K super-blocks
//! (dequantized in registers) or as f16, on wgpu and on the CPU, against the interpreter on the
//! f32 weights they stand for (the blocks' exact
//! dequantization, or the weights rounded to f16): every kernel form (vec4 and scalar, GEMM and
//! GEMV) with bias, activation, residual, norm prologues, gated and rotated epilogues, and
//! projections whose weight is a load-time stack or scaling of quantized parameters.

use crate::common;

use kiln_compiler::graph::{Graph, InputRole, Op, Scalar, Sym};
use kiln_compiler::interp;
use kiln_compiler::lower::{Options, Plan, WeightFormat, lower_with};
use kiln_compiler::tensor::Tensor;
use kiln_runtime::{GpuModel, QuantWeight};
use std::collections::{BTreeMap, HashMap};

/// Allowed difference, relative to `max(1, max |value|)`: the weights are the same numbers on
/// both sides, so only the order of the sums differs.
const TOLERANCE: f32 = 2e-5;

fn ops() -> Vec<Op> {
    common::projection_ops()
}

/// Every block-quantized format.
const QUANTIZED: [WeightFormat; 5] =
    [WeightFormat::Q8_0, WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q4_K, WeightFormat::Q6_K];

/// [`graph_k`] with rows of whole blocks of `format`: `k` 32 to 96, or 256 to 768 for the
/// K-quants' super-blocks of 256.
fn graph_for(format: WeightFormat) -> (Graph, Vec<String>) {
    graph_k(format.row_multiple().div_ceil(32))
}

fn graph() -> (Graph, Vec<String>) {
    graph_k(1)
}

/// One graph with every op at every shape `(rows, k, n)` (`k` times `k_factor`): GEMM over
/// several row tiles, GEMV (1 to 4 rows), the first row count past GEMV, `n` not a multiple of 4
/// (a gated one then runs the scalar form). Returns the graph and the names of its projection
/// weights.
fn graph_k(k_factor: usize) -> (Graph, Vec<String>) {
    let shapes: [(&[usize], usize, usize); 7] = [
        (&[2, 37], 64, 24),
        (&[1, 1], 64, 24),
        (&[1, 4], 96, 28),
        (&[1, 5], 32, 24),
        (&[1, 1], 64, 26),
        (&[3, 9], 32, 10),
        (&[1, 2], 64, 6),
    ];
    let mut g = Graph::new("formats");
    let mut weights = Vec::new();
    for (c, op) in ops().into_iter().enumerate() {
        let Op::Linear { bias, residual, norm, glu, rope, .. } = op.clone() else { unreachable!() };
        for (s, &(rows, k, n)) in shapes.iter().enumerate() {
            if rope.is_some() && n != 24 {
                continue; // the rotated columns are laid out for 24
            }
            let name = |p: &str| format!("op{c}.shape{s}.{p}");
            let k = k * k_factor;
            let x: Vec<usize> = rows.iter().copied().chain([k]).collect();
            let out: Vec<usize> = rows.iter().copied().chain([n]).collect();
            let m = if glu { 2 * n } else { n };
            let mut a = vec![g.param(&name("x"), &x)];
            if let Some(p) = norm {
                a.push(g.param(&name("norm.weight"), &[k]));
                if p.bias {
                    a.push(g.param(&name("norm.bias"), &[k]));
                }
            }
            a.push(g.param(&name("w"), &[m, k]));
            weights.push(name("w"));
            if bias {
                a.push(g.param(&name("b"), &[m]));
            }
            if residual {
                a.push(g.param(&name("r"), &out));
            }
            let y = g.add(op.clone(), &a).unwrap();
            g.outputs.push((name("y"), y));
        }
    }
    g.check().unwrap();
    (g, weights)
}

fn assert_close(what: &str, expected: &Tensor, got: &Tensor, tolerance: f32) {
    let scale = expected.as_f32().unwrap().iter().fold(1.0f32, |m, x| m.max(x.abs()));
    let err = expected.max_abs_diff(got);
    assert!(err <= tolerance * scale, "{what}: differs by {err:e} (max |x| {scale})");
}

/// Every projection of `plan` reads its weight in `format`.
fn assert_formats(plan: &Plan, format: WeightFormat) {
    let mut n = 0;
    for step in &plan.steps {
        if let Some(wi) = step.op.linear_weight() {
            assert_eq!(plan.values[step.operands[wi]].format, format, "`{}` reads its weight as", step.scope);
            n += 1;
        }
    }
    assert!(n > 0, "no projection in the plan");
}

/// A projection graph of `format` whose weights are quantized: the f32 parameters (the weights
/// dequantized, so the interpreter computes what the blocks hold), the blocks, the interpreter's
/// outputs, and the plan lowered unfolded, so the kernels read parameters as they would read
/// activations.
struct QuantizedCase {
    params: HashMap<String, Tensor>,
    blocks: HashMap<String, QuantWeight>,
    expected: Vec<(String, Tensor)>,
    plan: Plan,
}

fn quantized_case(format: WeightFormat) -> QuantizedCase {
    let (g, weights) = graph_for(format);
    let mut params = interp::random_params(&g, 11).unwrap();
    let mut blocks = HashMap::new();
    for w in &weights {
        let q = QuantWeight::quantize(format, &params[w]).unwrap();
        params.insert(w.clone(), q.dequantize());
        blocks.insert(w.clone(), q);
    }
    let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
    let formats: BTreeMap<String, WeightFormat> = weights.iter().map(|w| (w.clone(), format)).collect();
    let plan = lower_with(&g, Options { fold_constants: false, formats, ..Options::default() });
    assert_formats(&plan, format);
    QuantizedCase { params, blocks, expected, plan }
}

/// Every block-quantized format on wgpu, in the adapter's forms and, where it has subgroups, a
/// hardware adapter's split forms: the split GEMV at a decode step's rows and the split GEMM past
/// 4 (27 and 74 rows, each ending in a partial block of rows).
#[test]
fn quantized_projections_match_the_interpreter_on_dequantized_weights() {
    let Some(gpu) = common::gpu() else { return };
    let split = kiln_compiler::back::wgsl::Options { subgroups: true, split_rows: Some(4), ..gpu.options() };
    let forms: Vec<_> = std::iter::once(gpu.options()).chain(gpu.supports_subgroups().then_some(split)).collect();
    for format in QUANTIZED {
        let QuantizedCase { params, blocks, expected, plan } = quantized_case(format);
        for options in &forms {
            let form = options.describe();
            let model = GpuModel::with_progress(gpu.clone(), &plan, options, &params, &blocks, &()).unwrap();
            let quant_bytes: u64 = model.weight_bytes().iter().filter(|(f, _)| *f == format).map(|(_, b)| b).sum();
            let bytes = blocks.values().map(QuantWeight::bytes).sum::<u64>();
            assert_eq!(quant_bytes, bytes, "{format} bytes on the device ({form})");
            let wgsl: String = model.program().kernels.iter().map(|k| k.wgsl.as_str()).collect();
            assert_eq!(wgsl.contains("form == 5u"), options.subgroups, "{format} ({form}): the split GEMM form");
            let got = model.run(&HashMap::new()).unwrap();
            for ((name, want), (_, got)) in expected.iter().zip(&got) {
                assert_close(&format!("{format} ({form}): `{name}`"), want, got, TOLERANCE);
            }
        }
    }
}

/// The CPU backend computes quantized projections from the blocks: with f32 activations within
/// [`TOLERANCE`] of the interpreter on the dequantized weights, and with activations quantized to
/// 8 bits per block of 32 (llama.cpp's scheme) within [`INT8_TOLERANCE`], at every shape and
/// epilogue, on 1 and 3 threads.
#[test]
fn quantized_projections_on_the_cpu_match_the_interpreter() {
    for format in QUANTIZED {
        let QuantizedCase { params, blocks, expected, plan } = quantized_case(format);
        for (threads, int8) in [(1, false), (3, false), (1, true), (3, true)] {
            let model = kiln_runtime::CpuModel::new(plan.clone(), &params, &blocks, threads, &()).unwrap();
            let got = model.with_int8_activations(int8).run(&HashMap::new()).unwrap();
            let tolerance = if int8 { INT8_TOLERANCE } else { TOLERANCE };
            for ((name, want), (_, got)) in expected.iter().zip(&got) {
                let what = format!("{format} on cpu, {threads} threads, int8 activations {int8}: `{name}`");
                assert_close(&what, want, got, tolerance);
            }
        }
    }
}

/// [`kiln_runtime::Device::load_plan`] (how `kiln bench kernels` and compiled artifacts load a
/// plan) multiplies with int8 activations on the CPU when the storage asks for them, and refuses
/// them on wgpu, as loading a graph does.
#[test]
fn loading_a_plan_takes_int8_activations_on_the_cpu() {
    use kiln_runtime::{Device, Storage, Weights};
    let QuantizedCase { params, blocks, expected, plan } = quantized_case(WeightFormat::Q4_K);
    let load = |device: &Device, int8| {
        let storage = Storage { int8_activations: int8, ..Storage::default() };
        device.load_plan(plan.clone(), Weights::Given { params: &params, blocks: &blocks }, storage, &())
    };
    let cpu = Device::Cpu { threads: 2 };
    let exact = load(&cpu, false).unwrap().run(&HashMap::new()).unwrap();
    let int8 = load(&cpu, true).unwrap().run(&HashMap::new()).unwrap();
    let mut moved = false;
    for (((name, want), (_, exact)), (_, int8)) in expected.iter().zip(&exact).zip(&int8) {
        assert_close(&format!("`{name}`, f32 activations"), want, exact, TOLERANCE);
        assert_close(&format!("`{name}`, int8 activations"), want, int8, INT8_TOLERANCE);
        moved |= exact.max_abs_diff(int8) > 0.0;
    }
    assert!(moved, "int8 activations changed nothing: the plan ran with f32 ones");
    if let Some(gpu) = common::gpu() {
        let err = load(&Device::Gpu(gpu), true).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("--int8-activations"), "{err}");
    }
}

/// Allowed difference of the CPU's int8 dot products, relative to `max(1, max |value|)`: each
/// activation is rounded to 1/254 of its block's largest magnitude (measured: at most 1.2e-2 on
/// these shapes, at k = 64 where the fewest terms average the rounding out).
const INT8_TOLERANCE: f32 = 1.5e-2;

/// A load-time fold of quantized weights keeps the blocks: Q, K and V stacked into one weight
/// (as the optimizer's merged projections have) and a scaled weight, in every block format, on
/// wgpu and on the CPU.
#[test]
fn quantized_folds_stack_and_scale_blocks() {
    let gpu = common::gpu();
    for format in [WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q4_K, WeightFormat::Q6_K] {
        let k = 64usize.next_multiple_of(format.row_multiple());
        let mut g = Graph::new("folds");
        // Rows gathered by input ids, so the projections are dispatched while the stacking and
        // scaling fold.
        let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
        let table = g.param("table", &[16, k]);
        let x = g.add(Op::Gather, &[table, ids]).unwrap();
        let parts: Vec<_> = ["q", "k", "v"].iter().map(|p| g.param(&format!("{p}.weight"), &[16, k])).collect();
        let qk = g.add(Op::Concat { axis: 0 }, &[parts[0], parts[1]]).unwrap();
        let qkv = g.add(Op::Concat { axis: 0 }, &[qk, parts[2]]).unwrap();
        let scaled = g.add(Op::Scale { factor: Scalar(0.25) }, &[parts[0]]).unwrap();
        let y = g.add(Op::linear(None, false, false), &[x, qkv]).unwrap();
        let z = g.add(Op::linear(None, false, false), &[x, scaled]).unwrap();
        g.outputs = vec![("y".into(), y), ("z".into(), z)];
        g.check().unwrap();
        let mut params = interp::random_params(&g, 3).unwrap();
        let input = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, 3], vec![3, 0, 9]))]);
        let mut blocks = HashMap::new();
        for p in ["q.weight", "k.weight", "v.weight"] {
            let q = QuantWeight::quantize(format, &params[p]).unwrap();
            params.insert(p.into(), q.dequantize());
            blocks.insert(p.to_string(), q);
        }
        let expected = interp::run(&g, &params, &input).unwrap();
        let formats = blocks.keys().map(|k| (k.clone(), format)).collect();
        let plan = lower_with(&g, Options { formats, ..Options::default() });
        assert_formats(&plan, format);
        let cpu = kiln_runtime::CpuModel::new(plan.clone(), &params, &blocks, 1, &()).unwrap().run(&input).unwrap();
        for ((name, want), (_, got)) in expected.iter().zip(&cpu) {
            assert_close(&format!("{format} fold on cpu: `{name}`"), want, got, TOLERANCE);
        }
        let Some(gpu) = &gpu else { continue };
        let got = GpuModel::with_blocks(gpu.clone(), plan, &params, &blocks).unwrap().run(&input).unwrap();
        for ((name, want), (_, got)) in expected.iter().zip(&got) {
            assert_close(&format!("{format} fold: `{name}`"), want, got, TOLERANCE);
        }
    }
}

/// A projection whose weight is larger than the device binds runs as projections onto ranges of
/// its output columns, each reading a row slice of the weight in the weight's own format, joined
/// by concatenations (`wgsl::Options::binding_bytes`): plain, with bias and activation, with an
/// RMSNorm prologue, in f32 and two block formats, the last piece shorter (f32: padded). A gated
/// projection, which does not split, still runs (on chunked bindings, its blocks read as f32).
/// Each against the interpreter on the dequantized weights; without the split, the same plan
/// must agree too.
#[test]
fn projections_over_the_binding_limit_run_in_pieces() {
    use kiln_compiler::graph::Activation;
    use kiln_compiler::graph::{Prologue, Scalar};
    let Some(gpu) = common::gpu_with_buffer_limit(8192) else { return };
    for format in [WeightFormat::F32, WeightFormat::Q8_0, WeightFormat::Q4_K] {
        let k = 64usize.next_multiple_of(format.row_multiple());
        // Rows over 3 of the limit's worth, not a multiple of 4.
        let n = (3 * 8192 / format.bytes(1, k) as usize + 5) | 1;
        let mut g = Graph::new("pieces");
        let ids = g.add(Op::Input { name: "input_ids".into(), role: InputRole::Ids, seq: Sym::Seq }, &[]).unwrap();
        let table = g.param("table", &[16, k]);
        let x = g.add(Op::Gather, &[table, ids]).unwrap();
        let gain = g.param("gain", &[k]);
        let rms = Some(Prologue { rms: true, eps: Scalar(1e-6), bias: false });
        let cases = [
            ("plain", Op::linear(None, false, false), false),
            ("bias gelu", Op::linear(Some(Activation::Gelu), true, false), false),
            (
                "rms-norm",
                Op::Linear { act: None, bias: false, residual: false, norm: rms, glu: false, rope: None },
                false,
            ),
            (
                "gated",
                Op::Linear {
                    act: Some(Activation::Silu),
                    bias: false,
                    residual: false,
                    norm: None,
                    glu: true,
                    rope: None,
                },
                true,
            ),
        ];
        let mut weights = Vec::new();
        for (name, op, glu) in &cases {
            // The gated weight over the limit by half (two chunks: a kernel binds every chunk).
            let rows = if *glu { 3 * 8192 / format.bytes(2, k) as usize / 2 * 2 } else { n };
            let w = g.param(&format!("{name}.w"), &[rows, k]);
            weights.push(format!("{name}.w"));
            let mut operands = vec![x];
            if matches!(op, Op::Linear { norm: Some(_), .. }) {
                operands.push(gain);
            }
            operands.push(w);
            if matches!(op, Op::Linear { bias: true, .. }) {
                operands.push(g.param(&format!("{name}.b"), &[n]));
            }
            let y = g.add(op.clone(), &operands).unwrap();
            g.outputs.push((name.to_string(), y));
        }
        // A tied table: gathered from (bound in chunks, as f32) and the weight of a split head.
        let tied = g.param("tied", &[n, k]);
        weights.push("tied".into());
        let xt = g.add(Op::Gather, &[tied, ids]).unwrap();
        let y = g.add(Op::linear(None, false, false), &[xt, tied]).unwrap();
        g.outputs.push(("tied".into(), y));
        // A second projection by the same weight reads the same slices.
        let y = g.add(Op::linear(None, false, false), &[x, tied]).unwrap();
        g.outputs.push(("tied again".into(), y));
        g.check().unwrap();
        let mut params = interp::random_params(&g, 5).unwrap();
        let mut blocks = HashMap::new();
        for w in &weights {
            if let Some(q) = QuantWeight::quantize(format, &params[w]) {
                params.insert(w.clone(), q.dequantize());
                blocks.insert(w.clone(), q);
            }
        }
        let input = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![2, 3], vec![3, 0, 9, 15, 1, 2]))]);
        let expected = interp::run(&g, &params, &input).unwrap();
        let formats = blocks.keys().map(|k| (k.clone(), format)).collect();
        let plan = lower_with(&g, Options { formats, ..Options::default() });
        let split = gpu.options();
        assert_eq!(split.binding_bytes, Some(8192));
        let unsplit = kiln_compiler::back::wgsl::Options { binding_bytes: None, ..split };
        for options in [split, unsplit] {
            let model = GpuModel::with_progress(gpu.clone(), &plan, &options, &params, &blocks, &()).unwrap();
            let program = model.plan();
            let pieces: Vec<_> = program.steps.iter().filter(|s| s.op.linear_weight().is_some()).collect();
            let concats = program.steps.iter().filter(|s| matches!(s.op, Op::Concat { .. })).count();
            if options.binding_bytes.is_some() {
                // Five split projections of 4 pieces each (3 concatenations each), the gated one whole.
                assert_eq!((pieces.len(), concats), (21, 15), "{format}");
                // The tied weight is sliced once for both its projections.
                let tied = kiln_compiler::lower::Storage::Param("tied".into());
                let slices = (program.folds.iter())
                    .filter(|f| matches!(f.op, Op::Slice { .. }) && program.values[f.operands[0]].storage == tied)
                    .count();
                assert_eq!(slices, 4, "{format}");
                if format.is_f32() {
                    // The gather reads the head's transposed pieces (the table is held once).
                    let splits = program.steps.iter().find_map(|s| match &s.op {
                        Op::GatherColumns { splits } => Some(splits.clone()),
                        _ => None,
                    });
                    assert_eq!(splits.map(|s| (s.len(), s.iter().sum::<usize>())), Some((4, n)), "{format}");
                } else {
                    // Blocks are read untransposed: the gather gets an f32 copy.
                    let table = (program.steps.iter().filter(|s| matches!(s.op, Op::Gather)))
                        .map(|s| &program.values[s.operands[0]])
                        .find(|v| v.shape.first() == Some(&kiln_compiler::graph::Dim::Fixed(n)))
                        .expect("the tied table's gather");
                    assert!(table.format.is_f32(), "{format}: the gather reads the tied table as f32");
                }
                // The rms-norm prologue runs once, before its pieces.
                assert_eq!(program.steps.iter().filter(|s| matches!(s.op, Op::RmsNorm { .. })).count(), 1);
                for step in pieces.iter().filter(|s| !matches!(s.op, Op::Linear { glu: true, .. })) {
                    let w = &program.values[step.operands[step.op.linear_weight().unwrap()]];
                    let shape = kiln_compiler::lower::resolve(&w.shape, &HashMap::new());
                    let bytes = w.format.bytes(shape[0], shape[1]);
                    assert!(bytes <= 8192, "{format}: a piece of {bytes} bytes");
                    // f32 weights are read transposed, blocks as they are.
                    assert_eq!(w.format, format, "{format}: a piece's weight format");
                }
            } else {
                assert_eq!((pieces.len(), concats), (6, 0), "{format}");
            }
            let got = model.run(&input).unwrap();
            for ((name, want), (_, got)) in expected.iter().zip(&got) {
                assert_close(&format!("{format} ({}): `{name}`", options.describe()), want, got, TOLERANCE);
            }
        }
    }
}

#[test]
fn missing_or_mismatched_blocks_are_errors() {
    let Some(gpu) = common::gpu() else { return };
    let (g, weights) = graph();
    let params = interp::random_params(&g, 5).unwrap();
    let formats: BTreeMap<String, WeightFormat> = weights.iter().map(|w| (w.clone(), WeightFormat::Q8_0)).collect();
    let plan = lower_with(&g, Options { fold_constants: false, formats, ..Options::default() });
    let err = GpuModel::with_blocks(gpu.clone(), plan.clone(), &params, &HashMap::new()).err().unwrap().to_string();
    assert!(err.contains("Q8_0 blocks, which were not given"), "{err}");
    let blocks: HashMap<String, QuantWeight> =
        weights.iter().map(|w| (w.clone(), QuantWeight::quantize(WeightFormat::Q4_1, &params[w]).unwrap())).collect();
    let err = GpuModel::with_blocks(gpu, plan, &params, &blocks).err().unwrap().to_string();
    assert!(err.contains("given Q4_1 blocks"), "{err}");
}

/// f16 storage: exactly the interpreter on the weights rounded to f16 (the arithmetic is f32).
#[test]
fn f16_projections_match_the_interpreter_on_rounded_weights() {
    let Some(gpu) = common::gpu() else { return };
    let (g, weights) = graph();
    let plan = lower_with(&g, Options { fold_constants: false, ..Options::default() });
    let mut params = interp::random_params(&g, 13).unwrap();
    if !gpu.supports_f16() {
        let err = f16_model(gpu, &plan, &params).err().unwrap().to_string();
        assert!(err.contains("SHADER_F16"), "{err}");
        eprintln!("skipping the f16 comparison: the adapter lacks SHADER_F16");
        return;
    }
    for w in &weights {
        let t = &params[w];
        let rounded = t.as_f32().unwrap().iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        params.insert(w.clone(), Tensor::f32(t.shape.clone(), rounded));
    }
    let expected = interp::run(&g, &params, &HashMap::new()).unwrap();
    let model = f16_model(gpu, &plan, &params).unwrap();
    assert_formats(model.plan(), WeightFormat::F16);
    let got = model.run(&HashMap::new()).unwrap();
    for ((name, want), (_, got)) in expected.iter().zip(&got) {
        assert_close(&format!("f16: `{name}`"), want, got, TOLERANCE);
    }
}

/// `plan` on `gpu` with its f32 projection weights stored as f16 (the wgpu back end's option).
fn f16_model(
    gpu: std::sync::Arc<kiln_runtime::Gpu>,
    plan: &kiln_compiler::lower::Plan,
    params: &HashMap<String, Tensor>,
) -> Result<GpuModel, Box<kiln_runtime::GpuError>> {
    f16_model_with(gpu, plan, params, false)
}

/// [`f16_model`], multiplying in f16 if `math` (`Options::f16_math`).
fn f16_model_with(
    gpu: std::sync::Arc<kiln_runtime::Gpu>,
    plan: &kiln_compiler::lower::Plan,
    params: &HashMap<String, Tensor>,
    math: bool,
) -> Result<GpuModel, Box<kiln_runtime::GpuError>> {
    let options = kiln_compiler::back::wgsl::Options { f16_weights: true, f16_math: math, ..gpu.options() };
    GpuModel::with_progress(gpu, plan, &options, params, &HashMap::new(), &()).map_err(Box::new)
}

/// Max abs and max relative (to the largest reference magnitude) difference.
fn diff(reference: &Tensor, got: &Tensor) -> (f32, f32) {
    let scale = reference.as_f32().unwrap().iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = reference.max_abs_diff(got);
    (err, err / scale)
}

/// Tolerance of f16 weight storage against f32, relative to the largest logit: the projection
/// weights are rounded to 11 significant bits (relative error <= 2^-12 each), the products
/// accumulate in f32. Measured on lavapipe (max abs / relative difference of the logits, optimized
/// graph): gpt2 3.3e-3 / 7.5e-4 and llama 5.8e-3 / 1.1e-3 against their f32 goldens; SmolLM2-135M
/// (first 4 prompt tokens, weights dequantized from Q4_1 then stored as f16) 3.1e-2 / 1.3e-3
/// against f32 storage (its greedy continuation is unchanged).
const F16_TOLERANCE: f32 = 3e-3;

/// f16 storage on the gpt2 and llama golden fixtures: logits within [`F16_TOLERANCE`] of the f32
/// goldens, with f16 arithmetic too (`Options::f16_math`, activations rounded to f16 as well:
/// measured on lavapipe, gpt2 7.4e-3 / 1.7e-3 and llama 1.1e-2 / 2.0e-3 max abs / relative); skipped,
/// with a message, where the
/// adapter lacks SHADER_F16.
#[test]
fn f16_storage_keeps_golden_logits_within_tolerance() {
    let Some(gpu) = common::gpu() else { return };
    if !gpu.supports_f16() {
        eprintln!("skipping: the adapter lacks SHADER_F16");
        return;
    }
    for name in ["gpt2", "llama"] {
        let fe = common::spec(name);
        let dir = common::root().join("tests/fixtures").join(name);
        let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
        let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
        let optimized = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
        let plan = lower_with(&optimized, Options::default());
        for (math, what) in [(false, "f16 weights"), (true, "f16 weights and arithmetic")] {
            let model = f16_model_with(gpu.clone(), &plan, &params, math).unwrap();
            assert!(model.plan().values.iter().any(|v| v.format == WeightFormat::F16), "{name}: no f16 weight");
            let outputs = model.run(&io).unwrap();
            for (out, got) in outputs {
                let (abs, rel) = diff(&io[&out], &got);
                println!("{name}: `{out}` with {what} vs the f32 golden: max abs {abs:e}, relative {rel:e}");
                assert!(rel <= F16_TOLERANCE, "{name}: `{out}` differs by {abs} ({rel} relative) with {what}");
            }
        }
    }
}

/// SmolLM2-135M from its Q4_1 GGUF: the whole model with the blocks on the device (the default
/// of `kiln`) gives the reference first logits as the f32 path does, with about a third of the
/// weight bytes; f16 storage of the dequantized weights stays within [`F16_TOLERANCE`].
#[test]
fn smollm2_quantized_and_f16_logits() {
    let Some(gpu) = common::gpu() else { return };
    let weights = common::fetched("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let fe = common::spec("smollm2-135m");
    let reference =
        kiln_runtime::read_tensors(&common::root().join("tests/fixtures/smollm2-135m/reference.safetensors")).unwrap();
    let n = 4;
    let prompt = reference["prompt_ids"].as_i64().unwrap()[..n].to_vec();
    let io = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, n], prompt))]);
    let graph = kiln_compiler::optimize::optimize(&fe.graph).unwrap().0;
    let (params, blocks) = kiln_runtime::load_params_with_blocks(&fe.spec, &graph, &weights).unwrap();
    assert!(blocks.values().any(|q| q.format == WeightFormat::Q4_1));
    assert!(blocks.values().any(|q| q.format == WeightFormat::Q8_0), "the embedding table is Q8_0");
    let first = |outputs: Vec<(String, Tensor)>| {
        let logits = outputs.into_iter().find(|(n, _)| n == "logits").unwrap().1;
        Tensor::f32(vec![49152], logits.as_f32().unwrap()[..49152].to_vec())
    };
    let formats = blocks.iter().map(|(n, q)| (n.clone(), q.format)).collect();
    let plan = lower_with(&graph, Options { formats, ..Options::default() });
    let model = GpuModel::with_blocks(gpu.clone(), plan, &params, &blocks).unwrap();
    let bytes = |m: &GpuModel| m.weight_bytes().iter().map(|(_, b)| b).sum::<u64>();
    let quant_bytes = bytes(&model);
    let quantized = first(model.run(&io).unwrap());
    drop(model);
    let f32_model = GpuModel::new(gpu.clone(), lower_with(&graph, Options::default()), &params).unwrap();
    let f32_bytes = bytes(&f32_model);
    let full = first(f32_model.run(&io).unwrap());
    drop(f32_model);
    println!("smollm2: weight bytes on the device {quant_bytes} with blocks, {f32_bytes} in f32");
    assert!(quant_bytes * 2 < f32_bytes, "{quant_bytes} vs {f32_bytes}");
    for (what, got) in [("quantized", &quantized), ("f32", &full)] {
        let (abs, rel) = diff(&reference["first_logits"], got);
        println!("smollm2: first logits, {what} weights vs the reference: max abs {abs:e}, relative {rel:e}");
        assert!(abs <= 1e-3, "smollm2 {what}: first logits differ by {abs}");
    }
    if gpu.supports_f16() {
        let half = first(f16_model(gpu, &lower_with(&graph, Options::default()), &params).unwrap().run(&io).unwrap());
        let (abs, rel) = diff(&full, &half);
        println!("smollm2: first logits, f16 weights vs f32: max abs {abs:e}, relative {rel:e}");
        assert!(rel <= F16_TOLERANCE, "smollm2 f16: first logits differ by {abs} ({rel} relative)");
    }
}
