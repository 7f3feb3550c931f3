//! GGUF metadata -> spec, one mapping per `general.architecture`.
//!
//! llama.cpp's converter writes the architecture's sizes under `{arch}.*` keys; what it leaves out
//! (whether the head is tied, which projections have biases) is read from which tensors the file
//! holds, and what llama.cpp fixes in code for an architecture (Gemma 3's layer pattern and the
//! RoPE base of its sliding layers) is noted as such.

use super::{Draft, Hints, ImportError, Imported, Result, Val, global_period};
use crate::spec::LayerKind;
use crate::spec::weightmap::Source;
use std::collections::BTreeMap;

/// A GGUF metadata value as the importer reads it: scalars, and arrays by their length.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Any unsigned integer type, or a signed one holding a non-negative value.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    /// `float32` (widened) or `float64`.
    Float(f64),
    /// `bool`.
    Bool(bool),
    /// `string`.
    Str(String),
    /// An array, by its element count.
    Array(usize),
}

/// The architectures this module maps.
const ARCHITECTURES: &str = "gemma2, gemma3, llama, qwen2, qwen3";

/// Imports a GGUF file's metadata, given its tensors' names and row-major shapes.
pub fn gguf(
    meta: &BTreeMap<String, MetaValue>,
    tensors: &BTreeMap<String, Vec<usize>>,
    hints: &Hints,
) -> Result<Imported> {
    let arch = match meta.get("general.architecture") {
        Some(MetaValue::Str(a)) => a.clone(),
        Some(other) => {
            return Err(ImportError::new(format!("GGUF: `general.architecture` = {other:?} is not a string")));
        }
        None => return Err(ImportError::new("GGUF: the file has no `general.architecture`")),
    };
    let m = Meta { meta, tensors, arch: &arch };
    let mut d = match arch.as_str() {
        "llama" | "qwen2" | "qwen3" => llama_like(&m)?,
        "gemma2" | "gemma3" => gemma(&m)?,
        other => {
            return Err(ImportError::new(format!(
                "GGUF: `general.architecture = \"{other}\"` is not supported; kiln imports {ARCHITECTURES}"
            )));
        }
    };
    let mut hints = hints.clone();
    hints.tensors = Some(tensors.keys().cloned().collect());
    if hints.name.is_none() {
        // `general.basename` and `general.size_label` (`smollm2-135m`), else the architecture.
        let text = |key: &str| match meta.get(key) {
            Some(MetaValue::Str(s)) if !s.is_empty() => Some(s.to_lowercase()),
            _ => None,
        };
        let name = match (text("general.basename"), text("general.size_label")) {
            (Some(base), Some(size)) => format!("{base}-{size}"),
            (Some(base), None) => base,
            _ => arch.clone(),
        };
        hints.name = Some(name);
    }
    if let Some(MetaValue::Str(name)) = meta.get("general.name") {
        d.comment(format!("general.name = \"{name}\""));
    }
    d.finish(&hints)
}

/// The metadata and tensors of one file, read under its architecture's prefix.
struct Meta<'a> {
    meta: &'a BTreeMap<String, MetaValue>,
    tensors: &'a BTreeMap<String, Vec<usize>>,
    arch: &'a str,
}

