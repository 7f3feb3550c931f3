//! Sentence embeddings with all-MiniLM-L6-v2 from Rust: tokenize a batch, run the compiled model
//! on wgpu (the reference interpreter when there is no adapter), and compare the sentences by
//! cosine similarity.
//!
//! Needs the model: `scripts/fetch-models minilm`. Run with
//! `cargo run --example sentence-embeddings`.

use kiln_compiler::{interp, lower, optimize};
use kiln_runtime::{Gpu, GpuModel, Tokenizer};
use std::path::Path;
use std::sync::Arc;

/// Two pairs of paraphrases, interleaved.
const SENTENCES: [&str; 4] = [
    "The cat sits on the mat.",
    "Quarterly revenue grew by twelve percent.",
    "A feline rests on a rug.",
    "The company's sales rose 12% this quarter.",
];
/// The index of each sentence's paraphrase: its nearest neighbour, if the embeddings are good.
const PARAPHRASE: [usize; 4] = [2, 3, 0, 1];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = kiln_runtime::data_dir().ok_or("set KILN_DATA (or HOME) to find the models")?.join("minilm-l6");
    let (weights, tokenizer) = (data.join("model.safetensors"), data.join("tokenizer.json"));
    if !weights.exists() || !tokenizer.exists() {
        return Err(format!("MiniLM is not in {}: run scripts/fetch-models minilm", data.display()).into());
    }

    // The spec's outputs pool the last hidden state over each sentence's tokens and normalise
    // it: the model's `sentence_embedding` output is the embedding.
    let spec_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/minilm-l6.toml");
    let fe = kiln_compiler::front_end("models/minilm-l6.toml", &std::fs::read_to_string(spec_path)?)
        .map_err(|e| e.render())?;
    let graph = optimize::optimize(&fe.graph)?.0;
    let params = kiln_runtime::load_params(&fe.spec, &graph, &weights)?;

    // One batch, padded to the longest sentence; the attention mask keeps padding out of the mean.
    let max_positions = usize::try_from(fe.spec.spec.model.max_positions)?;
    let tokenizer = Tokenizer::from_file(&tokenizer)?.with_max_len(max_positions)?;
    let batch = tokenizer.encode_batch(&SENTENCES)?;
    println!("{} sentences, padded to {} tokens", batch.batch, batch.seq);

    let outputs = match Gpu::new(None) {
        Ok(gpu) => GpuModel::new(Arc::new(gpu), lower::lower(&graph), &params)?.run(&batch.inputs())?,
        Err(e) => {
            println!("no GPU adapter ({e}); running on the reference interpreter");
            interp::run(&graph, &params, &batch.inputs())?
        }
    };
    let embedding = outputs.iter().find(|(name, _)| name == "sentence_embedding").ok_or("no embedding")?;
    let dims = embedding.1.shape[1];
    let rows: Vec<&[f32]> = embedding.1.as_f32().ok_or("f32 embeddings")?.chunks_exact(dims).collect();

    // Unit vectors: cosine similarity is the dot product.
    let cosine = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    println!("cosine similarity ({dims} dimensions):");
    for (i, a) in rows.iter().enumerate() {
        let row: Vec<String> = rows.iter().map(|b| format!("{:5.2}", cosine(a, b))).collect();
        println!("  {}  {}", row.join(" "), SENTENCES[i]);
    }
    for (i, a) in rows.iter().enumerate() {
        let nearest = (0..rows.len())
            .filter(|&j| j != i)
            .max_by(|&j, &k| cosine(a, rows[j]).total_cmp(&cosine(a, rows[k])))
            .ok_or("one sentence has no neighbour")?;
        if nearest != PARAPHRASE[i] {
            return Err(format!("`{}` is nearest to `{}`, not its paraphrase", SENTENCES[i], SENTENCES[nearest]).into());
        }
    }
    println!("each sentence is nearest to its paraphrase");
    Ok(())
}
