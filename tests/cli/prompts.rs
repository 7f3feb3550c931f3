//! What `run` and `generate` take: a prompt from a file or standard input, and inputs that do
//! not fit the model — a tokenizer of another vocabulary or checkpoint tensors the spec never
//! reads (warned about, as `check --weights` warns), stop ids outside the vocabulary and absurd
//! thread counts (refused).

use crate::common::{fails_with, kiln, ok, scratch, stderr, stdout, with_stdin};
use std::path::{Path, PathBuf};
use std::process::Output;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny decoder spec of `vocab` tokens and `layers` blocks in the scratch directory `name`, and
/// weights drawn for it by `kiln init`.
fn tiny(name: &str, vocab: u32, layers: u32) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    let spec = dir.join(format!("tiny-{vocab}-{layers}.toml"));
    std::fs::write(
        &spec,
        format!(
            "[model]\nname = \"tiny\"\nkind = \"decoder\"\nvocab = {vocab}\nd_model = 16\nlayers = {layers}\n\
             max_positions = 64\n\n[attention]\nheads = 2\n\n[positions]\nkind = \"rope\"\n\n[norm]\nkind = \"rmsnorm\"\n"
        ),
    )
    .unwrap();
    let weights = spec.with_extension("safetensors");
    ok(&["init", s(&spec), "-o", s(&weights), "--force"]);
    (spec, weights)
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{}", stdout(o)))
}

/// `--prompt -` reads the prompt from standard input and `--prompt-file` from a file (one final
/// newline dropped, as `echo` adds one): the same prompt ids as `--prompt` gives.
#[test]
fn generate_reads_the_prompt_from_stdin_or_a_file() {
    let (spec, w) = tiny("prompt", 256, 1);
    let base = ["generate", s(&spec), "--weights", s(&w), "--tokenizer", "bytes", "--backend", "interp"];
    let base = [&base[..], &["--max-new-tokens", "1", "--json"]].concat();
    let given = json(&kiln(&[&base[..], &["--prompt", "Hi there"]].concat()))["prompt_ids"].clone();
    assert_eq!(given.as_array().unwrap().len(), 8, "{given}");
    let piped = json(&with_stdin(&[&base[..], &["--prompt", "-"]].concat(), "Hi there\n"));
    assert_eq!(piped["prompt_ids"], given);
    let file = scratch("prompt").join("prompt.txt");
    std::fs::write(&file, "Hi there\n").unwrap();
    assert_eq!(json(&kiln(&[&base[..], &["--prompt-file", s(&file)]].concat()))["prompt_ids"], given);
    let piped = json(&with_stdin(&[&base[..], &["--prompt-file", "-"]].concat(), "Hi there\r\n"));
    assert_eq!(piped["prompt_ids"], given);

    let o = with_stdin(&[&base[..], &["--prompt", "-"]].concat(), "\n");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("the prompt read from standard input is empty"), "{}", stderr(&o));
    fails_with(
        &[&base[..], &["--prompt-file", "no/such/prompt.txt"]].concat(),
        &["cannot read the prompt in `no/such/prompt.txt`"],
    );
    let o = kiln(&[&base[..], &["--prompt", "a", "--prompt-file", s(&file)]].concat());
    assert_eq!(o.status.code(), Some(2), "--prompt and --prompt-file are one or the other");
}

/// A spec that leaves checkpoint tensors unread (one block of a two-block checkpoint) runs, with
/// the warning `check --weights` gives, on `run` and `generate` (in `warnings` with `--json`); a
/// tokenizer smaller than the model's vocabulary is warned about as likely another model's.
#[test]
fn run_and_generate_warn_about_unread_tensors_and_a_foreign_tokenizer() {
    let (_, two) = tiny("unread", 256, 2);
    let (one, _) = tiny("unread", 256, 1);
    let out = scratch("unread").join("out.safetensors");
    let run = ["run", s(&one), "--weights", s(&two), "--input-ids", "1,2", "--backend", "interp", "--force"];
    let o = kiln(&[&run[..], &["--output", s(&out)]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let warning = format!("warning: `{}` holds 8 tensors the spec never reads: `layers.1.", two.display());
    assert!(stderr(&o).contains(&warning), "{}", stderr(&o));
    let o = kiln(&[&run[..], &["--output", s(&out), "--json"]].concat());
    assert!(json(&o)["warnings"][0].as_str().unwrap().contains("holds 8 tensors the spec never reads"));
    assert!(stderr(&o).is_empty(), "--json keeps stderr clean: {}", stderr(&o));
    let generate = ["generate", s(&one), "--weights", s(&two), "--prompt-ids", "1,2", "--max-new-tokens", "1"];
    let o = kiln(&[&generate[..], &["--backend", "interp"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(&warning), "{}", stderr(&o));
    let (_, w) = tiny("unread", 256, 1);
    let o = kiln(&["generate", s(&one), "--weights", s(&w), "--prompt-ids", "1", "--max-new-tokens", "1"]);
    assert!(!stderr(&o).contains("warning"), "every tensor is read: {}", stderr(&o));

    let (wide, w) = tiny("foreign-tokenizer", 300, 1);
    let generate = ["generate", s(&wide), "--weights", s(&w), "--tokenizer", "bytes", "--prompt", "hi"];
    let o = kiln(&[&generate[..], &["--max-new-tokens", "1", "--backend", "interp"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let said = "warning: the tokenizer `bytes` has 256 tokens but the model's vocabulary is 300";
    assert!(stderr(&o).contains(said), "{}", stderr(&o));
    let v = json(&kiln(&[&generate[..], &["--max-new-tokens", "1", "--backend", "interp", "--json"]].concat()));
    assert!(v["warnings"][0].as_str().unwrap().contains("has 256 tokens but the model's vocabulary is 300"), "{v}");
}

/// Stop ids outside the vocabulary can never stop anything, and thread counts far beyond the
/// cores only queue: both are refused, naming the flag, wherever the flag exists.
#[test]
fn stop_ids_outside_the_vocabulary_and_absurd_thread_counts_are_refused() {
    let (spec, w) = tiny("refused", 256, 1);
    let generate = ["generate", s(&spec), "--weights", s(&w), "--prompt-ids", "1,2", "--max-new-tokens", "1"];
    fails_with(&[&generate[..], &["--stop-ids", "3,999999"]].concat(), &["--stop-ids: 999999", "0..256"]);
    fails_with(&[&generate[..], &["--stop-ids", "256"]].concat(), &["--stop-ids: 256"]);
    let out = scratch("refused").join("out.safetensors");
    let run = ["run", s(&spec), "--weights", s(&w), "--input-ids", "1,2", "--output", s(&out)];
    let bench = ["bench", "forward", s(&spec), "--seq", "2", "--runs", "1"];
    for command in [&generate[..], &run[..], &bench[..]] {
        fails_with(
            &[command, &["--backend", "cpu", "--threads", "100000"]].concat(),
            &["--threads 100000 is more than 4 per core"],
        );
        fails_with(&[command, &["--backend", "cpu", "--threads", "0"]].concat(), &["--threads 0", "at least 1 thread"]);
    }
    ok(&[&run[..], &["--backend", "cpu", "--threads", "2"]].concat());
}
