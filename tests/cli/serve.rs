//! `kiln serve` as a client sees it, on loopback: the OpenAI API's answers and errors, greedy
//! answers under concurrency equal to each request alone, a client leaving mid-stream, capacity,
//! the API key, SIGTERM, and the official `openai` Python client unchanged.

use crate::common::{root, scratch};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `kiln serve`, killed when dropped; `log` collects its stderr.
pub(crate) struct Server {
    child: Child,
    pub(crate) addr: String,
    pub(crate) log: Arc<Mutex<String>>,
    _dir: std::path::PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small random decoder with a 256-token vocabulary, read through the byte tokenizer, with a
/// chat template; `max_positions` long. A long context makes it 4 times as wide, so that a
/// request for most of it runs for seconds (~1 ms a token) while a test acts beside it.
fn tiny(dir: &std::path::Path, max_positions: usize) -> Vec<String> {
    let mut spec = std::fs::read_to_string(root().join("models/llama.toml"))
        .unwrap()
        .replace("vocab = 128", "vocab = 256")
        .replace("max_positions = 64", &format!("max_positions = {max_positions}"));
    if max_positions > 1024 {
        spec = spec.replace("d_model = 64", "d_model = 256").replace("d_ff = 176", "d_ff = 704");
    }
    std::fs::write(dir.join("tiny.toml"), spec).unwrap();
    let template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}\
                    {% if add_generation_prompt %}<assistant>{% endif %}";
    std::fs::write(dir.join("chat.jinja"), template).unwrap();
    let s = |p: &str| dir.join(p).to_string_lossy().into_owned();
    vec![
        s("tiny.toml"),
        "--random-weights".into(),
        "--tokenizer".into(),
        "bytes".into(),
        "--chat-template".into(),
        s("chat.jinja"),
    ]
}

/// Starts `kiln serve` on [`tiny`] with ARGS (see [`start_with`]).
fn start(name: &str, max_positions: usize, args: &[&str]) -> Server {
    let dir = scratch(name);
    let model = tiny(&dir, max_positions);
    start_with(dir, &model, args)
}

/// Starts `kiln serve MODEL ARGS` (the model and its arguments in `model`) on a free port (on
/// the CPU back end, one thread, unless ARGS name a backend), and waits until `/health` says
/// ready; `dir` holds its files.
pub(crate) fn start_with(dir: std::path::PathBuf, model: &[String], args: &[&str]) -> Server {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kiln"));
    command.arg("serve").args(model).args(["--port", "0"]);
    if !args.contains(&"--backend") {
        command.args(["--backend", "cpu", "--threads", "1"]);
    }
    command.args(args).env_remove("KILN_API_KEY").stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = command.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let log = Arc::new(Mutex::new(String::new()));
    let mut addr = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        log.lock().unwrap().push_str(&format!("{line}\n"));
        if let Some(at) = line.find("http://") {
            addr = Some(line[at + 7..].split('/').next().unwrap().to_string());
            break;
        }
    }
    let addr = addr.unwrap_or_else(|| panic!("kiln serve printed no address:\n{}", log.lock().unwrap()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            sink.lock().unwrap().push_str(&format!("{line}\n"));
        }
    });
    let server = Server { child, addr, log, _dir: dir };
    let t = Instant::now();
    while get(&server, "/health").0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(60), "never ready:\n{}", server.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// One HTTP/1.1 request (`Connection: close`): the status, the headers and the body.
pub(crate) fn request(
    server: &Server,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", server.addr);
    for h in headers {
        head += &format!("{h}\r\n");
    }
    if !body.is_empty() {
        head += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    }
    s.write_all(format!("{head}\r\n{body}").as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    // A chunked body (a stream) is read as its chunks' data, sizes dropped.
    let body = match head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        true => dechunk(body),
        false => body.to_string(),
    };
    (status, head.to_string(), body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out += &rest[..n];
        body = &rest[n + 2..];
    }
    out
}

pub(crate) fn get(server: &Server, path: &str) -> (u16, String, String) {
    request(server, "GET", path, &[], "")
}

