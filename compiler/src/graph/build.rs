//! Graph building: a validated spec -> the unoptimized graph.
//!
//! The builder is one recipe with branches for every knob of the spec language: embeddings,
//! blocks (pre/post/DeepNorm, parallel residual, cross-attention), attention (MHA/GQA/MQA, RoPE,
//! ALiBi, masks), feed-forward (plain, gated, experts) and outputs. Parameter names are the
//! canonical ones listed in [`crate::spec::weightmap::TEMPLATES`].

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::{Activation, Dim, Graph, GraphError, InputRole, Op, PairStyle, Scalar, Sym};
use crate::spec::{self, BlockKind, LayerKind, MaskKind, NormKind, Placement, Pooling, PositionKind, QkNorm, Resolved};
use petgraph::graph::NodeIndex;

type R<T> = Result<T, GraphError>;

/// Builds the graph of a validated spec.
pub fn build(r: &Resolved) -> R<Graph> {
    build_with(r, false)
}

/// Builds a decoder's graph for generation with a key/value cache: every self-attention layer
/// `L` takes the cached keys and values as inputs `L.past_k`, `L.past_v` (`f32[batch, kv_heads,
/// past, head_dim]`), attends over them followed by the new tokens, and returns both as outputs
/// `L.present_k`, `L.present_v` (`[batch, kv_heads, past + seq, head_dim]`), the next step's cache.
/// Positions and RoPE start at `past`.
///
/// A step's other outputs are its last position's: `logits` is `[batch, 1, vocab]` (and
/// `last_hidden_state`, where the spec asks for it, `[batch, 1, d_model]`), since only the last
/// position's scores pick the next token; a prompt of 32 tokens runs the head once, not 32 times.
/// The spec's pooling is left out (a step's last position has nothing to pool).
///
/// For an encoder-decoder this is the decoder alone, on `tgt_ids`: its cross-attention layers
/// `L` read the encoder's keys and values, computed once by [`build_encoder`], as inputs
/// `L.memory_k`, `L.memory_v` (`f32[batch, kv_heads, src_seq, head_dim]`), masked by
/// `src_padding` when the spec has padding masks. Decoder-only specs with padding masks are not
/// supported here (a cache holds one unpadded sequence).
pub fn build_cached(r: &Resolved) -> R<Graph> {
    // The whole model is at fault: its name is the scope.
    let unsupported =
        |message: &str| GraphError { op: "kv_cache".into(), scope: r.spec.model.name.clone(), message: message.into() };
    match r.spec.model.kind {
        BlockKind::Encoder => Err(unsupported(
            "generation with a key/value cache needs a decoder (kind = \"decoder\" or \"encoder-decoder\")",
        )),
        BlockKind::Decoder if r.spec.attention.padding_mask => {
            Err(unsupported("generation with a key/value cache does not support attention.padding_mask"))
        }
        _ if r.spec.attention.low_rank.is_some() => Err(unsupported(
            "generation with a key/value cache does not support attention.low_rank (its keys mix every position)",
        )),
        // A cached step computes each position once, from the keys before it: a bidirectional
        // self-attention's earlier positions would change with every later token.
        _ if r.mask == MaskKind::Bidirectional => Err(unsupported(
            "generation with a key/value cache needs a causal or sliding-window mask: under a bidirectional one, \
             earlier positions attend to later tokens, so they change as tokens are added",
        )),
        _ => build_with(r, true),
    }
}

