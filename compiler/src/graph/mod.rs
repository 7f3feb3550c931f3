//! The graph IR: a dataflow graph of tensor-level ops on petgraph.
//!
//! A node is an [`Op`] applied to its operands (incoming edges, ordered by the edge weight, which is
//! the operand position). Every node carries its inferred [`Shape`] and [`DType`]; model dimensions
//! are concrete, while batch and sequence lengths stay symbolic ([`Sym`]) until run time. Parameters
//! are [`Op::Param`] nodes named after the canonical parameter names the weight map resolves.
//!
//! The ops are deliberately small and unfused (matmul, add, softmax, norm, rope, ...): fusion is the
//! optimizer's business. Each op's meaning is defined once, by the CPU reference interpreter
//! (the crate's `interp` module); shape rules are defined once, by [`infer`], which [`Graph::add`] applies.
//!
//! **Invariant**: the graph is acyclic and every node's shape is what [`infer`] gives for its op and
//! operands; [`Graph::check`] verifies both.
//!
//! This file holds the graph itself: [`Node`], [`Graph`] and [`GraphError`]. The rest is one concept
//! per file, re-exported here: `op.rs` the ops ([`Op`]), the attributes they carry ([`Scalar`],
//! [`InputRole`], [`Prologue`], [`RopeCols`], [`Rotation`]) and their printed names; `shape.rs`
//! symbolic shapes ([`Sym`], [`Dim`], [`Shape`]) and [`infer`], the shape rule of every op.
//! `build.rs` builds the graph of a spec and `print.rs` prints it.

#![expect(
    clippy::indexing_slicing,
    reason = "the graph methods index nodes of the graph itself, which `Graph::check` type-checks op by op"
)]

pub mod build;
mod op;
pub mod print;
mod shape;

pub use op::{
    Activation, BlockPattern, Bucketing, InputRole, Op, PackedAttention, PairStyle, Prologue, RopeCols, Rotation,
    Scalar, ScoreMods,
};
pub use shape::{Dim, Shape, Sym, SymTable, broadcast, elements, fmt_shape, infer, resolve};

use crate::tensor::DType;
use petgraph::Direction;
use petgraph::graph::DiGraph;
pub use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A node: an op, its inferred type, and the model scope it was built in (`layers.3.attn`).
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Inferred shape.
    pub shape: Shape,
    /// Inferred element type.
    pub dtype: DType,
    /// Where in the model this node belongs (for dumps, clusters and errors).
    pub scope: String,
    /// The rewrite rules that made this node, in the order they applied (its provenance, recorded
    /// by the optimizer; empty for a node of the graph as built). See [`crate::optimize::explain`].
    pub rules: Vec<&'static str>,
}

/// A shape or type error while building or checking a graph.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{op} in {}: {message}", scope_name(.scope))]
pub struct GraphError {
    /// The op that could not be typed.
    pub op: String,
    /// Its scope.
    pub scope: String,
    /// What is wrong, with the operand shapes.
    pub message: String,
}

/// A scope for a message: `` `layers.0.attn` ``, or for a node outside every scope, what that is
/// (never an empty `` `` ``).
pub fn scope_name(scope: &str) -> String {
    match scope {
        "" => "the model's top level".into(),
        scope => format!("`{scope}`"),
    }
}

