//! The optimizer's kernels: a training step's clipping and update on the device, so the
//! parameters, their gradients and the optimizer's state (AdamW's moments, SGD's momentum) never
//! leave it between steps. Two runners dispatch them: the wgpu runtime's plan steps of a whole
//! step's graph ([`crate::train::update`]: [`step_kernel`] names each op's), and its
//! `DeviceOptimizer` (a step of several micro-batches, whose gradients are averaged first). They
//! are not steps' kernels in the usual calling convention (an output, then operands): each
//! binds one chunk of a tensor split over buffers per dispatch (every operand is split at the
//! same element), and the updates write the tensor and its state in place.
//!
//! - [`sum_squares`]: the squares of gradients summed by workgroups of 64, each over
//!   [`SQUARES_PER_WORKGROUP`] consecutive elements, each workgroup's f32 sum written to its
//!   place in a buffer of partial sums (`parts[offset + workgroup]`); [`SUM_PARTS`] adds each
//!   tensor's into its squared norm ([`crate::graph::Op::SquareSums`]).
//! - [`CLIP_SCALE`]: the factor the updates read the gradients with
//!   ([`crate::graph::Op::ClipScale`]), NaN where the loss or the norm is not finite.
//! - [`adamw`]: one element per invocation, exactly the update the host computes
//!   ([`crate::semantics::adamw`], `torch.optim.AdamW` unfused): `g *= scale; p *= decay;
//!   m = lerp(m, g, 1 - b1); v = v * b2 + (1 - b2) * g * g; p += neg_step * m / (sqrt(v) /
//!   bc2_sqrt + eps)`, the interpolation in `torch.lerp`'s form for the weight's magnitude
//!   (`near`). WGSL does not promise the host's rounding of `sqrt` and the division (and may
//!   contract a product and a sum), so an element can differ from the host's by an ulp or two.
//! - [`sgd`]: one element per invocation, the host's SGD (`torch.optim.SGD`, dampening 0, not
//!   Nesterov), with the same caveat on contraction.
//! - [`ACCUMULATE`]: a micro-batch's gradient added to the running mean of the step's
//!   (`mean += weight * (g - mean)`, `weight` its counted positions over all so far), as the
//!   host's `GradAccumulator` adds it; the first micro-batch's is copied.
//!
//! The updates read the clipping factor and the step's constants from storage bindings (the
//! plan's values: [`crate::graph::Op::ClipScale`]'s output and the `optim.step` parameter), so a
//! step's factor never crosses to the host, and take no step where the factor is not finite.
//! Their per-tensor settings are a uniform ([`AdamWSettings`], [`SgdSettings`]) written once.

use crate::graph::Op;
#[cfg(doc)]
use crate::semantics::AdamStep;

/// Elements of a gradient each workgroup of [`sum_squares`] sums.
pub const SQUARES_PER_WORKGROUP: u32 = 4096;

/// Gradient chunks one [`sum_squares`] dispatch sums: four slots' sizes fill the 64 bytes of
/// uniform a bind group binds, and their bindings with the partial sums' stay within WebGPU's
/// least `max_storage_buffers_per_shader_stage` (8).
pub const SQUARES_SLOTS: usize = 4;

/// The sizes of one slot of a [`sum_squares`] dispatch: `n` elements, the first partial sum's
/// index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SquaresSizes {
    /// Elements of the chunk.
    pub n: u32,
    /// Where its workgroups' sums go in the partial sums' buffer.
    pub offset: u32,
}

impl SquaresSizes {
    /// The uniform's words of a dispatch of this slot alone (the others, zeros, empty).
    pub fn words(self) -> [u32; 4] {
        [self.n, self.offset, 0, 0]
    }

    /// Workgroups the slot takes (and partial sums it writes).
    pub fn workgroups(self) -> u32 {
        self.n.div_ceil(SQUARES_PER_WORKGROUP)
    }

    /// The uniform of one dispatch over `slots` (at most [`SQUARES_SLOTS`]; the rest empty):
    /// each slot's elements, partial sums' offset and first workgroup, and the dispatch's
    /// workgroups.
    pub fn uniform(slots: &[SquaresSizes]) -> ([u32; 4 * SQUARES_SLOTS], u32) {
        let (mut words, mut first) = ([0u32; 4 * SQUARES_SLOTS], 0u32);
        for (w, s) in words.chunks_exact_mut(4).zip(slots) {
            w.copy_from_slice(&[s.n, s.offset, first, 0]);
            first += s.workgroups();
        }
        (words, first)
    }
}

