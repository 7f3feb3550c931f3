//! Reverse-mode automatic differentiation on the graph IR.
//!
//! [`gradients`] takes a forward [`Graph`] with a one-element output (the loss) and returns the
//! same graph with its backward built into it: ordinary graph nodes, typed by
//! [`crate::graph::infer`] like every other, so the interpreter runs them and the rest of the
//! pipeline sees one graph. Each differentiated parameter gets a named output `grad.<name>`.
//!
//! The gradient of each op is a rule in [`rules`], kept as data and grouped by topic (tinygrad's
//! `gradient.py`, luminal's `autograd.rs`): a function from the op, its operands, its output and
//! the gradient arriving at the output to the gradients of its operands. Backward nodes are made
//! only for the nodes on a path from a wanted parameter to the loss; a parameter used several
//! times (tied), or several parameter nodes of one name, get the sum of every use's gradient. An
//! op on such a path without a rule is refused by name ([`AutodiffError::NoRule`]) — never a
//! silent zero. A wanted parameter the loss does not depend on gets an exact zero gradient.
//!
//! **Recomputation** ([`gradients_recomputing`]; activation checkpointing): the backward of a
//! chosen block (`layers.3`, as [`block_of`] names it) reads a copy of the block's forward
//! instead of the values the forward computed, so those die as soon as the forward has passed
//! the block, and the step holds one block's activations at a time instead of every block's.
//! The copy reads what comes from outside the block (its input, the memory of an encoder)
//! through [`Op::After`] with the gradient arriving at the block, so it runs when the backward
//! reaches the block — and is a distinct value to the optimizer, which would otherwise merge it
//! back into the forward.

pub mod rules;

use crate::graph::print::block_of;
use crate::graph::{Dim, Graph, GraphError, NodeIndex, Op, Scalar, fmt_shape, scope_name};
use petgraph::Direction;
use std::collections::{BTreeSet, HashMap, HashSet};

/// A block of a stack, as [`block_of`] names it: `("decoder.layers", 3)` for
/// `decoder.layers.3.attn`.
pub type Block = (String, usize);

/// Why a gradient graph could not be built.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AutodiffError {
    /// An op on a path from a wanted parameter to the loss has no gradient rule.
    #[error("no gradient rule for `{op}` in {}", scope_name(.scope))]
    NoRule {
        /// The op's name.
        op: String,
        /// Its scope.
        scope: String,
    },
    /// The graph has no output of the loss's name.
    #[error("the graph has no output `{0}` to differentiate")]
    NoLoss(String),
    /// The loss is not a one-element tensor.
    #[error("the loss `{loss}` must have one element, has shape {shape}")]
    NotScalar {
        /// The output's name.
        loss: String,
        /// Its shape.
        shape: String,
    },
    /// A rule exists for the op but not for this use of it (e.g. a concatenation along a
    /// symbolic axis).
    #[error("cannot differentiate `{op}` in {}: {message}", scope_name(.scope))]
    Unsupported {
        /// The op's name.
        op: String,
        /// Its scope.
        scope: String,
        /// Why.
        message: String,
    },
    /// A backward node could not be typed (a rule's bug).
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// A node index that is not in the graph (a bug).
    #[error("node {0} is not in the graph")]
    Missing(usize),
}

/// The forward graph plus the gradient of the output `loss` with respect to every parameter
/// `wants` accepts (by canonical name), as outputs `grad.<name>`, in parameter order.
pub fn gradients(graph: &Graph, loss: &str, wants: impl Fn(&str) -> bool) -> Result<Graph, AutodiffError> {
    gradients_recomputing(graph, loss, wants, &BTreeSet::new())
}

