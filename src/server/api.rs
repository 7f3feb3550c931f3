//! The OpenAI API's shapes: a request's JSON read into a [`Request`] (every field checked, an
//! error naming the field), the errors' body (`{"error": {"message", "type", "param", "code"}}`),
//! and the answers, whole or as the chunks of a stream.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kiln_runtime::Message;
use serde_json::{Value, json};

/// A request refused: the status and OpenAI's error body.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    /// Seconds a client should wait before trying again (429/503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
            retry_after: None,
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None, retry_after: None }
    }

    /// OpenAI's `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "server_overloaded",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The error body (also sent as a stream's last event when a generation fails midway).
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        response
    }
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// What to generate after.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// A conversation, rendered with the model's chat template.
    Messages(Vec<Message>),
    /// Text, tokenized with the model's special tokens.
    Text(String),
    /// Token ids.
    Ids(Vec<i64>),
}

/// The sampling a request asks for; `None`: the server's default.
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Added to the logits of these token ids before sampling (OpenAI's `logit_bias`, -100 to
    /// 100; -100 bans a token).
    pub logit_bias: Vec<(i64, f32)>,
    pub seed: Option<u64>,
}

/// A generation request, checked.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came in (`max_completion_tokens` for a chat that used it).
    pub max_tokens_param: &'static str,
    pub sampling: Sampling,
    /// Stop strings (the text ends before the first).
    pub stop: Vec<String>,
    /// `Some(n)`: each token's log probability and the `n` most likely alternatives'.
    pub logprobs: Option<usize>,
    pub stream: bool,
    /// A stream ends with a chunk of usage counts (`stream_options.include_usage`).
    pub include_usage: bool,
}

/// The fields of an object, or the error saying the body is not one.
fn object(v: &Value) -> Result<&serde_json::Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "the request body must be a JSON object"))
}

/// Field `key`, absent when missing or `null`.
fn field<'a>(o: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn number(o: &serde_json::Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
            _ => Err(ApiError::invalid(key, format!("`{key}` must be a number from {lo} to {hi}, not {v}"))),
        },
    }
}

fn integer(o: &serde_json::Map<String, Value>, key: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::invalid(key, format!("`{key}` must be an integer from {lo} to {hi}, not {v}"))),
        },
    }
}

fn boolean(o: &serde_json::Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match field(o, key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(key, format!("`{key}` must be true or false, not {v}"))),
    }
}

/// A message's text: a string, or an array of `{"type": "text", "text": ...}` parts.
fn content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            &format!("{at}.content[{j}]"),
                            format!("a content part must be {{\"type\": \"text\", \"text\": ...}}, not {:?}", kind),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Some(v) => Err(ApiError::invalid(&format!("{at}.content"), format!("content must be a string, not {v}"))),
    }
}