/// The WGSL lines that add the 64 invocations' `acc` into `red[0]` (a tree in workgroup memory,
/// `red: array<f32, 64>`), for the kernels below that reduce in one workgroup.
macro_rules! tree_sum {
    () => {
        "    red[lid.x] = acc;
    workgroupBarrier();
    for (var off = 32u; off > 0u; off = off >> 1u) {
        if (lid.x < off) { red[lid.x] = red[lid.x] + red[lid.x + off]; }
        workgroupBarrier();
    }
"
    };
}

/// The WGSL test of a value's finiteness on its bits (so no compiler may assume it away), which
/// the clipping and update kernels share: a factor that is not finite ([`crate::graph::Op::ClipScale`]'s
/// NaN) is a step not taken.
macro_rules! finite {
    () => {
        "fn finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }\n"
    };
}

/// Sums of squares of up to [`SQUARES_SLOTS`] gradient chunks in one dispatch: binding 0 the
/// slots' sizes ([`SquaresSizes::uniform`]), 1 ..= 4 the chunks (an empty slot's bound to any
/// buffer, never read), 5 the partial sums. A workgroup finds its slot from the slots' first
/// workgroups and sums [`SQUARES_PER_WORKGROUP`] consecutive elements of it. One dispatch a
/// chunk, each writing the same buffer of partial sums, ran one after another: on an H100 the
/// 273 of SmolLM2's step took 6.7 ms (BENCHMARKS.md, 2026-11-28).
pub fn sum_squares() -> String {
    let bindings: String = (0..SQUARES_SLOTS)
        .map(|j| format!("@group(0) @binding({}) var<storage, read> g{j}: array<f32>;\n", j + 1))
        .collect();
    let cases: String = (0..SQUARES_SLOTS)
        .map(|j| {
            format!(
                "        case {j}u: {{ for (var i = first + lid.x; i < end; i = i + 64u) {{ let x = g{j}[i]; acc = acc + x * x; }} }}\n"
            )
        })
        .collect();
    format!(
        "// Generated by kiln: gradients' squares summed per workgroup (see `optim`).
struct Slot {{ n: u32, offset: u32, first: u32, unused: u32 }}
struct Sizes {{ s: array<Slot, {SQUARES_SLOTS}> }}
@group(0) @binding(0) var<uniform> sizes: Sizes;
{bindings}@group(0) @binding({parts}) var<storage, read_write> parts: array<f32>;
var<workgroup> red: array<f32, 64>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    let wg = wid.x + wid.y * nwg.x;
    // The last non-empty slot starting at or before this workgroup.
    var j = 0u;
    for (var t = 1u; t < {SQUARES_SLOTS}u; t = t + 1u) {{
        if (sizes.s[t].n > 0u && sizes.s[t].first <= wg) {{ j = t; }}
    }}
    let slot = sizes.s[j];
    let local = wg - slot.first;
    let first = local * {SQUARES_PER_WORKGROUP}u;
    let end = min(first + {SQUARES_PER_WORKGROUP}u, slot.n);
    var acc = 0.0;
    switch j {{
{cases}        default: {{}}
    }}
{tree}    if (lid.x == 0u && first < slot.n) {{ parts[slot.offset + local] = red[0]; }}
}}
",
        parts = SQUARES_SLOTS + 1,
        tree = tree_sum!(),
    )
}

/// [`finite!`] as a `&str`, for the update kernels `format!` builds.
const FINITE: &str = finite!();

/// The settings of one AdamW dispatch: the chunk's elements, whether its tensor takes weight
/// decay, and the optimizer's constants ([`AdamStep`]'s `w1`, `b2`, `w2`, `eps`). The clipping
/// factor and the step's own constants are bound ([`adamw`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWSettings {
    /// Elements of the chunk.
    pub n: u32,
    /// Whether the tensor takes weight decay (reads the step's `decay`).
    pub decays: bool,
    /// `1 - beta1`.
    pub w1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// The denominator's epsilon.
    pub eps: f32,
}

impl AdamWSettings {
    /// [`Op::AdamW`]'s settings for a chunk of `n` elements; `None` for another op.
    pub fn of(op: &Op, n: u32) -> Option<AdamWSettings> {
        match *op {
            Op::AdamW { w1, b2, w2, eps, decays } => {
                Some(AdamWSettings { n, decays, w1: w1.0, b2: b2.0, w2: w2.0, eps: eps.0 })
            }
            _ => None,
        }
    }

