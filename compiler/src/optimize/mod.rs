//! The optimizer: Graph -> e-graph -> rewrite rules -> cost-based extraction -> Graph.
//!
//! The graph is turned into an [`egg`] e-graph over the language [`Kl`]: one e-node per graph op,
//! with every op attribute (a scale factor, an activation, a permutation, a parameter's identity)
//! an interned [`Attr`] leaf, so rewrite rules are plain s-expression patterns whose variables
//! range over attributes too. Rule sets (see `rules/` and its README) run in phases under the
//! documented [`Limits`]; each fused op appears in an e-class next to the ops it replaces. The
//! [`CostModel`] (bytes moved, FLOPs, a per-dispatch overhead) then picks the cheapest member of
//! every class, and the chosen terms are rebuilt into a graph, sharing identical subterms.
//!
//! **Invariant**: every rule's right-hand side computes the same values as its left-hand side, as
//! defined by the interpreter; the per-rule differential tests check exactly that.
//!
//! One concept per file, re-exported here: `lang.rs` the language [`Kl`] and its attributes
//! ([`Attr`]) with the translation from and to graph ops; `analysis.rs` the e-class types
//! ([`KAnalysis`]); `cost.rs` the [`CostModel`]; `extract.rs` the extraction and the rebuilt graph;
//! `provenance.rs` records which rules made each e-node ([`Provenance`]), and `explain.rs` reads it
//! off the rebuilt graph ([`explain`]). This file holds the entry points
//! ([`optimize`], [`optimize_for`], [`optimize_with`], [`optimize_target`]), their [`Limits`] and
//! [`Report`], and [`dispatches`].

#![expect(
    clippy::indexing_slicing,
    reason = "the entry points index nodes of graphs that `Graph::check` accepted, and the e-classes \
              they were added as"
)]

mod analysis;
mod cost;
mod explain;
mod extract;
mod lang;
mod provenance;
pub mod rules;

pub use analysis::{Data, KAnalysis, KGraph, Type};
pub use cost::{CostModel, Work};
pub use explain::explain;
pub use lang::{Attr, AttrValue, FALSE, Kl, NO_WINDOW, PLAIN_SCORES, TRUE, to_op};
pub use provenance::{Made, Provenance};

use crate::graph::{Dim, Graph, GraphError, Op, PackedAttention};
use egg::{Id, Runner};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Runner limits. Each is a documented constant, overridable per call (tests use small ones).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Stop after this many e-nodes.
    pub nodes: usize,
    /// Stop after this many iterations of a phase.
    pub iterations: usize,
    /// Stop after this long per phase.
    pub time: Duration,
}

/// Default node limit: far above what the rules reach on a 100-layer model (they add a few nodes
/// per block), low enough to bound memory.
pub const NODE_LIMIT: usize = 500_000;
/// Default iteration limit per phase; every rule set here saturates within a handful.
pub const ITER_LIMIT: usize = 16;
/// Default time limit per phase.
pub const TIME_LIMIT: Duration = Duration::from_secs(5);

impl Default for Limits {
    fn default() -> Self {
        Limits { nodes: NODE_LIMIT, iterations: ITER_LIMIT, time: TIME_LIMIT }
    }
}

/// What the optimizer did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Times each rule fired, by rule name.
    pub applied: BTreeMap<String, usize>,
    /// E-nodes at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// Iterations per phase, with the reason each phase stopped and its time.
    pub phases: Vec<(String, usize, String)>,
    /// Wall time.
    pub optimize_ms: f64,
    /// Dispatches before and after.
    pub dispatches: (usize, usize),
}

/// Optimizes a graph with the default rule phases and cost model.
pub fn optimize(g: &Graph) -> Result<(Graph, Report), GraphError> {
    optimize_for(g, &crate::target::Target::default())
}

/// Optimizes a graph for a back end: its cost model drives extraction and its limits bound the
/// fused forms (see [`crate::target`]).
pub fn optimize_for(g: &Graph, target: &crate::target::Target) -> Result<(Graph, Report), GraphError> {
    optimize_target(g, &Limits::default(), target, &rules::phases())
}

/// Optimizes a graph with the given limits, cost model and rule phases (for the default target's
/// kernel limits).
pub fn optimize_with(
    g: &Graph,
    limits: &Limits,
    model: &CostModel,
    phases: &[(&str, Vec<egg::Rewrite<Kl, KAnalysis>>)],
) -> Result<(Graph, Report), GraphError> {
    let target = crate::target::Target { cost: model.clone(), ..crate::target::Target::default() };
    optimize_target(g, limits, &target, phases)
}

