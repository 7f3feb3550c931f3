//! Specs from checkpoints: the architecture a checkpoint's own description states, written as a
//! kiln spec.
//!
//! Two descriptions are read: a Hugging Face `config.json` ([`hf_config`]) and the metadata of a
//! GGUF file ([`gguf`], keyed by `general.architecture`). Each supported family has a mapping from
//! its keys to the spec's knobs; every value written carries a comment naming where it came from
//! (`# config.json: rope_theta`, or the family's fixed choice), so the spec is the readable,
//! editable starting point for a variant.
//!
//! The mapping is exact or refused: a family kiln has no mapping for, or an option of a known family
//! that kiln cannot express (`rope_scaling`, a packing it does not read, ...), is an
//! [`ImportError`] naming it, never an approximation.
//!
//! The weights are mapped through a preset when the family has one, and by explicit
//! `[weights.tensors]` entries otherwise. Only entries for parameters the spec's graph has are
//! written. When the checkpoint's tensor names are known ([`Hints::tensors`]) and they carry a
//! prefix the family's names lack (`bert.` in `BertForMaskedLM`), the entries are written out with
//! it. Whether every parameter is then found, with the right shape, is checked against the tensors
//! themselves by `kiln-runtime`'s importer.

mod gguf;
mod hf;

pub use gguf::{MetaValue, gguf};
pub use hf::hf_config;

use super::weightmap::{self, Pack, PackPart, Source, WeightMap};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Why a checkpoint's description could not be imported.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ImportError {
    /// What is wrong or unsupported, naming the key and its value.
    pub message: String,
}

impl ImportError {
    fn new(message: impl Into<String>) -> Self {
        ImportError { message: message.into() }
    }
}

type Result<T> = std::result::Result<T, ImportError>;

/// What the importer may know beside the description itself.
#[derive(Clone, Debug, Default)]
pub struct Hints {
    /// The spec's `model.name` (default: the family).
    pub name: Option<String>,
    /// Names of the checkpoint's tensors, to fit the weight map to them (a prefix) when given.
    pub tensors: Option<BTreeSet<String>>,
    /// A sentence-transformers pipeline around the model: mean pooling (and whether it is
    /// normalized), from `modules.json` and `1_Pooling/config.json`.
    pub sentence_pooling: Option<SentencePooling>,
}

/// The pooling of a sentence-transformers model (`modules.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SentencePooling {
    /// A `Normalize` module follows the pooling.
    pub normalize: bool,
    /// The longest input the pipeline embeds (`sentence_bert_config.json`: `max_seq_length`).
    pub max_seq_length: Option<u64>,
}

/// An imported spec.
#[derive(Clone, Debug, PartialEq)]
pub struct Imported {
    /// The spec, as TOML with comments.
    pub text: String,
    /// The family it was read as (`llama`, `gguf:gemma3`, ...).
    pub family: String,
}

/// A spec value as written.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Val {
    Int(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// An inline table, its fields already written (`block = 4, global = 1`).
    Table(String),
    /// An array.
    List(Vec<Val>),
}

impl From<u64> for Val {
    fn from(v: u64) -> Self {
        Val::Int(v)
    }
}
impl From<f64> for Val {
    fn from(v: f64) -> Self {
        Val::Float(v)
    }
}
impl From<bool> for Val {
    fn from(v: bool) -> Self {
        Val::Bool(v)
    }
}
impl From<&str> for Val {
    fn from(v: &str) -> Self {
        Val::Str(v.to_string())
    }
}

impl Val {
    fn render(&self) -> String {
        match self {
            Val::Int(v) => v.to_string(),
            // `{:?}` is the shortest text that reads back as the same f64, always with a `.` or
            // an exponent (TOML's float syntax).
            Val::Float(v) => format!("{v:?}"),
            Val::Bool(v) => v.to_string(),
            Val::Str(s) => quote(s),
            Val::Table(fields) => format!("{{ {fields} }}"),
            Val::List(items) => format!("[{}]", items.iter().map(Val::render).collect::<Vec<_>>().join(", ")),
        }
    }
}

