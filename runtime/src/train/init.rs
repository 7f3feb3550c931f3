//! Declared initialization: a model's first weights, drawn as its spec's `[init]` says, under
//! its checkpoint's tensor names and stored shapes (what `kiln init` writes and `kiln train`
//! starts from).
//!
//! Each *graph parameter* is drawn in graph layout (`[out, in]` matrices, canonical names) by the
//! rule its role calls for ([`Role`]), from a stream of its own (the seed mixed with the
//! parameter's name, so a parameter's values do not depend on which others the model has). The
//! checkpoint tensor is then assembled by inverting the reading that
//! [`kiln_compiler::train::on_tensors`] puts in the graph: the parameter's rows put back in
//! llama.cpp's interleaved RoPE order, placed among the other parts of a pack, and transposed for
//! a tensor stored `[in, out]`. A tensor read by several parameters that are not parts of a pack
//! (a table shared by two stacks) keeps the first one's values: tied parameters get one init.
//!
//! The rules (see [`kiln_compiler::spec::Init`]): matrices and embedding tables normal(0, std);
//! the residual branches' output projections (attention `o`, feed-forward `down`, experts' `down`)
//! scaled by the residual factor; under DeepNorm the feed-forward, value and output projections
//! Xavier-normal with gain beta and the query and key projections with gain 1 (DeepNet, Wang et
//! al. 2022); biases 0; norm gains 1, stored as `1 - norm.gain_offset`.

use super::data::SplitMix64;
use kiln_compiler::graph::Graph;
use kiln_compiler::spec::weightmap::{Pack, PackDims, Source};
use kiln_compiler::spec::{InitRules, ResidualScale, Resolved};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::sources::pack_rows;
use kiln_compiler::train::{SourceError, TensorUse, on_tensors};
use std::collections::HashMap;

/// Why a model's weights could not be initialized.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The graph cannot be put on its checkpoint's tensors.
    #[error(transparent)]
    Sources(#[from] SourceError),
    /// A parameter cannot be placed in its tensor (its shape does not fit the stored one).
    #[error("parameter `{param}` cannot be placed in tensor `{tensor}` {shape:?}: {message}")]
    Placement {
        /// The parameter.
        param: String,
        /// Its tensor.
        tensor: String,
        /// The tensor's stored shape.
        shape: Vec<usize>,
        /// What does not fit.
        message: String,
    },
}

/// What a graph parameter is, for its initialization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A bias (`*.bias`): zeros.
    Bias,
    /// A norm's gain (a 1-D `*.weight`): ones, less the gain offset.
    NormGain,
    /// An output projection of a residual branch (attention or cross-attention `o`, feed-forward
    /// or expert `down`).
    ResidualOut,
    /// A query or key projection.
    QueryKey,
    /// A value projection.
    Value,
    /// A feed-forward's `up` or `gate`.
    FfnIn,
    /// Any other matrix or table (embeddings, the untied head, a router, Linformer projections,
    /// relative-bias tables).
    Matrix,
}

impl Role {
    /// The role of parameter `name` of `shape`.
    pub fn of(name: &str, shape: &[usize]) -> Role {
        let ends = |s: &str| name.ends_with(s);
        if ends(".bias") {
            Role::Bias
        } else if shape.len() == 1 {
            Role::NormGain
        } else if ends(".attn.o.weight") || ends(".cross.o.weight") || ends(".down.weight") {
            Role::ResidualOut
        } else if ends(".attn.q.weight") || ends(".attn.k.weight") || ends(".cross.q.weight") || ends(".cross.k.weight")
        {
            Role::QueryKey
        } else if ends(".attn.v.weight") || ends(".cross.v.weight") {
            Role::Value
        } else if ends(".up.weight") || ends(".gate.weight") {
            Role::FfnIn
        } else {
            Role::Matrix
        }
    }
}

/// How one parameter is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Draw {
    /// Every element this value.
    Constant(f64),
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
}

