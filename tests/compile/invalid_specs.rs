//! The invalid-spec corpus: every file under `tests/invalid/` breaks one rule of the spec language.
//!
//! Each one must be refused by the front end with diagnostics that are located (a span) and name the
//! rule they enforce; the rendered error, exactly as the CLI prints it, is snapshotted under
//! `snapshots/invalid__<file stem>.snap` so that a change to any message is reviewed.

use std::path::Path;

/// The corpus directory, relative to the repository root (the names used in rendered errors).
const CORPUS: &str = "tests/invalid";

/// What `kiln check <file>` prints for a spec that must be refused.
fn refusal(path: &Path) -> String {
    let name = path.file_name().and_then(|n| n.to_str()).expect("corpus file names are UTF-8");
    let file = format!("{CORPUS}/{name}");
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {file}: {e}"));
    let source = match String::from_utf8(bytes) {
        Ok(source) => source,
        // The CLI refuses such a file before the compiler sees it (src/model_file.rs, `spec_text`).
        Err(e) => {
            return format!(
                "error: spec `{file}` is not UTF-8 text (invalid byte at offset {})\n",
                e.utf8_error().valid_up_to()
            );
        }
    };
    let err = match kiln_compiler::front_end(&file, &source) {
        Ok(_) => panic!("{file} is accepted, but it is in the invalid corpus"),
        Err(err) => err,
    };
    assert!(!err.diagnostics.is_empty(), "{file}: refused without a diagnostic");
    for d in &err.diagnostics {
        assert!(d.span.is_some(), "{file}: diagnostic without a span: {d}");
        assert!(!d.rule.trim().is_empty(), "{file}: diagnostic without a rule: {d}");
    }
    err.render()
}

/// The `# ...` line each corpus file starts with, saying what is wrong with it.
fn what_is_wrong(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let first = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    let first = String::from_utf8_lossy(first);
    let comment = first
        .trim()
        .strip_prefix('#')
        .unwrap_or_else(|| panic!("{} must start with a `#` comment saying what is wrong", path.display()));
    comment.trim().to_string()
}

#[test]
fn invalid_specs_are_refused_with_located_errors() {
    insta::glob!("../invalid", "*.toml", |path| {
        let stem = path.file_stem().and_then(|s| s.to_str()).expect("corpus file names are UTF-8");
        let rendered = refusal(path);
        let mut settings = insta::Settings::clone_current();
        settings.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"));
        settings.set_prepend_module_to_snapshot(false);
        settings.remove_snapshot_suffix();
        settings.set_description(what_is_wrong(path));
        settings.set_omit_expression(true);
        settings.bind(|| insta::assert_snapshot!(format!("invalid__{stem}"), rendered));
    });
}

#[test]
fn the_corpus_is_not_trivially_small() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(CORPUS);
    let count = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "toml"))
        .count();
    assert!(count >= 20, "{CORPUS} holds {count} specs; the corpus should have at least 20");
}

/// A zero that breaks a knob's own rule and the rule that sizes are positive is reported once.
#[test]
fn a_zero_size_is_one_error() {
    for name in ["low-rank-zero.toml", "relative-bias-zero-buckets.toml"] {
        let source = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(CORPUS).join(name)).unwrap();
        let err = kiln_compiler::front_end(name, &source).err().unwrap_or_else(|| panic!("{name} is accepted"));
        assert_eq!(err.diagnostics.len(), 1, "{name}:\n{}", err.render());
    }
}

/// An unknown kind in a per-layer list is shown at its own line, not at the key.
#[test]
fn an_unknown_layer_type_is_shown_at_its_line() {
    let name = "layer-types-unknown-kind.toml";
    let source = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(CORPUS).join(name)).unwrap();
    let err = kiln_compiler::front_end(name, &source).err().unwrap_or_else(|| panic!("{name} is accepted"));
    let [d] = err.diagnostics.as_slice() else { panic!("{}", err.render()) };
    let span = d.span.clone().unwrap();
    assert_eq!(&source[span], "\"chunked_attention\"", "{}", err.render());
    assert_eq!(d.key.as_deref(), Some("attention.layer_types"));
}
