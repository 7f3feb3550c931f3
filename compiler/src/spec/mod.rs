//! The spec language: a Transformer architecture written as TOML.
//!
//! A spec is parsed with serde into [`Spec`] (unknown keys are refused), then [`validate`] checks
//! the rules that serde cannot (heads divide `d_model`, every dimension bounded, ...). Both stages
//! report [`Diagnostic`]s located at `line:column` in the source, looked up through a
//! [`SpanIndex`] built from the same text.
//!
//! Every section but `[model]` and `[attention]` may be left out; the defaults are those of a
//! plain GPT-style block (pre-norm LayerNorm, learned positions, GELU feed-forward of `4 * d_model`,
//! tied head). The full reference of keys lives in the README's spec reference.

pub mod import;
mod parse;
mod validate;
pub mod weightmap;

pub use parse::{SpanIndex, parse_spec};
pub use validate::{Limits, validate};
pub use weightmap::{Pack, PackDims, PackPart, Source, WeightMap};

use crate::diag::Diagnostic;
use serde::Deserialize;
use std::collections::BTreeMap;

/// A whole model spec.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Sizes and the block type.
    pub model: Model,
    /// Token embedding options.
    #[serde(default)]
    pub embedding: Embedding,
    /// Positional scheme.
    #[serde(default)]
    pub positions: Positions,
    /// Normalisation kind and placement.
    #[serde(default)]
    pub norm: Norm,
    /// Attention.
    pub attention: Attention,
    /// Feed-forward.
    #[serde(default)]
    pub ffn: Ffn,
    /// Mixture of experts; when present every feed-forward is a routed set of experts.
    #[serde(default)]
    pub moe: Option<Moe>,
    /// Output head.
    #[serde(default)]
    pub head: Head,
    /// What the model returns.
    #[serde(default)]
    pub outputs: Outputs,
    /// Where the parameters come from in a checkpoint.
    #[serde(default)]
    pub weights: Weights,
    /// How `kiln init` draws the first weights.
    #[serde(default)]
    pub init: Init,
    /// How the model is trained (`kiln train`): the recipe's keys, every one optional (see
    /// [`crate::train::RecipeFile`]); a `--recipe` file and command-line flags override them.
    #[serde(default)]
    pub train: Option<crate::train::RecipeFile>,
}

/// `[model]`: the block type and the sizes.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// A name used in dumps and errors.
    #[serde(default = "default_name")]
    pub name: String,
    /// Encoder, decoder or encoder-decoder.
    pub kind: BlockKind,
    /// Vocabulary size.
    pub vocab: u64,
    /// Model width.
    pub d_model: u64,
    /// Number of blocks (of each stack, for encoder-decoder unless overridden).
    pub layers: u64,
    /// Encoder blocks of an encoder-decoder (defaults to `layers`).
    #[serde(default)]
    pub encoder_layers: Option<u64>,
    /// Decoder blocks of an encoder-decoder (defaults to `layers`).
    #[serde(default)]
    pub decoder_layers: Option<u64>,
    /// Longest sequence the model accepts (the size of a learned position table).
    #[serde(default = "default_max_positions")]
    pub max_positions: u64,
}

fn default_name() -> String {
    "model".into()
}
fn default_max_positions() -> u64 {
    2048
}

/// The block type.
#[derive(Clone, Copy, Debug, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum BlockKind {
    /// Bidirectional self-attention stack (BERT).
    Encoder,
    /// Causal self-attention stack (GPT, LLaMA).
    Decoder,
    /// An encoder, and a decoder with cross-attention to its output (the original Transformer, T5).
    EncoderDecoder,
}

/// `[embedding]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Embedding {
    /// Multiplier of the token embedding: a number or `"sqrt-d-model"`.
    #[serde(default)]
    pub scale: EmbeddingScale,
    /// A norm applied to the summed embeddings (BERT, BLOOM).
    #[serde(default)]
    pub norm: bool,
    /// Size of the token-type (segment) table; 0 for none.
    #[serde(default)]
    pub token_types: u64,
    /// Encoder-decoder only: one token table for source and target.
    #[serde(default = "yes")]
    pub shared: bool,
}

