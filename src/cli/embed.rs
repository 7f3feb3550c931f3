//! `kiln embed`: sentence embeddings from an encoder or decoder: a spec (or an artifact of one),
//! a built-in name, or a checkpoint (a sentence-transformers or plain Hugging Face directory). The
//! sentences (arguments, or lines of a file or stdin) are tokenized as one batch padded to the
//! longest and truncated where the model's own pipeline truncates (`outputs.max_seq_length`, else
//! `max_positions`; each truncation is said), run through the model, and the token states pooled
//! (`--pooling`: the mean, the first or last token, or none) and normalized (`--normalize`) as
//! the sentence-transformers config beside the model says, else as the spec's `[outputs]` say;
//! each embedding is printed: the first values and the norm, every value, or JSON; with
//! `--similarity`, their cosine similarities too.

use crate::cli::run::{Params, load};
use crate::exec::{Backend, Exec};
use crate::model_file::{ModelFile, is_gguf, tokenizer_beside, tokenizer_for, weights_for};
use crate::progress::Reporter;
use anyhow::{Context, Result, bail};
use kiln_compiler::spec::{BlockKind, Pooling as SpecPooling};
use kiln_compiler::tensor::Tensor;
use kiln_runtime::device::Loaded;
use kiln_runtime::weights::Checkpoint;
use kiln_runtime::{Batch, Tokenizer};
use std::path::{Path, PathBuf};

/// Values printed per embedding without `--full`.
const LEADING: usize = 6;

/// Characters of a sentence quoted after its embedding without `--full` (the rest cut, `…`).
const QUOTED: usize = 48;

/// Arguments of `kiln embed`.
#[derive(clap::Args)]
pub struct EmbedArgs {
    /// The model: a spec (TOML) of an encoder or decoder, an artifact of one, a built-in name
    /// (`minilm-l6`), or a checkpoint (a sentence-transformers or plain Hugging Face model
    /// directory, a GGUF file) whose spec is imported in memory.
    spec: PathBuf,
    /// Checkpoint (safetensors or GGUF) holding the weights under the names the spec's weight
    /// map gives (default: SPEC's, if a checkpoint or built-in name; else the spec's
    /// `weights.path`).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The tokenizer: a Hugging Face `tokenizer.json`, or a GGUF file whose metadata has one
    /// (default: the model's, then the one beside the weights: a `tokenizer.json` in their
    /// directory, or the GGUF weights' own).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// How the token states become one vector per sentence: `mean` over the unpadded tokens,
    /// `cls` (the first token's), `last` (the last unpadded token's), or `none` (every token's
    /// vector). Default: the sentence-transformers config beside the model (`modules.json`,
    /// `1_Pooling/config.json`), else the spec's `outputs.pooling`, else mean for an encoder and
    /// last for a decoder.
    #[arg(long, value_enum)]
    pooling: Option<Pooling>,
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
    /// Scale every embedding to unit L2 norm; `--normalize=false`: never. Default: as the
    /// sentence-transformers config says (a `Normalize` module), else the spec's
    /// `outputs.normalize`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    normalize: Option<bool>,
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

/// How `kiln embed` pools the token states of a sentence.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the unpadded tokens (sentence-transformers' `mean_tokens`).
    Mean,
    /// The first token's state (`cls_token`: BERT's [CLS]).
    Cls,
    /// The last unpadded token's state (`lasttoken`: decoder embedding models).
    Last,
    /// No pooling: every token's state.
    None,
}

/// What a sentence-transformers pipeline beside the model says (`None` each where it says
/// nothing): its pooling (an error for one kiln does not do: `max_tokens`, several modes
/// concatenated, which `--pooling` replaces), its normalization, its longest input.
struct Pipeline {
    pooling: Result<Option<Pooling>, String>,
    normalize: Option<bool>,
    max_seq_length: Option<u64>,
}

