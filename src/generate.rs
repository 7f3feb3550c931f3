//! `kiln generate`: a decoder spec's cached graph, optimized unless asked not to, run on wgpu (or
//! the interpreter) through a [`Session`]: prefill, then one token per step, streamed as it comes.

use anyhow::{Result, bail};
use kiln_compiler::graph::build::build_cached;
use kiln_compiler::spec::PackDims;
use kiln_compiler::{FrontEnd, lower, optimize};
use kiln_runtime::generate::{Engine, Sampler, Session, Stats, generate};
use std::io::Write;
use std::path::Path;

/// What to run and how to sample.
pub struct Request<'a> {
    /// The weights (safetensors or GGUF).
    pub weights: &'a Path,
    /// Prompt token ids.
    pub prompt: Vec<i64>,
    /// Most tokens to generate.
    pub max_new: usize,
    /// Token choice.
    pub sampler: Sampler,
    /// Generation stops after any of these.
    pub stop: Vec<i64>,
    /// Run on the interpreter instead of wgpu.
    pub interp: bool,
    /// GPU adapter.
    pub adapter: Option<&'a str>,
    /// Skip the optimizer.
    pub no_optimize: bool,
}

/// Builds the session and generates, calling `on_token` with each new id.
pub fn run(fe: &FrontEnd, req: Request, on_token: impl FnMut(i64) -> bool) -> Result<(Vec<i64>, Stats)> {
    if req.prompt.is_empty() {
        bail!("the prompt is empty: give --prompt or --prompt-ids");
    }
    let vocab = fe.spec.spec.model.vocab as i64;
    if let Some(bad) = req.prompt.iter().find(|&&t| t < 0 || t >= vocab) {
        bail!("prompt token id {bad} is outside the vocabulary (0..{vocab})");
    }
    let mut graph = build_cached(&fe.spec)?;
    if !req.no_optimize {
        graph = optimize::optimize(&graph)?.0;
    }
    let ckpt = kiln_runtime::Checkpoint::open(req.weights)?;
    let names = kiln_runtime::weights::graph_params(&graph);
    let params = kiln_runtime::weights::load_named(&fe.spec.weights, &PackDims::of(&fe.spec), &names, &ckpt)?;
    let outputs: Vec<String> = graph.outputs.iter().map(|(n, _)| n.clone()).collect();
    let engine = if req.interp {
        Engine::Interp { graph, params }
    } else {
        let gpu = std::sync::Arc::new(kiln_runtime::Gpu::new(req.adapter)?);
        Engine::Gpu(Box::new(kiln_runtime::GpuModel::new(gpu, lower::lower(&graph)?, &params)?))
    };
    let mut session = Session::new(engine, &outputs, fe.spec.spec.model.max_positions as usize)?;
    let mut sampler = req.sampler;
    Ok(generate(&mut session, &req.prompt, req.max_new, &mut sampler, &req.stop, on_token)?)
}

/// Prints the throughput line.
pub fn report(stats: &Stats) {
    let _ = writeln!(
        std::io::stderr(),
        "prefill: {} tokens, {:.1} tok/s; decode: {} tokens, {:.1} tok/s",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.new_tokens,
        stats.decode_tok_s()
    );
}