impl Default for Embedding {
    fn default() -> Self {
        Embedding { scale: EmbeddingScale::default(), norm: false, token_types: 0, shared: true }
    }
}

fn yes() -> bool {
    true
}

/// The embedding multiplier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EmbeddingScale {
    /// A constant.
    Value(f64),
    /// A named rule.
    Named(ScaleRule),
}

impl Default for EmbeddingScale {
    fn default() -> Self {
        EmbeddingScale::Value(1.0)
    }
}

/// Named embedding scales.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ScaleRule {
    /// `sqrt(d_model)` (the original Transformer, Gemma).
    SqrtDModel,
}

/// `[positions]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Positions {
    /// The scheme.
    #[serde(default)]
    pub kind: PositionKind,
    /// RoPE base (theta).
    #[serde(default = "default_theta")]
    pub theta: f64,
    /// RoPE pair layout, or sinusoid layout.
    #[serde(default)]
    pub style: Option<PairStyle>,
    /// RoPE: the fraction of each head's dimensions that is rotated.
    #[serde(default = "one")]
    pub fraction: f64,
    /// RoPE base of the layers that attend globally when `attention.global_every` mixes them with
    /// sliding-window layers (default `theta`).
    #[serde(default)]
    pub global_theta: Option<f64>,
    /// Relative bias: distance buckets (half of them per direction in a bidirectional stack).
    #[serde(default)]
    pub buckets: Option<u64>,
    /// Relative bias: the distance from which every larger one shares the last bucket.
    #[serde(default)]
    pub max_distance: Option<u64>,
}

impl Default for Positions {
    fn default() -> Self {
        Positions {
            kind: PositionKind::default(),
            theta: default_theta(),
            style: None,
            fraction: 1.0,
            global_theta: None,
            buckets: None,
            max_distance: None,
        }
    }
}

fn default_theta() -> f64 {
    10000.0
}
fn one() -> f64 {
    1.0
}

/// Positional schemes.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PositionKind {
    /// No positional information (or only what attention biases add).
    None,
    /// A learned table of `max_positions` rows added to the embedding.
    #[default]
    Learned,
    /// Fixed sin/cos table added to the embedding.
    Sinusoidal,
    /// Rotary embedding of queries and keys.
    Rope,
    /// Attention with linear biases.
    Alibi,
    /// A learned bias per head added to the attention logits, indexed by the bucketed distance
    /// between key and query (T5): exact buckets for short distances, log-spaced ones up to
    /// `max_distance`; both directions in a bidirectional stack, only the past in a causal one.
    /// One table per stack (`relative_bias`, `[buckets, heads]`), shared by its layers; none on
    /// cross-attention.
    RelativeBias,
}

/// How the two halves of a rotation (or of a sinusoid) are laid out over the dimensions.
#[derive(Clone, Copy, Debug, Deserialize, serde::Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum PairStyle {
    /// First half / second half (HF's `rotate_half`; sin block then cos block).
    RotateHalf,
    /// Adjacent pairs (2i, 2i+1) (GPT-J, llama.cpp; sin, cos interleaved).
    Interleaved,
}

/// `[norm]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Norm {
    /// Which normalisation.
    #[serde(default)]
    pub kind: NormKind,
    /// Epsilon added to the variance.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Where the norms sit relative to the residual.
    #[serde(default)]
    pub placement: Placement,
    /// DeepNorm's residual scale `alpha` (default `(2 * layers)^(1/4)`).
    #[serde(default)]
    pub alpha: Option<f64>,
    /// A norm after the last block (default: on for pre-norm, off otherwise).
    #[serde(default, rename = "final")]
    pub final_norm: Option<bool>,
    /// Attention and feed-forward side by side on the same input (GPT-J, GPT-NeoX).
    #[serde(default)]
    pub parallel_residual: bool,
    /// Added to every gain: `1.0` for checkpoints that store a zero-centred gain (Gemma's RMSNorm
    /// multiplies by `1 + weight`).
    #[serde(default)]
    pub gain_offset: f64,
}

