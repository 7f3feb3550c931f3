//! What the wgpu back end tells the optimizer: its [`Target`] — the cost model measured on
//! lavapipe, which projections its kernels run in a scalar form, and the widest head its fused
//! attention takes. The optimizer reads these as data (a [`Target`], a [`CostModel`]) and never
//! this module; wgpu is the target the optimizer compiles for when it is given none.

use super::projection::vector_form;
use crate::optimize::CostModel;
use crate::target::Target;

/// The largest head width the fused attention kernels handle: each invocation accumulates its
/// output rows in a private array of this many floats per query slot ([`super::attention`], and
/// the plain bodies of [`super::emit`]). The optimizer fuses attention for wgpu only up to it
/// ([`Target::max_attention_head_dim`]).
pub const MAX_ATTENTION_HEAD_DIM: usize = 256;

/// [`CostModel::scalar_projection`] on lavapipe: SmolLM2's packed QKV projection with a RoPE
/// epilogue took 7 times as long at 128 rows in the scalar form as in the `vec4` one, and 22 times
/// at 16 (`kiln bench kernels`, on a busy machine; the same at 1 row, where both are GEMVs).
pub const LAVAPIPE_SCALAR_PROJECTION: f64 = 7.0;

impl Default for CostModel {
    /// Constants measured on lavapipe (Mesa llvmpipe, LLVM 15, 256-bit, on 2 CPU cores) with
    /// `kiln bench calibrate`: one dispatch took 32 us, one byte moved by an elementwise kernel
    /// 2.5 ns and one FLOP of a projection 2.7 ns, i.e. a dispatch costs as much as moving about
    /// 13 000 bytes and a FLOP about 1.1 bytes. (On a discrete GPU both ratios are far larger:
    /// rerun the calibration there before trusting choices that trade dispatches for FLOPs.)
    /// Projections run in a scalar form where [`vector_form`] says so.
    fn default() -> Self {
        CostModel {
            seq: 128,
            dispatch: 13000.0,
            flop: 1.1,
            scalar_projection: LAVAPIPE_SCALAR_PROJECTION,
            vector_projection: vector_form,
        }
    }
}

impl Target {
    /// wgpu, with the cost model measured on lavapipe ([`CostModel::default`]).
    pub fn wgpu() -> Target {
        Target {
            name: "wgpu",
            cost: CostModel::default(),
            max_attention_head_dim: MAX_ATTENTION_HEAD_DIM,
            attention_grad: true,
        }
    }
}

impl Default for Target {
    fn default() -> Target {
        Target::wgpu()
    }
}
