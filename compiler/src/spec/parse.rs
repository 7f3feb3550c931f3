//! Parsing: TOML text -> [`Spec`], plus a [`SpanIndex`] so later stages can point at keys.

use super::{EmbeddingScale, ResidualScale, ScaleRule, Spec};
use crate::diag::{Diagnostic, did_you_mean};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::ops::Range;
use toml::de::{DeTable, DeValue};

/// Byte spans of every key and value of a TOML document, by dotted path (`attention.heads`,
/// `weights.tensors."layers.{i}.attn.q.weight"` is stored as `weights.tensors.layers.{i}.attn.q.weight`).
#[derive(Clone, Debug, Default)]
pub struct SpanIndex {
    entries: BTreeMap<String, Entry>,
}

#[derive(Clone, Debug)]
struct Entry {
    key: Range<usize>,
    value: Range<usize>,
    /// The value is a table (a `[header]` or an inline `{ ... }`).
    table: bool,
    /// The value is an array of tables (`[[name]]`), a form no key of the spec language takes.
    array_of_tables: bool,
}

impl SpanIndex {
    /// Indexes a TOML document. A document that does not parse yields an empty index.
    pub fn new(source: &str) -> Self {
        let mut index = SpanIndex::default();
        if let Ok(root) = DeTable::parse(source) {
            index.add_table("", root.get_ref());
        }
        index
    }

    fn add_table(&mut self, prefix: &str, table: &DeTable<'_>) {
        for (key, value) in table.iter() {
            let path =
                if prefix.is_empty() { key.get_ref().to_string() } else { format!("{prefix}.{}", key.get_ref()) };
            let array_of_tables =
                value.get_ref().as_array().is_some_and(|a| !a.is_empty() && a.iter().all(|v| v.get_ref().is_table()));
            let table = value.get_ref().is_table();
            self.entries.insert(path.clone(), Entry { key: key.span(), value: value.span(), table, array_of_tables });
            if let DeValue::Table(inner) = value.get_ref() {
                self.add_table(&path, inner);
            }
        }
    }

    /// The span of the value at `path`, if the document has it.
    pub fn value(&self, path: &str) -> Option<Range<usize>> {
        self.entries.get(path).map(|e| e.value.clone())
    }

    /// The span of the key at `path`, if the document has it.
    pub fn key(&self, path: &str) -> Option<Range<usize>> {
        self.entries.get(path).map(|e| e.key.clone())
    }

    /// The best span for an error about `path`: its value if written, else the nearest written
    /// ancestor's key (the `[table]` header the missing key belongs in), else the file start.
    pub fn locate(&self, path: &str) -> Range<usize> {
        if let Some(span) = self.value(path) {
            return span;
        }
        let mut p = path;
        while let Some((parent, _)) = p.rsplit_once('.') {
            if let Some(span) = self.key(parent) {
                return span;
            }
            p = parent;
        }
        0..0
    }

    /// Whether the document has no key at all (it is empty or only comments).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The innermost path whose key contains `span`, else the innermost whose value does (a key
    /// of a dotted header `[a.b.c]` lies inside the span of its child tables too, so the key wins).
    /// An empty span is a position (serde's errors about the whole document), not a key.
    pub fn path_at(&self, span: &Range<usize>) -> Option<&str> {
        if span.is_empty() {
            return None;
        }
        let within = |r: &Range<usize>| r.start <= span.start && span.end <= r.end;
        let innermost = |f: &dyn Fn(&Entry) -> bool| {
            self.entries
                .iter()
                .filter(|(_, e)| f(e))
                .max_by_key(|(p, _)| p.matches('.').count())
                .map(|(p, _)| p.as_str())
        };
        innermost(&|e| within(&e.key)).or_else(|| innermost(&|e| within(&e.value)))
    }

    fn is_table(&self, path: &str) -> bool {
        self.entries.get(path).is_some_and(|e| e.table)
    }

    fn is_array_of_tables(&self, path: &str) -> bool {
        self.entries.get(path).is_some_and(|e| e.array_of_tables)
    }
}

/// Parses spec text. Errors carry a span and, for misspelled keys or values, a suggestion.
pub fn parse_spec(source: &str) -> Result<(Spec, SpanIndex), Diagnostic> {
    let index = SpanIndex::new(source);
    // A document of only comments parses, to an empty table: it is as empty as an empty file.
    if source.trim().is_empty() || (index.is_empty() && DeTable::parse(source).is_ok()) {
        return Err(Diagnostic::new("a spec has [model] and [attention]", "the spec is empty")
            .with_span(0..0)
            .with_help("`kiln new decoder` (or `encoder`, `encoder-decoder`) writes a spec to start from; `kiln list` shows the built-in ones"));
    }
    match toml::from_str::<Spec>(source) {
        Ok(spec) => Ok((spec, index)),
        Err(err) => Err(from_toml_error(&err, source, &index)),
    }
}

