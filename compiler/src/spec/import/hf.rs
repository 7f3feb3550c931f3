//! Hugging Face `config.json` -> spec, one mapping per `model_type`.
//!
//! Each value the config states is written with a `# config.json: KEY` note; a value the config
//! leaves out is the default of the family's transformers config class, and a choice the family's
//! modelling code makes (the norm kind, which projections have biases) is noted as fixed by the
//! architecture. Both transformers 4 keys (`rope_theta`, `rope_scaling`) and transformers 5 keys
//! (`rope_parameters`, `layer_types`) are read.

use super::{Draft, Hints, ImportError, Imported, Result, SentencePooling, Val, activation, global_period};
use crate::spec::LayerKind;
use crate::spec::weightmap::{Pack, PackPart, Source, Variant};
use serde_json::{Map, Value};

/// The families this module maps, for the refusal of any other `model_type`.
const FAMILIES: &str = "bert, bloom, falcon, gemma2, gemma3_text, gpt2, gpt_bigcode, gpt_neox, llama, mistral, \
     mixtral, mt5, olmo2, phi3, qwen2, qwen3, starcoder2, t5";

/// Imports a Hugging Face `config.json` (its text).
pub fn hf_config(text: &str, hints: &Hints) -> Result<Imported> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ImportError::new(format!("config.json is not valid JSON: {e}")))?;
    let Value::Object(map) = &value else {
        return Err(ImportError::new("config.json is not a JSON object"));
    };
    let cfg = Config { map };
    let mut draft = match cfg.str("model_type")? {
        Some(family @ ("llama" | "mistral" | "mixtral" | "qwen2" | "qwen3" | "phi3" | "olmo2" | "starcoder2")) => {
            llama_like(&cfg, family)?
        }
        Some(family @ ("gemma2" | "gemma3_text")) => gemma(&cfg, family)?,
        Some("gemma3") => {
            return Err(ImportError::new(
                "`model_type = \"gemma3\"` is Gemma 3 with its vision tower, which kiln does not support; a \
                 text-only checkpoint has `model_type = \"gemma3_text\"`",
            ));
        }
        Some("gpt2") => gpt2(&cfg)?,
        Some("gpt_bigcode") => gpt_bigcode(&cfg)?,
        Some("bloom") => bloom(&cfg)?,
        Some("gpt_neox") => gpt_neox(&cfg)?,
        Some("falcon") => falcon(&cfg)?,
        Some("bert") => bert(&cfg, hints)?,
        Some(family @ ("t5" | "mt5")) => t5(&cfg, family)?,
        Some(other) => {
            return Err(ImportError::new(format!(
                "`model_type = \"{other}\"` is not supported; kiln imports {FAMILIES}"
            )));
        }
        // The torch modules of the golden cases that are not transformers models describe
        // themselves with a `kind`.
        None => match cfg.str("kind")? {
            Some("torch.nn.Transformer seq2seq") => torch_transformer(&cfg)?,
            Some("lucidrains linformer.LinformerLM") => linformer(&cfg)?,
            Some("BigBird-style block-sparse encoder") => bigbird(&cfg)?,
            Some(other) => return Err(ImportError::new(format!("`kind = \"{other}\"` is not a model kiln imports"))),
            None => return Err(ImportError::new("config.json has no `model_type`")),
        },
    };
    if let Some(pooling) = hints.sentence_pooling {
        sentence_pooling(&mut draft, pooling);
    }
    draft.finish(hints)
}

/// Read access to the config's keys, with typed errors naming the key.
struct Config<'a> {
    map: &'a Map<String, Value>,
}

/// `config.json: KEY`.
fn from(key: &str) -> String {
    format!("config.json: {key}")
}

impl Config<'_> {
    /// The value of a key; `null` counts as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn wrong(key: &str, value: &Value, what: &str) -> ImportError {
        ImportError::new(format!("config.json: `{key}` = {value} is not {what}"))
    }

    fn uint(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|v| v.as_u64().ok_or_else(|| Self::wrong(key, v, "a non-negative integer"))).transpose()
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| Self::wrong(key, v, "a finite number")))
            .transpose()
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| Self::wrong(key, v, "true or false"))).transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| Self::wrong(key, v, "a string"))).transpose()
    }

    /// The first of `keys` present (aliases of one setting), with the key it was found under.
    fn need_uint<'k>(&self, keys: &[&'k str]) -> Result<(u64, &'k str)> {
        for &key in keys {
            if let Some(v) = self.uint(key)? {
                return Ok((v, key));
            }
        }
        Err(ImportError::new(format!("config.json has no `{}`", keys.join("` or `"))))
    }

    /// A boolean that must be `expected` (or absent): kiln cannot express the other value.
    fn refuse_if(&self, key: &str, unsupported: bool, why: &str) -> Result<()> {
        if self.bool(key)? == Some(unsupported) {
            return Err(ImportError::new(format!("`{key} = {unsupported}` is not supported: {why}")));
        }
        Ok(())
    }

    /// `(value, note)`: the key's value, or the family's default.
    fn uint_or(&self, key: &str, default: u64, family: &str) -> Result<(u64, String)> {
        Ok(match self.uint(key)? {
            Some(v) => (v, from(key)),
            None => (default, default_of(family, key)),
        })
    }

    fn float_or(&self, key: &str, default: f64, family: &str) -> Result<(f64, String)> {
        Ok(match self.float(key)? {
            Some(v) => (v, from(key)),
            None => (default, default_of(family, key)),
        })
    }

    fn bool_or(&self, key: &str, default: bool, family: &str) -> Result<(bool, String)> {
        Ok(match self.bool(key)? {
            Some(v) => (v, from(key)),
            None => (default, default_of(family, key)),
        })
    }

    fn str_or<'s>(&'s self, key: &str, default: &'s str, family: &str) -> Result<(&'s str, String)> {
        Ok(match self.str(key)? {
            Some(v) => (v, from(key)),
            None => (default, default_of(family, key)),
        })
    }
}

/// The note of a value the config leaves to its class's default.
fn default_of(family: &str, key: &str) -> String {
    format!("{family}: `{key}` absent, transformers' default")
}

/// The note of a choice the family's modelling code makes.
fn fixed(family: &str) -> String {
    format!("{family}: fixed by the architecture")
}

fn header(family: &str, cfg: &Config) -> Result<String> {
    let arch = match cfg.get("architectures").and_then(Value::as_array).and_then(|a| a.first()) {
        Some(Value::String(a)) => format!(", {a}"),
        _ => String::new(),
    };
    Ok(format!(
        "Imported by `kiln import` from config.json (model_type \"{family}\"{arch}); each note says where its value came from."
    ))
}