/// [`gradients`], the backward of each block in `recompute` reading a recomputed copy of the
/// block's forward (see the module's documentation). The gradients are the same values; the
/// graph has the copies, and only the nodes its outputs read (and its parameters and inputs).
pub fn gradients_recomputing(
    graph: &Graph,
    loss: &str,
    wants: impl Fn(&str) -> bool,
    recompute: &BTreeSet<Block>,
) -> Result<Graph, AutodiffError> {
    let &(_, loss_node) =
        graph.outputs.iter().find(|(name, _)| name == loss).ok_or_else(|| AutodiffError::NoLoss(loss.into()))?;
    let loss_shape = &rules::node(graph, loss_node)?.shape;
    if loss_shape.iter().any(|d| *d != Dim::Fixed(1)) {
        return Err(AutodiffError::NotScalar { loss: loss.into(), shape: fmt_shape(loss_shape) });
    }
    let mut names: Vec<&str> = Vec::new();
    let mut wanted: Vec<NodeIndex> = Vec::new();
    for (n, name) in graph.params() {
        if wants(name) {
            wanted.push(n);
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    let active = on_paths(graph, &wanted, loss_node);

    let mut g = graph.clone();
    let mut grads: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    if active.contains(&loss_node) {
        // d loss / d loss = 1, made from the loss itself (the IR has no constants).
        g.scope = rules::node(graph, loss_node)?.scope.clone();
        let zero = rules::add(&mut g, Op::Scale { factor: Scalar(0.0) }, &[loss_node])?;
        let one = rules::add(&mut g, Op::Offset { value: Scalar(1.0) }, &[zero])?;
        grads.insert(loss_node, one);
    }
    let table = rules::all();
    let mut copies: HashMap<Block, Copies> = HashMap::new();
    // Slices' gradients held back until their operand's gradient is wanted (see `settle`).
    let mut pieces: HashMap<NodeIndex, Vec<Piece>> = HashMap::new();
    for n in graph.order().into_iter().rev() {
        // Every reader of `n` comes before it in this order, so its pieces are all in.
        settle(&mut g, &mut grads, &mut pieces, n)?;
        let Some(&dy) = grads.get(&n) else { continue };
        let node = rules::node(graph, n)?;
        if matches!(node.op, Op::Param { .. }) {
            continue;
        }
        let operands = graph.operands(n);
        let needs: Vec<bool> = operands.iter().map(|o| active.contains(o)).collect();
        if !needs.contains(&true) {
            continue;
        }
        let rule = rules::find(&table, &node.op)
            .ok_or_else(|| AutodiffError::NoRule { op: node.op.name(), scope: node.scope.clone() })?;
        // In a recomputed block, the rule reads the copy's values; the first node of the block
        // the backward reaches (its output) starts the copy, after its gradient.
        let recomputed = block_of(&node.scope).map(|(stack, i, _)| (stack.to_string(), i));
        let (read, output) = match recomputed.filter(|b| recompute.contains(b)) {
            Some(block) => {
                let copy = copies.entry(block.clone()).or_insert_with(|| Copies::new(block, dy));
                let read = operands.iter().map(|&o| copy.value(&mut g, graph, o)).collect::<Result<Vec<_>, _>>()?;
                (read, copy.value(&mut g, graph, n)?)
            }
            None => (operands.clone(), n),
        };
        g.scope = node.scope.clone();
        if let (Op::Slice { axis, start, len }, [x], [x_read]) = (&node.op, operands.as_slice(), read.as_slice())
            && let Some(&Dim::Fixed(total)) = rules::shape(&g, *x_read)?.get(*axis)
        {
            let (axis, start, len) = (*axis, *start, *len);
            let piece = Piece { axis, start, len, total, dy, read: *x_read, scope: node.scope.clone() };
            pieces.entry(*x).or_default().push(piece);
            continue;
        }
        let site = rules::Site { op: &node.op, scope: &node.scope, operands: &read, output, dy, needs: &needs };
        let back = (rule.grad)(&mut g, &site)?;
        for ((&operand, need), grad) in operands.iter().zip(&needs).zip(back) {
            if let (true, Some(grad)) = (*need, grad) {
                accumulate(&mut g, &mut grads, operand, grad)?;
            }
        }
    }
    g.scope = String::new();
    for name in names {
        let mut total: Option<NodeIndex> = None;
        let mut first = None;
        for (n, pname) in graph.params() {
            if pname != name {
                continue;
            }
            first.get_or_insert(n);
            if let Some(&d) = grads.get(&n) {
                total = Some(match total {
                    Some(t) => rules::add(&mut g, Op::Add, &[t, d])?,
                    None => d,
                });
            }
        }
        let grad = match (total, first) {
            (Some(t), _) => t,
            // The loss does not depend on it: its gradient is exactly zero.
            (None, Some(p)) => rules::add(&mut g, Op::Scale { factor: Scalar(0.0) }, &[p])?,
            (None, None) => continue,
        };
        g.outputs.push((format!("grad.{name}"), grad));
    }
    if !copies.is_empty() {
        // A copy made for a rule that did not read it.
        g = used(&g);
    }
    g.check()?;
    Ok(g)
}

/// Every block of `g`'s stacks (the `layers.N` of [`block_of`]), in order.
pub fn blocks(g: &Graph) -> BTreeSet<Block> {
    g.g.node_indices().filter_map(|n| block_of(&g.g[n].scope)).map(|(stack, i, _)| (stack.to_string(), i)).collect()
}

/// A recomputed block's copy of its forward: the copy of each value its backward has read so
/// far (made on first read, with the operands it needs).
struct Copies {
    block: Block,
    /// The gradient arriving at the block: what the copy's reads from outside the block wait for.
    after: NodeIndex,
    copy: HashMap<NodeIndex, NodeIndex>,
}

impl Copies {
    fn new(block: Block, after: NodeIndex) -> Copies {
        Copies { block, after, copy: HashMap::new() }
    }

    /// The copy of forward value `v` (a node of `graph`; `g` is `graph` with the backward so far):
    /// a parameter or input itself, a value of the block computed again from the copies of its
    /// operands, and any other value (from before the block) read through [`Op::After`].
    fn value(&mut self, g: &mut Graph, graph: &Graph, v: NodeIndex) -> Result<NodeIndex, AutodiffError> {
        if let Some(&c) = self.copy.get(&v) {
            return Ok(c);
        }
        let node = rules::node(graph, v)?;
        let operands = graph.operands(v);
        let inside =
            block_of(&node.scope).is_some_and(|(stack, i, _)| (stack, i) == (self.block.0.as_str(), self.block.1));
        let copy = if operands.is_empty() {
            v
        } else if inside {
            let read = operands.iter().map(|&o| self.value(g, graph, o)).collect::<Result<Vec<_>, _>>()?;
            let scope = std::mem::replace(&mut g.scope, node.scope.clone());
            let copy = rules::add(g, node.op.clone(), &read);
            g.scope = scope;
            copy?
        } else {
            let scope = std::mem::replace(&mut g.scope, format!("{}.{}", self.block.0, self.block.1));
            let copy = rules::add(g, Op::After, &[v, self.after]);
            g.scope = scope;
            copy?
        };
        self.copy.insert(v, copy);
        Ok(copy)
    }
}

/// `g` with only the nodes its outputs read, and its parameters and inputs (in their order).
fn used(g: &Graph) -> Graph {
    let mut keep: HashSet<NodeIndex> =
        g.g.node_indices().filter(|&n| g.g.edges_directed(n, Direction::Incoming).next().is_none()).collect();
    let mut stack: Vec<NodeIndex> = g.outputs.iter().map(|(_, n)| *n).collect();
    keep.extend(stack.iter().copied());
    while let Some(n) = stack.pop() {
        for m in g.g.neighbors_directed(n, Direction::Incoming) {
            if keep.insert(m) {
                stack.push(m);
            }
        }
    }
    // Index order is a topological order: every node is added after its operands.
    let kept: Vec<NodeIndex> = g.g.node_indices().filter(|n| keep.contains(n)).collect();
    g.renumbered(&kept)
}

/// The gradient of one slice of a value, not yet padded to the value's extent: `dy` is the
/// gradient of `read[start..start + len]` along `axis` (`read` is the value, or its recomputed
/// copy; the zeros between pieces take their other extents from it).
struct Piece {
    axis: usize,
    start: usize,
    len: usize,
    total: usize,
    dy: NodeIndex,
    read: NodeIndex,
    scope: String,
}

/// Adds the slices' gradients held back for `node` to its gradient. Slices that do not overlap
/// along one axis (a packed projection's query, key and value parts) make one concatenation of
/// their gradients in order, zeros only in the gaps — rather than each padded to the whole
/// extent with zeros and the paddings added, three full-size passes and two additions of zeros
/// for a packed weight. Pieces that overlap one already placed are padded and added alone.
fn settle(
    g: &mut Graph,
    grads: &mut HashMap<NodeIndex, NodeIndex>,
    pieces: &mut HashMap<NodeIndex, Vec<Piece>>,
    node: NodeIndex,
) -> Result<(), AutodiffError> {
    let Some(mut all) = pieces.remove(&node) else { return Ok(()) };
    let scope = std::mem::take(&mut g.scope);
    all.sort_by_key(|p| (p.axis, p.start));
    let mut all = all.into_iter();
    while let Some(first) = all.next() {
        // A run of pieces along the first piece's axis, none overlapping the one before.
        let (axis, read, total) = (first.axis, first.read, first.total);
        g.scope = first.scope.clone();
        let mut run: Vec<Piece> = vec![first];
        let mut rest: Vec<Piece> = Vec::new();
        for p in all.by_ref() {
            let free = run.last().is_none_or(|last| last.start + last.len <= p.start);
            if p.axis == axis && free { run.push(p) } else { rest.push(p) }
        }
        let zeros = |g: &mut Graph, start: usize, len: usize| -> Result<NodeIndex, AutodiffError> {
            let part = rules::add(g, Op::Slice { axis, start, len }, &[read])?;
            rules::zeros_like(g, part)
        };
        let mut parts: Vec<NodeIndex> = Vec::new();
        let mut at = 0;
        for p in &run {
            if p.start > at {
                parts.push(zeros(g, at, p.start - at)?);
            }
            parts.push(p.dy);
            at = p.start + p.len;
        }
        if at < total {
            parts.push(zeros(g, at, total - at)?);
        }
        let mut parts = parts.into_iter();
        if let Some(mut dx) = parts.next() {
            for part in parts {
                dx = rules::add(g, Op::Concat { axis }, &[dx, part])?;
            }
            accumulate(g, grads, node, dx)?;
        }
        all = rest.into_iter();
    }
    g.scope = scope;
    Ok(())
}

/// Adds `grad` to the gradient gathered so far for `node`.
fn accumulate(
    g: &mut Graph,
    grads: &mut HashMap<NodeIndex, NodeIndex>,
    node: NodeIndex,
    grad: NodeIndex,
) -> Result<(), AutodiffError> {
    let sum = match grads.get(&node) {
        Some(&old) => rules::add(g, Op::Add, &[old, grad])?,
        None => grad,
    };
    grads.insert(node, sum);
    Ok(())
}

/// The nodes on a path from one of `from` to `to` (both ends included).
fn on_paths(g: &Graph, from: &[NodeIndex], to: NodeIndex) -> HashSet<NodeIndex> {
    let reach = |start: &[NodeIndex], dir: Direction| {
        let mut seen: HashSet<NodeIndex> = start.iter().copied().collect();
        let mut stack: Vec<NodeIndex> = start.to_vec();
        while let Some(n) = stack.pop() {
            for m in g.g.neighbors_directed(n, dir) {
                if seen.insert(m) {
                    stack.push(m);
                }
            }
        }
        seen
    };
    let down = reach(from, Direction::Outgoing);
    let up = reach(&[to], Direction::Incoming);
    down.intersection(&up).copied().collect()
}
