//! `kiln serve` of an embedding model (the fetched all-MiniLM-L6-v2) as a client sees it, on
//! loopback: `/v1/embeddings` equal to `kiln embed`, OpenAI's input and output shapes (strings,
//! token ids, base64), its errors, concurrent requests embedded together in one forward pass
//! (and spread over several under a small token budget) equal to each alone, and the official
//! `openai` Python client.

use crate::common::{fetched, scratch};
use crate::serve::{Server, metric, post, request, start_with};
use serde_json::{Value, json};
use std::process::Command;

/// Starts `kiln serve minilm-l6 ARGS`.
fn minilm(name: &str, args: &[&str]) -> Server {
    fetched("minilm", "minilm-l6", "tokenizer.json");
    fetched("minilm", "minilm-l6", "model.safetensors");
    start_with(scratch(name), &["minilm-l6".to_string()], args)
}

/// `kiln embed minilm-l6 --json SENTENCES`: each sentence's embedding and token count.
fn embed(sentences: &[&str]) -> (Vec<Vec<f64>>, Vec<u64>) {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["embed", "minilm-l6", "--json", "--backend", "cpu", "--threads", "1"])
        .args(sentences)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json: Value = serde_json::from_slice(&o.stdout).unwrap();
    let items = json["embeddings"].as_array().unwrap();
    let vectors = items.iter().map(|e| floats(&e["embedding"])).collect();
    (vectors, items.iter().map(|e| e["tokens"].as_u64().unwrap()).collect())
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The vectors of an embeddings answer, checked to be OpenAI's shape and in input order.
fn vectors(answer: &Value) -> Vec<Vec<f64>> {
    assert_eq!(answer["object"], "list", "{answer}");
    assert_eq!(answer["model"], "minilm-l6", "{answer}");
    let data = answer["data"].as_array().unwrap();
    data.iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!((d["object"].as_str(), d["index"].as_u64()), (Some("embedding"), Some(i as u64)), "{d}");
            floats(&d["embedding"])
        })
        .collect()
}

fn close(a: &[Vec<f64>], b: &[Vec<f64>]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-5, "vectors differ by {worst}");
    }
}

/// Standard base64 (with padding) decoded.
fn unbase64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut out = Vec::new();
    for chunk in text.as_bytes().chunks(4) {
        let kept: Vec<u8> = chunk.iter().copied().filter(|&c| c != b'=').map(value).collect();
        let n = kept.iter().enumerate().fold(0u32, |n, (i, &v)| n | (u32::from(v) << (18 - 6 * i)));
        out.extend(n.to_be_bytes()[1..].iter().take(kept.len() - 1));
    }
    out
}

const SENTENCES: [&str; 3] =
    ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog, twice and then once more.", "Hi"];

