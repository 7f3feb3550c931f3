//! The wgpu back end: a target-neutral [`Plan`] compiled into a [`Program`] of WGSL compute
//! kernels, one dispatch per step.
//!
//! [`compile`] first *legalizes* the plan for the kernels: the projection kernel
//! ([`projection`]) reads an f32 weight transposed, `[k, w]`, its rows padded to a multiple of 4
//! columns for a plain projection, so each such weight gets its transpose — a load-time fold for
//! a constant weight (shared by every projection that reads it), permute/slice/concat steps
//! otherwise — and, with [`Options::f16_weights`], is stored as f16. Quantized weights are read
//! as their blocks, untransposed. Slots are then placed again over the legalized steps. Second,
//! it generates each step's module ([`kernel`]), deduplicated by text and validated by naga with
//! every validation flag: a module that fails is a compiler bug, reported with the op and model
//! named. The runtime computes each dispatch's sizes from run-time shapes ([`dispatch`]).
//!
//! [`Options`] say what the device has beyond WebGPU's baseline: subgroups
//! ([`Options::subgroups`]: the row reductions of norms and softmaxes, and a GEMV form splitting
//! `k` over a workgroup, reduce through subgroup operations; see `reduce`) and f16
//! ([`Options::f16_weights`], [`Options::f16_math`]). Each is the runtime's choice from the
//! features it opened the device with; without them the kernels are plain WGSL.

#![expect(
    clippy::indexing_slicing,
    reason = "compilation runs on plans that lowering produced or `Plan::check` accepted, whose \
              value indices are in range; operand lists and shapes are read with checked access"
)]

mod append;
pub mod attention;
mod dims;
pub mod emit;
pub mod gemm;
mod kernel;
pub mod optim;
pub mod partials;
pub mod projection;
mod reduce;
pub mod sample;
mod scores;
pub mod target;

pub use dims::{appends_in_place, dispatch, dispatch_chunked, heads_in_place, workgroups};
pub use emit::{Elem, WORKGROUP};
pub use kernel::{kernel, kernel_chunked};

use crate::graph::{Dim, Op, PackedAttention, Shape};
use crate::lower::{Fold, Plan, Step, Storage, Value, WeightFormat, assign_slots, constant};
use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A unique WGSL module.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// A readable name (`matmul_t`, `layer_norm`, ...).
    pub name: String,
    /// The module text.
    pub wgsl: String,
    /// Number of operand bindings (after the uniform and the output).
    pub operands: usize,
    /// It binds a scratch buffer last, after its outputs: partial results (a split attention's
    /// softmax states, a reduction's over chunks of rows; see [`partials::partials_bytes`]),
    /// which it may dispatch a second time to combine ([`partials::combine_dims`]).
    #[serde(default)]
    pub partials: bool,
    /// It is an optimizer's kernel ([`optim::step_kernel`]), which the runtime dispatches per
    /// chunk of the tensors its step reads, with bindings of its own (see [`optim`]), rather than
    /// through the steps' calling convention.
    #[serde(default)]
    pub optimizer: bool,
}

