//! Weight maps: where each graph parameter comes from in a checkpoint.
//!
//! Graph parameters have canonical names (`layers.3.attn.q.weight`, stored `[out, in]` so that a
//! projection is `x @ W^T`). A weight map is a list of entries from a parameter *template*
//! (`layers.{i}.attn.q.weight`, `layers.{i}.moe.experts.{e}.up.weight`) to a [`Source`]: the
//! checkpoint tensor name (with the same placeholders), whether it is stored transposed (GPT-2's
//! Conv1D), and whether it is one part of a packed tensor (fused Q/K/V, gate/up).
//!
//! Presets are the weight maps of common families, written as TOML data in `presets/*.toml` and
//! read with the same code as a spec's `[weights.tensors]` overrides. A family whose tensor names
//! depend on a knob of the spec writes those entries per [`Variant`] (`[ffn.gated]`,
//! `[ffn.ungated]`), so one preset serves every spec of the family.

use serde::Deserialize;
use std::collections::BTreeMap;

/// How a packed tensor holds its parts (after any transpose, along the output rows).
#[derive(Clone, Copy, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Pack {
    /// Q rows, then K rows, then V rows (torch `in_proj_weight`, GPT-2 `c_attn`); K and V may be
    /// narrower than Q under grouped-query attention.
    QkvBlocks,
    /// Grouped per head: `[head][q|k|v][head_dim]` (BLOOM, GPT-NeoX); needs `kv_heads == heads`.
    QkvPerHead,
    /// Gate rows, then up rows (Phi-3 `gate_up_proj`).
    GateUpBlocks,
}

/// Which part of a packed tensor a parameter is.
#[derive(Clone, Copy, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PackPart {
    /// Query.
    Q,
    /// Key.
    K,
    /// Value.
    V,
    /// Gate of a gated feed-forward.
    Gate,
    /// Up projection of a gated feed-forward.
    Up,
}

/// A weight-map entry as written: a tensor name, or a table with options.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceSpec(pub Source);

/// Where one parameter comes from.
#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Source {
    /// Checkpoint tensor name; `{i}` is the layer index, `{e}` the expert index.
    pub tensor: String,
    /// The tensor is stored `[in, out]` (GPT-2 Conv1D) and is transposed on load.
    #[serde(default)]
    pub transpose: bool,
    /// The tensor packs several parameters.
    #[serde(default)]
    pub pack: Option<Pack>,
    /// Which part of the pack this parameter is (required with `pack`).
    #[serde(default)]
    pub part: Option<PackPart>,
    /// Rows are in llama.cpp's interleaved RoPE order and are put back in rotate-half order.
    #[serde(default)]
    pub rope_unpermute: bool,
}

impl<'de> Deserialize<'de> for SourceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Tables are decoded strictly through `Source` so unknown options are reported.
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = SourceSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a tensor name or a table { tensor = ..., transpose = ..., pack = ..., part = ... }")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(SourceSpec(Source::named(v)))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Source::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(SourceSpec)
            }
        }
        d.deserialize_any(V)
    }
}

impl Source {
    /// A plain tensor, stored as the graph wants it.
    pub fn named(tensor: &str) -> Self {
        Source { tensor: tensor.to_string(), transpose: false, pack: None, part: None, rope_unpermute: false }
    }
}

/// The sizes a weight map needs to cut packed tensors apart, recorded with the map in artifacts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PackDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Feed-forward width.
    pub d_ff: usize,
}

impl PackDims {
    /// The sizes of a validated spec.
    pub fn of(spec: &super::Resolved) -> Self {
        PackDims {
            heads: spec.spec.attention.heads as usize,
            kv_heads: spec.kv_heads as usize,
            head_dim: spec.head_dim as usize,
            d_ff: spec.d_ff as usize,
        }
    }
}

/// A source with its placeholders filled in, for one concrete parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The checkpoint tensor name.
    pub tensor: String,
    /// The entry it came from.
    pub source: Source,
    /// The parameter template that matched.
    pub template: String,
}

/// A complete weight map: preset entries with the spec's overrides applied.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WeightMap {
    /// The preset it started from.
    pub preset: Option<String>,
    /// Entries by parameter template.
    pub entries: BTreeMap<String, Source>,
}

impl WeightMap {
    /// Finds the entry for a concrete parameter name and fills in its placeholders.
    pub fn resolve(&self, param: &str) -> Option<Resolved> {
        self.entries.iter().find_map(|(template, source)| {
            let bindings = match_template(template, param)?;
            let mut tensor = source.tensor.clone();
            for (name, value) in bindings {
                tensor = tensor.replace(&format!("{{{name}}}"), &value.to_string());
            }
            Some(Resolved { tensor, source: source.clone(), template: template.clone() })
        })
    }
}