/// Builds an encoder-decoder's encoder for generation: `src_ids` (and `src_padding`) in, and
/// for every decoder cross-attention layer `L` the keys and values of the encoder's output as
/// `L.memory_k`, `L.memory_v` (`f32[batch, kv_heads, src_seq, head_dim]`), the inputs of
/// [`build_cached`]'s decoder. Run once per source.
pub fn build_encoder(r: &Resolved) -> R<Graph> {
    let spec = &r.spec;
    if spec.model.kind != BlockKind::EncoderDecoder {
        return Err(GraphError {
            op: "encoder".into(),
            scope: spec.model.name.clone(),
            message: "only an encoder-decoder spec has a separate encoder".into(),
        });
    }
    let mut b = Builder { g: Graph::new(&spec.model.name), r, cache: false };
    let src = b.input("src_ids", InputRole::Ids, Sym::SrcSeq)?;
    let src_mask = if spec.attention.padding_mask {
        Some(b.input("src_padding", InputRole::KeyMask { pad_is_one: true }, Sym::SrcSeq)?)
    } else {
        None
    };
    let xs = b.embed("encoder.", src, None, Sym::SrcSeq)?;
    let memory = b.stack("encoder.", xs, r.encoder_layers, MaskKind::Bidirectional, Sym::SrcSeq, src_mask, None)?;
    let a = &spec.attention;
    let (d, kv_heads) = (b.d(), r.kv_heads as usize);
    let width = kv_heads * r.head_dim as usize;
    for i in 0..r.decoder_layers {
        let name = format!("decoder.layers.{i}.cross");
        b.g.scope = name.clone();
        let k = b.linear(memory, &format!("{name}.k"), width, d, a.k_bias.unwrap_or(a.bias))?;
        let v = b.linear(memory, &format!("{name}.v"), width, d, a.v_bias.unwrap_or(a.bias))?;
        let k = b.split_heads(k, Sym::SrcSeq, kv_heads)?;
        let v = b.split_heads(v, Sym::SrcSeq, kv_heads)?;
        b.g.outputs.push((format!("{name}.memory_k"), k));
        b.g.outputs.push((format!("{name}.memory_v"), v));
    }
    b.g.scope.clear();
    Ok(b.g)
}

fn build_with(r: &Resolved, cache: bool) -> R<Graph> {
    let spec = &r.spec;
    let mut b = Builder { g: Graph::new(&spec.model.name), r, cache };
    let (hidden, pool_mask) = match spec.model.kind {
        BlockKind::Encoder | BlockKind::Decoder => {
            let ids = b.input("input_ids", InputRole::Ids, Sym::Seq)?;
            // A generation step pools nothing (see below).
            let pools = spec.outputs.pooling != Pooling::None && !cache;
            let key_mask = if spec.attention.padding_mask || pools {
                Some(b.input("attention_mask", InputRole::KeyMask { pad_is_one: false }, Sym::Seq)?)
            } else {
                None
            };
            let attn_mask = if spec.attention.padding_mask { key_mask } else { None };
            let token_types = if spec.embedding.token_types > 0 {
                Some(b.input("token_type_ids", InputRole::TokenTypes, Sym::Seq)?)
            } else {
                None
            };
            let x = b.embed("", ids, token_types, Sym::Seq)?;
            let h = b.stack("", x, r.layers(), r.mask, Sym::Seq, attn_mask, None)?;
            (h, key_mask)
        }
        BlockKind::EncoderDecoder => {
            let src = if cache { None } else { Some(b.input("src_ids", InputRole::Ids, Sym::SrcSeq)?) };
            let tgt = b.input("tgt_ids", InputRole::Ids, Sym::Seq)?;
            let src_mask = if spec.attention.padding_mask {
                Some(b.input("src_padding", InputRole::KeyMask { pad_is_one: true }, Sym::SrcSeq)?)
            } else {
                None
            };
            // With a cache the encoder runs apart (`build_encoder`) and its keys and values are
            // inputs of the cross-attention layers.
            let memory = match src {
                Some(src) => {
                    let xs = b.embed("encoder.", src, None, Sym::SrcSeq)?;
                    let bidi = MaskKind::Bidirectional;
                    Some(b.stack("encoder.", xs, r.encoder_layers, bidi, Sym::SrcSeq, src_mask, None)?)
                }
                None => None,
            };
            if let (Some(memory), true) = (memory, spec.outputs.encoder_hidden_state) {
                b.g.outputs.push(("encoder_hidden_state".into(), memory));
            }
            let xt = b.embed("decoder.", tgt, None, Sym::Seq)?;
            let h = b.stack("decoder.", xt, r.decoder_layers, r.mask, Sym::Seq, None, Some((memory, src_mask)))?;
            (h, None)
        }
    };

    if r.logits {
        b.g.scope = "head".into();
        // A masked-LM head's transform (BERT's `cls.predictions.transform`): a dense layer, the
        // activation and a norm, before the projection.
        let hidden = if spec.head.transform {
            let d = b.d();
            let act = activation(spec.head.transform_activation.unwrap_or(spec.ffn.activation));
            let dense = b.linear(hidden, "head.transform", d, d, true)?;
            let act = b.g.add(Op::Act(act), &[dense])?;
            b.norm_of(act, "head.transform_norm", d)?
        } else {
            hidden
        };
        let table = if spec.head.tied {
            b.token_table(if spec.model.kind == BlockKind::EncoderDecoder { "decoder." } else { "" })
        } else {
            b.g.param("head.weight", &[spec.model.vocab as usize, spec.model.d_model as usize])
        };
        let scaled = if spec.head.scale != 1.0 {
            b.g.add(Op::Scale { factor: Scalar(spec.head.scale as f32) }, &[hidden])?
        } else {
            hidden
        };
        let mut logits = b.g.add(Op::MatMul { transpose_b: true }, &[scaled, table])?;
        if spec.head.bias {
            let bias = b.g.param("head.bias", &[spec.model.vocab as usize]);
            logits = b.g.add(Op::Add, &[logits, bias])?;
        }
        if let Some(cap) = spec.head.softcap {
            logits = b.g.add(Op::SoftCap { cap: Scalar(cap as f32) }, &[logits])?;
        }
        b.g.outputs.push(("logits".into(), logits));
    }
    if spec.outputs.hidden_states {
        b.g.outputs.push(("last_hidden_state".into(), hidden));
    }
    // A generation step's hidden state is its last position's, so it has nothing to pool.
    if spec.outputs.pooling == Pooling::Mean && !cache {
        b.g.scope = "pool".into();
        let mask = pool_mask.ok_or_else(|| GraphError {
            op: "mean_pool".into(),
            scope: "pool".into(),
            message: "pooling needs the attention_mask input of an encoder or decoder".into(),
        })?;
        let mut pooled = b.g.add(Op::MeanPool, &[hidden, mask])?;
        if spec.outputs.normalize {
            pooled = b.g.add(Op::L2Normalize, &[pooled])?;
        }
        b.g.outputs.push(("sentence_embedding".into(), pooled));
    }
    b.g.scope.clear();
    Ok(b.g)
}

