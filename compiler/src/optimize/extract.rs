//! Extraction: the cheapest graph out of the saturated e-graph. `settle` re-extracts until the set of
//! shared values (charged to none of their readers, see `Cost`) is stable; `extract` keeps the
//! cheaper, each value counted once (`dag_cost`), of two such extractions, the second of which
//! starts with merged projections charged in shares to their slices (`sliced_classes`), then
//! takes each group of choices a multi-class rule made where that lowers the cost (`regroup`), and
//! each node whose operands the graph computes already where that does (`reuse`); `rebuild`
//! turns the chosen terms back into graph nodes, sharing identical ones, each with the scope of the
//! ops it replaces and the rules that made it.

#![expect(
    clippy::indexing_slicing,
    reason = "extraction indexes the e-graph's own classes, and the children of an extracted term, \
              which come before their parents"
)]

use super::analysis::{enode_konst, enode_shape};
use super::cost::Cost;
use super::{CostModel, KAnalysis, KGraph, Kl, Made, Type, to_op};
use crate::graph::{Graph, GraphError, Node, Op, Shape};
use egg::{Id, Language, RecExpr};
use petgraph::graph::NodeIndex;
use std::collections::{HashMap, HashSet};

/// What extraction chose: one e-node per class (canonical ids), from which [`Choices::term`]
/// builds each root's term.
pub(super) struct Choices {
    best: HashMap<Id, Kl>,
}

impl Choices {
    /// The chosen node of `class`.
    fn node(&self, egraph: &KGraph, class: Id) -> &Kl {
        &self.best[&egraph.find(class)]
    }

    /// The term rooted at `root`, each class's chosen node once, children before parents; `None`
    /// where the choices are cyclic (a class that reaches itself through its chosen children).
    pub(super) fn term(&self, egraph: &KGraph, root: Id) -> Option<RecExpr<Kl>> {
        let mut expr = RecExpr::default();
        let mut at: HashMap<Id, Id> = HashMap::new();
        // Classes whose children are being built: meeting one again below itself is a cycle.
        let mut open: HashSet<Id> = HashSet::new();
        // Post-order without recursion (a deep model's graph is thousands of classes deep).
        let mut stack = vec![(egraph.find(root), false)];
        while let Some((class, expanded)) = stack.pop() {
            if at.contains_key(&class) {
                continue;
            }
            let node = self.node(egraph, class);
            if expanded {
                let built = node.clone().map_children(|c| at[&egraph.find(c)]);
                at.insert(class, expr.add(built));
                open.remove(&class);
            } else {
                if !open.insert(class) {
                    return None;
                }
                stack.push((class, true));
                stack.extend(node.children().iter().map(|&c| (egraph.find(c), false)));
            }
        }
        Some(expr)
    }

    /// Whether the choices reachable from `roots` are free of cycles (a term exists for each).
    fn acyclic(&self, egraph: &KGraph, roots: &[Id]) -> bool {
        // Depth-first, iteratively: a class is `open` while its children are being visited.
        let (mut open, mut done): (HashSet<Id>, HashSet<Id>) = (HashSet::new(), HashSet::new());
        for &root in roots {
            let mut stack = vec![(egraph.find(root), false)];
            while let Some((class, expanded)) = stack.pop() {
                if expanded {
                    open.remove(&class);
                    done.insert(class);
                    continue;
                }
                if done.contains(&class) {
                    continue;
                }
                if !open.insert(class) {
                    return false;
                }
                stack.push((class, true));
                stack.extend(self.node(egraph, class).children().iter().map(|&c| (egraph.find(c), false)));
            }
        }
        true
    }
}

