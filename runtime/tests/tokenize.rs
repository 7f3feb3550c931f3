//! Tokenizers built from hand-written GGUF metadata: byte-level BPE with its merges, special and
//! user-defined tokens, the pre-tokenizer's digit split, BOS/EOS, padding and truncation,
//! decoding (whole and streamed), chat templates, and one specific error for each kind of bad
//! input. The real models' tokenizers are checked against their references in the workspace's
//! `tests/engines/tokenize.rs`.

use kiln_runtime::tokenize::{Message, TokenizeError, Tokenizer};
use std::path::PathBuf;

mod support;
use support::Builder;

/// Byte-level symbols: `Ġ` is the space byte, `Ã` and `©` the two bytes of `é`.
const TOKENS: &[&str] =
    &["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab", "12", "<tool>", "Ã", "©"];
/// Normal tokens are 1, control tokens 3, user-defined tokens 4.
const TYPES: &[i32] = &[3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4, 1, 1];
const MERGES: &[&str] = &["a b", "Ġ ab", "1 2"];

/// A complete tokenizer's metadata with pre-tokenizer `pre`.
fn metadata(pre: &str) -> Builder {
    Builder::new()
        .kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str("tokenizer.ggml.pre", pre)
        .kv_strs("tokenizer.ggml.tokens", TOKENS)
        .kv_i32s("tokenizer.ggml.token_type", TYPES)
        .kv_strs("tokenizer.ggml.merges", MERGES)
        .kv_u32("tokenizer.ggml.bos_token_id", 1)
        .kv_u32("tokenizer.ggml.eos_token_id", 2)
}

fn build(b: &Builder) -> Result<Tokenizer, TokenizeError> {
    let gguf = b.parse().unwrap_or_else(|e| panic!("{e}"));
    Tokenizer::from_gguf(&gguf)
}

fn tokenizer(b: &Builder) -> Tokenizer {
    build(b).unwrap_or_else(|e| panic!("{e}"))
}

fn build_err(b: &Builder) -> TokenizeError {
    match build(b) {
        Ok(_) => panic!("the metadata should be rejected"),
        Err(e) => e,
    }
}

#[test]
fn merges_special_and_user_defined_tokens() {
    let t = tokenizer(&metadata("smollm"));
    assert_eq!(t.encode("ab ab", false).unwrap(), [8, 9]);
    // Control tokens are matched whole, before the text is split, and never merged with it.
    assert_eq!(t.encode("<|im_start|>ab<|im_end|>", false).unwrap(), [1, 8, 2]);
    assert_eq!(t.encode("ab<tool>", false).unwrap(), [8, 11]);
    assert_eq!((t.bos_id(), t.eos_id(), t.vocab_size()), (Some(1), Some(2), TOKENS.len()));
    assert_eq!(t.token_to_id("<|im_end|>"), Some(2));
}

#[test]
fn the_pre_tokenizer_decides_how_digits_split() {
    // llama.cpp's `smollm` splits every digit off before BPE; `gpt-2` keeps runs of digits.
    assert_eq!(tokenizer(&metadata("smollm")).encode("12", false).unwrap(), [6, 7]);
    assert_eq!(tokenizer(&metadata("gpt-2")).encode("12", false).unwrap(), [10]);
}

#[test]
fn decoding_whole_and_streamed() {
    let t = tokenizer(&metadata("smollm"));
    assert_eq!(t.decode(&[8, 9, 5], false).unwrap(), "ab ab ");
    assert_eq!(t.decode(&[1, 8, 2], false).unwrap(), "<|im_start|>ab<|im_end|>");
    assert_eq!(t.decode(&[1, 8, 2], true).unwrap(), "ab");
    assert_eq!(t.decode(&[12, 13], false).unwrap(), "é");

    let mut stream = t.decode_stream(false);
    let steps: Vec<Option<String>> = [8, 9, 12, 13, 2].iter().map(|&id| stream.step(id).unwrap()).collect();
    let expected = [Some("ab"), Some(" ab"), None, Some("é"), Some("<|im_end|>")];
    assert_eq!(steps, expected.map(|s| s.map(String::from)), "the first byte of `é` waits for the second");

    assert!(matches!(t.decode(&[8, 99], false), Err(TokenizeError::UnknownId { id: 99, vocab: 14 })));
    assert!(matches!(stream.step(99), Err(TokenizeError::UnknownId { id: 99, .. })));
}