/// `[model]` of a decoder-only family with the usual key names.
fn decoder_model(d: &mut Draft, cfg: &Config, family: &str) -> Result<()> {
    d.set("model", "name", family, "");
    d.set("model", "kind", "decoder", fixed(family));
    let (vocab, vk) = cfg.need_uint(&["vocab_size"])?;
    d.set("model", "vocab", vocab, from(vk));
    let (width, wk) = cfg.need_uint(&["hidden_size", "n_embd", "d_model"])?;
    d.set("model", "d_model", width, from(wk));
    let (layers, lk) = cfg.need_uint(&["num_hidden_layers", "n_layer", "num_layers"])?;
    d.set("model", "layers", layers, from(lk));
    if let Some(max) = cfg.uint("max_position_embeddings")? {
        d.set("model", "max_positions", max, from("max_position_embeddings"));
    }
    Ok(())
}

/// `attention.heads`, `kv_heads` and `head_dim` under the usual names.
fn heads(d: &mut Draft, cfg: &Config) -> Result<()> {
    let (heads, hk) = cfg.need_uint(&["num_attention_heads", "n_head"])?;
    d.set("attention", "heads", heads, from(hk));
    if let Some(kv) = cfg.uint("num_key_value_heads")? {
        d.set("attention", "kv_heads", kv, from("num_key_value_heads"));
    }
    if let Some(head_dim) = cfg.uint("head_dim")? {
        d.set("attention", "head_dim", head_dim, from("head_dim"));
    }
    Ok(())
}

/// Refuses `rope_scaling` (transformers 4) or a `rope_type` other than the default.
fn refuse_rope_scaling(scaling: &Value, key: &str) -> Result<()> {
    let Value::Object(s) = scaling else {
        return Err(ImportError::new(format!("config.json: `{key}` = {scaling} is not an object")));
    };
    for field in ["rope_type", "type"] {
        match s.get(field).and_then(Value::as_str) {
            None | Some("default") => {}
            Some(other) => {
                return Err(ImportError::new(format!(
                    "`{key}.{field} = \"{other}\"` is not supported (kiln's RoPE has no frequency scaling)"
                )));
            }
        }
    }
    Ok(())
}

/// `[positions]` of a RoPE family: theta, and the rotated fraction.
fn rope(d: &mut Draft, cfg: &Config, family: &str, default_theta: f64) -> Result<()> {
    d.set("positions", "kind", "rope", fixed(family));
    if let Some(scaling) = cfg.get("rope_scaling") {
        refuse_rope_scaling(scaling, "rope_scaling")?;
    }
    let mut theta = None;
    let mut fraction = None;
    if let Some(params) = cfg.get("rope_parameters") {
        refuse_rope_scaling(params, "rope_parameters")?;
        let sub = Config { map: params.as_object().unwrap_or(cfg.map) };
        theta = sub.float("rope_theta")?.map(|t| (t, from("rope_parameters.rope_theta")));
        fraction = sub.float("partial_rotary_factor")?.map(|f| (f, from("rope_parameters.partial_rotary_factor")));
    }
    let theta = match theta {
        Some(t) => t,
        None => match (cfg.float("rope_theta")?, cfg.float("rotary_emb_base")?) {
            (Some(t), _) => (t, from("rope_theta")),
            (None, Some(t)) => (t, from("rotary_emb_base")),
            (None, None) => (default_theta, default_of(family, "rope_theta")),
        },
    };
    d.set("positions", "theta", theta.0, theta.1);
    let fraction = match fraction {
        Some(f) => Some(f),
        None => match (cfg.float("partial_rotary_factor")?, cfg.float("rotary_pct")?) {
            (Some(f), _) => Some((f, from("partial_rotary_factor"))),
            (None, Some(f)) => Some((f, from("rotary_pct"))),
            (None, None) if family == "gpt_neox" => Some((0.25, default_of(family, "rotary_pct"))),
            (None, None) => None,
        },
    };
    if let Some((f, note)) = fraction.filter(|(f, _)| *f != 1.0) {
        d.set("positions", "fraction", f, note);
    }
    Ok(())
}

/// Which layers attend through a sliding window, from `layer_types` (transformers 5) when given.
fn layer_types(cfg: &Config) -> Result<Option<Vec<bool>>> {
    let Some(types) = cfg.get("layer_types") else { return Ok(None) };
    let list = types.as_array().ok_or_else(|| Config::wrong("layer_types", types, "a list"))?;
    list.iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(ImportError::new(format!(
                "`layer_types` entry {t} is not supported (kiln's layers: \"full_attention\", \"sliding_attention\")"
            ))),
        })
        .collect::<Result<Vec<bool>>>()
        .map(Some)
}

/// `attention.mask`, `window`, and which layers are global: `global_every` for a periodic
/// pattern, else the list `layer_types`.
fn windows(d: &mut Draft, cfg: &Config, sliding: &[bool], note: &str) -> Result<()> {
    if !sliding.iter().any(|&s| s) {
        return Ok(());
    }
    let window = cfg.uint("sliding_window")?.ok_or_else(|| {
        ImportError::new("layers use sliding-window attention but config.json has no `sliding_window`")
    })?;
    d.set("attention", "mask", "sliding-window", note.to_string());
    d.set("attention", "window", window, from("sliding_window"));
    if sliding.iter().all(|&s| s) {
        return Ok(());
    }
    let global: Vec<bool> = sliding.iter().map(|&s| !s).collect();
    match global_period(&global) {
        Some(every) => d.set("attention", "global_every", every, note.to_string()),
        None => {
            let kinds = sliding.iter().map(|&s| if s { LayerKind::SlidingWindow } else { LayerKind::Global });
            d.set(
                "attention",
                "layer_types",
                Val::List(kinds.map(|k| Val::from(k.name())).collect()),
                note.to_string(),
            );
        }
    }
    Ok(())
}

/// The sliding window of a family that applies `sliding_window` to every layer when set (Mistral,
/// Mixtral, Phi-3, Starcoder2), or only with `use_sliding_window` from `max_window_layers` on
/// (Qwen 2/3).
fn uniform_window(d: &mut Draft, cfg: &Config, family: &str, layers: u64) -> Result<()> {
    if let Some(sliding) = layer_types(cfg)? {
        return windows(d, cfg, &sliding, "config.json: layer_types");
    }
    let qwen = matches!(family, "qwen2" | "qwen3");
    if qwen {
        if cfg.bool("use_sliding_window")? != Some(true) {
            return Ok(());
        }
        // Layers from `max_window_layers` on slide.
        let from_layer = cfg.uint("max_window_layers")?.unwrap_or(0);
        let sliding: Vec<bool> = (0..layers).map(|i| i >= from_layer).collect();
        return windows(d, cfg, &sliding, "config.json: use_sliding_window, max_window_layers");
    }
    if cfg.uint("sliding_window")?.is_some() {
        let sliding = vec![true; usize::try_from(layers).unwrap_or(0).max(1)];
        return windows(d, cfg, &sliding, "config.json: sliding_window");
    }
    Ok(())
}

/// `[head]`: tied or not.
fn tied(d: &mut Draft, cfg: &Config, family: &str, default: bool) -> Result<bool> {
    let (tied, note) = cfg.bool_or("tie_word_embeddings", default, family)?;
    d.set("head", "tied", tied, note);
    Ok(tied)
}

