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

/// `source` with `key = value` written into `[table]`: replacing the key's line if the table has
/// one, else added (with the table if absent).
fn with_key(source: &str, table: &str, key: &str, value: &str) -> String {
    let header = format!("[{table}]");
    let line = format!("{key} = {value}");
    let mut lines: Vec<String> = source.lines().map(str::to_string).collect();
    let Some(start) = lines.iter().position(|l| *l == header) else {
        return format!("{source}{header}\n{line}\n");
    };
    let end = lines[start + 1..].iter().position(|l| l.starts_with('[')).map_or(lines.len(), |i| start + 1 + i);
    match lines[start + 1..end].iter().position(|l| l.starts_with(&format!("{key} ="))) {
        Some(i) => lines[start + 1 + i] = line,
        None => lines.insert(start + 1, line),
    }
    lines.join("\n") + "\n"
}

/// The cells of the reference row documenting `table.key`, if there is one.
fn reference_row(readme: &str, table: &str, key: &str) -> Option<Vec<String>> {
    let full = format!("`{table}.{key}`");
    let line = readme
        .lines()
        .find(|l| l.starts_with(&format!("| `{table}.")) && l.split('|').nth(1).is_some_and(|c| c.contains(&full)))?;
    Some(line.split('|').map(|c| c.trim().to_string()).filter(|c| !c.is_empty()).collect())
}

/// The `"quoted"` words of a cell.
fn quoted(cell: &str) -> Vec<String> {
    cell.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

/// Each key's type cell agrees with what the parser does with a string the key cannot hold: a
/// key with a fixed set of values (or a list of them) lists exactly that set, and another key
/// names the type the parser expected.
#[test]
fn reference_types_and_values_match_the_parser() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for table in accepted_keys("") {
        for key in accepted_keys(&table) {
            let Some(row) = reference_row(&readme, &table, &key) else { continue };
            let ty = &row[1];
            let base =
                if table == "moe" { format!("{MINIMAL}[moe]\nexperts = 2\ntop_k = 1\n") } else { MINIMAL.into() };
            // A list of a fixed set is asked about its elements.
            let bad = if ty.starts_with("list of") { "[\"qqqqqqqq\"]" } else { "\"qqqqqqqq\"" };
            let source = with_key(&base, &table, &key, bad);
            let agrees = match parse_spec(&source) {
                // Free text.
                Ok(_) => ty.contains("string"),
                Err(d) if d.rule == "values come from a fixed set" => {
                    let help = d.help.clone().unwrap_or_default();
                    let mut allowed: Vec<String> = help
                        .split("allowed values:")
                        .nth(1)
                        .unwrap_or("")
                        .split(',')
                        .map(|v| v.trim().to_string())
                        .collect();
                    let mut documented = quoted(ty);
                    allowed.sort();
                    documented.sort();
                    allowed == documented
                }
                Err(d) => {
                    let expected = d.message.to_lowercase();
                    [("boolean", "bool"), ("integer", "int"), ("number", "float"), ("table", "table")]
                        .iter()
                        .any(|(said, word)| expected.contains(said) && ty.contains(word))
                }
            };
            checked += 1;
            if !agrees {
                wrong.push(format!("{table}.{key}: README says `{ty}`"));
            }
        }
    }
    assert!(checked >= 40, "only {checked} keys checked");
    assert!(wrong.is_empty(), "README types disagree with the parser:\n{}", wrong.join("\n"));
}

/// Every literal default in the reference is the parser's default: writing the key with that
/// value builds the same model (resolved spec and graph) as leaving it out.
#[test]
fn reference_defaults_are_the_defaults() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let build = |source: &str| {
        let fe = kiln_compiler::front_end("spec.toml", source).unwrap_or_else(|e| panic!("{}\n{source}", e.render()));
        (fe.spec.clone(), kiln_compiler::graph::print::text(&fe.graph))
    };
    let mut checked = Vec::new();
    let mut wrong = Vec::new();
    for table in accepted_keys("") {
        for key in accepted_keys(&table) {
            let Some(row) = reference_row(&readme, &table, &key) else { continue };
            // A literal default: a number, a boolean or one quoted string, in backticks or not.
            let default = row[2].trim_matches('`');
            let literal = default.parse::<f64>().is_ok()
                || ["true", "false"].contains(&default)
                || (default.starts_with('"') && default.ends_with('"') && default.matches('"').count() == 2);
            if !literal {
                continue;
            }
            // The context a key needs to be legal (RoPE for its base, experts for the router).
            let base = match table.as_str() {
                "moe" => format!("{MINIMAL}[moe]\nexperts = 2\ntop_k = 1\n"),
                "positions" if key == "theta" || key == "fraction" => {
                    format!("{MINIMAL}[positions]\nkind = \"rope\"\n")
                }
                "positions" if key == "buckets" || key == "max_distance" => {
                    format!("{MINIMAL}[positions]\nkind = \"relative-bias\"\n")
                }
                _ => MINIMAL.to_string(),
            };
            let implicit = build(&base);
            let explicit = build(&with_key(&base, &table, &key, default));
            // The resolved spec keeps what was written; compare what it resolved to.
            let same = implicit.1 == explicit.1
                && kiln_compiler::spec::Resolved { spec: implicit.0.spec.clone(), ..explicit.0.clone() } == implicit.0;
            checked.push(format!("{table}.{key}"));
            if !same {
                wrong.push(format!("{table}.{key} = {default}"));
            }
        }
    }
    assert!(checked.len() >= 20, "only {} literal defaults checked: {checked:?}", checked.len());
    assert!(wrong.is_empty(), "README defaults that are not the defaults: {wrong:?}");
}