impl Meta<'_> {
    /// `{arch}.{key}`.
    fn key(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    /// `GGUF: {arch}.{key}`.
    fn from(&self, key: &str) -> String {
        format!("GGUF: {}", self.key(key))
    }

    fn fixed(&self, what: &str) -> String {
        format!("GGUF {}: {what}", self.arch)
    }

    fn uint(&self, key: &str) -> Result<Option<u64>> {
        let full = self.key(key);
        match self.meta.get(&full) {
            None => Ok(None),
            Some(MetaValue::Uint(v)) => Ok(Some(*v)),
            Some(MetaValue::Array(n)) => Err(ImportError::new(format!(
                "GGUF: `{full}` is an array of {n} values (one per layer), which kiln does not support"
            ))),
            Some(other) => Err(ImportError::new(format!("GGUF: `{full}` = {other:?} is not a non-negative integer"))),
        }
    }

    fn need_uint(&self, key: &str) -> Result<u64> {
        self.uint(key)?.ok_or_else(|| ImportError::new(format!("GGUF: the file has no `{}`", self.key(key))))
    }

    /// A float key; a `float32` value is given its shortest decimal form (`1e-6`, not
    /// `9.99999997e-7`).
    fn float(&self, key: &str) -> Result<Option<f64>> {
        let full = self.key(key);
        match self.meta.get(&full) {
            None => Ok(None),
            Some(MetaValue::Float(v)) if v.is_finite() => Ok(Some(shortest(*v))),
            Some(MetaValue::Uint(v)) => Ok(Some(*v as f64)),
            Some(other) => Err(ImportError::new(format!("GGUF: `{full}` = {other:?} is not a finite number"))),
        }
    }

    fn str(&self, key: &str) -> Option<&str> {
        match self.meta.get(&self.key(key)) {
            Some(MetaValue::Str(s)) => Some(s),
            _ => None,
        }
    }

    fn has(&self, tensor: &str) -> bool {
        self.tensors.contains_key(tensor)
    }
}

/// A float32 value widened to f64, as the f64 its shortest f32 text reads as.
fn shortest(v: f64) -> f64 {
    let narrow = v as f32;
    if f64::from(narrow) == v { narrow.to_string().parse().unwrap_or(v) } else { v }
}

fn header(m: &Meta) -> String {
    format!(
        "Imported by `kiln import` from GGUF metadata (general.architecture = \"{}\"); each note says where its value came from.",
        m.arch
    )
}

/// `[model]`, heads and sizes shared by every architecture.
fn sizes(d: &mut Draft, m: &Meta) -> Result<u64> {
    d.set("model", "name", m.arch, "");
    d.set("model", "kind", "decoder", m.fixed("a causal decoder"));
    let vocab = match (m.uint("vocab_size")?, m.tensors.get("token_embd.weight").and_then(|s| s.first())) {
        (Some(v), _) => (v, m.from("vocab_size")),
        (None, Some(&rows)) => (rows as u64, "GGUF: rows of token_embd.weight".to_string()),
        (None, None) => return Err(ImportError::new("GGUF: no vocab_size and no token_embd.weight tensor")),
    };
    d.set("model", "vocab", vocab.0, vocab.1);
    d.set("model", "d_model", m.need_uint("embedding_length")?, m.from("embedding_length"));
    let layers = m.need_uint("block_count")?;
    d.set("model", "layers", layers, m.from("block_count"));
    if let Some(ctx) = m.uint("context_length")? {
        d.set("model", "max_positions", ctx, m.from("context_length"));
    }
    d.set("attention", "heads", m.need_uint("attention.head_count")?, m.from("attention.head_count"));
    if let Some(kv) = m.uint("attention.head_count_kv")? {
        d.set("attention", "kv_heads", kv, m.from("attention.head_count_kv"));
    }
    d.set("ffn", "d_ff", m.need_uint("feed_forward_length")?, m.from("feed_forward_length"));
    d.set("norm", "kind", "rmsnorm", m.fixed("RMSNorm"));
    if let Some(eps) = m.float("attention.layer_norm_rms_epsilon")? {
        d.set("norm", "eps", eps, m.from("attention.layer_norm_rms_epsilon"));
    }
    if let Some(kind) = m.str("rope.scaling.type").filter(|t| *t != "none") {
        return Err(ImportError::new(format!(
            "GGUF: `{} = \"{kind}\"` is not supported (kiln's RoPE has no frequency scaling)",
            m.key("rope.scaling.type")
        )));
    }
    if m.has("rope_freqs.weight") {
        return Err(ImportError::new(
            "GGUF: tensor `rope_freqs.weight` (per-frequency RoPE factors, Llama 3.1's scaling) is not supported",
        ));
    }
    if m.uint("expert_count")?.is_some_and(|n| n > 0) {
        return Err(ImportError::new(format!(
            "GGUF: `{}` > 0: mixture-of-experts GGUF files stack their experts in one tensor, which kiln does not read",
            m.key("expert_count")
        )));
    }
    let tied = !m.has("output.weight");
    let note = if tied { "GGUF: no output.weight tensor" } else { "GGUF: an output.weight tensor" };
    d.set("head", "tied", tied, note);
    Ok(layers)
}

