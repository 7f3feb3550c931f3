//! `kiln embed`: sentence embeddings from an encoder spec (or an artifact of one) that pools its
//! output (`outputs.pooling = "mean"`). The sentences (arguments, or lines of a file or stdin)
//! are tokenized as one batch padded to the longest and truncated where the model's own pipeline
//! truncates (`outputs.max_seq_length`, else `max_positions`; each truncation is said), run
//! through the model, and each row of its `sentence_embedding` is printed: the first values and
//! the norm, every value, or JSON; with `--similarity`, their cosine similarities too.

use crate::cli::run::{Params, execute};
use crate::exec::Exec;
use crate::model_file::{ModelFile, is_gguf, tokenizer_for, weights_for};
use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_runtime::Tokenizer;
use kiln_runtime::weights::Checkpoint;
use std::path::PathBuf;

/// Values printed per embedding without `--full`.
const LEADING: usize = 6;

/// Characters of a sentence quoted after its embedding without `--full` (the rest cut, `…`).
const QUOTED: usize = 48;

/// Arguments of `kiln embed`.
#[derive(clap::Args)]
pub struct EmbedArgs {
    /// The spec (TOML) of an encoder with `outputs.pooling = "mean"`, an artifact of one, or a
    /// checkpoint (a sentence-transformers model directory) whose spec is imported in memory.
    spec: PathBuf,
    /// Checkpoint (safetensors or GGUF) holding the weights under the names the spec's weight
    /// map gives (default: SPEC's, if a checkpoint).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The tokenizer: a Hugging Face `tokenizer.json`, or a GGUF file whose metadata has one
    /// (default: the checkpoint's, if SPEC is one; else the weights, when GGUF).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The sentences, embedded as one batch.
    #[arg(required_unless_present = "file", conflicts_with = "file")]
    sentences: Vec<String>,
    /// Instead: read the sentences from this file, one per line (blank lines skipped); `-` reads
    /// standard input.
    #[arg(short, long)]
    file: Option<PathBuf>,
    /// Also print the cosine similarity of every pair of sentences, as a matrix (JSON:
    /// `similarity`).
    #[arg(long)]
    similarity: bool,
    /// Scale every embedding to unit L2 norm (whatever the spec's `outputs.normalize` says).
    #[arg(long)]
    normalize: bool,
    /// Print every value of each embedding, not only the first few.
    #[arg(long)]
    full: bool,
    /// Print one JSON document on stdout instead of text: the model, the dimensions and, per
    /// sentence, its text, token count (embedded, and before truncation) and embedding.
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
    let model = ModelFile::read(&args.spec)?;
    let fe = &model.fe;
    if !fe.graph.outputs.iter().any(|(name, _)| name == "sentence_embedding") {
        bail!(
            "`{}` has no `sentence_embedding` output: `kiln embed` needs a spec with `outputs.pooling = \"mean\"`",
            args.spec.display()
        );
    }
    let sentences = match &args.file {
        Some(path) => read_sentences(path)?,
        None => args.sentences.clone(),
    };
    // Truncated where the model's own pipeline truncates.
    let (max_len, why) = match fe.spec.spec.outputs.max_seq_length {
        Some(len) => (len, "the spec's `outputs.max_seq_length`"),
        None => (fe.spec.spec.model.max_positions, "the spec's `max_positions`"),
    };
    let max_len = usize::try_from(max_len).unwrap_or(usize::MAX);
    let weights = weights_for(args.weights.clone(), &args.spec)?;
    let tokenizer_path = match tokenizer_for(args.tokenizer.clone(), &args.spec) {
        Some(path) => path,
        None if is_gguf(&weights)? => weights.clone(),
        None => bail!("`kiln embed` needs a tokenizer: give --tokenizer (a tokenizer.json or GGUF file)"),
    };
    let open = || Tokenizer::open(&tokenizer_path);
    let tokenizer = open()?.with_max_len(max_len)?;
    let batch = tokenizer.encode_batch(&sentences)?;
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
    // Each sentence's length untruncated, to say which were cut.
    let whole = open()?.with_max_len(usize::MAX / 2)?;
    let embedded: Vec<usize> =
        batch.attention_mask.chunks_exact(batch.seq).map(|m| m.iter().sum::<i64>() as usize).collect();
    let lengths = sentences.iter().map(|t| Ok(whole.encode(t, true)?.len())).collect::<Result<Vec<usize>>>()?;
    if !args.json {
        for (i, (&len, &kept)) in lengths.iter().zip(&embedded).enumerate() {
            if len > kept {
                reporter.info(format_args!(
                    "note: sentence {} has {}; embedded its first {kept} ({why})",
                    i + 1,
                    crate::report::count(len, "token")
                ));
            }
        }
    }