/// Matches a concrete name against a template with `{i}`/`{e}` placeholders (each a decimal number).
pub fn match_template(template: &str, name: &str) -> Option<Vec<(char, usize)>> {
    let mut bindings = Vec::new();
    let mut rest = name;
    let mut t = template;
    loop {
        match t.find('{') {
            None => return (t == rest).then_some(bindings),
            Some(open) => {
                let literal = &t[..open];
                rest = rest.strip_prefix(literal)?;
                let close = t[open..].find('}')? + open;
                let placeholder = t[open + 1..close].chars().next()?;
                let digits = rest.chars().take_while(char::is_ascii_digit).count();
                if digits == 0 {
                    return None;
                }
                bindings.push((placeholder, rest[..digits].parse().ok()?));
                rest = &rest[digits..];
                t = &t[close + 1..];
            }
        }
    }
}

/// The names of the built-in presets.
pub const PRESETS: &[&str] =
    &["bert", "bloom", "gemma3", "gguf-gemma3", "gguf-llama", "gpt2", "llama", "mixtral", "t5", "torch-transformer"];

/// The text of a built-in preset.
pub fn preset_source(name: &str) -> Option<&'static str> {
    Some(match name {
        "bert" => include_str!("presets/bert.toml"),
        "bloom" => include_str!("presets/bloom.toml"),
        "gemma3" => include_str!("presets/gemma3.toml"),
        "t5" => include_str!("presets/t5.toml"),
        "gguf-gemma3" => include_str!("presets/gguf-gemma3.toml"),
        "gguf-llama" => include_str!("presets/gguf-llama.toml"),
        "gpt2" => include_str!("presets/gpt2.toml"),
        "llama" => include_str!("presets/llama.toml"),
        "mixtral" => include_str!("presets/mixtral.toml"),
        "torch-transformer" => include_str!("presets/torch-transformer.toml"),
        _ => return None,
    })
}

/// The spec's choices a preset's entries may depend on: a family whose checkpoints name a tensor
/// by the variant it belongs to (T5 v1.0's one `wi` against v1.1's `wi_0`/`wi_1`) has one preset
/// whose entries follow the spec.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Variant {
    /// The feed-forward is gated (`ffn.gated`).
    pub gated_ffn: bool,
}

impl Variant {
    /// The variant a spec asks for.
    pub fn of(spec: &super::Spec) -> Self {
        Variant { gated_ffn: spec.ffn.gated }
    }
}

/// A preset file: entries for every spec at the top level, and the entries that depend on the
/// feed-forward kind under `[ffn.gated]` and `[ffn.ungated]`.
#[derive(Deserialize)]
struct PresetFile {
    #[serde(default)]
    ffn: FfnEntries,
    #[serde(flatten)]
    entries: BTreeMap<String, SourceSpec>,
}

/// A preset's entries by feed-forward kind.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FfnEntries {
    /// With `ffn.gated = true`.
    #[serde(default)]
    gated: BTreeMap<String, SourceSpec>,
    /// With `ffn.gated = false`.
    #[serde(default)]
    ungated: BTreeMap<String, SourceSpec>,
}

/// A built-in preset's entries for a spec of `variant` (they are tested to parse, so an error here
/// is a bug in kiln).
#[expect(clippy::panic, reason = "built-in presets are part of the program; tests parse every one")]
pub fn preset(name: &str, variant: Variant) -> Option<BTreeMap<String, Source>> {
    let text = preset_source(name)?;
    let file: PresetFile =
        toml::from_str(text).unwrap_or_else(|e| panic!("built-in preset `{name}` does not parse: {e}"));
    let chosen = if variant.gated_ffn { file.ffn.gated } else { file.ffn.ungated };
    Some(file.entries.into_iter().chain(chosen).map(|(k, v)| (k, v.0)).collect())
}