/// The per-head width when the file states it (`attention.key_length`).
fn head_dim(d: &mut Draft, m: &Meta) -> Result<Option<u64>> {
    let key = m.uint("attention.key_length")?;
    if let (Some(k), Some(v)) = (key, m.uint("attention.value_length")?)
        && k != v
    {
        return Err(ImportError::new(format!(
            "GGUF: key_length {k} differs from value_length {v}, which kiln does not support"
        )));
    }
    if let Some(k) = key {
        d.set("attention", "head_dim", k, m.from("attention.key_length"));
    }
    Ok(key)
}

/// LLaMA (also Mistral, SmolLM), Qwen 2 and Qwen 3.
fn llama_like(m: &Meta) -> Result<Draft> {
    let mut d = Draft::new(&format!("gguf:{}", m.arch), header(m));
    sizes(&mut d, m)?;
    let head_dim = head_dim(&mut d, m)?;
    d.set("positions", "kind", "rope", m.fixed("rotary positions"));
    let (theta, note) = match m.float("rope.freq_base")? {
        Some(t) => (t, m.from("rope.freq_base")),
        None => (10000.0, m.fixed("rope.freq_base absent, llama.cpp's default")),
    };
    d.set("positions", "theta", theta, note);
    if let Some(rotated) = m.uint("rope.dimension_count")? {
        let width = match head_dim {
            Some(h) => h,
            None => {
                let heads = m.need_uint("attention.head_count")?.max(1);
                m.need_uint("embedding_length")? / heads
            }
        };
        if rotated != width && width > 0 {
            d.set("positions", "fraction", rotated as f64 / width as f64, m.from("rope.dimension_count"));
        }
    }
    d.set("ffn", "activation", "silu", m.fixed("SwiGLU"));
    d.set("ffn", "gated", true, m.fixed("SwiGLU"));
    if m.arch == "qwen3" {
        d.set("attention", "qk_norm", "head", m.fixed("per-head query/key norms"));
    }
    for (p, tensor) in [("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")] {
        let bias = format!("blk.0.{tensor}.bias");
        if m.has(&bias) {
            if m.arch == "llama" && (p == "q" || p == "k") {
                return Err(ImportError::new(format!(
                    "GGUF llama: tensor `{bias}`: query/key biases in llama.cpp's RoPE row order are not supported"
                )));
            }
            d.set("attention", &format!("{p}_bias"), true, format!("GGUF: tensor {bias} present"));
            d.named(&format!("layers.{{i}}.attn.{p}.bias"), &format!("blk.{{i}}.{tensor}.bias"));
        }
    }
    if m.arch == "llama" {
        d.preset("gguf-llama", "llama.cpp's tensor names, Q/K rows in its RoPE order");
    } else {
        // llama.cpp stores Qwen's Q/K rows as trained (rotate-half RoPE), so the names are
        // llama's without the un-permutation.
        let swiglu = crate::spec::weightmap::Variant { gated_ffn: true };
        for (template, source) in crate::spec::weightmap::preset("gguf-llama", swiglu).unwrap_or_default() {
            d.tensor(&template, Source { rope_unpermute: false, ..source });
        }
        d.named("layers.{i}.attn.q_norm.weight", "blk.{i}.attn_q_norm.weight");
        d.named("layers.{i}.attn.k_norm.weight", "blk.{i}.attn_k_norm.weight");
    }
    Ok(d)
}

