//! Tokenization: text to token ids and back, and chat templates.
//!
//! A [`Tokenizer`] comes from one of two places:
//!
//! - a Hugging Face `tokenizer.json` ([`Tokenizer::from_file`]), read by the `tokenizers` crate:
//!   MiniLM's BERT WordPiece, or any other pipeline that format describes;
//! - a GGUF file's metadata ([`Tokenizer::from_gguf`]): llama.cpp's `tokenizer.ggml.*` keys,
//!   rebuilt as the equivalent `tokenizers` pipeline. kiln reads byte-level BPE
//!   (`tokenizer.ggml.model = "gpt2"`) split by the pre-tokenizers of [`PRE_TOKENIZERS`], and
//!   SentencePiece BPE (`"llama"`: LLaMA, Gemma, ...), its merges recovered from the
//!   vocabulary: every token splits into each pair of tokens that spell it, a merge ranked by its
//!   result's position in the vocabulary (SentencePiece stores pieces in the order its trainer
//!   made them; the scores of control and user-defined pieces are placeholders).
//!
//! [`Tokenizer::encode_batch`] pads a batch to its longest sequence with an attention mask,
//! ready to be a model's inputs; [`Tokenizer::decode`] turns ids back into text, and a
//! [`DecodeStream`] does it one id at a time for streaming output. A chat template (Jinja, from
//! `tokenizer.chat_template`) renders a conversation into a prompt with minijinja
//! ([`Tokenizer::apply_chat_template`]) under the whitespace settings transformers uses.

use kiln_compiler::tensor::Tensor;
use minijinja::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessor, PostProcessorWrapper,
    PreTokenizerWrapper, TruncationParams,
};

use crate::gguf::{self, Gguf, GgufError};

/// An error building a tokenizer, encoding, decoding or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The tokenizer file could not be read. (The cause is part of the message, not an error
    /// `source`, so error chains do not print it twice.)
    #[error("cannot read tokenizer `{path}`: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// The file is not a tokenizer the `tokenizers` crate can load.
    #[error("`{path}` is not a valid tokenizer.json: {message}")]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The file looks like GGUF but does not parse.
    #[error("`{path}`: {error}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        error: GgufError,
    },
    /// A GGUF metadata key the tokenizer needs is absent.
    #[error("the GGUF file has no `{key}` metadata, so it carries no tokenizer kiln can build")]
    MissingKey {
        /// The key.
        key: &'static str,
    },
    /// A GGUF metadata value of the wrong type.
    #[error("GGUF metadata `{key}` should be {expected}")]
    BadKey {
        /// The key.
        key: &'static str,
        /// What it should hold.
        expected: &'static str,
    },
    /// A tokenizer model kiln cannot build from GGUF metadata.
    #[error(
        "GGUF tokenizer model `{model}` is not supported (kiln builds `gpt2`, byte-level BPE, and `llama`, SentencePiece BPE)"
    )]
    UnsupportedModel {
        /// `tokenizer.ggml.model`.
        model: String,
    },
    /// A pre-tokenizer kiln does not know.
    #[error("GGUF pre-tokenizer `{pre}` is not supported (kiln knows {})", known_pre_tokenizers())]
    UnsupportedPreTokenizer {
        /// `tokenizer.ggml.pre`.
        pre: String,
    },
    /// GGUF tokenizer metadata that contradicts itself.
    #[error("GGUF tokenizer metadata: {message}")]
    Inconsistent {
        /// What is wrong.
        message: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary ({vocab} tokens)")]
    UnknownId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// `with_max_len` was given no room for a text between the special tokens.
    #[error("a maximum length of {max_len} leaves no room for text next to the {special} special tokens")]
    MaxLenTooSmall {
        /// The requested length.
        max_len: usize,
        /// Special tokens added to every sequence.
        special: usize,
    },
    /// Encoding or decoding failed inside the `tokenizers` crate.
    #[error("tokenization failed: {message}")]
    Tokenizers {
        /// The crate's message.
        message: String,
    },
    /// The tokenizer has no chat template.
    #[error("the tokenizer has no chat template (GGUF `tokenizer.chat_template`)")]
    NoChatTemplate,
    /// The chat template does not parse or fails to render.
    #[error("chat template: {message}")]
    Template {
        /// minijinja's message, with the template line where it knows it.
        message: String,
    },
}