impl Default for Norm {
    fn default() -> Self {
        Norm {
            kind: NormKind::default(),
            eps: default_eps(),
            placement: Placement::default(),
            alpha: None,
            final_norm: None,
            parallel_residual: false,
            gain_offset: 0.0,
        }
    }
}

fn default_eps() -> f64 {
    1e-5
}

/// Normalisations.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum NormKind {
    /// LayerNorm with gain and bias.
    #[default]
    Layernorm,
    /// LayerNorm with a gain only.
    LayernormNoBias,
    /// Root-mean-square norm with a gain.
    Rmsnorm,
}

/// Norm placement.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// `x + f(norm(x))`.
    #[default]
    Pre,
    /// `norm(x + f(x))`.
    Post,
    /// `norm(alpha * x + f(x))`.
    Deepnorm,
    /// `x + post(f(pre(x)))`: a norm before and another after each sublayer (Gemma 2/3).
    Sandwich,
    /// `x + norm(f(x))`: the norm after the sublayer, inside the residual (OLMo 2, Swin v2).
    PostSublayer,
}

impl Placement {
    /// Whether a norm follows each sublayer inside the residual (its parameters `*_post_norm`).
    pub fn post_sublayer(self) -> bool {
        matches!(self, Placement::Sandwich | Placement::PostSublayer)
    }
}

/// `[attention]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Attention {
    /// Query heads.
    pub heads: u64,
    /// Key/value heads (default `heads`; fewer is grouped-query, 1 is multi-query).
    #[serde(default)]
    pub kv_heads: Option<u64>,
    /// Per-head width (default `d_model / heads`).
    #[serde(default)]
    pub head_dim: Option<u64>,
    /// Which keys a query sees (default: causal for decoders, bidirectional for encoders).
    #[serde(default)]
    pub mask: Option<MaskKind>,
    /// Sliding-window size (keys within `window` positions before the query, itself included).
    #[serde(default)]
    pub window: Option<u64>,
    /// Whether the model takes a key padding mask input.
    #[serde(default)]
    pub padding_mask: bool,
    /// Biases on all four projections (overridden per projection by `q_bias` ... `o_bias`).
    #[serde(default)]
    pub bias: bool,
    /// Bias on the query projection.
    #[serde(default)]
    pub q_bias: Option<bool>,
    /// Bias on the key projection.
    #[serde(default)]
    pub k_bias: Option<bool>,
    /// Bias on the value projection.
    #[serde(default)]
    pub v_bias: Option<bool>,
    /// Bias on the output projection.
    #[serde(default)]
    pub o_bias: Option<bool>,
    /// The logit scale (default `1 / sqrt(head_dim)`).
    #[serde(default)]
    pub scale: Option<f64>,
    /// With `window`: every `global_every`-th layer (layers `global_every - 1`, `2 * global_every -
    /// 1`, ...) attends to every earlier key, the others through the sliding window (Gemma 3: 6).
    #[serde(default)]
    pub global_every: Option<u64>,
    /// With `window`: the attention of each layer of the stack that follows `mask`, in order (the
    /// decoder's in an encoder-decoder): any pattern, where `global_every` is a periodic one.
    #[serde(default)]
    pub layer_types: Option<Vec<LayerKind>>,
    /// A norm on the queries and keys of self-attention before RoPE, of the `[norm]` kind: over
    /// each head's width (`"head"`) or over the whole projection (`"width"`).
    #[serde(default)]
    pub qk_norm: Option<QkNorm>,
    /// Linformer: self-attention's keys and values projected along the sequence axis to this many
    /// rows by learned `[max_positions, low_rank]` matrices (`attn.proj_k`, `attn.proj_v`; a
    /// shorter input uses their first rows), so attention costs O(n low_rank).
    #[serde(default)]
    pub low_rank: Option<u64>,
    /// Linformer: one projection (`attn.proj_k`) for keys and values.
    #[serde(default)]
    pub low_rank_shared: bool,
    /// Soft-capping of the (scaled) attention logits: `c * tanh(s / c)` (Gemma 2: 50).
    #[serde(default)]
    pub softcap: Option<f64>,
    /// BigBird-style block sparsity of bidirectional self-attention.
    #[serde(default)]
    pub block_sparse: Option<BlockSparse>,
}

