//! A spec written inline, compiled and run from Rust on the reference interpreter.
//!
//! Run with `cargo run --example inline-spec`.

use kiln_compiler::graph::print;
use kiln_compiler::interp;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

const SPEC: &str = r#"
[model]
name = "tiny-llama"
kind = "decoder"
vocab = 256
d_model = 64
layers = 2

[attention]
heads = 4
kv_heads = 2

[positions]
kind = "rope"

[norm]
kind = "rmsnorm"

[ffn]
activation = "silu"
gated = true
d_ff = 172
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Parse, validate and build the graph; a bad spec comes back as a rendered, located error.
    let fe = kiln_compiler::front_end("inline.toml", SPEC).map_err(|e| e.render())?;
    let summary = print::summary(&fe.graph, 16);
    println!("{}: {} parameters, {} graph nodes", fe.graph.name, summary.parameters, summary.nodes);

    // Random weights under the canonical parameter names (a real model loads a checkpoint with
    // kiln_runtime::load_params instead).
    let params = interp::random_params(&fe.graph, 42)?;

    // Greedy decoding by re-running the sequence (the interpreter has no KV cache).
    let mut ids: Vec<i64> = vec![1, 17, 42];
    for _ in 0..5 {
        let inputs = HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, ids.len()], ids.clone()))]);
        let outputs = interp::run(&fe.graph, &params, &inputs)?;
        let logits = outputs[0].1.as_f32().ok_or("logits are f32")?;
        let last = &logits[(ids.len() - 1) * 256..];
        let next = last.iter().enumerate().fold(0, |best, (i, &v)| if v > last[best] { i } else { best });
        ids.push(next as i64);
    }
    println!("greedy continuation: {ids:?}");
    Ok(())
}