/// Turns a TOML or serde error into a diagnostic that names the key (not serde's "field" or Rust
/// types) and suggests the closest allowed word for a misspelled key or value.
fn from_toml_error(err: &toml::de::Error, source: &str, index: &SpanIndex) -> Diagnostic {
    let message = err.message().trim().replace('\n', " ");
    let span = err.span().unwrap_or(0..0);
    let key = index.path_at(&span).map(str::to_string);
    let at = key.as_deref().unwrap_or("");
    let suggest = |word: &str, expected: &[String], allowed: &str| {
        did_you_mean(word, expected.iter().map(String::as_str))
            .map(|s| format!("did you mean `{s}`?"))
            .unwrap_or_else(|| format!("{allowed}: {}", expected.join(", ")))
    };
    let (rule, message, help) = if let Some((word, expected)) = parse_unknown(&message, "unknown field") {
        let message = match at.strip_suffix(&word).and_then(|p| p.strip_suffix('.')) {
            Some(parent) => format!("unknown key `{word}` in `{parent}`"),
            None if index.is_table(&word) => format!("unknown table `[{word}]`"),
            None => format!("unknown key `{word}`"),
        };
        ("no unknown keys", message, Some(suggest(&word, &expected, "allowed here")))
    } else if let Some((word, expected)) = parse_unknown(&message, "unknown variant") {
        let message = match &key {
            Some(k) => format!("unknown value \"{word}\" for `{k}`"),
            None => format!("unknown value \"{word}\""),
        };
        ("values come from a fixed set", message, Some(suggest(&word, &expected, "allowed values")))
    } else if let Some(field) = message.strip_prefix("missing field `").and_then(|m| m.strip_suffix('`')) {
        match &key {
            Some(table) => ("required keys are present", format!("`{table}` lacks the required key `{field}`"), None),
            None => (
                "a spec has [model] and [attention]",
                format!("the spec has no `[{field}]` table"),
                Some(format!("add the `[{field}]` table; `kiln new` writes a complete spec to start from")),
            ),
        }
    } else if let Some(rest) =
        message.strip_prefix("invalid type: ").or_else(|| message.strip_prefix("invalid value: "))
    {
        let (found, expected) = rest.rsplit_once(", expected ").unwrap_or((rest, "another type"));
        if index.is_array_of_tables(at) {
            (
                "values have the documented type",
                format!("`{at}` is an array of tables, but it is a single table"),
                Some(format!("write `[{at}]`, not `[[{at}]]`")),
            )
        } else {
            let found = plain_type(found);
            let expected = plain_type(expected);
            // `d_model = "64"`: a number or boolean written as a string.
            let quoted = found.strip_prefix("string \"").and_then(|f| f.strip_suffix('"')).unwrap_or("");
            let unquoted_fits = (expected.contains("integer") && quoted.parse::<u64>().is_ok())
                || (expected.contains("number") && quoted.parse::<f64>().is_ok())
                || (expected.contains("boolean") && (quoted == "true" || quoted == "false"));
            let help = unquoted_fits.then(|| format!("write {quoted} without quotes"));
            let message = match &key {
                Some(k) => format!("`{k}` must be {expected}, found {found}"),
                None => format!("expected {expected}, found {found}"),
            };
            ("values have the documented type", message, help)
        }
    } else if message == "duplicate key" {
        let word = source.get(span.clone()).unwrap_or("").trim();
        (
            "the spec is valid TOML",
            format!("duplicate key `{word}`"),
            Some("a key is written once in its table; remove one of the two".to_string()),
        )
    } else {
        ("the spec is valid TOML", message, None)
    };
    let mut d = Diagnostic::new(rule, message).with_span(span);
    d.key = key;
    d.help = help;
    d
}

/// serde's names of types ("u64", "map", "struct Model") in the words of the spec language.
fn plain_type(serde: &str) -> String {
    let s = serde.trim();
    if let Some(big) = s.strip_suffix(" as i128") {
        return format!("{big}, which is out of range");
    }
    match s {
        "u64" | "usize" => "a non-negative integer".into(),
        "f64" => "a number".into(),
        "a boolean" => "a boolean (`true` or `false`)".into(),
        "map" | "a map" => "a table".into(),
        "sequence" => "an array".into(),
        _ if s.starts_with("struct ") => "a table".into(),
        _ => s.into(),
    }
}

/// Splits serde's "unknown field `x`, expected one of `a`, `b`" (or "expected `a`") into the word and the
/// candidates.
fn parse_unknown(message: &str, prefix: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix(prefix)?;
    let mut ticks = rest.split('`').skip(1).step_by(2).map(str::to_string);
    let word = ticks.next()?;
    Some((word, ticks.collect()))
}

impl<'de> Deserialize<'de> for EmbeddingScale {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = EmbeddingScale;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number or \"sqrt-d-model\"")
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(EmbeddingScale::Value(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(EmbeddingScale::Value(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(EmbeddingScale::Value(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "sqrt-d-model" => Ok(EmbeddingScale::Named(ScaleRule::SqrtDModel)),
                    _ => Err(E::unknown_variant(v, &["sqrt-d-model"])),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for ResidualScale {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ResidualScale;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number, \"gpt2\" or \"none\"")
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(ResidualScale::Value(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(ResidualScale::Value(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(ResidualScale::Value(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "gpt2" => Ok(ResidualScale::Gpt2),
                    "none" => Ok(ResidualScale::None),
                    _ => Err(E::unknown_variant(v, &["gpt2", "none"])),
                }
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_of_only_comments_is_empty() {
        let d = parse_spec("# nothing here\n\n# still nothing\n").unwrap_err();
        assert_eq!(d.message, "the spec is empty");
    }

    #[test]
    fn a_missing_table_is_not_blamed_on_the_first_one() {
        // serde reports the missing top-level key at offset 0, where `[model]` starts.
        let d = parse_spec("[model]\nkind = \"decoder\"\nvocab = 8\nd_model = 8\nlayers = 1\n").unwrap_err();
        assert_eq!(d.message, "the spec has no `[attention]` table");
        assert_eq!(d.key, None);
    }

    #[test]
    fn a_nested_unknown_table_names_the_unknown_key() {
        let src = "[model.sizes.hidden]\nd_ff = 1\n";
        let d = parse_spec(src).unwrap_err();
        assert_eq!(d.key.as_deref(), Some("model.sizes"));
        assert_eq!(d.message, "unknown key `sizes` in `model`");
    }
}