/// `[attention.block_sparse]`: which blocks of keys a block of queries attends (BigBird): the
/// global blocks see and are seen by every block, each block sees its `window` neighbours on each
/// side, and `random` more blocks drawn per query block by SplitMix64 from `seed` (the rule of
/// [`crate::semantics::block_pattern`]). Every layer and head shares the pattern.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BlockSparse {
    /// Positions per block.
    pub block: u64,
    /// Leading global blocks.
    #[serde(default)]
    pub global: u64,
    /// Neighbour blocks seen on each side.
    #[serde(default)]
    pub window: u64,
    /// Random blocks per query block.
    #[serde(default)]
    pub random: u64,
    /// Seed of the random blocks.
    #[serde(default)]
    pub seed: u64,
}

/// The attention of one layer under a sliding-window mask (`attention.layer_types`). The names
/// Hugging Face configs give in their `layer_types` are accepted too.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum LayerKind {
    /// Through the window (`attention.window`), at `positions.theta`.
    #[serde(alias = "sliding_attention")]
    SlidingWindow,
    /// Every earlier key, at `positions.global_theta`.
    #[serde(alias = "full_attention")]
    Global,
}

impl LayerKind {
    /// The name used in specs.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::SlidingWindow => "sliding-window",
            LayerKind::Global => "global",
        }
    }
}

/// Where a query/key norm normalises.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum QkNorm {
    /// Over each head's `head_dim` values (a gain of `head_dim`; Gemma 3, Qwen 3).
    Head,
    /// Over the whole projection (a gain of `heads * head_dim`, `kv_heads * head_dim` for keys;
    /// OLMo 2).
    Width,
}

/// Attention masks.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum MaskKind {
    /// Every query sees every key.
    Bidirectional,
    /// A query sees itself and earlier keys.
    Causal,
    /// Causal, limited to the last `window` keys.
    SlidingWindow,
}

/// `[ffn]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
#[derive(Default)]
pub struct Ffn {
    /// The activation.
    #[serde(default)]
    pub activation: Activation,
    /// Gated (`down(act(gate(x)) * up(x))`): SwiGLU with SiLU, GeGLU with GELU.
    #[serde(default)]
    pub gated: bool,
    /// Hidden width (default `4 * d_model`).
    #[serde(default)]
    pub d_ff: Option<u64>,
    /// Biases on the feed-forward projections.
    #[serde(default)]
    pub bias: bool,
}

/// Activations.
#[derive(Clone, Copy, Debug, Default, Deserialize, serde::Serialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Activation {
    /// `max(0, x)`.
    Relu,
    /// Exact GELU, `x * Phi(x)` with the error function.
    #[default]
    Gelu,
    /// GELU's tanh approximation.
    GeluTanh,
    /// `x * sigmoid(x)`.
    Silu,
}

/// `[moe]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Moe {
    /// Number of experts (each one a feed-forward as described by `[ffn]`).
    pub experts: u64,
    /// Experts used per token.
    pub top_k: u64,
    /// Rescale the kept router probabilities to sum to one.
    #[serde(default = "yes")]
    pub renormalize: bool,
}

/// `[head]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Head {
    /// Share the token embedding as the output projection.
    #[serde(default = "yes")]
    pub tied: bool,
    /// A bias on the output projection.
    #[serde(default)]
    pub bias: bool,
    /// A multiplier of the hidden states before the head (T5 v1.0: `d_model^-0.5`).
    #[serde(default = "one")]
    pub scale: f64,
    /// Soft-capping of the final logits: `c * tanh(logits / c)` (Gemma 2: 30).
    #[serde(default)]
    pub softcap: Option<f64>,
    /// A transform of the hidden states before the projection, as masked-LM heads have (BERT's
    /// `cls.predictions.transform`): `norm(act(h @ W^T + b))`, a `d_model`-wide dense with a bias,
    /// then the activation, then a norm of the spec's `[norm]` kind and eps.
    #[serde(default)]
    pub transform: bool,
    /// The transform's activation (default: `ffn.activation`).
    #[serde(default)]
    pub transform_activation: Option<Activation>,
}

