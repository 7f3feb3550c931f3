//! The real models' tokenizers against their references (`tests/fixtures/README.md`): MiniLM's
//! `tokenizer.json` gives sentence-transformers' padded batch, and SmolLM2's byte-level BPE,
//! rebuilt from its GGUF metadata, renders and tokenizes the chat prompt as transformers does and
//! decodes the greedy continuation to its text.

use crate::common;

use kiln_compiler::tensor::Tensor;
use kiln_runtime::tokenize::{Message, Tokenizer};
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path)
}

fn reference(model: &str) -> HashMap<String, Tensor> {
    kiln_runtime::read_tensors(&fixture(&format!("{model}/reference.safetensors"))).unwrap_or_else(|e| panic!("{e}"))
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.as_i64().expect("integer ids").iter().map(|&id| u32::try_from(id).expect("ids are u32")).collect()
}

fn minilm() -> Tokenizer {
    let path = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    Tokenizer::from_file(&path).and_then(|t| t.with_max_len(512)).unwrap_or_else(|e| panic!("{e}"))
}

fn smollm2() -> Tokenizer {
    let path = common::fetched("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
    Tokenizer::open(&path).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn minilm_batch_matches_sentence_transformers() {
    let sentences: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(fixture("minilm-l6/sentences.json")).unwrap()).unwrap();
    let batch = minilm().encode_batch(&sentences).unwrap_or_else(|e| panic!("{e}"));
    let expected = reference("minilm-l6");
    for (name, got) in batch.inputs() {
        assert_eq!(got, expected[&name], "minilm-l6: `{name}`");
    }
    assert_eq!((batch.batch, batch.seq), (4, 11));
}

#[test]
fn minilm_truncates_to_max_positions_keeping_sep() {
    let t = minilm();
    let word = i64::from(t.token_to_id("word").expect("`word` is in the vocabulary"));
    let long = "word ".repeat(600);
    let batch = t.encode_batch(&[long.as_str(), "short"]).unwrap();
    assert_eq!(batch.seq, 512);
    assert_eq!(batch.input_ids[..2], [101, word], "[CLS] word");
    assert_eq!(batch.input_ids[511], 102, "[SEP] ends the truncated sentence");
    assert_eq!(batch.attention_mask[512..].iter().sum::<i64>(), 3, "[CLS] short [SEP], then padding");
}

/// The conversation a ChatML prompt (`<|im_start|>role\ncontent<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` when a reply is asked for) was rendered from.
fn chatml_messages(prompt: &str) -> (Vec<Message>, bool) {
    let mut messages = Vec::new();
    let mut rest = prompt;
    while let Some(body) = rest.strip_prefix("<|im_start|>") {
        let Some((turn, after)) = body.split_once("<|im_end|>\n") else { break };
        let (role, content) = turn.split_once('\n').expect("a role line");
        messages.push(Message::new(role, content));
        rest = after;
    }
    let generation_prompt = rest == "<|im_start|>assistant\n";
    assert!(generation_prompt || rest.is_empty(), "not a ChatML prompt: {rest:?} left");
    (messages, generation_prompt)
}

#[test]
fn smollm2_chat_prompt_renders_and_tokenizes_as_transformers() {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2-135m/reference.json")).unwrap()).unwrap();
    let prompt = json["prompt"].as_str().expect("a prompt");
    let (messages, generation_prompt) = chatml_messages(prompt);
    assert_eq!(messages.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), ["system", "user"]);
    assert!(generation_prompt);

    let t = smollm2();
    assert_eq!(t.apply_chat_template(&messages, true).unwrap(), prompt);
    // The template adds its default system prompt (the reference's) when none is given.
    assert_eq!(t.apply_chat_template(&messages[1..], true).unwrap(), prompt);
    assert!(t.apply_chat_template(&messages, false).unwrap().ends_with("<|im_end|>\n"));

    let expected = ids(&reference("smollm2-135m")["prompt_ids"]);
    assert_eq!(t.encode(prompt, true).unwrap(), expected, "the GGUF asks for no BOS: the template writes it");
    assert_eq!(t.decode(&expected, false).unwrap(), prompt);
}