/// A dataflow graph with named outputs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// A name for dumps.
    pub name: String,
    /// Nodes and operand edges (edge weight = operand position).
    pub g: DiGraph<Node, usize>,
    /// Named results.
    pub outputs: Vec<(String, NodeIndex)>,
    /// Scope given to nodes added from now on.
    pub scope: String,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: &str) -> Self {
        Graph { name: name.to_string(), ..Default::default() }
    }

    /// Adds `op` applied to `operands`, inferring its shape and dtype.
    pub fn add(&mut self, op: Op, operands: &[NodeIndex]) -> Result<NodeIndex, GraphError> {
        let types: Vec<(&Shape, DType)> = operands.iter().map(|&i| (&self.g[i].shape, self.g[i].dtype)).collect();
        let (shape, dtype) =
            infer(&op, &types).map_err(|message| GraphError { op: op.name(), scope: self.scope.clone(), message })?;
        let node = self.g.add_node(Node { op, shape, dtype, scope: self.scope.clone(), rules: Vec::new() });
        for (pos, &operand) in operands.iter().enumerate() {
            self.g.add_edge(operand, node, pos);
        }
        Ok(node)
    }

    /// Adds a parameter with a concrete shape.
    pub fn param(&mut self, name: &str, shape: &[usize]) -> NodeIndex {
        self.g.add_node(Node {
            op: Op::Param { name: name.to_string() },
            shape: shape.iter().map(|&d| Dim::Fixed(d)).collect(),
            dtype: DType::F32,
            scope: self.scope.clone(),
            rules: Vec::new(),
        })
    }

    /// The operands of `node`, in operand order.
    pub fn operands(&self, node: NodeIndex) -> Vec<NodeIndex> {
        let mut edges: Vec<(usize, NodeIndex)> =
            self.g.edges_directed(node, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        edges.sort();
        edges.into_iter().map(|(_, n)| n).collect()
    }

    /// A deterministic topological order: among ready nodes, the lowest index first.
    pub fn order(&self) -> Vec<NodeIndex> {
        let mut indegree: Vec<usize> =
            self.g.node_indices().map(|n| self.g.edges_directed(n, Direction::Incoming).count()).collect();
        let mut ready: BinaryHeap<Reverse<usize>> =
            indegree.iter().enumerate().filter(|(_, d)| **d == 0).map(|(i, _)| Reverse(i)).collect();
        let mut order = Vec::with_capacity(indegree.len());
        while let Some(Reverse(i)) = ready.pop() {
            let n = NodeIndex::new(i);
            order.push(n);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let t = e.target().index();
                indegree[t] -= 1;
                if indegree[t] == 0 {
                    ready.push(Reverse(t));
                }
            }
        }
        order
    }

    /// The graph of the nodes of `order` (a topological order of some of its nodes, each node's
    /// operands among them), numbered in that order — so [`Graph::order`] follows it — with the
    /// outputs whose nodes are kept. Ops, operands and scopes are as they were.
    pub fn renumbered(&self, order: &[NodeIndex]) -> Graph {
        let mut out = Graph { name: self.name.clone(), scope: self.scope.clone(), ..Graph::default() };
        let mut new: std::collections::HashMap<NodeIndex, NodeIndex> = std::collections::HashMap::new();
        for &n in order {
            let m = out.g.add_node(self.g[n].clone());
            for e in self.g.edges_directed(n, Direction::Incoming) {
                if let Some(&source) = new.get(&e.source()) {
                    out.g.add_edge(source, m, *e.weight());
                }
            }
            new.insert(n, m);
        }
        out.outputs = self.outputs.iter().filter_map(|(name, n)| Some((name.clone(), *new.get(n)?))).collect();
        out
    }

    /// Parameter nodes with their names, in node order.
    pub fn params(&self) -> Vec<(NodeIndex, &str)> {
        self.g
            .node_indices()
            .filter_map(|n| match &self.g[n].op {
                Op::Param { name } => Some((n, name.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Input nodes, in node order.
    pub fn inputs(&self) -> Vec<(NodeIndex, &str, InputRole)> {
        self.g
            .node_indices()
            .filter_map(|n| match &self.g[n].op {
                Op::Input { name, role, .. } => Some((n, name.as_str(), *role)),
                _ => None,
            })
            .collect()
    }

    /// Verifies the IR invariants: acyclic, and every node typed as [`infer`] says.
    pub fn check(&self) -> Result<(), GraphError> {
        if self.order().len() != self.g.node_count() {
            return Err(GraphError {
                op: "graph".into(),
                scope: self.name.clone(),
                message: "the graph has a cycle".into(),
            });
        }
        for n in self.g.node_indices() {
            let node = &self.g[n];
            if let Op::Param { .. } = node.op {
                if node.shape.iter().any(|d| matches!(d, Dim::Sym(_))) || !self.operands(n).is_empty() {
                    return Err(GraphError {
                        op: "param".into(),
                        scope: node.scope.clone(),
                        message: "parameters have fixed shapes and no operands".into(),
                    });
                }
                continue;
            }
            let operands = self.operands(n);
            let types: Vec<(&Shape, DType)> = operands.iter().map(|&i| (&self.g[i].shape, self.g[i].dtype)).collect();
            let err = |message: String| GraphError { op: node.op.name(), scope: node.scope.clone(), message };
            let (shape, dtype) = infer(&node.op, &types).map_err(err)?;
            if shape != node.shape || dtype != node.dtype {
                return Err(err(format!(
                    "recorded type {}{} differs from inferred {dtype}{}",
                    node.dtype,
                    fmt_shape(&node.shape),
                    fmt_shape(&shape)
                )));
            }
        }
        Ok(())
    }
}