impl Default for Head {
    fn default() -> Self {
        Head { tied: true, bias: false, scale: 1.0, softcap: None, transform: false, transform_activation: None }
    }
}

/// `[outputs]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Outputs {
    /// `logits`: scores over the vocabulary (needs the head).
    #[serde(default)]
    pub logits: Option<bool>,
    /// `last_hidden_state`: the final hidden states.
    #[serde(default)]
    pub hidden_states: bool,
    /// `encoder_hidden_state`: an encoder-decoder's encoder output (after its final norm).
    #[serde(default)]
    pub encoder_hidden_state: bool,
    /// `sentence_embedding`: pooled hidden states.
    #[serde(default)]
    pub pooling: Pooling,
    /// Scale the pooled vector to unit L2 norm (sentence-transformers' `Normalize` module).
    #[serde(default)]
    pub normalize: bool,
    /// The longest input, in tokens, that the model's own pipeline embeds (sentence-transformers'
    /// `max_seq_length`: all-MiniLM-L6-v2 stops at 256 of its 512 positions); `kiln embed`
    /// truncates there. `None`: `model.max_positions`.
    #[serde(default)]
    pub max_seq_length: Option<u64>,
}

impl Default for Outputs {
    fn default() -> Self {
        Outputs {
            logits: None,
            hidden_states: false,
            encoder_hidden_state: false,
            pooling: Pooling::None,
            normalize: false,
            max_seq_length: None,
        }
    }
}

/// Pooling of the final hidden states into one vector per sequence.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Pooling {
    /// No pooled output.
    #[default]
    None,
    /// Mean over the unpadded tokens.
    Mean,
}

/// `[weights]`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    /// A named map of a model family (`gpt2`, `bert`, `llama`, ...).
    #[serde(default)]
    pub preset: Option<String>,
    /// Entries added to, or replacing, the preset's: graph parameter template -> checkpoint tensor.
    #[serde(default)]
    pub tensors: BTreeMap<String, weightmap::SourceSpec>,
    /// Where the checkpoint is (`kiln import` records it): a safetensors or GGUF file, relative
    /// to the spec's directory unless absolute. The CLI reads it when `--weights` is not given.
    #[serde(default)]
    pub path: Option<String>,
}

/// `[init]`: the distributions a model's first weights are drawn from (`kiln init`). Every
/// matrix and embedding table is normal(0, `std`); biases are 0; norm gains are 1 (stored as
/// `1 - norm.gain_offset`, so 0 for a `(1 + w)` gain); the residual branches' output projections
/// (attention `o`, feed-forward `down`) are scaled by `residual_scale`; under DeepNorm the
/// feed-forward, value and output projections are Xavier-normal with gain `beta`, the query and
/// key projections with gain 1.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Init {
    /// Standard deviation of the normal of matrices and embeddings.
    #[serde(default = "default_init_std")]
    pub std: f64,
    /// The multiplier of residual output projections (default: `"gpt2"` with the `gpt2` weight
    /// preset, else `"none"`).
    #[serde(default)]
    pub residual_scale: Option<ResidualScale>,
    /// DeepNorm's init gain beta (default `(8 * layers)^(-1/4)`; DeepNorm only).
    #[serde(default)]
    pub beta: Option<f64>,
    /// Seed of the draws.
    #[serde(default)]
    pub seed: u64,
}

impl Default for Init {
    fn default() -> Self {
        Init { std: default_init_std(), residual_scale: None, beta: None, seed: 0 }
    }
}

fn default_init_std() -> f64 {
    0.02
}

/// The multiplier of the residual branches' output projections at initialization.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ResidualScale {
    /// `1 / sqrt(2 * layers)` (GPT-2, nanoGPT).
    Gpt2,
    /// No scaling.
    None,
    /// A constant.
    Value(f64),
}

