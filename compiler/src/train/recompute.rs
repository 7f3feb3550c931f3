//! Which blocks a training step recomputes (activation checkpointing), as the recipe asks:
//! none, all, a number of them, or the fewest that bring the step's memory within a budget.
//!
//! Recomputing a block frees the activations its backward would read (they die once the
//! forward has passed the block) for the price of running its forward a second time when the
//! backward reaches it ([`crate::autodiff::gradients_recomputing`]). The blocks are ranked by
//! that price per byte freed — the cost model's estimate of the block's forward ([`CostModel`],
//! the CPU's constants) over the bytes its values hold — so a count or a budget takes the
//! cheapest first; identical blocks rank in block order. A budget is met by the fewest blocks
//! whose step fits: the memory is [`step_memory`]'s count of each candidate step graph, found by
//! bisection on the count (more blocks recomputed never hold more).

use super::recipe::{Recipe, Recompute};
use super::sources::TensorUse;
use super::{LOSS, StepMemory, TrainGraphError, step_memory};
use crate::autodiff::{Block, blocks, gradients_recomputing};
use crate::graph::print::block_of;
use crate::graph::{Graph, Op, Sym};
use crate::memory::human;
use crate::optimize::CostModel;
use std::collections::{BTreeSet, HashMap};

/// A training step's graph with the blocks it recomputes.
#[derive(Clone, Debug)]
pub struct StepGraph {
    /// The loss and the gradients (see [`super::training_graph`]).
    pub graph: Graph,
    /// The blocks whose activations the backward recomputes.
    pub recomputed: BTreeSet<Block>,
    /// The blocks of the model (recomputed or not).
    pub blocks: usize,
}

/// The step of `eval` (a loss graph on its checkpoint's tensors, read as `uses` say) with the
/// gradients of every tensor not in `frozen`, recomputing the blocks `recipe` asks for: its
/// `recompute`, or the fewest under its `memory_budget` at its `batch` and `seq`.
pub fn step_graph(
    eval: &Graph,
    uses: &[TensorUse],
    frozen: &[String],
    recipe: &Recipe,
) -> Result<StepGraph, TrainGraphError> {
    let wants = |t: &str| !frozen.iter().any(|f| f == t);
    let all = blocks(eval);
    let build = |chosen: BTreeSet<Block>| -> Result<StepGraph, TrainGraphError> {
        let graph = gradients_recomputing(eval, LOSS, wants, &chosen)?;
        Ok(StepGraph { graph, recomputed: chosen, blocks: all.len() })
    };
    let ranked = |seq: usize| -> Vec<Block> { ranked(eval, seq) };
    let first = |ranked: &[Block], n: usize| -> BTreeSet<Block> { ranked.iter().take(n).cloned().collect() };
    match (recipe.recompute, recipe.memory_budget) {
        (Recompute::None, None) => build(BTreeSet::new()),
        (Recompute::All, _) => build(all.clone()),
        (Recompute::Blocks(n), _) if n > all.len() => {
            Err(TrainGraphError::Recompute(format!("`recompute` = {n}, but the model has {} blocks", all.len())))
        }
        (Recompute::Blocks(n), _) => build(first(&ranked(recipe.seq.unwrap_or(128)), n)),
        (Recompute::None, Some(budget)) => {
            let seq = recipe.seq.ok_or_else(|| {
                TrainGraphError::Recompute("`memory_budget` needs the sequence length (`seq`) the step runs at".into())
            })?;
            let ranked = ranked(seq);
            let memory = |g: &Graph| memory_of(g, uses, frozen, recipe, seq);
            let fits = |g: &Graph| memory(g).total() <= budget;
            let none = build(BTreeSet::new())?;
            if fits(&none.graph) {
                return Ok(none);
            }
            let every = build(first(&ranked, ranked.len()))?;
            if !fits(&every.graph) {
                let m = memory(&every.graph);
                return Err(TrainGraphError::Recompute(format!(
                    "`memory_budget` = {} is less than the step needs with every block recomputed: {} \
                     (weights {}, gradients {}, optimizer state {}, activations {}, at batch {} and seq {seq})",
                    human(budget),
                    human(m.total()),
                    human(m.weights),
                    human(m.gradients),
                    human(m.optimizer),
                    human(m.activations),
                    recipe.batch,
                )));
            }
            // The fewest: `lo` blocks do not fit, `hi` do.
            let (mut lo, mut hi, mut best) = (0, ranked.len(), every);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                let step = build(first(&ranked, mid))?;
                if fits(&step.graph) {
                    (hi, best) = (mid, step);
                } else {
                    lo = mid;
                }
            }
            Ok(best)
        }
    }
}

/// The memory of a step of `step` (a training graph of the tensors `uses` reads, those not in
/// `frozen` trained) at the recipe's batch and `seq`: [`step_memory`] with the tensors counted
/// once each and the recipe's optimizer's state.
pub fn memory_of(step: &Graph, uses: &[TensorUse], frozen: &[String], recipe: &Recipe, seq: usize) -> StepMemory {
    let mut seen = std::collections::HashSet::new();
    let (mut weights, mut trained) = (0u64, 0u64);
    for u in uses {
        // Each tensor once (a tied or packed one is read by several parameters).
        if seen.insert(u.tensor.as_str()) {
            let n: u64 = u.shape.iter().map(|&d| d as u64).product();
            weights += n;
            if !frozen.contains(&u.tensor) {
                trained += n;
            }
        }
    }
    step_memory(step, recipe.batch, seq, weights, trained, recipe.moments())
}

