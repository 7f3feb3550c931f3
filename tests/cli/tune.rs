//! `kiln tune` on lavapipe: every form of the kernels it times matches the interpreter, the
//! fastest is cached for the adapter, and a later load of the same shapes there takes it.

use crate::common::{fails_with, kiln_command, scratch, stderr};
use std::path::Path;

/// A small decoder with grouped-query attention and RoPE: every kernel a decode step has.
const TINY: &str = r#"
[model]
name = "tiny-tune"
kind = "decoder"
vocab = 32
d_model = 16
layers = 2
max_positions = 32
[positions]
kind = "rope"
[norm]
kind = "rmsnorm"
[attention]
heads = 4
kv_heads = 2
[ffn]
activation = "silu"
gated = true
d_ff = 32
"#;

/// Runs kiln with `KILN_DATA` set to `data`; its JSON output.
fn json_in(data: &Path, args: &[&str]) -> serde_json::Value {
    let o = kiln_command(args).env("KILN_DATA", data).output().expect("kiln runs");
    assert!(o.status.success(), "kiln {args:?} failed:\n{}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("kiln {args:?}: not JSON ({e})"))
}

#[test]
fn every_form_matches_the_interpreter_and_the_fastest_is_used_after() {
    let dir = scratch("tune-all");
    let spec = dir.join("tiny.toml");
    std::fs::write(&spec, TINY).unwrap();
    let (spec, data) = (spec.to_str().unwrap(), dir.join("data"));
    let args = ["tune", spec, "--backend", "wgpu", "--prompt", "8", "--steps", "4", "--budget", "600", "--json", "-q"];
    let v = json_in(&data, &args);
    let candidates = v["candidates"].as_array().unwrap();
    assert!(candidates.len() >= 8, "{v}");
    let candidates: Vec<&serde_json::Value> = candidates.iter().filter(|c| matches_or_f16_refused(c)).collect();
    for c in &candidates {
        assert!(c["decode_ms"].as_f64().unwrap() > 0.0 && c["prefill_ms"].as_f64().unwrap() > 0.0, "{c}");
    }
    // The chosen forms: the fastest generation (the prompt's prefill and the decode steps), or
    // the default forms (the first) within 3% of it.
    let total = |c: &serde_json::Value| c["prefill_ms"].as_f64().unwrap() + 4.0 * c["decode_ms"].as_f64().unwrap();
    let fastest = candidates.iter().min_by(|a, b| total(a).total_cmp(&total(b))).unwrap();
    let expected = if total(candidates[0]) <= total(fastest) * 1.03 { candidates[0] } else { fastest };
    assert_eq!(expected["tunables"], v["chosen"], "{v}");
    let saved = Path::new(v["saved"].as_str().unwrap());
    assert!(saved.starts_with(data.join("tuning")) && saved.is_file(), "{v}");
    // A later load of these shapes on the adapter takes the chosen forms.
    let d = json_in(
        &data,
        &["bench", "decode", spec, "--backend", "wgpu", "--seq", "4", "--steps", "2", "--runs", "1", "--json", "-q"],
    );
    assert_eq!(d["kernel_forms"], v["chosen_forms"], "{d}");
    // `inspect --stage wgsl --adapter` compiles the step as it is loaded there, and says so.
    let adapter = v["adapter"].as_str().unwrap();
    let args = ["inspect", spec, "--graph", "step", "--stage", "wgsl", "--adapter", adapter, "--seq", "4"];
    let o = kiln_command(&args).env("KILN_DATA", &data).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    let header: Vec<&str> = text.lines().take(2).collect();
    let chosen = v["chosen_forms"].as_str().unwrap();
    assert!(header[0].ends_with(&format!("({chosen})")), "{header:?}");
    assert!(
        header[1].contains("forms tuned by `kiln tune`") && header[1].contains("one new token after 4 cached"),
        "{header:?}"
    );
    assert!(text.lines().filter(|l| l.starts_with("// step ")).all(|l| l.contains("workgroup")), "{text}");
    // Elsewhere (another data directory) the same adapter is not tuned.
    let o = kiln_command(&args).env("KILN_DATA", dir.join("other")).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("its default forms: not tuned"), "{}", stderr(&o));
}

#[test]
fn out_of_time_only_the_default_forms_run() {
    let dir = scratch("tune-budget");
    let spec = dir.join("tiny.toml");
    std::fs::write(&spec, TINY).unwrap();
    let spec = spec.to_str().unwrap();
    let args = ["tune", spec, "--backend", "wgpu", "--prompt", "4", "--steps", "2", "--budget", "0", "--json", "-q"];
    let v = json_in(&dir.join("data"), &args);
    let candidates = v["candidates"].as_array().unwrap();
    assert!(candidates[0]["rejected"].is_null(), "{v}");
    assert_eq!(candidates[0]["tunables"], v["chosen"], "{v}");
    for c in &candidates[1..] {
        assert_eq!(c["rejected"], "not timed: out of time", "{c}");
    }
}

#[test]
fn tune_refuses_what_it_cannot_tune() {
    fails_with(&["tune", "models/gpt2.toml", "--backend", "cpu"], &["--backend wgpu"]);
    fails_with(&["tune", "models/gpt2.toml", "--backend", "wgpu", "--budget=-1"], &["--budget"]);
    fails_with(&["tune", "models/gpt2.toml", "--backend", "wgpu", "--prompt", "2000"], &["positions"]);
}

