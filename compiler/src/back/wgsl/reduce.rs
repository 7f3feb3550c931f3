//! Workgroup reductions: the sum or maximum over a workgroup's 64 lanes of each lane's value,
//! which every lane gets back. The row kernels (norms, softmaxes, the cross-entropy and its
//! gradient; see [`super::emit::reduces`]) and the projection's split GEMV form (see
//! [`super::projection`]) call them by name, `row_sum`, `row_max` and `row_sum4` (a `vec4<f32>`
//! sum), from uniform control flow; [`functions`] writes them in one of two forms:
//!
//! - **plain**: halving in workgroup memory, `log2(64) = 6` barriers;
//! - **subgroups** (wgpu's `SUBGROUP` feature, [`super::Options::subgroups`]): `subgroupAdd` /
//!   `subgroupMax` within each subgroup, each subgroup's result written to workgroup memory by
//!   its first invocation, then those results reduced by every subgroup, its invocations taking
//!   them in turn (`subgroup_size` apart) and combining their shares with one more subgroup
//!   operation. The subgroup size is not known when the kernel is written (lavapipe's is 8, an
//!   NVIDIA GPU's 32, others 4 to 128, and one workgroup may hold a partial subgroup): nothing
//!   here depends on it, or on how invocations are assigned to subgroups. The invocation's
//!   subgroup builtins reach these functions through the private `sg` (invocation in its
//!   subgroup, subgroup size, subgroup index, subgroups in the workgroup), which the entry point
//!   sets first ([`ENTRY_BUILTINS`], [`ENTRY_SETUP`]).
//!
//! The total is the same in every lane of a workgroup whose subgroups are all the same size, and
//! within rounding otherwise. naga 30 takes the subgroup operations without an `enable
//! subgroups;` directive (which it rejects as unimplemented); validation needs its
//! `Capabilities::SUBGROUP`.

/// The entry point parameters a module with subgroup reductions adds.
pub const ENTRY_BUILTINS: &str = ", @builtin(subgroup_invocation_id) sgi: u32, @builtin(subgroup_size) sgs: u32, \
@builtin(subgroup_id) sgid: u32, @builtin(num_subgroups) nsg: u32";

/// The first statement of such an entry point: the builtins kept for the reductions.
pub const ENTRY_SETUP: &str = "sg = vec4<u32>(sgi, sgs, sgid, nsg);\n";

/// One reduction: its function name, value type, workgroup array, subgroup operation, identity
/// and how two values combine.
struct Reduction {
    name: &'static str,
    ty: &'static str,
    array: &'static str,
    subgroup_op: &'static str,
    identity: &'static str,
    combine: fn(&str, &str) -> String,
}

const SUM: Reduction = Reduction {
    name: "row_sum",
    ty: "f32",
    array: "red",
    subgroup_op: "subgroupAdd",
    identity: "0.0",
    combine: |a, b| format!("{a} + {b}"),
};

const MAX: Reduction = Reduction {
    name: "row_max",
    ty: "f32",
    array: "red",
    subgroup_op: "subgroupMax",
    identity: "-3.40282347e38",
    combine: |a, b| format!("max({a}, {b})"),
};

const SUM4: Reduction = Reduction {
    name: "row_sum4",
    ty: "vec4<f32>",
    array: "red4",
    subgroup_op: "subgroupAdd",
    identity: "vec4<f32>(0.0)",
    combine: |a, b| format!("{a} + {b}"),
};

/// The module-scope declarations and functions of the reductions: `row_sum` and `row_max`, and
/// `row_sum4` if `vec4`, in the subgroup form if `subgroups` (see the module docs).
pub fn functions(subgroups: bool, vec4: bool) -> String {
    let mut s = String::from("var<workgroup> red: array<f32, 64>;\n");
    if vec4 {
        s += "var<workgroup> red4: array<vec4<f32>, 64>;\n";
    }
    if subgroups {
        s += "// (invocation in subgroup, subgroup size, subgroup index, subgroups), set by main.\nvar<private> sg: vec4<u32>;\n";
    }
    let reductions: &[Reduction] = if vec4 { &[SUM, MAX, SUM4] } else { &[SUM, MAX] };
    for r in reductions {
        s += &if subgroups { subgroup_form(r) } else { plain_form(r) };
    }
    s
}

/// Halving in workgroup memory. The first barrier keeps a lane from overwriting a value another
/// lane still reads from the previous call.
fn plain_form(r: &Reduction) -> String {
    let Reduction { name, ty, array, .. } = r;
    format!(
        "fn {name}(lane: u32, v: {ty}) -> {ty} {{\n    workgroupBarrier();\n    {array}[lane] = v;\n    workgroupBarrier();\n    \
         for (var off = 32u; off > 0u; off = off >> 1u) {{\n        \
         if (lane < off) {{ {array}[lane] = {}; }}\n        workgroupBarrier();\n    }}\n    return {array}[0];\n}}\n",
        (r.combine)(&format!("{array}[lane]"), &format!("{array}[lane + off]"))
    )
}

/// Within each subgroup, across subgroups through workgroup memory, then within each subgroup
/// again (see the module docs).
fn subgroup_form(r: &Reduction) -> String {
    let Reduction { name, ty, array, subgroup_op, identity, .. } = r;
    format!(
        "fn {name}(lane: u32, v: {ty}) -> {ty} {{\n    let part = {subgroup_op}(v);\n    workgroupBarrier();\n    \
         if (sg.x == 0u) {{ {array}[sg.z] = part; }}\n    workgroupBarrier();\n    var t = {identity};\n    \
         for (var i = sg.x; i < sg.w; i = i + sg.y) {{ t = {}; }}\n    return {subgroup_op}(t);\n}}\n",
        (r.combine)("t", &format!("{array}[i]"))
    )
}
