//! The bodies of kiln's fuzz targets, one function per target, each taking the fuzzer's bytes.
//!
//! They live here rather than in `fuzz_targets/` so that the main test suite can run them too:
//! `tests/fuzz_regressions.rs` includes this file and feeds it every seed (`fuzz/seeds/`) and every
//! input that once crashed (`fuzz/regressions/`). Each function must return normally for any
//! input: a panic is a bug, whatever the bytes.

pub mod differential;
pub mod train;

use arbitrary::{Arbitrary, Unstructured};
use kiln_compiler::FrontEnd;
use kiln_compiler::artifact::Artifact;
use kiln_compiler::graph::Sym;
use kiln_compiler::graph::build::build_cached;
use kiln_compiler::spec::PackDims;
use kiln_runtime::InterpEngine;
use kiln_runtime::Sampler;
use kiln_runtime::generate::{Session, generate as run_generation};
use kiln_runtime::weights::{graph_params, load_named, quantized_named};
use kiln_runtime::{Checkpoint, Message, Tokenizer};
use std::collections::HashMap;
use std::path::Path;
use std::sync::LazyLock;

/// A fuzz target: the bytes the fuzzer made.
pub type Target = fn(&[u8]);

/// The fuzz targets by name, for the regression runner.
pub const TARGETS: [(&str, Target); 7] = [
    ("spec", spec),
    ("safetensors", safetensors),
    ("gguf", gguf),
    ("artifact", artifact),
    ("generate", generate),
    ("differential", differential),
    ("train", train),
];

/// Larger graphs are only front-ended: lowering them is slow and exercises nothing new.
const LOWER_NODES: usize = 400;

fn front_end(file: &str, source: &str) -> FrontEnd {
    kiln_compiler::front_end(file, source).unwrap_or_else(|e| panic!("{file} is valid: {}", e.render()))
}

static GPT2: LazyLock<FrontEnd> = LazyLock::new(|| front_end("gpt2.toml", include_str!("../../models/gpt2.toml")));

static SMOLLM2: LazyLock<FrontEnd> =
    LazyLock::new(|| front_end("smollm2-135m.toml", include_str!("../../models/smollm2-135m.toml")));

/// Spec text through the front end (parse, validate, build the graph, check it) and, for graphs
/// of a modest size, lowering to naga-validated kernels. Every outcome must be a value or a
/// rendered diagnostic.
pub fn spec(data: &[u8]) {
    let Ok(source) = std::str::from_utf8(data) else { return };
    match kiln_compiler::front_end("fuzz.toml", source) {
        Ok(fe) => {
            let _ = kiln_compiler::graph::print::summary(&fe.graph, 8);
            if fe.graph.g.node_count() <= LOWER_NODES {
                let _ = kiln_compiler::lower::lower(&fe.graph);
            }
        }
        Err(e) => {
            let _ = e.render();
        }
    }
}

/// Every tensor of a checkpoint converted, and `fe`'s weight map applied to it (transposes,
/// unpacking, RoPE row order, shape checks, quantized blocks kept), as `kiln run` does.
fn load_through_map(ckpt: &Checkpoint, fe: &FrontEnd) {
    for name in ckpt.names() {
        let _ = ckpt.get(&name);
    }
    let (spec, params) = (&fe.spec, graph_params(&fe.graph));
    let _ = load_named(&spec.weights, &PackDims::of(spec), &params, ckpt);
    let _ = quantized_named(&spec.weights, &PackDims::of(spec), &params, ckpt);
}

/// A safetensors file read as a checkpoint and loaded through the GPT-2 spec's weight map.
pub fn safetensors(data: &[u8]) {
    if let Ok(ckpt) = Checkpoint::from_bytes(Path::new("fuzz.safetensors"), data.to_vec()) {
        load_through_map(&ckpt, &GPT2);
    }
}

/// A GGUF file: header, metadata and tensor table parsed, every tensor converted, its tokenizer
/// built from the metadata and used, and the SmolLM2 spec's weight map applied to it.
pub fn gguf(data: &[u8]) {
    let Ok(ckpt) = Checkpoint::from_bytes(Path::new("fuzz.gguf"), data.to_vec()) else { return };
    if let Some(file) = ckpt.gguf()
        && let Ok(tokenizer) = Tokenizer::from_gguf(file)
    {
        for text in ["Hello, world!", " <|im_start|>user\n\u{c9}t\u{e9} 123 \u{1f600}", ""] {
            if let Ok(ids) = tokenizer.encode(text, true) {
                let _ = tokenizer.decode(&ids, false);
            }
        }
        let _ = tokenizer.apply_chat_template(&[Message::new("user", "hi")], true);
    }
    load_through_map(&ckpt, &SMOLLM2);
}

/// An artifact file: header, checksum and payload checked, and what `kiln run` does with an
/// accepted one (the plan's memory at a small size, the spec rebuilt from its source). Input that
/// starts with `{` is taken as a payload and sealed with a valid header and checksum first, so
/// the fuzzer reaches the payload's decoding and checks instead of stopping at the checksum.
pub fn artifact(data: &[u8]) {
    let sealed;
    let file = match data.first() {
        Some(b'{') => {
            sealed = seal(data);
            &sealed
        }
        _ => data,
    };
    let Ok(artifact) = Artifact::from_bytes(Path::new("fuzz.kiln"), file) else { return };
    let syms = HashMap::from([(Sym::Batch, 1), (Sym::Seq, 4), (Sym::SrcSeq, 4), (Sym::Past, 0), (Sym::Ctx, 4)]);
    let _ = artifact.plan.memory(&syms);
    let _ = kiln_compiler::front_end(&artifact.spec_file, &artifact.spec_source);
}