/// LLaMA and its relatives: RoPE, RMSNorm, gated SiLU, grouped-query attention.
fn llama_like(cfg: &Config, family: &str) -> Result<Draft> {
    let mut d = Draft::new(family, header(family, cfg)?);
    decoder_model(&mut d, cfg, family)?;
    let layers = cfg.need_uint(&["num_hidden_layers"])?.0;
    rope(&mut d, cfg, family, 10000.0)?;

    let starcoder = family == "starcoder2";
    if starcoder {
        d.set("norm", "kind", "layernorm", fixed(family));
        let (eps, note) = cfg.float_or("norm_epsilon", 1e-5, family)?;
        d.set("norm", "eps", eps, note);
    } else {
        d.set("norm", "kind", "rmsnorm", fixed(family));
        let (eps, note) = cfg.float_or("rms_norm_eps", 1e-6, family)?;
        d.set("norm", "eps", eps, note);
    }
    if family == "olmo2" {
        d.set("norm", "placement", "post-sublayer", fixed(family));
    }

    heads(&mut d, cfg)?;
    match family {
        "qwen2" => {
            for key in ["q_bias", "k_bias", "v_bias"] {
                d.set("attention", key, true, fixed(family));
            }
        }
        "starcoder2" => {
            let (bias, note) = cfg.bool_or("use_bias", true, family)?;
            d.set("attention", "bias", bias, note.clone());
            d.set("ffn", "bias", bias, note);
        }
        _ => {
            let (bias, note) = cfg.bool_or("attention_bias", false, family)?;
            if bias {
                d.set("attention", "bias", true, note);
            }
        }
    }
    match family {
        "qwen3" => d.set("attention", "qk_norm", "head", fixed(family)),
        "olmo2" => d.set("attention", "qk_norm", "width", fixed(family)),
        _ => {}
    }
    uniform_window(&mut d, cfg, family, layers)?;

    let default_act = if starcoder { "gelu_pytorch_tanh" } else { "silu" };
    let (act, note) = cfg.str_or("hidden_act", default_act, family)?;
    d.set("ffn", "activation", activation(act, "hidden_act")?, note);
    d.set("ffn", "gated", !starcoder, fixed(family));
    let (d_ff, ff_key) = cfg.need_uint(&["intermediate_size"])?;
    d.set("ffn", "d_ff", d_ff, from(ff_key));
    if let Some(true) = cfg.bool("mlp_bias")? {
        d.set("ffn", "bias", true, from("mlp_bias"));
    }

    if family == "mixtral" {
        let (experts, ek) = cfg.need_uint(&["num_local_experts"])?;
        d.set("moe", "experts", experts, from(ek));
        let (top_k, tk) = cfg.need_uint(&["num_experts_per_tok"])?;
        d.set("moe", "top_k", top_k, from(tk));
        d.set("moe", "renormalize", true, fixed(family));
    }
    tied(&mut d, cfg, family, starcoder)?;

    let m = "model.layers.{i}";
    match family {
        "mixtral" => d.preset("mixtral", "Mixtral's tensor names"),
        "starcoder2" | "olmo2" => {
            d.named("embed.tokens", "model.embed_tokens.weight");
            for p in ["q", "k", "v", "o"] {
                for w in ["weight", "bias"] {
                    d.named(&format!("layers.{{i}}.attn.{p}.{w}"), &format!("{m}.self_attn.{p}_proj.{w}"));
                }
            }
            d.named("final_norm.weight", "model.norm.weight");
            d.named("final_norm.bias", "model.norm.bias");
            d.named("head.weight", "lm_head.weight");
            if starcoder {
                for w in ["weight", "bias"] {
                    d.named(&format!("layers.{{i}}.attn_norm.{w}"), &format!("{m}.input_layernorm.{w}"));
                    d.named(&format!("layers.{{i}}.ffn_norm.{w}"), &format!("{m}.post_attention_layernorm.{w}"));
                    d.named(&format!("layers.{{i}}.ffn.up.{w}"), &format!("{m}.mlp.c_fc.{w}"));
                    d.named(&format!("layers.{{i}}.ffn.down.{w}"), &format!("{m}.mlp.c_proj.{w}"));
                }
            } else {
                d.named("layers.{i}.attn_post_norm.weight", &format!("{m}.post_attention_layernorm.weight"));
                d.named("layers.{i}.ffn_post_norm.weight", &format!("{m}.post_feedforward_layernorm.weight"));
                d.named("layers.{i}.attn.q_norm.weight", &format!("{m}.self_attn.q_norm.weight"));
                d.named("layers.{i}.attn.k_norm.weight", &format!("{m}.self_attn.k_norm.weight"));
                for p in ["gate", "up", "down"] {
                    d.named(&format!("layers.{{i}}.ffn.{p}.weight"), &format!("{m}.mlp.{p}_proj.weight"));
                }
            }
        }
        _ => {
            d.preset("llama", "LLaMA-family tensor names");
            // What the preset leaves out: the output projection's bias, feed-forward biases,
            // query/key norms (Qwen 3), and Phi-3's packed projections.
            d.named("layers.{i}.attn.o.bias", &format!("{m}.self_attn.o_proj.bias"));
            for p in ["gate", "up", "down"] {
                d.named(&format!("layers.{{i}}.ffn.{p}.bias"), &format!("{m}.mlp.{p}_proj.bias"));
            }
            d.named("layers.{i}.attn.q_norm.weight", &format!("{m}.self_attn.q_norm.weight"));
            d.named("layers.{i}.attn.k_norm.weight", &format!("{m}.self_attn.k_norm.weight"));
            if family == "phi3" {
                for (p, part) in [("q", PackPart::Q), ("k", PackPart::K), ("v", PackPart::V)] {
                    let tensor = format!("{m}.self_attn.qkv_proj.weight");
                    d.tensor(&format!("layers.{{i}}.attn.{p}.weight"), packed(&tensor, Pack::QkvBlocks, part));
                }
                for (p, part) in [("gate", PackPart::Gate), ("up", PackPart::Up)] {
                    let tensor = format!("{m}.mlp.gate_up_proj.weight");
                    d.tensor(&format!("layers.{{i}}.ffn.{p}.weight"), packed(&tensor, Pack::GateUpBlocks, part));
                }
            }
        }
    }
    Ok(d)
}

fn packed(tensor: &str, pack: Pack, part: PackPart) -> Source {
    Source { pack: Some(pack), part: Some(part), ..Source::named(tensor) }
}