/// The number of parameters the spec's graph has (sum over parameter elements).
pub fn parameter_count(r: &Resolved) -> u64 {
    build(r).map(|g| param_elements(&g)).unwrap_or(0)
}

/// Sum of the elements of every parameter of `g`.
pub fn param_elements(g: &Graph) -> u64 {
    g.params()
        .iter()
        .map(|(n, _)| g.g[*n].shape.iter().map(|d| if let Dim::Fixed(k) = d { *k as u64 } else { 0 }).product::<u64>())
        .sum()
}

/// What differs between the layers of one stack: the self-attention mask and the RoPE base.
#[derive(Clone, Copy)]
struct Layer {
    mask: MaskKind,
    theta: f64,
}

/// The name of the norm after a sublayer whose norm before it is `pre` (`layers.0.attn_norm` ->
/// `layers.0.attn_post_norm`).
fn post_norm(pre: &str) -> String {
    match pre.strip_suffix("_norm") {
        Some(stem) => format!("{stem}_post_norm"),
        None => format!("{pre}_post"),
    }
}

struct Builder<'a> {
    g: Graph,
    r: &'a Resolved,
    /// Self-attention reads and extends a key/value cache (see [`build_cached`]).
    cache: bool,
}

/// Where a block's attention looks: its own input, or an encoder's memory; `x: None` reads
/// the memory's keys and values from cache inputs (see [`build_cached`]).
struct Kv {
    x: Option<NodeIndex>,
    seq: Sym,
}

