//! What the optimizer knows about the back end it compiles for: a [`Target`] is the cost model
//! extraction uses and the limits of the fused forms the back end's kernels take. Rules and
//! extraction read these facts from the target they are given, never from a back end's module, so
//! a fusion that pays on a GPU and not on a CPU is not forced on the CPU, and a kernel limit of one
//! back end does not constrain another.
//!
//! Each back end states its own facts: the wgpu back end's are `back::wgsl::target`
//! (`Target::wgpu`, also the default target, and the lavapipe `CostModel::default`); the CPU's
//! need no kernel limits, so [`Target::cpu`] is stated here.

use crate::optimize::CostModel;

/// A back end's facts, as the optimizer uses them.
#[derive(Clone, Debug)]
pub struct Target {
    /// The back end's name (`wgpu`, `cpu`).
    pub name: &'static str,
    /// The cost model extraction minimises.
    pub cost: CostModel,
    /// The widest attention head the back end's fused attention takes.
    pub max_attention_head_dim: usize,
    /// Whether the back end's attention backward ([`crate::graph::Op::AttentionGrad`]) keeps the
    /// query rows' statistics (the CPU's per tile, the WGSL kernel's in a first dispatch), so its
    /// work is a few products per pair of query and key; where it does not, the rule that makes
    /// it does not fire.
    pub attention_grad: bool,
}

impl Target {
    /// The native CPU back end, with its measured cost model ([`CostModel::cpu`]); its fused
    /// attention keeps one score row per query head of a group on the heap, so any head width fits.
    pub fn cpu() -> Target {
        Target { name: "cpu", cost: CostModel::cpu(), max_attention_head_dim: usize::MAX, attention_grad: true }
    }

    /// The target of a back end by name (`wgpu` or `cpu`).
    pub fn named(name: &str) -> Option<Target> {
        match name {
            "wgpu" => Some(Target::wgpu()),
            "cpu" => Some(Target::cpu()),
            _ => None,
        }
    }
}