    /// The uniform's words (32 bytes).
    pub fn words(self) -> [u32; 8] {
        // `torch.lerp`'s form: from the start for a weight below one half in magnitude.
        let near = u32::from(self.w1.abs() < 0.5);
        let f = f32::to_bits;
        [self.n, near, u32::from(self.decays), f(self.w1), f(self.b2), f(self.w2), f(self.eps), 0]
    }
}

/// The AdamW update of a chunk in place: binding 0 [`AdamWSettings`], 1 the tensor, 2 its
/// gradient, 3 and 4 the first and second moments, 5 the clipping factor (`f32[1]`, NaN: no step
/// taken), 6 the step's constants (`-lr / (1 - beta1^t)`, `sqrt(1 - beta2^t)`, `1 - lr *
/// weight_decay`: [`crate::train::update::step_constants`]). One invocation per element (a grid
/// of `x * y` workgroups of 64, row-major).
pub fn adamw() -> String {
    format!(
        "\
// Generated by kiln: one AdamW step in place (see `optim`).
struct Settings {{ n: u32, near: u32, decays: u32, w1: f32, b2: f32, w2: f32, eps: f32, unused: u32 }}
@group(0) @binding(0) var<uniform> c: Settings;
@group(0) @binding(1) var<storage, read_write> p: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
@group(0) @binding(5) var<storage, read> scale: array<f32>;
@group(0) @binding(6) var<storage, read> step: array<f32>;
{FINITE}@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    let i = gid.x + gid.y * nwg.x * 64u;
    let s = scale[0];
    if (i >= c.n || !finite(s)) {{ return; }}
    let neg_step = step[0];
    let bc2_sqrt = step[1];
    var decay = 1.0;
    if (c.decays == 1u) {{ decay = step[2]; }}
    let gi = g[i] * s;
    let pi = p[i] * decay;
    let mi = m[i];
    var mn = 0.0;
    if (c.near == 1u) {{ mn = mi + c.w1 * (gi - mi); }} else {{ mn = gi - (gi - mi) * (1.0 - c.w1); }}
    let vn = v[i] * c.b2 + c.w2 * gi * gi;
    let denom = sqrt(vn) / bc2_sqrt + c.eps;
    p[i] = pi + neg_step * mn / denom;
    m[i] = mn;
    v[i] = vn;
}}
"
    )
}

/// The settings of one SGD dispatch: the chunk's elements, the momentum (unread without a
/// buffer) and the weight decay added to the gradient (0 where the tensor takes none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdSettings {
    /// Elements of the chunk.
    pub n: u32,
    /// The momentum.
    pub momentum: f32,
    /// `weight_decay`, or 0.
    pub weight_decay: f32,
}

impl SgdSettings {
    /// [`Op::Sgd`]'s settings for a chunk of `n` elements; `None` for another op.
    pub fn of(op: &Op, n: u32) -> Option<SgdSettings> {
        match *op {
            Op::Sgd { momentum, weight_decay } => {
                Some(SgdSettings { n, momentum: momentum.map_or(0.0, |m| m.0), weight_decay: weight_decay.0 })
            }
            _ => None,
        }
    }

    /// The uniform's words (16 bytes).
    pub fn words(self) -> [u32; 4] {
        [self.n, self.momentum.to_bits(), self.weight_decay.to_bits(), 0]
    }
}