/// A TOML basic string.
fn quote(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The sections in the order a spec is written.
const SECTIONS: &[&str] = &["model", "embedding", "positions", "norm", "attention", "ffn", "moe", "head", "outputs"];

/// One `key = value  # note` line.
#[derive(Clone, Debug)]
struct Line {
    key: String,
    value: Val,
    note: String,
}

/// A spec being written: values with their provenance, and the weight map.
#[derive(Clone, Debug, Default)]
pub(crate) struct Draft {
    header: Vec<String>,
    lines: BTreeMap<&'static str, Vec<Line>>,
    preset: Option<(String, String)>,
    entries: Vec<(String, Source)>,
    family: String,
}

impl Draft {
    pub(crate) fn new(family: &str, header: impl Into<String>) -> Self {
        Draft { header: vec![header.into()], family: family.to_string(), ..Draft::default() }
    }

    /// A header comment line.
    pub(crate) fn comment(&mut self, line: impl Into<String>) {
        self.header.push(line.into());
    }

    /// Sets `section.key` (a section of [`SECTIONS`]) with a note on where it came from.
    pub(crate) fn set(&mut self, section: &'static str, key: &str, value: impl Into<Val>, note: impl Into<String>) {
        let lines = self.lines.entry(section).or_default();
        let line = Line { key: key.to_string(), value: value.into(), note: note.into() };
        match lines.iter_mut().find(|l| l.key == line.key) {
            Some(old) => *old = line,
            None => lines.push(line),
        }
    }

    /// Maps the weights through a built-in preset.
    pub(crate) fn preset(&mut self, name: &str, note: impl Into<String>) {
        self.preset = Some((name.to_string(), note.into()));
    }

    /// A `[weights.tensors]` entry (written only if the graph has a parameter it matches).
    pub(crate) fn tensor(&mut self, template: &str, source: Source) {
        self.entries.retain(|(t, _)| t != template);
        self.entries.push((template.to_string(), source));
    }

    /// A plain `[weights.tensors]` entry.
    pub(crate) fn named(&mut self, template: &str, tensor: &str) {
        self.tensor(template, Source::named(tensor));
    }

    /// The spec text: the header, the sections, then `weights` as given.
    fn render(&self, preset: Option<&(String, String)>, entries: &[(String, Source)]) -> String {
        let mut out = String::new();
        for line in &self.header {
            let _ = writeln!(out, "# {line}");
        }
        for section in SECTIONS {
            let Some(lines) = self.lines.get(section).filter(|l| !l.is_empty()) else { continue };
            let _ = writeln!(out, "\n[{section}]");
            for line in lines {
                let text = format!("{} = {}", line.key, line.value.render());
                if line.note.is_empty() {
                    let _ = writeln!(out, "{text}");
                } else {
                    let _ = writeln!(out, "{text:<32} # {}", line.note);
                }
            }
        }
        // `[weights]` only holds a preset; entries alone go under `[weights.tensors]`.
        if let Some((name, note)) = preset {
            let _ = writeln!(out, "\n[weights]");
            let _ = writeln!(out, "{:<32} # {note}", format!("preset = {}", quote(name)));
        }
        if !entries.is_empty() {
            let _ = writeln!(out, "\n[weights.tensors]");
            for (template, source) in entries {
                let _ = writeln!(out, "{} = {}", quote(template), render_source(source));
            }
        }
        out
    }

    /// Checks the spec, keeps the weight-map entries its graph uses, fits them to the checkpoint's
    /// tensor names when known, and returns the text.
    pub(crate) fn finish(mut self, hints: &Hints) -> Result<Imported> {
        if let Some(name) = &hints.name {
            self.set("model", "name", name.as_str(), "");
        }
        // The graph of the spec without weights tells which parameters need an entry.
        let bare = self.render(None, &[]);
        let fe = crate::front_end("imported spec", &bare).map_err(|e| {
            ImportError::new(format!(
                "the {} description gives a spec kiln refuses:\n{}\n{bare}",
                self.family,
                e.render().trim_end()
            ))
        })?;
        let params: Vec<String> = fe.graph.params().into_iter().map(|(_, name)| name.to_string()).collect();
        let used = |template: &str| params.iter().any(|p| weightmap::match_template(template, p).is_some());
        let mut entries: Vec<(String, Source)> = self.entries.iter().filter(|(t, _)| used(t)).cloned().collect();
        let mut preset = self.preset.clone();

        if let Some(tensors) = &hints.tensors {
            let mut map = WeightMap::default();
            if let Some((name, _)) = &preset {
                map.entries = weightmap::preset(name, weightmap::Variant::of(&fe.spec.spec)).unwrap_or_default();
            }
            map.entries.extend(entries.iter().cloned());
            if let Some(prefix) = common_prefix(&map, &params, tensors) {
                // Write every entry the graph uses out in place of the preset, with the prefix on
                // those whose names the checkpoint lacks (a task model's own head, `cls.` beside
                // `bert.`, is found as it is).
                let lacking: BTreeSet<String> = params
                    .iter()
                    .filter_map(|p| map.resolve(p))
                    .filter(|r| !tensors.contains(&r.tensor))
                    .map(|r| r.template)
                    .collect();
                let mut all: Vec<(String, Source)> = map.entries.into_iter().filter(|(t, _)| used(t)).collect();
                for (template, source) in &mut all {
                    if lacking.contains(template) {
                        source.tensor = format!("{prefix}{}", source.tensor);
                    }
                }
                let some = if all.iter().all(|(t, _)| lacking.contains(t)) {
                    ""
                } else {
                    ", but for names the checkpoint holds without it"
                };
                let what = match &preset {
                    Some((name, _)) => format!("the `{name}` preset's entries are written out with it{some}"),
                    None => format!("the entries carry it{some}"),
                };
                self.comment(format!("The checkpoint's tensor names start with `{prefix}`: {what}."));
                preset = None;
                entries = all;
            }
        }
        let text = self.render(preset.as_ref(), &entries);
        crate::front_end("imported spec", &text).map_err(|e| {
            ImportError::new(format!(
                "internal error, please report: the imported spec does not check:\n{}",
                e.render()
            ))
        })?;
        Ok(Imported { text, family: self.family })
    }
}

/// A weight-map entry as TOML: a string, or an inline table with its options.
fn render_source(source: &Source) -> String {
    let plain = !source.transpose && source.pack.is_none() && source.part.is_none() && !source.rope_unpermute;
    if plain {
        return quote(&source.tensor);
    }
    let mut fields = vec![format!("tensor = {}", quote(&source.tensor))];
    if source.transpose {
        fields.push("transpose = true".into());
    }
    if let Some(pack) = source.pack {
        fields.push(format!("pack = {}", quote(pack_name(pack))));
    }
    if let Some(part) = source.part {
        fields.push(format!("part = {}", quote(part_name(part))));
    }
    if source.rope_unpermute {
        fields.push("rope_unpermute = true".into());
    }
    format!("{{ {} }}", fields.join(", "))
}

/// A packing as the spec names it.
fn pack_name(pack: Pack) -> &'static str {
    match pack {
        Pack::QkvBlocks => "qkv-blocks",
        Pack::QkvPerHead => "qkv-per-head",
        Pack::GateUpBlocks => "gate-up-blocks",
    }
}