/// The blocks of `eval`, cheapest to recompute per byte freed first (ties in block order): the
/// cost model's estimate of each block's forward at `seq` over the bytes of its values.
pub fn ranked(eval: &Graph, seq: usize) -> Vec<Block> {
    let model = CostModel { seq, ..CostModel::cpu() };
    let syms: HashMap<Sym, usize> =
        [(Sym::Batch, 1), (Sym::Seq, seq), (Sym::SrcSeq, seq), (Sym::Past, 0), (Sym::Ctx, seq)].into();
    let mut price: HashMap<Block, (f64, f64)> = HashMap::new();
    for n in eval.g.node_indices() {
        let node = &eval.g[n];
        let Some((stack, i, _)) = block_of(&node.scope) else { continue };
        let operands = eval.operands(n);
        if operands.is_empty() || matches!(node.op, Op::Reshape { .. } | Op::After) {
            continue;
        }
        let shapes: Vec<_> = operands.iter().map(|&o| &eval.g[o].shape).collect();
        let bytes: usize = crate::graph::resolve(&node.shape, &syms).iter().product::<usize>() * 4;
        let entry = price.entry((stack.to_string(), i)).or_default();
        entry.0 += model.node_cost(&node.op, &shapes, &node.shape);
        entry.1 += bytes as f64;
    }
    let mut out: Vec<(Block, f64)> = blocks(eval)
        .into_iter()
        .map(|b| {
            let (cost, bytes) = price.get(&b).copied().unwrap_or_default();
            let per_byte = cost / bytes.max(1.0);
            (b, per_byte)
        })
        .collect();
    // Stable: equal prices keep the model's order.
    out.sort_by(|a, b| a.1.total_cmp(&b.1));
    out.into_iter().map(|(b, _)| b).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::PackDims;
    use crate::train::{Objective, RecipeFile, loss_graph, on_tensors};

    /// A 4-block decoder's loss graph on its tensors, and where each parameter is read from.
    fn model() -> (Graph, Vec<TensorUse>) {
        let source = "[model]\nname = \"t\"\nkind = \"decoder\"\nvocab = 50\nd_model = 32\nlayers = 4\n\
                      max_positions = 32\n[attention]\nheads = 4\n[ffn]\nactivation = \"gelu\"\n";
        let fe = crate::front_end("t.toml", source).unwrap();
        let loss = loss_graph(&fe.graph, Objective { label_smoothing: 0.0 }).unwrap();
        on_tensors(&loss, &fe.spec.weights, &PackDims::of(&fe.spec)).unwrap()
    }

    fn recipe(text: &str) -> Recipe {
        let file: RecipeFile = toml::from_str(&format!("steps = 1\nbatch = 4\nseq = 32\n{text}")).unwrap();
        file.resolve().unwrap()
    }

    #[test]
    fn a_count_or_all_recomputes_that_many_blocks() {
        let (eval, uses) = model();
        let step = |text: &str| step_graph(&eval, &uses, &[], &recipe(text));
        assert_eq!(step("").unwrap().recomputed.len(), 0);
        assert_eq!(step("recompute = \"all\"").unwrap().recomputed.len(), 4);
        let two = step("recompute = 2").unwrap();
        assert_eq!((two.recomputed.len(), two.blocks), (2, 4));
        // Identical blocks rank in order: the first two.
        assert_eq!(two.recomputed.iter().map(|b| b.1).collect::<Vec<_>>(), [0, 1]);
        let message = step("recompute = 5").unwrap_err().to_string();
        assert_eq!(message, "recipe: `recompute` = 5, but the model has 4 blocks");
    }

    /// A budget gets the fewest blocks whose step fits: one block fewer does not.
    #[test]
    fn a_budget_recomputes_the_fewest_blocks_that_fit() {
        let (eval, uses) = model();
        let r = recipe("");
        let memory = |text: &str| {
            let s = step_graph(&eval, &uses, &[], &recipe(text)).unwrap();
            memory_of(&s.graph, &uses, &[], &r, 32).total()
        };
        let (none, all) = (memory(""), memory("recompute = \"all\""));
        assert!(all < none, "recomputing every block holds {all} bytes, none {none}");
        for budget in [none, none - 1, (none + all) / 2, all] {
            let s = step_graph(&eval, &uses, &[], &recipe(&format!("memory_budget = {budget}"))).unwrap();
            let n = s.recomputed.len();
            assert!(memory(&format!("recompute = {n}")) <= budget, "{n} blocks at budget {budget}");
            if n > 0 {
                assert!(memory(&format!("recompute = {}", n - 1)) > budget, "{n} blocks at budget {budget}");
            }
            assert_eq!(n == 0, budget >= none, "budget {budget}");
        }
        let message = step_graph(&eval, &uses, &[], &recipe(&format!("memory_budget = {}", all - 1))).unwrap_err();
        assert!(message.to_string().contains("is less than the step needs with every block recomputed"), "{message}");
        // Without a sequence length, a budget cannot be met.
        let no_seq = Recipe { seq: None, ..recipe("memory_budget = \"1GiB\"") };
        let message = step_graph(&eval, &uses, &[], &no_seq).unwrap_err().to_string();
        assert!(message.contains("needs the sequence length"), "{message}");
    }
}