/// The SGD update of a chunk in place (`torch.optim.SGD`, dampening 0, not Nesterov: `g *=
/// scale; g += weight_decay * p; b = first ? g : b * momentum + g; p -= lr * b`, the momentum
/// lines only in the form with momentum), with a momentum buffer or without: binding 0
/// [`SgdSettings`], 1 the tensor, 2 its gradient, then the momentum buffer (with momentum only),
/// the clipping factor and the step's constants (`-lr`, `first`: 1 where the buffer starts at
/// this step), numbered on. One invocation per element.
pub fn sgd(momentum: bool) -> String {
    let (buffer, update, next) = match momentum {
        true => (
            "@group(0) @binding(3) var<storage, read_write> b: array<f32>;\n",
            "    if (step[1] == 0.0) { gi = b[i] * c.momentum + gi; }\n    b[i] = gi;\n",
            4,
        ),
        false => ("", "", 3),
    };
    let last = next + 1;
    format!(
        "\
// Generated by kiln: one SGD step in place (see `optim`).
struct Settings {{ n: u32, momentum: f32, weight_decay: f32, unused: u32 }}
@group(0) @binding(0) var<uniform> c: Settings;
@group(0) @binding(1) var<storage, read_write> p: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
{buffer}@group(0) @binding({next}) var<storage, read> scale: array<f32>;
@group(0) @binding({last}) var<storage, read> step: array<f32>;
{FINITE}@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    let i = gid.x + gid.y * nwg.x * 64u;
    let s = scale[0];
    if (i >= c.n || !finite(s)) {{ return; }}
    let pi = p[i];
    var gi = g[i] * s + c.weight_decay * pi;
{update}    p[i] = pi + step[0] * gi;
}}
"
    )
}

/// Each tensor's partial sums of squares ([`sum_squares`]'s, one per workgroup) added into its
/// squared norm: binding 0 the uniform (`count` tensors), 1 the partial sums, 2 their ranges
/// (`u32[count + 1]`: tensor `j`'s are `ranges[j]..ranges[j + 1]`), 3 the squared norms
/// (`f32[count]`, [`crate::graph::Op::SquareSums`]'s output). One workgroup of 64 per tensor.
pub const SUM_PARTS: &str = concat!(
    "\
// Generated by kiln: each tensor's partial sums of squares added (see `optim`).
struct Sizes { count: u32, unused0: u32, unused1: u32, unused2: u32 }
@group(0) @binding(0) var<uniform> sizes: Sizes;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read> ranges: array<u32>;
@group(0) @binding(3) var<storage, read_write> sums: array<f32>;
var<workgroup> red: array<f32, 64>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = wid.x + wid.y * nwg.x;
    if (j >= sizes.count) { return; }
    var acc = 0.0;
    for (var i = ranges[j] + lid.x; i < ranges[j + 1u]; i = i + 64u) {
        acc = acc + parts[i];
    }
",
    tree_sum!(),
    "    if (lid.x == 0u) { sums[j] = red[0]; }
}
"
);

/// The uniform of the [`CLIP_SCALE`] kernel: the number of squared norms, the clipping bound
/// (none: a factor of 1), and the NaN it writes for a step not taken (given, so the module holds
/// no NaN constant).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipSettings {
    /// Squared norms summed.
    pub n: u32,
    /// The recipe's `max_norm`.
    pub max_norm: Option<f32>,
}

impl ClipSettings {
    /// The uniform's words (16 bytes).
    pub fn words(self) -> [u32; 4] {
        let max = self.max_norm.unwrap_or(0.0).to_bits();
        [self.n, u32::from(self.max_norm.is_some()), max, f32::NAN.to_bits()]
    }
}

/// [`crate::graph::Op::ClipScale`] in one workgroup of 64: binding 0 [`ClipSettings`], 1 the loss
/// (`f32[1]`), 2 the squared norms, 3 the factor (`f32[1]`): `max_norm / (norm + 1e-6)` where
/// below 1, else 1; NaN where the loss or the norm is not finite ([`crate::semantics::step_scale`],
/// in f32: the sums are scaled by 2^-24 while added, so no sum of finite norms overflows, and the
/// root scaled back by 2^12, both exact).
pub const CLIP_SCALE: &str = concat!(
    "\
// Generated by kiln: the clipping factor of a training step (see `optim`).
struct Settings { n: u32, clips: u32, max_norm: f32, nan: u32 }
@group(0) @binding(0) var<uniform> c: Settings;
@group(0) @binding(1) var<storage, read> loss: array<f32>;
@group(0) @binding(2) var<storage, read> sums: array<f32>;
@group(0) @binding(3) var<storage, read_write> scale: array<f32>;
var<workgroup> red: array<f32, 64>;
",
    finite!(),
    "\
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
    var acc = 0.0;
    for (var i = lid.x; i < c.n; i = i + 64u) {
        acc = acc + sums[i] * 5.9604644775390625e-8;
    }
",
    tree_sum!(),
    "    if (lid.x == 0u) {
        let norm = sqrt(red[0]) * 4096.0;
        var s = 1.0;
        if (!finite(norm) || !finite(loss[0])) {
            s = bitcast<f32>(c.nan);
        } else if (c.clips == 1u) {
            let coef = c.max_norm / (norm + 1e-6);
            if (coef < 1.0) { s = coef; }
        }
        scale[0] = s;
    }
}
"
);