/// Gemma 2 and Gemma 3 (text): sandwich norms with zero-centred gains, GeGLU, sliding layers.
fn gemma(cfg: &Config, family: &str) -> Result<Draft> {
    let mut d = Draft::new(family, header(family, cfg)?);
    let gemma3 = family == "gemma3_text";
    decoder_model(&mut d, cfg, family)?;
    let layers = cfg.need_uint(&["num_hidden_layers"])?.0;
    cfg.refuse_if("use_bidirectional_attention", true, "kiln's decoders attend causally")?;
    d.set("embedding", "scale", "sqrt-d-model", fixed(family));

    // Which layers slide: `layer_types`, else the family's pattern.
    let sliding = match layer_types(cfg)? {
        Some(s) => (s, from("layer_types")),
        None if gemma3 => {
            let (pattern, note) = cfg.uint_or("sliding_window_pattern", 6, family)?;
            let pattern = pattern.max(1);
            ((0..layers).map(|i| (i + 1) % pattern != 0).collect(), note)
        }
        None => ((0..layers).map(|i| i % 2 == 0).collect(), fixed(family)),
    };

    // RoPE: one base per layer kind.
    d.set("positions", "kind", "rope", fixed(family));
    if let Some(scaling) = cfg.get("rope_scaling") {
        refuse_rope_scaling(scaling, "rope_scaling")?;
    }
    let (local, global) = match cfg.get("rope_parameters").and_then(Value::as_object) {
        Some(params) if params.contains_key("sliding_attention") || params.contains_key("full_attention") => {
            let kind = |k: &str| -> Result<Option<(f64, String)>> {
                let Some(p) = params.get(k) else { return Ok(None) };
                refuse_rope_scaling(p, &format!("rope_parameters.{k}"))?;
                let sub = Config { map: p.as_object().unwrap_or(params) };
                Ok(sub.float("rope_theta")?.map(|t| (t, from(&format!("rope_parameters.{k}.rope_theta")))))
            };
            (kind("sliding_attention")?, kind("full_attention")?)
        }
        Some(params) => {
            let p = Value::Object(params.clone());
            refuse_rope_scaling(&p, "rope_parameters")?;
            let t = Config { map: params }.float("rope_theta")?.map(|t| (t, from("rope_parameters.rope_theta")));
            (t.clone(), t)
        }
        None => {
            let global = cfg.float_or("rope_theta", 10000.0, family)?;
            let local = match cfg.float("rope_local_base_freq")? {
                Some(t) => (t, from("rope_local_base_freq")),
                None if gemma3 => (10000.0, default_of(family, "rope_local_base_freq")),
                None => global.clone(),
            };
            (Some(local), Some(global))
        }
    };
    let any_sliding = sliding.0.iter().any(|&s| s);
    let any_global = sliding.0.iter().any(|&s| !s);
    let first = if any_sliding { local.clone() } else { global.clone() };
    let (theta, note) = first.unwrap_or((10000.0, default_of(family, "rope_theta")));
    d.set("positions", "theta", theta, note);
    if any_sliding
        && any_global
        && let Some((g, note)) = global.filter(|(g, _)| *g != theta)
    {
        d.set("positions", "global_theta", g, note);
    }

    d.set("norm", "kind", "rmsnorm", fixed(family));
    let (eps, note) = cfg.float_or("rms_norm_eps", 1e-6, family)?;
    d.set("norm", "eps", eps, note);
    d.set("norm", "placement", "sandwich", fixed(family));
    d.set("norm", "gain_offset", 1.0, format!("{family}: gains are stored zero-centred (x * (1 + weight))"));

    heads(&mut d, cfg)?;
    let (bias, note) = cfg.bool_or("attention_bias", false, family)?;
    if bias {
        d.set("attention", "bias", true, note);
    }
    let (scalar, note) = cfg.float_or("query_pre_attn_scalar", 256.0, family)?;
    if scalar <= 0.0 {
        return Err(ImportError::new(format!("config.json: `query_pre_attn_scalar` = {scalar} is not positive")));
    }
    d.set("attention", "scale", 1.0 / scalar.sqrt(), format!("1 / sqrt({}), {note}", Val64(scalar)));
    windows(&mut d, cfg, &sliding.0, &sliding.1)?;
    if gemma3 {
        d.set("attention", "qk_norm", "head", fixed(family));
    }
    if let Some(cap) = cfg.float("attn_logit_softcapping")? {
        d.set("attention", "softcap", cap, from("attn_logit_softcapping"));
    }

    let act = match cfg.str("hidden_activation")? {
        Some(a) => (a, from("hidden_activation")),
        None => cfg.str_or("hidden_act", "gelu_pytorch_tanh", family)?,
    };
    d.set("ffn", "activation", activation(act.0, "hidden_activation")?, act.1);
    d.set("ffn", "gated", true, fixed(family));
    let (d_ff, ff_key) = cfg.need_uint(&["intermediate_size"])?;
    d.set("ffn", "d_ff", d_ff, from(ff_key));

    tied(&mut d, cfg, family, true)?;
    if let Some(cap) = cfg.float("final_logit_softcapping")? {
        d.set("head", "softcap", cap, from("final_logit_softcapping"));
    }
    d.preset("gemma3", "Gemma's tensor names (Gemma 2 lacks only the query/key norms)");
    for p in ["q", "k", "v", "o"] {
        d.named(&format!("layers.{{i}}.attn.{p}.bias"), &format!("model.layers.{{i}}.self_attn.{p}_proj.bias"));
    }
    Ok(d)
}

/// A float as the spec writes it, for notes.
struct Val64(f64);

impl std::fmt::Display for Val64 {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        if self.0.fract() == 0.0 && self.0.abs() < 1e15 {
            write!(f, "{}", self.0 as i64)
        } else {
            write!(f, "{:?}", self.0)
        }
    }
}

/// GPT-2: learned positions, pre-LayerNorm, Conv1D projections.
fn gpt2(cfg: &Config) -> Result<Draft> {
    let family = "gpt2";
    let mut d = Draft::new(family, header(family, cfg)?);
    gpt2_common(&mut d, cfg, family)?;
    d.preset("gpt2", "GPT-2's tensor names");
    Ok(d)
}

/// What GPT-2 and GPT-BigCode share.
fn gpt2_common(d: &mut Draft, cfg: &Config, family: &str) -> Result<()> {
    cfg.refuse_if("scale_attn_by_inverse_layer_idx", true, "kiln's attention scale is the same in every layer")?;
    cfg.refuse_if("add_cross_attention", true, "a decoder-only model with cross-attention has no encoder to attend")?;
    decoder_model(d, cfg, family)?;
    let (n_positions, pk) = cfg.need_uint(&["n_positions", "max_position_embeddings"])?;
    d.set("model", "max_positions", n_positions, from(pk));
    d.set("positions", "kind", "learned", fixed(family));
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_epsilon", 1e-5, family)?;
    d.set("norm", "eps", eps, note);
    d.set("norm", "placement", "pre", fixed(family));
    heads(d, cfg)?;
    d.set("attention", "bias", true, fixed(family));
    if cfg.bool("scale_attn_weights")? == Some(false) {
        d.set("attention", "scale", 1.0, from("scale_attn_weights"));
    }
    let default_act = if family == "gpt2" { "gelu_new" } else { "gelu_pytorch_tanh" };
    let (act, note) = cfg.str_or("activation_function", default_act, family)?;
    d.set("ffn", "activation", activation(act, "activation_function")?, note);
    d.set("ffn", "bias", true, fixed(family));
    if let Some(inner) = cfg.uint("n_inner")? {
        d.set("ffn", "d_ff", inner, from("n_inner"));
    }
    tied(d, cfg, family, true)?;
    Ok(())
}

