//! Deterministic printers of the graph IR: text (for snapshots and `kiln inspect`), Graphviz DOT
//! (blocks as clusters, fused ops marked, runs of blocks collapsed on request), and a summary
//! (parameter count, FLOPs per token, graph size).

#![expect(
    clippy::indexing_slicing,
    reason = "printing indexes the names and groups it built from the same graph's nodes, and \
              operands of ops that `Graph::check` type-checked"
)]

use super::{Dim, Graph, Op, Sym, fmt_shape};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write;
use std::ops::Range;

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

/// How [`dot_with`] draws a graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DotOptions {
    /// Fill the ops the optimizer fused and label each with the rules that produced it (see
    /// [`crate::optimize::explain`]; ops of a graph as built are never fused).
    pub fused: bool,
    /// Keep only the blocks whose index is in this range, in every stack of blocks (`layers.N`,
    /// `encoder.layers.N`, `decoder.layers.N`); each run of hidden blocks becomes one summary node
    /// that the edges into and out of the run go through.
    pub layers: Option<Range<usize>>,
    /// Draw a legend of the node styles used.
    pub legend: bool,
}

/// Fill of a fused op.
const FUSED_FILL: &str = "#fde3c8";
/// Outline of a fused op.
const FUSED_LINE: &str = "#c8651b";
/// Fill of a summary of hidden blocks.
const HIDDEN_FILL: &str = "#e3ebf5";
/// Fill of a block's cluster.
const BLOCK_FILL: &str = "#f6f8fa";

/// The block a scope belongs to: `layers.3.attn` is block 3 of the stack `layers`, part `attn`;
/// `decoder.layers.0` is block 0 of `decoder.layers`, part `""`. `None` outside blocks (`embed`,
/// `head`, ...).
pub fn block_of(scope: &str) -> Option<(&str, usize, &str)> {
    let mut at = 0;
    for segment in scope.split('.') {
        let end = at + segment.len();
        if segment == "layers" {
            let rest = &scope[end..];
            if let Some(rest) = rest.strip_prefix('.') {
                let digits = rest.split('.').next().unwrap_or("");
                if let Ok(index) = digits.parse::<usize>() {
                    let part = rest[digits.len()..].strip_prefix('.').unwrap_or("");
                    return Some((&scope[..end], index, part));
                }
            }
        }
        at = end + 1;
    }
    None
}

/// Blocks per stack: one more than the largest block index of any node (0 without blocks).
pub fn block_count(g: &Graph) -> usize {
    g.g.node_indices().filter_map(|n| block_of(&g.g[n].scope)).map(|(_, i, _)| i + 1).max().unwrap_or(0)
}

/// What a node is drawn in: a cluster of its own scope, a part of a block, or nothing.
enum Place<'a> {
    /// Top level (an empty scope).
    Top,
    /// A cluster per scope outside blocks.
    Scope(&'a str),
    /// A block's cluster (stack, index), in the sub-cluster of its part (none for `""`).
    Block(&'a str, usize, &'a str),
    /// A summary of hidden blocks, by number.
    Hidden(usize),
}

/// Graphviz DOT: blocks as clusters with their parts (`attn`, `ffn`, ...) as sub-clusters, other
/// scopes as clusters of their own, parameters as notes, inputs as houses, outputs as double
/// octagons. The same as [`dot_with`] with the default options.
pub fn dot(g: &Graph) -> String {
    dot_with(g, &DotOptions::default())
}

