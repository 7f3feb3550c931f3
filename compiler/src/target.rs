//! What the optimizer knows about the back end it compiles for: a [`Target`] is the cost model
//! extraction uses and the limits of the fused forms the back end's kernels take. Rules and
//! extraction read these facts from the target they are given, never from a back end's module, so
//! a fusion that pays on a GPU and not on a CPU is not forced on the CPU, and a kernel limit of one
//! back end does not constrain another.

use crate::optimize::CostModel;

/// The largest head width wgpu's fused attention kernel handles: each invocation accumulates its
/// output rows in a private array of this many floats per query slot
/// ([`crate::back::wgsl::attention`]). The optimizer fuses attention for wgpu only up to it.
pub const WGPU_MAX_ATTENTION_HEAD_DIM: usize = 256;

/// A back end's facts, as the optimizer uses them.
#[derive(Clone, Debug)]
pub struct Target {
    /// The back end's name (`wgpu`, `cpu`).
    pub name: &'static str,
    /// The cost model extraction minimises.
    pub cost: CostModel,
    /// The widest attention head the back end's fused attention takes.
    pub max_attention_head_dim: usize,
}

impl Target {
    /// wgpu, with the cost model measured on lavapipe ([`CostModel::default`]).
    pub fn wgpu() -> Target {
        Target { name: "wgpu", cost: CostModel::default(), max_attention_head_dim: WGPU_MAX_ATTENTION_HEAD_DIM }
    }

    /// The native CPU back end, with its measured cost model ([`CostModel::cpu`]); its fused
    /// attention keeps one score row per query head of a group on the heap, so any head width fits.
    pub fn cpu() -> Target {
        Target { name: "cpu", cost: CostModel::cpu(), max_attention_head_dim: usize::MAX }
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

impl Default for Target {
    fn default() -> Target {
        Target::wgpu()
    }
}