/// The kernel a step of an optimizer's op runs, which the wgpu runtime dispatches itself (per
/// chunk of its tensors, as the module docs say) rather than through the steps' calling
/// convention: [`sum_squares`] for [`Op::SquareSums`] (then [`SUM_PARTS`]), [`CLIP_SCALE`],
/// [`adamw`], [`sgd`]. `None` for any other op.
pub fn step_kernel(op: &Op) -> Option<String> {
    Some(match op {
        Op::SquareSums => sum_squares(),
        Op::ClipScale { .. } => CLIP_SCALE.to_string(),
        Op::AdamW { .. } => adamw(),
        Op::Sgd { momentum, .. } => sgd(momentum.is_some()),
        _ => return None,
    })
}

/// The sizes of one [`ACCUMULATE`] dispatch: `n` elements, the micro-batch's weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeanStep {
    /// Elements of the chunk.
    pub n: u32,
    /// The micro-batch's share of the positions counted so far, its own included.
    pub weight: f32,
}

impl MeanStep {
    /// The uniform's words.
    pub fn words(self) -> [u32; 4] {
        [self.n, self.weight.to_bits(), 0, 0]
    }
}

/// A gradient chunk added to the running mean in place: binding 0 [`MeanStep`], 1 the mean, 2
/// the gradient. One invocation per element.
pub const ACCUMULATE: &str = "\
// Generated by kiln: a micro-batch's gradient into the step's mean (see `optim`).
struct Mean { n: u32, weight: f32, unused0: u32, unused1: u32 }
@group(0) @binding(0) var<uniform> c: Mean;
@group(0) @binding(1) var<storage, read_write> mean: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= c.n) { return; }
    let m = mean[i];
    mean[i] = m + c.weight * (g[i] - m);
}
";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Scalar;

    #[test]
    fn the_optimizer_kernels_validate() {
        for text in [&sum_squares(), SUM_PARTS, CLIP_SCALE, ACCUMULATE, &adamw(), &sgd(false), &sgd(true)] {
            super::super::validate(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        }
        // The uniforms' sizes as the modules declare them.
        assert_eq!(std::mem::size_of_val(&SquaresSizes { n: 1, offset: 0 }.words()), 16);
        let op = Op::AdamW { w1: Scalar(0.1), b2: Scalar(0.999), w2: Scalar(0.001), eps: Scalar(1e-8), decays: true };
        let adam = AdamWSettings::of(&op, 7).expect("an AdamW op");
        assert_eq!(std::mem::size_of_val(&adam.words()), 32);
        assert_eq!(adam.words()[..3], [7, 1, 1], "a weight of 0.1 interpolates from the start; decays");
        assert_eq!(AdamWSettings { w1: 0.5, ..adam }.words()[1], 0);
        assert_eq!(SquaresSizes { n: 4097, offset: 3 }.workgroups(), 2);
        // A dispatch's slots: each its first workgroup after the last's; the rest empty, within
        // the 64 bytes bound.
        let slots = [SquaresSizes { n: 4097, offset: 3 }, SquaresSizes { n: 10, offset: 5 }];
        let (words, workgroups) = SquaresSizes::uniform(&slots);
        assert_eq!((&words[..8], workgroups), (&[4097, 3, 0, 0, 10, 5, 2, 0][..], 3));
        assert!(words[8..].iter().all(|&w| w == 0) && std::mem::size_of_val(&words) == 64);
        let op = Op::Sgd { momentum: Some(Scalar(0.9)), weight_decay: Scalar(0.0) };
        assert_eq!(SgdSettings::of(&op, 3).expect("an SGD op").words(), [3, 0.9f32.to_bits(), 0, 0]);
        assert!(AdamWSettings::of(&op, 3).is_none() && step_kernel(&Op::Gather).is_none());
        assert!(sgd(false).contains("binding(4) var<storage, read> step") && sgd(true).contains("binding(5)"));
        let clip = ClipSettings { n: 2, max_norm: None }.words();
        assert_eq!((clip[1], f32::from_bits(clip[3]).is_nan()), (0, true));
        // No NaN literal reaches a module (naga refuses one): the clipping kernel is given it.
        assert!(!CLIP_SCALE.contains("0x7fc"));
    }
}