#[test]
fn batches_are_padded_with_the_pad_id_and_masked() {
    let t = tokenizer(&metadata("smollm").kv_u32("tokenizer.ggml.padding_token_id", 0));
    let batch = t.encode_batch(&["ab", "ab ab ab"]).unwrap();
    assert_eq!((batch.batch, batch.seq), (2, 3));
    assert_eq!(batch.input_ids, [8, 0, 0, 8, 9, 9]);
    assert_eq!(batch.attention_mask, [1, 0, 0, 1, 1, 1]);
    assert_eq!(batch.token_type_ids, [0; 6]);
    let inputs = batch.inputs();
    assert_eq!(inputs["input_ids"].shape, [2, 3]);
    assert_eq!(inputs["attention_mask"].as_i64().unwrap(), batch.attention_mask.as_slice());
    // Without a padding id, EOS pads.
    assert_eq!(tokenizer(&metadata("smollm")).pad_id(), 2);
}

#[test]
fn bos_and_eos_are_added_when_the_metadata_asks_and_survive_truncation() {
    let b =
        metadata("smollm").kv_bool("tokenizer.ggml.add_bos_token", true).kv_bool("tokenizer.ggml.add_eos_token", true);
    let t = tokenizer(&b);
    assert_eq!(t.encode("ab", true).unwrap(), [1, 8, 2]);
    assert_eq!(t.encode("ab", false).unwrap(), [8]);
    let t = t.with_max_len(3).unwrap();
    assert_eq!(t.encode_batch(&["ab ab ab"]).unwrap().input_ids, [1, 8, 2]);
    let err = tokenizer(&b).with_max_len(2).unwrap_err();
    assert!(matches!(err, TokenizeError::MaxLenTooSmall { max_len: 2, special: 2 }), "{err}");
}

#[test]
fn chat_templates_render_like_transformers() {
    // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
    let template = "{% for m in messages %}\n  {% if m.role == 'system' %}\n[{{ m.content }}]\n  {% else %}\n\
                    {{ m.role }}: {{ m.content }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n\
                    {% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}";
    let t = tokenizer(&metadata("smollm").kv_str("tokenizer.chat_template", template));
    let messages = [Message::new("system", "be brief"), Message::new("user", "hi")];
    assert_eq!(t.apply_chat_template(&messages, false).unwrap(), "[be brief]\nuser: hi<|im_end|>\n");
    assert_eq!(
        t.apply_chat_template(&messages, true).unwrap(),
        "[be brief]\nuser: hi<|im_end|>\n<|im_start|>assistant:"
    );

    let raising =
        t.with_chat_template("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}");
    let err = raising.apply_chat_template(&messages, false).unwrap_err();
    assert!(matches!(&err, TokenizeError::Template { message } if message.contains("one message only")), "{err}");

    let broken = raising.with_chat_template("{% for m in messages %}");
    let err = broken.apply_chat_template(&messages, false).unwrap_err();
    assert!(matches!(&err, TokenizeError::Template { message } if message.contains("syntax error")), "{err}");

    let err = tokenizer(&metadata("smollm")).apply_chat_template(&messages, false).unwrap_err();
    assert!(matches!(err, TokenizeError::NoChatTemplate), "{err}");
}

