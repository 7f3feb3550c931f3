//! Parsing: TOML text -> [`Spec`], plus a [`SpanIndex`] so later stages can point at keys.

use super::{EmbeddingScale, ScaleRule, Spec};
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
            let path = if prefix.is_empty() {
                key.get_ref().to_string()
            } else {
                format!("{prefix}.{}", key.get_ref())
            };
            self.entries.insert(path.clone(), Entry { key: key.span(), value: value.span() });
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

    /// The innermost path whose key or value contains `span`.
    pub fn path_at(&self, span: &Range<usize>) -> Option<&str> {
        self.entries
            .iter()
            .filter(|(_, e)| {
                (e.key.start <= span.start && span.end <= e.key.end)
                    || (e.value.start <= span.start && span.end <= e.value.end)
            })
            .max_by_key(|(p, _)| p.matches('.').count())
            .map(|(p, _)| p.as_str())
    }
}

/// Parses spec text. Errors carry a span and, for misspelled keys or values, a suggestion.
pub fn parse_spec(source: &str) -> Result<(Spec, SpanIndex), Diagnostic> {
    if source.trim().is_empty() {
        return Err(Diagnostic::new("a spec has [model] and [attention]", "the spec is empty")
            .with_span(0..0)
            .with_help("start from one of the files in models/"));
    }
    let index = SpanIndex::new(source);
    match toml::from_str::<Spec>(source) {
        Ok(spec) => Ok((spec, index)),
        Err(err) => Err(from_toml_error(&err, &index)),
    }
}

fn from_toml_error(err: &toml::de::Error, index: &SpanIndex) -> Diagnostic {
    let message = err.message().trim().to_string();
    let span = err.span().unwrap_or(0..0);
    let key = index.path_at(&span).map(str::to_string);
    let (rule, help) = if let Some((word, expected)) = parse_unknown(&message, "unknown field") {
        let help = did_you_mean(&word, expected.iter().map(String::as_str))
            .map(|s| format!("did you mean `{s}`?"))
            .or_else(|| Some(format!("allowed keys here: {}", expected.join(", "))));
        ("no unknown keys", help)
    } else if let Some((word, expected)) = parse_unknown(&message, "unknown variant") {
        let help = did_you_mean(&word, expected.iter().map(String::as_str))
            .map(|s| format!("did you mean `{s}`?"))
            .or_else(|| Some(format!("allowed values: {}", expected.join(", "))));
        ("values come from a fixed set", help)
    } else if message.starts_with("missing field") {
        ("required keys are present", None)
    } else if message.starts_with("invalid type") || message.starts_with("invalid value") {
        ("values have the documented type", None)
    } else {
        ("the spec is valid TOML", None)
    };
    let message = match &key {
        Some(k) if !message.contains('\n') => format!("{message} (at `{k}`)"),
        _ => message.replace('\n', " "),
    };
    let mut d = Diagnostic::new(rule, message).with_span(span);
    d.key = key;
    d.help = help;
    d
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
