//! A graph on its checkpoint's tensors: every parameter read through the weight map as graph ops.
//!
//! Loading for inference turns each checkpoint tensor into the graph's parameters once, on the
//! host (`runtime::weights`: transposed, cut out of a pack, its RoPE rows reordered). Training
//! updates the checkpoint's tensors themselves — the parameters PyTorch's optimizer holds, under
//! the names a checkpoint is written back with — so [`on_tensors`] rewrites each parameter node
//! into the same reading as graph ops on a parameter named after its tensor:
//!
//! - stored `[in, out]` (GPT-2's Conv1D): a `permute` of the two axes;
//! - one part of a packed tensor: a `slice` of its rows (Q/K/V or gate/up blocks), or for a
//!   per-head pack `[head][q|k|v][head_dim]`, a reshape to `[heads, 3, head_dim, ..]`, a slice of
//!   the middle axis and a reshape back;
//! - llama.cpp's interleaved RoPE rows: a reshape to `[heads, head_dim / 2, 2, ..]`, a permute of
//!   the middle axes and a reshape back.
//!
//! Autodiff then gives each tensor its gradient (the sum over the parameters read from it: a tied
//! embedding, the three parts of a pack), and an optimizer's per-tensor rules (weight decay on
//! matrices only) see the shapes the checkpoint has. On a compiled back end the reading of a
//! tensor is a load-time fold, evaluated once per set of weights.

use crate::graph::{Dim, Graph, GraphError, NodeIndex, Op};
use crate::spec::weightmap::{Pack, PackDims, PackPart, Source, WeightMap};
use std::collections::HashMap;

/// Why a graph could not be put on its checkpoint's tensors.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SourceError {
    /// A parameter's source cannot be read as graph ops at its shape.
    #[error("parameter `{param}` (from `{tensor}`): {message}")]
    Reading {
        /// The parameter.
        param: String,
        /// Its tensor.
        tensor: String,
        /// What does not fit.
        message: String,
    },
    /// Two parameters read one tensor at different shapes.
    #[error("tensor `{tensor}` is read as {first:?} by `{a}` and as {second:?} by `{b}`")]
    Conflict {
        /// The tensor.
        tensor: String,
        /// One parameter.
        a: String,
        /// Its view of the tensor's shape.
        first: Vec<usize>,
        /// Another parameter.
        b: String,
        /// Its view.
        second: Vec<usize>,
    },
    /// Typing a reading op failed (a bug of this module).
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Where one graph parameter is read from.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorUse {
    /// The graph's parameter name.
    pub param: String,
    /// The checkpoint tensor it is read from.
    pub tensor: String,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// It is one part of a packed tensor (so the tensor holds other parameters too).
    pub packed: bool,
}

/// `graph` with each parameter replaced by its reading from a parameter named after its
/// checkpoint tensor (see the module docs), and where each was read from, in parameter order. A
/// parameter without a weight-map entry is its own tensor.
pub fn on_tensors(graph: &Graph, map: &WeightMap, dims: &PackDims) -> Result<(Graph, Vec<TensorUse>), SourceError> {
    // The tensors first: each one's shape, from every parameter read from it.
    let mut uses: Vec<TensorUse> = Vec::new();
    let mut sources: HashMap<String, Source> = HashMap::new();
    for (n, name) in graph.params() {
        if uses.iter().any(|u| u.param == name) {
            continue;
        }
        let source = match map.resolve(name) {
            Some(r) => Source { tensor: r.tensor, ..r.source },
            None => Source::named(name),
        };
        let shape = fixed(&graph.g[n].shape);
        let tensor_shape = stored_shape(&source, &shape, dims).map_err(|message| SourceError::Reading {
            param: name.to_string(),
            tensor: source.tensor.clone(),
            message,
        })?;
        if let Some(other) = uses.iter().find(|u| u.tensor == source.tensor && u.shape != tensor_shape) {
            return Err(SourceError::Conflict {
                tensor: source.tensor.clone(),
                a: other.param.clone(),
                first: other.shape.clone(),
                b: name.to_string(),
                second: tensor_shape,
            });
        }
        uses.push(TensorUse {
            param: name.to_string(),
            tensor: source.tensor.clone(),
            shape: tensor_shape,
            packed: source.pack.is_some(),
        });
        sources.insert(name.to_string(), source);
    }

    let mut g = Graph::new(&graph.name);
    let mut tensors: HashMap<String, NodeIndex> = HashMap::new();
    let mut readings: HashMap<String, NodeIndex> = HashMap::new();
    let mut transposed: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    let mut map_node: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    for n in graph.order() {
        let node = &graph.g[n];
        g.scope = node.scope.clone();
        let new = match &node.op {
            Op::Param { name } => match readings.get(name) {
                Some(&r) => r,
                None => {
                    let (Some(source), Some(u)) = (sources.get(name), uses.iter().find(|u| &u.param == name)) else {
                        continue;
                    };
                    let t = *tensors.entry(u.tensor.clone()).or_insert_with(|| g.param(&u.tensor, &u.shape));
                    let r = reading(&mut g, t, source, &u.shape, dims, &mut transposed)?;
                    readings.insert(name.clone(), r);
                    r
                }
            },
            op => {
                let operands: Vec<NodeIndex> =
                    graph.operands(n).iter().filter_map(|o| map_node.get(o).copied()).collect();
                let new = g.add(op.clone(), &operands)?;
                g.g[new].rules = node.rules.clone();
                new
            }
        };
        map_node.insert(n, new);
    }
    g.scope = String::new();
    g.outputs = graph.outputs.iter().filter_map(|(name, n)| Some((name.clone(), *map_node.get(n)?))).collect();
    g.check()?;
    Ok((g, uses))
}