/// The sentence-transformers pipeline in `dir`, if any.
fn pipeline(dir: &Path) -> Result<Pipeline> {
    let Some(p) = kiln_runtime::import::sentence_pipeline(dir)? else {
        return Ok(Pipeline { pooling: Ok(None), normalize: None, max_seq_length: None });
    };
    let pooling = match p.modes.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] => Ok(None),
        ["mean_tokens"] => Ok(Some(Pooling::Mean)),
        ["cls_token"] => Ok(Some(Pooling::Cls)),
        ["lasttoken"] => Ok(Some(Pooling::Last)),
        modes => Err(format!(
            "`{}` pools by {}, which kiln embed does not do: choose one with --pooling mean|cls|last|none",
            p.config.display(),
            modes.iter().map(|m| format!("`pooling_mode_{m}`")).collect::<Vec<_>>().join(" + ")
        )),
    };
    Ok(Pipeline { pooling, normalize: p.normalize, max_seq_length: p.max_seq_length })
}

/// Where an embedding model is and how it embeds: what `kiln embed` and `kiln serve` take.
pub struct EmbedSource {
    /// The model: a spec, an artifact, a built-in name or a checkpoint.
    pub spec: PathBuf,
    /// Its checkpoint (default: the model's own).
    pub weights: Option<PathBuf>,
    /// Its tokenizer (default: the model's, then the one beside the weights).
    pub tokenizer: Option<PathBuf>,
    /// Pooling asked for (default: the sentence-transformers config, then the spec).
    pub pooling: Option<Pooling>,
    /// Normalization asked for (default: the sentence-transformers config, then the spec).
    pub normalize: Option<bool>,
    /// Where it runs.
    pub exec: Exec,
}

/// An embedding model opened (spec prepared, tokenizer, checkpoint, pooling, normalization,
/// backend resolved) but not yet loaded: [`EmbedModel::load`] loads it, on the thread that will
/// run it.
pub struct EmbedModel {
    model: ModelFile,
    source: States,
    ckpt: Checkpoint,
    exec: Exec,
    backend: Backend,
    /// The graph's name.
    pub name: String,
    /// How token states become a sentence's vector.
    pub pooling: Pooling,
    /// Whether every vector is scaled to unit norm.
    pub normalize: bool,
    /// The most tokens of a sentence embedded (the rest is cut).
    pub max_len: usize,
    /// Where that limit comes from (for the note on a truncated sentence).
    pub max_len_why: &'static str,
    /// The tokenizer, truncating to `max_len`.
    pub tokenizer: Tokenizer,
    /// Where the tokenizer was read.
    pub tokenizer_path: PathBuf,
    /// Values per embedding.
    pub dims: usize,
    /// The model's vocabulary: token ids are below it.
    pub vocab: u64,
}