/// The draw of a parameter of `role` and `shape` under `rules`.
pub fn draw(rules: &InitRules, role: Role, shape: &[usize]) -> Draw {
    // Xavier-normal: gain * sqrt(2 / (fan_in + fan_out)) of an `[out, in]` matrix.
    let xavier = |gain: f64| {
        let fans: usize = shape.iter().take(2).sum();
        Draw::Normal(gain * (2.0 / fans.max(1) as f64).sqrt())
    };
    match (role, rules.deepnorm_beta) {
        (Role::Bias, _) => Draw::Constant(0.0),
        (Role::NormGain, _) => Draw::Constant(rules.norm_gain),
        (Role::QueryKey, Some(_)) => xavier(1.0),
        (Role::Value | Role::FfnIn, Some(beta)) => xavier(beta),
        (Role::ResidualOut, Some(beta)) => match xavier(beta) {
            Draw::Normal(s) => Draw::Normal(s * rules.residual_factor),
            d => d,
        },
        (Role::ResidualOut, None) => Draw::Normal(rules.std * rules.residual_factor),
        (Role::QueryKey | Role::Value | Role::FfnIn | Role::Matrix, _) => Draw::Normal(rules.std),
    }
}

/// The rules applied to a spec, one line each, for a summary (`kiln init` prints them).
pub fn describe(spec: &Resolved) -> Vec<String> {
    let rules = spec.init();
    let layers = spec.spec.model.layers;
    let mut lines = vec![format!("matrices and embeddings normal(0, {})", rules.std)];
    match rules.residual_scale {
        ResidualScale::Gpt2 => lines.push(format!("residual projections scaled by 1/sqrt(2*{layers})")),
        ResidualScale::Value(v) => lines.push(format!("residual projections scaled by {v}")),
        ResidualScale::None => {}
    }
    if let Some(beta) = rules.deepnorm_beta {
        lines.push(format!(
            "DeepNorm: feed-forward, value and output projections Xavier-normal with gain beta = {beta:.4}, query and key with gain 1"
        ));
    }
    if spec.spec.norm.gain_offset == 0.0 {
        lines.push("norm gains 1, biases 0".into());
    } else {
        lines.push(format!(
            "norm gains 1, stored as {} (norm.gain_offset = {}), biases 0",
            rules.norm_gain, spec.spec.norm.gain_offset
        ));
    }
    lines.push(format!("seed {}", rules.seed));
    lines
}

/// The initial weights of `graph` (built from `spec`), as the spec's `[init]` says: one tensor per
/// checkpoint tensor, under the names the spec's weight map gives and in their stored shapes, in
/// the order the graph first reads them. Deterministic for a seed.
pub fn initialize(spec: &Resolved, graph: &Graph) -> Result<Vec<(String, Tensor)>, InitError> {
    let rules = spec.init();
    let dims = PackDims::of(spec);
    let (_, uses) = on_tensors(graph, &spec.weights, &dims)?;
    let shapes: HashMap<String, Vec<usize>> = crate::weights::graph_params(graph).into_iter().collect();
    let mut order: Vec<&str> = Vec::new();
    let mut by_tensor: HashMap<&str, Vec<&TensorUse>> = HashMap::new();
    for u in &uses {
        let list = by_tensor.entry(u.tensor.as_str()).or_default();
        if list.is_empty() {
            order.push(u.tensor.as_str());
        }
        list.push(u);
    }
    let mut out = Vec::with_capacity(order.len());
    for tensor in order {
        let list = by_tensor.get(tensor).map(Vec::as_slice).unwrap_or_default();
        let Some(stored) = list.first().map(|u| u.shape.clone()) else { continue };
        let mut data = vec![0f32; stored.iter().product()];
        let mut written = vec![false; data.len()];
        for u in list {
            let shape = shapes.get(u.param.as_str()).cloned().unwrap_or_default();
            let fail = |message: String| InitError::Placement {
                param: u.param.clone(),
                tensor: u.tensor.clone(),
                shape: stored.clone(),
                message,
            };
            let source = source_of(spec, &u.param);
            let places = placement(&source, &shape, &stored, &dims).map_err(fail)?;
            let values = parameter(&rules, &u.param, &shape);
            for (&at, v) in places.iter().zip(values) {
                if let (Some(slot), Some(w)) = (data.get_mut(at), written.get_mut(at))
                    && !*w
                {
                    *slot = v;
                    *w = true;
                }
            }
        }
        out.push((tensor.to_string(), Tensor::f32(stored, data)));
    }
    Ok(out)
}