/// Optimizes a graph for `target` with the given limits and rule phases.
pub fn optimize_target(
    g: &Graph,
    limits: &Limits,
    target: &crate::target::Target,
    phases: &[(&str, Vec<egg::Rewrite<Kl, KAnalysis>>)],
) -> Result<(Graph, Report), GraphError> {
    let model = &target.cost;
    let start = Instant::now();
    let analysis = KAnalysis {
        max_attention_head_dim: target.max_attention_head_dim,
        attention_grad: target.attention_grad,
        ..KAnalysis::default()
    };
    let mut egraph = KGraph::new(analysis);
    let mut class_of: HashMap<NodeIndex, Id> = HashMap::new();
    let mut scope_of: HashMap<Id, String> = HashMap::new();
    for n in g.order() {
        let operands: Vec<Id> = g.operands(n).iter().map(|o| class_of[o]).collect();
        let id = lang::add_op(&mut egraph, &g.g[n], &operands);
        scope_of.entry(id).or_insert_with(|| g.g[n].scope.clone());
        class_of.insert(n, id);
    }
    egraph.rebuild();
    let roots: Vec<Id> = g.outputs.iter().map(|(_, n)| class_of[n]).collect();
    for n in g.g.node_indices() {
        let users = g.g.edges_directed(n, petgraph::Direction::Outgoing).count();
        *egraph.analysis.uses.entry(egraph.find(class_of[&n])).or_default() += users;
    }
    for root in &roots {
        *egraph.analysis.uses.entry(egraph.find(*root)).or_default() += 1;
    }

    let mut report = Report::default();
    for (name, rules) in phases {
        let rules: Vec<_> = rules
            .iter()
            .map(provenance::record)
            .collect::<Result<_, _>>()
            .map_err(|message| GraphError { op: "optimize".into(), scope: String::new(), message })?;
        let runner = Runner::default()
            .with_egraph(egraph)
            .with_node_limit(limits.nodes)
            .with_iter_limit(limits.iterations)
            .with_time_limit(limits.time)
            .run(rules.iter());
        for it in &runner.iterations {
            for (rule, count) in &it.applied {
                *report.applied.entry(rule.to_string()).or_default() += count;
            }
        }
        let reason = runner.stop_reason.as_ref().map(|r| format!("{r:?}")).unwrap_or_default();
        let ms: f64 = runner.iterations.iter().map(|it| it.total_time).sum::<f64>() * 1e3;
        report.phases.push((name.to_string(), runner.iterations.len(), format!("{reason}, {ms:.1} ms")));
        egraph = runner.egraph;
    }
    egraph.rebuild();
    Provenance::canonicalize(&mut egraph);
    report.egraph_nodes = egraph.total_number_of_nodes();
    report.egraph_classes = egraph.number_of_classes();

    // Scopes follow the classes through merges; a class the rules made takes the scope of the
    // class its first node's rule rewrote (see `extract::rebuild`).
    let scopes: HashMap<Id, String> = scope_of.into_iter().map(|(id, s)| (egraph.find(id), s)).collect();
    let choices = extract::extract(&egraph, model, &roots);
    let mut out = Graph::new(&g.name);
    let mut built: HashMap<(Op, Vec<NodeIndex>), NodeIndex> = HashMap::new();
    for ((name, _), root) in g.outputs.iter().zip(&roots) {
        let expr = choices.term(&egraph, *root).ok_or_else(|| GraphError {
            op: "extract".into(),
            scope: name.clone(),
            message: "the extracted choices are cyclic (an optimizer bug)".into(),
        })?;
        let n = extract::rebuild(&egraph, &expr, &scopes, &mut out, &mut built)?;
        out.outputs.push((name.clone(), n));
    }
    out.scope.clear();
    out.check()?;
    report.dispatches = (dispatches(g), dispatches(&out));
    report.optimize_ms = start.elapsed().as_secs_f64() * 1e3;
    Ok((out, report))
}

/// Kernel dispatches a graph lowers to: every op but inputs, parameters, reshapes and constants
/// (ops on parameters alone, folded at load time as the lowering does), and but the cache appends
/// the WGSL back end folds into the cached attention reading them ([`folded_appends`]; on a
/// hardware adapter, with the wgpu back end's `Options::fold_appends`: lavapipe runs them apart).
pub fn dispatches(g: &Graph) -> usize {
    let folded = folded_appends(g);
    let mut konst = vec![false; g.g.node_count()];
    let mut count = 0;
    for n in g.order() {
        let operands = g.operands(n);
        let node = &g.g[n];
        konst[n.index()] = match node.op {
            Op::Param { .. } => true,
            Op::Input { .. } | Op::Positions { .. } => false,
            _ => {
                !operands.is_empty()
                    && operands.iter().all(|o| konst[o.index()])
                    && node.shape.iter().all(|d| matches!(d, Dim::Fixed(_)))
            }
        };
        if !konst[n.index()]
            && !matches!(node.op, Op::Input { .. } | Op::Reshape { .. } | Op::After)
            && !folded.contains(&n)
        {
            count += 1;
        }
    }
    count
}

/// The cache appends a decoder step's cached attention does in its own dispatch on wgpu (the
/// graph-level view of the wgpu back end's `fold_appends`, which folds them in the plan): a pair of
/// `heads` appends, neither normalizing nor rotating, of the attention's key and value heads of
/// the projection it reads its queries from, each read by the attention alone.
pub fn folded_appends(g: &Graph) -> std::collections::HashSet<NodeIndex> {
    let mut folded = std::collections::HashSet::new();
    for n in g.g.node_indices() {
        let Op::PackedAttention(PackedAttention {
            kv_heads, head_dim, k, v, mods, cached: true, appends: false, ..
        }) = g.g[n].op
        else {
            continue;
        };
        let operands = g.operands(n);
        let (Some(&qkv), None) = (operands.first(), mods.sparse) else { continue };
        let append = |i: usize, start: usize| -> Option<NodeIndex> {
            let c = *operands.get(i)?;
            let appends = matches!(g.g[c].op,
                Op::Heads { start: s, heads, head_dim: d, norm: None, rope: None }
                    if s == start && heads == kv_heads && d == head_dim);
            let readers = g.g.neighbors_directed(c, petgraph::Direction::Outgoing).count();
            (appends && g.operands(c).len() == 2 && g.operands(c).get(1) == Some(&qkv) && readers == 1).then_some(c)
        };
        if let (Some(kc), Some(vc)) = (append(1, k), append(2, v)) {
            folded.extend([kc, vc]);
        }
    }
    folded
}