/// The choices the optimized graph is rebuilt from: of two [`settle`]d extractions, the one whose
/// graph costs less ([`dag_cost`]), then improved by the rules' groups ([`regroup`]).
pub(super) fn extract(egraph: &KGraph, model: &CostModel, roots: &[Id]) -> Choices {
    // Shared values: first those of the input graph; then, a few rounds, those of the graph the
    // previous round extracted (a norm read by two projections is no longer shared once both
    // became one), until the set is stable. Values the rules made to be read several times (a
    // merged projection, sliced by its consumers) are shared only once extracted, which the
    // rounds cannot discover from an extraction without them: a second start assumes them shared,
    // and of the two results the one whose graph (each value counted once) costs less is kept.
    let input_shared: HashSet<Id> =
        egraph.analysis.uses.iter().filter(|(_, u)| **u > 1).map(|(id, _)| egraph.find(*id)).collect();
    let starts = [(input_shared.clone(), HashMap::new()), (input_shared, sliced_classes(egraph))];
    let extractors = starts.map(|(shared, split)| settle(egraph, model, roots, shared, split));
    let costed = costed(egraph);
    let choices =
        extractors.map(|e| Choices { best: costed.iter().map(|&c| (c, e.find_best_node(c).clone())).collect() });
    // A shared value is charged to none of its readers, so a class may choose a node reading a
    // class whose choice reads it back at no cost (a training graph's backward offers such
    // loops): a cyclic extraction has no term and is not a candidate. The extraction that
    // charges every reader in full is acyclic (a node costs at least its children), the last
    // resort.
    let mut candidates: Vec<(Choices, f64)> = choices
        .into_iter()
        .filter(|c| c.acyclic(egraph, roots))
        .map(|c| {
            let cost = dag_cost(egraph, model, &c, roots);
            (c, cost)
        })
        .collect();
    if candidates.is_empty() {
        let plain = egg::Extractor::new(egraph, Cost { egraph, model, shared: HashSet::new(), split: HashMap::new() });
        let c = Choices { best: costed.iter().map(|&c| (c, plain.find_best_node(c).clone())).collect() };
        let cost = dag_cost(egraph, model, &c, roots);
        candidates.push((c, cost));
    }
    candidates.sort_by(|a, b| a.1.total_cmp(&b.1));
    let (best, cost) = candidates.swap_remove(0);
    let (best, cost) = regroup(egraph, model, roots, best, cost);
    reuse(egraph, model, roots, best, cost)
}

/// Most passes of [`reuse`] over the graph.
const REUSE_ROUNDS: usize = 4;

/// Time after which [`reuse`] stops with the best choices found: each candidate costs the whole
/// graph again, so the pass grows with the square of the graph's size (0.3 s on SmolLM2-135M's
/// training step); a much larger graph keeps what the time allowed.
const REUSE_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Takes, class by class, a node whose operands the chosen graph computes already, where the
/// whole graph then costs less. A tree extraction charges an operand to each of its readers, so
/// a form reading a value another choice made looks dearer than it is: the stacked output
/// gradients of a packed projection, read by the weight's gradient and by the input's, pay
/// only once both products read them.
fn reuse(egraph: &KGraph, model: &CostModel, roots: &[Id], mut choices: Choices, mut cost: f64) -> Choices {
    let start = std::time::Instant::now();
    for _ in 0..REUSE_ROUNDS {
        let reached = reachable(egraph, &choices, roots);
        let mut order: Vec<Id> = reached.iter().copied().collect();
        order.sort();
        let mut improved = false;
        for class in order {
            if start.elapsed() > REUSE_TIME {
                return choices;
            }
            let current = choices.node(egraph, class).clone();
            for node in &egraph[class].nodes {
                let node = node.clone().map_children(|c| egraph.find(c));
                if node == current || !node.all(|c| reached.contains(&c)) {
                    continue;
                }
                let mut trial = Choices { best: choices.best.clone() };
                trial.best.insert(class, node);
                if !trial.acyclic(egraph, roots) {
                    continue;
                }
                let trial_cost = dag_cost(egraph, model, &trial, roots);
                if trial_cost < cost {
                    (choices, cost, improved) = (trial, trial_cost, true);
                    break;
                }
            }
        }
        if !improved {
            break;
        }
    }
    choices
}

/// The classes the choices reach from `roots`.
fn reachable(egraph: &KGraph, choices: &Choices, roots: &[Id]) -> HashSet<Id> {
    let mut seen: HashSet<Id> = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    while let Some(class) = stack.pop() {
        if seen.insert(class) {
            stack.extend(choices.node(egraph, class).children().iter().map(|&c| egraph.find(c)));
        }
    }
    seen
}

/// Takes each group of choices a multi-class rule made ([`KAnalysis::groups`]) where the whole
/// graph then costs less, one group at a time. A group's op serves several values (a decoder
/// step's attention that also appends to the caches): a tree extraction charges it to each of
/// them and never picks it, while counting each value once shows what it saves.
fn regroup(egraph: &KGraph, model: &CostModel, roots: &[Id], mut choices: Choices, mut cost: f64) -> (Choices, f64) {
    for group in &egraph.analysis.groups {
        let mut trial = Choices { best: choices.best.clone() };
        for (class, node) in group {
            let node = node.clone().map_children(|c| egraph.find(c));
            if !node.all(|c| trial.best.contains_key(&c)) {
                continue;
            }
            trial.best.insert(egraph.find(*class), node);
        }
        // A group's node may read a class whose choice reads the group's own value: taking it
        // would make the graph cyclic.
        if !trial.acyclic(egraph, roots) {
            continue;
        }
        let trial_cost = dag_cost(egraph, model, &trial, roots);
        if trial_cost < cost {
            (choices, cost) = (trial, trial_cost);
        }
    }
    (choices, cost)
}