#[test]
fn a_first_use_tunes_where_asked_and_caches_it() {
    let dir = scratch("tune-first-use");
    let spec = dir.join("tiny.toml");
    std::fs::write(&spec, TINY).unwrap();
    let spec = spec.to_str().unwrap();
    let args = [
        "generate",
        spec,
        "--random-weights",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--backend",
        "wgpu",
        "-q",
    ];
    let tuned = |data: &Path| std::fs::read_dir(data.join("tuning")).map_or(0, |d| d.count());
    // `KILN_TUNE=always` tunes at a software adapter's first use too (a hardware one's is the default).
    let data = dir.join("always");
    run_tuning_at_first_use(&args, &data);
    assert_eq!(tuned(&data), 1, "no tuning cached in {}", data.display());
    // On lavapipe by default, and where turned off, a load tunes nothing.
    for (data, tune) in [(dir.join("default"), None), (dir.join("off"), Some("off"))] {
        let mut command = kiln_command(&args);
        command.env("KILN_DATA", &data).env_remove("KILN_TUNE");
        if let Some(t) = tune {
            command.env("KILN_TUNE", t);
        }
        let o = command.output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(tuned(&data), 0, "{}", data.display());
    }
}

/// Runs kiln with `args` where a load tunes at its first use even on a software adapter
/// (`KILN_TUNE=always`, with time for the default forms only), its data in `data`; asserts it
/// succeeded.
fn run_tuning_at_first_use(args: &[&str], data: &Path) {
    let o = kiln_command(args)
        .env("KILN_DATA", data)
        .env("KILN_TUNE", "always")
        .env("KILN_TUNE_BUDGET", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Whether a tuning's candidate `c` matched the reference (within the f32 tolerance, 2e-3), after
/// checking that it did: every f32 form must; a form storing weights as f16 may instead be
/// refused (its rounding past 3e-3, or a greedy token changed), and matches within 3e-3.
fn matches_or_f16_refused(c: &serde_json::Value) -> bool {
    let f16 = c["tunables"]["f16_weights"] == true;
    let error = c["error"].as_f64().unwrap();
    match c["rejected"].as_str() {
        None => {
            assert!(error <= if f16 { 3e-3 } else { 2e-3 }, "{c}");
            true
        }
        Some(why) => {
            assert!(f16 && (why.contains("differs") || why.contains("greedy")), "a form was rejected: {c}");
            false
        }
    }
}

/// A small encoder with padding and pooled outputs: its forward pass is what is tuned.
const TINY_ENCODER: &str = r#"
[model]
name = "tiny-tune-encoder"
kind = "encoder"
vocab = 32
d_model = 16
layers = 2
max_positions = 32
[norm]
placement = "post"
[attention]
heads = 2
bias = true
padding_mask = true
[ffn]
activation = "gelu"
d_ff = 32
bias = true
[outputs]
pooling = "mean"
"#;

#[test]
fn an_encoder_is_tuned_on_its_forward_pass() {
    let dir = scratch("tune-encoder");
    let spec = dir.join("tiny-encoder.toml");
    std::fs::write(&spec, TINY_ENCODER).unwrap();
    let (spec, data) = (spec.to_str().unwrap(), dir.join("data"));
    let args = ["tune", spec, "--backend", "wgpu", "--batch", "3", "--prompt", "12", "--budget", "600", "--json", "-q"];
    let v = json_in(&data, &args);
    assert_eq!(v["decode_steps"], 0, "{v}");
    let candidates = v["candidates"].as_array().unwrap();
    for c in candidates.iter().filter(|c| matches_or_f16_refused(c)) {
        assert!(c["prefill_ms"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["decode_ms"].is_null(), "{c}");
    }
    let adapter = v["adapter"].as_str().unwrap();
    let o = kiln_command(&["inspect", spec, "--stage", "wgsl", "--adapter", adapter])
        .env("KILN_DATA", &data)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.lines().nth(1).is_some_and(|l| l.contains("forms tuned by `kiln tune`")), "{text}");
}

/// An encoder's first use on an adapter that tunes at first use (`KILN_TUNE=always` on lavapipe)
/// tunes its forward pass and caches the choice, which the next use reads without tuning again.
#[test]
fn an_encoders_first_use_tunes_its_forward_pass() {
    let dir = scratch("tune-encoder-first-use");
    let spec = dir.join("tiny-encoder.toml");
    std::fs::write(&spec, TINY_ENCODER).unwrap();
    let (spec, data) = (spec.to_str().unwrap(), dir.join("data"));
    let out = dir.join("out.safetensors");
    let out = out.to_str().unwrap();
    let args = [
        "run",
        spec,
        "--random-weights",
        "--input-ids",
        "1,2,3;4,5,6",
        "--output",
        out,
        "--force",
        "--backend",
        "wgpu",
        "-q",
    ];
    let run = || run_tuning_at_first_use(&args, &data);
    run();
    let files: Vec<_> = std::fs::read_dir(data.join("tuning")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let tuning: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    let classes = tuning["classes"].as_object().unwrap();
    assert_eq!(classes.len(), 1, "{tuning}");
    let (class, entry) = classes.iter().next().unwrap();
    assert!(class.starts_with("tiny-tune-encoder"), "{class}");
    // A forward pass: no decode steps, every candidate timed on it or left for want of time.
    assert_eq!(entry["steps"], 0, "{entry}");
    let modified = std::fs::metadata(&files[0]).unwrap().modified().unwrap();
    run();
    assert_eq!(std::fs::metadata(&files[0]).unwrap().modified().unwrap(), modified, "tuned again");
}