pub(crate) fn post(server: &Server, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (status, _, text) = request(server, "POST", path, &[], &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// The `data:` payloads of a stream.
fn events(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A metric's value in `/metrics`.
pub(crate) fn metric(server: &Server, name: &str) -> f64 {
    let (_, _, text) = get(server, "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// Waits (up to 10 s) for a metric to read `value`: a gauge follows an answer's last event by
/// a moment.
fn eventually(server: &Server, name: &str, value: f64) {
    let t = Instant::now();
    while metric(server, name) != value {
        assert!(t.elapsed() < Duration::from_secs(10), "{name} stays at {}, not {value}", metric(server, name));
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn user(text: &str) -> serde_json::Value {
    serde_json::json!([{"role": "user", "content": text}])
}

#[test]
fn the_openai_api_answers_and_refuses_bad_requests_with_its_error_shape() {
    let server = start("serve-api", 128, &["--max-body", "2KiB", "--name", "tiny-llama"]);
    let (status, _, models) = get(&server, "/v1/models");
    assert_eq!(status, 200);
    assert!(models.contains("\"id\":\"tiny-llama\""), "{models}");

    let (status, chat) = post(
        &server,
        "/v1/chat/completions",
        &serde_json::json!({"model": "x", "messages": user("Hi"), "max_tokens": 5}),
    );
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
    // `<user>Hi\n<assistant>`: 20 bytes, one token each.
    assert_eq!(chat["usage"], serde_json::json!({"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}));

    let body = serde_json::json!({"prompt": [72, 105], "max_tokens": 4, "logprobs": 2, "temperature": 0.8, "seed": 9});
    let (status, c) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4, "{c}");
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|v| v.as_f64().unwrap() < 0.0));
    assert!(lp["top_logprobs"].as_array().unwrap().iter().all(|t| t.as_object().unwrap().len() <= 2));
    // A seed repeats a sampled answer.
    assert_eq!(post(&server, "/v1/completions", &body).1["choices"], c["choices"]);
    // `logit_bias`: +100 makes `A` (byte 65) every token; -100 bans the greedy choice.
    let (_, a) = post(
        &server,
        "/v1/completions",
        &serde_json::json!({"prompt": "x", "max_tokens": 4, "logit_bias": {"65": 100}}),
    );
    assert_eq!(a["choices"][0]["text"], "AAAA", "{a}");
    let greedy = |bias: serde_json::Value| {
        let body = serde_json::json!({"prompt": [72, 105], "max_tokens": 1, "temperature": 0, "logprobs": 1, "logit_bias": bias});
        post(&server, "/v1/completions", &body).1["choices"][0]["logprobs"]["top_logprobs"][0].clone()
    };
    let first = greedy(serde_json::json!({}));
    let top = first.as_object().unwrap().keys().next().unwrap().clone();
    let id = top.as_bytes()[0];
    if top.len() == 1 {
        let banned = greedy(serde_json::json!({id.to_string(): -100}));
        assert!(!banned.as_object().unwrap().contains_key(&top), "{first} then {banned}");
    }

    // Streamed: the role, text chunks, the finish reason, usage, [DONE].
    let body = serde_json::json!({"messages": user("Hi"), "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}});
    let (status, head, text) = request(&server, "POST", "/v1/chat/completions", &[], &body.to_string());
    assert_eq!(status, 200);
    assert!(head.to_ascii_lowercase().contains("content-type: text/event-stream"), "{head}");
    let data = events(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    let finish: Vec<_> = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finish.len(), 1, "{text}");
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 3);

    // Errors: OpenAI's shape, the field named.
    for (path, body, status, param) in [
        ("/v1/chat/completions", serde_json::json!({"messages": user("Hi"), "temperature": 9}), 400, "temperature"),
        ("/v1/chat/completions", serde_json::json!({"messages": []}), 400, "messages"),
        ("/v1/chat/completions", serde_json::json!({"messages": user("Hi"), "max_tokens": 100000}), 400, "max_tokens"),
        ("/v1/completions", serde_json::json!({"prompt": "x".repeat(200)}), 400, "prompt"),
        ("/v1/completions", serde_json::json!({"prompt": [7, 999]}), 400, "prompt"),
        ("/v1/completions", serde_json::json!({"prompt": "x", "logit_bias": {"300": 1}}), 400, "logit_bias"),
        ("/v1/completions", serde_json::json!({"prompt": "x", "logit_bias": {"3": 101}}), 400, "logit_bias"),
        ("/v1/completions", serde_json::json!({"prompt": "x", "suffix": "y"}), 400, "suffix"),
        ("/v1/completions", serde_json::json!({"prompt": "x", "best_of": 2}), 400, "best_of"),
        (
            "/v1/chat/completions",
            serde_json::json!({"messages": user("Hi"), "response_format": {"type": "json_object"}}),
            400,
            "response_format",
        ),
        ("/v1/embeddings", serde_json::json!({"input": "x"}), 400, "model"),
    ] {
        let (got, e) = post(&server, path, &body);
        assert_eq!(got, status, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    let (status, _, e) = request(&server, "POST", "/v1/chat/completions", &[], "{not json");
    assert!(status == 400 && e.contains("not valid JSON"), "{status} {e}");
    let (status, _, e) =
        request(&server, "POST", "/v1/completions", &[], &format!("{{\"prompt\": \"{}\"}}", "x".repeat(4000)));
    assert!(status == 413 && e.contains("\"error\""), "{status} {e}");
    let (status, _, e) = get(&server, "/v2/anything");
    assert!(status == 404 && e.contains("not_found_error"), "{status} {e}");

    assert_eq!(metric(&server, "kiln_requests_total{endpoint=\"chat\"}"), 7.0);
    assert!(metric(&server, "kiln_generated_tokens_total") >= 16.0);
    assert!(metric(&server, "kiln_time_to_first_token_seconds_count") >= 4.0);
    eventually(&server, "kiln_running_sequences", 0.0);
}

/// Each request's completion, run alone, then all at once (with prompts prefilled in chunks of
/// 4 tokens between the others' steps, and the sequences past their prompts decoded together in
/// batched steps): greedy answers and their log probabilities are equal.
#[test]
fn greedy_answers_under_concurrency_equal_each_request_alone() {
    concurrent_equals_alone("serve-batch", 6, &["--parallel", "4", "--prefill-chunk", "4"]);
}

/// The same on wgpu (lavapipe in CI), whose caches stay on the device between steps and whose
/// batched steps run there too.
#[test]
fn greedy_answers_under_concurrency_equal_each_request_alone_on_wgpu() {
    if crate::common::gpu().is_none() {
        return;
    }
    concurrent_equals_alone("serve-batch-wgpu", 3, &["--parallel", "3", "--prefill-chunk", "4", "--backend", "wgpu"]);
}

fn concurrent_equals_alone(name: &str, requests: usize, args: &[&str]) {
    let server = Arc::new(start(name, 256, args));
    let bodies: Vec<serde_json::Value> = (0..requests)
        .map(|i| {
            let prompt = format!("Request {i}: {}", "the quick brown fox ".repeat(i + 1));
            serde_json::json!({"prompt": prompt, "max_tokens": 12 + 3 * i, "temperature": 0, "logprobs": 1})
        })
        .collect();
    let alone: Vec<serde_json::Value> =
        bodies.iter().map(|b| post(&server, "/v1/completions", b).1["choices"][0].clone()).collect();
    let together: Vec<serde_json::Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let server = server.clone();
                scope.spawn(move || post(&server, "/v1/completions", b).1["choices"][0].clone())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a["logprobs"]["token_logprobs"].as_array().unwrap().len(), 12 + 3 * i, "{a}");
        assert_eq!(a, t, "request {i} differs when served with the others");
    }
    // They did run together: some scheduler step advanced several sequences, and some model
    // step decoded several.
    let (_, _, text) = get(&server, "/metrics");
    let count = |line: &str| text.lines().find_map(|l| l.strip_prefix(line)).unwrap().parse::<u64>().unwrap();
    assert!(count("kiln_batch_size_bucket{le=\"1\"} ") < count("kiln_batch_size_count "), "{text}");
    let alone = count("kiln_decode_batch_size_bucket{le=\"1\"} ");
    assert!(alone < count("kiln_decode_batch_size_count "), "{text}");
}

/// A client that leaves mid-stream frees its sequence at once, and one queued behind it runs.
#[test]
fn a_client_leaving_mid_stream_frees_its_slot() {
    let server = start("serve-cancel", 8192, &["--parallel", "1", "--max-tokens-limit", "8000"]);
    let body = serde_json::json!({"prompt": "Once", "max_tokens": 8000, "stream": true});
    let mut s = TcpStream::connect(&server.addr).unwrap();
    let text = body.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let mut first = [0u8; 512];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("200 OK"));
    drop(s);
    let (status, c) = post(&server, "/v1/completions", &serde_json::json!({"prompt": "Hi", "max_tokens": 3}));
    assert_eq!(status, 200, "{c}");
    assert_eq!(metric(&server, "kiln_requests_cancelled_total"), 1.0);
    eventually(&server, "kiln_running_sequences", 0.0);
}

/// Past `--parallel` running and `--queue` waiting, a request gets 503 with Retry-After.
#[test]
fn requests_past_capacity_get_503_with_retry_after() {
    let server =
        Arc::new(start("serve-capacity", 8192, &["--parallel", "1", "--queue", "1", "--max-tokens-limit", "8000"]));
    // One running, one queued behind it.
    let mut running = TcpStream::connect(&server.addr).unwrap();
    let text = serde_json::json!({"prompt": "Once", "max_tokens": 8000, "stream": true}).to_string();
    write!(
        running,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let t = Instant::now();
    while metric(&server, "kiln_running_sequences") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the first request never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    let queued = {
        let server = server.clone();
        std::thread::spawn(move || {
            post(&server, "/v1/completions", &serde_json::json!({"prompt": "Hi", "max_tokens": 2}))
        })
    };
    let t = Instant::now();
    while metric(&server, "kiln_queue_depth") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the second request never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, head, body) =
        request(&server, "POST", "/v1/completions", &[], &serde_json::json!({"prompt": "Hi"}).to_string());
    assert_eq!(status, 503, "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    assert!(body.contains("at capacity"), "{body}");
    assert_eq!(metric(&server, "kiln_requests_rejected_total"), 1.0);
    // The running one leaves; the queued one is then answered.
    drop(running);
    let (status, c) = queued.join().unwrap();
    assert_eq!(status, 200, "{c}");
}

#[test]
fn an_api_key_is_required_where_set_and_beyond_loopback() {
    let server = start("serve-key", 128, &["--api-key", "sesame"]);
    assert_eq!(get(&server, "/health").0, 200, "health needs no key");
    let (status, _, e) = get(&server, "/v1/models");
    assert!(status == 401 && e.contains("authentication_error"), "{status} {e}");
    let (status, _, _) = request(&server, "GET", "/v1/models", &["Authorization: Bearer wrong"], "");
    assert_eq!(status, 401);
    let (status, _, _) = request(&server, "GET", "/metrics", &[], "");
    assert_eq!(status, 401);
    let (status, _, m) = request(&server, "GET", "/v1/models", &["Authorization: Bearer sesame"], "");
    assert!(status == 200 && m.contains("tiny"), "{m}");

    let dir = scratch("serve-open");
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("serve")
        .args(tiny(&dir, 128))
        .args(["--host", "0.0.0.0", "--port", "0"])
        .env_remove("KILN_API_KEY")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--host 0.0.0.0: serving beyond this machine needs --api-key"), "{err}");
}

/// SIGTERM stops taking requests, lets the one in flight end within `--drain-timeout`, and exits.
#[cfg(unix)]
#[test]
fn sigterm_drains_and_exits() {
    let mut server = start("serve-term", 8192, &["--drain-timeout", "1", "--max-tokens-limit", "8000"]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    let text = serde_json::json!({"prompt": "Once", "max_tokens": 8000, "stream": true}).to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let _ = s.read(&mut first).unwrap();
    // SAFETY: signalling a child process this test started and still owns.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "still running after SIGTERM:\n{}", server.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}:\n{}", server.log.lock().unwrap());
    // The stream ended with the server's error event, not silently.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(String::from_utf8_lossy(&rest).contains("shutting down"), "{}", String::from_utf8_lossy(&rest));
    assert!(TcpStream::connect(&server.addr).is_err(), "still accepting");
}

/// The official `openai` Python package, unchanged, against the server: chat and completions,
/// streamed and not, the model list, and a refused request raised as its `BadRequestError`.
#[test]
fn the_official_openai_client_works_unchanged() {
    let has_client = Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    assert!(has_client, "the `openai` Python package is missing: scripts/test installs it");
    let server = start("serve-openai", 256, &["--api-key", "k"]);
    let script = r#"
import sys, openai
client = openai.OpenAI(base_url=f"http://{sys.argv[1]}/v1", api_key="k", max_retries=0)
models = client.models.list()
assert [m.id for m in models.data] == ["tiny"], models
chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4, chat
parts = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
    max_tokens=4, stream=True, stream_options={"include_usage": True}))
assert parts[0].choices[0].delta.role == "assistant", parts
assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length", parts
assert parts[-1].usage.completion_tokens == 4, parts
done = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=1)
assert len(done.choices[0].logprobs.token_logprobs) == 3, done
streamed = "".join(p.choices[0].text for p in client.completions.create(model="tiny", prompt="Hello",
    max_tokens=3, temperature=0, stream=True))
assert streamed == done.choices[0].text, (streamed, done)
try:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=7)
    raise SystemExit("no error")
except openai.BadRequestError as e:
    assert e.body["param"] == "temperature", e.body
try:
    openai.OpenAI(base_url=f"http://{sys.argv[1]}/v1", api_key="wrong", max_retries=0).models.list()
    raise SystemExit("no error")
except openai.AuthenticationError:
    pass
print("ok")
"#;
    let o = Command::new("python3").args(["-c", script, &server.addr]).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.trim() == "ok", "{out}\n{err}\nserver:\n{}", server.log.lock().unwrap());
}

/// A client that never finishes its request's head is closed after `--header-timeout`, and
/// others are served meanwhile.
#[test]
fn a_stalled_client_is_closed_after_the_header_timeout() {
    let server = start("serve-slow", 128, &["--header-timeout", "1"]);
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le").unwrap();
    let (status, c) = post(&server, "/v1/completions", &serde_json::json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(status, 200, "{c}");
    let t = Instant::now();
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut rest = Vec::new();
    let read = slow.read_to_end(&mut rest);
    assert!(read.is_ok(), "not closed: {read:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "closed after {:?}", t.elapsed());
}

/// A client that reads nothing of its stream holds up no other: the model's thread never
/// waits on a client (each answer's events queue until its connection takes them).
#[test]
fn a_client_reading_nothing_holds_no_one_up() {
    let server = start("serve-deaf", 8192, &["--parallel", "2", "--max-tokens-limit", "8000"]);
    let mut deaf = TcpStream::connect(&server.addr).unwrap();
    let text = serde_json::json!({"prompt": "Once", "max_tokens": 8000, "stream": true}).to_string();
    write!(
        deaf,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let t = Instant::now();
    while metric(&server, "kiln_running_sequences") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the stream never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    for _ in 0..3 {
        let (status, c) = post(&server, "/v1/completions", &serde_json::json!({"prompt": "Hi", "max_tokens": 4}));
        assert_eq!(status, 200, "{c}");
    }
    eventually(&server, "kiln_running_sequences", 1.0);
    drop(deaf);
}

/// A request waits until the key/value cache its prompt and `max_tokens` may grow to fits the
/// budget beside the running ones, even with sequence slots free; one that could never fit is
/// refused. (The wide test model's cache is 2 KiB a token: 2 layers x keys and values x 2 heads
/// x 64 x f32.)
#[test]
fn requests_are_admitted_by_key_value_cache_budget() {
    let server = start("serve-budget", 8192, &["--parallel", "4", "--kv-cache", "10MiB", "--max-tokens-limit", "8000"]);
    // 8000 tokens need ~16 MiB: never.
    let (status, e) = post(&server, "/v1/completions", &serde_json::json!({"prompt": "Hi", "max_tokens": 8000}));
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "max_tokens");
    assert!(e["error"]["message"].as_str().unwrap().contains("--kv-cache"), "{e}");
    // ~8 MiB running; another ~3 MiB waits though three slots are free.
    let open = |max_tokens: usize| {
        let mut s = TcpStream::connect(&server.addr).unwrap();
        let text = serde_json::json!({"prompt": "Once", "max_tokens": max_tokens, "stream": true}).to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
            text.len()
        )
        .unwrap();
        s
    };
    let running = open(4000);
    let t = Instant::now();
    while metric(&server, "kiln_running_sequences") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the first never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    let waiting = open(1500);
    while metric(&server, "kiln_queue_depth") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the second never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(metric(&server, "kiln_running_sequences"), 1.0);
    assert_eq!(metric(&server, "kiln_kv_cache_budget_bytes"), 10.0 * 1024.0 * 1024.0);
    drop((running, waiting));
}

/// A request whose sequence fails mid-batch gets its error, in its stream, and the requests
/// decoding beside it finish as they would alone: the server serves on. The failure is a real
/// one: a GPT-2 whose position table overflows f32 at position 12 (its row at f32's largest
/// value, the token rows at ±1e37, which the layer norms scale back everywhere else), so a
/// sequence reaching that position gets NaN logits, which are refused (not sampled as some
/// token), while shorter ones never meet it.
#[test]
fn a_request_failing_mid_batch_fails_alone() {
    let dir = scratch("serve-fails-mid-batch");
    let spec = std::fs::read_to_string(root().join("models/gpt2.toml")).unwrap().replace("vocab = 128", "vocab = 256");
    std::fs::write(dir.join("gpt2.toml"), spec).unwrap();
    let mut tensors = kiln_runtime::read_tensors(&root().join("tests/fixtures/gpt2/model.safetensors")).unwrap();
    let d = tensors["transformer.wpe.weight"].shape[1];
    let wte = (0..256 * d).map(|i| if (i * 7 + i / d).is_multiple_of(3) { -1e37 } else { 1e37 }).collect();
    tensors.insert("transformer.wte.weight".into(), kiln_compiler::tensor::Tensor::f32(vec![256, d], wte));
    let wpe = &tensors["transformer.wpe.weight"];
    let mut rows = wpe.as_f32().unwrap().to_vec();
    rows[12 * d..13 * d].fill(f32::MAX);
    let wpe = kiln_compiler::tensor::Tensor::f32(wpe.shape.clone(), rows);
    tensors.insert("transformer.wpe.weight".into(), wpe);
    let weights = dir.join("overflowing.safetensors");
    kiln_runtime::write_tensors(&weights, &tensors.into_iter().collect::<Vec<_>>()).unwrap();
    let s = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let model = [s(&dir.join("gpt2.toml")), "--weights".into(), s(&weights), "--tokenizer".into(), "bytes".into()];
    let server = start_with(dir, &model, &[]);
    let body = |max: usize, stream: bool| serde_json::json!({"prompt": [1, 2, 3], "max_tokens": max, "temperature": 0, "stream": stream});
    let (status, alone) = post(&server, "/v1/completions", &body(8, false));
    assert_eq!(status, 200, "{alone}");
    // Together: the failing request streamed, four that stop short of position 12 beside it.
    let (failing, others) = std::thread::scope(|scope| {
        let failing = scope.spawn(|| request(&server, "POST", "/v1/completions", &[], &body(20, true).to_string()));
        let others: Vec<_> =
            (0..4).map(|_| scope.spawn(|| post(&server, "/v1/completions", &body(8, false)))).collect();
        (failing.join().unwrap(), others.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>())
    });
    let (status, _, stream) = failing;
    assert_eq!(status, 200, "{stream}");
    let data = events(&stream);
    let last: serde_json::Value = serde_json::from_str(data.last().unwrap()).unwrap();
    let message = last["error"]["message"].as_str().unwrap_or_else(|| panic!("no error at the end: {stream}"));
    assert!(message.contains("hold a NaN"), "{message}");
    // It streamed the tokens before position 12 first.
    assert!(data.len() > 2, "{stream}");
    for (status, answer) in &others {
        assert_eq!(*status, 200, "{answer}");
        assert_eq!(answer["choices"], alone["choices"], "{answer}");
    }
    assert_eq!(metric(&server, "kiln_requests_failed_total"), 1.0);
    // And it serves on.
    assert_eq!(post(&server, "/v1/completions", &body(8, false)).1["choices"], alone["choices"]);
}
