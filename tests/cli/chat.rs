//! Conversations and the tokenizer: `kiln chat` (a REPL fed on standard input), `generate
//! --messages`, `--chat-template`, several prompts at once, `generate --random-weights`, and
//! `kiln tokenize`.

use crate::common::{fails_with, fetched, kiln, ok, scratch, stderr, stdout, with_stdin};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny byte-level decoder spec (256 tokens, 256 positions) in the scratch directory `name`,
/// weights drawn for it by `kiln init`, and a chat template: `<role>content</s>` per message,
/// `<assistant>` after them.
fn tiny(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = scratch(name);
    let spec = dir.join("tiny.toml");
    std::fs::write(
        &spec,
        "[model]\nname = \"tiny\"\nkind = \"decoder\"\nvocab = 256\nd_model = 16\nlayers = 1\n\
         max_positions = 256\n\n[attention]\nheads = 2\n\n[positions]\nkind = \"rope\"\n\n[norm]\nkind = \"rmsnorm\"\n",
    )
    .unwrap();
    let weights = dir.join("tiny.safetensors");
    ok(&["init", s(&spec), "-o", s(&weights), "--force"]);
    let template = dir.join("chat.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}\
         {% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    (spec, weights, template)
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{}", stdout(o)))
}

/// The `conversation: N tokens (C cached)` figures of each turn on a chat's stderr.
fn turns(err: &str) -> Vec<(usize, usize)> {
    err.lines()
        .filter_map(|l| l.strip_prefix("conversation: "))
        .map(|l| {
            let (n, rest) = l.split_once(" token").unwrap();
            let cached = rest.split_once('(').unwrap().1.split_once(' ').unwrap().0;
            (n.parse().unwrap(), cached.parse().unwrap())
        })
        .collect()
}

/// `kiln chat` keeps the conversation across turns: each turn renders the whole history with the
/// chat template, `/reset` forgets it, `/system` sets a system prompt, `/help` lists the commands,
/// an unknown command is said and the session goes on, and `/exit` (or the end of input) ends it.
#[test]
fn chat_keeps_the_history_across_turns() {
    let (spec, w, template) = tiny("chat-history");
    let args = ["chat", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--chat-template", s(&template)];
    let args = [&args[..], &["--backend", "interp", "--max-new-tokens", "5"]].concat();
    let input = "hi\n/help\nhello there\n/frob\n/reset\nhi\n/reset\n/system be brief\nhi\n/exit\nnever read\n";
    let o = with_stdin(&args, input);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    // `<user>hi</s><assistant>`: 23 bytes, so 23 tokens.
    let first = "<user>hi</s><assistant>".len();
    let seen = turns(&err);
    assert_eq!(seen.len(), 4, "four turns, `never read` after /exit: {err}");
    assert_eq!(seen[0], (first, 0), "{err}");
    // The second turn holds the first, its answer, and the new question.
    let asked = "</s><user>hello there</s><assistant>".len();
    assert!(seen[1].0 >= first + asked, "{seen:?}");
    assert_eq!(seen[2], (first, 0), "/reset forgets the history: {err}");
    assert_eq!(seen[3].0, first + "<system>be brief</s>".len(), "/system adds a system turn: {err}");
    assert!(err.contains("/system TEXT"), "/help lists the commands: {err}");
    assert!(err.contains("unknown command `/frob`"), "{err}");
    assert_eq!(stdout(&o).lines().count(), 4, "one answer a turn:\n{}", stdout(&o));

    // The end of input ends the session as /exit does.
    let o = with_stdin(&args, "hi\n");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(turns(&stderr(&o)).len(), 1);
}

/// A turn runs only what the key/value cache does not hold, and answers as the whole
/// conversation run at once by `generate --messages` answers.
#[test]
fn chat_turns_reuse_the_cache_and_match_generate_messages() {
    let (spec, w, template) = tiny("chat-cache");
    let model = ["--weights", s(&w), "--tokenizer", "bytes", "--chat-template", s(&template), "--backend", "interp"];
    let model = [&model[..], &["--max-new-tokens", "6"]].concat();
    let o = with_stdin(&[&["chat", s(&spec)][..], &model].concat(), "hi\nhello there\n");
    assert!(o.status.success(), "{}", stderr(&o));
    let answers: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
    let seen = turns(&stderr(&o));
    let messages = serde_json::json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "hello there"},
    ]);
    let file = scratch("chat-cache").join("messages.json");
    std::fs::write(&file, messages.to_string()).unwrap();
    let v = json(&kiln(&[&["generate", s(&spec)][..], &model, &["--messages", s(&file), "--json"]].concat()));
    assert_eq!(v["prompt_ids"].as_array().unwrap().len(), seen[1].0, "the same rendering: {v}");
    // Whether the answer's text re-encodes to its tokens decides the reuse: this one does.
    assert_eq!(seen[1].1, seen[0].0 + 6 - 1, "the first turn and its answer stay cached: {seen:?}");
    assert_eq!(v["text"].as_str().unwrap(), answers[1], "{v}");
}