impl Builder<'_> {
    fn d(&self) -> usize {
        self.r.spec.model.d_model as usize
    }

    fn input(&mut self, name: &str, role: InputRole, seq: Sym) -> R<NodeIndex> {
        self.g.scope = "inputs".into();
        self.g.add(Op::Input { name: name.into(), role, seq }, &[])
    }

    fn token_table(&mut self, stack: &str) -> NodeIndex {
        let name =
            if self.r.spec.embedding.shared { "embed.tokens".to_string() } else { format!("{stack}embed.tokens") };
        // The same parameter may be requested twice (shared or tied tables): reuse the node.
        if let Some((n, _)) = self.g.params().into_iter().find(|(_, p)| *p == name) {
            return n;
        }
        let shape = [self.r.spec.model.vocab as usize, self.d()];
        self.g.param(&name, &shape)
    }

    /// Token (+ position, + token type) embeddings, scaled and normalised as the spec says.
    fn embed(&mut self, stack: &str, ids: NodeIndex, token_types: Option<NodeIndex>, seq: Sym) -> R<NodeIndex> {
        let spec = &self.r.spec;
        self.g.scope = format!("{stack}embed");
        let table = self.token_table(stack);
        let mut x = self.g.add(Op::Gather, &[table, ids])?;
        if self.r.embed_scale != 1.0 {
            x = self.g.add(Op::Scale { factor: Scalar(self.r.embed_scale as f32) }, &[x])?;
        }
        match spec.positions.kind {
            PositionKind::Learned => {
                let table =
                    self.g.param(&format!("{stack}embed.positions"), &[spec.model.max_positions as usize, self.d()]);
                let pos = self.g.add(Op::Positions { len: Dim::Sym(seq) }, &[])?;
                let p = self.g.add(Op::Gather, &[table, pos])?;
                x = self.g.add(Op::Add, &[x, p])?;
            }
            PositionKind::Sinusoidal => {
                let pos = self.g.add(Op::Positions { len: Dim::Sym(seq) }, &[])?;
                let style = spec.positions.style.map_or(PairStyle::Interleaved, pair_style);
                let p = self.g.add(Op::Sinusoid { dim: self.d(), style }, &[pos])?;
                x = self.g.add(Op::Add, &[x, p])?;
            }
            PositionKind::None | PositionKind::Rope | PositionKind::Alibi | PositionKind::RelativeBias => {}
        }
        if let Some(tt) = token_types {
            let table =
                self.g.param(&format!("{stack}embed.token_types"), &[spec.embedding.token_types as usize, self.d()]);
            let t = self.g.add(Op::Gather, &[table, tt])?;
            x = self.g.add(Op::Add, &[x, t])?;
        }
        if spec.embedding.norm {
            x = self.norm(x, &format!("{stack}embed.norm"))?;
        }
        Ok(x)
    }

    /// `layers` blocks, then the final norm if any.
    #[allow(clippy::too_many_arguments)]
    fn stack(
        &mut self,
        stack: &str,
        mut x: NodeIndex,
        layers: u64,
        mask: MaskKind,
        seq: Sym,
        key_mask: Option<NodeIndex>,
        cross: Option<(Option<NodeIndex>, Option<NodeIndex>)>,
    ) -> R<NodeIndex> {
        for i in 0..layers {
            // Under a window, a global layer (`layer_types`, `global_every`) attends to every
            // earlier key, at its own theta.
            let global = mask == MaskKind::SlidingWindow && self.r.layer_kind(i) == LayerKind::Global;
            let p = &self.r.spec.positions;
            let (mask, theta) =
                if global { (MaskKind::Causal, p.global_theta.unwrap_or(p.theta)) } else { (mask, p.theta) };
            let layer = Layer { mask, theta };
            x = self.block(&format!("{stack}layers.{i}"), x, layer, seq, key_mask, cross)?;
        }
        // A generation step's outputs are its last position's: its logits pick the next token
        // (a prefill's other positions would only be thrown away, and the head is the widest
        // projection a decoder has). Every op after the blocks is per row.
        if self.cache {
            x = self.g.add(Op::Last { axis: 1 }, &[x])?;
        }
        if self.r.final_norm {
            self.g.scope = format!("{stack}final_norm");
            x = self.norm(x, &format!("{stack}final_norm"))?;
        }
        Ok(x)
    }

    fn block(
        &mut self,
        name: &str,
        x: NodeIndex,
        layer: Layer,
        seq: Sym,
        key_mask: Option<NodeIndex>,
        cross: Option<(Option<NodeIndex>, Option<NodeIndex>)>,
    ) -> R<NodeIndex> {
        let norm = &self.r.spec.norm;
        if norm.parallel_residual {
            self.g.scope = format!("{name}.attn");
            let a_in = self.norm(x, &format!("{name}.attn_norm"))?;
            let a = self.attention(&format!("{name}.attn"), a_in, Kv { x: Some(a_in), seq }, seq, layer, key_mask)?;
            self.g.scope = format!("{name}.ffn");
            let f_in = self.norm(x, &format!("{name}.ffn_norm"))?;
            let f = self.ffn_or_moe(name, f_in)?;
            let sum = self.g.add(Op::Add, &[a, f])?;
            return self.g.add(Op::Add, &[x, sum]);
        }
        self.g.scope = format!("{name}.attn");
        let mut h = self.sublayer(x, &format!("{name}.attn_norm"), |b, y| {
            b.attention(&format!("{name}.attn"), y, Kv { x: Some(y), seq }, seq, layer, key_mask)
        })?;
        if let Some((memory, memory_mask)) = cross {
            self.g.scope = format!("{name}.cross");
            h = self.sublayer(h, &format!("{name}.cross_norm"), |b, y| {
                b.attention(
                    &format!("{name}.cross"),
                    y,
                    Kv { x: memory, seq: Sym::SrcSeq },
                    seq,
                    Layer { mask: MaskKind::Bidirectional, theta: b.r.spec.positions.theta },
                    memory_mask,
                )
            })?;
        }
        self.g.scope = format!("{name}.ffn");
        self.sublayer(h, &format!("{name}.ffn_norm"), |b, y| b.ffn_or_moe(name, y))
    }

    /// A residual sublayer with the spec's norm placement.
    fn sublayer(
        &mut self,
        x: NodeIndex,
        norm: &str,
        f: impl FnOnce(&mut Self, NodeIndex) -> R<NodeIndex>,
    ) -> R<NodeIndex> {
        match self.r.spec.norm.placement {
            Placement::Pre => {
                let y = self.norm(x, norm)?;
                let fy = f(self, y)?;
                self.g.add(Op::Add, &[x, fy])
            }
            Placement::Sandwich => {
                let y = self.norm(x, norm)?;
                let fy = f(self, y)?;
                let fy = self.norm(fy, &post_norm(norm))?;
                self.g.add(Op::Add, &[x, fy])
            }
            Placement::PostSublayer => {
                let fx = f(self, x)?;
                let fx = self.norm(fx, &post_norm(norm))?;
                self.g.add(Op::Add, &[x, fx])
            }
            Placement::Post | Placement::Deepnorm => {
                let fx = f(self, x)?;
                let skip = if self.r.residual_alpha != 1.0 {
                    self.g.add(Op::Scale { factor: Scalar(self.r.residual_alpha as f32) }, &[x])?
                } else {
                    x
                };
                let sum = self.g.add(Op::Add, &[skip, fx])?;
                self.norm(sum, norm)
            }
        }
    }

    fn norm(&mut self, x: NodeIndex, name: &str) -> R<NodeIndex> {
        self.norm_of(x, name, self.d())
    }

    /// The spec's norm over the last `d` values of `x` (its gain offset added to the gain, a
    /// load-time fold).
    fn norm_of(&mut self, x: NodeIndex, name: &str, d: usize) -> R<NodeIndex> {
        let n = &self.r.spec.norm;
        let eps = Scalar(n.eps as f32);
        let mut gain = self.g.param(&format!("{name}.weight"), &[d]);
        if n.gain_offset != 0.0 {
            gain = self.g.add(Op::Offset { value: Scalar(n.gain_offset as f32) }, &[gain])?;
        }
        match n.kind {
            NormKind::Layernorm => {
                let bias = self.g.param(&format!("{name}.bias"), &[d]);
                self.g.add(Op::LayerNorm { eps }, &[x, gain, bias])
            }
            NormKind::LayernormNoBias => self.g.add(Op::LayerNorm { eps }, &[x, gain]),
            NormKind::Rmsnorm => self.g.add(Op::RmsNorm { eps }, &[x, gain]),
        }
    }

    /// `x @ W^T (+ b)` with `W: [out, in]`.
    fn linear(&mut self, x: NodeIndex, name: &str, out: usize, inp: usize, bias: bool) -> R<NodeIndex> {
        let w = self.g.param(&format!("{name}.weight"), &[out, inp]);
        let y = self.g.add(Op::MatMul { transpose_b: true }, &[x, w])?;
        if bias {
            let b = self.g.param(&format!("{name}.bias"), &[out]);
            self.g.add(Op::Add, &[y, b])
        } else {
            Ok(y)
        }
    }

    /// `[b, s, heads * hd] -> [b, heads, s, hd]`.
    fn split_heads(&mut self, x: NodeIndex, seq: Sym, heads: usize) -> R<NodeIndex> {
        let hd = self.r.head_dim as usize;
        let shape = vec![Dim::Sym(Sym::Batch), Dim::Sym(seq), Dim::Fixed(heads), Dim::Fixed(hd)];
        let x = self.g.add(Op::Reshape { shape }, &[x])?;
        self.g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[x])
    }

    fn attention(
        &mut self,
        name: &str,
        xq: NodeIndex,
        kv: Kv,
        seq: Sym,
        layer: Layer,
        key_mask: Option<NodeIndex>,
    ) -> R<NodeIndex> {
        let r = self.r;
        let a = &r.spec.attention;
        let mask = layer.mask;
        let (d, hd, heads, kv_heads) = (self.d(), r.head_dim as usize, a.heads as usize, r.kv_heads as usize);
        let is_cross = name.ends_with(".cross");
        let bias = |b: Option<bool>| b.unwrap_or(a.bias);
        let qk_norm = if is_cross { None } else { a.qk_norm };
        let mut q = self.linear(xq, &format!("{name}.q"), heads * hd, d, bias(a.q_bias))?;
        if qk_norm == Some(QkNorm::Width) {
            q = self.norm_of(q, &format!("{name}.q_norm"), heads * hd)?;
        }
        let projected = match kv.x {
            Some(x) => {
                let mut k = self.linear(x, &format!("{name}.k"), kv_heads * hd, d, bias(a.k_bias))?;
                if qk_norm == Some(QkNorm::Width) {
                    k = self.norm_of(k, &format!("{name}.k_norm"), kv_heads * hd)?;
                }
                let v = self.linear(x, &format!("{name}.v"), kv_heads * hd, d, bias(a.v_bias))?;
                Some((k, v))
            }
            None => None,
        };
        let mut q = self.split_heads(q, seq, heads)?;
        if qk_norm == Some(QkNorm::Head) {
            q = self.norm_of(q, &format!("{name}.q_norm"), hd)?;
        }
        let (mut k, mut v) = match projected {
            Some((k, v)) => {
                let mut k = self.split_heads(k, kv.seq, kv_heads)?;
                if qk_norm == Some(QkNorm::Head) {
                    k = self.norm_of(k, &format!("{name}.k_norm"), hd)?;
                }
                (k, self.split_heads(v, kv.seq, kv_heads)?)
            }
            None => {
                let scope = self.g.scope.clone();
                let role = InputRole::Cache { kv_heads, head_dim: hd, window: None };
                let k = self.input(&format!("{name}.memory_k"), role, kv.seq)?;
                let v = self.input(&format!("{name}.memory_v"), role, kv.seq)?;
                self.g.scope = scope;
                (k, v)
            }
        };
        let positions = &r.spec.positions;
        if positions.kind == PositionKind::Rope && !is_cross {
            let rope = Op::Rope {
                theta: Scalar(layer.theta as f32),
                rotary_dim: r.rotary_dim as usize,
                style: positions.style.map_or(PairStyle::RotateHalf, pair_style),
            };
            q = self.g.add(rope.clone(), &[q])?;
            k = self.g.add(rope, &[k])?;
        }
        if let (Some(rank), false) = (a.low_rank, is_cross) {
            // Linformer: keys and values projected along the sequence to `rank` rows.
            let (rows, rank) = (r.spec.model.max_positions as usize, rank as usize);
            let pk = self.g.param(&format!("{name}.proj_k"), &[rows, rank]);
            let pv = if a.low_rank_shared { pk } else { self.g.param(&format!("{name}.proj_v"), &[rows, rank]) };
            k = self.project_rows(k, pk, kv.seq)?;
            v = self.project_rows(v, pv, kv.seq)?;
        }
        if self.cache && !is_cross {
            let scope = self.g.scope.clone();
            // A sliding-window layer caches only what a next query can attend.
            let window = match mask {
                MaskKind::SlidingWindow => a.window.map(|w| w as usize),
                _ => None,
            };
            let role = InputRole::Cache { kv_heads, head_dim: hd, window };
            let len = if window.is_some() { Sym::Recent } else { Sym::Past };
            let past_k = self.input(&format!("{name}.past_k"), role, len)?;
            let past_v = self.input(&format!("{name}.past_v"), role, len)?;
            self.g.scope = scope;
            k = self.g.add(Op::Concat { axis: 2 }, &[past_k, k])?;
            v = self.g.add(Op::Concat { axis: 2 }, &[past_v, v])?;
            self.g.outputs.push((format!("{name}.present_k"), k));
            self.g.outputs.push((format!("{name}.present_v"), v));
        }
        if kv_heads < heads {
            let times = heads / kv_heads;
            k = self.g.add(Op::RepeatHeads { times }, &[k])?;
            v = self.g.add(Op::RepeatHeads { times }, &[v])?;
        }
        let mut s = self.g.add(Op::MatMul { transpose_b: true }, &[q, k])?;
        s = self.g.add(Op::Scale { factor: Scalar(r.attn_scale as f32) }, &[s])?;
        if let Some(cap) = a.softcap {
            s = self.g.add(Op::SoftCap { cap: Scalar(cap as f32) }, &[s])?;
        }
        if positions.kind == PositionKind::Alibi && !is_cross {
            s = self.g.add(Op::Alibi, &[s])?;
        }
        if positions.kind == PositionKind::RelativeBias && !is_cross {
            // One table per stack (held by its first layer in T5), read by every layer.
            let stack = name.find("layers.").map_or("", |at| &name[..at]);
            let table_name = format!("{stack}relative_bias");
            let (buckets, max_distance) = (r.relative.0 as usize, r.relative.1 as usize);
            let table = match self.g.params().into_iter().find(|(_, p)| *p == table_name) {
                Some((n, _)) => n,
                None => self.g.param(&table_name, &[buckets, heads]),
            };
            let keys = self.g.g[k].shape.get(2).copied().unwrap_or(Dim::Sym(seq));
            let bidirectional = mask == MaskKind::Bidirectional;
            let op = Op::RelativeBias { buckets, max_distance, bidirectional, q: Dim::Sym(seq), k: keys };
            let bias = self.g.add(op, &[table])?;
            s = self.g.add(Op::Add, &[s, bias])?;
        }
        let (causal, window) = match mask {
            MaskKind::Bidirectional => (false, None),
            MaskKind::Causal => (true, None),
            MaskKind::SlidingWindow => (true, a.window.map(|w| w as usize)),
        };
        let operands: Vec<NodeIndex> = std::iter::once(s).chain(key_mask).collect();
        if let (Some(bs), false) = (a.block_sparse, is_cross) {
            let op = Op::BlockSparseMask {
                block: bs.block as usize,
                global: bs.global as usize,
                window: bs.window as usize,
                random: bs.random as usize,
                seed: bs.seed,
            };
            s = self.g.add(op, &operands)?;
        } else if causal || key_mask.is_some() {
            s = self.g.add(Op::Mask { causal, window }, &operands)?;
        }
        let p = self.g.add(Op::Softmax, &[s])?;
        let ctx = self.g.add(Op::MatMul { transpose_b: false }, &[p, v])?;
        let ctx = self.g.add(Op::Permute { perm: vec![0, 2, 1, 3] }, &[ctx])?;
        let ctx = self
            .g
            .add(Op::Reshape { shape: vec![Dim::Sym(Sym::Batch), Dim::Sym(seq), Dim::Fixed(heads * hd)] }, &[ctx])?;
        self.linear(ctx, &format!("{name}.o"), d, heads * hd, bias(a.o_bias))
    }

    /// `e[:n]^T @ x` per head: `x [b, h, n, d]` projected along its sequence by the first `n` rows
    /// of `e [max_positions, r]` to `[b, h, r, d]`.
    fn project_rows(&mut self, x: NodeIndex, e: NodeIndex, seq: Sym) -> R<NodeIndex> {
        let e = self.g.add(Op::Truncate { len: Dim::Sym(seq) }, &[e])?;
        let xt = self.g.add(Op::Permute { perm: vec![0, 1, 3, 2] }, &[x])?;
        let y = self.g.add(Op::MatMul { transpose_b: false }, &[xt, e])?;
        self.g.add(Op::Permute { perm: vec![0, 1, 3, 2] }, &[y])
    }

    fn ffn_or_moe(&mut self, block: &str, x: NodeIndex) -> R<NodeIndex> {
        let Some(moe) = &self.r.spec.moe else {
            return self.ffn(&format!("{block}.ffn"), x);
        };
        let (experts, top_k, renormalize) = (moe.experts as usize, moe.top_k as usize, moe.renormalize);
        self.g.scope = format!("{block}.moe");
        let logits = self.linear(x, &format!("{block}.moe.router"), experts, self.d(), false)?;
        let probs = self.g.add(Op::Softmax, &[logits])?;
        let weights = self.g.add(Op::TopK { k: top_k, renormalize }, &[probs])?;
        let mut acc: Option<NodeIndex> = None;
        for e in 0..experts {
            self.g.scope = format!("{block}.moe.experts.{e}");
            let y = self.ffn(&format!("{block}.moe.experts.{e}"), x)?;
            let axis = self.g.g[weights].shape.len() - 1;
            let w = self.g.add(Op::Slice { axis, start: e, len: 1 }, &[weights])?;
            let wy = self.g.add(Op::Mul, &[y, w])?;
            acc = Some(match acc {
                None => wy,
                Some(a) => self.g.add(Op::Add, &[a, wy])?,
            });
        }
        acc.ok_or_else(|| GraphError {
            op: "moe".into(),
            scope: block.into(),
            message: "a mixture of experts needs at least one expert".into(),
        })
    }

    fn ffn(&mut self, name: &str, x: NodeIndex) -> R<NodeIndex> {
        let f = &self.r.spec.ffn;
        let (d, d_ff) = (self.d(), self.r.d_ff as usize);
        let h = if f.gated {
            let gate = self.linear(x, &format!("{name}.gate"), d_ff, d, f.bias)?;
            let up = self.linear(x, &format!("{name}.up"), d_ff, d, f.bias)?;
            let act = self.g.add(Op::Act(activation(f.activation)), &[gate])?;
            self.g.add(Op::Mul, &[act, up])?
        } else {
            let up = self.linear(x, &format!("{name}.up"), d_ff, d, f.bias)?;
            self.g.add(Op::Act(activation(f.activation)), &[up])?
        };
        self.linear(h, &format!("{name}.down"), d, d_ff, f.bias)
    }
}

/// The IR's activation for the spec's.
fn activation(a: spec::Activation) -> Activation {
    match a {
        spec::Activation::Relu => Activation::Relu,
        spec::Activation::Gelu => Activation::Gelu,
        spec::Activation::GeluTanh => Activation::GeluTanh,
        spec::Activation::Silu => Activation::Silu,
    }
}

/// The IR's pair layout for the spec's.
fn pair_style(s: spec::PairStyle) -> PairStyle {
    match s {
        spec::PairStyle::RotateHalf => PairStyle::RotateHalf,
        spec::PairStyle::Interleaved => PairStyle::Interleaved,
    }
}
