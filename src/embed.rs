//! `kiln embed`: sentence embeddings from an encoder spec that pools its output
//! (`outputs.pooling = "mean"`). The sentences are tokenized as one batch padded to the longest
//! (and truncated to the spec's `max_positions`), run through the model, and each row of its
//! `sentence_embedding` is printed: the first values and the norm, every value, or JSON.

use crate::progress::Reporter;
use crate::{Backend, Exec, load_f32, load_spec, run_compiled};
use anyhow::{Context, Result, bail};
use kiln_compiler::spec::PackDims;
use kiln_compiler::{interp, optimize};
use kiln_runtime::Tokenizer;
use kiln_runtime::weights::{Checkpoint, graph_params};
use std::path::PathBuf;

/// Values printed per embedding without `--full`.
const LEADING: usize = 6;

/// Arguments of `kiln embed`.
#[derive(clap::Args)]
pub struct EmbedArgs {
    /// The spec (TOML) of an encoder with `outputs.pooling = "mean"`, or a checkpoint (a
    /// sentence-transformers model directory) whose spec is imported in memory.
    spec: PathBuf,
    /// Checkpoint (safetensors or GGUF) holding the weights under the names the spec's weight
    /// map gives (default: SPEC's, if a checkpoint).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The tokenizer: a Hugging Face `tokenizer.json`, or a GGUF file whose metadata has one
    /// (default: the checkpoint's, if SPEC is one).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The sentences, embedded as one batch.
    #[arg(required = true)]
    sentences: Vec<String>,
    /// Scale every embedding to unit L2 norm (whatever the spec's `outputs.normalize` says).
    #[arg(long)]
    normalize: bool,
    /// Print every value of each embedding, not only the first few.
    #[arg(long)]
    full: bool,
    /// Print one JSON document on stdout instead of text: the model, the dimensions and, per
    /// sentence, its text, token count and embedding.
    #[arg(long, conflicts_with = "full")]
    json: bool,
    #[command(flatten)]
    exec: Exec,
}

impl EmbedArgs {
    /// The spec file.
    pub fn spec(&self) -> &std::path::Path {
        &self.spec
    }

    /// Whether `--print-spec` was given.
    pub fn print_spec(&self) -> bool {
        self.exec.print_spec
    }
}