#[test]
fn embeddings_equal_kiln_embed_in_openai_shapes_and_bad_inputs_are_named() {
    let server = minilm("serve-embed", &[]);
    let (expected, tokens) = embed(&SENTENCES);
    let (status, answer) = post(&server, "/v1/embeddings", &json!({"model": "anything", "input": SENTENCES}));
    assert_eq!(status, 200, "{answer}");
    close(&vectors(&answer), &expected);
    let total: u64 = tokens.iter().sum();
    assert_eq!(answer["usage"], json!({"prompt_tokens": total, "total_tokens": total}));
    // One string is one input; base64 is the same floats' little-endian bytes.
    let (_, one) = post(&server, "/v1/embeddings", &json!({"input": SENTENCES[1]}));
    close(&vectors(&one), &expected[1..2]);
    let (_, b64) = post(&server, "/v1/embeddings", &json!({"input": SENTENCES, "encoding_format": "base64"}));
    let decoded: Vec<Vec<f64>> = b64["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let bytes = unbase64(d["embedding"].as_str().unwrap());
            bytes.chunks_exact(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect()
        })
        .collect();
    close(&decoded, &expected);
    // Token ids, one array or several, run as given; `dimensions` equal to the model's is taken.
    let (status, ids) =
        post(&server, "/v1/embeddings", &json!({"input": [[101, 7632, 102], [101, 102]], "dimensions": 384}));
    assert_eq!(status, 200, "{ids}");
    assert_eq!(vectors(&ids).iter().map(Vec::len).collect::<Vec<_>>(), [384, 384]);
    assert_eq!(ids["usage"]["prompt_tokens"], 5);
    let (_, single) = post(&server, "/v1/embeddings", &json!({"input": [101, 7632, 102]}));
    close(&vectors(&single), &vectors(&ids)[..1]);
    for (body, param, says) in [
        (json!({"model": "m"}), "input", "missing"),
        (json!({"input": []}), "input", "empty array"),
        (json!({"input": ""}), "input", "empty string"),
        (json!({"input": 7}), "input", "must be a string"),
        (json!({"input": ["a", {"text": "b"}]}), "input", "must be a string"),
        (json!({"input": [1, 2.5]}), "input", "integers"),
        (json!({"input": [[1, 99999999]]}), "input", "outside the model's vocabulary"),
        (json!({"input": "a", "dimensions": 128}), "dimensions", "384"),
        (json!({"input": "a", "encoding_format": "int8"}), "encoding_format", "base64"),
    ] {
        let (status, e) = post(&server, "/v1/embeddings", &body);
        assert_eq!(status, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    // An embedding model generates no text.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let (status, e) = post(&server, path, &json!({"messages": [{"role": "user", "content": "Hi"}], "prompt": "x"}));
        assert_eq!(status, 400, "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("does not generate text"), "{e}");
    }
    assert_eq!(metric(&server, "kiln_requests_total{endpoint=\"embeddings\"}"), 14.0);
    assert_eq!(metric(&server, "kiln_prompt_tokens_total"), (2 * total + tokens[1] + 8) as f64);
}

/// Requests of several inputs each: every answer is the same alone and together.
fn requests() -> Vec<Vec<String>> {
    (0..10)
        .map(|r| {
            (0..1 + r % 4)
                .map(|i| {
                    format!("Request {r} asks about item {i}: {}", "and then some more words ".repeat(1 + (r + i) % 5))
                })
                .collect()
        })
        .collect()
}

#[test]
fn concurrent_embedding_requests_are_embedded_together_and_equal_each_alone() {
    let server = minilm("serve-embed-batch", &[]);
    let requests = requests();
    let alone: Vec<Vec<Vec<f64>>> =
        requests.iter().map(|r| vectors(&post(&server, "/v1/embeddings", &json!({"input": r})).1)).collect();
    assert_eq!(metric(&server, "kiln_embedding_batch_requests_sum"), 10.0);
    // All at once, until some forward pass embedded inputs of more than one request.
    let mut rounds = 0;
    while metric(&server, "kiln_embedding_batch_requests_sum") == metric(&server, "kiln_embedding_batch_requests_count")
    {
        rounds += 1;
        assert!(rounds <= 5, "no two requests were ever embedded together:\n{}", server.log.lock().unwrap());
        let together: Vec<Vec<Vec<f64>>> = std::thread::scope(|s| {
            let server = &server;
            let handles: Vec<_> = requests
                .iter()
                .map(|r| s.spawn(move || vectors(&post(server, "/v1/embeddings", &json!({"input": r})).1)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (a, b) in alone.iter().zip(&together) {
            close(a, b);
        }
    }
    // A budget of a few inputs: a request's inputs are spread over passes, and equal all the same.
    let small = minilm("serve-embed-budget", &["--embed-batch-tokens", "40"]);
    let many: Vec<String> = requests.concat();
    let (status, answer) = post(&small, "/v1/embeddings", &json!({"input": many}));
    assert_eq!(status, 200, "{answer}");
    close(&vectors(&answer), &alone.concat());
    assert!(metric(&small, "kiln_embedding_batch_requests_count") > 3.0);
}

#[test]
fn embedding_requests_past_the_queue_get_503_with_retry_after() {
    let server = minilm("serve-embed-queue", &["--queue", "0"]);
    let (status, head, body) = request(&server, "POST", "/v1/embeddings", &[], r#"{"input": "Hi"}"#);
    assert_eq!(status, 503, "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    assert!(body.contains("at capacity"), "{body}");
    assert_eq!(metric(&server, "kiln_requests_rejected_total"), 1.0);
}

#[test]
fn the_official_openai_client_embeds_unchanged() {
    let has_client = Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    assert!(has_client, "the `openai` Python package is missing: scripts/test installs it");
    let server = minilm("serve-embed-openai", &["--api-key", "k"]);
    let script = r#"
import sys, openai
client = openai.OpenAI(base_url=f"http://{sys.argv[1]}/v1", api_key="k", max_retries=0)
# The client asks for base64 unless told otherwise, and decodes it.
got = client.embeddings.create(model="minilm-l6", input=["The cat sits on the mat.", "Hi"])
floats = client.embeddings.create(model="minilm-l6", input=["The cat sits on the mat.", "Hi"], encoding_format="float")
assert [d.index for d in got.data] == [0, 1] and len(got.data[0].embedding) == 384, got
assert all(abs(a - b) < 1e-6 for x, y in zip(got.data, floats.data) for a, b in zip(x.embedding, y.embedding))
assert got.usage.prompt_tokens == got.usage.total_tokens > 0, got.usage
one = client.embeddings.create(model="minilm-l6", input="Hi")
assert all(abs(a - b) < 1e-5 for a, b in zip(one.data[0].embedding, got.data[1].embedding))
try:
    client.embeddings.create(model="minilm-l6", input="Hi", dimensions=64)
    raise SystemExit("no error")
except openai.BadRequestError as e:
    assert e.body["param"] == "dimensions", e.body
print("ok")
"#;
    let o = Command::new("python3").args(["-c", script, &server.addr]).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.trim() == "ok", "{out}\n{err}\nserver:\n{}", server.log.lock().unwrap());
}