impl EmbedModel {
    /// Opens the model `src` names: its spec rebuilt to give the states its pooling needs, the
    /// sentence-transformers config beside it, its tokenizer and checkpoint; the backend is
    /// resolved (said on `reporter` unless `json`).
    pub fn open(src: EmbedSource, reporter: &Reporter, json: bool) -> Result<EmbedModel> {
        let EmbedSource { spec: path, weights, tokenizer, pooling, normalize, exec } = src;
        let mut model = ModelFile::read(&path)?;
        let weights = weights_for(weights, &path)?;
        // The sentence-transformers config: in the model's directory, else beside the weights.
        let dir = if path.is_dir() { Some(path.as_path()) } else { weights.parent() };
        let st = match dir {
            Some(dir) if !dir.as_os_str().is_empty() => pipeline(dir)?,
            _ => pipeline(Path::new("."))?,
        };
        let outputs = &model.fe.spec.spec.outputs;
        let kind = model.fe.spec.spec.model.kind;
        let configured = match pooling {
            Some(p) => Some(p),
            None => st.pooling.map_err(anyhow::Error::msg)?,
        };
        let pooling = match configured {
            Some(p) => p,
            None if outputs.pooling == SpecPooling::Mean => Pooling::Mean,
            None if kind == BlockKind::Decoder => Pooling::Last,
            None => Pooling::Mean,
        };
        let normalize = normalize.or(st.normalize).unwrap_or(outputs.normalize);
        if kind == BlockKind::EncoderDecoder {
            bail!(
                "`{}` is an encoder-decoder: embedding needs an encoder or a decoder (whose token states are pooled)",
                path.display()
            );
        }
        let source = States::prepare(&mut model, pooling, normalize)
            .with_context(|| format!("cannot embed with `{}`", path.display()))?;
        let fe = &model.fe;
        // Truncated where the model's own pipeline truncates.
        let (max_len, max_len_why) = match (fe.spec.spec.outputs.max_seq_length, st.max_seq_length) {
            (Some(len), _) => (len, "the spec's `outputs.max_seq_length`"),
            (None, Some(len)) => (len, "`max_seq_length` of sentence_bert_config.json"),
            (None, None) => (fe.spec.spec.model.max_positions, "the spec's `max_positions`"),
        };
        let max_len = usize::try_from(max_len).unwrap_or(usize::MAX).min(fe.spec.spec.model.max_positions as usize);
        let tokenizer_path = match tokenizer_for(tokenizer, &path).or_else(|| tokenizer_beside(&weights)) {
            Some(path) => path,
            None if is_gguf(&weights)? => weights.clone(),
            None => bail!(
                "embedding needs a tokenizer: give --tokenizer (a tokenizer.json or GGUF file); none is beside `{}`",
                weights.display()
            ),
        };
        let tokenizer = Tokenizer::open(&tokenizer_path)?.with_max_len(max_len)?;
        let ckpt = Checkpoint::open(&weights)?;
        let backend = exec.backend.resolve(exec.adapter.as_deref(), exec.threads()?, reporter, json);
        crate::exec::check_exec(&exec, backend)?;
        Ok(EmbedModel {
            name: fe.graph.name.clone(),
            dims: fe.spec.spec.model.d_model as usize,
            vocab: fe.spec.spec.model.vocab,
            model,
            source,
            ckpt,
            exec,
            backend,
            pooling,
            normalize,
            max_len,
            max_len_why,
            tokenizer,
            tokenizer_path,
        })
    }

    /// Loads the model on its backend (the loading shown on `reporter`), once: the [`Embedder`]
    /// then embeds any number of batches.
    pub fn load(self, reporter: &Reporter) -> Result<Embedder> {
        let EmbedModel {
            model, source, ckpt, exec, backend, pooling, normalize, max_len, tokenizer, dims, vocab, ..
        } = self;
        let loaded = load(model, &Params::Checkpoint(&ckpt), &exec, backend, reporter)?;
        Ok(Embedder { loaded, source, pooling, normalize, max_len, tokenizer, dims, vocab })
    }
}

/// An embedding model loaded on its device: it embeds batches of sentences (or token ids) of any
/// size and length, one forward pass each.
pub struct Embedder {
    loaded: Loaded,
    source: States,
    /// How token states become a sentence's vector.
    pub pooling: Pooling,
    /// Whether every vector is scaled to unit norm.
    pub normalize: bool,
    /// The most tokens of a sentence embedded.
    pub max_len: usize,
    /// The tokenizer, truncating to `max_len`.
    pub tokenizer: Tokenizer,
    /// Values per embedding.
    pub dims: usize,
    /// Token ids are below this.
    pub vocab: u64,
}

/// What [`Embedder::embed`] gives per sentence: its vectors (one, or with no pooling one per
/// token) and the tokens embedded (after truncation).
pub struct Embeddings {
    /// Per sentence: its embedding, or (no pooling) its tokens' states.
    pub vectors: Vec<Vec<Vec<f32>>>,
    /// Per sentence: the tokens embedded.
    pub tokens: Vec<usize>,
}

impl Embedder {
    /// Embeds `sentences` as one batch (tokenized with their special tokens, truncated to
    /// `max_len`, padded to the longest).
    pub fn embed(&self, sentences: &[String]) -> Result<Embeddings> {
        let batch = self.tokenizer.encode_batch(sentences)?;
        let tokens = batch.attention_mask.chunks_exact(batch.seq.max(1)).map(|m| m.iter().sum::<i64>() as usize);
        let tokens = tokens.collect();
        Ok(Embeddings { vectors: self.run(&batch)?, tokens })
    }

