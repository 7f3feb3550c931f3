//! Declared initialization (`[init]`, `kiln_runtime::train::init`): the distributions drawn, the
//! checkpoint layout written, and the reading of `on_tensors` giving back the drawn parameters.

use crate::common::{root, spec};
use kiln_compiler::graph::{Graph, Op};
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, front_end};
use kiln_runtime::train::init::{Role, initialize, parameter};
use kiln_runtime::weights::graph_params;
use std::collections::{BTreeMap, HashMap};

fn load(text: &str) -> FrontEnd {
    front_end("spec.toml", text).unwrap_or_else(|e| panic!("{}", e.render()))
}

fn init(fe: &FrontEnd) -> BTreeMap<String, Tensor> {
    initialize(&fe.spec, &fe.graph).expect("initializes").into_iter().collect()
}

fn values<'a>(w: &'a BTreeMap<String, Tensor>, name: &str) -> &'a [f32] {
    w.get(name)
        .unwrap_or_else(|| panic!("no tensor `{name}` among {:?}", w.keys().collect::<Vec<_>>()))
        .as_f32()
        .unwrap()
}

/// Mean and standard deviation.
fn moments(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// `v` is drawn from normal(0, std): its deviation within 3 % and its mean within 4 standard errors.
fn assert_normal(w: &BTreeMap<String, Tensor>, name: &str, std: f64) {
    let v = values(w, name);
    let (mean, s) = moments(v);
    assert!((s / std - 1.0).abs() < 0.03, "{name}: std {s}, expected {std}");
    assert!(mean.abs() < 4.0 * std / (v.len() as f64).sqrt(), "{name}: mean {mean}");
}

fn assert_constant(w: &BTreeMap<String, Tensor>, name: &str, c: f32) {
    assert!(values(w, name).iter().all(|&x| x == c), "{name}: not all {c}");
}

/// The tensor names and shapes of a safetensors fixture.
fn fixture_layout(dir: &str) -> BTreeMap<String, Vec<usize>> {
    let path = root().join("tests/fixtures").join(dir).join("model.safetensors");
    kiln_runtime::read_tensors(&path).expect("fixture reads").into_iter().map(|(n, t)| (n, t.shape)).collect()
}

fn layout(w: &BTreeMap<String, Tensor>) -> BTreeMap<String, Vec<usize>> {
    w.iter().map(|(n, t)| (n.clone(), t.shape.clone())).collect()
}

#[test]
fn gpt2_tensors_are_the_checkpoints_packed_and_transposed() {
    let w = init(&spec("gpt2"));
    assert_eq!(layout(&w), fixture_layout("gpt2"));
    assert_eq!(w["transformer.h.0.attn.c_attn.weight"].shape, vec![64, 192]);
}

#[test]
fn llama_tensors_are_the_checkpoints() {
    let w = init(&spec("llama"));
    assert_eq!(layout(&w), fixture_layout("llama"));
}

/// A graph whose outputs are `graph`'s parameters, each read as `on_tensors` reads it: the
/// reading applied to the initialized tensors must give back the parameters drawn in graph layout.
fn check_round_trip(fe: &FrontEnd) {
    let mut params = Graph::new("params");
    for (name, shape) in graph_params(&fe.graph) {
        let n = params.param(&name, &shape);
        params.outputs.push((name, n));
    }
    let (reading, uses) = kiln_compiler::train::on_tensors(&params, &fe.spec.weights, &PackDims::of(&fe.spec))
        .expect("reads the parameters");
    let tensors: HashMap<String, Tensor> = initialize(&fe.spec, &fe.graph).unwrap().into_iter().collect();
    let read = kiln_compiler::interp::run(&reading, &tensors, &HashMap::new()).expect("the reading runs");
    let rules = fe.spec.init();
    let mut first: HashMap<&str, &str> = HashMap::new();
    for u in &uses {
        first.entry(u.tensor.as_str()).or_insert(u.param.as_str());
    }
    let mut checked = 0;
    for (name, t) in &read {
        let u = uses.iter().find(|u| &u.param == name).unwrap();
        // A tensor shared unpacked by several parameters holds the first one's values.
        let owner = if u.packed { name.as_str() } else { first[u.tensor.as_str()] };
        let expected = parameter(&rules, owner, &t.shape);
        // Not `assert_eq!`: a mismatch would print every element.
        assert!(t.as_f32().unwrap() == expected.as_slice(), "{name} read from {} is not what was drawn", u.tensor);
        checked += 1;
    }
    assert_eq!(checked, graph_params(&fe.graph).len());
}

#[test]
fn the_reading_of_the_tensors_gives_back_the_drawn_parameters() {
    // Packed and transposed (GPT-2), plain (LLaMA), packed per head (BLOOM), shared tables (T5).
    for name in ["gpt2", "llama", "bloom", "t5", "bert", "mixtral", "vaswani"] {
        check_round_trip(&spec(name));
    }
    // llama.cpp's interleaved RoPE rows, and a transposed gate/up pack.
    let llama = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    check_round_trip(&load(&llama.replace("preset = \"llama\"", "preset = \"gguf-llama\"")));
    let packed = format!(
        "{llama}\n[weights.tensors]\n\"layers.{{i}}.ffn.gate.weight\" = {{ tensor = \"l.{{i}}.gate_up\", pack = \"gate-up-blocks\", part = \"gate\", transpose = true }}\n\"layers.{{i}}.ffn.up.weight\" = {{ tensor = \"l.{{i}}.gate_up\", pack = \"gate-up-blocks\", part = \"up\", transpose = true }}\n"
    );
    let fe = load(&packed);
    assert_eq!(init(&fe)["l.0.gate_up"].shape, vec![64, 352]);
    check_round_trip(&fe);
}

const GPT2_WIDE: &str = r#"
[model]
kind = "decoder"
vocab = 128
d_model = 256
layers = 12
max_positions = 64
[attention]
heads = 4
bias = true
[ffn]
bias = true
[weights]
preset = "gpt2"
"#;

#[test]
fn gpt2_draws_normal_matrices_scaled_residual_projections_unit_gains_and_zero_biases() {
    let w = init(&load(GPT2_WIDE));
    let (std, scaled) = (0.02, 0.02 / 24f64.sqrt());
    assert_normal(&w, "transformer.h.3.mlp.c_fc.weight", std);
    assert_normal(&w, "transformer.h.3.attn.c_attn.weight", std);
    assert_normal(&w, "transformer.wte.weight", std);
    assert_normal(&w, "transformer.wpe.weight", std);
    assert_normal(&w, "transformer.h.3.mlp.c_proj.weight", scaled);
    assert_normal(&w, "transformer.h.3.attn.c_proj.weight", scaled);
    assert_constant(&w, "transformer.h.3.ln_1.weight", 1.0);
    assert_constant(&w, "transformer.ln_f.weight", 1.0);
    for b in ["attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias", "ln_2.bias"] {
        assert_constant(&w, &format!("transformer.h.3.{b}"), 0.0);
    }
    // Written rules replace the family's.
    let custom = GPT2_WIDE.to_string() + "[init]\nstd = 0.05\nresidual_scale = \"none\"\n";
    let w = init(&load(&custom));
    assert_normal(&w, "transformer.h.3.mlp.c_proj.weight", 0.05);
    assert_normal(&w, "transformer.h.3.mlp.c_fc.weight", 0.05);
    let halved = GPT2_WIDE.replace("preset = \"gpt2\"", "") + "[init]\nresidual_scale = 0.5\n";
    let w = init(&load(&halved));
    assert_normal(&w, "layers.3.attn.o.weight", 0.01);
    assert_normal(&w, "layers.3.ffn.down.weight", 0.01);
    assert_normal(&w, "layers.3.attn.q.weight", 0.02);
    // Without the preset, no family scale.
    let plain = GPT2_WIDE.replace("preset = \"gpt2\"", "");
    assert_normal(&init(&load(&plain)), "layers.3.ffn.down.weight", 0.02);
}

#[test]
fn offset_norm_gains_are_drawn_as_zero() {
    let gemma = init(&spec("gemma3"));
    let norms: Vec<&String> = gemma.keys().filter(|n| n.contains("norm")).collect();
    assert!(norms.len() > 4, "{norms:?}");
    for n in norms {
        assert_constant(&gemma, n, 0.0);
    }
}

#[test]
fn deepnorm_scales_ffn_value_and_output_by_beta() {
    let text = r#"
[model]
kind = "decoder"
vocab = 64
d_model = 256
layers = 6
[norm]
placement = "deepnorm"
[attention]
heads = 4
"#;
    let w = init(&load(text));
    let beta = 48f64.powf(-0.25);
    let square = (2.0 / 512f64).sqrt();
    let ffn = (2.0 / (256.0 + 1024.0f64)).sqrt();
    assert_normal(&w, "layers.2.attn.q.weight", square);
    assert_normal(&w, "layers.2.attn.k.weight", square);
    assert_normal(&w, "layers.2.attn.v.weight", beta * square);
    assert_normal(&w, "layers.2.attn.o.weight", beta * square);
    assert_normal(&w, "layers.2.ffn.up.weight", beta * ffn);
    assert_normal(&w, "layers.2.ffn.down.weight", beta * ffn);
    assert_normal(&w, "embed.tokens", 0.02);
    assert_constant(&w, "layers.2.attn_norm.weight", 1.0);
    let w = init(&load(&format!("{text}[init]\nbeta = 0.5\n")));
    assert_normal(&w, "layers.2.attn.v.weight", 0.5 * square);
}

#[test]
fn draws_are_deterministic_for_a_seed_and_change_with_it() {
    let fe = spec("gpt2");
    assert_eq!(init(&fe), init(&fe));
    let mut other = spec("gpt2");
    other.spec.spec.init.seed = 1;
    let (a, b) = (init(&fe), init(&other));
    assert_ne!(a["transformer.wte.weight"], b["transformer.wte.weight"]);
    assert_ne!(a["transformer.h.1.attn.c_attn.weight"], b["transformer.h.1.attn.c_attn.weight"]);
    assert_eq!(a["transformer.h.1.ln_1.weight"], b["transformer.h.1.ln_1.weight"]);
    // Each parameter has its own stream: no two matrices are the same draws.
    assert_ne!(
        a["transformer.h.0.mlp.c_proj.weight"].as_f32().unwrap()[..16],
        a["transformer.h.1.mlp.c_proj.weight"].as_f32().unwrap()[..16]
    );
}

/// Whether parameter `name` of `graph` is a norm's gain (the `LayerNorm`/`RmsNorm` operand, or
/// the offset of it).
fn feeds_norm(graph: &Graph, name: &str) -> bool {
    let Some((n, _)) = graph.params().into_iter().find(|(_, p)| *p == name) else { return false };
    graph.order().into_iter().any(|m| {
        let gain = |o: &kiln_compiler::graph::NodeIndex| {
            *o == n || (matches!(graph.g[*o].op, Op::Offset { .. }) && graph.operands(*o).first() == Some(&n))
        };
        matches!(graph.g[m].op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) && graph.operands(m).get(1).is_some_and(gain)
    })
}

#[test]
fn roles_read_from_names_are_the_graphs() {
    for entry in std::fs::read_dir(root().join("models")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let fe = spec(&name);
        for (param, shape) in graph_params(&fe.graph) {
            let role = Role::of(&param, &shape);
            assert_eq!(role == Role::NormGain, feeds_norm(&fe.graph, &param), "{name}: {param} is {role:?}");
            assert_eq!(role == Role::Bias, param.ends_with(".bias"), "{name}: {param}");
        }
    }
}