fn fixed(shape: &[Dim]) -> Vec<usize> {
    shape.iter().map(|d| if let Dim::Fixed(k) = d { *k } else { 0 }).collect()
}

/// The rows of each part of a pack, in the pack's order, and the index of `part` among them
/// (what reading a part cuts out, and what initializing a packed tensor fills in).
pub fn pack_rows(pack: Pack, part: PackPart, dims: &PackDims) -> Result<(Vec<usize>, usize), String> {
    let (q, kv, ff) = (dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.d_ff);
    let qkv = |p: PackPart| [PackPart::Q, PackPart::K, PackPart::V].iter().position(|&x| x == p);
    match (pack, part) {
        (Pack::QkvBlocks | Pack::QkvPerHead, p) if qkv(p).is_some() => {
            Ok((vec![q, kv, kv], qkv(p).unwrap_or_default()))
        }
        (Pack::GateUpBlocks, PackPart::Gate) => Ok((vec![ff, ff], 0)),
        (Pack::GateUpBlocks, PackPart::Up) => Ok((vec![ff, ff], 1)),
        (pack, part) => Err(format!("a {pack:?} pack has no part {part:?}")),
    }
}

/// The checkpoint tensor's shape, from the shape of one parameter read from it.
fn stored_shape(source: &Source, param: &[usize], dims: &PackDims) -> Result<Vec<usize>, String> {
    let mut shape = param.to_vec();
    if let Some(pack) = source.pack {
        let part = source.part.ok_or("a pack entry names no part")?;
        let (rows, index) = pack_rows(pack, part, dims)?;
        let first = shape.first_mut().ok_or("a scalar is not a pack of rows")?;
        if rows.get(index) != Some(first) {
            return Err(format!("has {} rows, the pack's part has {:?}", first, rows.get(index)));
        }
        *first = rows.iter().sum();
    }
    if source.transpose {
        let [r, c] = shape.as_slice() else { return Err(format!("a transposed tensor must be 2-D, is {shape:?}")) };
        shape = vec![*c, *r];
    }
    Ok(shape)
}

/// Adds the reading of `source` from tensor node `t` (of `stored` shape), in the order loading
/// applies it: transpose, unpack, RoPE rows. A tensor is transposed once for all the parameters
/// read from it (`transposed`, by tensor node): the parts of a packed tensor are then slices of
/// one value, whose gradients autodiff joins into one concatenation rather than transposing and
/// adding a zero-padded copy of the whole tensor per part.
fn reading(
    g: &mut Graph,
    t: NodeIndex,
    source: &Source,
    stored: &[usize],
    dims: &PackDims,
    transposed: &mut HashMap<NodeIndex, NodeIndex>,
) -> Result<NodeIndex, GraphError> {
    let mut x = t;
    let mut shape = stored.to_vec();
    if source.transpose && shape.len() == 2 {
        x = match transposed.get(&t) {
            Some(&x) => x,
            None => {
                let x = g.add(Op::Permute { perm: vec![1, 0] }, &[x])?;
                transposed.insert(t, x);
                x
            }
        };
        shape.reverse();
    }
    let reshape = |g: &mut Graph, x: NodeIndex, s: &[usize]| {
        g.add(Op::Reshape { shape: s.iter().map(|&d| Dim::Fixed(d)).collect() }, &[x])
    };
    if let (Some(pack), Some(part)) = (source.pack, source.part)
        && let Ok((rows, index)) = pack_rows(pack, part, dims)
    {
        let rest = shape.get(1..).unwrap_or_default().to_vec();
        let len = rows.get(index).copied().unwrap_or_default();
        if pack == Pack::QkvPerHead {
            let (heads, hd) = (dims.heads, dims.head_dim);
            let split: Vec<usize> = [heads, 3, hd].into_iter().chain(rest.iter().copied()).collect();
            x = reshape(g, x, &split)?;
            x = g.add(Op::Slice { axis: 1, start: index, len: 1 }, &[x])?;
            let joined: Vec<usize> = [heads * hd].into_iter().chain(rest.iter().copied()).collect();
            x = reshape(g, x, &joined)?;
        } else {
            let start = rows.iter().take(index).sum();
            x = g.add(Op::Slice { axis: 0, start, len }, &[x])?;
        }
        shape = [len].into_iter().chain(rest).collect();
    }
    if source.rope_unpermute
        && let Some((&rows, rest)) = shape.split_first()
    {
        let hd = dims.head_dim;
        if hd >= 2 && rows.is_multiple_of(hd) {
            let split: Vec<usize> = [rows / hd, hd / 2, 2].into_iter().chain(rest.iter().copied()).collect();
            x = reshape(g, x, &split)?;
            let mut perm: Vec<usize> = (0..split.len()).collect();
            perm.swap(1, 2);
            x = g.add(Op::Permute { perm }, &[x])?;
            x = reshape(g, x, &shape)?;
        }
    }
    Ok(x)
}
