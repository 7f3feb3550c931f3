//! kiln outside its checkout: the specs of `models/` by name from any directory, `kiln new`,
//! `kiln list` and `kiln fetch`; a real model's name finding its fetched weights.

use crate::common::{fails_with, failure, kiln, kiln_command, ok, root, scratch, stderr, stdout};
use std::path::Path;
use std::process::Output;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs kiln in `dir` with `KILN_DATA` set to `data` (when given).
fn kiln_in(dir: &Path, data: Option<&Path>, args: &[&str]) -> Output {
    let mut command = kiln_command(args);
    command.current_dir(dir);
    if let Some(data) = data {
        command.env("KILN_DATA", data);
    }
    command.output().expect("kiln runs")
}

#[test]
fn check_a_builtin_name_from_outside_the_checkout() {
    let dir = scratch("names-outside");
    for name in ["gpt2", "t5", "minilm-l6", "smollm2-135m"] {
        let o = kiln_in(&dir, None, &["check", name, "--json"]);
        assert!(o.status.success(), "kiln check {name} in {}: {}", dir.display(), stderr(&o));
        let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(json["model"], name, "{json}");
    }
    // Every command that reads a spec takes a name: two of them at once.
    let o = kiln_in(&dir, None, &["diff", "gpt2", "bloom", "--json"]);
    assert!(o.status.success(), "kiln diff gpt2 bloom: {}", stderr(&o));
    // A misspelt name is neither a file nor a built-in spec: the nearest name is suggested.
    let o = kiln_in(&dir, None, &["check", "gtp2"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot read spec `gtp2`") && err.contains("did you mean `gpt2`?"), "{err}");
    // A file of that name wins over the built-in spec.
    std::fs::write(dir.join("gpt2"), "").unwrap();
    let o = kiln_in(&dir, None, &["check", "gpt2"]);
    assert!(!o.status.success() && stderr(&o).contains("the spec is empty"), "{}", stderr(&o));
}

#[test]
fn an_empty_spec_points_to_kiln_new_not_the_checkout() {
    let dir = scratch("names-empty");
    let empty = dir.join("empty.toml");
    std::fs::write(&empty, "# nothing yet\n").unwrap();
    fails_with(&["check", s(&empty)], &["the spec is empty", "kiln new decoder", "kiln list"]);
    assert!(!stderr(&kiln(&["check", s(&empty)])).contains("models/"));
}

#[test]
fn new_writes_specs_that_check_and_never_overwrites() {
    let dir = scratch("names-new");
    for kind in ["decoder", "encoder", "encoder-decoder"] {
        let path = dir.join(format!("{kind}.toml"));
        let _ = std::fs::remove_file(&path);
        kiln_in(&dir, None, &["new", kind, "-o", s(&path)]);
        let said = ok(&["check", s(&path), "--json"]);
        let json: serde_json::Value = serde_json::from_str(&said).unwrap();
        assert_eq!(json["kind"], kind, "{said}");
        fails_with(&["new", kind, "-o", s(&path)], &["exists; pass --force to replace it"]);
        ok(&["new", kind, "-o", s(&path), "--force"]);
    }
    let printed = ok(&["new", "--from", "gpt2"]);
    assert_eq!(printed, std::fs::read_to_string(root().join("models/gpt2.toml")).unwrap());
    fails_with(&["new", "decodr"], &["no kind of model `decodr`", "did you mean `decoder`?"]);
    fails_with(&["new", "--from", "gpt3"], &["no built-in spec `gpt3`", "did you mean `gpt2`?"]);
    failure(&["new"], &["<KIND>"]);
}

#[test]
fn list_names_every_builtin_spec_and_where_its_weights_are() {
    let data = scratch("names-list-data");
    let o = kiln_in(&data, Some(&data), &["list", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let specs = json["specs"].as_array().unwrap();
    let names: Vec<&str> = specs.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let mut files: Vec<String> = std::fs::read_dir(root().join("models"))
        .unwrap()
        .filter_map(|e| e.unwrap().path().file_stem().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    files.sort();
    assert_eq!(names, files);
    let smollm2 = specs.iter().find(|s| s["name"] == "smollm2-135m").unwrap();
    assert_eq!((smollm2["fetchable"].as_bool(), smollm2["fetched"].as_bool()), (Some(true), Some(false)));
    let text = stdout(&kiln_in(&data, Some(&data), &["list"]));
    assert!(text.contains("weights: not fetched (`kiln fetch smollm2-135m`)"), "{text}");
}

#[test]
fn a_real_model_by_name_finds_its_fetched_weights_or_says_how_to_fetch_them() {
    let data = scratch("names-no-data");
    let o = kiln_in(&data, Some(&data), &["generate", "smollm2-135m", "--prompt", "Hi"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("`smollm2-135m`'s weights are not fetched") && err.contains("kiln fetch smollm2-135m"),
        "{err}"
    );
    // The fetched files found by name (fakes here: `check` reads no weights, `fetch` sees them cached).
    let model = data.join("smollm2-135m");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("SmolLM2-135M-Instruct.Q4_1.gguf"), "not a gguf").unwrap();
    // (From another directory: in the data dir, `smollm2-135m` is the model's directory.)
    let elsewhere = scratch("names-elsewhere");
    let out = elsewhere.join("o.safetensors");
    let o = kiln_in(&elsewhere, Some(&data), &["run", "smollm2-135m", "--input-ids", "1,2", "--output", s(&out)]);
    assert!(stderr(&o).contains("SmolLM2-135M-Instruct.Q4_1.gguf"), "{}", stderr(&o));
    // `generate` and `chat` read them too.
    for command in [&["generate", "smollm2-135m", "--prompt", "Hi"][..], &["chat", "smollm2-135m"]] {
        let o = kiln_in(&elsewhere, Some(&data), command);
        assert!(stderr(&o).contains("SmolLM2-135M-Instruct.Q4_1.gguf"), "{command:?}: {}", stderr(&o));
    }
    let o = kiln_in(&data, Some(&data), &["fetch", "smollm2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("smollm2-135m already in"), "{}", stdout(&o));
}

#[test]
fn fetch_refuses_unknown_names_before_any_download() {
    let data = scratch("names-fetch");
    let o = kiln_in(&data, Some(&data), &["fetch", "smollm3"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no model `smollm3` to fetch: did you mean `smollm2`?"), "{err}");
    assert!(std::fs::read_dir(&data).unwrap().next().is_none(), "nothing written");
    failure(&["fetch"], &["<NAMES>"]);
    // The script reads the same list (`known:` lists the names and aliases).
    let o = std::process::Command::new("bash")
        .arg(root().join("scripts/fetch-models"))
        .arg("smollm3")
        .env("KILN_DATA", &data)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("smollm2-135m (smollm2)"), "{}", stderr(&o));
}

#[test]
fn bench_help_says_which_specs_are_built_in() {
    let help = ok(&["bench", "forward", "--help"]);
    assert!(help.contains("a built-in spec") && !help.contains("so any directory will do"), "{help}");
}

#[test]
fn the_readme_tour_names_no_file_of_the_checkout_that_a_built_in_name_replaces() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let tour = readme.split("## A tour").nth(1).and_then(|t| t.split("\n## ").next()).unwrap();
    for (name, _) in kiln_names() {
        let named = tour.lines().filter(|l| l.starts_with("kiln ")).any(|l| l.contains(&format!("models/{name}.toml")));
        assert!(!named, "a tour command names models/{name}.toml: use `{name}`");
    }
}

/// The built-in names, as `kiln list --json` gives them.
fn kiln_names() -> Vec<(String, bool)> {
    let json: serde_json::Value = serde_json::from_str(&ok(&["list", "--json"])).unwrap();
    json["specs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["fetchable"].as_bool().unwrap()))
        .collect()
}