    /// A sentence's token ids as [`embed`](Self::embed) runs them (special tokens added,
    /// truncated to `max_len`).
    pub fn tokenize(&self, text: &str) -> Result<Vec<i64>> {
        Ok(self.tokenizer.encode(text, true)?.into_iter().map(i64::from).collect())
    }

    /// Embeds rows of token ids as one batch, each as given (no special tokens added), padded to
    /// the longest: one list of vectors per row.
    pub fn embed_ids(&self, rows: &[Vec<i64>]) -> Result<Vec<Vec<Vec<f32>>>> {
        let seq = rows.iter().map(Vec::len).max().unwrap_or(0);
        let pad = i64::from(self.tokenizer.pad_id());
        let cells = rows.len() * seq;
        let mut batch = Batch {
            batch: rows.len(),
            seq,
            input_ids: Vec::with_capacity(cells),
            attention_mask: Vec::with_capacity(cells),
            token_type_ids: vec![0; cells],
        };
        for ids in rows {
            batch.input_ids.extend(ids);
            batch.input_ids.extend(std::iter::repeat_n(pad, seq - ids.len()));
            batch.attention_mask.extend(std::iter::repeat_n(1, ids.len()));
            batch.attention_mask.extend(std::iter::repeat_n(0, seq - ids.len()));
        }
        self.run(&batch)
    }

    /// One forward pass over `batch`: its rows' vectors, pooled and normalized.
    fn run(&self, batch: &Batch) -> Result<Vec<Vec<Vec<f32>>>> {
        if batch.seq == 0 {
            bail!("the sentences encode to no tokens");
        }
        let vocab = self.vocab;
        if let Some(id) = batch.input_ids.iter().find(|&&id| id < 0 || id as u64 >= vocab) {
            bail!("token id {id} is outside the model's vocabulary of {vocab}: is the tokenizer this model's?");
        }
        let states = self.source.take(self.loaded.run(&batch.inputs())?)?;
        let source = self.source;
        let (Some(values), &[rows, ..]) = (states.as_f32(), states.shape.as_slice()) else {
            bail!("the model's `{}` should be f32, got {:?}", source.output(), states.shape);
        };
        if rows != batch.batch {
            bail!("`{}` has shape {:?} for {} sentences", source.output(), states.shape, batch.batch);
        }
        // One list of vectors per sentence: its embedding, or (no pooling) its tokens' states.
        let mut embeddings: Vec<Vec<Vec<f32>>> = match source {
            States::Pooled => {
                let dims = states.shape.get(1).copied().unwrap_or(0);
                values.chunks_exact(dims.max(1)).map(|e| vec![e.to_vec()]).collect()
            }
            States::Hidden => {
                let &[_, seq, dims] = states.shape.as_slice() else {
                    bail!("`last_hidden_state` should be [batch, seq, dimensions], got {:?}", states.shape);
                };
                pool(values, &batch.attention_mask, seq, dims, self.pooling)
            }
        };
        let dims = embeddings.first().and_then(|e| e.first()).map_or(0, Vec::len);
        if dims == 0 {
            bail!("the model's `{}` has shape {:?}: no dimensions to embed", source.output(), states.shape);
        }
        if self.normalize {
            embeddings.iter_mut().flatten().for_each(|e| normalize_vec(e));
        }
        Ok(embeddings)
    }
}