/// The initialization of a validated spec with its defaults resolved ([`Resolved::init`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InitRules {
    /// Standard deviation of matrices and embeddings.
    pub std: f64,
    /// The residual scale rule in force (written, or the family's default).
    pub residual_scale: ResidualScale,
    /// The multiplier it gives.
    pub residual_factor: f64,
    /// DeepNorm's beta, when the placement is DeepNorm.
    pub deepnorm_beta: Option<f64>,
    /// The norm gain's stored value for a gain of 1 (`1 - norm.gain_offset`).
    pub norm_gain: f64,
    /// Seed of the draws.
    pub seed: u64,
}

/// A parsed, validated spec with its defaults resolved: what the graph builder reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The spec as written.
    pub spec: Spec,
    /// Per-head width.
    pub head_dim: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Feed-forward width.
    pub d_ff: u64,
    /// The attention mask of self-attention in the main stack (decoder stack for encoder-decoder).
    pub mask: MaskKind,
    /// Under a sliding-window mask, each main-stack layer's attention (from `attention.layer_types`
    /// or `attention.global_every`); empty otherwise.
    pub layer_kinds: Vec<LayerKind>,
    /// Whether a final norm is applied.
    pub final_norm: bool,
    /// The logit scale.
    pub attn_scale: f64,
    /// Embedding multiplier.
    pub embed_scale: f64,
    /// DeepNorm alpha (1 for other placements).
    pub residual_alpha: f64,
    /// Number of rotated dimensions per head (RoPE only).
    pub rotary_dim: u64,
    /// Relative bias: `(buckets, max_distance)` (relative-bias positions only).
    pub relative: (u64, u64),
    /// Whether logits are produced.
    pub logits: bool,
    /// Encoder blocks (0 for decoder-only).
    pub encoder_layers: u64,
    /// Decoder blocks (0 for encoder-only).
    pub decoder_layers: u64,
    /// The weight map, preset plus overrides.
    pub weights: WeightMap,
}

impl Resolved {
    /// Number of blocks of the stack that produces the outputs.
    pub fn layers(&self) -> u64 {
        self.encoder_layers + self.decoder_layers
    }

    /// The initialization rules (`[init]` with its defaults: the residual scale is GPT-2's for a
    /// spec on the `gpt2` weight preset, none otherwise and under DeepNorm, whose beta applies).
    pub fn init(&self) -> InitRules {
        let spec = &self.spec;
        let layers = spec.model.layers.max(1) as f64;
        let deepnorm = spec.norm.placement == Placement::Deepnorm;
        let residual_scale =
            spec.init.residual_scale.unwrap_or(if !deepnorm && spec.weights.preset.as_deref() == Some("gpt2") {
                ResidualScale::Gpt2
            } else {
                ResidualScale::None
            });
        let residual_factor = match residual_scale {
            ResidualScale::Gpt2 => 1.0 / (2.0 * layers).sqrt(),
            ResidualScale::None => 1.0,
            ResidualScale::Value(v) => v,
        };
        InitRules {
            std: spec.init.std,
            residual_scale,
            residual_factor,
            deepnorm_beta: deepnorm.then(|| spec.init.beta.unwrap_or((8.0 * layers).powf(-0.25))),
            norm_gain: 1.0 - spec.norm.gain_offset,
            seed: spec.init.seed,
        }
    }

    /// The attention of layer `i` of the main stack under a sliding-window mask.
    pub fn layer_kind(&self, i: u64) -> LayerKind {
        usize::try_from(i).ok().and_then(|i| self.layer_kinds.get(i)).copied().unwrap_or(LayerKind::SlidingWindow)
    }
}

/// Parses and validates a spec: the front end in one call.
pub fn load(file: &str, source: &str) -> Result<Resolved, crate::diag::SpecError> {
    let fail = |diagnostics: Vec<Diagnostic>| crate::diag::SpecError {
        file: file.to_string(),
        source: source.to_string(),
        diagnostics,
    };
    let (spec, index) = parse_spec(source).map_err(|d| fail(vec![d]))?;
    validate(spec, &index, &Limits::default()).map_err(fail)
}