#[test]
fn smollm2_special_tokens_and_digits() {
    let t = smollm2();
    assert_eq!(t.encode("<|im_start|><|im_end|>", false).unwrap(), [1, 2]);
    assert_eq!((t.bos_id(), t.eos_id(), t.pad_id()), (Some(1), Some(2), 2));
    // llama.cpp's `smollm` pre-tokenizer splits numbers into single digits.
    let digits = t.encode("2025", false).unwrap();
    assert_eq!(digits.len(), 4);
    assert_eq!(t.decode(&digits[1..2], false).unwrap(), "0");
}

#[test]
fn smollm2_decodes_the_greedy_continuation_whole_and_streamed() {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2-135m/reference.json")).unwrap()).unwrap();
    let text = json["greedy_text"].as_str().expect("greedy text");
    let greedy = ids(&reference("smollm2-135m")["greedy_ids"]);
    let t = smollm2();
    assert_eq!(t.decode(&greedy, false).unwrap(), text);
    assert_eq!(t.decode(&greedy, true).unwrap(), text.trim_end_matches("<|im_end|>"));

    let mut stream = t.decode_stream(false);
    let streamed: String = greedy.iter().filter_map(|&id| stream.step(id).unwrap()).collect();
    assert_eq!(streamed, text);
}

#[test]
fn smollm2_streaming_holds_back_split_characters() {
    let t = smollm2();
    let text = "Crème brûlée, 東京, 🦀!";
    let ids = t.encode(text, false).unwrap();
    let mut stream = t.decode_stream(false);
    let steps: Vec<Option<String>> = ids.iter().map(|&id| stream.step(id).unwrap()).collect();
    assert!(steps.iter().any(Option::is_none), "some character spans several byte-level tokens: {ids:?}");
    assert_eq!(steps.into_iter().flatten().collect::<String>(), text);
}

fn gemma3() -> Tokenizer {
    let path = common::fetched("gemma3", "gemma3-270m", "gemma-3-270m-q4_k_m.gguf");
    Tokenizer::open(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// Gemma 3's SentencePiece vocabulary, rebuilt from its GGUF metadata: the prompt's ids and the
/// greedy continuation's text are the reference's.
#[test]
fn gemma3_prompt_and_greedy_text_match_the_reference() {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gemma3-270m/reference.json")).unwrap()).unwrap();
    let prompt = json["prompt"].as_str().expect("a prompt");
    let reference = reference("gemma3-270m");
    let t = gemma3();
    assert_eq!(t.encode(prompt, true).unwrap(), ids(&reference["prompt_ids"]), "BOS, then the prompt");
    assert_eq!((t.bos_id(), t.eos_id(), t.pad_id()), (Some(2), Some(1), 0));
    let greedy = ids(&reference["greedy_ids"]);
    assert_eq!(t.decode(&greedy, false).unwrap(), json["greedy_text"].as_str().expect("greedy text"));
    let mut stream = t.decode_stream(false);
    let streamed: String = greedy.iter().filter_map(|&id| stream.step(id).unwrap()).collect();
    assert_eq!(streamed, json["greedy_text"].as_str().unwrap());
}

/// Awkward texts (space runs, tabs, newlines, CJK, emoji through byte fallback, control
/// characters, a chat turn's control tokens) tokenize as transformers' GGUF tokenizer does
/// (`scripts/tokenizer-cases`), and decode back to themselves.
#[test]
fn gemma3_awkward_texts_match_transformers_and_round_trip() {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gemma3-270m/tokenizer-cases.json")).unwrap()).unwrap();
    let t = gemma3();
    let cases = json["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().expect("a text");
        let expected: Vec<u32> =
            case["ids"].as_array().expect("ids").iter().map(|id| id.as_u64().expect("an id") as u32).collect();
        let got = t.encode(text, true).unwrap();
        assert_eq!(got, expected, "{text:?}");
        assert_eq!(t.decode(&got[1..], false).unwrap(), text, "{text:?} decodes back");
    }
}
