//! Validation: the rules a spec must keep beyond its TOML types, with defaults resolved.
//!
//! Every error is located at the key it concerns. All rules are checked and all failures reported,
//! so a person fixes a spec in one pass. Every dimension is bounded by [`Limits`] so that absurd
//! sizes are refused here, before anything is allocated. The rules only a built graph can check
//! (the parameter count, weight-map keys naming parameters) are the front end's
//! ([`crate::front_end`]), which runs them on the graph it builds from the spec resolved here.

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
    /// Total parameter count (checked by the front end, on the built graph).
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
        self.errors.push(Diagnostic::new(rule, message).with_key(key).with_span(self.index.locate(key)));
    }

    fn error_help(&mut self, key: &str, rule: &'static str, message: String, help: String) {
        self.error_at(key, key, rule, message, help);
    }

    /// An error about `key` located at `at`: the written key that brings the rule into play, when
    /// `key` itself is not written (a missing `window` is reported at the mask that needs it).
    fn error_at(&mut self, key: &str, at: &str, rule: &'static str, message: String, help: String) {
        self.errors.push(Diagnostic::new(rule, message).with_key(key).with_span(self.index.locate(at)).with_help(help));
    }

    /// `1 <= value <= max`.
    fn bounded(&mut self, key: &str, value: u64, max: u64) {
        if value == 0 {
            self.error(key, "dimensions are positive", format!("`{key}` must be at least 1"));
        } else if value > max {
            self.error(key, "dimensions are bounded", format!("`{key}` = {value} is larger than the limit {max}"));
        }
    }

    fn positive_finite(&mut self, key: &str, value: f64) {
        if !(value.is_finite() && value > 0.0) {
            self.error(key, "positive finite number", format!("`{key}` = {value} must be a positive finite number"));
        } else {
            self.single(key, value);
        }
    }

    /// A finite float setting as the kernels use it: in f32, where it must stay finite and, unless
    /// it is 0, normal (a subnormal is flushed to zero on some GPUs, so engines would disagree;
    /// 1e300 would be infinite and 1e-300 zero, neither what was written).
    fn single(&mut self, key: &str, value: f64) {
        let single = value as f32;
        if value != 0.0 && !single.is_normal() {
            self.error_help(
                key,
                "float settings fit f32",
                format!("`{key}` = {value:e} is {single:?} in f32, which the kernels compute in"),
                format!("use a magnitude between {:e} and {:e}", f32::MIN_POSITIVE, f32::MAX),
            );
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
                c.error_help(
                    key,
                    "stack sizes belong to encoder-decoder models",
                    format!("`{key}` is only meaningful when `model.kind` = \"encoder-decoder\""),
                    "remove it: the number of blocks of a single stack is `model.layers`".into(),
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
    if a.heads > 0 && kv_heads > 0 && !a.heads.is_multiple_of(kv_heads) {
        let divisors: Vec<String> =
            (1..=a.heads).filter(|d| a.heads.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        c.error_help(
            "attention.kv_heads",
            "kv_heads divides heads",
            format!("`attention.kv_heads` = {kv_heads} does not divide `attention.heads` = {}", a.heads),
            format!("each key/value head serves the same number of query heads; use one of {}", divisors.join(", ")),
        );
    }
    // Whether `head_dim` is what the spec means: written, or d_model split evenly. Rules that
    // derive from it are not checked otherwise, so the root cause is the one error shown.
    let head_dim_sound = a.head_dim.is_some() || (a.heads > 0 && m.d_model.is_multiple_of(a.heads));
    let head_dim = match a.head_dim {
        Some(hd) => {
            c.bounded("attention.head_dim", hd, limits.d_model);
            hd
        }
        None => {
            if a.heads > 0 && !m.d_model.is_multiple_of(a.heads) {
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
    // Implicit heads are `d_model / heads` wide and within `d_model`'s bound already.
    if a.head_dim.is_some() && head_dim.saturating_mul(a.heads) > limits.d_model {
        c.error(
            "attention.head_dim",
            "dimensions are bounded",
            format!(
                "heads * head_dim = {} is larger than the limit {}",
                head_dim.saturating_mul(a.heads),
                limits.d_model
            ),
        );
    }
    let default_mask = match m.kind {
        BlockKind::Encoder => MaskKind::Bidirectional,
        _ => MaskKind::Causal,
    };
    let mask = a.mask.unwrap_or(default_mask);
    match (mask, a.window) {
        (MaskKind::SlidingWindow, None) => c.error_at(
            "attention.window",
            "attention.mask",
            "a sliding window has a size",
            "`attention.mask` = \"sliding-window\" needs `attention.window`".into(),
            "add `window = <keys>` to [attention]: how many positions back a query sees, itself included".into(),
        ),
        (MaskKind::SlidingWindow, Some(w)) => c.bounded("attention.window", w, limits.max_positions),
        (_, Some(_)) => c.error_help(
            "attention.window",
            "a window needs a sliding-window mask",
            "`attention.window` is set but `attention.mask` is not \"sliding-window\"".into(),
            "set `mask = \"sliding-window\"` in [attention], or remove `window`".into(),
        ),
        _ => {}
    }
    // Each main-stack layer's attention under the window: listed, or every `global_every`-th.
    let stack_layers = match m.kind {
        BlockKind::EncoderDecoder => ("model.decoder_layers", decoder_layers),
        _ => ("model.layers", m.layers),
    };
    if let Some(every) = a.global_every {
        c.bounded("attention.global_every", every, limits.layers);
        let layers = stack_layers.1;
        if every > layers && layers > 0 {
            c.error_help(
                "attention.global_every",
                "some layer is global",
                format!("`attention.global_every` = {every} is more than the {layers} layers: no layer would attend globally"),
                format!("use at most {layers}, or remove `global_every` to make every layer a sliding-window one"),
            );
        }
        if mask != MaskKind::SlidingWindow {
            c.error_help(
                "attention.global_every",
                "global layers interleave with sliding-window ones",
                "`attention.global_every` is set but `attention.mask` is not \"sliding-window\"".into(),
                "set `mask = \"sliding-window\"` and `window` in [attention]: the layers that are not global use the window".into(),
            );
        }
    }
    let layer_kinds = match (&a.layer_types, a.global_every) {
        (Some(kinds), every) => {
            if every.is_some() {
                c.error_help(
                    "attention.layer_types",
                    "one per-layer pattern",
                    "`attention.layer_types` and `attention.global_every` both say which layers are global".into(),
                    "keep one: `layer_types` lists any pattern, `global_every` a periodic one".into(),
                );
            }
            if mask != MaskKind::SlidingWindow {
                c.error_help(
                    "attention.layer_types",
                    "global layers interleave with sliding-window ones",
                    "`attention.layer_types` is set but `attention.mask` is not \"sliding-window\"".into(),
                    "set `mask = \"sliding-window\"` and `window` in [attention]: the layers listed as \"sliding-window\" use the window".into(),
                );
            }
            let (key, count) = stack_layers;
            if kinds.len() as u64 != count {
                let which = if m.kind == BlockKind::EncoderDecoder { "the decoder has" } else { "the model has" };
                c.error_help(
                    "attention.layer_types",
                    "one layer type per layer",
                    format!("`attention.layer_types` lists {} layers, but {which} {count} (`{key}`)", kinds.len()),
                    "list one kind per layer, \"sliding-window\" or \"global\", in order".into(),
                );
            }
            kinds.clone()
        }
        (None, Some(every)) if mask == MaskKind::SlidingWindow => (1..=stack_layers.1)
            .map(|n| if n.is_multiple_of(every.max(1)) { LayerKind::Global } else { LayerKind::SlidingWindow })
            .collect(),
        _ => Vec::new(),
    };
    let layer_kinds = if mask == MaskKind::SlidingWindow { layer_kinds } else { Vec::new() };
    if let Some(bs) = a.block_sparse {
        c.bounded("attention.block_sparse.block", bs.block, limits.max_positions);
        if bs.random > 8 {
            c.error(
                "attention.block_sparse.random",
                "at most 8 random blocks",
                format!("`block_sparse.random` = {}: at most 8 random blocks per query block", bs.random),
            );
        }
        if mask != MaskKind::Bidirectional {
            c.error_help(
                "attention.block_sparse",
                "block sparsity is bidirectional",
                "`attention.block_sparse` draws blocks on both sides of a query, which a causal or windowed mask contradicts".into(),
                "use `mask = \"bidirectional\"` (an encoder's default) with `block_sparse`".into(),
            );
        }
    }
    if let Some(rank) = a.low_rank {
        c.bounded("attention.low_rank", rank, limits.max_positions);
        if mask != MaskKind::Bidirectional {
            c.error_help(
                "attention.low_rank",
                "low-rank attention sees every position",
                "`attention.low_rank` projects keys along the whole sequence, which a causal or windowed mask cannot restrict".into(),
                "use `mask = \"bidirectional\"` (an encoder's default) with `low_rank`".into(),
            );
        }
    } else if a.low_rank_shared {
        c.error_help(
            "attention.low_rank_shared",
            "a shared projection needs low-rank attention",
            "`attention.low_rank_shared` is set but `attention.low_rank` is not".into(),
            "set `low_rank = <rows>` in [attention], or remove `low_rank_shared`".into(),
        );
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
                let bad = (rotated - rotated.round()).abs() > 1e-9 || rotary_dim % 2 != 0 || rotary_dim == 0;
                if bad && head_dim_sound {
                    // Blame the fraction if it is written, else the head width it multiplies.
                    let key = if index.value("positions.fraction").is_some() {
                        "positions.fraction"
                    } else {
                        "attention.head_dim"
                    };
                    c.error_help(
                        key,
                        "RoPE needs an even rotated dim",
                        format!(
                            "RoPE rotates head_dim * fraction = {head_dim} * {} = {rotated} dimensions; that must be a positive even integer",
                            p.fraction
                        ),
                        "rotated dimensions come in pairs: choose `attention.head_dim` and `positions.fraction` so that their product is even".into(),
                    );
                }
            }
        }
        PositionKind::Sinusoidal => {
            if !m.d_model.is_multiple_of(2) {
                c.error(
                    "model.d_model",
                    "sinusoidal positions need an even width",
                    format!("sinusoidal positions pair sin and cos, so `model.d_model` = {} must be even", m.d_model),
                );
            }
        }
        PositionKind::None | PositionKind::Learned | PositionKind::Alibi | PositionKind::RelativeBias => {}
    }
    // Options of another scheme would be silently ignored.
    if let Some(theta) = p.global_theta {
        c.positive_finite("positions.global_theta", theta);
        let a = &spec.attention;
        if a.global_every.is_none() && a.layer_types.is_none() && p.kind == PositionKind::Rope {
            c.error_help(
                "positions.global_theta",
                "a global theta needs global layers",
                "`positions.global_theta` is set but neither `attention.global_every` nor `attention.layer_types` is"
                    .into(),
                "set `global_every` or `layer_types` in [attention] to say which layers attend globally, or remove `global_theta`"
                    .into(),
            );
        }
    }
    let (buckets, max_distance) = (p.buckets.unwrap_or(32), p.max_distance.unwrap_or(128));
    if p.kind == PositionKind::RelativeBias {
        // One rule for the lower end (zero included), the common bound for the upper.
        if buckets < 4 || !buckets.is_multiple_of(2) {
            c.error(
                "positions.buckets",
                "relative-bias buckets are even, at least 4",
                format!("`positions.buckets` = {buckets}: a bidirectional stack splits them by direction, then into exact and log-spaced halves; use an even number of at least 4"),
            );
        } else {
            c.bounded("positions.buckets", buckets, 1024);
        }
        c.bounded("positions.max_distance", max_distance, limits.max_positions);
        if max_distance <= buckets / 2 {
            c.error(
                "positions.max_distance",
                "log-spaced buckets reach past the exact ones",
                format!("`positions.max_distance` = {max_distance} must be larger than buckets / 2 = {}", buckets / 2),
            );
        }
    }
    for (option, schemes) in [
        ("theta", "rope"),
        ("fraction", "rope"),
        ("style", "rope and sinusoidal"),
        ("global_theta", "rope"),
        ("buckets", "relative-bias"),
        ("max_distance", "relative-bias"),
    ] {
        let key = format!("positions.{option}");
        let applies = match p.kind {
            PositionKind::Rope => matches!(option, "theta" | "fraction" | "style" | "global_theta"),
            PositionKind::Sinusoidal => option == "style",
            PositionKind::RelativeBias => matches!(option, "buckets" | "max_distance"),
            PositionKind::None | PositionKind::Learned | PositionKind::Alibi => false,
        };
        if !applies && index.value(&key).is_some() {
            let kind = match p.kind {
                PositionKind::None => "none",
                PositionKind::Learned => "learned",
                PositionKind::Sinusoidal => "sinusoidal",
                PositionKind::Rope => "rope",
                PositionKind::Alibi => "alibi",
                PositionKind::RelativeBias => "relative-bias",
            };
            c.error_help(
                &key,
                "options match the positional scheme",
                format!("`{key}` only applies to {schemes} positions, but `positions.kind` is \"{kind}\""),
                format!("remove `{option}`, or change `positions.kind`"),
            );
        }
    }

    // Combinations without a meaning. Low-rank attention's keys are projections along the
    // sequence, mixtures of every position: they have no position of their own to take a block,
    // a distance, a slope or a padding flag from.
    if let Some(rank) = a.low_rank {
        let positional = match p.kind {
            PositionKind::RelativeBias => Some(("positions.kind", "a relative position bias")),
            PositionKind::Alibi => Some(("positions.kind", "ALiBi")),
            _ => None,
        };
        let padding = a.padding_mask.then_some(("attention.padding_mask", "a key padding mask"));
        let keyed = a.block_sparse.map(|_| ("attention.block_sparse", "a block pattern"));
        for (key, what) in keyed.into_iter().chain(positional).chain(padding) {
            c.error_at(
                key,
                "attention.low_rank",
                "low-rank keys have no position",
                format!("{what} needs each key's position, but `attention.low_rank` projects the keys along the sequence into {rank} mixtures of every position"),
                format!("use `low_rank` or {what}, not both"),
            );
        }
        if rank > m.max_positions {
            c.error_help(
                "attention.low_rank",
                "a projection keeps fewer rows than the sequence",
                format!(
                    "`attention.low_rank` = {rank} is more rows than any input has (`model.max_positions` = {})",
                    m.max_positions
                ),
                format!("use at most {} rows", m.max_positions),
            );
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
            c.error_help(
                "norm.alpha",
                "alpha belongs to DeepNorm",
                "`norm.alpha` is set but `norm.placement` is not \"deepnorm\"".into(),
                "set `placement = \"deepnorm\"` in [norm], or remove `alpha`".into(),
            );
            1.0
        }
        (_, None) => 1.0,
    };
    let final_norm = n.final_norm.unwrap_or(matches!(n.placement, Placement::Pre) || n.placement.post_sublayer());
    if !n.gain_offset.is_finite() {
        c.error("norm.gain_offset", "finite number", format!("`norm.gain_offset` = {} must be finite", n.gain_offset));
    } else {
        c.single("norm.gain_offset", n.gain_offset);
    }
    if n.parallel_residual && m.kind == BlockKind::EncoderDecoder {
        c.error_help(
            "norm.parallel_residual",
            "parallel residual is a single-stack block",
            "`norm.parallel_residual` adds attention and feed-forward side by side; a decoder block with cross-attention has no such form".into(),
            "remove `parallel_residual`, or use `kind = \"decoder\"` or `\"encoder\"`".into(),
        );
    }
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
                c.error(
                    "embedding.scale",
                    "positive finite number",
                    format!("`embedding.scale` = {v} must be finite and non-zero"),
                );
            } else {
                c.single("embedding.scale", v);
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
    } else if d_ff > limits.d_ff && m.d_model <= limits.d_model {
        c.error_at(
            "ffn.d_ff",
            "model.d_model",
            "dimensions are bounded",
            format!("the default `ffn.d_ff` = 4 * `model.d_model` = {d_ff} is larger than the limit {}", limits.d_ff),
            "set `ffn.d_ff` explicitly".into(),
        );
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
    if o.encoder_hidden_state && m.kind != BlockKind::EncoderDecoder {
        c.error(
            "outputs.encoder_hidden_state",
            "an encoder output needs an encoder-decoder",
            "`outputs.encoder_hidden_state` is set but the model has no separate encoder (use `hidden_states`)".into(),
        );
    }
    if !logits && !o.hidden_states && o.pooling == Pooling::None {
        // Without an [outputs] table, it is the encoder kind that turned logits off.
        let at = if index.key("outputs").is_some() { "outputs" } else { "model.kind" };
        c.error_at(
            "outputs",
            at,
            "a model has an output",
            "the model would produce no output".into(),
            "enable one in [outputs]: `logits = true`, `hidden_states = true` or `pooling = \"mean\"`".into(),
        );
    }
    if o.pooling != Pooling::None && m.kind == BlockKind::EncoderDecoder {
        c.error_help(
            "outputs.pooling",
            "pooling is of a single stack",
            "`outputs.pooling` averages one stack's hidden states over its attention mask; an encoder-decoder has two stacks and no pooled output".into(),
            "remove `pooling`, or use `kind = \"encoder\"` for sentence embeddings".into(),
        );
    }
    if o.normalize && o.pooling == Pooling::None {
        c.error(
            "outputs.normalize",
            "normalize applies to a pooled output",
            "`outputs.normalize` is set but `outputs.pooling` is \"none\"".into(),
        );
    }
    if let Some(len) = o.max_seq_length {
        if o.pooling == Pooling::None {
            c.error(
                "outputs.max_seq_length",
                "max_seq_length applies to a pooled output",
                "`outputs.max_seq_length` is set but `outputs.pooling` is \"none\": only `kiln embed` truncates there"
                    .into(),
            );
        } else if len == 0 || len > spec.model.max_positions {
            c.error(
                "outputs.max_seq_length",
                "max_seq_length is within the positions",
                format!(
                    "`outputs.max_seq_length` = {len} must be from 1 to `model.max_positions` = {}",
                    spec.model.max_positions
                ),
            );
        }
    }
    for (key, cap) in [("attention.softcap", spec.attention.softcap), ("head.softcap", spec.head.softcap)] {
        if let Some(cap) = cap {
            c.positive_finite(key, cap);
        }
    }
    if !spec.head.scale.is_finite() || spec.head.scale == 0.0 {
        c.error(
            "head.scale",
            "positive finite number",
            format!("`head.scale` = {} must be finite and non-zero", spec.head.scale),
        );
    } else {
        c.single("head.scale", spec.head.scale);
    }
    if spec.head.bias && !logits {
        c.error("head.bias", "a head bias needs logits", "`head.bias` is set but the model produces no logits".into());
    }
    // The transform belongs to the head, which only a model with logits builds.
    if spec.head.transform && !logits {
        c.error_help(
            "head.transform",
            "a head transform needs logits",
            "`head.transform` is set but the model produces no logits, so no head is built".into(),
            "set `outputs.logits = true` (an encoder's default is false), or drop the transform".into(),
        );
    }
    if spec.head.transform_activation.is_some() && !spec.head.transform {
        c.error(
            "head.transform_activation",
            "an activation needs the transform",
            "`head.transform_activation` is set but `head.transform` is not true".into(),
        );
    }

    // Initialization.
    let init = &spec.init;
    c.positive_finite("init.std", init.std);
    if let Some(ResidualScale::Value(v)) = init.residual_scale {
        c.positive_finite("init.residual_scale", v);
    }
    if let Some(beta) = init.beta {
        if n.placement == Placement::Deepnorm {
            c.positive_finite("init.beta", beta);
        } else {
            c.error_help(
                "init.beta",
                "beta belongs to DeepNorm",
                "`init.beta` is set but `norm.placement` is not \"deepnorm\"".into(),
                "set `placement = \"deepnorm\"` in [norm], or remove `beta`".into(),
            );
        }
    }

    // Weight map.
    let mut weights = WeightMap::default();
    if let Some(name) = &spec.weights.preset {
        match weightmap::preset(name, weightmap::Variant::of(&spec)) {
            Some(entries) => {
                weights.preset = Some(name.clone());
                weights.entries = entries;
            }
            None => {
                let help = did_you_mean(name, weightmap::PRESETS.iter().copied())
                    .map(|s| format!("did you mean `{s}`?"))
                    .unwrap_or_else(|| format!("known presets: {}", weightmap::PRESETS.join(", ")));
                c.error_help(
                    "weights.preset",
                    "presets are known",
                    format!("unknown weight-map preset `{name}`"),
                    help,
                );
            }
        }
    }
    if spec.weights.path.as_deref().is_some_and(|p| p.trim().is_empty()) {
        c.error_help(
            "weights.path",
            "a recorded checkpoint path names a file",
            "`weights.path` is empty".into(),
            "give the checkpoint's path (relative to the spec's directory), or remove the key".into(),
        );
    }
    let templates = weightmap::all_templates();
    for (template, source) in &spec.weights.tensors {
        let key = format!("weights.tensors.{template}");
        if !weightmap::is_known_template(template) {
            let help = did_you_mean(template, templates.iter().map(String::as_str))
                .map(|s| format!("did you mean `{s}`?"))
                .unwrap_or_else(|| "parameter names are listed in the README's spec reference".into());
            c.errors.push(
                Diagnostic::new(
                    "weight-map keys name graph parameters",
                    format!("`{template}` is not a graph parameter"),
                )
                .with_key(key.clone())
                .with_span(index.key(&key).unwrap_or_else(|| index.locate(&key)))
                .with_help(help),
            );
            continue;
        }
        let s = &source.0;
        if s.pack.is_some() != s.part.is_some() {
            let help = match s.pack {
                Some(_) => "add `part` (q, k, v, gate or up): which part of the packed tensor this parameter is",
                None => "add `pack` (qkv-blocks, qkv-per-head or gate-up-blocks): how the tensor holds its parts",
            };
            c.error_help(
                &key,
                "pack and part go together",
                format!("`{template}`: `pack` and `part` must be given together"),
                help.into(),
            );
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

    // A declared recipe: its values as `kiln train` will check them (its steps may come from the
    // command line, so a missing `steps` is not an error here).
    if let Some(train) = &spec.train {
        let steps = crate::train::RecipeFile { steps: Some(train.steps.unwrap_or(1)), ..Default::default() };
        match train.clone().merge(steps).resolve() {
            Err(crate::train::RecipeError::Invalid { key, value, why }) => c.error(
                &format!("train.{key}"),
                "a recipe's values are possible",
                format!("`train.{key}` = {value}: {why}"),
            ),
            Err(e) => c.error("train", "a recipe's values are possible", e.to_string()),
            Ok(_) => {}
        }
    }

    let resolved = Resolved {
        head_dim,
        kv_heads,
        d_ff,
        mask,
        layer_kinds,
        final_norm,
        attn_scale,
        embed_scale,
        residual_alpha,
        rotary_dim,
        relative: (buckets, max_distance),
        logits,
        encoder_layers,
        decoder_layers,
        weights,
        spec,
    };
    if c.errors.is_empty() {
        Ok(resolved)
    } else {
        c.errors.sort_by_key(|d| d.span.as_ref().map(|s| s.start));
        Err(c.errors)
    }
}
