//! What extraction minimises: the [`CostModel`] (a per-dispatch overhead, bytes moved and FLOPs, at
//! batch 1 and a reference sequence length, with constants measured for lavapipe and for the CPU
//! back end; the wgpu back end's are its `CostModel::default`), the [`Work`] of one op that it prices, and `Cost`, egg's cost function, which charges
//! a value read by several ops to none of them.

#![expect(
    clippy::indexing_slicing,
    reason = "the cost model indexes operands of ops that `graph::infer` typed, and the e-graph's own \
              classes"
)]

use super::analysis::{enode_konst, enode_shape};
use super::{KGraph, Kl, to_op};
use crate::graph::{Dim, Op, PackedAttention, Shape, Sym};
use egg::{Id, Language};
use std::collections::{HashMap, HashSet};

/// [`CostModel::cpu`]'s dispatch constant (one step, in bytes moved).
const CPU_DISPATCH: f64 = 10000.0;
/// [`CostModel::cpu`]'s FLOP constant (in bytes moved).
const CPU_FLOP: f64 = 0.15;

/// Query rows per tile of the CPU's attention backward ([`Op::AttentionGrad`]).
const ATTENTION_GRAD_TILE_ROWS: f64 = 64.0;
/// The fixed work of one tile of the CPU's attention backward, as the FLOPs that take as long:
/// a tile of 64 query rows against 64 keys of width 32 took 18 us (nanoGPT's step, `kiln bench
/// train --profile`), of which its 1.3 MFLOP at 200 GFLOPS are 6.5 us; the other 11 us (its five
/// `gemm` calls' set-up and packing, its rows' softmax) are 2.2 MFLOP at that rate. With it the
/// backward is chosen where it measured faster: from 128 tokens at width 32 (1.0x at 128, 1.25x
/// at 256, 1.9x at 1024; 0.9x at 64).
const ATTENTION_GRAD_TILE_FLOPS: f64 = 2.2e6;

/// The cost model: estimated time of one forward pass at batch 1, sequence [`CostModel::seq`].
#[derive(Clone, Debug)]
pub struct CostModel {
    /// Sequence length the costs are estimated at.
    pub seq: usize,
    /// Cost of one dispatch (kernel launch, barrier), in the unit of one byte moved.
    pub dispatch: f64,
    /// Cost of one floating-point operation, in the unit of one byte moved.
    pub flop: f64,
    /// How many times its FLOPs cost in a projection the back end runs in a scalar form rather
    /// than a vector one (the WGSL back end's `vec4` forms need `k` a multiple of 4 and a RoPE
    /// epilogue's pairs in whole `vec4`s). 1 for the CPU, whose kernels have no such forms.
    pub scalar_projection: f64,
    /// The back end's fact of which projections run in the vector form: whether projection `op`
    /// (an [`Op::Linear`]) from `k` inputs to `n` outputs does. The CPU's are all vector.
    pub vector_projection: fn(op: &Op, k: usize, n: usize) -> bool,
}

impl CostModel {
    /// Constants measured on the native CPU back end (2 cores of an x86 VM with AVX-512, 2
    /// threads) with `kiln bench calibrate --backend cpu`: one step 0.2-0.4 us, one byte moved
    /// 0.035 ns, one projection FLOP 0.005 ns (about 200 GFLOPS), i.e. a step costs as much as
    /// moving about 10 000 bytes (7 300-13 500 over three runs) and a FLOP 0.15 bytes (0.13-0.21):
    /// arithmetic is seven times cheaper, relative to memory, than on lavapipe. See BENCHMARKS.md.
    pub fn cpu() -> Self {
        CostModel {
            seq: 128,
            dispatch: CPU_DISPATCH,
            flop: CPU_FLOP,
            scalar_projection: 1.0,
            vector_projection: |_, _, _| true,
        }
    }