/// Choices of the wgpu back end: the device features its kernels may use. The default is plain
/// WGSL, which every adapter runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Store every constant f32 projection weight as f16 (needs `SHADER_F16` on the device).
    /// Arithmetic stays f32: each weight is widened as it is loaded.
    pub f16_weights: bool,
    /// With [`Options::f16_weights`], the `vec4` projection forms multiply in f16: each `vec4` of
    /// activations is rounded to f16 and dotted with the four f16 weight rows it meets, the four
    /// products of each column summed in f16, and that partial sum added to an f32 accumulator.
    /// Halves the conversions and doubles the arithmetic width where a device has fast f16; costs
    /// the activations' rounding to 11 significant bits (a relative error of up to 2^-11 per
    /// product, about 5e-4, on top of the weights' own) and an activation beyond f16's range
    /// (65504) becomes infinite. Quantized weights and the scalar forms are unaffected. Needs
    /// `SHADER_F16`.
    pub f16_math: bool,
    /// Reduce rows with subgroup operations (needs `SUBGROUP` on the device): the norms' and
    /// softmaxes' row sums and maxima, and the projection's split GEMV form (see `reduce` and
    /// [`projection`]), which only this option enables.
    pub subgroups: bool,
    /// Run a decoder step's two cache appends in its cached attention's own dispatch
    /// (`fold_appends`), for a hardware adapter, where a dispatch costs microseconds. Where the
    /// runtime appends to a cache in place, the folded kernel's threads write only the new rows
    /// (see `append::append_copy`). On lavapipe it decodes as fast as the three dispatches but
    /// prefills 1.5x slower (SmolLM2, `kiln bench decode --steps 32 --seq 16 --backend wgpu`: 10.1
    /// against 10.5 decode tok/s, 38.8 against 57.2 prefill), so a software adapter keeps them
    /// apart (see `Gpu::options`).
    pub fold_appends: bool,
    /// Give the attention kernels their workgroup form (see [`attention`]): where the blocked
    /// forms would run too few invocations to fill a GPU (a decode step's attention runs one per
    /// key/value head), a workgroup per query row and head, its lanes splitting the keys. For a
    /// hardware adapter (see `Gpu::options`). Lavapipe keeps the blocked forms: it has a few CPU
    /// threads to fill, not thousands of lanes, and there the blocked forms' loads serve several
    /// heads and rows while the workgroup form's barriers and reductions cost a synchronisation of
    /// its 64 lanes per chunk of keys.
    pub attention_workgroups: bool,
    /// With [`Options::attention_workgroups`]: below how many invocations of the blocked forms an
    /// attention runs its workgroup form instead; `None` for the built-in threshold
    /// ([`attention::WORKGROUP_FORM_BELOW`]). A tunable (`kiln tune` times it per adapter).
    pub attention_workgroup_below: Option<usize>,
    /// The projection's `vec4` GEMM (prefill) tile, `(rows, groups of 4 columns)` an invocation
    /// computes: one of [`projection::GEMM_TILES`]; `None` (or another) for 8 x 2, chosen for
    /// lavapipe's loads. A tunable (`kiln tune`).
    pub gemm_tile: Option<(usize, usize)>,
    /// With [`Options::subgroups`]: projections of up to this many rows run the split GEMV form
    /// (a workgroup per row and [`Options::split_groups`] groups of 4 columns, its lanes splitting
    /// `k`), as a decode step's do, where the `vec4` GEMM's tiles of 8 rows would launch too few
    /// workgroups to fill a GPU (fewer than [`projection::SPLIT_BELOW_WORKGROUPS`]; SmolLM2's
    /// projections at 32 rows: 5–12 workgroups on an H100 of 132 SMs; its 32-token prefill took
    /// 30 ms, a step of 8 sequences 41 ms). Each row reads the weights again, from the cache where
    /// they fit. `None`: [`projection::GEMV_MAX_ROWS`]. A tunable (`kiln tune`); a hardware
    /// adapter starts from [`projection::HARDWARE_SPLIT_ROWS`].
    pub split_rows: Option<usize>,
    /// Groups of 4 output columns a split GEMV's workgroup computes: one of
    /// [`projection::SPLIT_GROUPS`]; `None` (or another) for [`projection::SPLIT_GEMV_GROUPS`]. Fewer
    /// launch more workgroups (SmolLM2's 576-column projections launch 72 a row with two groups,
    /// 144 with one) but read each weight row in shorter pieces: on an H200, workgroups of 4
    /// columns decoded Gemma 3 270M 14% slower than of 8 (640 columns, `k` up to 2 048) and
    /// SmolLM2 no faster (BENCHMARKS.md, 2026-11-27), so every adapter starts from the default.
    /// A rotating projection keeps 2. A tunable (`kiln tune`).
    pub split_groups: Option<usize>,
    /// With [`Options::subgroups`]: a decode step's projection (up to
    /// [`projection::GEMV_MAX_ROWS`] rows) at least this many columns wide runs the `vec4` GEMV —
    /// a lane per 4 columns walking all of `k`, so a warp reads each weight row's 512 contiguous
    /// bytes — instead of the split GEMV, whose lanes split `k` and read 32-byte pieces of as many
    /// weight rows: SmolLM2's vocabulary head (576 x 49 152) streamed at 233 GB/s so on an H100
    /// (BENCHMARKS.md, 2026-11-27). `None`: the split GEMV at every width. A tunable (`kiln
    /// tune`, [`projection::WIDE_GEMV_FROM`]).
    pub wide_gemv_from: Option<usize>,
    /// Keys per tile of the attention's blocked forms: one of [`attention::KEY_TILES`]; `None`
    /// (or another) for [`attention::KEY_TILE`]. A tunable (`kiln tune`).
    pub attention_key_tile: Option<usize>,
    /// With [`Options::attention_workgroups`]: split each query row's keys into ranges of this
    /// many, one workgroup each, where the workgroup form would launch too few workgroups to fill
    /// a GPU (a decode step: one per query head), and combine the ranges' partial softmax states
    /// in a second dispatch (flash-decoding; see [`attention`]). `None`: one workgroup walks all
    /// of a row's keys. A tunable (`kiln tune`); a hardware adapter starts from
    /// [`attention::SPLIT_KEYS`].
    pub attention_split_keys: Option<usize>,
    /// Submissions a run's dispatches are split over, in order (`None` or 1: one). The device
    /// starts on the first part while the host records the rest, so recording overlaps execution
    /// where the host's share of a step is large (a decode step: a few hundred small dispatches);
    /// each submission costs the driver's fixed share. A tunable (`kiln tune`); a hardware
    /// adapter starts from [`HARDWARE_SUBMISSIONS`].
    pub submissions: Option<usize>,
    /// The largest buffer the device binds, in bytes. A projection whose weight is larger (a
    /// 262144-token vocabulary head) is split into projections onto ranges of its output columns
    /// whose weights each fit, joined by concatenations (see [`column_divisible`]): each piece runs
    /// the fast projection forms, where a weight split over several bindings would run the scalar
    /// chunked kernel (Gemma 3 270M's head on lavapipe: 22 s of a 22.7 s forward pass). `None`:
    /// no limit (the runtime binds larger tensors in chunks).
    pub binding_bytes: Option<u64>,
    /// The parameters change between runs (a training step's, set before each): nothing is
    /// derived from them at load time. A projection weight's transpose is then a step of the
    /// plan, run on the device each time, not a load-time fold the host evaluates again whenever
    /// the parameters change (on an H200, GPT-2 small's training step spent 3.4 s of 5.0 on the
    /// host, mostly so); no projection is split to fit the bindings (its pieces would be folds:
    /// the runtime binds the weight in chunks instead); no gather reads a transposed copy.
    pub params_vary: bool,
    /// Split a tiled product's contraction where its output has too few blocks to fill a GPU
    /// (fewer than [`gemm::FILL_WORKGROUPS`]; a gradient through a vocabulary head: 72 blocks
    /// contracting 49 152 rows): a workgroup per block and slice, the slices' partial outputs
    /// added by a second dispatch (see [`gemm::launch`]). A hardware adapter's; on lavapipe,
    /// whose few threads the blocks already fill, the extra workgroups doubled a 1 024³
    /// product's time.
    pub split_contractions: bool,
}

