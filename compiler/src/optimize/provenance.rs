//! Provenance: which rules made each e-node, recorded while they fire.
//!
//! Every rule of a phase runs behind a [`Recorded`] applier (see [`record`]), which wraps the rule's
//! own applier without knowing anything about the rule: before the rule applies a match, it finds
//! the e-nodes the match read (the left-hand side instantiated with the match, looked up in the
//! e-graph), and after, it files every e-node the rule added under
//!
//! - the rules that made the matched e-nodes, then the rule itself (a derivation, in order): the
//!   node standing for the matched class inherits from every matched e-node, a node the rule added
//!   below it (the projection of a packed attention, say) only from the matched e-nodes below the
//!   matched root;
//! - the matched class, whose scope the new node takes when it has none of its own (the ops it
//!   replaces, not the op it happens to read first).
//!
//! Rules whose searcher is not a pattern (the shared-input merges join two matches in code) have
//! no left-hand side to read: what they add records only their own name and matched class.
//!
//! The table is keyed by e-nodes in the form the e-graph's classes hold them, which rebuilding
//! changes: it is re-canonicalized when a rule first applies after a rebuild, and once more
//! before extraction ([`Provenance::canonicalize`]). Its cost is a re-match of the left-hand side
//! per application and a map entry per e-node added; the optimize times of `kiln inspect --stats`
//! did not move beyond their noise.
//!
//! Why not egg's explanations (`Runner::with_explanations_enabled`, `EGraph::explain_existance`):
//! they answer a different question — a proof, from the input terms, that a whole term exists —
//! for which every union is recorded and the extracted term must be given as a whole expression
//! (for a fused op, the model below it); and a union made in code, as the shared-input merges make
//! theirs, is justified by its source location rather than by the rule's name. The rule names of a
//! derivation are what `--explain` wants, and the appliers see them directly.

use super::{KAnalysis, KGraph, Kl};
use egg::{Applier, ENodeOrVar, Id, Language, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol};
use std::collections::HashMap;
use std::sync::Arc;

/// How a rule-made e-node came about.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Made {
    /// The rules of its derivation, in the order they applied, each once; the last made it.
    pub rules: Vec<&'static str>,
    /// The class whose match the last rule rewrote.
    pub at: Id,
}

/// The derivation of every e-node a rule added (see the module documentation).
#[derive(Debug, Default)]
pub struct Provenance {
    made: HashMap<Kl, Made>,
}

impl Provenance {
    /// How `node` (as a class of the e-graph holds it) was made; `None` for a node of the input
    /// graph.
    pub fn of(&self, node: &Kl) -> Option<&Made> {
        self.made.get(node)
    }

    /// Brings every key to the e-graph's current canonical form. Two keys that become one e-node
    /// keep the shorter derivation (then the first in order), so the result does not depend on
    /// the table's iteration order.
    pub fn canonicalize(egraph: &mut KGraph) {
        let made = std::mem::take(&mut egraph.analysis.provenance.made);
        let mut canonical: HashMap<Kl, Made> = HashMap::with_capacity(made.len());
        for (node, m) in made {
            let node = node.map_children(|c| egraph.find(c));
            let m = Made { at: egraph.find(m.at), ..m };
            match canonical.get_mut(&node) {
                Some(old) if (old.rules.len(), &*old) <= (m.rules.len(), &m) => {}
                Some(old) => *old = m,
                None => {
                    canonical.insert(node, m);
                }
            }
        }
        egraph.analysis.provenance.made = canonical;
    }
}

/// `rule`, recording what it makes (see the module documentation). The error is egg's check that
/// the right-hand side binds no variable the left-hand side lacks, which `rule` passed already.
pub fn record(rule: &Rewrite<Kl, KAnalysis>) -> Result<Rewrite<Kl, KAnalysis>, String> {
    Rewrite::new(rule.name, Shared(rule.searcher.clone()), Recorded { inner: rule.applier.clone() })
}

/// A rule's own searcher, shared with the rule (every method delegated, so a pattern keeps its
/// indexed search).
struct Shared(Arc<dyn Searcher<Kl, KAnalysis> + Sync + Send>);

impl Searcher<Kl, KAnalysis> for Shared {
    fn search_eclass(&self, egraph: &KGraph, eclass: Id) -> Option<SearchMatches<'_, Kl>> {
        self.0.search_eclass(egraph, eclass)
    }

    fn search_eclass_with_limit(&self, egraph: &KGraph, eclass: Id, limit: usize) -> Option<SearchMatches<'_, Kl>> {
        self.0.search_eclass_with_limit(egraph, eclass, limit)
    }

    fn search(&self, egraph: &KGraph) -> Vec<SearchMatches<'_, Kl>> {
        self.0.search(egraph)
    }

    fn search_with_limit(&self, egraph: &KGraph, limit: usize) -> Vec<SearchMatches<'_, Kl>> {
        self.0.search_with_limit(egraph, limit)
    }

    fn n_matches(&self, egraph: &KGraph) -> usize {
        self.0.n_matches(egraph)
    }

    fn get_pattern_ast(&self) -> Option<&PatternAst<Kl>> {
        self.0.get_pattern_ast()
    }

    fn vars(&self) -> Vec<egg::Var> {
        self.0.vars()
    }
}

