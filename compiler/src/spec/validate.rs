//! Validation: the rules a spec must keep beyond its TOML types, with defaults resolved.
//!
//! Every error is located at the key it concerns. All rules are checked and all failures reported,
//! so a person fixes a spec in one pass. Every dimension is bounded by [`Limits`] so that absurd
//! sizes are refused here, before anything is allocated.

use super::weightmap::{self, WeightMap};
use super::*;
use crate::diag::{Diagnostic, did_you_mean};
use crate::spec::parse::SpanIndex;

/// Upper bounds on sizes. They are generous for real models and refuse typos like an extra zero
/// run six times over.
#[derive(Clone, Debug)]
pub struct Limits {
    /// `model.d_model`, `attention.head_dim * heads`.
    pub d_model: u64,
    /// `model.vocab`.
    pub vocab: u64,
    /// `model.layers` (each stack).
    pub layers: u64,
    /// `model.max_positions`.
    pub max_positions: u64,
    /// `attention.heads`.
    pub heads: u64,
    /// `ffn.d_ff`.
    pub d_ff: u64,
    /// `moe.experts`.
    pub experts: u64,
    /// `embedding.token_types`.
    pub token_types: u64,
    /// Total parameter count.
    pub parameters: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            d_model: 1 << 16,
            vocab: 1 << 22,
            layers: 1024,
            max_positions: 1 << 20,
            heads: 1024,
            d_ff: 1 << 18,
            experts: 1024,
            token_types: 1024,
            parameters: 1 << 40,
        }
    }
}

/// Collects diagnostics, locating each through the span index.
struct Checker<'a> {
    index: &'a SpanIndex,
    errors: Vec<Diagnostic>,
}

impl Checker<'_> {
    fn error(&mut self, key: &str, rule: &'static str, message: String) {
        self.errors
            .push(Diagnostic::new(rule, message).with_key(key).with_span(self.index.locate(key)));
    }

    fn error_help(&mut self, key: &str, rule: &'static str, message: String, help: String) {
        self.errors.push(
            Diagnostic::new(rule, message).with_key(key).with_span(self.index.locate(key)).with_help(help),
        );
    }

    /// `1 <= value <= max`.
    fn bounded(&mut self, key: &str, value: u64, max: u64) {
        if value == 0 {
            self.error(key, "dimensions are positive", format!("`{key}` must be at least 1"));
        } else if value > max {
            self.error(
                key,
                "dimensions are bounded",
                format!("`{key}` = {value} is larger than the limit {max}"),
            );
        }
    }

    fn positive_finite(&mut self, key: &str, value: f64) {
        if !(value.is_finite() && value > 0.0) {
            self.error(key, "positive finite number", format!("`{key}` = {value} must be a positive finite number"));
        }
    }
}

