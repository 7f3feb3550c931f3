//! The executor: [`GpuModel::run`] and its variants run one forward pass. A run binds its inputs
//! ([`GpuModel::bind_inputs`]), picks the caches it appends to in place and the copies they need
//! ([`GpuModel::substitutes`]), uploads the inputs and sizes the buffers it keeps between runs
//! ([`GpuModel::upload_inputs`], [`GpuModel::grow_buffers`]), encodes each step — its sizes, its
//! pipeline, its bind group ([`GpuModel::encode_steps`]) — records the forward pass and what
//! happens to each output on one command encoder ([`record_forward`], [`GpuModel::record_outputs`]),
//! submits once and reads the outputs back ([`read_outputs`]).

#![expect(
    clippy::indexing_slicing,
    reason = "a plan is lowered from a checked graph or read from an artifact, whose `Plan::check` \
              bounds its value and slot indices, and compiled here (one kernel per step); step shapes \
              are read through `dispatch`, which errs on an ill-typed step; inputs are shape-checked \
              by `bind` and token ids range-checked by `check_indices`; the per-step tables, the \
              slots and the input buffers are sized here before they are read"
)]

use super::cache::{Append, CacheCopy};
use super::model::Variant;
use super::tensor::STORAGE;
use super::{DeviceTensor, Gpu, GpuError, GpuModel};
use kiln_compiler::back::wgsl::{
    self, Elem, dispatch, dispatch_chunked, kernel_chunked, validate as validate_wgsl, workgroups,
};
use kiln_compiler::graph::{Sym, SymTable};
use kiln_compiler::lower::{Step, Storage, resolve};
use kiln_compiler::tensor::{DType, Data, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Bytes between the `Dims` of consecutive steps in the uniform buffer (the largest uniform offset
/// alignment WebGPU allows an adapter to require).
pub(super) const DIMS_STRIDE: u64 = 256;

/// Outputs kept on the device, by name.
pub type Kept = HashMap<String, DeviceTensor>;

/// Outputs a run left where it wrote them, by name: the buffers of their slots (see
/// [`GpuModel::run_leaving`]).
pub type Left = HashMap<String, Vec<wgpu::Buffer>>;

/// An output lent by [`GpuModel::run_lending`]: its buffers hold it until the next run (they are
/// the plan's slots), so the callback copies out what it needs on the encoder it is given.
pub(crate) struct Lent<'a> {
    /// Its shape.
    pub shape: &'a [usize],
    /// Its chunks, of `chunk_bytes` each but the last.
    pub buffers: &'a [wgpu::Buffer],
    /// Bytes of a chunk.
    pub chunk_bytes: u64,
}

/// The output [`GpuModel::run_lending`] lends, by name, and the callback it lends it to.
pub(crate) type Lend<'a> = (&'a str, &'a mut dyn FnMut(&mut wgpu::CommandEncoder, Lent<'_>) -> Result<(), GpuError>);

/// Device objects kept from one run to the next, so a generation step allocates and uploads
/// nothing but its new tokens, and rebuilds only the bind groups whose buffers changed.
#[derive(Default)]
pub(super) struct RunState {
    /// Intermediate buffers by slot: (bytes, chunks), grown when a longer input needs more.
    slots: Vec<(u64, Vec<wgpu::Buffer>)>,
    /// Input buffers by value: (bytes, chunks), grown likewise.
    inputs: HashMap<usize, (u64, Vec<wgpu::Buffer>)>,
    /// Every step's `Dims`, at `DIMS_STRIDE` apart, and what was last written there.
    uniform: Option<wgpu::Buffer>,
    pub(super) dims: Vec<u8>,
    /// By step: the pipeline and buffers its bind group was built for, and the bind group.
    pub(super) bind_groups: Vec<Option<CachedGroup>>,
    /// By step: the bind group of its second dispatch (a split attention combining its partial
    /// states: see `wgsl::attention`), its `Dims` at the step's slot past the steps' own.
    pub(super) second_groups: Vec<Option<CachedGroup>>,
    /// By step: that slot, for the steps whose kernel binds partial states.
    pub(super) second_slots: Vec<Option<usize>>,
    /// By step: the scratch buffer of a split attention's partial states (bytes, buffer), grown
    /// when a longer context splits more.
    partials: Vec<Option<(u64, wgpu::Buffer)>>,
    /// A buffer bound where a kernel reads nothing: the cache operand of a step appending in
    /// place, whose output is the cache itself.
    unread: Option<wgpu::Buffer>,
}

impl RunState {
    /// Where each value of a run in this state lives, placed as `at` says.
    pub(super) fn buffers<'r>(&'r self, model: &'r GpuModel, at: Placement<'r>) -> Buffers<'r> {
        Buffers::new(model, (&self.slots, &self.inputs), at)
    }
}

/// A step's bind group, with the pipeline and buffers it was built for.
pub(super) type CachedGroup = (wgpu::ComputePipeline, Vec<(wgpu::Buffer, Range)>, wgpu::BindGroup);

/// The part of a buffer a binding covers: `(offset, size)` in bytes, or `None` for all of it.
pub(super) type Range = Option<(u64, u64)>;

/// A run's inputs bound to the plan's values.
pub(super) struct Bound<'t> {
    /// The sizes the inputs give the plan's symbols.
    pub(super) syms: HashMap<Sym, usize>,
    /// Tensors to upload, by value.
    pub(super) host: HashMap<usize, Tensor>,
    /// Tensors already on the device, by value.
    pub(super) resident: HashMap<usize, &'t DeviceTensor>,
}

