//! Pre-norm, post-norm and DeepNorm, two ways. First, one checkpoint under two architectures: the
//! GPT-2 fixture's weights run under the pre-norm spec they were trained with (`models/gpt2.toml`)
//! and under a post-norm spec that differs in one key (`norm.placement`); both load the same
//! tensors by the same names, only the graph changes. Then the question the knob is about, answered
//! by training: the experiment's three placements (`experiment/*-warmup.toml`, 12 layers) trained
//! for a few steps on the same text, seed and batches through the library (`Trainer`), their
//! losses side by side. The full experiment — 300 steps on the shipped Shakespeare corpus, with
//! and without warm-up — is one `kiln train` command in the README.
//!
//! Run with `cargo run --example pre-vs-post-norm`.

use kiln_compiler::graph::{Graph, Op, print};
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::RecipeFile;
use kiln_compiler::{interp, lower, optimize};
use kiln_runtime::Device;
use kiln_runtime::train::Trainer;
use kiln_runtime::train::data::{ByteTokenizer, Corpus, CorpusOptions, Objective, Split};
use kiln_runtime::train::init;
use kiln_runtime::{Gpu, GpuModel};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

const SPECS: [(&str, &str); 2] =
    [("pre-norm", "models/gpt2.toml"), ("post-norm", "examples/pre-vs-post-norm/post-norm.toml")];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let weights = root.join("tests/fixtures/gpt2/model.safetensors");
    // Token ids and the logits HF transformers computed for them (the golden reference).
    let io = kiln_runtime::read_tensors(&root.join("tests/fixtures/gpt2/io.safetensors"))?;
    let ids = io.get("input_ids").ok_or("the fixture has no input_ids")?;
    let golden = io.get("logits").and_then(Tensor::as_f32).ok_or("the fixture has no f32 logits")?;
    let inputs = HashMap::from([("input_ids".to_string(), ids.clone())]);
    let gpu = match Gpu::new(None) {
        Ok(gpu) => Some(Arc::new(gpu)),
        Err(e) => {
            println!("no GPU adapter ({e}); running on the reference interpreter");
            None
        }
    };

    let mut logits = Vec::new();
    for (label, file) in SPECS {
        let fe = kiln_compiler::front_end(file, &std::fs::read_to_string(root.join(file))?).map_err(|e| e.render())?;
        println!("{label} ({file}): block 0 as built");
        for line in norm_and_residual_lines(&fe.graph) {
            println!("    {line}");
        }
        let graph = optimize::optimize(&fe.graph)?.0;
        let params = kiln_runtime::load_params(&fe.spec, &graph, &weights)?;
        let outputs = match &gpu {
            Some(gpu) => GpuModel::new(gpu.clone(), lower::lower(&graph), &params)?.run(&inputs)?,
            None => interp::run(&graph, &params, &inputs)?,
        };
        let (_, out) = outputs.into_iter().find(|(name, _)| name == "logits").ok_or("no logits output")?;
        let out = out.as_f32().ok_or("f32 logits")?.to_vec();
        println!("    max |logits - HF transformers| = {:.2e}\n", max_abs_diff(&out, golden));
        logits.push(out);
    }

    // The pre-norm spec is the architecture the weights were trained under: it reproduces the
    // reference. The post-norm spec is a different function of the same weights.
    let pre_error = max_abs_diff(&logits[0], golden);
    let moved = max_abs_diff(&logits[0], &logits[1]);
    println!("pre-norm reproduces the reference ({pre_error:.1e}); post-norm moves the logits by up to {moved:.2}");
    if pre_error > 1e-4 {
        return Err(format!("pre-norm logits differ from the reference by {pre_error:e}").into());
    }
    if moved < 1e-2 {
        return Err("the post-norm spec computed the same logits as the pre-norm one".into());
    }
    train_each_placement(root)
}

/// The experiment's placements with warm-up, trained for `STEPS` steps each on the same batches of
/// a small text (bytes of this file's own source), on the CPU; each must learn (its loss fall).
fn train_each_placement(root: &Path) -> Result<(), Box<dyn std::error::Error>> {
    const STEPS: usize = 12;
    let text = root.join("examples/pre-vs-post-norm/main.rs");
    let cache = std::env::temp_dir().join(format!("kiln-pre-vs-post-norm-{}", std::process::id()));
    println!("\ntraining each placement for {STEPS} steps (12 layers, d_model 64) on the same batches:");
    for placement in ["pre", "post", "deepnorm"] {
        let file = format!("examples/pre-vs-post-norm/experiment/{placement}-warmup.toml");
        let fe =
            kiln_compiler::front_end(&file, &std::fs::read_to_string(root.join(&file))?).map_err(|e| e.render())?;
        let declared = fe.spec.spec.train.clone().unwrap_or_default();
        let overrides =
            RecipeFile { steps: Some(STEPS), warmup_steps: Some(2), eval_every: None, ..RecipeFile::default() };
        let recipe = declared.merge(overrides).resolve()?;
        let options = CorpusOptions {
            seed: recipe.seed,
            cache_dir: Some(cache.clone()),
            ..CorpusOptions::new(recipe.seq.unwrap_or(64), Objective::Causal)
        };
        let mut corpus = Corpus::open(&[&text], &ByteTokenizer, options)?;
        let params = init::initialize(&fe.spec, &fe.graph)?.into_iter().collect();
        let dims = PackDims::of(&fe.spec);
        let device = Device::Cpu { threads: kiln_runtime::cpu::default_threads() };
        let mut trainer = Trainer::new(device, &fe.graph, &fe.spec.weights, &dims, recipe.clone(), params)?;
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            let batch = corpus.batch(Split::Train, recipe.batch)?;
            losses.push(trainer.step(&[batch])?.loss);
        }
        let (first, last) = (losses[0], losses[STEPS - 1]);
        println!("    {placement:9} loss {first:.3} -> {last:.3}");
        if last >= first {
            return Err(format!("{placement}: the loss did not fall ({first} -> {last})").into());
        }
    }
    let _ = std::fs::remove_dir_all(&cache);
    Ok(())
}

/// The lines of the graph's text dump, in block 0, that show where the norms sit: the norms and
/// the residual sums (additions of two computed values, not of a bias parameter).
fn norm_and_residual_lines(graph: &Graph) -> Vec<String> {
    let in_block_0 = |scope: &str| scope == "layers.0" || scope.starts_with("layers.0.");
    let order = graph.order();
    let picked: Vec<bool> = order
        .iter()
        .map(|&n| {
            let node = &graph.g[n];
            let residual = matches!(node.op, Op::Add)
                && graph.operands(n).iter().all(|&o| !matches!(graph.g[o].op, Op::Param { .. }));
            in_block_0(&node.scope) && (matches!(node.op, Op::LayerNorm { .. }) || residual)
        })
        .collect();
    // The text dump has a header line, then one line per node with scope comments between them.
    let text = print::text(graph);
    let nodes = text.lines().filter(|l| l.trim_start().starts_with('%'));
    nodes.zip(picked).filter(|(_, keep)| *keep).map(|(line, _)| line.trim().to_string()).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
