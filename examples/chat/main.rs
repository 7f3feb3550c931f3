//! A two-turn chat with SmolLM2-135M-Instruct from Rust: the GGUF file's own tokenizer and chat
//! template, its Q4_1 weights kept as blocks, and one key/value cache for the whole conversation,
//! so the second turn prefills only the tokens the first did not already run. It runs where
//! `kiln generate` would: on a hardware GPU through wgpu when the machine has one, else on the
//! native CPU backend.
//!
//! Needs the model: `scripts/fetch-models smollm2`. Run with `cargo run --example chat`.

use kiln_compiler::graph::build::build_cached;
use kiln_compiler::target::Target;
use kiln_compiler::{lower, optimize};
use kiln_runtime::Sampler;
use kiln_runtime::generate::{Session, generate};
use kiln_runtime::{CpuEngine, GpuEngine};
use kiln_runtime::{CpuModel, Gpu, GpuModel, Message, Tokenizer};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// The user's turns.
const TURNS: [&str; 2] = ["What is the capital of France?", "And what is the capital of Germany?"];
/// Most tokens per answer.
const MAX_NEW: usize = 24;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = kiln_runtime::data_dir().ok_or("set KILN_DATA (or HOME) to find the models")?.join("smollm2-135m");
    let weights = data.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !weights.exists() {
        return Err(format!("SmolLM2 is not in {}: run scripts/fetch-models smollm2", data.display()).into());
    }
    let spec_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m.toml");
    let fe = kiln_compiler::front_end("models/smollm2-135m.toml", &std::fs::read_to_string(spec_path)?)
        .map_err(|e| e.render())?;

    // The decoder step with its key/value cache, optimized for the backend that runs it, as
    // `kiln generate` runs it.
    let gpu = match Gpu::hardware_adapter() {
        Some(_) => Some(Gpu::new(None)?),
        None => None,
    };
    let target = if gpu.is_some() { Target::wgpu() } else { Target::cpu() };
    let graph = optimize::optimize_for(&build_cached(&fe.spec)?, &target)?.0;
    let (params, blocks) = kiln_runtime::load_params_with_blocks(&fe.spec, &graph, &weights)?;
    // Projections whose weights the file stores as Q4_1/Q8_0 read those blocks directly.
    let formats = blocks.iter().map(|(name, q)| (name.clone(), q.format)).collect();
    let plan = lower::lower_with(&graph, lower::Options { formats, ..lower::Options::default() });
    let engine: Box<dyn kiln_runtime::Engine> = match gpu {
        Some(gpu) => Box::new(GpuEngine::new(GpuModel::with_blocks(Arc::new(gpu), plan, &params, &blocks)?)),
        None => {
            let threads = kiln_runtime::cpu::default_threads();
            println!("(no GPU adapter: the CPU backend on {threads} threads)");
            Box::new(CpuEngine::new(CpuModel::from_owned(plan, params, blocks, threads, &())?))
        }
    };
    let outputs: Vec<String> = graph.outputs.iter().map(|(name, _)| name.clone()).collect();
    let max_positions = usize::try_from(fe.spec.spec.model.max_positions)?;
    let mut session = Session::new(engine, &outputs, max_positions)?;

    let tokenizer = Tokenizer::open(&weights)?;
    let eos: Vec<i64> = tokenizer.eos_id().map(i64::from).into_iter().collect();
    let mut messages = Vec::new();
    // The token ids the session's cache holds, in order.
    let mut cached: Vec<i64> = Vec::new();
    let mut answers = Vec::new();
    for question in TURNS {
        messages.push(Message::new("user", question));
        let rendered = tokenizer.apply_chat_template(&messages, true)?;
        let ids: Vec<i64> = tokenizer.encode(&rendered, false)?.into_iter().map(i64::from).collect();
        // The conversation so far is a prefix of the new rendering: run only what follows it.
        // (Were it not, say because a token boundary moved, start the cache over.)
        if !ids.starts_with(&cached) {
            session.reset();
            cached.clear();
        }
        let new = &ids[cached.len()..];
        println!("user: {question}");
        print!("assistant: ");
        std::io::stdout().flush()?;
        let mut stream = tokenizer.decode_stream(true);
        let mut greedy = Sampler::greedy();
        let (answer, stats) = generate(&mut session, new, MAX_NEW, &mut greedy, &eos, |id| {
            // Display only: the answer is decoded (and its errors reported) below.
            if let Some(text) = u32::try_from(id).ok().and_then(|id| stream.step(id).ok().flatten()) {
                print!("{text}");
                let _ = std::io::stdout().flush();
            }
            true
        })?;
        println!();
        println!(
            "  ({} prompt tokens run of {} in the conversation, {} cached; {} new tokens)\n",
            new.len(),
            ids.len(),
            cached.len(),
            stats.new_tokens
        );
        // The cache now holds the prompt and every answer token but the last (never run).
        cached.extend_from_slice(new);
        cached.extend_from_slice(&answer[..answer.len().saturating_sub(1)]);
        let ids: Vec<u32> = answer.iter().filter_map(|&id| u32::try_from(id).ok()).collect();
        let text = tokenizer.decode(&ids, true)?;
        messages.push(Message::new("assistant", text.as_str()));
        answers.push(text);
    }

    // Greedy decoding of this model answers both questions correctly; anything else means the
    // compiled model or the cache reuse broke.
    for (answer, city) in answers.iter().zip(["Paris", "Berlin"]) {
        if !answer.contains(city) {
            return Err(format!("expected an answer naming {city}, got {answer:?}").into());
        }
    }
    Ok(())
}