impl Request {
    /// Reads a request to `endpoint` from its JSON body. `max_stop` limits the stop strings.
    pub fn parse(endpoint: Endpoint, body: &Value) -> Result<Request, ApiError> {
        let o = object(body)?;
        let prompt = match endpoint {
            Endpoint::Chat => Prompt::Messages(messages(o)?),
            Endpoint::Completions => completion_prompt(o)?,
        };
        if let Some(n) = integer(o, "n", 1, u64::MAX)?
            && n != 1
        {
            return Err(ApiError::invalid("n", format!("`n` = {n}: this server gives one choice per request")));
        }
        for key in ["tools", "functions"] {
            if field(o, key).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
                return Err(ApiError::invalid(key, format!("`{key}`: this server does not call tools")));
            }
        }
        if endpoint == Endpoint::Completions && boolean(o, "echo")? {
            return Err(ApiError::invalid("echo", "`echo`: this server does not echo the prompt"));
        }
        // What would change the answer and is not done here is refused, never ignored.
        if let Some(format) = field(o, "response_format")
            && format.get("type").and_then(Value::as_str) != Some("text")
        {
            return Err(ApiError::invalid(
                "response_format",
                format!("`response_format` {format}: only text is given"),
            ));
        }
        for key in ["suffix", "audio", "modalities", "prediction"] {
            let given = field(o, key).is_some_and(|v| match v {
                Value::String(s) => !s.is_empty(),
                Value::Array(a) => a.iter().any(|m| m != "text"),
                _ => true,
            });
            if given {
                return Err(ApiError::invalid(key, format!("`{key}` is not supported by this server")));
            }
        }
        if let Some(n) = integer(o, "best_of", 1, u64::MAX)?
            && n != 1
        {
            return Err(ApiError::invalid("best_of", format!("`best_of` = {n}: this server gives one choice")));
        }
        let max_key = match (endpoint, field(o, "max_completion_tokens")) {
            (Endpoint::Chat, Some(_)) => "max_completion_tokens",
            _ => "max_tokens",
        };
        let max_tokens = integer(o, max_key, 1, u64::MAX)?.map(|n| n as usize);
        let sampling = Sampling {
            temperature: number(o, "temperature", 0.0, 2.0)?,
            top_p: match number(o, "top_p", 0.0, 1.0)? {
                Some(p) if p <= 0.0 => return Err(ApiError::invalid("top_p", "`top_p` must be above 0")),
                p => p,
            },
            top_k: integer(o, "top_k", 0, u32::MAX as u64)?.map(|k| k as usize),
            repetition_penalty: match number(o, "repetition_penalty", 0.0, 10.0)? {
                Some(p) if p <= 0.0 => {
                    return Err(ApiError::invalid("repetition_penalty", "`repetition_penalty` must be above 0"));
                }
                p => p,
            },
            frequency_penalty: number(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
            presence_penalty: number(o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
            logit_bias: logit_bias(o)?,
            seed: match field(o, "seed") {
                None => None,
                Some(v) => Some(
                    v.as_i64()
                        .map(|s| s as u64)
                        .or_else(|| v.as_u64())
                        .ok_or_else(|| ApiError::invalid("seed", format!("`seed` must be an integer, not {v}")))?,
                ),
            },
        };
        let stop = match field(o, "stop") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => {
                a.iter().filter_map(Value::as_str).map(str::to_string).collect()
            }
            Some(v) => {
                return Err(ApiError::invalid("stop", format!("`stop` must be a string or up to 4 strings, not {v}")));
            }
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "a stop string must not be empty"));
        }
        let logprobs = match endpoint {
            Endpoint::Chat => match boolean(o, "logprobs")? {
                true => Some(integer(o, "top_logprobs", 0, 20)?.unwrap_or(0) as usize),
                false if field(o, "top_logprobs").is_some() => {
                    return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs`: true"));
                }
                false => None,
            },
            Endpoint::Completions => integer(o, "logprobs", 0, 5)?.map(|n| n as usize),
        };
        let stream = boolean(o, "stream")?;
        let include_usage = match field(o, "stream_options") {
            None => false,
            Some(options) if stream => options.get("include_usage").and_then(Value::as_bool).unwrap_or(false),
            Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` needs `stream`: true")),
        };
        Ok(Request { prompt, max_tokens, max_tokens_param: max_key, sampling, stop, logprobs, stream, include_usage })
    }
}