/// GPT-BigCode (StarCoder 1, SantaCoder): GPT-2 with multi-query attention and nn.Linear.
fn gpt_bigcode(cfg: &Config) -> Result<Draft> {
    let family = "gpt_bigcode";
    let mut d = Draft::new(family, header(family, cfg)?);
    gpt2_common(&mut d, cfg, family)?;
    let (mqa, note) = cfg.bool_or("multi_query", true, family)?;
    if mqa {
        d.set("attention", "kv_heads", 1, note);
    }
    let h = "transformer.h.{i}";
    d.named("embed.tokens", "transformer.wte.weight");
    d.named("embed.positions", "transformer.wpe.weight");
    for w in ["weight", "bias"] {
        d.named(&format!("layers.{{i}}.attn_norm.{w}"), &format!("{h}.ln_1.{w}"));
        for (p, part) in [("q", PackPart::Q), ("k", PackPart::K), ("v", PackPart::V)] {
            d.tensor(
                &format!("layers.{{i}}.attn.{p}.{w}"),
                packed(&format!("{h}.attn.c_attn.{w}"), Pack::QkvBlocks, part),
            );
        }
        d.named(&format!("layers.{{i}}.attn.o.{w}"), &format!("{h}.attn.c_proj.{w}"));
        d.named(&format!("layers.{{i}}.ffn_norm.{w}"), &format!("{h}.ln_2.{w}"));
        d.named(&format!("layers.{{i}}.ffn.up.{w}"), &format!("{h}.mlp.c_fc.{w}"));
        d.named(&format!("layers.{{i}}.ffn.down.{w}"), &format!("{h}.mlp.c_proj.{w}"));
        d.named(&format!("final_norm.{w}"), &format!("transformer.ln_f.{w}"));
    }
    d.named("head.weight", "lm_head.weight");
    Ok(d)
}

/// BLOOM: ALiBi, a LayerNorm on the embedding, fused per-head Q/K/V.
fn bloom(cfg: &Config) -> Result<Draft> {
    let family = "bloom";
    let mut d = Draft::new(family, header(family, cfg)?);
    cfg.refuse_if(
        "apply_residual_connection_post_layernorm",
        true,
        "the residual taken after the norm is not a placement kiln has",
    )?;
    decoder_model(&mut d, cfg, family)?;
    d.set("embedding", "norm", true, fixed(family));
    d.set("positions", "kind", "alibi", fixed(family));
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_epsilon", 1e-5, family)?;
    d.set("norm", "eps", eps, note);
    heads(&mut d, cfg)?;
    d.set("attention", "bias", true, fixed(family));
    d.set("ffn", "activation", "gelu-tanh", fixed(family));
    d.set("ffn", "bias", true, fixed(family));
    tied(&mut d, cfg, family, true)?;
    d.preset("bloom", "BLOOM's tensor names");
    Ok(d)
}

/// GPT-NeoX (Pythia): partial rotary, parallel residual, per-head fused Q/K/V.
fn gpt_neox(cfg: &Config) -> Result<Draft> {
    let family = "gpt_neox";
    let mut d = Draft::new(family, header(family, cfg)?);
    decoder_model(&mut d, cfg, family)?;
    rope(&mut d, cfg, family, 10000.0)?;
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_eps", 1e-5, family)?;
    d.set("norm", "eps", eps, note);
    let (parallel, note) = cfg.bool_or("use_parallel_residual", true, family)?;
    d.set("norm", "parallel_residual", parallel, note);
    heads(&mut d, cfg)?;
    let (bias, note) = cfg.bool_or("attention_bias", true, family)?;
    d.set("attention", "bias", bias, note);
    let (act, note) = cfg.str_or("hidden_act", "gelu", family)?;
    d.set("ffn", "activation", activation(act, "hidden_act")?, note);
    let (d_ff, ff_key) = cfg.need_uint(&["intermediate_size"])?;
    d.set("ffn", "d_ff", d_ff, from(ff_key));
    d.set("ffn", "bias", true, fixed(family));
    tied(&mut d, cfg, family, false)?;

    let l = "gpt_neox.layers.{i}";
    d.named("embed.tokens", "gpt_neox.embed_in.weight");
    for w in ["weight", "bias"] {
        d.named(&format!("layers.{{i}}.attn_norm.{w}"), &format!("{l}.input_layernorm.{w}"));
        for (p, part) in [("q", PackPart::Q), ("k", PackPart::K), ("v", PackPart::V)] {
            let tensor = format!("{l}.attention.query_key_value.{w}");
            d.tensor(&format!("layers.{{i}}.attn.{p}.{w}"), packed(&tensor, Pack::QkvPerHead, part));
        }
        d.named(&format!("layers.{{i}}.attn.o.{w}"), &format!("{l}.attention.dense.{w}"));
        d.named(&format!("layers.{{i}}.ffn_norm.{w}"), &format!("{l}.post_attention_layernorm.{w}"));
        d.named(&format!("layers.{{i}}.ffn.up.{w}"), &format!("{l}.mlp.dense_h_to_4h.{w}"));
        d.named(&format!("layers.{{i}}.ffn.down.{w}"), &format!("{l}.mlp.dense_4h_to_h.{w}"));
        d.named(&format!("final_norm.{w}"), &format!("gpt_neox.final_layer_norm.{w}"));
    }
    d.named("head.weight", "embed_out.weight");
    Ok(d)
}