fn tokenizers_error(e: tokenizers::Error) -> TokenizeError {
    TokenizeError::Tokenizers { message: e.to_string() }
}

/// How text is split before byte-level BPE, as llama.cpp does for a `tokenizer.ggml.pre` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreSplit {
    /// GPT-2's regex: contractions, letters, numbers, other symbols, whitespace runs.
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (StarCoder, SmolLM).
    DigitsThenGpt2,
}

/// The `tokenizer.ggml.pre` values kiln builds, with their split. The groups are llama.cpp's:
/// every name in a group selects the same regexes in its `llama-vocab.cpp`.
pub const PRE_TOKENIZERS: &[(&str, PreSplit)] = &[
    ("gpt-2", PreSplit::Gpt2),
    ("phi-2", PreSplit::Gpt2),
    ("mpt", PreSplit::Gpt2),
    ("olmo", PreSplit::Gpt2),
    ("starcoder", PreSplit::DigitsThenGpt2),
    ("refact", PreSplit::DigitsThenGpt2),
    ("command-r", PreSplit::DigitsThenGpt2),
    ("smollm", PreSplit::DigitsThenGpt2),
    ("codeshell", PreSplit::DigitsThenGpt2),
    ("exaone", PreSplit::DigitsThenGpt2),
];

fn known_pre_tokenizers() -> String {
    PRE_TOKENIZERS.iter().map(|(name, _)| format!("`{name}`")).collect::<Vec<_>>().join(", ")
}

/// The two GGUF tokenizer models kiln builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GgufModel {
    /// `gpt2`: byte-level BPE with the file's merges, split as the pre-tokenizer says.
    ByteLevel(PreSplit),
    /// `llama`: SentencePiece BPE over `▁`-spelled text with byte fallback.
    SentencePiece,
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`, `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// A batch of encoded texts, padded to the longest: every vector is row-major `[batch, seq]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Number of texts.
    pub batch: usize,
    /// Length of the longest encoded text; shorter ones are padded to it.
    pub seq: usize,
    /// Token ids; padding positions hold the pad id.
    pub input_ids: Vec<i64>,
    /// 1 for a token, 0 for padding.
    pub attention_mask: Vec<i64>,
    /// Segment ids (0 for a single text; padding 0).
    pub token_type_ids: Vec<i64>,
}

impl Batch {
    /// The batch as model inputs under the names kiln's graphs read (`input_ids`,
    /// `attention_mask`, `token_type_ids`; a graph ignores those it has no input for).
    pub fn inputs(&self) -> HashMap<String, Tensor> {
        let shape = vec![self.batch, self.seq];
        HashMap::from([
            ("input_ids".to_string(), Tensor::i64(shape.clone(), self.input_ids.clone())),
            ("attention_mask".to_string(), Tensor::i64(shape.clone(), self.attention_mask.clone())),
            ("token_type_ids".to_string(), Tensor::i64(shape, self.token_type_ids.clone())),
        ])
    }
}