/// Buffers a run binds instead of a value's own — a cache appended in place for its present, and
/// a contiguous copy of a cache with room that is read another way — and the copies on the device,
/// before the forward pass, that fill them.
#[derive(Default)]
pub(super) struct Substitutes {
    pub(super) instead: HashMap<usize, Vec<wgpu::Buffer>>,
    pub(super) copies: Vec<CacheCopy>,
}

/// Where a run's values are besides its state's slots and inputs.
#[derive(Clone, Copy)]
pub(super) struct Placement<'a> {
    /// The sizes of the symbols.
    pub(super) syms: &'a HashMap<Sym, usize>,
    /// The tensors resident on the device, by value.
    pub(super) resident: &'a HashMap<usize, &'a DeviceTensor>,
    /// The buffers bound instead of values' own.
    pub(super) instead: &'a HashMap<usize, Vec<wgpu::Buffer>>,
    /// Each sequence's first position, `u32`, for a batched run's steps that read positions.
    pub(super) starts: Option<&'a wgpu::Buffer>,
    /// Values bound as a part of another buffer — a sequence's row of a batched step's value, in
    /// the batch's buffer — by value: the buffer and a row's bytes; this run binds row `row`'s.
    pub(super) parts: &'a HashMap<usize, (wgpu::Buffer, u64)>,
    pub(super) row: u64,
}

/// A buffer a run state keeps, split in chunks: its bytes and the chunks.
type Held = (u64, Vec<wgpu::Buffer>);

/// Where each value of one run lives.
pub(super) struct Buffers<'r> {
    model: &'r GpuModel,
    syms: &'r HashMap<Sym, usize>,
    /// `syms` as a table, for the sizes of every binding of every step.
    pub(super) table: SymTable,
    slots: &'r [(u64, Vec<wgpu::Buffer>)],
    inputs: &'r HashMap<usize, (u64, Vec<wgpu::Buffer>)>,
    resident: &'r HashMap<usize, &'r DeviceTensor>,
    instead: &'r HashMap<usize, Vec<wgpu::Buffer>>,
    /// Each sequence's first position, `u32`, for a batched run's steps that read positions.
    starts: Option<&'r wgpu::Buffer>,
    parts: &'r HashMap<usize, (wgpu::Buffer, u64)>,
    row: u64,
}

impl<'r> Buffers<'r> {
    /// A run's values in a state's `slots` and `inputs`, the rest placed as `at` says.
    fn new(
        model: &'r GpuModel,
        (slots, inputs): (&'r [Held], &'r HashMap<usize, Held>),
        at: Placement<'r>,
    ) -> Buffers<'r> {
        let Placement { syms, resident, instead, starts, parts, row } = at;
        Buffers { model, syms, table: SymTable::new(syms), slots, inputs, resident, instead, starts, parts, row }
    }

    /// The chunk buffers of a value, as many as its current size needs.
    pub(super) fn of(&self, value: usize) -> &'r [wgpu::Buffer] {
        let plan = &self.model.program.plan;
        let mut v = value;
        while let Storage::Alias(a) = plan.values[v].storage {
            v = a;
        }
        let all: &'r [wgpu::Buffer] = match &plan.values[v].storage {
            _ if self.instead.contains_key(&v) => &self.instead[&v],
            Storage::Param(_) | Storage::Const => &self.model.params[&v],
            Storage::Input { .. } => match self.resident.get(&v) {
                Some(t) => &t.buffers,
                None => &self.inputs[&v].1,
            },
            Storage::Slot(s) => &self.slots[*s].1,
            Storage::Alias(_) => unreachable!("aliases resolved above"),
        };
        let bytes = 4 * self.table.elements(&plan.values[value].shape) as u64;
        &all[..(bytes.div_ceil(self.model.gpu.chunk_bytes).max(1) as usize).min(all.len())]
    }

    /// What a step binds for a value: its chunk buffers, whole ([`Buffers::of`]), or for a value
    /// bound as a part of another buffer ([`Placement::parts`]) that buffer and the part.
    fn binding(&self, value: usize) -> (&'r [wgpu::Buffer], Range) {
        let v = crate::prepare::root(&self.model.program.plan, value);
        match self.parts.get(&v) {
            Some((buffer, bytes)) => (std::slice::from_ref(buffer), Some((self.row * bytes, *bytes))),
            None => (self.of(value), None),
        }
    }
}

/// The grid of workgroups each step launches (`(0, 0)` when it has nothing to compute at these
/// sizes), then that of its second dispatch (`(0, 0)` for none); their pipeline and bind groups
/// are the run state's tables of bind groups.
pub(super) struct Grids {
    first: Vec<(u32, u32)>,
    second: Vec<(u32, u32)>,
}

/// The run state's tables a run's encoding makes current (see [`RunState`]).
struct Tables<'s> {
    groups: &'s mut [Option<CachedGroup>],
    second_groups: &'s mut [Option<CachedGroup>],
    second_slots: &'s [Option<usize>],
    partials: &'s mut [Option<(u64, wgpu::Buffer)>],
}

/// Reused from step to step while a run encodes them: the bound buffers and the resolved shapes.
#[derive(Default)]
struct Scratch<'r> {
    bound: Vec<&'r [wgpu::Buffer]>,
    /// The part of its first buffer each of `bound` binds.
    ranges: Vec<Range>,
    operands: Vec<Vec<usize>>,
    out: Vec<usize>,
}

