//! Gradient rules, one per op, grouped by topic: `linear` (matmul, add, mul, scale, offset,
//! sums), `shape` (reshape, permute, slice, truncate, concat, gather, repeat_heads), `activation`
//! (activations, softmax, soft-cap, the causal/window and block-sparse masks), `norm`
//! (layer_norm, rms_norm, l2_normalize, mean_pool), `position` (RoPE, ALiBi, T5's relative
//! bias), `experts` (the MoE router's top-k), `loss` (cross-entropy). Each rule is a [`Rule`]: the
//! op's printed name ([`Op::name`]) and a function from the [`Site`] (the op, its operands, its
//! output and the gradient arriving there) to one gradient per operand (`None` where the operand
//! is not differentiable or not needed). Rules build their result out of existing graph ops; the
//! helpers below (`sum_to`, `zeros_like`, ...) are what several rules share.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

mod activation;
mod experts;
mod linear;
mod loss;
mod norm;
mod position;
mod shape;

use super::AutodiffError;
use crate::graph::{Dim, Graph, Node, NodeIndex, Op, Scalar, Shape};

/// Where a rule applies: one forward node and the gradient arriving at its output.
pub struct Site<'a> {
    /// The op.
    pub op: &'a Op,
    /// Its scope (for errors).
    pub scope: &'a str,
    /// Its operands, in order.
    pub operands: &'a [NodeIndex],
    /// The node itself (its output).
    pub output: NodeIndex,
    /// The gradient of the loss with respect to the output, of the output's shape.
    pub dy: NodeIndex,
    /// Which operands need a gradient (those on a path from a wanted parameter).
    pub needs: &'a [bool],
}

impl Site<'_> {
    /// Operand `i`.
    pub fn operand(&self, i: usize) -> Result<NodeIndex, AutodiffError> {
        self.operands.get(i).copied().ok_or_else(|| self.unsupported(format!("it has no operand {i}")))
    }

    /// Whether operand `i` needs a gradient.
    pub fn needs(&self, i: usize) -> bool {
        self.needs.get(i).copied().unwrap_or(false)
    }

    /// An [`AutodiffError::Unsupported`] at this site.
    pub fn unsupported(&self, message: String) -> AutodiffError {
        AutodiffError::Unsupported { op: self.op.name(), scope: self.scope.to_string(), message }
    }
}

/// The operands' gradients a rule returns, in operand order.
pub type Grads = Vec<Option<NodeIndex>>;

/// A gradient rule.
pub struct Rule {
    /// The printed name of the op it differentiates ([`Op::name`]).
    pub op: &'static str,
    /// The operands' gradients.
    pub grad: fn(&mut Graph, &Site) -> Result<Grads, AutodiffError>,
}

/// Every rule.
pub fn all() -> Vec<Rule> {
    [
        linear::rules(),
        shape::rules(),
        activation::rules(),
        norm::rules(),
        position::rules(),
        experts::rules(),
        loss::rules(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The rule of `op` among `rules`, if it has one.
pub fn find<'r>(rules: &'r [Rule], op: &Op) -> Option<&'r Rule> {
    let name = op.name();
    rules.iter().find(|r| r.op == name)
}

/// The node `n` of `g`.
pub fn node(g: &Graph, n: NodeIndex) -> Result<&Node, AutodiffError> {
    g.g.node_weight(n).ok_or(AutodiffError::Missing(n.index()))
}

/// The shape of node `n`.
pub fn shape(g: &Graph, n: NodeIndex) -> Result<Shape, AutodiffError> {
    Ok(node(g, n)?.shape.clone())
}

/// Adds a node, its type error as an [`AutodiffError`].
pub fn add(g: &mut Graph, op: Op, operands: &[NodeIndex]) -> Result<NodeIndex, AutodiffError> {
    Ok(g.add(op, operands)?)
}

/// `x * factor`.
pub fn scale(g: &mut Graph, x: NodeIndex, factor: f32) -> Result<NodeIndex, AutodiffError> {
    add(g, Op::Scale { factor: Scalar(factor) }, &[x])
}

/// Zeros of `x`'s shape (`x * 0`: the IR has no constants; `x` is finite where rules use it).
pub fn zeros_like(g: &mut Graph, x: NodeIndex) -> Result<NodeIndex, AutodiffError> {
    scale(g, x, 0.0)
}

/// Ones of `x`'s shape.
pub fn ones_like(g: &mut Graph, x: NodeIndex) -> Result<NodeIndex, AutodiffError> {
    let zero = zeros_like(g, x)?;
    add(g, Op::Offset { value: Scalar(1.0) }, &[zero])
}

/// `grad` (of a broadcast shape) summed over the axes `target` was broadcast along, reshaped to
/// `target`: the gradient of an operand of a broadcasting op.
pub fn sum_to(g: &mut Graph, grad: NodeIndex, target: &Shape) -> Result<NodeIndex, AutodiffError> {
    let from = shape(g, grad)?;
    if &from == target {
        return Ok(grad);
    }
    let lead = from.len().saturating_sub(target.len());
    let mut x = grad;
    for (axis, d) in from.iter().enumerate() {
        let kept = axis.checked_sub(lead).and_then(|t| target.get(t));
        let summed = match kept {
            None => true,
            Some(t) => *t == Dim::Fixed(1) && *d != Dim::Fixed(1),
        };
        if summed {
            x = add(g, Op::SumAxis { axis }, &[x])?;
        }
    }
    if shape(g, x)? != *target {
        x = add(g, Op::Reshape { shape: target.clone() }, &[x])?;
    }
    Ok(x)
}

/// `x` with its last two axes swapped.
pub fn transpose(g: &mut Graph, x: NodeIndex) -> Result<NodeIndex, AutodiffError> {
    let rank = shape(g, x)?.len();
    let mut perm: Vec<usize> = (0..rank).collect();
    if rank >= 2 {
        perm.swap(rank - 2, rank - 1);
    }
    add(g, Op::Permute { perm }, &[x])
}

/// The sum over the last axis, kept with extent 1.
pub fn sum_last(g: &mut Graph, x: NodeIndex) -> Result<NodeIndex, AutodiffError> {
    let axis = shape(g, x)?.len().saturating_sub(1);
    add(g, Op::SumAxis { axis }, &[x])
}