/// Falcon (7B layout and the classic one): RoPE, multi-query or per-head fused Q/K/V, parallel
/// attention sharing one norm.
fn falcon(cfg: &Config) -> Result<Draft> {
    let family = "falcon";
    let mut d = Draft::new(family, header(family, cfg)?);
    cfg.refuse_if(
        "new_decoder_architecture",
        true,
        "its Q/K/V are packed per key/value group ([group][q..., k, v]), a packing kiln does not read",
    )?;
    cfg.refuse_if("alibi", true, "Falcon scales its ALiBi biases with the logits, unlike kiln's (BLOOM's) ALiBi")?;
    decoder_model(&mut d, cfg, family)?;
    rope(&mut d, cfg, family, 10000.0)?;
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_epsilon", 1e-5, family)?;
    d.set("norm", "eps", eps, note);
    let (parallel, note) = cfg.bool_or("parallel_attn", true, family)?;
    d.set("norm", "parallel_residual", parallel, note);
    heads(&mut d, cfg)?;
    let (mqa, note) = cfg.bool_or("multi_query", true, family)?;
    if mqa {
        d.set("attention", "kv_heads", 1, note);
    }
    let (bias, bias_note) = cfg.bool_or("bias", false, family)?;
    d.set("attention", "bias", bias, bias_note.clone());
    let (act, note) = cfg.str_or("activation", "gelu", family)?;
    d.set("ffn", "activation", activation(act, "activation")?, note);
    if let Some(ff) = cfg.uint("ffn_hidden_size")? {
        d.set("ffn", "d_ff", ff, from("ffn_hidden_size"));
    }
    d.set("ffn", "bias", bias, bias_note);
    tied(&mut d, cfg, family, true)?;

    let h = "transformer.h.{i}";
    let pack = if mqa { Pack::QkvBlocks } else { Pack::QkvPerHead };
    d.named("embed.tokens", "transformer.word_embeddings.weight");
    for w in ["weight", "bias"] {
        d.named(&format!("layers.{{i}}.attn_norm.{w}"), &format!("{h}.input_layernorm.{w}"));
        // With parallel attention one norm feeds both sublayers.
        let ffn_norm = if parallel { "input_layernorm" } else { "post_attention_layernorm" };
        d.named(&format!("layers.{{i}}.ffn_norm.{w}"), &format!("{h}.{ffn_norm}.{w}"));
        for (p, part) in [("q", PackPart::Q), ("k", PackPart::K), ("v", PackPart::V)] {
            let tensor = format!("{h}.self_attention.query_key_value.{w}");
            d.tensor(&format!("layers.{{i}}.attn.{p}.{w}"), packed(&tensor, pack, part));
        }
        d.named(&format!("layers.{{i}}.attn.o.{w}"), &format!("{h}.self_attention.dense.{w}"));
        d.named(&format!("layers.{{i}}.ffn.up.{w}"), &format!("{h}.mlp.dense_h_to_4h.{w}"));
        d.named(&format!("layers.{{i}}.ffn.down.{w}"), &format!("{h}.mlp.dense_4h_to_h.{w}"));
        d.named(&format!("final_norm.{w}"), &format!("transformer.ln_f.{w}"));
    }
    d.named("head.weight", "lm_head.weight");
    Ok(d)
}

/// BERT: a post-LayerNorm encoder with token types and a padding mask.
fn bert(cfg: &Config, hints: &Hints) -> Result<Draft> {
    let family = "bert";
    let mut d = Draft::new(family, header(family, cfg)?);
    cfg.refuse_if("is_decoder", true, "a BERT decoder (causal, with cross-attention) is not supported")?;
    cfg.refuse_if("add_cross_attention", true, "a BERT decoder (causal, with cross-attention) is not supported")?;
    if let Some(kind) = cfg.str("position_embedding_type")?.filter(|k| *k != "absolute") {
        return Err(ImportError::new(format!(
            "`position_embedding_type = \"{kind}\"` is not supported (kiln's BERT positions are absolute)"
        )));
    }
    d.set("model", "name", family, "");
    d.set("model", "kind", "encoder", fixed(family));
    let (vocab, vk) = cfg.need_uint(&["vocab_size"])?;
    d.set("model", "vocab", vocab, from(vk));
    let (width, wk) = cfg.need_uint(&["hidden_size"])?;
    d.set("model", "d_model", width, from(wk));
    let (layers, lk) = cfg.need_uint(&["num_hidden_layers"])?;
    d.set("model", "layers", layers, from(lk));
    let (max, note) = cfg.uint_or("max_position_embeddings", 512, family)?;
    d.set("model", "max_positions", max, note);
    d.set("embedding", "norm", true, fixed(family));
    let (types, note) = cfg.uint_or("type_vocab_size", 2, family)?;
    d.set("embedding", "token_types", types, note);
    d.set("positions", "kind", "learned", from("position_embedding_type"));
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_eps", 1e-12, family)?;
    d.set("norm", "eps", eps, note);
    d.set("norm", "placement", "post", fixed(family));
    heads(&mut d, cfg)?;
    d.set("attention", "bias", true, fixed(family));
    d.set("attention", "padding_mask", true, "bert: takes `attention_mask`");
    let (act, note) = cfg.str_or("hidden_act", "gelu", family)?;
    d.set("ffn", "activation", activation(act, "hidden_act")?, note);
    let (d_ff, ff_key) = cfg.need_uint(&["intermediate_size"])?;
    d.set("ffn", "d_ff", d_ff, from(ff_key));
    d.set("ffn", "bias", true, fixed(family));
    let architecture =
        cfg.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str);
    match masked_lm_head(architecture, hints) {
        Some(source) => {
            // `BertForMaskedLM`'s output: the scores of its prediction head, a transform (dense,
            // `hidden_act`, LayerNorm at `layer_norm_eps`) then the decoder with its own bias.
            d.comment(format!("A masked-LM model ({source}): its prediction head's scores are the output."));
            tied(&mut d, cfg, family, true)?;
            d.set("head", "bias", true, "bert: the masked-LM head's cls.predictions.bias");
            d.set("head", "transform", true, "bert: cls.predictions.transform, with hidden_act and layer_norm_eps");
            d.set("outputs", "logits", true, "bert: the masked-LM head's scores are the output");
        }
        None => {
            d.set("outputs", "logits", false, "bert: the encoder's hidden states are its output");
            d.set("outputs", "hidden_states", true, "bert: the encoder's hidden states are its output");
        }
    }
    d.preset("bert", "BERT's tensor names");
    if hints.tensors.is_none() {
        // Without the tensor names, the architecture says whether they carry the `bert.` prefix
        // of a model with a task head.
        let headed = architecture.is_some_and(|a| a != "BertModel");
        if headed {
            d.comment("A task model (architectures): its encoder's tensors are read under `bert.`.");
            let ungated = Variant { gated_ffn: false };
            // The task head's own tensors (`cls.`) are not under the encoder's prefix.
            let encoder = crate::spec::weightmap::preset("bert", ungated).unwrap_or_default();
            for (template, source) in encoder.into_iter().filter(|(t, _)| !t.starts_with("head.")) {
                d.tensor(&template, Source { tensor: format!("bert.{}", source.tensor), ..source });
            }
        }
    }
    Ok(d)
}

/// Where a BERT checkpoint's masked-LM prediction head shows, if it has one: its transform's
/// tensor among the checkpoint's names, or, when the names are unknown, an architecture with the
/// head (`BertForMaskedLM`, `BertForPreTraining`).
fn masked_lm_head(architecture: Option<&str>, hints: &Hints) -> Option<&'static str> {
    const TRANSFORM: &str = "cls.predictions.transform.dense.weight";
    match &hints.tensors {
        Some(tensors) => tensors.contains(TRANSFORM).then_some("its tensors hold cls.predictions.transform"),
        None => matches!(architecture, Some("BertForMaskedLM" | "BertForPreTraining")).then_some("architectures"),
    }
}

/// A sentence-transformers pipeline's mean pooling.
fn sentence_pooling(d: &mut Draft, pooling: SentencePooling) {
    let note = "sentence-transformers: modules.json";
    d.set("outputs", "pooling", "mean", format!("{note}, 1_Pooling/config.json"));
    if pooling.normalize {
        d.set("outputs", "normalize", true, format!("{note} (a Normalize module)"));
    }
    if let Some(len) = pooling.max_seq_length {
        d.set("outputs", "max_seq_length", len, "sentence-transformers: sentence_bert_config.json: max_seq_length");
    }
}