#[test]
fn missing_metadata_is_named() {
    let err = build_err(&Builder::new().kv_str("general.architecture", "llama"));
    assert!(matches!(err, TokenizeError::MissingKey { key: "tokenizer.ggml.model" }), "{err}");
    assert_eq!(
        err.to_string(),
        "the GGUF file has no `tokenizer.ggml.model` metadata, so it carries no tokenizer kiln can build"
    );
    let no_pre = Builder::new().kv_str("tokenizer.ggml.model", "gpt2");
    assert!(matches!(build_err(&no_pre), TokenizeError::MissingKey { key: "tokenizer.ggml.pre" }));
    let no_tokens = no_pre.kv_str("tokenizer.ggml.pre", "smollm");
    assert!(matches!(build_err(&no_tokens), TokenizeError::MissingKey { key: "tokenizer.ggml.tokens" }));
    let no_merges = no_tokens.kv_strs("tokenizer.ggml.tokens", TOKENS);
    assert!(matches!(build_err(&no_merges), TokenizeError::MissingKey { key: "tokenizer.ggml.merges" }));
}

#[test]
fn unsupported_models_and_pre_tokenizers_are_named() {
    let unigram = Builder::new().kv_str("tokenizer.ggml.model", "t5");
    let err = build_err(&unigram);
    assert!(matches!(&err, TokenizeError::UnsupportedModel { model } if model == "t5"), "{err}");
    assert!(err.to_string().contains("`llama`, SentencePiece BPE"), "the message lists what kiln builds: {err}");
    let err = build_err(&metadata("qwen2"));
    assert!(matches!(&err, TokenizeError::UnsupportedPreTokenizer { pre } if pre == "qwen2"), "{err}");
    assert!(err.to_string().contains("`smollm`"), "the message lists the known names: {err}");
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`): spaces become `▁` (one put
/// before the text unless `add_space_prefix` is false), merges follow the tokens' order in the
/// vocabulary, a byte no piece covers falls back to its `<0xAB>` token, a token of spaces is
/// reached through `▁`s, BOS is added by default, and decoding undoes it all.
#[test]
fn sentencepiece_vocabularies_merge_in_vocabulary_order() {
    const SP_TOKENS: &[&str] =
        &["<unk>", "<s>", "</s>", "\u{2581}", "a", "b", "c", "ab", "\u{2581}c", "bc", "<0x21>", "  ", "<ctl>"];
    // Normal 1, unknown 2, control 3, byte 6.
    const SP_TYPES: &[i32] = &[2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 6, 1, 3];
    let sp = |prefix: Option<bool>| {
        let b = Builder::new()
            .kv_str("tokenizer.ggml.model", "llama")
            .kv_strs("tokenizer.ggml.tokens", SP_TOKENS)
            .kv_i32s("tokenizer.ggml.token_type", SP_TYPES)
            .kv_u32("tokenizer.ggml.bos_token_id", 1)
            .kv_u32("tokenizer.ggml.eos_token_id", 2)
            .kv_u32("tokenizer.ggml.unknown_token_id", 0);
        tokenizer(&match prefix {
            Some(p) => b.kv_bool("tokenizer.ggml.add_space_prefix", p),
            None => b,
        })
    };
    let t = sp(None);
    // "▁abc▁c": `ab` merges before `bc` (vocabulary order), then `▁c`.
    assert_eq!(t.encode("abc c", true).unwrap(), [1, 3, 7, 6, 8]);
    assert_eq!(t.decode(&[7, 6, 8], false).unwrap(), "abc c", "the prefix space is stripped again");
    // `!` is no piece: its byte token. `▁c` (id 8) merges before `▁▁` (id 11).
    assert_eq!(t.encode("a!", false).unwrap(), [3, 4, 10]);
    assert_eq!(t.encode("c  c", false).unwrap(), [8, 3, 8]);
    assert_eq!(t.decode(&[8, 3, 8, 10], false).unwrap(), "c  c!", "the prefix space is stripped");
    assert_eq!(t.encode("<ctl>a", false).unwrap(), [12, 3, 4], "control tokens are matched whole");
    // Without the prefix space (Gemma), the text starts as written.
    let t = sp(Some(false));
    assert_eq!(t.encode("abc c", true).unwrap(), [1, 7, 6, 8]);
    assert_eq!(t.decode(&[7, 6, 8], false).unwrap(), "abc c");
    // The two-space token, stored with real spaces, is reached through `▁▁`.
    assert_eq!(t.encode("a  b", false).unwrap(), [4, 11, 5]);
    assert_eq!(t.decode(&[4, 11, 5], false).unwrap(), "a  b");
}

#[test]
fn values_of_the_wrong_type_are_named() {
    let err = build_err(&Builder::new().kv_u32("tokenizer.ggml.model", 2));
    assert!(matches!(err, TokenizeError::BadKey { key: "tokenizer.ggml.model", .. }), "{err}");
    let b = Builder::new()
        .kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str("tokenizer.ggml.pre", "smollm")
        .kv_str("tokenizer.ggml.tokens", "a b");
    let err = build_err(&b);
    assert!(matches!(err, TokenizeError::BadKey { key: "tokenizer.ggml.tokens", expected: "an array of strings" }));
    let b = Builder::new()
        .kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str("tokenizer.ggml.pre", "smollm")
        .kv_strs("tokenizer.ggml.tokens", TOKENS)
        .kv_strs("tokenizer.ggml.merges", MERGES)
        .kv_strs("tokenizer.ggml.token_type", TOKENS);
    assert!(matches!(build_err(&b), TokenizeError::BadKey { key: "tokenizer.ggml.token_type", .. }));
}

#[test]
fn contradictory_metadata_is_explained() {
    let base = || {
        Builder::new()
            .kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str("tokenizer.ggml.pre", "smollm")
            .kv_strs("tokenizer.ggml.tokens", TOKENS)
    };
    let cases = [
        (
            base().kv_strs("tokenizer.ggml.merges", MERGES).kv_i32s("tokenizer.ggml.token_type", &[1, 1]),
            "2 token types for 14 tokens",
        ),
        (
            base().kv_strs("tokenizer.ggml.merges", MERGES).kv_u32("tokenizer.ggml.bos_token_id", 14),
            "`tokenizer.ggml.bos_token_id` = 14 is outside the 14 tokens",
        ),
        (
            base().kv_strs("tokenizer.ggml.merges", MERGES).kv_bool("tokenizer.ggml.add_bos_token", true),
            "`add_bos_token` is set but there is no `bos_token_id`",
        ),
        (
            base().kv_strs("tokenizer.ggml.merges", &["a b", "ab"]),
            "merge 1 `ab` is not two tokens separated by one space",
        ),
        (base().kv_strs("tokenizer.ggml.merges", &["a x"]), "do not form a BPE model"),
    ];
    for (b, needle) in cases {
        let err = build_err(&b);
        assert!(
            matches!(err, TokenizeError::Inconsistent { .. }) && err.to_string().contains(needle),
            "{needle}: {err}"
        );
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-tokenize-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn files_that_hold_no_tokenizer_are_refused() {
    let dir = scratch("files");
    let missing = dir.join("missing.json");
    let err = Tokenizer::open(&missing).unwrap_err();
    assert!(matches!(err, TokenizeError::Io { .. }) && err.to_string().contains("missing.json"), "{err}");
    assert!(matches!(Tokenizer::from_file(&missing), Err(TokenizeError::Io { .. })));

    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, b"{\"model\": 3}").unwrap();
    let err = Tokenizer::open(&garbage).unwrap_err();
    assert!(matches!(err, TokenizeError::InvalidFile { .. }) && err.to_string().contains("garbage.json"), "{err}");

    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, b"GGUF\x03\0\0\0").unwrap();
    let err = Tokenizer::open(&truncated).unwrap_err();
    assert!(matches!(err, TokenizeError::Gguf { .. }) && err.to_string().contains("truncated"), "{err}");

    let bare = dir.join("bare.gguf");
    std::fs::write(&bare, Builder::new().kv_str("general.architecture", "llama").bytes()).unwrap();
    assert!(matches!(Tokenizer::open(&bare), Err(TokenizeError::MissingKey { key: "tokenizer.ggml.model" })));

    let complete = dir.join("tokenizer.gguf");
    std::fs::write(&complete, metadata("smollm").bytes()).unwrap();
    assert_eq!(Tokenizer::open(&complete).unwrap().encode("ab", false).unwrap(), [8]);
}
