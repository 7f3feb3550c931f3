//! Every knob of the spec language builds, type-checks and runs on the reference interpreter, and
//! the knobs the golden fixtures do not cover are pinned by equivalences and by what a mask must
//! hide.

use kiln_compiler::interp::{random_params, run};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, front_end};
use std::collections::HashMap;

const BASE: &str = r#"
[model]
kind = "decoder"
vocab = 50
d_model = 32
layers = 2
max_positions = 16
"#;

fn spec(extra: &str) -> FrontEnd {
    let source = format!("{BASE}{extra}");
    front_end("test.toml", &source).unwrap_or_else(|e| panic!("{}\n{source}", e.render()))
}

fn ids(batch: usize, seq: usize, salt: i64) -> Tensor {
    Tensor::i64(vec![batch, seq], (0..(batch * seq) as i64).map(|i| (i * 7 + salt) % 50).collect())
}

fn outputs(fe: &FrontEnd, params: &HashMap<String, Tensor>, inputs: Vec<(&str, Tensor)>) -> HashMap<String, Tensor> {
    let inputs = inputs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    run(&fe.graph, params, &inputs).unwrap_or_else(|e| panic!("{e}")).into_iter().collect()
}

fn f(t: &Tensor) -> &[f32] {
    t.as_f32().unwrap()
}

#[test]
fn every_knob_builds_and_runs() {
    let cases = [
        "[attention]\nheads = 4\nmask = \"sliding-window\"\nwindow = 3\n",
        "[attention]\nheads = 4\n[norm]\nparallel_residual = true\n",
        "[attention]\nheads = 4\n[norm]\nplacement = \"deepnorm\"\n",
        "[attention]\nheads = 4\n[norm]\nplacement = \"deepnorm\"\nalpha = 2.0\nfinal = true\n",
        "[attention]\nheads = 4\n[positions]\nkind = \"rope\"\nfraction = 0.5\n",
        "[attention]\nheads = 4\n[positions]\nkind = \"rope\"\nstyle = \"interleaved\"\ntheta = 500000.0\n",
        "[attention]\nheads = 4\n[norm]\nkind = \"layernorm-no-bias\"\n",
        "[attention]\nheads = 4\n[ffn]\nactivation = \"gelu\"\ngated = true\nd_ff = 48\n",
        "[attention]\nheads = 4\nkv_heads = 1\n[positions]\nkind = \"rope\"\n",
        "[attention]\nheads = 4\n[embedding]\ntoken_types = 3\nnorm = true\n",
        "[attention]\nheads = 4\n[positions]\nkind = \"sinusoidal\"\nstyle = \"rotate-half\"\n",
        "[attention]\nheads = 4\n[embedding]\nscale = 5.657\n[head]\ntied = false\nbias = true\n",
        "[attention]\nheads = 4\nq_bias = true\nv_bias = true\n[ffn]\nactivation = \"relu\"\nbias = true\n",
        "[attention]\nheads = 4\nhead_dim = 16\nscale = 0.1\n",
        "[attention]\nheads = 4\nkv_heads = 2\n[moe]\nexperts = 3\ntop_k = 1\nrenormalize = false\n[ffn]\ngated = true\nactivation = \"silu\"\n",
        "[attention]\nheads = 4\n[positions]\nkind = \"alibi\"\n[outputs]\nhidden_states = true\n",
        "[attention]\nheads = 6\nhead_dim = 8\n[positions]\nkind = \"alibi\"\n",
    ];
    for (i, extra) in cases.iter().enumerate() {
        let fe = spec(extra);
        let params = random_params(&fe.graph, i as u64).unwrap();
        let out = outputs(
            &fe,
            &params,
            vec![
                ("input_ids", ids(2, 7, i as i64)),
                ("token_type_ids", Tensor::i64(vec![2, 7], (0..14).map(|i| i % 3).collect())),
            ],
        );
        let logits = &out["logits"];
        assert_eq!(logits.shape, vec![2, 7, 50], "case {i}");
        assert!(f(logits).iter().all(|v| v.is_finite()), "case {i}: non-finite logits\n{extra}");
    }
}