/// T5 (v1.0 and v1.1) and mT5: relative position bias, RMSNorm, no biases.
fn t5(cfg: &Config, family: &str) -> Result<Draft> {
    let mut d = Draft::new(family, header(family, cfg)?);
    cfg.refuse_if("is_encoder_decoder", false, "kiln imports T5 as the encoder-decoder")?;
    d.set("model", "name", family, "");
    d.set("model", "kind", "encoder-decoder", fixed(family));
    let (vocab, vk) = cfg.need_uint(&["vocab_size"])?;
    d.set("model", "vocab", vocab, from(vk));
    let (width, wk) = cfg.need_uint(&["d_model"])?;
    d.set("model", "d_model", width, from(wk));
    let (layers, lk) = cfg.need_uint(&["num_layers"])?;
    d.set("model", "layers", layers, from(lk));
    if let Some(dec) = cfg.uint("num_decoder_layers")?.filter(|&n| n != layers) {
        d.set("model", "decoder_layers", dec, from("num_decoder_layers"));
    }
    if let Some(n) = cfg.uint("n_positions")? {
        d.set("model", "max_positions", n, from("n_positions"));
    }
    d.set("positions", "kind", "relative-bias", fixed(family));
    let (buckets, note) = cfg.uint_or("relative_attention_num_buckets", 32, family)?;
    d.set("positions", "buckets", buckets, note);
    let (distance, note) = cfg.uint_or("relative_attention_max_distance", 128, family)?;
    d.set("positions", "max_distance", distance, note);
    d.set("norm", "kind", "rmsnorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_epsilon", 1e-6, family)?;
    d.set("norm", "eps", eps, note);
    let (heads, hk) = cfg.need_uint(&["num_heads"])?;
    d.set("attention", "heads", heads, from(hk));
    let (d_kv, kk) = cfg.need_uint(&["d_kv"])?;
    d.set("attention", "head_dim", d_kv, from(kk));
    d.set("attention", "scale", 1.0, format!("{family}: no logit scaling (folded into the weights)"));
    d.set("attention", "padding_mask", true, format!("{family}: takes the source's `attention_mask`"));

    // `feed_forward_proj` is `[gated-]ACT`; transformers reads `gated-gelu` as the tanh GELU.
    let (proj, note) = cfg.str_or("feed_forward_proj", "relu", family)?;
    let (gated, act) = match proj.strip_prefix("gated-") {
        Some(act) => (true, act),
        None => (false, proj),
    };
    let act = match cfg.str("dense_act_fn")? {
        Some(a) => a,
        None if act == "gelu" && gated => "gelu_new",
        None => act,
    };
    d.set("ffn", "activation", activation(act, "feed_forward_proj")?, note.clone());
    d.set("ffn", "gated", gated, note);
    let (d_ff, ff_key) = cfg.need_uint(&["d_ff"])?;
    d.set("ffn", "d_ff", d_ff, from(ff_key));

    let tied = self::tied(&mut d, cfg, family, family == "t5")?;
    // A tied head rescales the decoder output by d_model^-0.5, unless transformers 5's
    // `scale_decoder_outputs` says otherwise.
    let (scaled, note) = match cfg.bool("scale_decoder_outputs")? {
        Some(s) => (s, from("scale_decoder_outputs")),
        None => (tied, format!("{family}: a tied head scales the decoder output (tie_word_embeddings)")),
    };
    if scaled {
        d.set("head", "scale", 1.0 / (width as f64).sqrt(), format!("d_model^-0.5, {note}"));
    }
    d.set(
        "outputs",
        "encoder_hidden_state",
        true,
        format!("{family}: transformers returns the encoder's output too (encoder_last_hidden_state)"),
    );
    d.preset("t5", "T5's tensor names (the feed-forward's follow `ffn.gated`)");
    Ok(d)
}

/// `torch.nn.Transformer` inside the golden case's seq2seq module (source and target embeddings,
/// a generator), described by its constructor arguments.
fn torch_transformer(cfg: &Config) -> Result<Draft> {
    let family = "torch.nn.Transformer";
    let mut d = Draft::new(
        family,
        "Imported by `kiln import` from config.json (a torch.nn.Transformer seq2seq module); each note says where its value came from.",
    );
    d.set("model", "name", "transformer", "");
    d.set("model", "kind", "encoder-decoder", fixed(family));
    let (vocab, vk) = cfg.need_uint(&["vocab_size"])?;
    d.set("model", "vocab", vocab, from(vk));
    let (width, wk) = cfg.need_uint(&["d_model"])?;
    d.set("model", "d_model", width, from(wk));
    let (enc, ek) = cfg.need_uint(&["num_encoder_layers"])?;
    d.set("model", "layers", enc, from(ek));
    let (dec, dk) = cfg.need_uint(&["num_decoder_layers"])?;
    if dec != enc {
        d.set("model", "decoder_layers", dec, from(dk));
    }
    d.set("embedding", "scale", "sqrt-d-model", "the module scales the embeddings by sqrt(d_model)");
    d.set("embedding", "shared", false, "the module's src_embed and tgt_embed");
    if let Some(p) = cfg.str("positional")?.filter(|p| !p.starts_with("sinusoidal, interleaved")) {
        return Err(ImportError::new(format!("`positional = \"{p}\"` is not supported")));
    }
    d.set("positions", "kind", "sinusoidal", from("positional"));
    d.set("positions", "style", "interleaved", from("positional"));
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_eps", 1e-5, family)?;
    d.set("norm", "eps", eps, note);
    let (first, note) = cfg.bool_or("norm_first", false, family)?;
    d.set("norm", "placement", if first { "pre" } else { "post" }, note.clone());
    d.set("norm", "final", true, format!("{family}: the encoder and decoder end with a norm"));
    let (heads, hk) = cfg.need_uint(&["nhead"])?;
    d.set("attention", "heads", heads, from(hk));
    d.set("attention", "bias", true, fixed(family));
    d.set("attention", "padding_mask", true, "the module takes `src_padding`");
    let (act, note) = cfg.str_or("activation", "relu", family)?;
    d.set("ffn", "activation", activation(act, "activation")?, note);
    let (d_ff, fk) = cfg.need_uint(&["dim_feedforward"])?;
    d.set("ffn", "d_ff", d_ff, from(fk));
    d.set("ffn", "bias", true, fixed(family));
    d.set("head", "tied", false, "the module's generator");
    d.set("head", "bias", true, "the module's generator");
    d.preset("torch-transformer", "torch.nn.Transformer's tensor names in the module");
    Ok(d)
}

