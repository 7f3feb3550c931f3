//! The provenance of fused ops: [`explain`] names the rules that produced one, as the optimizer
//! recorded them while they fired (see `provenance.rs`).

use crate::graph::Graph;
use petgraph::graph::NodeIndex;

/// The rules that made node `n`, in the order they applied (the last one made it). Empty for ops
/// of the graph as built, and for ops the rules did not make.
pub fn explain(g: &Graph, n: NodeIndex) -> Vec<&'static str> {
    g.g.node_weight(n).map(|node| node.rules.clone()).unwrap_or_default()
}