/// An output staged for reading back: its name, shape, type and staging buffers.
pub(super) type Readback = (String, Vec<usize>, DType, Vec<wgpu::Buffer>);

impl GpuModel {
    /// Runs one forward pass on named inputs; returns the named outputs.
    pub fn run(&self, given: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>, GpuError> {
        Ok(self.run_resident(given, &HashMap::new(), &[])?.0)
    }

    /// Runs one forward pass where some inputs already live on the device (`resident`: cache
    /// inputs, say the previous step's `present_k` or an encoder's keys) and some outputs stay
    /// there (`keep`, by name). Returns the outputs read back (all but those kept) and the kept
    /// ones. Nothing but `given` is uploaded and nothing kept is read back, so a generation
    /// session's cache never leaves the device.
    pub fn run_resident(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<String, DeviceTensor>,
        keep: &[String],
    ) -> Result<(Vec<(String, Tensor)>, Kept), GpuError> {
        self.run_lending(given, resident, keep, None)
    }

    /// [`GpuModel::run_resident`], where one output is neither read back nor kept but lent to a
    /// callback (`lend`: its name and the callback), which records what it does with it (see
    /// [`Lent`]) on the run's command encoder, after the forward pass and before the run's one
    /// submission: how a generation step samples its next token on the device.
    pub(crate) fn run_lending(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<String, DeviceTensor>,
        keep: &[String],
        lend: Option<Lend<'_>>,
    ) -> Result<(Vec<(String, Tensor)>, Kept), GpuError> {
        let (read, kept, _) = self.run_outputs(given, resident, keep, lend, &|_| true)?;
        Ok((read, kept))
    }

    /// Runs one forward pass on named inputs and reads back only the outputs `read` names; the
    /// others stay where the pass wrote them, in the plan's slots, whose buffers it returns by
    /// output name (chunks of [`Gpu::chunk_bytes`], the first elements the output's). They hold
    /// the outputs until the next run of this model writes its slots: what a training step's
    /// update on the device reads its gradients from (see [`super::DeviceOptimizer`]).
    pub fn run_leaving(
        &self,
        given: &HashMap<String, Tensor>,
        read: &dyn Fn(&str) -> bool,
    ) -> Result<(Vec<(String, Tensor)>, Left), GpuError> {
        let (outputs, _, left) = self.run_outputs(given, &HashMap::new(), &[], None, read)?;
        Ok((outputs, left))
    }

    /// [`GpuModel::run_lending`], reading back only the outputs `wanted` names (and those kept
    /// or lent), and returning the others' slot buffers.
    #[expect(clippy::type_complexity, reason = "the outputs read back, kept and left")]
    fn run_outputs(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<String, DeviceTensor>,
        keep: &[String],
        lend: Option<Lend<'_>>,
        wanted: &dyn Fn(&str) -> bool,
    ) -> Result<(Vec<(String, Tensor)>, Kept, Left), GpuError> {
        let gpu = &self.gpu;
        let started = std::time::Instant::now();
        gpu.check_lost()?;
        let bound = self.bind_inputs(given, resident)?;
        let appends = self.appends_in_place(given, &bound.resident, keep, &bound.syms)?;
        let mut substitutes = self.substitutes(&appends, &bound.resident)?;

        // Buffers: inputs and slots (kept, grown as needed), one uniform for every step's Dims.
        let mut state = self.state.lock().map_err(|_| GpuError::Poisoned("run state"))?;
        let state = &mut *state;
        // The optimizer's steps of a whole training step: recorded after the others, their
        // updates' own results never written (the tensors are updated in place).
        let tail = self.tail.as_ref();
        let first_of_tail = tail.map_or(self.program.plan.steps.len(), |t| t.first);
        if let Some(t) = tail {
            for &v in &t.outputs {
                substitutes.instead.insert(v, vec![t.placeholder.clone()]);
            }
        }
        let unwritten = |name: &str| tail.is_some_and(|t| t.unwritten.contains(name));
        self.upload_inputs(state, &bound.host)?;
        self.grow_buffers(state, &bound.syms, &appends, &mut substitutes.instead)?;
        let at = Placement {
            syms: &bound.syms,
            resident: &bound.resident,
            instead: &substitutes.instead,
            starts: None,
            parts: &HashMap::new(),
            row: 0,
        };
        let grids = self.encode_part(state, at, &appends, &|i| i < first_of_tail)?;
        let buffers = state.buffers(self, at);
        let (bind_groups, second_groups) = (&state.bind_groups, &state.second_groups);

        // The steps in one compute pass per submission: the device starts on a part while the
        // next is recorded. The cache copies go first, the outputs' copies last.
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let new_encoder =
            || gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("forward") });
        let mut encoder = new_encoder();
        for c in &substitutes.copies {
            c.record(&mut encoder, 0, gpu.chunk_bytes)?;
        }
        let parts = parts(&grids.first, self.program.options.submission_count());
        for (n, steps) in parts.iter().enumerate() {
            record_forward(&mut encoder, (bind_groups, second_groups), &grids, steps.clone())?;
            if n + 1 < parts.len() {
                gpu.queue.submit([std::mem::replace(&mut encoder, new_encoder()).finish()]);
            }
        }
        if let Some(t) = tail {
            t.record(gpu, (&self.program, &self.pipelines), &buffers, &mut encoder)?;
        }
        // What is read back, kept or lent: every output but those left in their slots (and the
        // updates' results, which nothing wrote).
        let lent = lend.as_ref().map(|l| l.0.to_string());
        let wanted = |name: &str| {
            !unwritten(name) && (wanted(name) || keep.iter().any(|k| k == name) || lent.as_deref() == Some(name))
        };
        let left: Left = self
            .program
            .plan
            .outputs
            .iter()
            .filter(|(name, _)| !wanted(name))
            .map(|(name, v)| (name.clone(), buffers.of(*v).to_vec()))
            .collect();
        let (readbacks, kept) = self.record_outputs(&mut encoder, &buffers, &appends, keep, lend, &wanted)?;
        gpu.queue.submit([encoder.finish()]);
        self.host.add(started.elapsed());
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Rejected { what: "the forward pass", message: e.to_string() });
        }
        Ok((read_outputs(gpu, readbacks)?, kept, left))
    }

    /// Binds `given` and the `resident` tensors to the plan's inputs exactly as the interpreter
    /// does, and checks the token ids' range.
    pub(super) fn bind_inputs<'t>(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &'t HashMap<String, DeviceTensor>,
    ) -> Result<Bound<'t>, GpuError> {
        let plan = &self.program.plan;
        let resident_shapes: HashMap<&str, &[usize]> =
            resident.iter().map(|(name, t)| (name.as_str(), t.shape.as_slice())).collect();
        let bound = crate::prepare::bind_values(plan, &self.inputs, given, &resident_shapes)?;
        let mut host: HashMap<usize, Tensor> = HashMap::new();
        let mut on_device: HashMap<usize, &DeviceTensor> = HashMap::new();
        for ((id, tensor), name) in bound.inputs.into_iter().zip(&bound.names) {
            match tensor {
                Some(t) => {
                    host.insert(id, t);
                }
                None => {
                    let t = &resident[name];
                    if !Arc::ptr_eq(&t.gpu, &self.gpu) {
                        return Err(GpuError::OtherDevice(name.clone()));
                    }
                    on_device.insert(id, t);
                }
            }
        }
        let by_value: HashMap<usize, &Tensor> = host.iter().map(|(&id, t)| (id, t)).collect();
        crate::prepare::check_indices(plan, &by_value, &bound.syms)?;
        Ok(Bound { syms: bound.syms, host, resident: on_device })
    }

    /// The buffers bound instead of a value's own this run, and the copies that fill them: each
    /// cache appended in place is bound for its present (its held rows copied first when it
    /// grew), and each other resident cache with room gets a contiguous copy.
    pub(super) fn substitutes(
        &self,
        appends: &[Append<'_>],
        resident: &HashMap<usize, &DeviceTensor>,
    ) -> Result<Substitutes, GpuError> {
        let mut s = Substitutes::default();
        for a in appends {
            s.instead.insert(a.site.present_value, vec![a.buffer.clone()]);
            if let Some((from, room)) = &a.grown_from {
                let to = vec![a.buffer.clone()];
                s.copies.push(CacheCopy {
                    from: (from.clone(), *room),
                    to: (to, a.room),
                    heads: a.heads,
                    rows: a.held,
                    d: a.d,
                });
            }
        }
        for (&id, t) in resident {
            let Some(room) = t.room.filter(|_| !appends.iter().any(|a| a.site.site.past_value == id)) else { continue };
            let (heads, rows, d, _) = t.heads()?;
            let to = self.gpu.chunked("the key/value cache", 4 * (heads * rows * d) as u64, STORAGE)?;
            s.copies.push(CacheCopy { from: (t.buffers.clone(), room), to: (to.clone(), rows), heads, rows, d });
            s.instead.insert(id, to);
        }
        Ok(s)
    }

    /// Writes the host inputs to their buffers (token ids as `i32`), replacing a buffer only
    /// when an input needs more than it holds.
    pub(super) fn upload_inputs(&self, state: &mut RunState, host: &HashMap<usize, Tensor>) -> Result<(), GpuError> {
        let gpu = &self.gpu;
        for (&id, t) in host {
            let bytes: Vec<u8> = match &t.data {
                Data::I64(v) => {
                    v.iter().flat_map(|&x| (x.clamp(i32::MIN as i64, i32::MAX as i64) as i32).to_le_bytes()).collect()
                }
                Data::F32(v) => bytemuck::cast_slice(v).to_vec(),
            };
            let len = bytes.len() as u64;
            if state.inputs.get(&id).is_none_or(|(have, _)| *have < len) {
                state.inputs.insert(id, (len, gpu.chunked("input", len, STORAGE)?));
            }
            gpu.write_chunked(&state.inputs[&id].1, &bytes);
        }
        Ok(())
    }

    /// Grows the slots to this run's sizes, makes the uniform of dispatch sizes and the table of
    /// bind groups on the first run, and binds the buffer read by nothing as the past of each
    /// cache appended in place.
    pub(super) fn grow_buffers(
        &self,
        state: &mut RunState,
        syms: &HashMap<Sym, usize>,
        appends: &[Append<'_>],
        instead: &mut HashMap<usize, Vec<wgpu::Buffer>>,
    ) -> Result<(), GpuError> {
        let (gpu, plan) = (&self.gpu, &self.program.plan);
        let sizes = plan.slot_sizes_except(syms, |v| instead.contains_key(&v));
        let slots = &mut state.slots;
        for (s, &needed) in sizes.iter().enumerate() {
            let have = slots.get(s).map_or(0, |(have, _)| *have);
            if slots.len() <= s || have < needed {
                let bytes = with_room(have, needed);
                let b = gpu.chunked(&format!("intermediate buffer {s}"), bytes, STORAGE)?;
                if slots.len() <= s {
                    slots.push((bytes, b));
                } else {
                    slots[s] = (bytes, b);
                }
            }
        }
        if state.uniform.is_none() {
            // A slot per step, then one per step that may dispatch a second time.
            let mut next = plan.steps.len();
            state.second_slots = (0..plan.steps.len())
                .map(|i| {
                    let partials = self.program.kernel_of(i).is_some_and(|k| k.partials);
                    partials.then(|| (next, next += 1).0)
                })
                .collect();
            state.uniform = Some(gpu.buffer(
                "dispatch sizes",
                DIMS_STRIDE * next.max(1) as u64,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            )?);
        }
        state.bind_groups.resize_with(plan.steps.len(), || None);
        state.second_groups.resize_with(plan.steps.len(), || None);
        state.partials.resize_with(plan.steps.len(), || None);
        if state.unread.is_none() && !appends.is_empty() {
            state.unread = Some(gpu.buffer("an operand read by nothing", 16, STORAGE)?);
        }
        for a in appends {
            let unread = state.unread.clone().ok_or_else(|| GpuError::Internal("no unread buffer".into()))?;
            instead.insert(a.site.site.past_value, vec![unread]);
        }
        Ok(())
    }

    /// Encodes the steps `selected` of a run in `state` ([`GpuModel::encode_steps`]), its values
    /// placed as `at` says, and writes
    /// their `Dims` to its uniform where they changed: a run's sizes change only with its input's
    /// (and a cache's) length.
    pub(super) fn encode_part(
        &self,
        state: &mut RunState,
        at: Placement<'_>,
        appends: &[Append<'_>],
        selected: &dyn Fn(usize) -> bool,
    ) -> Result<Grids, GpuError> {
        let RunState { slots, inputs, uniform, dims, bind_groups, second_groups, second_slots, partials, .. } = state;
        let uniform = uniform.as_ref().ok_or_else(|| GpuError::Internal("no uniform buffer".into()))?;
        let buffers = Buffers::new(self, (slots, inputs), at);
        let tables = Tables { groups: bind_groups, second_groups, second_slots, partials };
        let (dims_bytes, grids) = self.encode_steps(&buffers, appends, uniform, tables, selected)?;
        if *dims != dims_bytes {
            self.gpu.queue.write_buffer(uniform, 0, &dims_bytes);
            *dims = dims_bytes;
        }
        Ok(grids)
    }

    /// Every step's `Dims` (at [`DIMS_STRIDE`] apart, for the uniform) and its grid, with its
    /// pipeline and bind group made current in `tables` (kept where it binds the same pipeline
    /// and buffers), and the same for the second dispatch of a split attention (its `Dims` at the
    /// step's second slot) with the scratch buffer its partial states need. A decode step runs
    /// this for every step of the plan, so it allocates nothing per step where nothing changed:
    /// shapes are resolved into reused vectors through a [`SymTable`], and a step's buffers are
    /// compared with its bind group's, not copied.
    fn encode_steps<'r>(
        &self,
        buffers: &Buffers<'r>,
        appends: &[Append<'_>],
        uniform: &wgpu::Buffer,
        tables: Tables<'_>,
        selected: &dyn Fn(usize) -> bool,
    ) -> Result<(Vec<u8>, Grids), GpuError> {
        let (gpu, plan) = (&self.gpu, &self.program.plan);
        let slots = plan.steps.len() + tables.second_slots.iter().flatten().count();
        let mut dims_bytes = vec![0u8; (DIMS_STRIDE as usize) * slots.max(1)];
        let mut grids = Grids { first: Vec::with_capacity(plan.steps.len()), second: vec![(0, 0); plan.steps.len()] };
        let mut scratch = Scratch::<'r>::default();
        let mut variants = self.variants.lock().map_err(|_| GpuError::Poisoned("pipeline cache"))?;
        let grid = |dims: &[u32; 16]| match dims[0] {
            0 => (0, 0),
            threads => workgroups(threads, gpu.limits.max_compute_workgroups_per_dimension),
        };
        for (i, step) in plan.steps.iter().enumerate() {
            if !selected(i) {
                grids.first.push((0, 0));
                continue;
            }
            // The kernel's calling convention: the output, the operands, then what else it
            // writes (and, for a split attention, its partial states).
            scratch.bound.clear();
            scratch.ranges.clear();
            let values =
                std::iter::once(step.output).chain(step.operands.iter().copied()).chain(step.also.iter().copied());
            for (buffers, range) in values.map(|v| buffers.binding(v)) {
                scratch.bound.push(buffers);
                scratch.ranges.push(range);
            }
            let chunked = scratch.bound.iter().any(|b| b.len() > 1);
            let dims = self.step_dims(i, step, &buffers.table, appends, chunked, &mut scratch)?;
            let offset = i * DIMS_STRIDE as usize;
            dims_bytes[offset..offset + 64].copy_from_slice(bytemuck::cast_slice(&dims));

            let partials = !chunked && self.program.kernel_of(i).is_some_and(|k| k.partials);
            let storage_bindings = scratch.bound.iter().map(|b| b.len() as u32).sum::<u32>() + u32::from(partials);
            if storage_bindings > gpu.limits.max_storage_buffers_per_shader_stage {
                return Err(GpuError::TooManyBindings {
                    step: step.scope.clone(),
                    op: step.op.name(),
                    bindings: storage_bindings,
                    limit: gpu.limits.max_storage_buffers_per_shader_stage,
                });
            }
            // A batched step's rotating projection reads each sequence's position from `starts`.
            let starts = buffers.starts.filter(|_| crate::batching::positional(&step.op));
            let variant;
            let pipeline = match (chunked, starts) {
                (false, None) => &self.pipelines[self.program.step_kernels[i]],
                (false, Some(_)) => {
                    variant = self.at_starts_pipeline(i, step, &mut variants)?;
                    &variant
                }
                (true, None) => {
                    let counts: Vec<u32> = scratch.bound.iter().map(|b| b.len() as u32).collect();
                    variant = self.chunked_pipeline(i, step, &counts, &mut variants)?;
                    &variant
                }
                (true, Some(_)) => {
                    let message = "a position per sequence through tensors split over buffers".to_string();
                    return Err(GpuError::Step { step: step.scope.clone(), message });
                }
            };
            // The partial states' buffer (bound, if small, also where this run does not split).
            let extra = match partials {
                true => {
                    let needed = wgsl::partials::partials_bytes(&step.op, &dims).max(16);
                    let held = &mut tables.partials[i];
                    let have = held.as_ref().map_or(0, |(bytes, _)| *bytes);
                    if have < needed {
                        kiln_compiler::memory::check(|| "a step's partial results".to_string(), needed)?;
                        let bytes = with_room(have, needed);
                        *held = Some((bytes, gpu.buffer("a step's partial results", bytes, STORAGE)?));
                    }
                    held.as_ref().map(|(_, b)| b)
                }
                false => starts,
            };
            let bound = (&scratch.bound[..], &scratch.ranges[..]);
            bind_group(gpu, &mut tables.groups[i], pipeline, bound, extra, uniform, offset as u64);
            grids.first.push(grid(&dims));
            if let (true, Some(second)) = (partials, wgsl::partials::combine_dims(&step.op, &dims)) {
                let slot = tables.second_slots[i]
                    .ok_or_else(|| GpuError::Internal(format!("step {i} has no second dispatch slot")))?;
                let offset = slot * DIMS_STRIDE as usize;
                dims_bytes[offset..offset + 64].copy_from_slice(bytemuck::cast_slice(&second));
                bind_group(gpu, &mut tables.second_groups[i], pipeline, bound, extra, uniform, offset as u64);
                grids.second[i] = grid(&second);
            }
        }
        Ok((dims_bytes, grids))
    }

    /// Step `i`'s `Dims` at this run's sizes (`chunked`: it binds a tensor split over buffers),
    /// with the room of the caches it appends to or reads in place.
    fn step_dims(
        &self,
        i: usize,
        step: &Step,
        table: &SymTable,
        appends: &[Append<'_>],
        chunked: bool,
        scratch: &mut Scratch<'_>,
    ) -> Result<[u32; 16], GpuError> {
        let plan = &self.program.plan;
        let operands = &mut scratch.operands;
        if operands.len() < step.operands.len() {
            operands.resize_with(step.operands.len(), Vec::new);
        }
        for (shape, &o) in operands.iter_mut().zip(&step.operands) {
            table.resolve_into(&plan.values[o].shape, shape);
        }
        table.resolve_into(&plan.values[step.output].shape, &mut scratch.out);
        let (operand_shapes, out_shape) = (&operands[..step.operands.len()], &scratch.out);
        let past = table.dim(kiln_compiler::graph::Dim::Sym(Sym::Past));
        let at_step = |message: String| GpuError::Step { step: step.scope.clone(), message };
        let mut dims = match chunked {
            true => dispatch_chunked(&step.op, operand_shapes, out_shape, past),
            false => dispatch(&step.op, operand_shapes, out_shape, past, &self.program.options),
        }
        .map_err(at_step)?;
        if let Some(a) = appends.iter().find(|a| a.site.site.step == i) {
            let room = a.room as u32;
            match a.site.folded {
                true if chunked => {
                    Err("internal error: a cache appended in place through chunked bindings".to_string())
                }
                true => wgsl::appends_in_place(&step.op, &mut dims, room),
                false => wgsl::heads_in_place(&step.op, &mut dims, room),
            }
            .map_err(at_step)?;
        }
        for a in appends {
            let room = a.room as u32;
            for &(_, operand) in a.site.readers.iter().filter(|(r, _)| *r == i) {
                if chunked {
                    return Err(GpuError::Internal(format!(
                        "`{}` reads a cache appended in place through chunked bindings",
                        step.scope
                    )));
                }
                let strides = wgsl::attention::KEY_STRIDES;
                dims[if operand == 1 { strides.0 } else { strides.1 }] = room;
            }
        }
        Ok(dims)
    }

    /// The pipeline of step `i`'s kernel variant reading its tensors split over buffers
    /// (`counts` of them per binding), from `variants` or built there when first needed. The
    /// split kernels read f32 only.
    fn chunked_pipeline(
        &self,
        i: usize,
        step: &Step,
        counts: &[u32],
        variants: &mut HashMap<(usize, Variant), wgpu::ComputePipeline>,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        let (gpu, plan) = (&self.gpu, &self.program.plan);
        if let Some(&o) = step.operands.iter().find(|&&o| !plan.values[o].format.is_f32()) {
            return Err(GpuError::SplitFormat { step: step.scope.clone(), format: plan.values[o].format });
        }
        let key = (self.program.step_kernels[i], Variant::Chunked(counts.to_vec()));
        if !variants.contains_key(&key) {
            let elems: Vec<Elem> = step.operands.iter().map(|&o| elem(plan.values[o].dtype)).collect();
            let text = kernel_chunked(
                &step.op,
                &elems,
                elem(plan.values[step.output].dtype),
                counts,
                (gpu.chunk_bytes / 4) as u32,
            )
            .ok_or_else(|| GpuError::NoKernel(step.op.name()))?;
            validate_wgsl(&text)
                .map_err(|e| GpuError::Internal(format!("chunked {} kernel is invalid: {e}", step.op.name())))?;
            variants.insert(key.clone(), gpu.pipeline(&format!("{} (chunked)", step.op.name()), &text));
        }
        Ok(variants[&key].clone())
    }

    /// The pipeline of step `i`'s kernel reading each sequence's first position from a binding
    /// (a rotating projection in a batched step), from `variants` or built there when first
    /// needed.
    fn at_starts_pipeline(
        &self,
        i: usize,
        step: &Step,
        variants: &mut HashMap<(usize, Variant), wgpu::ComputePipeline>,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        let key = (self.program.step_kernels[i], Variant::AtStarts);
        if !variants.contains_key(&key) {
            let (plan, options) = (&self.program.plan, &self.program.options);
            let text = wgsl::step_kernel_at_starts(plan, step, options).ok_or_else(|| GpuError::Step {
                step: step.scope.clone(),
                message: format!("{} has no kernel taking a position per sequence", step.op.name()),
            })?;
            validate_wgsl(&text)
                .map_err(|e| GpuError::Internal(format!("{} kernel at starts is invalid: {e}", step.op.name())))?;
            variants.insert(key.clone(), self.gpu.pipeline(&format!("{} (at starts)", step.op.name()), &text));
        }
        Ok(variants[&key].clone())
    }

    /// Records on `encoder`, after the forward pass, what happens to each output: lent to the
    /// callback, left where it is kept (a cache appended in place), copied into buffers of its
    /// own to be kept, or staged to be read back after the submission.
    pub(super) fn record_outputs(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        buffers: &Buffers<'_>,
        appends: &[Append<'_>],
        keep: &[String],
        mut lend: Option<Lend<'_>>,
        wanted: &dyn Fn(&str) -> bool,
    ) -> Result<(Vec<Readback>, Kept), GpuError> {
        let (gpu, plan) = (&self.gpu, &self.program.plan);
        let mut readbacks = Vec::new();
        let mut kept = HashMap::new();
        for (name, v) in plan.outputs.iter().filter(|(name, _)| wanted(name)) {
            let shape = resolve(&plan.values[*v].shape, buffers.syms);
            if let Some((lent, then)) = lend.as_mut()
                && *lent == name.as_str()
            {
                (*then)(encoder, Lent { shape: &shape, buffers: buffers.of(*v), chunk_bytes: gpu.chunk_bytes })?;
                continue;
            }
            if let Some(a) = appends.iter().find(|a| a.site.site.present == *name) {
                // Already where it is kept: the cache, with room for more rows.
                let buffers = vec![a.buffer.clone()];
                kept.insert(name.clone(), DeviceTensor { gpu: gpu.clone(), shape, buffers, room: Some(a.room) });
                continue;
            }
            let bytes = 4 * shape.iter().product::<usize>() as u64;
            if keep.contains(name) {
                // Kept on the device: copied into buffers of its own (a slot is reused next run).
                let own = gpu.chunked(&format!("output `{name}`"), bytes, STORAGE)?;
                for (c, (chunk, to)) in buffers.of(*v).iter().zip(&own).enumerate() {
                    let at = c as u64 * gpu.chunk_bytes;
                    let len = (bytes.saturating_sub(at)).min(gpu.chunk_bytes).next_multiple_of(4);
                    if len > 0 {
                        encoder.copy_buffer_to_buffer(chunk, 0, to, 0, len);
                    }
                }
                kept.insert(name.clone(), DeviceTensor { gpu: gpu.clone(), shape, buffers: own, room: None });
                continue;
            }
            let staging = gpu.stage(&format!("output `{name}`"), buffers.of(*v), bytes, encoder)?;
            readbacks.push((name.clone(), shape, plan.values[*v].dtype, staging));
        }
        Ok((readbacks, kept))
    }
}

/// The bytes to give a slot holding `have` that must hold `needed`: half as much again where it
/// grows by under a quarter (a value that lengthens by a row each decode step: made anew every
/// few steps rather than every step, each time invalidating the bind groups that read it), the
/// size needed otherwise (a longer prompt's activations: no more memory than they take).
fn with_room(have: u64, needed: u64) -> u64 {
    match have > 0 && needed < have + have / 4 {
        true => needed.max(have + have / 2),
        false => needed,
    }
}

/// Makes `cached` step `i`'s bind group for `pipeline`, the chunks of `bound` and `extra`: kept
/// if it was built for the same pipeline and buffers, else a new one binding its `Dims` (64
/// bytes) at `offset` in the uniform, then `bound`'s buffers in order — each value's first
/// buffer only the part its range says, where `bound.1` gives one (empty: every buffer whole) —,
/// then `extra`. (The optimizer's kernels, `super::optim`, bind theirs this way too.)
pub(super) fn bind_group(
    gpu: &Gpu,
    cached: &mut Option<CachedGroup>,
    pipeline: &wgpu::ComputePipeline,
    (bound, ranges): (&[&[wgpu::Buffer]], &[Range]),
    extra: Option<&wgpu::Buffer>,
    uniform: &wgpu::Buffer,
    offset: u64,
) {
    let buffers = || {
        let values = bound.iter().enumerate();
        let chunks = values.flat_map(|(i, chunks)| {
            let range = ranges.get(i).copied().flatten();
            chunks.iter().enumerate().map(move |(j, b)| (b, if j == 0 { range } else { None }))
        });
        chunks.chain(extra.map(|b| (b, None)))
    };
    if let Some((p, b, _)) = cached
        && p == pipeline
        && b.iter().map(|(b, r)| (b, *r)).eq(buffers())
    {
        return;
    }
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: uniform,
            offset,
            size: wgpu::BufferSize::new(64),
        }),
    }];
    for (buffer, range) in buffers() {
        let resource = match range {
            None => buffer.as_entire_binding(),
            Some((offset, size)) => {
                wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size: wgpu::BufferSize::new(size) })
            }
        };
        entries.push(wgpu::BindGroupEntry { binding: entries.len() as u32, resource });
    }
    let group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    });
    *cached = Some((pipeline.clone(), buffers().map(|(b, r)| (b.clone(), r)).collect(), group));
}