#[test]
fn encoder_decoder_with_rope_and_gqa_runs() {
    let source = r#"
[model]
kind = "encoder-decoder"
vocab = 50
d_model = 32
layers = 1
decoder_layers = 2
[positions]
kind = "rope"
[attention]
heads = 4
kv_heads = 2
padding_mask = true
[ffn]
activation = "gelu-tanh"
gated = true
"#;
    let fe = front_end("t.toml", source).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = random_params(&fe.graph, 3).unwrap();
    let src_padding = Tensor::i64(vec![2, 6], vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
    let out =
        outputs(&fe, &params, vec![("src_ids", ids(2, 6, 2)), ("tgt_ids", ids(2, 4, 5)), ("src_padding", src_padding)]);
    assert_eq!(out["logits"].shape, vec![2, 4, 50]);
    assert!(f(&out["logits"]).iter().all(|v| v.is_finite()));
}

#[test]
fn causal_mask_hides_the_future() {
    let fe = spec("[attention]\nheads = 4\n");
    let params = random_params(&fe.graph, 1).unwrap();
    let a = ids(1, 6, 0);
    let mut b = a.clone();
    if let kiln_compiler::tensor::Data::I64(v) = &mut b.data {
        v[5] = (v[5] + 1) % 50;
    }
    let (oa, ob) = (outputs(&fe, &params, vec![("input_ids", a)]), outputs(&fe, &params, vec![("input_ids", b)]));
    let (la, lb) = (f(&oa["logits"]), f(&ob["logits"]));
    assert_eq!(la[..5 * 50], lb[..5 * 50], "earlier positions must not see the last token");
    assert_ne!(la[5 * 50..], lb[5 * 50..]);
}

#[test]
fn window_of_one_sees_only_itself() {
    let fe = spec("[attention]\nheads = 4\nmask = \"sliding-window\"\nwindow = 1\n");
    let params = random_params(&fe.graph, 2).unwrap();
    let a = ids(1, 6, 0);
    let mut b = a.clone();
    if let kiln_compiler::tensor::Data::I64(v) = &mut b.data {
        v[0] = (v[0] + 1) % 50;
    }
    let (oa, ob) = (outputs(&fe, &params, vec![("input_ids", a)]), outputs(&fe, &params, vec![("input_ids", b)]));
    assert_eq!(f(&oa["logits"])[50..], f(&ob["logits"])[50..], "later positions must not see token 0");
}

#[test]
fn window_covering_the_sequence_equals_causal() {
    let causal = spec("[attention]\nheads = 4\n");
    let window = spec("[attention]\nheads = 4\nmask = \"sliding-window\"\nwindow = 8\n");
    let params = random_params(&causal.graph, 4).unwrap();
    let oa = outputs(&causal, &params, vec![("input_ids", ids(2, 8, 3))]);
    let ob = outputs(&window, &params, vec![("input_ids", ids(2, 8, 3))]);
    assert_eq!(oa["logits"], ob["logits"]);
}

#[test]
fn deepnorm_with_alpha_one_is_post_norm() {
    let post = spec("[attention]\nheads = 4\n[norm]\nplacement = \"post\"\n");
    let deep = spec("[attention]\nheads = 4\n[norm]\nplacement = \"deepnorm\"\nalpha = 1.0\n");
    let params = random_params(&post.graph, 5).unwrap();
    let oa = outputs(&post, &params, vec![("input_ids", ids(2, 5, 1))]);
    let ob = outputs(&deep, &params, vec![("input_ids", ids(2, 5, 1))]);
    assert_eq!(oa["logits"], ob["logits"]);
}

/// Multi-query attention is multi-head attention whose heads all share one K and one V.
#[test]
fn mqa_equals_mha_with_shared_key_value_heads() {
    let mqa = spec("[attention]\nheads = 4\nkv_heads = 1\n[positions]\nkind = \"rope\"\n");
    let mha = spec("[attention]\nheads = 4\n[positions]\nkind = \"rope\"\n");
    let params = random_params(&mqa.graph, 6).unwrap();
    let mut wide = params.clone();
    for (name, t) in &params {
        if name.ends_with("attn.k.weight") || name.ends_with("attn.v.weight") {
            let rows: Vec<f32> = (0..4).flat_map(|_| f(t).iter().copied()).collect();
            wide.insert(name.clone(), Tensor::f32(vec![32, 32], rows));
        }
    }
    let oa = outputs(&mqa, &params, vec![("input_ids", ids(2, 6, 2))]);
    let ob = outputs(&mha, &wide, vec![("input_ids", ids(2, 6, 2))]);
    assert!(oa["logits"].max_abs_diff(&ob["logits"]) < 1e-5);
}

/// Interleaved RoPE on rows permuted into pair order computes the same scores as rotate-half
/// RoPE: the permutation llama.cpp applies to Q/K weights.
#[test]
fn interleaved_rope_equals_rotate_half_on_permuted_rows() {
    let half = spec("[attention]\nheads = 4\n[positions]\nkind = \"rope\"\n");
    let pairs = spec("[attention]\nheads = 4\n[positions]\nkind = \"rope\"\nstyle = \"interleaved\"\n");
    let params = random_params(&half.graph, 7).unwrap();
    let hd = 8;
    let mut permuted = params.clone();
    for (name, t) in &params {
        if name.ends_with("attn.q.weight") || name.ends_with("attn.k.weight") {
            let x = f(t);
            let width = t.shape[1];
            let mut out = vec![0.0; x.len()];
            for h in 0..t.shape[0] / hd {
                for i in 0..hd / 2 {
                    for j in 0..2 {
                        let (dst, src) = (h * hd + 2 * i + j, h * hd + j * hd / 2 + i);
                        out[dst * width..(dst + 1) * width].copy_from_slice(&x[src * width..(src + 1) * width]);
                    }
                }
            }
            permuted.insert(name.clone(), Tensor::f32(t.shape.clone(), out));
        }
    }
    let oa = outputs(&half, &params, vec![("input_ids", ids(2, 6, 4))]);
    let ob = outputs(&pairs, &permuted, vec![("input_ids", ids(2, 6, 4))]);
    assert!(oa["logits"].max_abs_diff(&ob["logits"]) < 1e-4);
}

#[test]
fn padding_mask_hides_padded_keys_and_fully_masked_rows_stay_finite() {
    let source = format!(
        "{}[attention]\nheads = 4\npadding_mask = true\n[outputs]\nhidden_states = true\npooling = \"mean\"\n",
        BASE.replace("\"decoder\"", "\"encoder\"")
    );
    let fe = front_end("t.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let params = random_params(&fe.graph, 8).unwrap();
    let mask = Tensor::i64(vec![1, 5], vec![1, 1, 1, 0, 0]);
    let a = ids(1, 5, 0);
    let mut b = a.clone();
    if let kiln_compiler::tensor::Data::I64(v) = &mut b.data {
        v[4] = (v[4] + 3) % 50;
    }
    let oa = outputs(&fe, &params, vec![("input_ids", a.clone()), ("attention_mask", mask.clone())]);
    let ob = outputs(&fe, &params, vec![("input_ids", b), ("attention_mask", mask)]);
    let d = 32;
    assert_eq!(f(&oa["last_hidden_state"])[..3 * d], f(&ob["last_hidden_state"])[..3 * d]);
    assert_eq!(oa["sentence_embedding"], ob["sentence_embedding"], "pooling ignores padded tokens");

    let none = Tensor::i64(vec![1, 5], vec![0; 5]);
    let oc = outputs(&fe, &params, vec![("input_ids", a), ("attention_mask", none)]);
    assert!(f(&oc["last_hidden_state"]).iter().all(|v| v.is_finite()), "fully masked rows are defined");
    assert!(f(&oc["sentence_embedding"]).iter().all(|v| v.is_finite()));
}

#[test]
fn large_logits_do_not_overflow_softmax() {
    let fe = spec("[attention]\nheads = 4\nscale = 1000.0\n");
    let params = random_params(&fe.graph, 9).unwrap();
    let out = outputs(&fe, &params, vec![("input_ids", ids(1, 6, 0))]);
    assert!(f(&out["logits"]).iter().all(|v| v.is_finite()));
}

#[test]
fn bad_run_inputs_are_errors_not_panics() {
    let fe = spec("[attention]\nheads = 4\n");
    let params = random_params(&fe.graph, 10).unwrap();
    let run_with = |t: Tensor| {
        let inputs = HashMap::from([("input_ids".to_string(), t)]);
        run(&fe.graph, &params, &inputs).map(|_| ()).unwrap_err().to_string()
    };
    let e = run_with(Tensor::i64(vec![1, 3], vec![1, 50, 2]));
    assert!(e.contains("token id 50 is out of range for `embed.tokens` (50 rows)"), "{e}");
    let e = run_with(Tensor::i64(vec![1, 17], vec![1; 17]));
    assert!(e.contains("position 16 is out of range for `embed.positions` (16 rows)"), "{e}");
    let e = run_with(Tensor::i64(vec![3], vec![1, 2, 3]));
    assert!(e.contains("input `input_ids`: expected [batch, seq]"), "{e}");
    let e = run_with(Tensor::f32(vec![1, 2], vec![1.0, 2.0]));
    assert!(e.contains("expected integer ids"), "{e}");
    let missing = run(&fe.graph, &params, &HashMap::new()).unwrap_err().to_string();
    assert_eq!(missing, "missing input `input_ids`");
}

/// A sliding-window decoder of four layers at RoPE bases 1e4 (window) and 1e6 (global), with
/// `pattern` (`global_every = ...` or `layer_types = [...]`) saying which layers are global.
fn layered(pattern: &str) -> FrontEnd {
    let source = BASE.replace("layers = 2", "layers = 4")
        + "[positions]\nkind = \"rope\"\nglobal_theta = 1000000.0\n"
        + "[attention]\nheads = 4\nmask = \"sliding-window\"\nwindow = 3\n"
        + pattern;
    front_end("t.toml", &source).unwrap_or_else(|e| panic!("{}\n{source}", e.render()))
}

/// Per attention scope, the window of its mask and the RoPE base of its rotations.
fn attention_layers(graph: &kiln_compiler::graph::Graph) -> Vec<(String, Option<usize>, Vec<u32>)> {
    use kiln_compiler::graph::Op;
    let mut layers: std::collections::BTreeMap<String, (Option<usize>, Vec<u32>)> = Default::default();
    for n in graph.g.node_indices() {
        let node = &graph.g[n];
        match &node.op {
            Op::Mask { window, .. } => layers.entry(node.scope.clone()).or_default().0 = *window,
            Op::Rope { theta, .. } => layers.entry(node.scope.clone()).or_default().1.push(theta.0.to_bits()),
            _ => {}
        }
    }
    layers.into_iter().map(|(scope, (window, thetas))| (scope, window, thetas)).collect()
}

/// `attention.layer_types`: the window and the window's RoPE base exactly at the layers listed
/// `sliding-window`, every earlier key and the global base at those listed `global` (or under the
/// names Hugging Face configs give them), in the graph as built and in the cached decoder's.
#[test]
fn layer_types_put_the_window_at_the_listed_layers() {
    let fe = layered("layer_types = [\"global\", \"sliding-window\", \"sliding_attention\", \"full_attention\"]\n");
    let (local, global) = (10000.0f32.to_bits(), 1000000.0f32.to_bits());
    let layers = attention_layers(&fe.graph);
    let expected: Vec<(String, Option<usize>, Vec<u32>)> =
        [(None, global), (Some(3), local), (Some(3), local), (None, global)]
            .into_iter()
            .enumerate()
            .map(|(i, (window, theta))| (format!("layers.{i}.attn"), window, vec![theta, theta]))
            .collect();
    assert_eq!(layers, expected);
    let cached = kiln_compiler::graph::build::build_cached(&fe.spec).unwrap();
    let windows: Vec<(String, Option<usize>)> = cached
        .inputs()
        .into_iter()
        .filter_map(|(_, name, role)| match role {
            kiln_compiler::graph::InputRole::Cache { window, .. } if name.ends_with("past_k") => {
                Some((name.to_string(), window))
            }
            _ => None,
        })
        .collect();
    let expected: Vec<(String, Option<usize>)> = [None, Some(3), Some(3), None]
        .into_iter()
        .enumerate()
        .map(|(i, w)| (format!("layers.{i}.attn.past_k"), w))
        .collect();
    assert_eq!(windows, expected);
}

/// A list that spells out a period is the periodic spec: the same graph and the same outputs;
/// another list is another model.
#[test]
fn a_periodic_layer_list_equals_global_every() {
    let periodic = layered("global_every = 2\n");
    let listed = layered("layer_types = [\"sliding-window\", \"global\", \"sliding-window\", \"global\"]\n");
    let other = layered("layer_types = [\"global\", \"sliding-window\", \"global\", \"sliding-window\"]\n");
    let print = kiln_compiler::graph::print::text;
    assert_eq!(print(&periodic.graph), print(&listed.graph));
    assert_eq!(periodic.spec.layer_kinds, listed.spec.layer_kinds);
    let params = random_params(&periodic.graph, 12).unwrap();
    let run_on = |fe: &FrontEnd| outputs(fe, &params, vec![("input_ids", ids(2, 9, 5))]).remove("logits").unwrap();
    assert_eq!(run_on(&periodic), run_on(&listed));
    assert_ne!(run_on(&periodic), run_on(&other));
}

/// A generation step's outputs are its last position's: the cached graph runs the final norm and
/// the head on one row per sequence (`logits` `[batch, 1, vocab]`), equal to the last row of the
/// whole forward; the hidden state is the last position's too, and pooling is left out.
#[test]
fn a_cached_step_computes_its_last_position_only() {
    use kiln_compiler::graph::{Dim, InputRole, Sym};
    let fe = spec("[attention]\nheads = 4\n[outputs]\nhidden_states = true\npooling = \"mean\"\n");
    let cached = kiln_compiler::graph::build::build_cached(&fe.spec).unwrap();
    let shape = |name: &str| {
        let (_, n) = cached.outputs.iter().find(|(o, _)| o == name).unwrap_or_else(|| panic!("no {name}"));
        cached.g[*n].shape.clone()
    };
    assert_eq!(shape("logits"), vec![Dim::Sym(Sym::Batch), Dim::Fixed(1), Dim::Fixed(50)]);
    assert_eq!(shape("last_hidden_state"), vec![Dim::Sym(Sym::Batch), Dim::Fixed(1), Dim::Fixed(32)]);
    assert!(cached.outputs.iter().all(|(o, _)| o != "sentence_embedding"), "a step pools nothing");

    let params = random_params(&fe.graph, 3).unwrap();
    let (batch, seq) = (2, 5);
    let mut inputs = HashMap::from([("input_ids".to_string(), ids(batch, seq, 1))]);
    for (n, name, role) in cached.inputs() {
        if let InputRole::Cache { .. } = role {
            let [_, Dim::Fixed(kv), _, Dim::Fixed(d)] = cached.g[n].shape[..] else {
                panic!("{name}: a cache's shape")
            };
            inputs.insert(name.to_string(), Tensor::f32(vec![batch, kv, 0, d], vec![]));
        }
    }
    let step: HashMap<String, Tensor> = run(&cached, &params, &inputs).unwrap().into_iter().collect();
    let mask = Tensor::f32(vec![batch, seq], vec![1.0; batch * seq]);
    let full = outputs(&fe, &params, vec![("input_ids", ids(batch, seq, 1)), ("attention_mask", mask)]);
    for (name, width) in [("logits", 50), ("last_hidden_state", 32)] {
        assert_eq!(step[name].shape, vec![batch, 1, width], "{name}");
        let last: Vec<f32> =
            f(&full[name]).chunks(seq * width).flat_map(|sequence| sequence[(seq - 1) * width..].to_vec()).collect();
        let err = last.iter().zip(f(&step[name])).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-5, "{name}: the step's row differs from the forward's last by {err}");
    }
}