/// A part of a pack as the spec names it.
fn part_name(part: PackPart) -> &'static str {
    match part {
        PackPart::Q => "q",
        PackPart::K => "k",
        PackPart::V => "v",
        PackPart::Gate => "gate",
        PackPart::Up => "up",
    }
}

/// A prefix that, put before every tensor name the map gives for `params` that the checkpoint
/// lacks, makes all of them present (and is needed: at least one is missing without it). Names the
/// checkpoint has as they are keep no prefix.
fn common_prefix(map: &WeightMap, params: &[String], tensors: &BTreeSet<String>) -> Option<String> {
    let wanted: Vec<String> = params.iter().filter_map(|p| map.resolve(p).map(|r| r.tensor)).collect();
    let missing: Vec<&String> = wanted.iter().filter(|t| !tensors.contains(*t)).collect();
    let first = missing.first()?;
    // Candidates: what precedes the first missing name in a tensor ending with it.
    let candidates: BTreeSet<String> = tensors
        .iter()
        .filter_map(|t| t.strip_suffix(first.as_str()))
        .filter(|p| p.ends_with('.'))
        .map(str::to_string)
        .collect();
    candidates.into_iter().find(|prefix| missing.iter().all(|t| tensors.contains(&format!("{prefix}{t}"))))
}

/// An activation as the spec names it, from a Hugging Face `hidden_act` value.
pub(crate) fn activation(value: &str, key: &str) -> Result<&'static str> {
    Ok(match value {
        "gelu" => "gelu",
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => "gelu-tanh",
        "silu" | "swish" => "silu",
        "relu" => "relu",
        other => {
            return Err(ImportError::new(format!(
                "`{key} = \"{other}\"` is not supported (kiln's activations: gelu, gelu_new / gelu_pytorch_tanh, silu, relu)"
            )));
        }
    })
}

/// The period `n` of a layer pattern whose global layers are exactly `n - 1`, `2n - 1`, ...
/// (`attention.global_every`), given which layers are global; `None` if it has no such form.
pub(crate) fn global_period(global: &[bool]) -> Option<u64> {
    let first = global.iter().position(|&g| g)?;
    let n = first + 1;
    let fits = global.iter().enumerate().all(|(i, &g)| g == ((i + 1) % n == 0));
    fits.then_some(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_periods() {
        assert_eq!(global_period(&[false, false, false, true]), Some(4));
        assert_eq!(global_period(&[false, true, false, true, false]), Some(2));
        assert_eq!(global_period(&[true, true]), Some(1));
        assert_eq!(global_period(&[false, true, true]), None);
        assert_eq!(global_period(&[false, false]), None);
    }

    #[test]
    fn sources_render_as_the_spec_writes_them() {
        let mut s = Source::named("a.{i}.w");
        assert_eq!(render_source(&s), "\"a.{i}.w\"");
        s.transpose = true;
        s.pack = Some(weightmap::Pack::QkvBlocks);
        s.part = Some(weightmap::PackPart::K);
        assert_eq!(
            render_source(&s),
            "{ tensor = \"a.{i}.w\", transpose = true, pack = \"qkv-blocks\", part = \"k\" }"
        );
    }
}