/// Checks every rule and resolves defaults. Returns all diagnostics on failure.
pub fn validate(spec: Spec, index: &SpanIndex, limits: &Limits) -> Result<Resolved, Vec<Diagnostic>> {
    let mut c = Checker { index, errors: Vec::new() };
    let m = &spec.model;

    c.bounded("model.d_model", m.d_model, limits.d_model);
    c.bounded("model.vocab", m.vocab, limits.vocab);
    c.bounded("model.max_positions", m.max_positions, limits.max_positions);
    let (encoder_layers, decoder_layers) = match m.kind {
        BlockKind::Encoder => (m.layers, 0),
        BlockKind::Decoder => (0, m.layers),
        BlockKind::EncoderDecoder => (m.encoder_layers.unwrap_or(m.layers), m.decoder_layers.unwrap_or(m.layers)),
    };
    c.bounded("model.layers", m.layers, limits.layers);
    for (key, value) in [("model.encoder_layers", m.encoder_layers), ("model.decoder_layers", m.decoder_layers)] {
        if let Some(v) = value {
            if m.kind != BlockKind::EncoderDecoder {
                c.error(
                    key,
                    "stack sizes belong to encoder-decoder models",
                    format!("`{key}` is only meaningful when `model.kind` = \"encoder-decoder\""),
                );
            } else {
                c.bounded(key, v, limits.layers);
            }
        }
    }

    // Attention.
    let a = &spec.attention;
    c.bounded("attention.heads", a.heads, limits.heads);
    let kv_heads = a.kv_heads.unwrap_or(a.heads);
    if let Some(kv) = a.kv_heads {
        c.bounded("attention.kv_heads", kv, limits.heads);
    }
    if a.heads > 0 && kv_heads > 0 && a.heads % kv_heads != 0 {
        c.error(
            "attention.kv_heads",
            "kv_heads divides heads",
            format!("`attention.kv_heads` = {kv_heads} does not divide `attention.heads` = {}", a.heads),
        );
    }
    let head_dim = match a.head_dim {
        Some(hd) => {
            c.bounded("attention.head_dim", hd, limits.d_model);
            hd
        }
        None => {
            if a.heads > 0 && m.d_model % a.heads != 0 {
                c.error_help(
                    "attention.heads",
                    "heads divide d_model",
                    format!("`attention.heads` = {} does not divide `model.d_model` = {}", a.heads, m.d_model),
                    "set `attention.head_dim` explicitly if the heads are not d_model / heads wide".into(),
                );
            }
            m.d_model / a.heads.max(1)
        }
    };
    if head_dim.saturating_mul(a.heads) > limits.d_model {
        c.error(
            "attention.head_dim",
            "dimensions are bounded",
            format!("heads * head_dim = {} is larger than the limit {}", head_dim.saturating_mul(a.heads), limits.d_model),
        );
    }
    let default_mask = match m.kind {
        BlockKind::Encoder => MaskKind::Bidirectional,
        _ => MaskKind::Causal,
    };
    let mask = a.mask.unwrap_or(default_mask);
    match (mask, a.window) {
        (MaskKind::SlidingWindow, None) => c.error(
            "attention.window",
            "a sliding window has a size",
            "`attention.mask` = \"sliding-window\" needs `attention.window`".into(),
        ),
        (MaskKind::SlidingWindow, Some(w)) => c.bounded("attention.window", w, limits.max_positions),
        (_, Some(_)) => c.error(
            "attention.window",
            "a window needs a sliding-window mask",
            "`attention.window` is set but `attention.mask` is not \"sliding-window\"".into(),
        ),
        _ => {}
    }
    let attn_scale = a.scale.unwrap_or(1.0 / (head_dim.max(1) as f64).sqrt());
    if let Some(s) = a.scale {
        c.positive_finite("attention.scale", s);
    }

    // Positions.
    let p = &spec.positions;
    let mut rotary_dim = 0;
    match p.kind {
        PositionKind::Rope => {
            c.positive_finite("positions.theta", p.theta);
            if !(p.fraction > 0.0 && p.fraction <= 1.0) {
                c.error(
                    "positions.fraction",
                    "the rotated fraction is in (0, 1]",
                    format!("`positions.fraction` = {} must be in (0, 1]", p.fraction),
                );
            } else {
                let rotated = head_dim as f64 * p.fraction;
                rotary_dim = rotated.round() as u64;
                if (rotated - rotated.round()).abs() > 1e-9 || rotary_dim % 2 != 0 || rotary_dim == 0 {
                    c.error(
                        "positions.fraction",
                        "RoPE needs an even rotated dim",
                        format!(
                            "RoPE rotates head_dim * fraction = {head_dim} * {} = {rotated} dimensions; that must be a positive even integer",
                            p.fraction
                        ),
                    );
                }
            }
        }
        PositionKind::Sinusoidal => {
            if m.d_model % 2 != 0 {
                c.error(
                    "model.d_model",
                    "sinusoidal positions need an even width",
                    format!("sinusoidal positions pair sin and cos, so `model.d_model` = {} must be even", m.d_model),
                );
            }
        }
        PositionKind::None | PositionKind::Learned | PositionKind::Alibi => {
            for key in ["theta", "fraction", "style"] {
                if index.value(&format!("positions.{key}")).is_some() {
                    c.error(
                        &format!("positions.{key}"),
                        "options match the positional scheme",
                        format!("`positions.{key}` only applies to rope (or style to sinusoidal) positions"),
                    );
                }
            }
        }
    }

    // Norm.
    let n = &spec.norm;
    c.positive_finite("norm.eps", n.eps);
    let residual_alpha = match (n.placement, n.alpha) {
        (Placement::Deepnorm, Some(alpha)) => {
            c.positive_finite("norm.alpha", alpha);
            alpha
        }
        (Placement::Deepnorm, None) => (2.0 * m.layers.max(1) as f64).powf(0.25),
        (_, Some(_)) => {
            c.error(
                "norm.alpha",
                "alpha belongs to DeepNorm",
                "`norm.alpha` is set but `norm.placement` is not \"deepnorm\"".into(),
            );
            1.0
        }
        (_, None) => 1.0,
    };
    let final_norm = n.final_norm.unwrap_or(n.placement == Placement::Pre);
    if n.parallel_residual && n.placement != Placement::Pre {
        c.error(
            "norm.parallel_residual",
            "parallel residual is pre-norm",
            "`norm.parallel_residual` needs `norm.placement` = \"pre\"".into(),
        );
    }

    // Embedding.
    let e = &spec.embedding;
    let embed_scale = match e.scale {
        EmbeddingScale::Value(v) => {
            if !v.is_finite() || v == 0.0 {
                c.error("embedding.scale", "positive finite number", format!("`embedding.scale` = {v} must be finite and non-zero"));
            }
            v
        }
        EmbeddingScale::Named(ScaleRule::SqrtDModel) => (m.d_model as f64).sqrt(),
    };
    if e.token_types > limits.token_types {
        c.error(
            "embedding.token_types",
            "dimensions are bounded",
            format!("`embedding.token_types` = {} is larger than the limit {}", e.token_types, limits.token_types),
        );
    }
    if !e.shared && m.kind != BlockKind::EncoderDecoder {
        c.error(
            "embedding.shared",
            "separate embeddings belong to encoder-decoder models",
            "`embedding.shared` = false is only meaningful for encoder-decoder models".into(),
        );
    }

    // Feed-forward and experts.
    let d_ff = spec.ffn.d_ff.unwrap_or(4 * m.d_model);
    if let Some(f) = spec.ffn.d_ff {
        c.bounded("ffn.d_ff", f, limits.d_ff);
    } else if d_ff > limits.d_ff {
        c.error("ffn.d_ff", "dimensions are bounded", format!("the default `ffn.d_ff` = 4 * d_model = {d_ff} is larger than the limit {}", limits.d_ff));
    }
    if let Some(moe) = &spec.moe {
        c.bounded("moe.experts", moe.experts, limits.experts);
        if moe.top_k == 0 {
            c.error("moe.top_k", "dimensions are positive", "`moe.top_k` must be at least 1".into());
        } else if moe.top_k > moe.experts {
            c.error(
                "moe.top_k",
                "top_k <= experts",
                format!("`moe.top_k` = {} is larger than `moe.experts` = {}", moe.top_k, moe.experts),
            );
        }
    }

    // Outputs.
    let o = &spec.outputs;
    let logits = o.logits.unwrap_or(m.kind != BlockKind::Encoder);
    if !logits && !o.hidden_states && o.pooling == Pooling::None {
        c.error(
            "outputs",
            "a model has an output",
            "the model would produce no output: enable `outputs.logits`, `outputs.hidden_states` or `outputs.pooling`".into(),
        );
    }
    if o.normalize && o.pooling == Pooling::None {
        c.error(
            "outputs.normalize",
            "normalize applies to a pooled output",
            "`outputs.normalize` is set but `outputs.pooling` is \"none\"".into(),
        );
    }
    if spec.head.bias && !logits {
        c.error("head.bias", "a head bias needs logits", "`head.bias` is set but the model produces no logits".into());
    }

    // Weight map.
    let mut weights = WeightMap::default();
    if let Some(name) = &spec.weights.preset {
        match weightmap::preset(name) {
            Some(entries) => {
                weights.preset = Some(name.clone());
                weights.entries = entries;
            }
            None => {
                let help = did_you_mean(name, weightmap::PRESETS.iter().copied())
                    .map(|s| format!("did you mean `{s}`?"))
                    .unwrap_or_else(|| format!("known presets: {}", weightmap::PRESETS.join(", ")));
                c.error_help("weights.preset", "presets are known", format!("unknown weight-map preset `{name}`"), help);
            }
        }
    }
    let templates = weightmap::all_templates();
    for (template, source) in &spec.weights.tensors {
        let key = format!("weights.tensors.{template}");
        if !weightmap::is_known_template(template) {
            let help = did_you_mean(template, templates.iter().map(String::as_str))
                .map(|s| format!("did you mean `{s}`?"))
                .unwrap_or_else(|| "parameter names are listed in the README's spec reference".into());
            c.errors.push(
                Diagnostic::new("weight-map keys name graph parameters", format!("`{template}` is not a graph parameter"))
                    .with_key(key.clone())
                    .with_span(index.key(&key).unwrap_or_else(|| index.locate(&key)))
                    .with_help(help),
            );
            continue;
        }
        let s = &source.0;
        if s.pack.is_some() != s.part.is_some() {
            c.error(&key, "pack and part go together", format!("`{template}`: `pack` and `part` must be given together"));
        }
        if s.pack == Some(Pack::QkvPerHead) && kv_heads != a.heads {
            c.error(
                &key,
                "per-head packing needs kv_heads == heads",
                format!("`{template}` is packed per head, which needs `attention.kv_heads` = `attention.heads`"),
            );
        }
        weights.entries.insert(template.clone(), s.clone());
    }

    // The parameter count bounds everything that will ever be allocated for weights.
    let resolved = Resolved {
        head_dim,
        kv_heads,
        d_ff,
        mask,
        final_norm,
        attn_scale,
        embed_scale,
        residual_alpha,
        rotary_dim,
        logits,
        encoder_layers,
        decoder_layers,
        weights,
        spec,
    };
    if c.errors.is_empty() {
        let params = crate::graph::build::parameter_count(&resolved);
        if params > limits.parameters {
            c.error(
                "model",
                "the parameter count is bounded",
                format!("the model would have {params} parameters, more than the limit {}", limits.parameters),
            );
        }
    }
    if c.errors.is_empty() {
        Ok(resolved)
    } else {
        c.errors.sort_by_key(|d| d.span.as_ref().map(|s| s.start));
        Err(c.errors)
    }
}