/// One message of a conversation, for [`Tokenizer::apply_chat_template`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, or another role the template knows.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// A tokenizer: text to ids for a model, ids back to text, and the model's chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Fills padding positions. Any id works (the attention mask hides padding); this is the
    /// file's pad token where it names one.
    pad_id: u32,
    /// Added before / after every text by `encode*(..)` for GGUF tokenizers whose metadata asks
    /// for it (`tokenizer.ggml.add_bos_token`, `add_eos_token`); a `tokenizer.json` adds its
    /// special tokens in its own post-processor instead.
    prefix: Option<u32>,
    suffix: Option<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("pad_id", &self.pad_id)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Reads the tokenizer in a file: the metadata of a GGUF file (told apart by its magic, as
    /// [`Checkpoint::open`](crate::Checkpoint::open) does) or else a `tokenizer.json`.
    pub fn open(path: &Path) -> Result<Self, TokenizeError> {
        let bytes = std::fs::read(path).map_err(|error| TokenizeError::Io { path: path.into(), error })?;
        if gguf::sniff(&bytes) {
            let file = Gguf::parse(bytes).map_err(|error| TokenizeError::Gguf { path: path.into(), error })?;
            Self::from_gguf(&file)
        } else {
            Self::from_json(path, &bytes)
        }
    }

    /// Reads a Hugging Face `tokenizer.json`. Its padding settings are dropped ([`encode_batch`]
    /// pads to the longest text of each batch, with the file's pad token); its truncation is
    /// kept until [`with_max_len`] replaces it.
    ///
    /// [`encode_batch`]: Self::encode_batch
    /// [`with_max_len`]: Self::with_max_len
    pub fn from_file(path: &Path) -> Result<Self, TokenizeError> {
        let bytes = std::fs::read(path).map_err(|error| TokenizeError::Io { path: path.into(), error })?;
        Self::from_json(path, &bytes)
    }

    /// The byte tokenizer: each UTF-8 byte of a text is its own id (0..=255), as a model
    /// trained on raw bytes reads text (`kiln train` with no tokenizer). Built as a BPE model
    /// with no merges whose vocabulary is the 256 byte tokens `<0x00>`..`<0xFF>`: every
    /// character falls back to its bytes, and decoding joins them again.
    pub fn bytes() -> Result<Self, TokenizeError> {
        let vocab: Vocab = (0..=255u32).map(|b| (format!("<0x{b:02X}>"), b)).collect();
        let model = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .byte_fallback(true)
            .build()
            .map_err(|e| inconsistent(format!("the byte vocabulary does not form a BPE model: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_decoder(Some(DecoderSequence::new(vec![ByteFallback::default().into(), Fuse::default().into()])));
        Ok(Tokenizer { inner, pad_id: 0, prefix: None, suffix: None, bos: None, eos: None, chat_template: None })
    }

    /// A `tokenizer.json` already in memory (errors name it `<memory>`).
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, TokenizeError> {
        Self::from_json(Path::new("<memory>"), bytes)
    }

    /// A `tokenizer.json` read from `path` into `bytes`.
    fn from_json(path: &Path, bytes: &[u8]) -> Result<Self, TokenizeError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TokenizeError::InvalidFile { path: path.into(), message: e.to_string() })?;
        let pad_id = inner.get_padding().map_or(0, |p| p.pad_id);
        inner.with_padding(None);
        Ok(Tokenizer { inner, pad_id, prefix: None, suffix: None, bos: None, eos: None, chat_template: None })
    }

    /// Builds the tokenizer a GGUF file describes in its metadata: vocabulary
    /// (`tokenizer.ggml.tokens`), merges, token types (control tokens such as `<|im_start|>`
    /// become special tokens that are never split), BOS/EOS/padding ids and whether to add
    /// BOS/EOS, the pre-tokenizer (`tokenizer.ggml.pre`) and the chat template.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self, TokenizeError> {
        let model = gguf
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| missing_or_bad(gguf, "tokenizer.ggml.model", "a string"))?;
        let kind = match model {
            "gpt2" => {
                let pre = gguf
                    .get_str("tokenizer.ggml.pre")
                    .ok_or_else(|| missing_or_bad(gguf, "tokenizer.ggml.pre", "a string"))?;
                let split = PRE_TOKENIZERS
                    .iter()
                    .find(|(name, _)| *name == pre)
                    .map(|&(_, split)| split)
                    .ok_or_else(|| TokenizeError::UnsupportedPreTokenizer { pre: pre.to_string() })?;
                GgufModel::ByteLevel(split)
            }
            "llama" => GgufModel::SentencePiece,
            _ => return Err(TokenizeError::UnsupportedModel { model: model.to_string() }),
        };
        let tokens = gguf
            .get_array_str("tokenizer.ggml.tokens")
            .ok_or_else(|| missing_or_bad(gguf, "tokenizer.ggml.tokens", "an array of strings"))?;
        let types = match gguf.get("tokenizer.ggml.token_type") {
            None => None,
            Some(value) => {
                let types = value
                    .as_array()
                    .and_then(|a| a.as_i32())
                    .ok_or(TokenizeError::BadKey { key: "tokenizer.ggml.token_type", expected: "an array of int32" })?;
                if types.len() != tokens.len() {
                    return Err(inconsistent(format!("{} token types for {} tokens", types.len(), tokens.len())));
                }
                Some(types)
            }
        };
        let id = |key: &'static str| -> Result<Option<u32>, TokenizeError> {
            match gguf.get(key) {
                None => Ok(None),
                Some(_) => {
                    let id = gguf.get_u32(key).ok_or(TokenizeError::BadKey { key, expected: "a token id" })?;
                    if id as usize >= tokens.len() {
                        return Err(inconsistent(format!("`{key}` = {id} is outside the {} tokens", tokens.len())));
                    }
                    Ok(Some(id))
                }
            }
        };
        let flag = |key: &'static str, default: bool| -> Result<bool, TokenizeError> {
            match gguf.get(key) {
                None => Ok(default),
                Some(v) => v.as_bool().ok_or(TokenizeError::BadKey { key, expected: "a bool" }),
            }
        };
        let (bos, eos) = (id("tokenizer.ggml.bos_token_id")?, id("tokenizer.ggml.eos_token_id")?);
        let pad = id("tokenizer.ggml.padding_token_id")?;
        // llama.cpp's defaults where the key is absent: SentencePiece vocabularies add BOS and
        // the prefix space, byte-level ones neither.
        let is_sentencepiece = kind == GgufModel::SentencePiece;
        let prefix = if flag("tokenizer.ggml.add_bos_token", is_sentencepiece)? {
            Some(bos.ok_or_else(|| inconsistent("`add_bos_token` is set but there is no `bos_token_id`".into()))?)
        } else {
            None
        };
        let suffix = if flag("tokenizer.ggml.add_eos_token", false)? {
            Some(eos.ok_or_else(|| inconsistent("`add_eos_token` is set but there is no `eos_token_id`".into()))?)
        } else {
            None
        };
        let chat_template = match gguf.get("tokenizer.chat_template") {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or(TokenizeError::BadKey { key: "tokenizer.chat_template", expected: "a string" })?
                    .to_string(),
            ),
        };

        let (mut inner, vocab) = match kind {
            GgufModel::ByteLevel(split) => {
                let merges = gguf
                    .get_array_str("tokenizer.ggml.merges")
                    .ok_or_else(|| missing_or_bad(gguf, "tokenizer.ggml.merges", "an array of strings"))?;
                let mut inner = tokenizers::Tokenizer::new(bpe(tokens, merges)?);
                let byte_level = ByteLevel::new(false, true, true);
                let pre_tokenizer: PreTokenizerWrapper = match split {
                    PreSplit::Gpt2 => byte_level.into(),
                    PreSplit::DigitsThenGpt2 => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
                };
                inner.with_pre_tokenizer(Some(pre_tokenizer));
                inner.with_decoder(Some(ByteLevel::default()));
                (inner, tokens.to_vec())
            }
            GgufModel::SentencePiece => {
                let unk = id("tokenizer.ggml.unknown_token_id")?;
                let space_prefix = flag("tokenizer.ggml.add_space_prefix", true)?;
                sentencepiece(tokens, unk, space_prefix)?
            }
        };

        // Control tokens (and BOS/EOS even without types) are special: matched whole before the
        // text is split, so `<|im_start|>` is one id. User-defined tokens are matched whole too,
        // as written in the text (a SentencePiece token respelled with `▁` cannot be written so
        // and is left to the model's merges).
        let mut special: BTreeSet<u32> = [bos, eos].into_iter().flatten().collect();
        let mut user_defined = Vec::new();
        // `types` has one entry per token (checked above).
        for (i, ((&ty, token), spelled)) in types.unwrap_or_default().iter().zip(tokens).zip(&vocab).enumerate() {
            match ty {
                TOKEN_TYPE_CONTROL => {
                    special.insert(i as u32);
                }
                TOKEN_TYPE_USER_DEFINED if token == spelled => {
                    user_defined.push(AddedToken::from(token.clone(), false));
                }
                _ => {}
            }
        }
        let special = special
            .iter()
            .map(|&i| {
                let token = vocab
                    .get(i as usize)
                    .ok_or_else(|| inconsistent(format!("special token {i} is outside the {} tokens", tokens.len())))?;
                Ok(AddedToken::from(token.clone(), true))
            })
            .collect::<Result<Vec<_>, TokenizeError>>()?;
        inner.add_special_tokens(special).map_err(tokenizers_error)?;
        inner.add_tokens(user_defined).map_err(tokenizers_error)?;

        let pad_id = pad.or(eos).unwrap_or(0);
        Ok(Tokenizer { inner, pad_id, prefix, suffix, bos, eos, chat_template })
    }

    /// Truncates every encoded text to at most `max_len` ids, special tokens included (a
    /// model's `max_positions`).
    pub fn with_max_len(mut self, max_len: usize) -> Result<Self, TokenizeError> {
        // `tokenizers` leaves room for what its post-processor adds; kiln's own BOS/EOS need theirs.
        let ours = usize::from(self.prefix.is_some()) + usize::from(self.suffix.is_some());
        let theirs = self.inner.get_post_processor().map_or(0, |p| p.added_tokens(false));
        let special = ours + theirs;
        if max_len <= special {
            return Err(TokenizeError::MaxLenTooSmall { max_len, special });
        }
        let params = TruncationParams { max_length: max_len - ours, ..TruncationParams::default() };
        self.inner.with_truncation(Some(params)).map_err(tokenizers_error)?;
        Ok(self)
    }

    /// The number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token (a vocabulary entry or an added token such as `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The beginning-of-sequence id (GGUF tokenizers).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id (GGUF tokenizers): generation stops there.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The id padding positions hold.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The chat template, if the tokenizer has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Sets the chat template (say, from a `tokenizer_config.json` next to a `tokenizer.json`).
    pub fn with_chat_template(mut self, template: impl Into<String>) -> Self {
        self.chat_template = Some(template.into());
        self
    }

    /// Encodes one text into ids and segment ids. `add_special_tokens` adds what the tokenizer
    /// adds around a text (`[CLS]`/`[SEP]`, a GGUF BOS); special tokens written in the text
    /// (`<|im_start|>`) are recognised either way.
    fn encode_with_types(&self, text: &str, add_special_tokens: bool) -> Result<(Vec<u32>, Vec<u32>), TokenizeError> {
        let encoding = self.inner.encode(text, add_special_tokens).map_err(tokenizers_error)?;
        let mut ids = encoding.get_ids().to_vec();
        let mut types = encoding.get_type_ids().to_vec();
        if add_special_tokens {
            if let Some(prefix) = self.prefix {
                ids.insert(0, prefix);
                types.insert(0, 0);
            }
            if let Some(suffix) = self.suffix {
                ids.push(suffix);
                types.push(0);
            }
        }
        Ok((ids, types))
    }

    /// Encodes one text into ids (a prompt). `add_special_tokens` adds what the tokenizer adds
    /// around a text (`[CLS]`/`[SEP]`, a GGUF BOS); special tokens written in the text
    /// (`<|im_start|>`) are recognised either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.encode_with_types(text, add_special_tokens)?.0)
    }

    /// Encodes a text of any length into ids, without special tokens and without truncation
    /// (a training corpus, which a `tokenizer.json`'s truncation or [`with_max_len`](Self::with_max_len)
    /// would cut short).
    pub fn encode_untruncated(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        if self.inner.get_truncation().is_none() {
            return self.encode(text, false);
        }
        let mut inner = self.inner.clone();
        inner.with_truncation(None).map_err(tokenizers_error)?;
        Ok(inner.encode(text, false).map_err(tokenizers_error)?.get_ids().to_vec())
    }

    /// Encodes texts with their special tokens, truncated as [`with_max_len`](Self::with_max_len)
    /// says and padded on the right to the longest.
    pub fn encode_batch<S: AsRef<str>>(&self, texts: &[S]) -> Result<Batch, TokenizeError> {
        let encoded = texts.iter().map(|t| self.encode_with_types(t.as_ref(), true)).collect::<Result<Vec<_>, _>>()?;
        let seq = encoded.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0);
        let cells = texts.len() * seq;
        let mut batch = Batch {
            batch: texts.len(),
            seq,
            input_ids: Vec::with_capacity(cells),
            attention_mask: Vec::with_capacity(cells),
            token_type_ids: Vec::with_capacity(cells),
        };
        for (ids, types) in &encoded {
            let pad = seq - ids.len();
            batch.input_ids.extend(ids.iter().map(|&id| i64::from(id)));
            batch.input_ids.extend(std::iter::repeat_n(i64::from(self.pad_id), pad));
            batch.attention_mask.extend(std::iter::repeat_n(1, ids.len()));
            batch.attention_mask.extend(std::iter::repeat_n(0, pad));
            batch.token_type_ids.extend(types.iter().map(|&t| i64::from(t)));
            batch.token_type_ids.extend(std::iter::repeat_n(0, pad));
        }
        Ok(batch)
    }

    /// Decodes ids into text. Special tokens (`<|im_end|>`) are written out unless
    /// `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizeError> {
        self.check_ids(ids)?;
        self.inner.decode(ids, skip_special_tokens).map_err(tokenizers_error)
    }

    /// A decoder that takes one id at a time and returns the text it completes (for printing
    /// tokens as a model generates them).
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream { tokenizer: self, inner: self.inner.decode_stream(skip_special_tokens) }
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizeError> {
        let vocab = self.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(&id) => Err(TokenizeError::UnknownId { id, vocab }),
            None => Ok(()),
        }
    }

    /// Renders a conversation with the chat template, as transformers' `apply_chat_template`
    /// does: Jinja with `trim_blocks` and `lstrip_blocks`, the variables `messages` (each with
    /// `role` and `content`), `add_generation_prompt`, `bos_token` and `eos_token`, and a
    /// `raise_exception(message)` function.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let source = self.chat_template.as_deref().ok_or(TokenizeError::NoChatTemplate)?;
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        env.add_function("raise_exception", raise_exception);
        let template = env.template_from_str(source).map_err(template_error)?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from(BTreeMap::from([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ]))
            })
            .collect();
        let token = |id: Option<u32>| id.and_then(|id| self.id_to_token(id)).unwrap_or_default();
        let context = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => token(self.bos),
            eos_token => token(self.eos),
        };
        template.render(context).map_err(template_error)
    }
}