impl Options {
    /// The options of a hardware adapter with subgroups (what `Gpu::options` gives one, less the
    /// binding limit): subgroup reductions, the cache appends in the attention's dispatch, the
    /// attention's workgroup form.
    pub fn hardware() -> Options {
        Options {
            subgroups: true,
            fold_appends: true,
            attention_workgroups: true,
            attention_split_keys: Some(attention::SPLIT_KEYS),
            submissions: Some(HARDWARE_SUBMISSIONS),
            split_rows: Some(projection::HARDWARE_SPLIT_ROWS),
            split_contractions: true,
            ..Options::default()
        }
    }

    /// Submissions a run is split over (see [`Options::submissions`]): at least 1.
    pub fn submission_count(&self) -> usize {
        self.submissions.unwrap_or(1).max(1)
    }

    /// The options in words, for reports: `plain`, or the features used (`subgroups, f16 weights`).
    pub fn describe(&self) -> String {
        let mut used = Vec::new();
        if self.subgroups {
            used.push("subgroups");
        }
        match (self.f16_weights, self.f16_math) {
            (true, true) => used.push("f16 weights and arithmetic"),
            (true, false) => used.push("f16 weights"),
            _ => {}
        }
        if self.fold_appends {
            used.push("cache appends in the attention");
        }
        let below;
        if self.attention_workgroups {
            below = match self.attention_workgroup_below {
                Some(n) => format!("attention in workgroups below {n} invocations"),
                None => "attention in workgroups".into(),
            };
            used.push(&below);
        }
        let (tile, keys, rows, width);
        if let (true, Some(n)) = (self.subgroups, self.split_rows) {
            rows = format!("split GEMV to {n} rows");
            used.push(&rows);
        }
        if let (true, Some(g)) = (self.subgroups, self.split_groups) {
            width = format!("split GEMV {} columns a workgroup", 4 * g);
            used.push(&width);
        }
        let wide;
        if let (true, Some(n)) = (self.subgroups, self.wide_gemv_from) {
            wide = format!("vec4 GEMV from {n} columns");
            used.push(&wide);
        }
        if let Some((rows, groups)) = self.gemm_tile {
            tile = format!("GEMM tile {rows} x {}", 4 * groups);
            used.push(&tile);
        }
        if let Some(t) = self.attention_key_tile {
            keys = format!("attention key tile {t}");
            used.push(&keys);
        }
        let split;
        if let (true, Some(n)) = (self.attention_workgroups, self.attention_split_keys) {
            split = format!("attention split every {n} keys");
            used.push(&split);
        }
        let parts;
        if self.submission_count() > 1 {
            parts = format!("{} submissions", self.submission_count());
            used.push(&parts);
        }
        if used.is_empty() { "plain".into() } else { used.join(", ") }
    }

    /// The options' choices among kernel forms ([`Tunables`]).
    pub fn tunables(&self) -> Tunables {
        Tunables {
            f16_weights: self.f16_weights,
            f16_math: self.f16_math,
            subgroups: self.subgroups,
            fold_appends: self.fold_appends,
            attention_workgroups: self.attention_workgroups,
            attention_workgroup_below: self.attention_workgroup_below,
            gemm_tile: self.gemm_tile,
            split_rows: self.split_rows,
            split_groups: self.split_groups,
            wide_gemv_from: self.wide_gemv_from,
            attention_key_tile: self.attention_key_tile,
            attention_split_keys: self.attention_split_keys,
            submissions: self.submissions,
        }
    }