/// The classes an extractor finds a term for: those with a node whose children all have one
/// (`egg::Extractor` has a best node for these and only these).
fn costed(egraph: &KGraph) -> HashSet<Id> {
    let mut costed: HashSet<Id> = HashSet::new();
    loop {
        let before = costed.len();
        for class in egraph.classes() {
            if !costed.contains(&class.id) && class.nodes.iter().any(|n| n.all(|c| costed.contains(&egraph.find(c)))) {
                costed.insert(class.id);
            }
        }
        if costed.len() == before {
            return costed;
        }
    }
}

/// An extractor whose shared set is stable: extraction from `shared`, re-derived from the result
/// for at most [`EXTRACTION_ROUNDS`].
fn settle<'a>(
    egraph: &'a KGraph,
    model: &'a CostModel,
    roots: &[Id],
    mut shared: HashSet<Id>,
    split: HashMap<Id, f64>,
) -> egg::Extractor<'a, Cost<'a>, Kl, KAnalysis> {
    let mut extractor = egg::Extractor::new(egraph, Cost { egraph, model, shared: shared.clone(), split });
    for _ in 0..EXTRACTION_ROUNDS {
        let next = shared_in_extraction(egraph, &extractor, roots);
        if next == shared {
            break;
        }
        shared = next;
        extractor = egg::Extractor::new(egraph, Cost { egraph, model, shared: shared.clone(), split: HashMap::new() });
    }
    extractor
}

/// Classes sliced by two or more different slices or `heads` (the merged projections, whose
/// columns they read), with the number of them: each consumer is charged that share of its cost.
fn sliced_classes(egraph: &KGraph) -> HashMap<Id, f64> {
    let mut slices: HashMap<Id, HashSet<Id>> = HashMap::new();
    for class in egraph.classes() {
        for node in &class.nodes {
            if let Kl::Slice([_, x]) | Kl::Heads([_, _, x, _]) = node {
                slices.entry(egraph.find(*x)).or_default().insert(class.id);
            }
        }
    }
    slices.into_iter().filter(|(_, s)| s.len() > 1).map(|(x, s)| (x, s.len() as f64)).collect()
}

/// The cost of the graph an extractor extracts, each class counted once (what running it costs).
fn dag_cost(egraph: &KGraph, model: &CostModel, choices: &Choices, roots: &[Id]) -> f64 {
    let mut seen: HashSet<Id> = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    let mut total = 0.0;
    while let Some(class) = stack.pop() {
        if !seen.insert(class) {
            continue;
        }
        let node = choices.node(egraph, class);
        stack.extend(node.children().iter().map(|&c| egraph.find(c)));
        let Some((op, operands)) = to_op(egraph, node) else { continue };
        if enode_konst(egraph, node) {
            continue;
        }
        let shapes: Vec<&Shape> = operands.iter().filter_map(|&o| egraph[o].data.as_ref().map(|d| &d.shape)).collect();
        match enode_shape(egraph, node) {
            Some(out) => total += model.node_cost(&op, &shapes, &out),
            None => return f64::INFINITY,
        }
    }
    // A group taken whole is one op serving several values: a cached attention whose cache
    // appends the WGSL back end runs in its own dispatch (see `optimize::folded_appends`).
    for group in &egraph.analysis.groups {
        let taken = group.iter().all(|(class, node)| {
            let class = egraph.find(*class);
            seen.contains(&class) && *choices.node(egraph, class) == node.clone().map_children(|c| egraph.find(c))
        });
        if taken {
            total -= model.dispatch * (group.len() - 1) as f64;
        }
    }
    total
}

/// Most re-extractions after the first (each with the shared values of the previous one).
const EXTRACTION_ROUNDS: usize = 3;