/// The values of parameter `name` (graph layout, row-major).
pub fn parameter(rules: &InitRules, name: &str, shape: &[usize]) -> Vec<f32> {
    let len: usize = shape.iter().product();
    match draw(rules, Role::of(name, shape), shape) {
        Draw::Constant(c) => vec![c as f32; len],
        Draw::Normal(std) => {
            let mut rng = Rng::new(rules.seed, name);
            (0..len).map(|_| (rng.normal() * std) as f32).collect()
        }
    }
}

/// The weight-map source of `param` (itself, unpacked, when the map has no entry).
fn source_of(spec: &Resolved, param: &str) -> Source {
    match spec.weights.resolve(param) {
        Some(r) => Source { tensor: r.tensor, ..r.source },
        None => Source::named(param),
    }
}

/// For each element of a parameter of `shape` (row-major), its index in the stored tensor of
/// `stored` shape: the inverse of `on_tensors`' reading (transpose, unpack, RoPE rows).
fn placement(source: &Source, shape: &[usize], stored: &[usize], dims: &PackDims) -> Result<Vec<usize>, String> {
    let rows = shape.first().copied().unwrap_or(1);
    let rest: usize = shape.iter().skip(1).product();
    let hd = dims.head_dim;
    // The parameter's row `g` as a row of the part before the RoPE rows were reordered.
    let rope = source.rope_unpermute && hd >= 2 && rows.is_multiple_of(hd);
    let unrope = |g: usize| {
        if rope {
            let (head, within) = (g / hd, g % hd);
            head * hd + 2 * (within % (hd / 2)) + within / (hd / 2)
        } else {
            g
        }
    };
    // The part's row `p` as a row of the (untransposed) pack: after the earlier parts' rows, or
    // for a per-head pack at `[head][part][head_dim]`; and the pack's rows.
    let (start, per_head, total) = match (source.pack, source.part) {
        (Some(pack), Some(part)) => {
            let (sizes, index) = pack_rows(pack, part, dims)?;
            if sizes.get(index) != Some(&rows) {
                return Err(format!("{rows} rows, the pack's part has {:?}", sizes.get(index)));
            }
            let start: usize = sizes.iter().take(index).sum();
            (start, (pack == Pack::QkvPerHead).then_some(index), sizes.iter().sum())
        }
        _ => (0, None, rows),
    };
    let pack_row = |p: usize| match per_head {
        Some(index) => ((p / hd) * 3 + index) * hd + p % hd,
        None => start + p,
    };
    let transpose = source.transpose && shape.len() == 2;
    let size: usize = stored.iter().product();
    if size != total * rest {
        return Err(format!("the parameter {shape:?} is read from {} elements", total * rest));
    }
    let mut places = Vec::with_capacity(rows * rest);
    for g in 0..rows {
        let r = pack_row(unrope(g));
        for c in 0..rest {
            places.push(if transpose { c * total + r } else { r * rest + c });
        }
    }
    Ok(places)
}

/// [`SplitMix64`] seeded from the seed and a parameter's name (FNV-1a), with Box–Muller normals.
struct Rng {
    bits: SplitMix64,
    spare: Option<f64>,
}

impl Rng {
    fn new(seed: u64, name: &str) -> Rng {
        let hash =
            name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3));
        Rng { bits: SplitMix64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ hash), spare: None }
    }

    /// Uniform in (0, 1]: 53 random bits, never 0 (the logarithm below needs it).
    fn uniform(&mut self) -> f64 {
        ((self.bits.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal.
    fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.uniform(), self.uniform());
        let radius = (-2.0 * u.ln()).sqrt();
        let angle = std::f64::consts::TAU * v;
        self.spare = Some(radius * angle.sin());
        radius * angle.cos()
    }
}
