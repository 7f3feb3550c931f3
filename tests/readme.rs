//! The README's spec reference cannot drift from the code: every key the parser accepts must be
//! documented in a row of the reference table, and every built-in preset must be named.
//!
//! The accepted keys are read from the parser itself: an unknown key in each table makes serde list
//! the keys that table accepts.

use kiln_compiler::spec::parse_spec;
use kiln_compiler::spec::weightmap::PRESETS;

const MINIMAL: &str = "[model]\nkind = \"decoder\"\nvocab = 10\nd_model = 8\nlayers = 1\n[attention]\nheads = 2\n";

/// The keys the parser accepts in `table` ("" for the top level).
fn accepted_keys(table: &str) -> Vec<String> {
    let source = if table.is_empty() {
        format!("qqqqqqqqqqqqqqqqqqqq = 1\n{MINIMAL}")
    } else if table == "model" || table == "attention" {
        MINIMAL.replace(&format!("[{table}]\n"), &format!("[{table}]\nqqqqqqqqqqqqqqqqqqqq = 1\n"))
    } else if table == "moe" {
        format!("{MINIMAL}[moe]\nexperts = 2\ntop_k = 1\nqqqqqqqqqqqqqqqqqqqq = 1\n")
    } else {
        format!("{MINIMAL}[{table}]\nqqqqqqqqqqqqqqqqqqqq = 1\n")
    };
    let err = parse_spec(&source).expect_err("unknown key is refused");
    let help = err.help.unwrap_or_default();
    let listed = help.split("allowed here:").nth(1).unwrap_or_else(|| panic!("no key list in {help:?}"));
    listed.split(',').map(|k| k.trim().trim_matches('`').to_string()).filter(|k| !k.is_empty()).collect()
}

#[test]
fn readme_documents_every_spec_key() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let tables = accepted_keys("");
    assert!(tables.len() >= 10, "{tables:?}");
    let mut missing = Vec::new();
    for table in &tables {
        let keys = accepted_keys(table);
        assert!(!keys.is_empty(), "no keys listed for [{table}]");
        for key in keys {
            let full = format!("`{table}.{key}`");
            let row_prefix = format!("| `{table}.");
            let documented = readme
                .lines()
                .any(|l| l.starts_with(&row_prefix) && (l.contains(&full) || l.contains(&format!("`{key}`"))));
            if !documented {
                missing.push(format!("{table}.{key}"));
            }
        }
    }
    assert!(missing.is_empty(), "README spec reference lacks: {missing:?}");
}

#[test]
fn readme_names_every_preset() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let row = readme.lines().find(|l| l.starts_with("| `weights.preset`")).expect("weights.preset row");
    for preset in PRESETS {
        assert!(row.contains(&format!("`{preset}`")), "README does not name preset `{preset}`");
    }
}