/// Gemma 2 and Gemma 3: sandwich norms (gains stored with Gemma's +1 added), GeGLU, sliding layers
/// in llama.cpp's fixed pattern.
fn gemma(m: &Meta) -> Result<Draft> {
    let gemma3 = m.arch == "gemma3";
    let mut d = Draft::new(&format!("gguf:{}", m.arch), header(m));
    let layers = sizes(&mut d, m)?;
    let head_dim = head_dim(&mut d, m)?;
    d.set("embedding", "scale", "sqrt-d-model", m.fixed("embeddings scaled by sqrt(d_model)"));
    d.set("norm", "placement", "sandwich", m.fixed("a norm before and after each sublayer"));
    d.set("norm", "gain_offset", 0.0, m.fixed("llama.cpp stores the gains with Gemma's +1 added"));

    // llama.cpp's attention scale: 1/sqrt(d_model / heads) for the 27B models, else
    // 1/sqrt(head_dim).
    let heads = m.need_uint("attention.head_count")?.max(1);
    let width = m.need_uint("embedding_length")?;
    let is_27b = if gemma3 { layers == 62 } else { layers == 46 };
    let (scalar, note) = match head_dim {
        Some(h) if !is_27b => (h, "1 / sqrt(key_length), llama.cpp's rule".to_string()),
        _ => (width / heads, "1 / sqrt(d_model / heads), llama.cpp's rule for the 27B model".to_string()),
    };
    d.set("attention", "scale", 1.0 / (scalar.max(1) as f64).sqrt(), note);

    // Layers: llama.cpp's fixed pattern (Gemma 2: every 2nd layer global; Gemma 3: every 6th).
    let window = m.uint("attention.sliding_window")?;
    let (pattern, note) = match m.uint("attention.sliding_window_pattern")? {
        Some(p) => (p, m.from("attention.sliding_window_pattern")),
        None => (if gemma3 { 6 } else { 2 }, m.fixed("llama.cpp's fixed layer pattern")),
    };
    let global: Vec<bool> = (0..layers).map(|i| (i + 1) % pattern.max(1) == 0).collect();
    let any_sliding = window.is_some() && global.iter().any(|&g| !g);
    let global_theta = m.float("rope.freq_base")?;
    let local_theta = match m.float("rope.freq_base_swa")? {
        Some(t) => (t, m.from("rope.freq_base_swa")),
        None if gemma3 => (10000.0, m.fixed("llama.cpp's RoPE base of the sliding layers")),
        None => (global_theta.unwrap_or(10000.0), m.from("rope.freq_base")),
    };
    d.set("positions", "kind", "rope", m.fixed("rotary positions"));
    if let (Some(window), true) = (window, any_sliding) {
        d.set("positions", "theta", local_theta.0, local_theta.1);
        if global.iter().any(|&g| g)
            && let Some(g) = global_theta.filter(|&g| g != local_theta.0)
        {
            d.set("positions", "global_theta", g, m.from("rope.freq_base"));
        }
        d.set("attention", "mask", "sliding-window", note.clone());
        d.set("attention", "window", window, m.from("attention.sliding_window"));
        match global_period(&global) {
            Some(every) => d.set("attention", "global_every", every, note),
            None if global.iter().any(|&g| g) => {
                let kinds = global.iter().map(|&g| if g { LayerKind::Global } else { LayerKind::SlidingWindow });
                d.set("attention", "layer_types", Val::List(kinds.map(|k| Val::from(k.name())).collect()), note);
            }
            None => {}
        }
    } else if let Some(t) = global_theta {
        d.set("positions", "theta", t, m.from("rope.freq_base"));
    }
    if gemma3 {
        d.set("attention", "qk_norm", "head", m.fixed("per-head query/key norms"));
    }
    if let Some(cap) = m.float("attn_logit_softcapping")? {
        d.set("attention", "softcap", cap, m.from("attn_logit_softcapping"));
    }
    if let Some(cap) = m.float("final_logit_softcapping")? {
        d.set("head", "softcap", cap, m.from("final_logit_softcapping"));
    }
    d.set("ffn", "activation", "gelu-tanh", m.fixed("GeGLU with the tanh GELU"));
    d.set("ffn", "gated", true, m.fixed("GeGLU with the tanh GELU"));
    d.preset("gguf-gemma3", "llama.cpp's Gemma tensor names");
    Ok(d)
}