/// Incremental decoding: [`step`](Self::step) takes the next id and returns the text it
/// completes. Byte-level tokens can end inside a UTF-8 character; such an id returns `None` and
/// its bytes come out with the id that completes the character.
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    inner: tokenizers::DecodeStream<
        'a,
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >,
}

impl DecodeStream<'_> {
    /// Decodes one more id: the new text, or `None` while it ends inside a character.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TokenizeError> {
        self.tokenizer.check_ids(&[id])?;
        self.inner.step(id).map_err(tokenizers_error)
    }
}

/// Token to id; a repeated token keeps its first id, as llama.cpp's lookup does.
fn vocab(tokens: &[String]) -> Result<Vocab, TokenizeError> {
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (i, token) in tokens.iter().enumerate() {
        let id = u32::try_from(i).map_err(|_| inconsistent(format!("{} tokens do not fit u32 ids", tokens.len())))?;
        vocab.entry(token.clone()).or_insert(id);
    }
    Ok(vocab)
}

/// The BPE model of a vocabulary and its merges (`"left right"`, highest priority first).
fn bpe(tokens: &[String], merges: &[String]) -> Result<BPE, TokenizeError> {
    let vocab = vocab(tokens)?;
    let pairs = merges
        .iter()
        .enumerate()
        .map(|(i, merge)| match merge.split_once(' ') {
            Some((left, right)) if !left.is_empty() && !right.is_empty() && !right.contains(' ') => {
                Ok((left.to_string(), right.to_string()))
            }
            _ => Err(inconsistent(format!("merge {i} `{merge}` is not two tokens separated by one space"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .build()
        .map_err(|e| inconsistent(format!("vocabulary and merges do not form a BPE model: {e}")))
}

/// The SentencePiece BPE tokenizer of a GGUF vocabulary (`tokenizer.ggml.model = "llama"`), and
/// the vocabulary as it spells the tokens.
///
/// SentencePiece writes a space as `▁` (the normalizer replaces them; with `space_prefix`, as
/// `tokenizer.ggml.add_space_prefix` asks, one is put before the text, and the decoder strips it
/// again), falls back to the `<0xAB>` tokens for bytes no piece covers, and merges pairs of
/// adjacent pieces by priority. GGUF files carry no merges for this model, so they are recovered
/// from the vocabulary: every token splits into each pair of tokens that spell it, and a merge's
/// priority is its result's position in the vocabulary, earlier first. SentencePiece's BPE
/// trainer stores pieces in the order it made them, so this is the training order; the scores
/// are that order too for ordinary pieces, but not for control and user-defined ones, which carry
/// placeholder scores (Gemma's carry -1000, also where its multi-space pieces are concerned), so
/// positions are the reliable key. Several splits of one token: the longer left piece first.
/// Tokens made only of spaces are stored with real spaces by llama.cpp's converter but are
/// reached through `▁`s, so they are respelled. (transformers' GGUF loader builds Gemma's
/// tokenizer the same way.)
fn sentencepiece(
    tokens: &[String],
    unk: Option<u32>,
    space_prefix: bool,
) -> Result<(tokenizers::Tokenizer, Vec<String>), TokenizeError> {
    const SPACE: &str = "\u{2581}";
    let spelled: Vec<String> = tokens
        .iter()
        .map(|t| if !t.is_empty() && t.chars().all(|c| c == ' ') { SPACE.repeat(t.chars().count()) } else { t.clone() })
        .collect();
    let vocab = vocab(&spelled)?;
    // (priority, left, right): every split of a token into two tokens.
    let mut merges: Vec<(u32, &str, &str)> = Vec::new();
    for (i, token) in spelled.iter().enumerate() {
        // A repeated token merges only under its first id.
        let Some(&id) = vocab.get(token) else { continue };
        if id as usize != i {
            continue;
        }
        for (at, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                merges.push((id, left, right));
            }
        }
    }
    // Earlier result first; for one result, the longer left piece first (the sort is stable, and
    // the splits of a token were pushed shortest left first).
    merges.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
    let merges = merges.into_iter().map(|(_, l, r)| (l.to_string(), r.to_string())).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(token) = unk.and_then(|u| spelled.get(u as usize)) {
        builder = builder.unk_token(token.clone());
    }
    let model = builder.build().map_err(|e| inconsistent(format!("the vocabulary does not form a BPE model: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(model);
    let replace = Replace::new(" ", SPACE).map_err(tokenizers_error)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE, " ").map_err(tokenizers_error)?.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    if space_prefix {
        inner
            .with_normalizer(Some(NormalizerSequence::new(vec![Prepend::new(SPACE.into()).into(), replace.into()])))
            .map_err(tokenizers_error)?;
        decoders.push(Strip::new(' ', 1, 0).into());
    } else {
        inner.with_normalizer(Some(replace)).map_err(tokenizers_error)?;
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok((inner, spelled))
}

fn inconsistent(message: String) -> TokenizeError {
    TokenizeError::Inconsistent { message }
}

/// `MissingKey` when the file lacks `key`, `BadKey` when its value has another type.
fn missing_or_bad(gguf: &Gguf, key: &'static str, expected: &'static str) -> TokenizeError {
    if gguf.get(key).is_some() { TokenizeError::BadKey { key, expected } } else { TokenizeError::MissingKey { key } }
}

fn template_error(e: minijinja::Error) -> TokenizeError {
    // minijinja's message names the kind, the detail and the template line.
    TokenizeError::Template { message: e.to_string() }
}

/// `raise_exception(message)`, which HF chat templates call to reject a conversation.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_tokenizer_reads_and_writes_utf8_bytes() {
        let t = Tokenizer::bytes().unwrap();
        let text = "ROMEO: Ünïcödé, 東京!\n\tend";
        let ids = t.encode(text, true).unwrap();
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        let mut stream = t.decode_stream(false);
        let streamed: String = ids.iter().filter_map(|&id| stream.step(id).unwrap()).collect();
        assert_eq!(streamed, text);
        assert_eq!(t.vocab_size(), 256);
    }

    #[test]
    fn every_pre_tokenizer_name_is_listed_once() {
        for (i, (a, _)) in PRE_TOKENIZERS.iter().enumerate() {
            assert!(PRE_TOKENIZERS[i + 1..].iter().all(|(b, _)| a != b), "{a} twice");
        }
    }

    #[test]
    fn merges_must_be_two_tokens() {
        let tokens: Vec<String> = ["a", "b", "ab"].iter().map(|s| s.to_string()).collect();
        assert!(bpe(&tokens, &["a b".to_string()]).is_ok());
        for bad in ["ab", "a  b", " a", "a b c"] {
            let err = bpe(&tokens, &[bad.to_string()]).unwrap_err();
            assert!(matches!(err, TokenizeError::Inconsistent { .. }), "{bad}: {err}");
        }
        let err = bpe(&tokens, &["a c".to_string()]).unwrap_err();
        assert!(err.to_string().contains("do not form a BPE model"), "{err}");
    }
}