/// A rule's applier, recording the derivation of every e-node it adds.
struct Recorded {
    inner: Arc<dyn Applier<Kl, KAnalysis> + Sync + Send>,
}

impl Recorded {
    fn apply_recording(
        &self,
        egraph: &mut KGraph,
        eclass: Id,
        subst: &Subst,
        lhs: Option<&PatternAst<Kl>>,
        rule: Symbol,
    ) -> Vec<Id> {
        // The derivations the match read: of every matched e-node, and of those below its root.
        let (mut all, mut below) = (Vec::new(), Vec::new());
        if let Some(ast) = lhs {
            let mut nodes = Vec::new();
            if matched(egraph, ast, root_of(ast), eclass, subst, &mut nodes) {
                let root = nodes.pop();
                for node in &nodes {
                    if let Some(m) = egraph.analysis.provenance.of(node) {
                        extend(&mut below, &m.rules);
                    }
                }
                all.clone_from(&below);
                if let Some(m) = root.as_ref().and_then(|r| egraph.analysis.provenance.of(r)) {
                    extend(&mut all, &m.rules);
                }
            }
        }
        let name = rule.as_str();
        extend(&mut all, &[name]);
        extend(&mut below, &[name]);

        let first = egraph.nodes().len();
        // One match at a time through the inner applier's own `apply_matches` (a pattern unions
        // in its own order there, which decides the classes' ids and so extraction's ties), with
        // no left-hand side, as egg's runner passes none without explanations.
        let one = SearchMatches { eclass, substs: vec![subst.clone()], ast: None };
        let changed = self.inner.apply_matches(egraph, &[one], rule);
        let root = egraph.find(eclass);
        for i in first..egraph.nodes().len() {
            let id = Id::from(i);
            let node = egraph.id_to_node(id).clone().map_children(|c| egraph.find(c));
            if matches!(node, Kl::Attr(_) | Kl::None) {
                continue;
            }
            let rules = if egraph.find(id) == root { all.clone() } else { below.clone() };
            egraph.analysis.provenance.made.entry(node).or_insert(Made { rules, at: root });
        }
        changed
    }
}

impl Applier<Kl, KAnalysis> for Recorded {
    fn apply_matches(&self, egraph: &mut KGraph, matches: &[SearchMatches<Kl>], rule: Symbol) -> Vec<Id> {
        // The first application after a rebuild sees classes whose nodes were re-canonicalized.
        if egraph.clean {
            Provenance::canonicalize(egraph);
        }
        let mut changed = Vec::new();
        for m in matches {
            let lhs = m.ast.as_deref();
            for subst in &m.substs {
                changed.extend(self.apply_recording(egraph, m.eclass, subst, lhs, rule));
            }
        }
        changed
    }

    fn apply_one(
        &self,
        egraph: &mut KGraph,
        eclass: Id,
        subst: &Subst,
        searcher_ast: Option<&PatternAst<Kl>>,
        rule: Symbol,
    ) -> Vec<Id> {
        self.apply_recording(egraph, eclass, subst, searcher_ast, rule)
    }

    fn get_pattern_ast(&self) -> Option<&PatternAst<Kl>> {
        self.inner.get_pattern_ast()
    }

    fn vars(&self) -> Vec<egg::Var> {
        self.inner.vars()
    }
}

/// Appends the rules of `more` not yet in `rules`.
fn extend(rules: &mut Vec<&'static str>, more: &[&'static str]) {
    for r in more {
        if !rules.contains(r) {
            rules.push(r);
        }
    }
}

/// The root of a pattern: its last node.
fn root_of(ast: &PatternAst<Kl>) -> Id {
    Id::from(ast.as_ref().len().saturating_sub(1))
}

/// Finds the e-nodes of `class` matching the pattern node `at` under `subst`, children first (so
/// the matched root comes last); false, with `out` as it was, when there are none.
fn matched(egraph: &KGraph, ast: &PatternAst<Kl>, at: Id, class: Id, subst: &Subst, out: &mut Vec<Kl>) -> bool {
    match ast.as_ref().get(usize::from(at)) {
        None => false,
        Some(ENodeOrVar::Var(v)) => subst.get(*v).is_some_and(|&id| egraph.find(id) == egraph.find(class)),
        Some(ENodeOrVar::ENode(p)) => {
            for node in &egraph[class].nodes {
                if !node.matches(p) {
                    continue;
                }
                let mark = out.len();
                let children = node.children().iter().zip(p.children());
                if children.into_iter().all(|(&c, &pc)| matched(egraph, ast, pc, c, subst, out)) {
                    out.push(node.clone());
                    return true;
                }
                out.truncate(mark);
            }
            false
        }
    }
}