    /// These options with the forms `t` chooses, its precision included (the binding limit
    /// kept).
    pub fn tuned(self, t: Tunables) -> Options {
        Options {
            f16_weights: t.f16_weights,
            f16_math: t.f16_math,
            subgroups: t.subgroups,
            fold_appends: t.fold_appends,
            attention_workgroups: t.attention_workgroups,
            attention_workgroup_below: t.attention_workgroup_below,
            gemm_tile: t.gemm_tile,
            split_rows: t.split_rows,
            split_groups: t.split_groups,
            wide_gemv_from: t.wide_gemv_from,
            attention_key_tile: t.attention_key_tile,
            attention_split_keys: t.attention_split_keys,
            submissions: t.submissions,
            ..self
        }
    }
}

/// Submissions a hardware adapter's runs start from (see [`Options::submissions`]): a decode
/// step's ~150–200 dispatches in parts of ~50, as a Vulkan peer measured best on an RTX 5070
/// (1.4 ms a SmolLM2 token in 8 submissions of a 394-dispatch step against 2.4–3.1 ms in one).
pub const HARDWARE_SUBMISSIONS: usize = 4;

/// The choices among the kernels' forms whose best depends on the adapter, as data: what `kiln
/// tune` times per adapter and model shape and caches. Each is a form the kernels have, held to
/// the interpreter on lavapipe; which is fastest is the device's question (the workgroup form of
/// attention took an H200's forward pass from 106.6 to 68.0 ms at one shape and from 22.8 to 40.0
/// at another). The precision of f32 weights is one too, taken only where the caller left it to
/// the tuning (see `kiln_runtime::tune::options_for`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tunables {
    /// f32 projection weights stored as f16 ([`Options::f16_weights`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub f16_weights: bool,
    /// And multiplied in f16 ([`Options::f16_math`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub f16_math: bool,
    /// Subgroup reductions, and the split GEMV ([`Options::subgroups`]).
    pub subgroups: bool,
    /// The cache appends in the attention's dispatch ([`Options::fold_appends`]).
    pub fold_appends: bool,
    /// The attention's workgroup form ([`Options::attention_workgroups`]).
    pub attention_workgroups: bool,
    /// Below how many blocked invocations it runs ([`Options::attention_workgroup_below`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_workgroup_below: Option<usize>,
    /// The projection's prefill tile ([`Options::gemm_tile`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_tile: Option<(usize, usize)>,
    /// Rows up to which a projection runs the split GEMV ([`Options::split_rows`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_rows: Option<usize>,
    /// Groups of 4 columns a split GEMV's workgroup takes ([`Options::split_groups`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_groups: Option<usize>,
    /// The width from which a decode step's projection runs the `vec4` GEMV
    /// ([`Options::wide_gemv_from`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wide_gemv_from: Option<usize>,
    /// The attention's key tile ([`Options::attention_key_tile`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_key_tile: Option<usize>,
    /// The keys per workgroup of a split attention ([`Options::attention_split_keys`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_split_keys: Option<usize>,
    /// Submissions a run is split over ([`Options::submissions`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submissions: Option<usize>,
}

impl Tunables {
    /// The forms in words (`plain`, or the features used), as [`Options::describe`] says them.
    pub fn describe(&self) -> String {
        Options::default().tuned(*self).describe()
    }
}

/// A plan compiled for wgpu.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    /// The plan as this back end runs it: the neutral plan legalized (weights transposed, padded,
    /// maybe f16; slots placed over its steps).
    pub plan: Plan,
    /// Unique kernels.
    pub kernels: Vec<Kernel>,
    /// The kernel of each step of [`Program::plan`], by index into [`Program::kernels`].
    pub step_kernels: Vec<usize>,
    /// The options it was compiled with, which [`dispatch`] needs too.
    pub options: Options,
}

impl Program {
    /// The kernel step `i` dispatches.
    pub fn kernel_of(&self, i: usize) -> Option<&Kernel> {
        self.step_kernels.get(i).and_then(|&k| self.kernels.get(k))
    }

    /// The deterministic text of every kernel, for snapshots: `// kernel N: name` then the module.
    pub fn kernels_text(&self) -> String {
        let mut s = String::new();
        for (i, k) in self.kernels.iter().enumerate() {
            s += &format!("// ---- kernel {i}: {} ({} operands)\n{}\n", k.name, k.operands, k.wgsl);
        }
        s
    }
}

/// A plan this back end cannot compile: an op on operands its kernels do not take (a plan read
/// from a file), or a compiler bug (a generated module naga rejects).
#[derive(Clone, Debug, thiserror::Error)]
#[error("cannot compile model `{model}` for wgpu: op `{op}` (`{scope}`): {message}")]
pub struct CompileError {
    /// The model.
    pub model: String,
    /// The op.
    pub op: String,
    /// Its scope.
    pub scope: String,
    /// What is wrong.
    pub message: String,
}

/// Parses and validates a WGSL module with every validation flag.
pub fn validate(text: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(text).map_err(|e| e.emit_to_string(text))?;
    // f16 and subgroups are the capabilities a kernel may use, each only where its `Options` say.
    let capabilities = naga::valid::Capabilities::SHADER_FLOAT16 | naga::valid::Capabilities::SUBGROUP;
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities)
        .validate(&module)
        .map_err(|e| e.emit_to_string(text))?;
    Ok(())
}