/// Every parameter template the graph builder can produce. An override naming anything else is an
/// error (with a suggestion). Encoder-decoder models prefix per-stack names with `encoder.`/`decoder.`.
pub const TEMPLATES: &[&str] = &[
    "embed.tokens",
    "embed.positions",
    "embed.token_types",
    "embed.norm.weight",
    "embed.norm.bias",
    "layers.{i}.attn_norm.weight",
    "layers.{i}.attn_norm.bias",
    "layers.{i}.attn_post_norm.weight",
    "layers.{i}.attn_post_norm.bias",
    "layers.{i}.attn.q_norm.weight",
    "layers.{i}.attn.q_norm.bias",
    "layers.{i}.attn.k_norm.weight",
    "layers.{i}.attn.k_norm.bias",
    "layers.{i}.attn.proj_k",
    "layers.{i}.attn.proj_v",
    "layers.{i}.attn.q.weight",
    "layers.{i}.attn.q.bias",
    "layers.{i}.attn.k.weight",
    "layers.{i}.attn.k.bias",
    "layers.{i}.attn.v.weight",
    "layers.{i}.attn.v.bias",
    "layers.{i}.attn.o.weight",
    "layers.{i}.attn.o.bias",
    "layers.{i}.cross_norm.weight",
    "layers.{i}.cross_norm.bias",
    "layers.{i}.cross_post_norm.weight",
    "layers.{i}.cross_post_norm.bias",
    "layers.{i}.cross.q.weight",
    "layers.{i}.cross.q.bias",
    "layers.{i}.cross.k.weight",
    "layers.{i}.cross.k.bias",
    "layers.{i}.cross.v.weight",
    "layers.{i}.cross.v.bias",
    "layers.{i}.cross.o.weight",
    "layers.{i}.cross.o.bias",
    "layers.{i}.ffn_norm.weight",
    "layers.{i}.ffn_norm.bias",
    "layers.{i}.ffn_post_norm.weight",
    "layers.{i}.ffn_post_norm.bias",
    "layers.{i}.ffn.gate.weight",
    "layers.{i}.ffn.gate.bias",
    "layers.{i}.ffn.up.weight",
    "layers.{i}.ffn.up.bias",
    "layers.{i}.ffn.down.weight",
    "layers.{i}.ffn.down.bias",
    "layers.{i}.moe.router.weight",
    "layers.{i}.moe.experts.{e}.gate.weight",
    "layers.{i}.moe.experts.{e}.up.weight",
    "layers.{i}.moe.experts.{e}.down.weight",
    "layers.{i}.moe.experts.{e}.gate.bias",
    "layers.{i}.moe.experts.{e}.up.bias",
    "layers.{i}.moe.experts.{e}.down.bias",
    "relative_bias",
    "final_norm.weight",
    "final_norm.bias",
    "head.transform.weight",
    "head.transform.bias",
    "head.transform_norm.weight",
    "head.transform_norm.bias",
    "head.weight",
    "head.bias",
];

/// Whether `template` is a parameter template the builder can produce (optionally stack-prefixed).
pub fn is_known_template(template: &str) -> bool {
    let bare = template.strip_prefix("encoder.").or_else(|| template.strip_prefix("decoder.")).unwrap_or(template);
    TEMPLATES.contains(&bare) || TEMPLATES.contains(&template)
}

/// All known templates, including stack-prefixed forms (for suggestions).
pub fn all_templates() -> Vec<String> {
    let mut all: Vec<String> = TEMPLATES.iter().map(|t| t.to_string()).collect();
    for stack in ["encoder.", "decoder."] {
        all.extend(TEMPLATES.iter().map(|t| format!("{stack}{t}")));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_bind_placeholders() {
        assert_eq!(match_template("layers.{i}.attn.q.weight", "layers.12.attn.q.weight"), Some(vec![('i', 12)]));
        assert_eq!(
            match_template("layers.{i}.moe.experts.{e}.up.weight", "layers.1.moe.experts.3.up.weight"),
            Some(vec![('i', 1), ('e', 3)])
        );
        assert_eq!(match_template("layers.{i}.attn.q.weight", "layers.x.attn.q.weight"), None);
        assert_eq!(match_template("head.weight", "head.weight"), Some(vec![]));
        assert_eq!(match_template("head.weight", "head.bias"), None);
    }

    #[test]
    fn every_preset_parses_and_names_known_templates() {
        for name in PRESETS {
            let file: PresetFile = toml::from_str(preset_source(name).expect("listed preset exists")).unwrap();
            assert!(!file.entries.is_empty(), "{name}");
            for variant in [&file.ffn.gated, &file.ffn.ungated] {
                for template in variant.keys() {
                    assert!(!file.entries.contains_key(template), "preset {name}: {template} given twice");
                }
            }
            for gated_ffn in [false, true] {
                for template in preset(name, Variant { gated_ffn }).expect("listed preset exists").keys() {
                    assert!(is_known_template(template), "preset {name}: unknown template {template}");
                }
            }
        }
    }

    #[test]
    fn the_t5_preset_names_the_feed_forward_of_its_kind() {
        let up = "encoder.layers.{i}.ffn.up.weight";
        let gated = preset("t5", Variant { gated_ffn: true }).unwrap();
        assert_eq!(gated[up].tensor, "encoder.block.{i}.layer.1.DenseReluDense.wi_1.weight");
        assert!(gated.contains_key("decoder.layers.{i}.ffn.gate.weight"));
        let plain = preset("t5", Variant { gated_ffn: false }).unwrap();
        assert_eq!(plain[up].tensor, "encoder.block.{i}.layer.1.DenseReluDense.wi.weight");
        assert_eq!(
            plain["decoder.layers.{i}.ffn.up.weight"].tensor,
            "decoder.block.{i}.layer.2.DenseReluDense.wi.weight"
        );
        assert!(!plain.contains_key("encoder.layers.{i}.ffn.gate.weight"));
        // Entries that do not depend on the kind are in both.
        assert_eq!(gated["head.weight"], plain["head.weight"]);
    }
}