/// Runs `kiln embed`, showing the loading on `reporter`.
pub fn run(args: EmbedArgs, reporter: &Reporter) -> Result<()> {
    let EmbedArgs { spec, weights, tokenizer, pooling, sentences, file, similarity, normalize, full, json, exec } =
        args;
    let src = EmbedSource { spec, weights, tokenizer, pooling, normalize, exec };
    let model = EmbedModel::open(src, reporter, json)?;
    let (pooling, normalize, max_len, why) = (model.pooling, model.normalize, model.max_len, model.max_len_why);
    if pooling == Pooling::None && similarity {
        bail!("--similarity compares one vector per sentence: give --pooling mean, cls or last, not none");
    }
    let sentences = match &file {
        Some(path) => read_sentences(path)?,
        None => sentences,
    };
    let batch = model.tokenizer.encode_batch(&sentences)?;
    if batch.seq == 0 {
        bail!("the sentences encode to no tokens");
    }
    let vocab = model.vocab;
    if let Some(id) = batch.input_ids.iter().find(|&&id| id as u64 >= vocab) {
        bail!(
            "the tokenizer gave id {id}, outside the model's vocabulary of {vocab}: is `{}` the tokenizer of this model?",
            model.tokenizer_path.display()
        );
    }
    // Each sentence's length untruncated, to say which were cut.
    let whole = Tokenizer::open(&model.tokenizer_path)?.with_max_len(usize::MAX / 2)?;
    let lengths = sentences.iter().map(|t| Ok(whole.encode(t, true)?.len())).collect::<Result<Vec<usize>>>()?;
    let kept: Vec<usize> =
        batch.attention_mask.chunks_exact(batch.seq).map(|m| m.iter().sum::<i64>() as usize).collect();
    if !json {
        for (i, (&len, &kept)) in lengths.iter().zip(&kept).enumerate() {
            if len > kept {
                reporter.info(format_args!(
                    "note: sentence {} has {}; embedded its first {kept} ({why})",
                    i + 1,
                    crate::report::count(len, "token")
                ));
            }
        }
    }
    let name = model.name.clone();
    let embedder = model.load(reporter)?;
    let Embeddings { vectors: embeddings, tokens: embedded } = embedder.embed(&sentences)?;
    let dims = embeddings.first().and_then(|e| e.first()).map_or(0, Vec::len);
    let pooled: Vec<Vec<f32>> = embeddings.iter().filter_map(|e| e.first().cloned()).collect();
    let similarity = similarity.then(|| cosine_matrix(&pooled));

    if json {
        let items: Vec<serde_json::Value> = sentences
            .iter()
            .zip(&embeddings)
            .zip(embedded.iter().zip(&lengths))
            .map(|((text, vectors), (kept, len))| {
                let json = |v: &Vec<f32>| v.iter().map(|&x| shortest(x)).collect::<Vec<f64>>();
                let mut item = serde_json::json!({
                    "text": text,
                    "tokens": kept,
                    "truncated_from": (len > kept).then_some(len),
                });
                match pooling {
                    Pooling::None => item["token_embeddings"] = vectors.iter().map(json).collect(),
                    _ => item["embedding"] = vectors.first().map(json).into(),
                }
                item
            })
            .collect();
        let mut value = serde_json::json!({
            "model": name,
            "dimensions": dims,
            "max_tokens": max_len,
            "pooling": format!("{pooling:?}").to_lowercase(),
            "normalized": normalize,
            "embeddings": items,
        });
        if let Some(m) = &similarity {
            let m: Vec<Vec<f64>> = m.iter().map(|row| row.iter().map(|&x| shortest(x)).collect()).collect();
            value["similarity"] = serde_json::json!(m);
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for (text, vectors) in sentences.iter().zip(&embeddings) {
            match pooling {
                Pooling::None => {
                    println!("{}", crate::report::shorten(text, QUOTED).escape_debug());
                    for (j, vector) in vectors.iter().enumerate() {
                        println!("  token {j}: {}", line("", vector, full).trim_end_matches("  \"\""));
                    }
                }
                _ => vectors.iter().for_each(|v| println!("{}", line(text, v, full))),
            }
        }
        if let Some(m) = &similarity {
            print!("{}", matrix_text(m));
        }
    }
    Ok(())
}

/// Where `kiln embed` reads the vectors it prints: the model's own `sentence_embedding` (an
/// artifact that pools as asked), or its `last_hidden_state`, pooled here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum States {
    Pooled,
    Hidden,
}