/// The classes the extracted graph reads from more than one op.
fn shared_in_extraction(egraph: &KGraph, extractor: &egg::Extractor<Cost, Kl, KAnalysis>, roots: &[Id]) -> HashSet<Id> {
    let mut uses: HashMap<Id, usize> = HashMap::new();
    let mut seen: HashSet<Id> = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    for r in &stack {
        *uses.entry(*r).or_default() += 1;
    }
    while let Some(class) = stack.pop() {
        if !seen.insert(class) {
            continue;
        }
        for &c in extractor.find_best_node(class).children() {
            let c = egraph.find(c);
            // Attribute leaves and `none` are not values.
            if egraph[c].data.is_some() {
                *uses.entry(c).or_default() += 1;
                stack.push(c);
            }
        }
    }
    uses.into_iter().filter(|(_, u)| *u > 1).map(|(id, _)| id).collect()
}

/// Turns an extracted term back into graph nodes, sharing identical (op, operands) nodes.
pub(super) fn rebuild(
    egraph: &KGraph,
    expr: &RecExpr<Kl>,
    scopes: &HashMap<Id, String>,
    out: &mut Graph,
    built: &mut HashMap<(Op, Vec<NodeIndex>), NodeIndex>,
) -> Result<NodeIndex, GraphError> {
    // Evaluate the RecExpr bottom-up in a scratch e-graph view: we need each node's op, which
    // `to_op` reads from classes, so look the node up in the real e-graph.
    let mut index: Vec<Option<NodeIndex>> = vec![None; expr.as_ref().len()];
    let nodes = expr.as_ref();
    let mut class: Vec<Id> = Vec::with_capacity(nodes.len());
    // Extraction only returns nodes of the e-graph, children before parents; a term that breaks
    // that is an optimizer bug, reported as an error rather than a panic.
    let broken = |message: &str| GraphError { op: "extract".into(), scope: String::new(), message: message.into() };
    for (i, node) in nodes.iter().enumerate() {
        let in_graph = node.clone().map_children(|c| class[usize::from(c)]);
        let id = egraph.lookup(in_graph.clone()).ok_or_else(|| broken("an extracted node is not in the e-graph"))?;
        class.push(id);
        let Some((op, operand_classes)) = to_op(egraph, &in_graph) else { continue };
        // Map operand classes back to the RecExpr children that produced them.
        let children: Vec<usize> = node.children().iter().map(|&c| usize::from(c)).collect();
        let operands: Vec<NodeIndex> = operand_classes
            .iter()
            .map(|oc| {
                let pos =
                    children.iter().find(|&&c| class[c] == *oc).ok_or_else(|| broken("an operand is no child"))?;
                index[*pos].ok_or_else(|| broken("an operand is built after its user"))
            })
            .collect::<Result<_, _>>()?;
        let key = (op.clone(), operands.clone());
        let n = match built.get(&key) {
            Some(&n) => n,
            None => {
                // Ops the rules created take the scope of the ops they replace (the class their
                // rule rewrote), else of their first scoped operand.
                let made = egraph.analysis.provenance.of(&in_graph);
                out.scope = scope_of(egraph, scopes, id, made).unwrap_or_else(|| {
                    operands.iter().map(|&o| out.g[o].scope.clone()).find(|s| !s.is_empty()).unwrap_or_default()
                });
                let n = match &op {
                    Op::Param { .. } | Op::Input { .. } | Op::Positions { .. } if operands.is_empty() => {
                        let Type { shape, dtype, .. } =
                            egraph[id].data.clone().ok_or_else(|| broken("a leaf has no type"))?;
                        let scope = out.scope.clone();
                        out.g.add_node(Node { op: op.clone(), shape, dtype, scope, rules: Vec::new() })
                    }
                    _ => out.add(op.clone(), &operands)?,
                };
                if let Some(made) = made {
                    out.g[n].rules.clone_from(&made.rules);
                }
                built.insert(key, n);
                n
            }
        };
        index[i] = Some(n);
    }
    index.last().copied().flatten().ok_or_else(|| broken("the root is not a tensor"))
}

/// Most classes [`scope_of`] follows from a rule-made class to a class of the input graph.
const SCOPE_HOPS: usize = 4;

/// The scope of class `id`: that of the input graph's ops in it or, for a class the rules made
/// (its node `made`), that of the class the rule rewrote, followed through classes the rules made
/// in turn.
fn scope_of(egraph: &KGraph, scopes: &HashMap<Id, String>, id: Id, made: Option<&Made>) -> Option<String> {
    let (mut class, mut made) = (id, made);
    for _ in 0..SCOPE_HOPS {
        if let Some(scope) = scopes.get(&egraph.find(class)) {
            return Some(scope.clone());
        }
        class = made?.at;
        made = egraph[class].nodes.iter().find_map(|n| egraph.analysis.provenance.of(n));
    }
    None
}