/// `payload` behind a valid artifact header: magic, format version, length and CRC-32.
fn seal(payload: &[u8]) -> Vec<u8> {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in payload {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    let mut out = kiln_compiler::artifact::MAGIC.to_vec();
    out.extend_from_slice(&kiln_compiler::artifact::FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&(!crc).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// What `generate` is given: a prompt as text (optionally a chat turn) or as raw ids, sampling
/// parameters and a token budget.
#[derive(Arbitrary, Debug)]
struct GenerateInput {
    text: Option<String>,
    chat: bool,
    ids: Vec<i64>,
    max_new: u8,
    temperature: f32,
    top_k: u16,
    top_p: f32,
    repetition_penalty: f32,
    seed: u64,
}

/// The GPT-2 fixture (vocabulary 128, 32 positions) as a cached decoder on the interpreter, and a
/// word-level tokenizer of at most 128 tokens with a chat template.
struct Gpt2 {
    graph: kiln_compiler::graph::Graph,
    params: HashMap<String, kiln_compiler::tensor::Tensor>,
    max_positions: usize,
    tokenizer: Tokenizer,
}

static GPT2_CACHED: LazyLock<Gpt2> = LazyLock::new(|| {
    let graph = build_cached(&GPT2.spec).expect("a decoder has a cached graph");
    let ckpt = Checkpoint::from_bytes(
        Path::new("model.safetensors"),
        include_bytes!("../../tests/fixtures/gpt2/model.safetensors").to_vec(),
    )
    .expect("fixture weights");
    let params = load_named(&GPT2.spec.weights, &PackDims::of(&GPT2.spec), &graph_params(&graph), &ckpt)
        .expect("fixture weights");
    let tokenizer = Tokenizer::from_json_bytes(include_bytes!("../tokenizer.json"))
        .expect("fuzz/tokenizer.json is valid")
        .with_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
    Gpt2 { graph, params, max_positions: GPT2.spec.spec.model.max_positions as usize, tokenizer }
});

/// Generation inputs run on the GPT-2 fixture through a cached `Session`: out-of-vocabulary ids,
/// prompts longer than the positions and senseless sampling parameters must be errors, and every
/// sampled id must be in the vocabulary.
pub fn generate(data: &[u8]) {
    let Ok(input) = GenerateInput::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let model = &*GPT2_CACHED;
    let prompt: Vec<i64> = match &input.text {
        Some(text) => {
            let rendered = match input.chat {
                true => match model.tokenizer.apply_chat_template(&[Message::new("user", text.as_str())], true) {
                    Ok(rendered) => rendered,
                    Err(_) => return,
                },
                false => text.clone(),
            };
            match model.tokenizer.encode(&rendered, !input.chat) {
                Ok(ids) => ids.into_iter().map(i64::from).collect(),
                Err(_) => return,
            }
        }
        None => input.ids.clone(),
    };
    let Ok(mut sampler) =
        Sampler::new(input.temperature, input.top_k.into(), input.top_p, input.repetition_penalty, input.seed)
    else {
        return;
    };
    let outputs: Vec<String> = model.graph.outputs.iter().map(|(n, _)| n.clone()).collect();
    let engine = Box::new(InterpEngine::new(model.graph.clone(), model.params.clone()));
    let Ok(mut session) = Session::new(engine, &outputs, model.max_positions) else { return };
    // A budget of a few tokens keeps each run short; the limits are what is being tested.
    let max_new = usize::from(input.max_new % 4);
    if let Ok((ids, _)) = run_generation(&mut session, &prompt, max_new, &mut sampler, &[], |_| true) {
        assert!(ids.iter().all(|&id| (0..128).contains(&id)), "sampled an id outside the vocabulary: {ids:?}");
        let ids: Vec<u32> = ids.iter().filter_map(|&id| u32::try_from(id).ok()).collect();
        let _ = model.tokenizer.decode(&ids, true);
    }
}

/// A spec drawn from the whole language (see [`differential`]) through the front end (a refusal
/// is fine) and, when accepted, run at random weights on inputs of drawn lengths, batches and
/// padding by every engine on the unoptimized and the optimized graph: the interpreter, the CPU
/// back end at 1 and 3 threads, and wgpu where an adapter opens. They must agree on accepting or
/// refusing each run and on its outputs within [`differential::TOLERANCE`] of their scale; a
/// decoder's cached decoding (an encoder-decoder's with its encoder run once) must equal
/// recomputing the whole model, on every engine.
pub fn differential(data: &[u8]) {
    differential::run(data);
}

/// Target `train`: a spec drawn as [`differential`] draws one, its training step (loss and every
/// tensor's gradient) on every engine, held to the interpreter's (see [`train`](mod@train)).
pub fn train(data: &[u8]) {
    train::run(data);
}
