//! The order a graph's ops run in, chosen for memory: a list scheduler (XLA's, in spirit) that,
//! of the ops ready to run, runs the one that frees the most bytes less the bytes it allocates,
//! ties going to the graph's own order.
//!
//! Lowering runs a graph's ops in its node order ([`Graph::order`]), which is the order they were
//! built in. That suits a graph built as it runs — a forward pass, or a training step as autodiff
//! builds it, each weight's gradient made as soon as the backward reaches its op — but not one the
//! optimizer rebuilt: the rebuild makes each output's whole term in turn, so a training step's
//! weight gradients, the last outputs, come after the whole backward, and every activation and
//! gradient they read is held until then (GPT-2 small's step: every block's activations live at
//! once even when each block's forward is recomputed). [`by_memory`] puts each op where it lets
//! memory go soonest.

use crate::graph::{Graph, Op, Sym, resolve};
use petgraph::Direction;
use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use std::collections::HashMap;

/// `g` with its nodes renumbered in the order [`order_by_memory`] gives at the sizes `syms`
/// resolves (so [`Graph::order`] and lowering follow it) where that order holds fewer bytes at
/// its [`peak`] than the graph's own; else `g` as it is. The same graph either way: ops,
/// operands, outputs.
pub fn by_memory(g: &Graph, syms: &HashMap<Sym, usize>) -> Graph {
    let order = order_by_memory(g, syms);
    match peak(g, &order, syms) < peak(g, &g.order(), syms) {
        true => g.renumbered(&order),
        false => g.clone(),
    }
}

/// Whether `v` is a view of its first operand's buffer (a reshape, an `after`).
fn is_view(g: &Graph, v: NodeIndex) -> bool {
    matches!(g.g[v].op, Op::Reshape { .. } | Op::After)
}

/// For each node (by index), the value whose buffer it is: itself, or for a view its operand's.
fn roots(g: &Graph) -> Vec<NodeIndex> {
    let mut roots: Vec<NodeIndex> = g.g.node_indices().collect();
    for v in g.order() {
        if let (true, Some(&o)) = (is_view(g, v), g.operands(v).first()) {
            roots[v.index()] = roots[o.index()];
        }
    }
    roots
}

/// The most bytes `g`'s values hold at once when its ops run in `order` (a topological order),
/// at the sizes `syms` resolves: each value from its op to its last reader (an output to the
/// end); views (reshapes, `after`) hold none of their own and keep their operand's buffer until
/// their own last reader; parameters are not counted, inputs are.
pub fn peak(g: &Graph, order: &[NodeIndex], syms: &HashMap<Sym, usize>) -> u64 {
    let roots = roots(g);
    let (view, root) = (|v| is_view(g, v), |v: NodeIndex| roots[v.index()]);
    let mut reads: HashMap<NodeIndex, usize> = HashMap::new();
    for &v in order.iter().filter(|&&v| !view(v)) {
        for o in g.operands(v) {
            *reads.entry(root(o)).or_default() += 1;
        }
    }
    for (_, v) in &g.outputs {
        *reads.entry(root(*v)).or_default() += 1;
    }
    let bytes = |v: NodeIndex| -> u64 {
        let node = &g.g[v];
        let elements: u64 = resolve(&node.shape, syms).iter().map(|&d| d as u64).product();
        elements * if node.dtype == crate::tensor::DType::I64 { 8 } else { 4 }
    };
    let param = |v: NodeIndex| matches!(g.g[v].op, Op::Param { .. });
    let (mut live, mut peak) = (0u64, 0u64);
    for &v in order.iter().filter(|&&v| !view(v)) {
        if !param(v) {
            live += bytes(v);
            peak = peak.max(live);
        }
        for o in g.operands(v) {
            let o = root(o);
            if let Some(r) = reads.get_mut(&o) {
                *r -= 1;
                if *r == 0 && !param(o) {
                    live = live.saturating_sub(bytes(o));
                }
            }
        }
    }
    peak
}

/// A topological order of `g` that, among the ops ready to run, runs first the one whose run
/// frees the most bytes (operands read for the last time) less the bytes of its output, at the
/// sizes `syms` resolves; ties go to the earlier in [`Graph::order`]. Views (reshapes, `after`)
/// hold no bytes of their own and run as soon as they are ready; they keep their operand's buffer
/// until their own readers have run. Parameters, inputs and outputs are never freed.
pub fn order_by_memory(g: &Graph, syms: &HashMap<Sym, usize>) -> Vec<NodeIndex> {
    let n = g.g.node_count();
    let base = g.order();
    let mut rank = vec![0usize; n];
    for (i, &v) in base.iter().enumerate() {
        rank[v.index()] = i;
    }
    let operands: Vec<Vec<NodeIndex>> = g.g.node_indices().map(|v| g.operands(v)).collect();
    let roots = roots(g);
    let (view, root) = (|v| is_view(g, v), |v: NodeIndex| roots[v.index()]);
    let held = |v: NodeIndex| !view(v) && !matches!(g.g[v].op, Op::Param { .. } | Op::Input { .. });
    let bytes: Vec<u64> =
        g.g.node_indices()
            .map(|v| match held(v) {
                true => resolve(&g.g[v].shape, syms).iter().map(|&d| d as u64).product::<u64>() * 4,
                false => 0,
            })
            .collect();
    // Reads still to come of each buffer (by its root); an output's buffer is read at the end.
    let mut reads = vec![0usize; n];
    for v in g.g.node_indices().filter(|&v| !view(v)) {
        for &o in &operands[v.index()] {
            reads[root(o).index()] += 1;
        }
    }
    for (_, o) in &g.outputs {
        reads[root(*o).index()] += 1;
    }
    let mut waiting: Vec<usize> =
        g.g.node_indices().map(|v| g.g.edges_directed(v, Direction::Incoming).count()).collect();
    let mut ready: Vec<NodeIndex> = g.g.node_indices().filter(|v| waiting[v.index()] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while !ready.is_empty() {
        // The score of running `v` now: bytes freed less bytes allocated (views first).
        let score = |v: NodeIndex| -> i128 {
            if view(v) {
                return i128::MAX;
            }
            let mut roots: Vec<NodeIndex> = operands[v.index()].iter().map(|&o| root(o)).collect();
            roots.sort();
            let mut freed = 0u64;
            for group in roots.chunk_by(|a, b| a == b) {
                let r = group[0];
                if held(r) && reads[r.index()] == group.len() {
                    freed += bytes[r.index()];
                }
            }
            i128::from(freed) - i128::from(bytes[v.index()])
        };
        let best = ready
            .iter()
            .enumerate()
            .max_by(|(_, a), (_, b)| score(**a).cmp(&score(**b)).then(rank[b.index()].cmp(&rank[a.index()])));
        let Some((at, _)) = best else { break };
        let v = ready.swap_remove(at);
        order.push(v);
        if !view(v) {
            for &o in &operands[v.index()] {
                reads[root(o).index()] -= 1;
            }
        }
        for e in g.g.edges_directed(v, Direction::Outgoing) {
            let t = e.target().index();
            waiting[t] -= 1;
            if waiting[t] == 0 {
                ready.push(e.target());
            }
        }
    }
    order
}