/// The `linformer` package's `LinformerLM`, described by its constructor arguments.
fn linformer(cfg: &Config) -> Result<Draft> {
    let family = "linformer";
    let mut d = Draft::new(
        family,
        "Imported by `kiln import` from config.json (the linformer package's LinformerLM); each note says where its value came from.",
    );
    d.set("model", "name", family, "");
    d.set("model", "kind", "encoder", fixed(family));
    let (vocab, vk) = cfg.need_uint(&["num_tokens"])?;
    d.set("model", "vocab", vocab, from(vk));
    let (width, wk) = cfg.need_uint(&["dim"])?;
    d.set("model", "d_model", width, from(wk));
    let (depth, lk) = cfg.need_uint(&["depth"])?;
    d.set("model", "layers", depth, from(lk));
    let (seq, sk) = cfg.need_uint(&["seq_len"])?;
    d.set("model", "max_positions", seq, from(sk));
    d.set("positions", "kind", "learned", fixed(family));
    d.set("norm", "final", false, fixed(family));
    let (heads, hk) = cfg.need_uint(&["heads"])?;
    d.set("attention", "heads", heads, from(hk));
    if let Some(dim_head) = cfg.uint("dim_head")? {
        d.set("attention", "head_dim", dim_head, from("dim_head"));
    }
    let (k, kk) = cfg.uint_or("k", 256, family)?;
    d.set("attention", "low_rank", k, kk);
    let (shared, note) = cfg.bool_or("share_kv", false, family)?;
    if shared {
        d.set("attention", "low_rank_shared", true, note);
    }
    d.set("attention", "o_bias", true, fixed(family));
    let (mult, _) = cfg.uint_or("ff_mult", 4, family)?;
    d.set("ffn", "d_ff", mult * width, "ff_mult * dim (ff_mult: config.json, default 4)");
    d.set("ffn", "bias", true, fixed(family));
    d.set("head", "tied", false, "the package's to_logits");
    d.set("head", "bias", true, "the package's to_logits");
    d.set("outputs", "logits", true, "the package's to_logits");
    let l = "linformer.net.layers.{i}";
    d.named("embed.tokens", "token_emb.weight");
    d.named("embed.positions", "pos_emb.weight");
    for w in ["weight", "bias"] {
        d.named(&format!("layers.{{i}}.attn_norm.{w}"), &format!("{l}.0.norm.{w}"));
        d.named(&format!("layers.{{i}}.ffn_norm.{w}"), &format!("{l}.1.norm.{w}"));
        d.named(&format!("layers.{{i}}.attn.o.{w}"), &format!("{l}.0.fn.to_out.{w}"));
        d.named(&format!("layers.{{i}}.ffn.up.{w}"), &format!("{l}.1.fn.w1.{w}"));
        d.named(&format!("layers.{{i}}.ffn.down.{w}"), &format!("{l}.1.fn.w2.{w}"));
        d.named(&format!("head.{w}"), &format!("to_logits.{w}"));
    }
    for p in ["q", "k", "v"] {
        d.named(&format!("layers.{{i}}.attn.{p}.weight"), &format!("{l}.0.fn.to_{p}.weight"));
    }
    d.named("layers.{i}.attn.proj_k", &format!("{l}.0.fn.proj_k"));
    d.named("layers.{i}.attn.proj_v", &format!("{l}.0.fn.proj_v"));
    Ok(d)
}

/// The golden case's BigBird-style block-sparse encoder module, described by its arguments.
fn bigbird(cfg: &Config) -> Result<Draft> {
    let family = "bigbird-style";
    let mut d = Draft::new(
        family,
        "Imported by `kiln import` from config.json (a BigBird-style block-sparse encoder module); each note says where its value came from.",
    );
    d.set("model", "name", "bigbird", "");
    d.set("model", "kind", "encoder", fixed(family));
    let (vocab, vk) = cfg.need_uint(&["vocab_size"])?;
    d.set("model", "vocab", vocab, from(vk));
    let (width, wk) = cfg.need_uint(&["d_model"])?;
    d.set("model", "d_model", width, from(wk));
    let (layers, lk) = cfg.need_uint(&["layers"])?;
    d.set("model", "layers", layers, from(lk));
    let (max, mk) = cfg.need_uint(&["max_positions"])?;
    d.set("model", "max_positions", max, from(mk));
    d.set("embedding", "norm", true, fixed(family));
    d.set("positions", "kind", "learned", fixed(family));
    if let Some(norm) = cfg.str("norm")?.filter(|n| *n != "post") {
        return Err(ImportError::new(format!("`norm = \"{norm}\"` is not supported (the module is post-norm)")));
    }
    d.set("norm", "kind", "layernorm", fixed(family));
    let (eps, note) = cfg.float_or("layer_norm_eps", 1e-12, family)?;
    d.set("norm", "eps", eps, note);
    d.set("norm", "placement", "post", from("norm"));
    let (heads, hk) = cfg.need_uint(&["heads"])?;
    d.set("attention", "heads", heads, from(hk));
    d.set("attention", "bias", true, fixed(family));
    d.set("attention", "padding_mask", true, fixed(family));
    if let Some(act) = cfg.str("activation")?.filter(|a| *a != "gelu (erf)") {
        return Err(ImportError::new(format!("`activation = \"{act}\"` is not supported")));
    }
    d.set("ffn", "activation", "gelu", from("activation"));
    let (d_ff, fk) = cfg.need_uint(&["d_ff"])?;
    d.set("ffn", "d_ff", d_ff, from(fk));
    d.set("ffn", "bias", true, fixed(family));
    d.set("outputs", "hidden_states", true, fixed(family));
    let sparse = [
        ("block", "block"),
        ("global", "global_blocks"),
        ("window", "window_blocks"),
        ("random", "random_blocks"),
        ("seed", "seed"),
    ];
    let mut fields = Vec::new();
    for (field, key) in sparse {
        let (v, _) = cfg.need_uint(&[key])?;
        fields.push(format!("{field} = {v}"));
    }
    let note = "config.json: block, global_blocks, window_blocks, random_blocks, seed";
    d.set("attention", "block_sparse", Val::Table(fields.join(", ")), note);
    d.named("embed.tokens", "embed.weight");
    d.named("embed.positions", "pos.weight");
    for w in ["weight", "bias"] {
        d.named(&format!("embed.norm.{w}"), &format!("ln_e.{w}"));
        for p in ["q", "k", "v", "o"] {
            d.named(&format!("layers.{{i}}.attn.{p}.{w}"), &format!("layers.{{i}}.{p}.{w}"));
        }
        d.named(&format!("layers.{{i}}.attn_norm.{w}"), &format!("layers.{{i}}.ln1.{w}"));
        d.named(&format!("layers.{{i}}.ffn_norm.{w}"), &format!("layers.{{i}}.ln2.{w}"));
        d.named(&format!("layers.{{i}}.ffn.up.{w}"), &format!("layers.{{i}}.fc1.{w}"));
        d.named(&format!("layers.{{i}}.ffn.down.{w}"), &format!("layers.{{i}}.fc2.{w}"));
    }
    Ok(d)
}