    fn elements(&self, shape: &Shape) -> f64 {
        shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(k) => *k as f64,
                Dim::Sym(Sym::Batch) => 1.0,
                Dim::Sym(_) => self.seq as f64,
            })
            .product()
    }

    /// Cost of computing `op` from operands of the given types into `out`, excluding operands.
    pub fn node_cost(&self, op: &Op, operands: &[&Shape], out: &Shape) -> f64 {
        match op {
            Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. } | Op::After => 0.0,
            _ => {
                let w = self.work(op, operands, out);
                self.dispatch + w.bytes_in + w.bytes_out + self.flop * w.flops
            }
        }
    }

    /// What computing `op` from operands of the given types into `out` moves and computes, at
    /// batch 1 and sequence [`CostModel::seq`]: the estimate [`CostModel::node_cost`] prices.
    pub fn work(&self, op: &Op, operands: &[&Shape], out: &Shape) -> Work {
        let bytes_out = 4.0 * self.elements(out);
        let bytes_in: f64 = match op {
            // Reads only its heads' columns (and the cache), as many as it writes.
            Op::Heads { .. } => bytes_out,
            // Reads its heads' columns of `x`, and the first `n` rows of `e`.
            Op::LowRank { heads, head_dim, .. } => {
                let n = operands.first().and_then(|x| x.get(1)).map_or(1.0, |n| self.elements(&vec![*n]));
                let r = operands.get(1).and_then(|e| e.get(1)).map_or(1.0, |r| self.elements(&vec![*r]));
                4.0 * n * ((heads * head_dim) as f64 + r)
            }
            _ => operands.iter().map(|s| 4.0 * self.elements(s)).sum(),
        };
        let last = |s: &Shape| s.last().map(|d| self.elements(&vec![*d])).unwrap_or(1.0);
        let flops = match op {
            Op::MatMul { .. } => 2.0 * self.elements(out) * operands.first().map_or(1.0, |s| last(s)),
            // The product, and the derivative at each of its outputs.
            Op::MatMulActGrad { .. } => self.elements(out) * (2.0 * operands.first().map_or(1.0, |s| last(s)) + 1.0),
            Op::Linear { norm, glu, .. } => {
                let k = operands.first().map_or(1.0, |s| last(s));
                let rows = self.elements(out) / last(out).max(1.0);
                let n = last(out);
                let m = if *glu { 2.0 * n } else { n };
                let vector = (self.vector_projection)(op, k as usize, n as usize);
                let mut f = 2.0 * rows * m * k * if vector { 1.0 } else { self.scalar_projection };
                match norm {
                    // One pass: the sum of squares accumulates beside the dot products from the
                    // values already loaded, and scales the sums after (the WGSL projection's
                    // `rms_load`; the CPU's normalises each row once): the statistics' own
                    // arithmetic, as the separate norm does it, and no second read of the row.
                    // `kiln bench kernels` measures it at least as fast as the norm's own
                    // kernel and the projection on lavapipe (at 1, 16 and 128 rows).
                    Some(p) if p.rms => f += 2.0 * rows * k,
                    // Two passes over its rows' inputs for the mean and variance, in every
                    // invocation that shares the rows.
                    Some(_) => f += rows * n * k * 4.0,
                    None => {}
                }
                f
            }
            Op::PackedAttention(PackedAttention { heads, head_dim, cached, appends, .. }) => {
                let tokens = self.elements(out) / last(out).max(1.0);
                // Keys: the packed rows', or a cache's (`[b, kv, t, d]`), which this step's rows
                // follow when it appends to it.
                let rows = |shape: Option<&Shape>, axis: usize| {
                    shape.and_then(|x| x.get(axis)).map_or(1.0, |t| self.elements(&vec![*t]))
                };
                let keys = match *cached {
                    true if *appends => rows(operands.get(1).copied(), 2) + rows(operands.first().copied(), 1),
                    true => rows(operands.get(1).copied(), 2),
                    false => self.seq as f64,
                };
                4.0 * tokens * (*heads * *head_dim) as f64 * keys
            }
            // Every output sums over the sequence (the rows of `x`).
            Op::LowRank { .. } => {
                2.0 * self.elements(out)
                    * operands.first().and_then(|x| x.get(1)).map_or(1.0, |n| self.elements(&vec![*n]))
            }
            // A copy, plus a rotation's angle, sine, cosine and two products per element, and a
            // norm's square and scale.
            Op::Heads { norm, rope, .. } => {
                self.elements(out)
                    * (1.0 + if rope.is_some() { 4.0 } else { 0.0 } + if norm.is_some() { 2.0 } else { 0.0 })
            }
            // A product per row and output element: every row of `a` ([.., r, k]).
            Op::ContractRows => {
                2.0 * self.elements(out) * operands.first().map_or(1.0, |a| self.elements(a) / last(a).max(1.0))
            }
            Op::Attention { .. } => {
                let (q, k) = (operands[0], operands[1]);
                4.0 * self.elements(q) * self.elements(&vec![k[2]])
            }
            // Five products per pair of query and key (the scores, the output's gradient against
            // the values, and the three gradients), and each tile's fixed work. The WGSL kernel
            // runs them as scalar loops, each lane a row's dot products (and recomputes the
            // scores and `dp` in each of its dispatches), so its products are priced as a scalar
            // projection's ([`CostModel::scalar_projection`], 1 on the CPU): measured per
            // adapter; on lavapipe (7) the unfused backward, whose products are tiled, stays the
            // cheaper at the cost model's sequence, and an H100's (1.4) takes the fused one.
            Op::AttentionGrad { .. } => {
                let (q, k) = (operands[0], operands[1]);
                let tiles = (self.elements(q) / last(q).max(1.0) / ATTENTION_GRAD_TILE_ROWS).ceil();
                10.0 * self.elements(q) * self.elements(&vec![k[2]]) * self.scalar_projection
                    + tiles * ATTENTION_GRAD_TILE_FLOPS
            }
            _ => self.elements(out),
        };
        Work { bytes_in, bytes_out, flops }
    }
}