/// The steps of a run in `count` parts of as many dispatches each (steps with nothing to compute
/// dispatch nothing), in order: at most `count`, none empty, together every step.
fn parts(grids: &[(u32, u32)], count: usize) -> Vec<std::ops::Range<usize>> {
    let dispatched = grids.iter().filter(|g| g.0 > 0).count();
    let per = dispatched.div_ceil(count.max(1)).max(1);
    let mut parts = Vec::with_capacity(count);
    let (mut start, mut seen, mut done) = (0, 0, 0);
    for (i, g) in grids.iter().enumerate() {
        if g.0 > 0 {
            (seen, done) = (seen + 1, done + 1);
        }
        // A part ends at its last dispatch, unless no dispatch follows (the last part takes the
        // rest).
        if seen == per && done < dispatched {
            parts.push(start..i + 1);
            (start, seen) = (i + 1, 0);
        }
    }
    parts.push(start..grids.len());
    parts
}

/// Records on `encoder` the forward pass's `steps`: each with something to compute, in order, in
/// one compute pass, with the pipeline and bind group `groups` holds for it, then its second
/// dispatch where it has one (the second table's; the pass orders them).
pub(super) fn record_forward(
    encoder: &mut wgpu::CommandEncoder,
    groups: (&[Option<CachedGroup>], &[Option<CachedGroup>]),
    grids: &Grids,
    steps: std::ops::Range<usize>,
) -> Result<(), GpuError> {
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
    dispatch_steps(&mut pass, groups, grids, steps)
}

