//! The provenance of fused ops: [`explain`] reads, off a fused op's attributes, the rules that
//! produced it.

#![expect(
    clippy::indexing_slicing,
    reason = "`explain` indexes nodes and operands of a graph that `Graph::check` accepted"
)]

use crate::graph::{Graph, Op, ScoreMods};
use petgraph::graph::NodeIndex;

/// The rules that produce a fused op, read off its attributes (a provenance record: each fused form
/// has one derivation in the current rule set). Empty for ops that are not fused.
pub fn explain(g: &Graph, n: NodeIndex) -> Vec<&'static str> {
    let node = &g.g[n];
    match &node.op {
        Op::Linear { act, bias, residual, norm, glu, rope } => {
            let mut r = vec!["matmul-to-linear"];
            if *bias {
                r.push("linear-bias");
            }
            if *glu {
                r.push("shared-input-merge");
                r.push(if *bias { "gated-linear-bias" } else { "gated-linear" });
            } else if act.is_some() {
                r.push("linear-act");
            }
            if rope.is_some() {
                r.push("shared-input-merge");
                r.push(if *bias { "attention-packed-rope-bias" } else { "attention-packed-rope" });
            }
            if *residual {
                r.push("linear-residual");
            }
            match norm {
                Some(p) if p.rms => r.push("norm-prologue-rms"),
                Some(_) => r.push("norm-prologue-ln"),
                None => {}
            }
            r
        }
        Op::PackedAttention { alibi, causal, window, mods, .. } => {
            let masked = *causal || window.is_some() || g.operands(n).len() > 1 + usize::from(mods.relative.is_some());
            let rope = matches!(g.g[g.operands(n)[0]].op, Op::Linear { rope: Some(_), .. });
            vec![
                softmax_rule(masked, *alibi, mods),
                "attention",
                "shared-input-merge",
                if rope { "attention-packed-rope" } else { "attention-packed" },
            ]
        }
        Op::AddNorm { rms, after: false, .. } => vec![if *rms { "add-norm-rms" } else { "add-norm-ln" }],
        Op::AddNorm { rms, after: true, .. } => vec![if *rms { "norm-add-rms" } else { "norm-add-ln" }],
        Op::MaskedSoftmax { alibi, causal, window, mods, .. } => {
            let masked = *causal || window.is_some() || g.operands(n).len() > 1 + usize::from(mods.relative.is_some());
            vec![softmax_rule(masked, *alibi, mods)]
        }
        Op::Attention { alibi, causal, window, mods, .. } => {
            let operands = g.operands(n);
            let masked = *causal || window.is_some() || operands.len() > 3 + usize::from(mods.relative.is_some());
            let gqa = g.g[operands[1]].shape.get(1) != g.g[operands[0]].shape.get(1);
            vec![softmax_rule(masked, *alibi, mods), if gqa { "attention-gqa" } else { "attention" }]
        }
        Op::Concat { axis: 0 } => vec!["shared-input-merge"],
        Op::LowRank { start, heads, head_dim } => {
            let whole = g.g[g.operands(n)[0]].shape.last() == Some(&crate::graph::Dim::Fixed(heads * head_dim));
            if *start == 0 && whole { vec!["low-rank"] } else { vec!["shared-input-merge", "low-rank-slice"] }
        }
        Op::Heads { norm, rope, .. } => {
            let mut r = vec!["heads-split"];
            if norm.is_some() {
                r.push("heads-norm");
            }
            if rope.is_some() {
                r.push("heads-rope");
            }
            if g.operands(n).len() == 2 + usize::from(norm.is_some()) {
                r.push("heads-append");
            }
            r
        }
        _ => vec![],
    }
}

fn softmax_rule(masked: bool, alibi: bool, mods: &ScoreMods) -> &'static str {
    if mods.sparse.is_some() {
        return if masked { "sparse-softmax" } else { "sparse-softmax-unmasked" };
    }
    if mods.softcap.is_some() {
        return if masked { "masked-softmax-softcap" } else { "scaled-softmax-softcap" };
    }
    if mods.relative.is_some() {
        return if masked { "masked-softmax-relative" } else { "scaled-softmax-relative" };
    }
    match (masked, alibi) {
        (true, false) => "masked-softmax",
        (true, true) => "masked-softmax-alibi",
        (false, false) => "scaled-softmax",
        (false, true) => "scaled-softmax-alibi",
    }
}