/// `generate --messages` renders an OpenAI-shaped history with the chat template and answers the
/// next assistant turn; bad files are refused naming the file and the problem.
#[test]
fn generate_messages_and_its_errors() {
    let (spec, w, template) = tiny("messages");
    let base = ["generate", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--backend", "interp"];
    let base = [&base[..], &["--chat-template", s(&template), "--max-new-tokens", "2"]].concat();
    let dir = scratch("messages");
    let file = dir.join("m.json");
    std::fs::write(&file, r#"[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]"#).unwrap();
    let v = json(&kiln(&[&base[..], &["--messages", s(&file), "--json"]].concat()));
    let rendered = "<system>be brief</s><user>hi</s><assistant>";
    let ids: Vec<i64> = rendered.bytes().map(i64::from).collect();
    assert_eq!(v["prompt_ids"], serde_json::json!(ids));
    // The same as --chat --system.
    let chat = ["--chat", "--system", "be brief", "--prompt", "hi", "--json"];
    assert_eq!(json(&kiln(&[&base[..], &chat].concat()))["prompt_ids"], v["prompt_ids"]);
    let piped = json(&with_stdin(
        &[&base[..], &["--messages", "-", "--json"]].concat(),
        &std::fs::read_to_string(&file).unwrap(),
    ));
    assert_eq!(piped["prompt_ids"], v["prompt_ids"]);

    for (text, said) in [
        ("[", "is not valid JSON"),
        ("[]", "holds an empty list"),
        (r#"{"role": "user"}"#, "holds an object, not an array"),
        (r#"[{"role": "robot", "content": "x"}]"#, "message 1 has the role `robot`"),
        (r#"[{"role": "user"}]"#, "message 1 has no `content`"),
        (r#"[{"role": "user", "content": 3}]"#, "message 1's `content` is a number"),
        (r#"["hi"]"#, "message 1 is a string"),
    ] {
        let bad = dir.join("bad.json");
        std::fs::write(&bad, text).unwrap();
        fails_with(
            &[&base[..], &["--messages", s(&bad)]].concat(),
            &[&format!("--messages: `{}`", bad.display()), said],
        );
    }
    fails_with(&[&base[..], &["--messages", "no/such.json"]].concat(), &["cannot read the messages in `no/such.json`"]);
}

/// `--chat-template FILE` renders with the file's template: needed where the tokenizer has none
/// (the byte tokenizer here, as Gemma 3 270M's GGUF), said when missing.
#[test]
fn chat_template_overrides_the_tokenizer() {
    let (spec, w, template) = tiny("template");
    let base = ["generate", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--backend", "interp"];
    let base = [&base[..], &["--max-new-tokens", "1", "--chat", "--prompt", "hi"]].concat();
    fails_with(&base, &["the tokenizer has no chat template", "--chat-template FILE"]);
    let v = json(&kiln(&[&base[..], &["--chat-template", s(&template), "--json"]].concat()));
    assert_eq!(v["prompt_ids"].as_array().unwrap().len(), "<user>hi</s><assistant>".len(), "{v}");
    fails_with(
        &[&base[..], &["--chat-template", "no/such.jinja"]].concat(),
        &["cannot read the chat template `no/such.jinja`"],
    );
    let broken = scratch("template").join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}").unwrap();
    fails_with(&[&base[..], &["--chat-template", s(&broken)]].concat(), &["chat template"]);
    let o = kiln(&["generate", s(&spec), "--weights", s(&w), "--prompt-ids", "1", "--chat-template", s(&template)]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--chat-template renders conversations"), "{}", stderr(&o));
    // A chat needs a template before the first question.
    let o = with_stdin(&["chat", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--backend", "interp"], "hi\n");
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--chat-template FILE"), "{}", stderr(&o));
}

/// Several prompts (`--prompt` repeated, or `--batch-prompts FILE`) are answered in turn on the
/// model loaded once: each as it would be alone, text under a header per prompt, `--json` an array.
#[test]
fn generate_answers_several_prompts() {
    let (spec, w, _) = tiny("batch");
    let base = ["generate", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--backend", "interp"];
    let base = [&base[..], &["--max-new-tokens", "3"]].concat();
    let alone: Vec<serde_json::Value> = ["ab", "hello"]
        .iter()
        .map(|p| json(&kiln(&[&base[..], &["--prompt", p, "--json"]].concat()))["generated_ids"].clone())
        .collect();
    let v = json(&kiln(&[&base[..], &["--prompt", "ab", "--prompt", "hello", "--json"]].concat()));
    let docs = v.as_array().unwrap_or_else(|| panic!("an array: {v}"));
    assert_eq!(docs.len(), 2);
    assert_eq!(docs[0]["prompt"], "ab");
    assert_eq!(docs[1]["prompt"], "hello");
    assert_eq!([docs[0]["generated_ids"].clone(), docs[1]["generated_ids"].clone()], alone[..]);
    let file = scratch("batch").join("prompts.txt");
    std::fs::write(&file, "ab\n\nhello\n").unwrap();
    let v = json(&kiln(&[&base[..], &["--batch-prompts", s(&file), "--json"]].concat()));
    assert_eq!(v.as_array().unwrap().len(), 2, "blank lines skipped: {v}");
    let text = stdout(&kiln(&[&base[..], &["--batch-prompts", s(&file)]].concat()));
    assert!(text.starts_with("### prompt 1/2: ab\n"), "{text}");
    assert!(text.contains("\n### prompt 2/2: hello\n"), "{text}");
    let ids = kiln(&[&base[..], &["--batch-prompts", s(&file), "--print-ids"]].concat());
    assert_eq!(stdout(&ids).lines().count(), 2, "one line of ids per prompt: {}", stdout(&ids));
    let empty = scratch("batch").join("empty.txt");
    std::fs::write(&empty, "\n \n").unwrap();
    fails_with(&[&base[..], &["--batch-prompts", s(&empty)]].concat(), &["--batch-prompts", "holds no prompt"]);
}

/// `generate --random-weights` runs a spec without a checkpoint, as `run --random-weights` does,
/// saying that the output is noise; without either, the message names both.
#[test]
fn generate_with_random_weights() {
    let (spec, _, _) = tiny("random");
    let args = ["generate", s(&spec), "--random-weights", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"];
    let o = kiln(&[&args[..], &["--backend", "interp"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("the output is noise"), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim().split(',').count(), 4, "{}", stdout(&o));
    // The same weights on every engine.
    let cpu = kiln(&[&args[..], &["--backend", "cpu"]].concat());
    assert_eq!(stdout(&cpu), stdout(&o), "{}", stderr(&cpu));
    let v = json(&kiln(&[&args[..], &["--backend", "interp", "--json"]].concat()));
    assert_eq!(v["random_weights"], true);
    fails_with(&["generate", s(&spec), "--prompt-ids", "1"], &["--weights CHECKPOINT, or --random-weights"]);
    let o = kiln(&["generate", s(&spec), "--random-weights", "--weights", "x", "--prompt-ids", "1"]);
    assert_eq!(o.status.code(), Some(2), "one or the other");
}

/// `kiln tokenize` prints each token's id and text (`--ids-only`: the ids as `--prompt-ids`
/// takes them; `--json`), from an argument, a file or standard input, and `--decode` the text
/// of ids; a spec alone has no tokenizer to use.
#[test]
fn tokenize_prints_ids_and_pieces() {
    let (spec, _, _) = tiny("tokenize");
    let bytes = ["tokenize", s(&spec), "--tokenizer", "bytes"];
    let text = ok(&[&bytes[..], &["hé"]].concat());
    assert_eq!(text.lines().collect::<Vec<_>>(), ["    104  \"h\"", "    195  <0xC3>", "    169  <0xA9>"], "{text}");
    assert_eq!(ok(&[&bytes[..], &["--ids-only", "hi"]].concat()), "104,105\n");
    let o = with_stdin(&[&bytes[..], &["--ids-only", "-"]].concat(), "hi\n");
    assert_eq!(stdout(&o), "104,105\n", "{}", stderr(&o));
    assert_eq!(ok(&[&bytes[..], &["--decode", "104,105"]].concat()), "hi\n");
    fails_with(&["tokenize", s(&spec), "hi"], &["brings no tokenizer", "--tokenizer"]);
    fails_with(&[&bytes[..], &["--decode", "300"]].concat(), &["--decode", "300"]);
    fails_with(&[&bytes[..], &["--file", "no/such.txt"]].concat(), &["no/such.txt"]);

    let gguf = fetched("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["tokenize", s(&gguf), "--json", "What is the capital of France?"])).unwrap();
    assert_eq!(v["ids"], serde_json::json!([1780, 314, 260, 3575, 282, 4649, 47]), "{v}");
    assert_eq!(v["tokens"][3]["text"], " capital");
    assert_eq!(v["tokens"][3]["token"], "Ġcapital");
}

/// Ctrl-C during an answer stops it, not the session: what it said stays in the history and the
/// next line is answered; Ctrl-C at the prompt ends the session with exit code 130.
#[cfg(unix)]
#[test]
fn chat_ctrl_c_stops_the_answer_then_the_session() {
    use std::io::{BufRead, BufReader, Read};
    let (spec, w, template) = tiny("chat-ctrl-c");
    // RoPE has no position table: a long context keeps it answering until interrupted.
    std::fs::write(
        &spec,
        std::fs::read_to_string(&spec).unwrap().replace("max_positions = 256", "max_positions = 60000"),
    )
    .unwrap();
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["chat", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--chat-template", s(&template)])
            .args(["--backend", "interp", "--max-new-tokens", "50000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let interrupt = |child: &std::process::Child| {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGINT);
        }
    };
    let mut child = spawn();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut answers = Vec::new();
    for question in ["hi\n", "again\n"] {
        stdin.write_all(question.as_bytes()).unwrap();
        stdin.flush().unwrap();
        let mut first = [0u8; 1];
        out.read_exact(&mut first).unwrap();
        interrupt(&child);
        let mut rest = String::new();
        out.read_line(&mut rest).unwrap();
        answers.push(format!("{}{rest}", first[0] as char));
    }
    drop(stdin);
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "the end of input ends the session: {err}");
    assert_eq!(err.matches("interrupted: stopped after").count(), 2, "{err}");
    let seen = turns(&err);
    assert_eq!(seen.len(), 2, "{err}");
    let partial = answers[0].trim_end().len();
    assert!(seen[1].0 >= seen[0].0 + partial, "the stopped answer stays in the history: {seen:?} {answers:?}");

    // At the prompt, Ctrl-C ends the session.
    let mut child = spawn();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("chat with") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the session never started");
    }
    interrupt(&child);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
}

/// A real conversation: SmolLM2-135M-Instruct's GGUF, its own tokenizer and chat template, two
/// questions through one key/value cache, each answered right (greedily, as `examples/chat`).
#[test]
fn chat_with_smollm2_answers_two_questions() {
    let gguf = fetched("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let args = ["chat", s(&gguf), "--greedy", "--max-new-tokens", "24", "--backend", "cpu"];
    let o = with_stdin(&args, "What is the capital of France?\nAnd what is the capital of Germany?\n");
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{err}");
    let answers: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(answers.first().is_some_and(|a| a.contains("Paris")), "{out}\n{err}");
    assert!(answers.iter().skip(1).any(|a| a.contains("Berlin")), "{out}\n{err}");
    let seen = turns(&err);
    assert_eq!(seen.len(), 2, "{err}");
    assert!(seen[1].1 > seen[0].0, "the second turn runs after the first, cached: {seen:?}");
}