impl States {
    /// Makes `model` give the states `pooling` and `normalize` need: a spec is rebuilt to output
    /// its unpooled `last_hidden_state` (with the attention mask input, so padding is never
    /// attended to, and without logits); an artifact's plan is what it is, so it must have one
    /// output or the other.
    fn prepare(model: &mut ModelFile, pooling: Pooling, normalize: bool) -> Result<States> {
        let has = |name: &str| model.fe.graph.outputs.iter().any(|(n, _)| n == name);
        if model.artifact.is_some() {
            if has("last_hidden_state") {
                return Ok(States::Hidden);
            }
            let spec_normalizes = model.fe.spec.spec.outputs.normalize;
            if has("sentence_embedding") && pooling == Pooling::Mean && (normalize || !spec_normalizes) {
                return Ok(States::Pooled);
            }
            bail!(
                "the artifact has no `last_hidden_state` output to pool (its `sentence_embedding` is the mean{}): \
                 compile its spec with `outputs.hidden_states = true`, or embed with the spec itself",
                if spec_normalizes { ", normalized" } else { "" }
            );
        }
        let spec = &mut model.fe.spec;
        spec.spec.outputs.hidden_states = true;
        spec.spec.outputs.pooling = SpecPooling::None;
        spec.spec.outputs.normalize = false;
        spec.spec.attention.padding_mask = true;
        spec.logits = false;
        model.fe.graph = kiln_compiler::graph::build::build(spec)?;
        model.fe.graph.check()?;
        Ok(States::Hidden)
    }

    /// The output it reads.
    fn output(self) -> &'static str {
        match self {
            States::Pooled => "sentence_embedding",
            States::Hidden => "last_hidden_state",
        }
    }

    /// That output, out of the model's.
    fn take(self, outputs: Vec<(String, Tensor)>) -> Result<Tensor> {
        outputs
            .into_iter()
            .find_map(|(name, t)| (name == self.output()).then_some(t))
            .with_context(|| format!("the model produced no `{}`", self.output()))
    }
}

/// Pools `states` (`[batch, seq, dims]`, row-major) per sentence as `pooling` says, reading only
/// the tokens `mask` (`[batch, seq]`, 1 for a token) marks: their mean, the first token's state,
/// the last marked token's, or every marked token's (`none`). A sentence of no tokens pools to
/// zeros.
fn pool(states: &[f32], mask: &[i64], seq: usize, dims: usize, pooling: Pooling) -> Vec<Vec<Vec<f32>>> {
    let rows = states.chunks_exact((seq * dims).max(1)).zip(mask.chunks_exact(seq.max(1)));
    rows.map(|(sentence, mask)| {
        let tokens: Vec<&[f32]> =
            sentence.chunks_exact(dims.max(1)).zip(mask).filter(|(_, m)| **m != 0).map(|(t, _)| t).collect();
        match pooling {
            Pooling::None => tokens.iter().map(|t| t.to_vec()).collect(),
            Pooling::Cls => vec![sentence.get(..dims).map_or_else(|| vec![0.0; dims], <[f32]>::to_vec)],
            Pooling::Last => vec![tokens.last().map_or_else(|| vec![0.0; dims], |t| t.to_vec())],
            Pooling::Mean => {
                let mut sum = vec![0.0f32; dims];
                for t in &tokens {
                    sum.iter_mut().zip(*t).for_each(|(s, x)| *s += x);
                }
                let n = tokens.len().max(1) as f32;
                vec![sum.into_iter().map(|s| s / n).collect()]
            }
        }
    })
    .collect()
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
fn normalize_vec(v: &mut [f32]) {
    let n = norm(v);
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

/// The f64 nearest to `x`'s shortest decimal form, so JSON shows `0.13417706` for an f32, not
/// the f64 expansion of its binary value (`0.13417705893516541`).
pub fn shortest(x: f32) -> f64 {
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
        normalize_vec(&mut u);
        assert!((norm(&u) - 1.0).abs() < 1e-6);
        assert_eq!(shortest(0.134_177_06).to_string(), "0.13417706");
        let mut zero = [0.0; 3];
        normalize_vec(&mut zero);
        assert_eq!(zero, [0.0; 3]);
        let m = cosine_matrix(&[vec![1.0, 0.0], vec![1.0, 1.0], vec![0.0, 0.0]]);
        assert!((m[0][1] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6 && m[1][1] > 0.999_999 && m[2][0] == 0.0);
        assert_eq!(matrix_text(&m).lines().nth(3), Some("   2  0.7071  1.0000  0.0000"));
    }
}