    let ckpt = Checkpoint::open(&weights)?;
    let backend = args.exec.backend.resolve(args.exec.adapter.as_deref(), args.exec.threads()?, reporter, args.json);
    let name = fe.graph.name.clone();
    let outputs = execute(model, &Params::Checkpoint(&ckpt), &batch.inputs(), &args.exec, backend, reporter)?;
    let embedding = outputs
        .into_iter()
        .find_map(|(name, t)| (name == "sentence_embedding").then_some(t))
        .context("the model produced no `sentence_embedding`")?;
    let (Some(values), &[rows, dims]) = (embedding.as_f32(), embedding.shape.as_slice()) else {
        bail!("`sentence_embedding` should be f32 [batch, dimensions], got {:?}", embedding.shape);
    };
    if rows != sentences.len() || dims == 0 {
        bail!("`sentence_embedding` has shape {:?} for {} sentences", embedding.shape, sentences.len());
    }
    let mut embeddings: Vec<Vec<f32>> = values.chunks_exact(dims).map(<[f32]>::to_vec).collect();
    if args.normalize {
        embeddings.iter_mut().for_each(|e| normalize(e));
    }
    let similarity = args.similarity.then(|| cosine_matrix(&embeddings));

    if args.json {
        let items: Vec<serde_json::Value> = sentences
            .iter()
            .zip(&embeddings)
            .zip(embedded.iter().zip(&lengths))
            .map(|((text, embedding), (kept, len))| {
                let embedding: Vec<f64> = embedding.iter().map(|&x| shortest(x)).collect();
                serde_json::json!({
                    "text": text,
                    "tokens": kept,
                    "truncated_from": (len > kept).then_some(len),
                    "embedding": embedding,
                })
            })
            .collect();
        let mut value =
            serde_json::json!({ "model": name, "dimensions": dims, "max_tokens": max_len, "embeddings": items });
        if let Some(m) = &similarity {
            let m: Vec<Vec<f64>> = m.iter().map(|row| row.iter().map(|&x| shortest(x)).collect()).collect();
            value["similarity"] = serde_json::json!(m);
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for (text, embedding) in sentences.iter().zip(&embeddings) {
            println!("{}", line(text, embedding, args.full));
        }
        if let Some(m) = &similarity {
            print!("{}", matrix_text(m));
        }
    }
    Ok(())
}

/// The sentences of a file (`-`: standard input), one per line, blank lines skipped.
fn read_sentences(path: &std::path::Path) -> Result<Vec<String>> {
    let text = crate::model_file::read_text(path, "the sentences")?;
    let sentences: Vec<String> =
        text.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    if sentences.is_empty() {
        bail!("`{}` holds no sentences (one per line)", path.display());
    }
    Ok(sentences)
}

/// The cosine similarity of every pair of vectors (0 with a zero vector).
fn cosine_matrix(v: &[Vec<f32>]) -> Vec<Vec<f32>> {
    v.iter()
        .map(|a| {
            v.iter()
                .map(|b| {
                    let (na, nb) = (norm(a), norm(b));
                    if na == 0.0 || nb == 0.0 {
                        0.0
                    } else {
                        a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>() / (na * nb)
                    }
                })
                .collect()
        })
        .collect()
}

/// The similarity matrix as text: a header of sentence numbers, then one row per sentence.
fn matrix_text(m: &[Vec<f32>]) -> String {
    let mut text = format!("cosine similarity\n{:>4}", "");
    for j in 0..m.len() {
        text += &format!(" {:>7}", j + 1);
    }
    text.push('\n');
    for (i, row) in m.iter().enumerate() {
        text += &format!("{:>4}", i + 1);
        for x in row {
            text += &format!(" {x:>7.4}");
        }
        text.push('\n');
    }
    text
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

/// One sentence's line: its norm, its first values (or all of them) and its text (its first
/// [`QUOTED`] characters, but with `full`).
fn line(text: &str, embedding: &[f32], full: bool) -> String {
    let text = if full { text.to_string() } else { crate::report::shorten(text, QUOTED) };
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
        let long = "word ".repeat(40);
        assert!(line(&long, &v, false).ends_with(&format!("{:?}", format!("{}…", &long[..QUOTED]))));
        assert!(line(&long, &v, true).ends_with(&format!("{long:?}")));
        let mut u = v;
        normalize(&mut u);
        assert!((norm(&u) - 1.0).abs() < 1e-6);
        assert_eq!(shortest(0.134_177_06).to_string(), "0.13417706");
        let mut zero = [0.0; 3];
        normalize(&mut zero);
        assert_eq!(zero, [0.0; 3]);
        let m = cosine_matrix(&[vec![1.0, 0.0], vec![1.0, 1.0], vec![0.0, 0.0]]);
        assert!((m[0][1] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6 && m[1][1] > 0.999_999 && m[2][0] == 0.0);
        assert_eq!(matrix_text(&m).lines().nth(3), Some("   2  0.7071  1.0000  0.0000"));
    }
}