/// Runs `kiln embed`, showing the loading on `reporter`.
pub fn run(args: EmbedArgs, reporter: &Reporter) -> Result<()> {
    let mut fe = load_spec(&args.spec)?;
    if !fe.graph.outputs.iter().any(|(name, _)| name == "sentence_embedding") {
        bail!(
            "`{}` has no `sentence_embedding` output: `kiln embed` needs a spec with `outputs.pooling = \"mean\"`",
            args.spec.display()
        );
    }
    let max_len = usize::try_from(fe.spec.spec.model.max_positions).unwrap_or(usize::MAX);
    let Some(tokenizer_path) = crate::import::tokenizer_for(args.tokenizer.clone(), &args.spec) else {
        bail!("--tokenizer is required with a spec (a checkpoint directory's tokenizer.json is used by default)");
    };
    let tokenizer = Tokenizer::open(&tokenizer_path)?.with_max_len(max_len)?;
    let batch = tokenizer.encode_batch(&args.sentences)?;
    if batch.seq == 0 {
        bail!("the sentences encode to no tokens");
    }
    let vocab = fe.spec.spec.model.vocab;
    if let Some(id) = batch.input_ids.iter().find(|&&id| id as u64 >= vocab) {
        bail!(
            "the tokenizer gave id {id}, outside the model's vocabulary of {vocab}: is `{}` the tokenizer of this model?",
            tokenizer_path.display()
        );
    }

    let ckpt = Checkpoint::open(&crate::import::weights_for(args.weights.clone(), &args.spec)?)?;
    let backend = args.exec.backend.resolve(args.exec.adapter.as_deref(), args.exec.threads()?, reporter, args.json);
    if !args.exec.no_optimize {
        let target = backend.optimizer_target();
        fe.graph = reporter.stage("optimizing", || optimize::optimize_for(&fe.graph, &target))?.0;
    }
    let inputs = batch.inputs();
    let outputs = match backend {
        Backend::Wgpu | Backend::Cpu | Backend::Auto => {
            run_compiled(&fe.spec, &fe.graph, &ckpt, &inputs, &args.exec, backend, reporter)?
        }
        Backend::Interp => {
            let names = graph_params(&fe.graph);
            let params = load_f32(&fe.spec.weights, &PackDims::of(&fe.spec), &names, &ckpt, reporter)?;
            interp::run(&fe.graph, &params, &inputs).context("run failed")?
        }
    };
    let embedding = outputs
        .into_iter()
        .find_map(|(name, t)| (name == "sentence_embedding").then_some(t))
        .context("the model produced no `sentence_embedding`")?;
    let (Some(values), &[rows, dims]) = (embedding.as_f32(), embedding.shape.as_slice()) else {
        bail!("`sentence_embedding` should be f32 [batch, dimensions], got {:?}", embedding.shape);
    };
    if rows != args.sentences.len() || dims == 0 {
        bail!("`sentence_embedding` has shape {:?} for {} sentences", embedding.shape, args.sentences.len());
    }
    let mut embeddings: Vec<Vec<f32>> = values.chunks_exact(dims).map(<[f32]>::to_vec).collect();
    if args.normalize {
        embeddings.iter_mut().for_each(|e| normalize(e));
    }

    if args.json {
        let items: Vec<serde_json::Value> = args
            .sentences
            .iter()
            .zip(&embeddings)
            .zip(batch.attention_mask.chunks_exact(batch.seq))
            .map(|((text, embedding), mask)| {
                let embedding: Vec<f64> = embedding.iter().map(|&x| shortest(x)).collect();
                serde_json::json!({ "text": text, "tokens": mask.iter().sum::<i64>(), "embedding": embedding })
            })
            .collect();
        let value = serde_json::json!({ "model": fe.graph.name, "dimensions": dims, "embeddings": items });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for (text, embedding) in args.sentences.iter().zip(&embeddings) {
            println!("{}", line(text, embedding, args.full));
        }
    }
    Ok(())
}

/// The L2 norm.
fn norm(v: &[f32]) -> f32 {
    v.iter().map(|x| x * x).sum::<f32>().sqrt()
}

/// Scales `v` to unit L2 norm (a zero vector stays zero).
fn normalize(v: &mut [f32]) {
    let n = norm(v);
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

/// The f64 nearest to `x`'s shortest decimal form, so JSON shows `0.13417706` for an f32, not
/// the f64 expansion of its binary value (`0.13417705893516541`).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// One sentence's line: its norm, its first values (or all of them) and its text.
fn line(text: &str, embedding: &[f32], full: bool) -> String {
    let shown = if full { embedding.len() } else { embedding.len().min(LEADING) };
    let mut values: Vec<String> = embedding[..shown].iter().map(|x| format!("{x:.6}")).collect();
    if shown < embedding.len() {
        values.push("…".into());
    }
    format!("norm {:.6}  [{}] ({} dims)  {text:?}", norm(embedding), values.join(", "), embedding.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_show_the_norm_and_the_leading_values() {
        let v = [3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-3];
        let l = line("hi", &v, false);
        assert_eq!(
            l,
            "norm 5.000000  [3.000000, 4.000000, 0.000000, 0.000000, 0.000000, 0.000000, …] (8 dims)  \"hi\""
        );
        assert!(line("hi", &v, true).contains("0.001000] (8 dims)"));
        let mut u = v;
        normalize(&mut u);
        assert!((norm(&u) - 1.0).abs() < 1e-6);
        assert_eq!(shortest(0.134_177_06).to_string(), "0.13417706");
        let mut zero = [0.0; 3];
        normalize(&mut zero);
        assert_eq!(zero, [0.0; 3]);
    }
}