/// The element type of a value's buffer on the device (`I64` graph values are `i32` there).
fn device_elem(v: &Value) -> Elem {
    match (v.dtype, v.format) {
        (DType::I64, _) => Elem::I32,
        (DType::F32, f) => Elem::from(f),
    }
}

/// Whether `op` is a projection [`Options::binding_bytes`] can split into projections onto
/// ranges of its output columns: one whose output column `j` reads only row `j` of its weight
/// and bias (not gated, rotating or adding a residual).
pub fn column_divisible(op: &Op) -> bool {
    matches!(op, Op::Linear { residual: false, glu: false, rope: None, .. })
}

/// Compiles a plan (from [`crate::lower::lower`], or an artifact's that passed
/// [`Plan::check`]) for wgpu: legalizes it and generates its kernels (see the module docs).
pub fn compile(plan: &Plan, options: &Options) -> Result<Program, CompileError> {
    let mut l = Legalize {
        model: &plan.name,
        values: plan.values.clone(),
        folds: plan.folds.clone(),
        steps: Vec::with_capacity(plan.steps.len()),
        transposed: HashMap::new(),
        slices: HashMap::new(),
        params_vary: options.params_vary,
    };
    for step in &plan.steps {
        match options.binding_bytes.and_then(|limit| l.split_projection(step, limit)) {
            Some(pieces) => {
                for piece in pieces {
                    l.push(piece, options)?;
                }
            }
            None => l.push(step.clone(), options)?,
        }
    }
    l.gather_transposed();
    let Legalize { mut values, folds, steps, .. } = l;
    let steps = if options.fold_appends { fold_appends(&values, steps) } else { steps };
    let slots = assign_slots(&mut values, &steps, &plan.outputs);
    let plan = Plan { name: plan.name.clone(), values, folds, steps, slots, outputs: plan.outputs.clone() };

    let mut kernels: Vec<Kernel> = Vec::new();
    let mut kernel_of: HashMap<String, usize> = HashMap::new();
    let mut step_kernels = Vec::with_capacity(plan.steps.len());
    for step in &plan.steps {
        let error = |message: String| CompileError {
            model: plan.name.clone(),
            op: step.op.name(),
            scope: step.scope.clone(),
            message,
        };
        let elems: Vec<Elem> = step.operands.iter().map(|&v| device_elem(&plan.values[v])).collect();
        let optimizer = optim::step_kernel(&step.op);
        let is_optimizer = optimizer.is_some();
        let text = match optimizer {
            Some(text) => text,
            None => kernel(&step.op, &elems, device_elem(&plan.values[step.output]), geometry(&plan, step), options)
                .ok_or_else(|| error("no kernel runs this op".into()))?,
        };
        let k = match kernel_of.get(&text) {
            Some(&k) => k,
            None => {
                validate(&text)
                    .map_err(|e| error(format!("internal compiler error: generated WGSL is invalid: {e}")))?;
                let partials = partials::has_partials(&step.op, geometry(&plan, step).is_some(), options);
                kernels.push(Kernel {
                    name: step.op.name(),
                    wgsl: text.clone(),
                    operands: step.operands.len(),
                    partials,
                    optimizer: is_optimizer,
                });
                kernel_of.insert(text, kernels.len() - 1);
                kernels.len() - 1
            }
        };
        step_kernels.push(k);
    }
    Ok(Program { plan, kernels, step_kernels, options: *options })
}

/// The kernel of step `step` of a compiled program's `plan` for a batched step of sequences at
/// different positions, where the step is a projection whose epilogue rotates (RoPE): its
/// [`kernel`], reading the first position of each sequence from a `u32` binding after its
/// operands (see `kernel::kernel_at_starts`); `None` for any other step.
pub fn step_kernel_at_starts(plan: &Plan, step: &Step, options: &Options) -> Option<String> {
    let elems: Vec<Elem> = step.operands.iter().map(|&v| device_elem(&plan.values[v])).collect();
    kernel::kernel_at_starts(&step.op, &elems, device_elem(&plan.values[step.output]), options)
}

/// Whether step `step` of `plan` reads its key and value operands (1 and 2) through the row
/// strides its sizes give ([`attention::KEY_STRIDES`]), so a cache appended in place can be bound as they
/// are: an attention over `[b, kv, k, d]` operands (a cached packed one not appending itself)
/// whose kernel is specialised to its head geometry, not visiting blocks of keys, and not bound
/// in chunks (the chunked variants take no strides; the caller checks that).
pub fn reads_strided_keys(plan: &Plan, step: &Step) -> bool {
    let plain = match step.op {
        Op::Attention { mods, .. }
        | Op::PackedAttention(PackedAttention { mods, cached: true, appends: false, .. }) => mods.sparse.is_none(),
        _ => false,
    };
    plain && geometry(plan, step).is_some()
}