/// `logit_bias`: an object from token ids (as strings) to biases from -100 to 100.
fn logit_bias(o: &serde_json::Map<String, Value>) -> Result<Vec<(i64, f32)>, ApiError> {
    let Some(v) = field(o, "logit_bias") else { return Ok(Vec::new()) };
    let map = v.as_object().ok_or_else(|| {
        ApiError::invalid("logit_bias", format!("`logit_bias` must map token ids to biases, not {v}"))
    })?;
    map.iter()
        .map(|(id, bias)| {
            let id =
                id.parse::<i64>().ok().filter(|&i| i >= 0).ok_or_else(|| {
                    ApiError::invalid("logit_bias", format!("`logit_bias`: `{id}` is not a token id"))
                })?;
            match bias.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` of {id}: {bias} is not a number from -100 to 100"),
                )),
            }
        })
        .collect()
}

/// A chat request's `messages`.
fn messages(o: &serde_json::Map<String, Value>) -> Result<Vec<Message>, ApiError> {
    let list = field(o, "messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("messages", "`messages` must be an array of messages"))?;
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(&at, format!("{at} has no `role` string")))?;
            // A developer message is the system's, as the OpenAI API treats it for older models.
            let role = if role == "developer" { "system" } else { role };
            Ok(Message::new(role, content(m.get("content"), &at)?))
        })
        .collect()
}

/// A completion request's `prompt`: a string, token ids, or a list holding one of either.
fn completion_prompt(o: &serde_json::Map<String, Value>) -> Result<Prompt, ApiError> {
    let ids = |a: &[Value]| -> Option<Vec<i64>> { a.iter().map(Value::as_i64).collect() };
    match field(o, "prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            ids(a).map(Prompt::Ids).ok_or_else(|| ApiError::invalid("prompt", "token ids must be integers"))
        }
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(inner) if !inner.is_empty() => {
                ids(inner).map(Prompt::Ids).ok_or_else(|| ApiError::invalid("prompt", "token ids must be integers"))
            }
            v => Err(ApiError::invalid("prompt", format!("a prompt must be a string or token ids, not {v}"))),
        },
        Some(Value::Array(a)) if a.len() > 1 => {
            Err(ApiError::invalid("prompt", format!("{} prompts: this server takes one per request", a.len())))
        }
        None => Err(ApiError::invalid("prompt", "`prompt` is missing")),
        Some(v) => Err(ApiError::invalid("prompt", format!("a prompt must be a string or token ids, not {v}"))),
    }
}

/// One generated token's log probability and its most likely alternatives'.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// A chat answer's `logprobs.content`.
pub fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    let entry = |t: &str, lp: f32| json!({"token": t, "logprob": lp, "bytes": t.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, lp)| entry(s, *lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// A completion's `logprobs`, the legacy shape; `offset` is the text's length before these tokens.
pub fn completion_logprobs(tokens: &[TokenLogprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.token.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top.iter().map(|(s, lp)| (s.clone(), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Token counts of an answer.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Inputs one embeddings request may carry (OpenAI's limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// One input of `POST /v1/embeddings`: a text, or token ids run as given.
#[derive(Clone, Debug, PartialEq)]
pub enum EmbedInput {
    Text(String),
    Ids(Vec<i64>),
}

/// `POST /v1/embeddings` read and checked: its inputs, whether the vectors go as base64, and
/// the `dimensions` asked for (`model` and `user` are ignored).
#[derive(Debug)]
pub struct EmbeddingRequest {
    pub inputs: Vec<EmbedInput>,
    pub base64: bool,
    pub dimensions: Option<u64>,
}

impl EmbeddingRequest {
    /// Reads an embeddings request: `input` a string, an array of strings, an array of token
    /// ids, or an array of such arrays (none empty, at most [`MAX_EMBEDDING_INPUTS`]);
    /// `encoding_format` `float` (the default) or `base64`; `dimensions` a positive integer.
    pub fn parse(body: &Value) -> Result<EmbeddingRequest, ApiError> {
        let o = object(body)?;
        let bad = |v: &Value| {
            ApiError::invalid(
                "input",
                format!(
                    "`input` must be a string, an array of strings, an array of token ids or an array of such \
                     arrays, not {}",
                    shorten_json(v)
                ),
            )
        };
        let ids = |a: &[Value], at: &str| -> Result<Vec<i64>, ApiError> {
            if a.is_empty() {
                return Err(ApiError::invalid("input", format!("{at} is an empty array of token ids")));
            }
            a.iter()
                .map(|v| {
                    v.as_i64().filter(|&id| id >= 0).ok_or_else(|| {
                        ApiError::invalid("input", format!("{at}: token ids are integers from 0, not {v}"))
                    })
                })
                .collect()
        };
        let text = |s: &str, at: &str| match s.is_empty() {
            true => Err(ApiError::invalid("input", format!("{at} is an empty string"))),
            false => Ok(EmbedInput::Text(s.to_string())),
        };
        let inputs = match field(o, "input") {
            None => return Err(ApiError::invalid("input", "`input` is missing")),
            Some(Value::String(s)) => vec![text(s, "`input`")?],
            Some(Value::Array(a)) if a.is_empty() => {
                return Err(ApiError::invalid("input", "`input` is an empty array: give at least one input"));
            }
            Some(Value::Array(a)) if a.len() > MAX_EMBEDDING_INPUTS => {
                return Err(ApiError::invalid(
                    "input",
                    format!("`input` has {} inputs; at most {MAX_EMBEDDING_INPUTS} per request", a.len()),
                ));
            }
            Some(Value::Array(a)) if a.iter().all(Value::is_number) => vec![EmbedInput::Ids(ids(a, "`input`")?)],
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => text(s, &format!("`input[{i}]`")),
                    Value::Array(inner) => Ok(EmbedInput::Ids(ids(inner, &format!("`input[{i}]`"))?)),
                    v => Err(bad(v)),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => return Err(bad(v)),
        };
        let base64 = match field(o, "encoding_format") {
            None => false,
            Some(Value::String(f)) if f == "float" => false,
            Some(Value::String(f)) if f == "base64" => true,
            Some(v) => {
                return Err(ApiError::invalid(
                    "encoding_format",
                    format!("`encoding_format` must be \"float\" or \"base64\", not {}", shorten_json(v)),
                ));
            }
        };
        let dimensions = integer(o, "dimensions", 1, u64::MAX)?;
        Ok(EmbeddingRequest { inputs, base64, dimensions })
    }
}

/// A JSON value for an error message, cut to its first 60 characters.
fn shorten_json(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// An embedding as OpenAI's `encoding_format: "base64"` gives it: its f32 values' little-endian
/// bytes, in standard base64 with padding.
pub fn base64_f32(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            match i <= chunk.len() {
                true => out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63])),
                false => out.push('='),
            }
        }
    }
    out
}

/// Token counts of an embeddings answer.
pub fn embedding_usage(prompt: usize) -> Value {
    json!({"prompt_tokens": prompt, "total_tokens": prompt})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_requests_take_openai_inputs_and_name_the_bad_field() {
        let parse = |v: Value| EmbeddingRequest::parse(&v);
        let r = parse(json!({"model": "m", "input": "hi"})).unwrap();
        assert_eq!((r.inputs, r.base64, r.dimensions), (vec![EmbedInput::Text("hi".into())], false, None));
        let r = parse(json!({"input": ["a", [1, 2]], "encoding_format": "base64", "dimensions": 384})).unwrap();
        assert_eq!(r.inputs, vec![EmbedInput::Text("a".into()), EmbedInput::Ids(vec![1, 2])]);
        assert!(r.base64 && r.dimensions == Some(384));
        assert_eq!(parse(json!({"input": [5, 6]})).unwrap().inputs, vec![EmbedInput::Ids(vec![5, 6])]);
        for (body, param, says) in [
            (json!({}), "input", "missing"),
            (json!({"input": []}), "input", "empty array"),
            (json!({"input": ""}), "input", "empty string"),
            (json!({"input": ["a", ""]}), "input", "`input[1]` is an empty string"),
            (json!({"input": [[]]}), "input", "empty array of token ids"),
            (json!({"input": [1.5]}), "input", "integers"),
            (json!({"input": [-1]}), "input", "integers"),
            (json!({"input": 7}), "input", "must be a string"),
            (json!({"input": ["a", 3]}), "input", "must be a string"),
            (json!({"input": "a", "encoding_format": "int8"}), "encoding_format", "base64"),
            (json!({"input": "a", "dimensions": 0}), "dimensions", "integer"),
        ] {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }

    #[test]
    fn base64_embeddings_are_little_endian_f32_bytes() {
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[]), "");
        // 12 bytes: no padding; 8 bytes: one `=`.
        assert_eq!(base64_f32(&[0.0, -2.0, 0.5]), "AAAAAAAAAMAAAAA/");
        assert_eq!(base64_f32(&[0.0, -2.0]), "AAAAAAAAAMA=");
    }

    fn chat(body: Value) -> Result<Request, ApiError> {
        Request::parse(Endpoint::Chat, &body)
    }

    #[test]
    fn a_chat_request_is_read_with_its_sampling_and_stops() {
        let r = chat(json!({"model": "x", "messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "temperature": 0.5, "top_p": 0.9,
            "max_tokens": 7, "stop": ["\n", "."], "seed": 3, "stream": true, "stream_options": {"include_usage": true},
            "logprobs": true, "top_logprobs": 2}))
        .unwrap();
        let Prompt::Messages(m) = &r.prompt else { panic!() };
        assert_eq!((m[0].role.as_str(), m[1].content.as_str()), ("system", "Hi"));
        assert_eq!((r.sampling.temperature, r.sampling.top_p, r.sampling.seed), (Some(0.5), Some(0.9), Some(3)));
        assert_eq!(
            (r.max_tokens, r.stop.len(), r.logprobs, r.stream, r.include_usage),
            (Some(7), 2, Some(2), true, true)
        );
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, param) in [
            (json!({"messages": []}), "messages"),
            (json!({"messages": [{"content": "x"}]}), "messages[0]"),
            (json!({"messages": [{"role": "user", "content": "x"}], "temperature": 3}), "temperature"),
            (json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}), "top_p"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "n": 2}), "n"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "top_logprobs"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream"),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        assert!(chat(json!([1, 2])).unwrap_err().message.contains("JSON object"));
    }

    #[test]
    fn a_completion_prompt_is_text_or_ids() {
        let p = |v: Value| Request::parse(Endpoint::Completions, &json!({"prompt": v})).map(|r| r.prompt);
        assert!(matches!(p(json!("Hi")), Ok(Prompt::Text(t)) if t == "Hi"));
        assert!(matches!(p(json!([1, 2])), Ok(Prompt::Ids(ids)) if ids == [1, 2]));
        assert!(matches!(p(json!([[4]])), Ok(Prompt::Ids(ids)) if ids == [4]));
        assert_eq!(p(json!(["a", "b"])).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(p(json!({})).unwrap_err().param.as_deref(), Some("prompt"));
    }

    #[test]
    fn completion_logprobs_have_offsets_into_the_text() {
        let t = |s: &str| TokenLogprob { token: s.into(), logprob: -0.5, top: vec![(s.into(), -0.5)] };
        let v = completion_logprobs(&[t("Hel"), t("lo")], 4);
        assert_eq!(v["text_offset"], json!([4, 7]));
        assert_eq!(v["top_logprobs"][1]["lo"], json!(-0.5));
    }
}