/// The estimated work of one op ([`CostModel::work`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Bytes read from the operands.
    pub bytes_in: f64,
    /// Bytes written.
    pub bytes_out: f64,
    /// Floating-point operations.
    pub flops: f64,
}

/// Extraction cost: the cost of an e-node plus that of its operands, except operands that are
/// *shared* (read by several ops of the input graph: a residual stream, a norm feeding Q, K and
/// V). A shared value is computed once whichever consumers are chosen, so it is charged to none
/// of them; charging it to each (plain tree cost) would make any rewrite that reads it fewer
/// times look cheaper by the whole cost of everything before it.
pub(super) struct Cost<'a> {
    pub(super) egraph: &'a KGraph,
    pub(super) model: &'a CostModel,
    pub(super) shared: HashSet<Id>,
    /// Classes charged in shares: a consumer pays the cost over this many (a merged projection
    /// before any extraction has shown it shared).
    pub(super) split: HashMap<Id, f64>,
}

impl egg::CostFunction<Kl> for Cost<'_> {
    type Cost = f64;
    fn cost<C: FnMut(Id) -> f64>(&mut self, enode: &Kl, mut costs: C) -> f64 {
        let children: f64 = enode
            .children()
            .iter()
            .map(|&c| {
                let cost = costs(c);
                let c = self.egraph.find(c);
                match self.split.get(&c) {
                    _ if cost.is_finite() && self.shared.contains(&c) => 0.0,
                    Some(k) => cost / k,
                    None => cost,
                }
            })
            .sum();
        let Some((op, operands)) = to_op(self.egraph, enode) else { return children };
        if enode_konst(self.egraph, enode) {
            return children;
        }
        let shapes: Vec<&Shape> =
            operands.iter().filter_map(|&o| self.egraph[o].data.as_ref().map(|d| &d.shape)).collect();
        let out = enode_shape(self.egraph, enode);
        match out {
            Some(out) => children + self.model.node_cost(&op, &shapes, &out),
            None => f64::INFINITY,
        }
    }
}
