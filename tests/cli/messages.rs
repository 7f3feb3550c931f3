//! Messages a new user meets: a text file given as the model is not echoed whole, a spec given
//! where a checkpoint belongs is called a spec, a missing input names both ways to give it, an
//! unknown backend lists the backends, `embed` quotes its sentences short, and wgpu says which
//! adapter runs it.

use crate::common::{self, fails_with, kiln, scratch, stderr, stdout};

/// A one-line text file of 20 000 characters given as the model: the error shows a window of the
/// line around the caret, cut with ellipses, never the whole line.
#[test]
fn a_long_line_is_not_echoed_whole() {
    let file = scratch("long-line").join("notes.txt");
    std::fs::write(&file, format!("{} then more words", "word ".repeat(4000))).unwrap();
    let o = kiln(&["check", file.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("notes.txt:1:"), "{err}");
    assert!(err.contains('…'), "the cut is marked: {err}");
    assert!(err.lines().all(|l| l.chars().count() <= 200), "a line longer than 200 characters:\n{err}");
    // The caret still points into what is shown.
    let shown = err.lines().find(|l| l.starts_with("1 | ")).unwrap();
    let caret = err.lines().find(|l| l.trim_start().starts_with("| ") && l.contains('^')).unwrap();
    assert!(caret.find('^').unwrap() < shown.chars().count() + 2, "{err}");
}

/// A spec given to `import`, or as `--weights`, is said to be a spec, not a checkpoint with a
/// header too large.
#[test]
fn a_spec_where_a_checkpoint_belongs_is_called_a_spec() {
    let spec_said = "`models/llama.toml` is a kiln spec (TOML), not a checkpoint";
    fails_with(&["import", "models/llama.toml"], &[spec_said, "a Hugging Face model directory or a GGUF file"]);
    fails_with(&["check", "models/gpt2.toml", "--weights", "models/llama.toml"], &[spec_said]);
    let run =
        ["run", "models/gpt2.toml", "--weights", "models/llama.toml", "--input-ids", "1", "--output", "/dev/null"];
    fails_with(&run, &[spec_said, "weights are a safetensors or GGUF file"]);
    let o = kiln(&["import", "README.md"]);
    assert!(stderr(&o).contains("`README.md` is a text file, not a checkpoint"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("header too large"), "{}", stderr(&o));
}

/// `run` without inputs names both ways to give them, `--random-weights` or not.
#[test]
fn run_without_inputs_names_both_flags() {
    let run = ["run", "models/gpt2.toml", "--output", "/dev/null"];
    fails_with(&[&run[..], &["--random-weights"]].concat(), &["--inputs FILE", "--input-ids 1,2,3"]);
    fails_with(&[&run[..], &["--weights", "tests/fixtures/gpt2/model.safetensors"]].concat(), &["--input-ids"]);
}

/// An unknown backend is refused with every backend listed, not the nearest name alone.
#[test]
fn an_unknown_backend_lists_them_all() {
    for args in [
        &["run", "models/gpt2.toml", "--random-weights", "--input-ids", "1", "--output", "/dev/null"][..],
        &["bench", "forward"],
        &["compile", "models/gpt2.toml", "-o", "/dev/null", "--for"],
        &["inspect", "models/gpt2.toml", "--stats"],
    ] {
        let flag = if args[0] == "compile" { &[][..] } else { &["--backend"][..] };
        let o = kiln(&[args, flag, &["cuda"]].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("`cuda` is not a backend") && err.contains("auto, cpu, wgpu, interp"), "{err}");
        assert!(!err.contains("similar value"), "{err}");
    }
    let help = stdout(&kiln(&["run", "--help"]));
    assert!(["- auto:", "- cpu:", "- wgpu:", "- interp:"].iter().all(|v| help.contains(v)), "{help}");
}

/// `embed` quotes each sentence after its vector, cut short (`--full` quotes it whole).
#[test]
fn embed_quotes_long_sentences_short() {
    let weights = common::fetched("minilm", "minilm-l6", "model.safetensors");
    let tokenizer = common::fetched("minilm", "minilm-l6", "tokenizer.json");
    let sentence = "The cat sits on the mat while the dog sleeps by the fire and the rain falls outside.";
    let o = kiln(&[
        "embed",
        "models/minilm-l6.toml",
        "--weights",
        weights.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--backend",
        "cpu",
        "-q",
        sentence,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("\"The cat sits on the mat while the dog sleeps by…\""), "{out}");
    assert!(!out.contains(sentence), "{out}");
}

/// On wgpu, stderr says which adapter runs the model, and that a software one (lavapipe) is.
#[test]
fn wgpu_names_its_adapter() {
    let Some(gpu) = common::gpu() else { return };
    let o = kiln(
        &["run", "models/llama.toml", "--random-weights", "--input-ids", "1,2", "--output", "/dev/null"]
            .into_iter()
            .chain(["--backend", "wgpu"])
            .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let said = format!("backend: wgpu on adapter `{}`", gpu.adapter_name());
    assert!(stderr(&o).contains(&said), "{}", stderr(&o));
    assert_eq!(stderr(&o).contains("a software rasterizer (lavapipe"), gpu.is_software(), "{}", stderr(&o));
}
