//! Deterministic printers of the graph IR: text (for snapshots and `kiln inspect`), Graphviz DOT,
//! and a summary (parameter count, FLOPs per token, graph size).

use super::{Dim, Graph, Op, Sym, fmt_shape};
use petgraph::graph::NodeIndex;
use std::collections::HashMap;
use std::fmt::Write;

/// Prints the graph as text, one node per line in topological order, with a comment line whenever
/// the scope changes:
///
/// ```text
/// # layers.0.attn
/// %7 = matmul_t %6, %5 : f32[batch, seq, 64]
/// ```
pub fn text(g: &Graph) -> String {
    let order = g.order();
    let names = numbering(&order);
    let mut out = format!("graph \"{}\" {{\n", g.name);
    let mut scope = None;
    for &n in &order {
        let node = &g.g[n];
        if scope != Some(&node.scope) {
            let _ = writeln!(out, "  # {}", node.scope);
            scope = Some(&node.scope);
        }
        let operands: Vec<String> = g.operands(n).iter().map(|o| format!("%{}", names[o])).collect();
        let mut rhs = node.op.name();
        let attrs = node.op.attrs();
        if !attrs.is_empty() {
            rhs += &format!(" {attrs}");
        }
        if !operands.is_empty() {
            rhs += &format!(" {}", operands.join(", "));
        }
        let _ = writeln!(out, "  %{} = {rhs} : {}{}", names[&n], node.dtype, fmt_shape(&node.shape));
    }
    let _ = writeln!(out, "  # outputs");
    for (name, n) in &g.outputs {
        let _ = writeln!(out, "  {name} = %{}", names[n]);
    }
    out.push_str("}\n");
    out
}

/// Graphviz DOT: one cluster per scope, parameters as notes, outputs as double octagons.
pub fn dot(g: &Graph) -> String {
    let order = g.order();
    let names = numbering(&order);
    let mut out =
        format!("digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n", g.name);
    let mut scopes: Vec<&str> = Vec::new();
    let mut by_scope: HashMap<&str, Vec<NodeIndex>> = HashMap::new();
    for &n in &order {
        let s = g.g[n].scope.as_str();
        if !by_scope.contains_key(s) {
            scopes.push(s);
        }
        by_scope.entry(s).or_default().push(n);
    }
    for (i, scope) in scopes.iter().enumerate() {
        let _ = writeln!(out, "  subgraph cluster_{i} {{\n    label=\"{scope}\";\n    style=rounded;");
        for n in &by_scope[scope] {
            let node = &g.g[*n];
            let (shape, label) = match &node.op {
                Op::Param { name } => ("note", format!("{name}\\n{}", fmt_shape(&node.shape))),
                Op::Input { name, .. } => ("invhouse", format!("{name}\\n{}{}", node.dtype, fmt_shape(&node.shape))),
                op => {
                    let attrs = op.attrs().replace('"', "\\\"");
                    let head = if attrs.is_empty() { op.name() } else { format!("{} {attrs}", op.name()) };
                    ("box", format!("{head}\\n{}{}", node.dtype, fmt_shape(&node.shape)))
                }
            };
            let _ = writeln!(out, "    n{} [shape={shape}, label=\"%{}: {label}\"];", n.index(), names[n]);
        }
        out.push_str("  }\n");
    }
    for &n in &order {
        for o in g.operands(n) {
            let _ = writeln!(out, "  n{} -> n{};", o.index(), n.index());
        }
    }
    for (name, n) in &g.outputs {
        let _ = writeln!(out, "  out_{name} [shape=doubleoctagon, label=\"{name}\"];\n  n{} -> out_{name};", n.index());
    }
    out.push_str("}\n");
    out
}

/// Node numbers in printing order (dense, from 0), so dumps do not depend on internal indices.
fn numbering(order: &[NodeIndex]) -> HashMap<NodeIndex, usize> {
    order.iter().enumerate().map(|(i, &n)| (n, i)).collect()
}

/// What `kiln check` prints about a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Parameter elements.
    pub parameters: u64,
    /// Matrix-multiply FLOPs per token of a forward pass over `seq` tokens (batch 1).
    pub flops_per_token: f64,
    /// The sequence length the FLOPs were counted at.
    pub seq: usize,
    /// Nodes in the graph.
    pub nodes: usize,
    /// Operand edges.
    pub edges: usize,
    /// Nodes that compute (not inputs or parameters).
    pub compute_nodes: usize,
}

/// Summarises a graph, counting FLOPs at batch 1 and sequence (and source sequence) `seq`.
pub fn summary(g: &Graph, seq: usize) -> Summary {
    let bind = |d: &Dim| match d {
        Dim::Fixed(k) => *k as f64,
        Dim::Sym(Sym::Batch) => 1.0,
        Dim::Sym(_) => seq as f64,
    };
    let mut flops = 0.0;
    for n in g.g.node_indices() {
        if let Op::MatMul { .. } = g.g[n].op {
            let operands = g.operands(n);
            let a = &g.g[operands[0]].shape;
            let k = bind(&a[a.len() - 1]);
            let out: f64 = g.g[n].shape.iter().map(bind).product();
            flops += 2.0 * out * k;
        }
    }
    let compute_nodes =
        g.g.node_indices().filter(|&n| !matches!(g.g[n].op, Op::Param { .. } | Op::Input { .. })).count();
    Summary {
        parameters: super::build::param_elements(g),
        flops_per_token: flops / seq as f64,
        seq,
        nodes: g.g.node_count(),
        edges: g.g.edge_count(),
        compute_nodes,
    }
}