/// The head geometry of an attention step, which its kernel is specialised to (shape inference
/// keeps head counts and widths fixed).
fn geometry(plan: &Plan, step: &Step) -> Option<attention::Geometry> {
    match step.op {
        Op::PackedAttention(PackedAttention { heads, kv_heads, head_dim, .. }) => {
            Some(attention::Geometry { heads, kv_heads, head_dim })
        }
        Op::Attention { .. } => {
            let shape = |i: usize| step.operands.get(i).map(|&v| &plan.values[v].shape);
            match (shape(0)?.as_slice(), shape(1)?.as_slice()) {
                ([_, Dim::Fixed(heads), _, Dim::Fixed(head_dim)], [_, Dim::Fixed(kv_heads), ..]) => {
                    Some(attention::Geometry { heads: *heads, kv_heads: *kv_heads, head_dim: *head_dim })
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// Folds the two cache appends of each decoder step's cached attention into the attention's own
/// dispatch, a horizontal fusion: its kernel runs, past the attention's threads, one thread per
/// element of the two caches after the step (see [`Op::PackedAttention`]'s `appends`). Folded:
/// an append (`heads`, neither normalizing nor rotating) of the attention's key (value) heads of
/// the projection the attention reads its queries from, whose cache no other step reads (the
/// plan's outputs may). The attention then reads the caches *before* the step and this step's
/// keys and values in place, so nothing it writes is read in the same dispatch. A graph's
/// [`crate::optimize::dispatches`] counts such an append as no dispatch of its own.
fn fold_appends(values: &[Value], mut steps: Vec<Step>) -> Vec<Step> {
    let producer: HashMap<usize, usize> = steps.iter().enumerate().map(|(i, s)| (s.output, i)).collect();
    // Readers of each value, through the reshapes aliasing it.
    let root = |mut v: usize| {
        while let Some(Storage::Alias(a)) = values.get(v).map(|x| &x.storage) {
            v = *a;
        }
        v
    };
    let mut readers: HashMap<usize, usize> = HashMap::new();
    for step in &steps {
        for &o in &step.operands {
            *readers.entry(root(o)).or_default() += 1;
        }
    }
    let mut folded: Vec<bool> = vec![false; steps.len()];
    for i in 0..steps.len() {
        let Op::PackedAttention(PackedAttention {
            kv_heads, head_dim, k, v, mods, cached: true, appends: false, ..
        }) = steps[i].op
        else {
            continue;
        };
        // BigBird's pattern visits key blocks, not ranges a buffer holds.
        if mods.sparse.is_some() {
            continue;
        }
        let attention = &steps[i];
        let append = |operand: usize, start: usize| -> Option<(usize, usize)> {
            let cache = *attention.operands.get(operand)?;
            let &p = producer.get(&cache)?;
            let appends = matches!(steps[p].op,
                Op::Heads { start: s, heads, head_dim: d, norm: None, rope: None }
                    if s == start && heads == kv_heads && d == head_dim);
            match steps[p].operands.as_slice() {
                &[past, x] if appends && Some(&x) == attention.operands.first() && readers.get(&cache) == Some(&1) => {
                    Some((p, past))
                }
                _ => None,
            }
        };
        let (Some((pk, past_k)), Some((pv, past_v))) = (append(1, k), append(2, v)) else { continue };
        let presents = vec![steps[pk].output, steps[pv].output];
        let step = &mut steps[i];
        if let Op::PackedAttention(PackedAttention { appends, .. }) = &mut step.op {
            *appends = true;
        }
        (step.operands[1], step.operands[2]) = (past_k, past_v);
        step.also = presents;
        (folded[pk], folded[pv]) = (true, true);
    }
    steps.into_iter().zip(folded).filter(|(_, f)| !f).map(|(s, _)| s).collect()
}

/// The state of one legalization: the plan's values, folds and steps as extended so far.
struct Legalize<'p> {
    model: &'p str,
    values: Vec<Value>,
    folds: Vec<Fold>,
    steps: Vec<Step>,
    /// (Weight value, padded) -> its transpose (shared by every projection reading the weight).
    transposed: HashMap<(usize, bool), usize>,
    /// (Value, first row, rows) -> its row slice (a piece of a split projection's weight or bias,
    /// shared likewise).
    slices: HashMap<(usize, usize, usize), usize>,
    /// [`Options::params_vary`]: no value is derived from the parameters at load time.
    params_vary: bool,
}

impl Legalize<'_> {
    /// Whether `v` is known at load time (a parameter, or computed from parameters alone) and the
    /// parameters do not change between runs: what a load-time fold may read.
    fn foldable(&self, v: usize) -> bool {
        !self.params_vary && constant(&self.values, v)
    }

    fn error(&self, step: &Step, message: String) -> CompileError {
        CompileError { model: self.model.to_string(), op: step.op.name(), scope: step.scope.clone(), message }
    }

    /// Appends `step`, its projection weight (if any) transposed, padded and maybe f16 as the
    /// kernels read it.
    fn push(&mut self, mut step: Step, options: &Options) -> Result<(), CompileError> {
        if let Some(wi) = step.op.linear_weight() {
            let &w = step.operands.get(wi).ok_or_else(|| self.error(&step, "the weight operand is missing".into()))?;
            match self.values[w].format {
                WeightFormat::F32 => {
                    let n = match self.values[w].shape.as_slice() {
                        [Dim::Fixed(n), _] => Some(*n),
                        [_, _] => None,
                        s => return Err(self.error(&step, format!("the weight has {} axes, not 2", s.len()))),
                    };
                    let pad = n.is_some_and(|n| projection::pads_weight(&step.op, n));
                    let t = self.transpose(w, pad, &step.scope);
                    if options.f16_weights && self.values[t].storage == Storage::Const {
                        self.values[t].format = WeightFormat::F16;
                    }
                    step.operands[wi] = t;
                }
                WeightFormat::F16 => {
                    return Err(self.error(
                        &step,
                        "the plan stores the weight as f16, which only this back end chooses (`Options::f16_weights`)"
                            .into(),
                    ));
                }
                // Blocks are read untransposed (see `crate::lower::format`).
                WeightFormat::Q8_0
                | WeightFormat::Q4_1
                | WeightFormat::Q5_0
                | WeightFormat::Q4_K
                | WeightFormat::Q6_K => {}
            }
        }
        self.steps.push(step);
        Ok(())
    }

    /// [`Options::binding_bytes`]: a projection `act(norm(x) @ w^T + bias)` whose constant weight
    /// `w` (`[n, k]`) is larger than `limit` bytes, as the projections onto column ranges of its
    /// output whose weights (load-time row slices of `w`, in its format) each fit, then the
    /// concatenations joining their outputs into the original output, in order (after the norm
    /// of a prologue, which runs once as a step of its own). `None` if the
    /// weight fits, or the projection cannot be split: a gated, rotating or residual one (their
    /// columns pair up or read another operand by column), a weight computed at run time, or one
    /// whose four rows alone are over the limit.
    fn split_projection(&mut self, step: &Step, limit: u64) -> Option<Vec<Step>> {
        let Op::Linear { act, bias, norm, .. } = step.op else { return None };
        if !column_divisible(&step.op) {
            return None;
        }
        let wi = step.op.linear_weight()?;
        let w = *step.operands.get(wi)?;
        let &[Dim::Fixed(n), Dim::Fixed(k)] = self.values.get(w)?.shape.as_slice() else { return None };
        let format = self.values[w].format;
        let b = if bias { Some(*step.operands.get(wi + 1)?) } else { None };
        if format.bytes(n, k) <= limit || !self.foldable(w) || b.is_some_and(|b| !self.foldable(b)) {
            return None;
        }
        // Rows per piece: as even as multiples of 4 allow (so the f32 pieces' transposes need no
        // padding; the last piece's padding keeps it within `rows` too), each within the limit.
        let most = (limit / format.bytes(1, k).max(1)) as usize / 4 * 4;
        let rows = match most {
            0 => 0,
            most => n.div_ceil(n.div_ceil(most)).next_multiple_of(4),
        };
        let out = &self.values[step.output];
        let (out_shape, dtype) = (out.shape.clone(), out.dtype);
        let axis = out_shape.len().checked_sub(1)?;
        if rows == 0 || out_shape.last() != Some(&Dim::Fixed(n)) {
            return None;
        }
        let fold = |l: &mut Self, from: usize, shape: Shape, start: usize, len: usize| {
            if let Some(&v) = l.slices.get(&(from, start, len)) {
                return v;
            }
            let v = l.values.len();
            l.slices.insert((from, start, len), v);
            let (dtype, format) = (l.values[from].dtype, l.values[from].format);
            l.values.push(Value { shape, dtype, storage: Storage::Const, format });
            l.folds.push(Fold { op: Op::Slice { axis: 0, start, len }, operands: vec![from], output: v });
            v
        };
        let with_cols = |l: &mut Self, cols: usize| {
            let mut shape = out_shape.clone();
            shape[axis] = Dim::Fixed(cols);
            l.values.push(Value { shape, dtype, storage: Storage::Slot(usize::MAX), format: WeightFormat::F32 });
            l.values.len() - 1
        };
        let mut steps = Vec::new();
        // A norm prologue runs once, as a step of its own, not again in every piece (the pieces
        // of Gemma 3 270M's head measured 10% slower with it on lavapipe).
        let (op, x) = match norm {
            None => (step.op.clone(), step.operands[..wi].to_vec()),
            Some(p) => {
                let &x = step.operands.first()?;
                let normed = self.values.len();
                self.values.push(Value { storage: Storage::Slot(usize::MAX), ..self.values[x].clone() });
                let op = if p.rms { Op::RmsNorm { eps: p.eps } } else { Op::LayerNorm { eps: p.eps } };
                let operands = step.operands[..wi].to_vec();
                steps.push(Step { op, operands, output: normed, also: Vec::new(), scope: step.scope.clone() });
                (Op::Linear { act, bias, residual: false, norm: None, glu: false, rope: None }, vec![normed])
            }
        };
        let mut joined: Option<(usize, usize)> = None; // (value, columns)
        for start in (0..n).step_by(rows) {
            let len = rows.min(n - start);
            let mut operands = x.clone();
            operands.push(fold(self, w, vec![Dim::Fixed(len), Dim::Fixed(k)], start, len));
            if let Some(b) = b {
                operands.push(fold(self, b, vec![Dim::Fixed(len)], start, len));
            }
            let last = start + len == n;
            let output = if last && joined.is_none() { step.output } else { with_cols(self, len) };
            steps.push(Step { op: op.clone(), operands, output, also: Vec::new(), scope: step.scope.clone() });
            if let Some((acc, cols)) = joined {
                let to = if last { step.output } else { with_cols(self, cols + len) };
                steps.push(Step {
                    op: Op::Concat { axis },
                    operands: vec![acc, output],
                    output: to,
                    also: Vec::new(),
                    scope: step.scope.clone(),
                });
                joined = Some((to, cols + len));
            } else {
                joined = Some((output, len));
            }
        }
        Some(steps)
    }

    /// Each gather from a constant table that a projection reads too (a tied head) made a gather
    /// of columns ([`Op::GatherColumns`]) from the projection's transposed copy — or from the
    /// transposed pieces of a projection split to fit the adapter's bindings
    /// ([`Self::split_projection`]) — so that the device holds the table once: nothing else
    /// reads the table, whose upload is dropped (only load-time folds read it).
    fn gather_transposed(&mut self) {
        let transposed = |l: &Self, w: usize| {
            [false, true]
                .into_iter()
                .find_map(|pad| l.transposed.get(&(w, pad)).copied())
                .filter(|&t| l.values[t].storage == Storage::Const)
        };
        for i in 0..self.steps.len() {
            let (op, operands) = (&self.steps[i].op, &self.steps[i].operands);
            let (Op::Gather, &[table, ids]) = (op, operands.as_slice()) else { continue };
            let Some(&Dim::Fixed(rows)) = self.values[table].shape.first() else { continue };
            // The whole table transposed, else its row slices in order, each transposed.
            let pieces: Option<Vec<(usize, usize)>> = match transposed(self, table) {
                Some(t) => Some(vec![(t, rows)]),
                None => {
                    let mut slices: Vec<(usize, usize, usize)> = self
                        .slices
                        .iter()
                        .filter(|((from, _, _), _)| *from == table)
                        .map(|(&(_, start, len), &v)| (start, len, v))
                        .collect();
                    slices.sort_unstable();
                    let mut next = 0;
                    let mut pieces = Vec::new();
                    for (start, len, v) in slices {
                        if start != next {
                            break;
                        }
                        let Some(t) = transposed(self, v) else { break };
                        pieces.push((t, len));
                        next += len;
                    }
                    (next == rows && !pieces.is_empty()).then_some(pieces)
                }
            };
            if let Some(pieces) = pieces {
                let step = &mut self.steps[i];
                step.op = Op::GatherColumns { splits: pieces.iter().map(|&(_, rows)| rows).collect() };
                step.operands = pieces.iter().map(|&(t, _)| t).chain([ids]).collect();
            }
        }
    }

    /// The `[k, m]` transpose of a 2-D projection weight `w` (`[m, k]`), its rows padded to a
    /// multiple of 4 columns if `pad` (by repeating the first ones): a load-time fold for a
    /// constant weight, permute (slice, concat) steps otherwise, placed in slots afterwards.
    fn transpose(&mut self, w: usize, pad: bool, scope: &str) -> usize {
        if let Some(&t) = self.transposed.get(&(w, pad)) {
            return t;
        }
        let shape = self.values[w].shape.clone();
        let is_constant = self.foldable(w);
        let derive = |l: &mut Self, op: Op, operands: Vec<usize>, shape: Shape| -> usize {
            let v = l.values.len();
            let storage = if is_constant { Storage::Const } else { Storage::Slot(usize::MAX) };
            l.values.push(Value { shape, dtype: l.values[w].dtype, storage, format: WeightFormat::F32 });
            if is_constant {
                l.folds.push(Fold { op, operands, output: v });
            } else {
                l.steps.push(Step { op, operands, output: v, also: Vec::new(), scope: scope.to_string() });
            }
            v
        };
        let mut t = derive(self, Op::Permute { perm: vec![1, 0] }, vec![w], vec![shape[1], shape[0]]);
        if let (true, Dim::Fixed(n)) = (pad, shape[0]) {
            let extra = n.next_multiple_of(4) - n;
            let rows = shape[1];
            let head =
                derive(self, Op::Slice { axis: 1, start: 0, len: extra }, vec![t], vec![rows, Dim::Fixed(extra)]);
            t = derive(self, Op::Concat { axis: 1 }, vec![t, head], vec![rows, Dim::Fixed(n + extra)]);
        }
        self.transposed.insert((w, pad), t);
        t
    }
}