/// Records on `pass` the dispatches of `steps`, as [`record_forward`] does.
pub(super) fn dispatch_steps(
    pass: &mut wgpu::ComputePass<'_>,
    groups: (&[Option<CachedGroup>], &[Option<CachedGroup>]),
    grids: &Grids,
    steps: std::ops::Range<usize>,
) -> Result<(), GpuError> {
    for i in steps {
        for (table, grid) in [(groups.0, grids.first[i]), (groups.1, grids.second[i])] {
            let (x, y) = grid;
            if x == 0 {
                continue;
            }
            let Some((pipeline, _, group)) = &table[i] else {
                return Err(GpuError::Internal(format!("step {i} has no bind group")));
            };
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, group, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
    }
    Ok(())
}

/// Waits for the submission and reads the staged outputs back (token ids from `i32`).
pub(super) fn read_outputs(gpu: &Gpu, readbacks: Vec<Readback>) -> Result<Vec<(String, Tensor)>, GpuError> {
    let mut outputs = Vec::new();
    for (name, shape, dtype, staging) in readbacks {
        let n: usize = shape.iter().product();
        let data = gpu.read_staging(&staging, &format!("`{name}`"), n)?;
        let t = match dtype {
            DType::F32 => Tensor::f32(shape, bytemuck::cast_slice::<u8, f32>(&data).to_vec()),
            DType::I64 => {
                Tensor::i64(shape, bytemuck::cast_slice::<u8, i32>(&data).iter().map(|&x| x as i64).collect())
            }
        };
        outputs.push((name, t));
    }
    Ok(outputs)
}

/// The WGSL element type a value of `dtype` is stored as.
fn elem(dtype: DType) -> Elem {
    match dtype {
        DType::F32 => Elem::F32,
        DType::I64 => Elem::I32,
    }
}

#[cfg(test)]
mod tests {
    use super::parts;

    #[test]
    fn parts_split_the_dispatches_evenly_and_cover_every_step() {
        // Steps 1 and 4 dispatch nothing.
        let grids = [(1, 1), (0, 0), (2, 1), (3, 1), (0, 0), (1, 1), (1, 1)];
        assert_eq!(parts(&grids, 1), vec![0..7]);
        assert_eq!(parts(&grids, 2), vec![0..4, 4..7]);
        assert_eq!(parts(&grids, 3), vec![0..3, 3..6, 6..7]);
        assert_eq!(parts(&grids, 5), vec![0..1, 1..3, 3..4, 4..6, 6..7]);
        assert_eq!(parts(&grids, 50), vec![0..1, 1..3, 3..4, 4..6, 6..7]);
        assert_eq!(parts(&[(0, 0), (0, 0)], 4), vec![0..2]);
        assert_eq!(parts(&[], 4), vec![0..0]);
    }
}