/// Graphviz DOT drawn as `options` say (see [`dot`]).
pub fn dot_with(g: &Graph, options: &DotOptions) -> String {
    let order = g.order();
    let names = numbering(&order);
    let is_op = |n: NodeIndex| !matches!(g.g[n].op, Op::Param { .. } | Op::Input { .. });

    // Runs of hidden blocks, per stack: consecutive indices of blocks present outside the range.
    let mut present: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for &n in &order {
        if let Some((stack, index, _)) = block_of(&g.g[n].scope) {
            present.entry(stack).or_default().insert(index);
        }
    }
    // (stack, first, last) of each run, and the run of each hidden (stack, index).
    let mut runs: Vec<(&str, usize, usize)> = Vec::new();
    let mut run_of: HashMap<(&str, usize), usize> = HashMap::new();
    if let Some(keep) = &options.layers {
        for (&stack, indices) in &present {
            let mut previous: Option<usize> = None;
            for &i in indices {
                if keep.contains(&i) {
                    previous = None;
                    continue;
                }
                // A hidden block right after the previous one extends the open run.
                match (previous, runs.last_mut()) {
                    (Some(p), Some(run)) if p + 1 == i => run.2 = i,
                    _ => runs.push((stack, i, i)),
                }
                run_of.insert((stack, i), runs.len() - 1);
                previous = Some(i);
            }
        }
    }
    let place = |n: NodeIndex| -> Place {
        let scope = g.g[n].scope.as_str();
        match block_of(scope) {
            Some((stack, i, _)) if run_of.contains_key(&(stack, i)) => Place::Hidden(run_of[&(stack, i)]),
            Some((stack, i, part)) => Place::Block(stack, i, part),
            None if scope.is_empty() => Place::Top,
            None => Place::Scope(scope),
        }
    };

    let mut out = format!(
        "digraph \"{}\" {{\n  rankdir=TB;\n  fontname=\"sans-serif\";\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n",
        escape(&g.name)
    );
    // Top-level items in order of first appearance, then the nodes of each.
    #[derive(PartialEq, Eq, Hash, Clone, Copy)]
    enum Item<'a> {
        Top,
        Scope(&'a str),
        Block(&'a str, usize),
        Hidden(usize),
    }
    let mut items: Vec<Item> = Vec::new();
    let mut parts: HashMap<Item, Vec<&str>> = HashMap::new();
    let mut members: HashMap<(Item, &str), Vec<NodeIndex>> = HashMap::new();
    let mut hidden_ops = vec![0usize; runs.len()];
    for &n in &order {
        let (item, part) = match place(n) {
            Place::Top => (Item::Top, ""),
            Place::Scope(s) => (Item::Scope(s), ""),
            Place::Block(stack, i, part) => (Item::Block(stack, i), part),
            Place::Hidden(r) => {
                hidden_ops[r] += usize::from(is_op(n));
                (Item::Hidden(r), "")
            }
        };
        if !parts.contains_key(&item) {
            items.push(item);
        }
        let item_parts = parts.entry(item).or_default();
        if !item_parts.contains(&part) {
            item_parts.push(part);
        }
        members.entry((item, part)).or_default().push(n);
    }

    let mut fused_any = false;
    let mut node_line = |out: &mut String, n: NodeIndex, indent: &str| {
        let node = &g.g[n];
        let (shape, mut label) = match &node.op {
            Op::Param { name } => ("note", format!("{}\\n{}", escape(name), fmt_shape(&node.shape))),
            Op::Input { name, .. } => {
                ("invhouse", format!("{}\\n{}{}", escape(name), node.dtype, fmt_shape(&node.shape)))
            }
            op => {
                let attrs = escape(&op.attrs());
                let head = if attrs.is_empty() { op.name() } else { format!("{} {attrs}", op.name()) };
                ("box", format!("{head}\\n{}{}", node.dtype, fmt_shape(&node.shape)))
            }
        };
        let mut style = String::new();
        let rules = if options.fused { crate::optimize::explain(g, n) } else { Vec::new() };
        if !rules.is_empty() {
            fused_any = true;
            let lines: Vec<String> = rules.chunks(2).map(|c| c.join(", ")).collect();
            label += &format!("\\n<- {}", lines.join(",\\n   "));
            style = format!(", style=filled, fillcolor=\"{FUSED_FILL}\", color=\"{FUSED_LINE}\"");
        }
        let _ = writeln!(out, "{indent}n{} [shape={shape}, label=\"%{}: {label}\"{style}];", n.index(), names[&n]);
    };
    let mut cluster = 0;
    for item in &items {
        match *item {
            Item::Top => {
                for &n in &members[&(Item::Top, "")] {
                    node_line(&mut out, n, "  ");
                }
            }
            Item::Scope(scope) => {
                let _ = writeln!(
                    out,
                    "  subgraph cluster_{cluster} {{\n    label=\"{}\";\n    style=rounded;",
                    escape(scope)
                );
                cluster += 1;
                for &n in &members[&(*item, "")] {
                    node_line(&mut out, n, "    ");
                }
                out.push_str("  }\n");
            }
            Item::Block(stack, i) => {
                let _ = writeln!(
                    out,
                    "  subgraph cluster_{cluster} {{\n    label=\"{}.{i}\";\n    style=\"rounded,filled\";\n    fillcolor=\"{BLOCK_FILL}\";",
                    escape(stack)
                );
                cluster += 1;
                for part in &parts[item] {
                    let nodes = &members[&(*item, *part)];
                    if part.is_empty() {
                        for &n in nodes {
                            node_line(&mut out, n, "    ");
                        }
                        continue;
                    }
                    let _ = writeln!(
                        out,
                        "    subgraph cluster_{cluster} {{\n      label=\"{}\";\n      style=\"rounded,filled\";\n      fillcolor=white;",
                        escape(part)
                    );
                    cluster += 1;
                    for &n in nodes {
                        node_line(&mut out, n, "      ");
                    }
                    out.push_str("    }\n");
                }
                out.push_str("  }\n");
            }
            Item::Hidden(r) => {
                let (stack, first, last) = runs[r];
                let blocks = last + 1 - first;
                let noun = if blocks == 1 { "block" } else { "blocks" };
                let _ = writeln!(
                    out,
                    "  hidden_{r} [shape=box3d, style=filled, fillcolor=\"{HIDDEN_FILL}\", label=\"{} {first}..{}: {blocks} {noun}, {} ops\"];",
                    escape(stack),
                    last + 1,
                    hidden_ops[r]
                );
            }
        }
    }

    // Edges; those of hidden nodes go to their run's summary, once each.
    let id = |n: NodeIndex| match place(n) {
        Place::Hidden(r) => format!("hidden_{r}"),
        _ => format!("n{}", n.index()),
    };
    let mut seen: HashSet<(String, String)> = HashSet::new();
    for &n in &order {
        for o in g.operands(n) {
            let (from, to) = (id(o), id(n));
            let summary = matches!(place(o), Place::Hidden(_)) || matches!(place(n), Place::Hidden(_));
            if summary && (from == to || !seen.insert((from.clone(), to.clone()))) {
                continue;
            }
            let _ = writeln!(out, "  {from} -> {to};");
        }
    }
    for (name, n) in &g.outputs {
        let name = escape(name);
        let _ =
            writeln!(out, "  \"out_{name}\" [shape=doubleoctagon, label=\"{name}\"];\n  {} -> \"out_{name}\";", id(*n));
    }
    if options.legend {
        out.push_str("  subgraph cluster_legend {\n    label=\"legend\";\n    style=dashed;\n    fontsize=10;\n");
        out.push_str("    legend_op [label=\"op\\ndtype[shape]\"];\n");
        out.push_str("    legend_param [shape=note, label=\"parameter\"];\n");
        out.push_str("    legend_input [shape=invhouse, label=\"input\"];\n");
        if fused_any {
            let _ = writeln!(
                out,
                "    legend_fused [style=filled, fillcolor=\"{FUSED_FILL}\", color=\"{FUSED_LINE}\", label=\"fused op\\n<- rules that made it\"];"
            );
        }
        if !runs.is_empty() {
            let _ = writeln!(
                out,
                "    legend_hidden [shape=box3d, style=filled, fillcolor=\"{HIDDEN_FILL}\", label=\"hidden blocks\\n(--layers)\"];"
            );
        }
        out.push_str("  }\n");
    }
    out.push_str("}\n");
    out
}

/// Escapes a DOT string's quotes and backslashes.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Node numbers in printing order (dense, from 0), so dumps do not depend on internal indices.
fn numbering(order: &[NodeIndex]) -> HashMap<NodeIndex, usize> {
    order.iter().enumerate().map(|(i, &n)| (n, i)).collect()
}

/// The matrix-multiply FLOPs of a forward pass over `seq` tokens (and source tokens) at batch 1:
/// the one FLOP count every command prints (`check`, `diff`, `inspect`). Counted the same before
/// and after fusion — a fused projection (`Op::Linear`) counts its matmul (both halves of a gated
/// one), an attention its two score products, Linformer's low-rank projection its product — and
/// not the elementwise work around them; ops on parameters alone (folded at load time) count
/// nothing.
pub fn matmul_flops(g: &Graph, seq: usize) -> f64 {
    let bind = |d: &Dim| match d {
        Dim::Fixed(k) => *k as f64,
        Dim::Sym(Sym::Batch) => 1.0,
        Dim::Sym(_) => seq as f64,
    };
    let elements = |s: &[Dim]| -> f64 { s.iter().map(bind).product() };
    let last = |s: &[Dim]| s.last().map_or(1.0, bind);
    let axis = |s: &[Dim], i: usize| s.get(i).map_or(1.0, bind);
    let mut konst: HashMap<NodeIndex, bool> = HashMap::new();
    let mut flops = 0.0;
    for n in g.order() {
        let node = &g.g[n];
        let operands = g.operands(n);
        let k = match node.op {
            Op::Param { .. } => true,
            Op::Input { .. } | Op::Positions { .. } => false,
            _ => !operands.is_empty() && operands.iter().all(|o| konst.get(o).copied().unwrap_or(false)),
        };
        konst.insert(n, k);
        if k {
            continue;
        }
        let shape = |i: usize| operands.get(i).map(|&o| g.g[o].shape.as_slice()).unwrap_or(&[]);
        let out = node.shape.as_slice();
        flops += match &node.op {
            Op::MatMul { .. } | Op::MatMulActGrad { .. } => 2.0 * elements(out) * last(shape(0)),
            Op::Linear { glu, .. } => {
                let rows = elements(out) / last(out).max(1.0);
                let m = if *glu { 2.0 } else { 1.0 } * last(out);
                2.0 * rows * m * last(shape(0))
            }
            Op::Attention { .. } => 4.0 * elements(shape(0)) * axis(shape(1), 2),
            Op::AttentionGrad { .. } => 10.0 * elements(shape(0)) * axis(shape(1), 2),
            Op::PackedAttention(p) => {
                let tokens = elements(out) / last(out).max(1.0);
                let keys = if p.cached { axis(shape(1), 2) } else { axis(shape(0), 1) };
                4.0 * tokens * (p.heads * p.head_dim) as f64 * keys
            }
            Op::LowRank { .. } => 2.0 * elements(out) * axis(shape(0), 1),
            Op::ContractRows => 2.0 * elements(out) * elements(shape(0)) / last(shape(0)).max(1.0),
            _ => 0.0,
        };
    }
    flops
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
    let flops = matmul_flops(g, seq);
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
