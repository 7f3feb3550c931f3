//! Several sequences' decode steps as one run on the device: continuous batching's step
//! ([`GpuModel::run_batched`]).
//!
//! How the plan runs batched is [`crate::batching`]'s, shared with the CPU engine. On the device
//! a run is held in one [`RunState`] for the whole batch and one per sequence (its row), each
//! with its own slots, uniform of sizes and bind groups, kept from step to step:
//!
//! - the steps run once over the batch are encoded in the whole batch's state, at the batch's
//!   sizes, and read each weight once for every sequence;
//! - the steps run once per sequence are encoded in each row's state, at that sequence's sizes
//!   and with its own cache — bound, appended to in place and grown exactly as its own step
//!   would ([`GpuModel::appends_in_place`]) — and recorded one pass per step with every row's
//!   dispatch; each row's part of a batched operand or result is bound in place, a part of the
//!   batch's buffer (where a storage binding can start at it: the adapter's offset alignment),
//!   else copied into the row's slot first, and a batched result written per row copied into its
//!   row of the batch's slot after;
//! - a projection whose epilogue rotates (RoPE) runs once over the batch, each row at its own
//!   sequence's position (a variant of its kernel reading the positions from a binding,
//!   `wgsl::step_kernel_at_starts`); the other steps that read positions (learned positions, a
//!   rotation by itself) run per sequence, their kernels reading one position from their sizes.
//!
//! Everything is recorded on one command encoder and submitted once; the logits come back as
//! `[batch, 1, vocab]`, and each sequence's presents become its cache only when the run
//! succeeded (an append in place writes past the rows the old cache holds, so on an error every
//! cache is as it was).

#![expect(
    clippy::indexing_slicing,
    reason = "value and step indices come from a plan `Plan::check` bounded; the batch plan has an \
              entry per value and step, and the row states are sized to the batch before use"
)]

use super::cache::Append;
use super::run::{Bound, Buffers, Grids, Placement, RunState, Substitutes, dispatch_steps, read_outputs};
use super::tensor::{STORAGE, copy_range};
use super::{DeviceTensor, GpuError, GpuModel};
use crate::batching::{BatchPlan, Exec, Mode};
use crate::prepare::root;
use kiln_compiler::graph::{Op, Sym};
use kiln_compiler::interp::PAST_LEN;
use kiln_compiler::lower::{Step, Storage};
use kiln_compiler::tensor::Tensor;
use std::collections::{HashMap, HashSet};

/// One sequence of a batched step: its cache on the device, the token it runs, and the tokens
/// before it (where its token's position is; a sliding window's cache may hold fewer).
pub struct SeqStep<'a> {
    /// The sequence's cache, by past input name: read in place, its presents in their place on
    /// success, as it was on an error.
    pub cache: &'a mut HashMap<String, DeviceTensor>,
    /// The token to run.
    pub token: i64,
    /// Tokens before it.
    pub past: usize,
}

/// What batched runs keep from one to the next: the whole batch's state and each row's.
#[derive(Default)]
pub(super) struct BatchState {
    whole: RunState,
    rows: Vec<RunState>,
    /// Each sequence's position, `u32` (bytes, buffer), grown with the batch.
    starts: Option<(u64, wgpu::Buffer)>,
    /// Copy each row's part of the batched values even where it could be bound in place
    /// ([`GpuModel::copy_batched_rows`]).
    copy_rows: bool,
}

/// A sequence's own binding for one batched run: its inputs bound, the caches it appends to in
/// place, and the buffers bound instead of its values' own.
struct Row<'t, 'm> {
    bound: Bound<'t>,
    appends: Vec<Append<'m>>,
    substitutes: Substitutes,
}

impl GpuModel {
    /// Whether [`GpuModel::run_batched`] can run this plan; if not, why (in words that follow
    /// "cannot run sequences together: ").
    pub fn batching(&self) -> Result<(), String> {
        self.batch_plan().map(|_| ())
    }

    /// Whether a batched step copies each sequence's part of the batch's values into and out of
    /// the sequence's own buffers around its own steps even where it could bind the part in place
    /// (off by default; for tests and measurements: every adapter copies a part that a storage
    /// binding cannot start at, see [`GpuModel::run_batched`]).
    pub fn copy_batched_rows(&self, on: bool) -> Result<(), GpuError> {
        self.batch_state.lock().map_err(|_| GpuError::Poisoned("batch state"))?.copy_rows = on;
        Ok(())
    }

    fn batch_plan(&self) -> Result<&BatchPlan, String> {
        let plan = &self.program.plan;
        // A rotating projection takes a position per sequence (`wgsl::step_kernel_at_starts`)
        // where its weight is bound in one buffer (the split kernels read one position).
        let one_buffer =
            |step: &Step| step.operands.iter().all(|o| self.params.get(&root(plan, *o)).is_none_or(|b| b.len() == 1));
        let batched_positions = |step: &Step| matches!(step.op, Op::Linear { rope: Some(_), .. }) && one_buffer(step);
        let made = self.batch.get_or_init(|| BatchPlan::new(plan, |_| false, &HashMap::new(), batched_positions));
        made.as_ref().map_err(Clone::clone)
    }

    /// One step of several sequences together, each running one token after its own cache:
    /// what a cached run ([`GpuModel::run_resident`], keeping the presents) gives each sequence
    /// alone, with the steps that depend on neither positions nor caches run once for all of them
    /// (see the module's docs). Returns the outputs other than the presents, read back,
    /// `[batch, ..]` with sequence `i`'s row `i` (`logits`: `[batch, 1, vocab]`); each present
    /// named by `links` (present, past) becomes its sequence's cache under the past name. On an
    /// error every cache is as it was.
    pub fn run_batched(
        &self,
        seqs: &mut [SeqStep<'_>],
        links: &[(String, String)],
    ) -> Result<Vec<(String, Tensor)>, GpuError> {
        let bp = self.batch_plan().map_err(GpuError::Unbatched)?;
        let (gpu, plan) = (&self.gpu, &self.program.plan);
        let b = seqs.len();
        if b == 0 {
            return Err(GpuError::Invalid("a batched step needs at least one sequence".into()));
        }
        let started = std::time::Instant::now();
        gpu.check_lost()?;
        let presents: Vec<String> = links.iter().map(|(present, _)| present.clone()).collect();
        let is_present = |name: &str| presents.iter().any(|p| p == name);
        for (name, v) in plan.outputs.iter().filter(|(name, _)| !is_present(name)) {
            if bp.modes[root(plan, *v)] != Mode::Batched {
                return Err(GpuError::Unbatched(format!(
                    "its output `{name}` is held per sequence but is not a cache"
                )));
            }
        }

        // Each sequence bound as its own step binds it.
        let mut rows: Vec<Row<'_, '_>> = Vec::with_capacity(b);
        for seq in seqs.iter() {
            let given = HashMap::from([
                (bp.ids.1.clone(), Tensor::i64(vec![1, 1], vec![seq.token])),
                (PAST_LEN.to_string(), Tensor::i64(vec![1], vec![seq.past as i64])),
            ]);
            let bound = self.bind_inputs(&given, seq.cache)?;
            let appends = self.appends_in_place(&given, &bound.resident, &presents, &bound.syms)?;
            let substitutes = self.substitutes(&appends, &bound.resident)?;
            rows.push(Row { bound, appends, substitutes });
        }
        let mut syms = rows[0].bound.syms.clone();
        syms.insert(Sym::Batch, b);
        let tokens = Tensor::i64(vec![b, 1], seqs.iter().map(|s| s.token).collect());
        let host = HashMap::from([(bp.ids.0, tokens)]);
        let (no_resident, no_instead, no_parts) = (HashMap::new(), HashMap::new(), HashMap::new());

        let mut state = self.batch_state.lock().map_err(|_| GpuError::Poisoned("batch state"))?;
        let BatchState { whole, rows: row_states, starts, copy_rows } = &mut *state;
        if row_states.len() < b {
            row_states.resize_with(b, RunState::default);
        }
        let positions: Vec<u32> = seqs.iter().map(|s| u32::try_from(s.past).unwrap_or(u32::MAX)).collect();
        let bytes = 4 * b as u64;
        if starts.as_ref().is_none_or(|(have, _)| *have < bytes) {
            *starts = Some((bytes, gpu.buffer("each sequence's position", bytes, STORAGE)?));
        }
        let starts = starts.as_ref().map(|(_, buffer)| buffer);
        if let Some(buffer) = starts {
            gpu.queue.write_buffer(buffer, 0, bytemuck::cast_slice(&positions));
        }
        let batched = |i: usize| bp.steps[i] == Exec::Batched;
        let per_row = |i: usize| matches!(bp.steps[i], Exec::PerRow | Exec::Append(_));
        self.upload_inputs(whole, &host)?;
        self.grow_buffers(whole, &syms, &[], &mut HashMap::new())?;
        let whole_at =
            Placement { syms: &syms, resident: &no_resident, instead: &no_instead, starts, parts: &no_parts, row: 0 };
        let whole_grids = self.encode_part(whole, whole_at, &[], &batched)?;
        let whole_buffers = whole.buffers(self, whole_at);
        // The batched values the rows' own steps read or write, each row's part bound in place
        // in the batch's buffer where a storage binding can start there (else copied in and
        // out of the row's own slot around its steps): by value, the buffer and a row's bytes.
        let row_tables: Vec<_> = rows.iter().map(|row| kiln_compiler::graph::SymTable::new(&row.bound.syms)).collect();
        let align = u64::from(gpu.limits.min_storage_buffer_offset_alignment).max(4);
        let mut in_place: HashMap<usize, (wgpu::Buffer, u64)> = HashMap::new();
        for step in plan.steps.iter().enumerate().filter(|(i, _)| per_row(*i)).map(|(_, step)| step) {
            let values =
                std::iter::once(step.output).chain(step.operands.iter().copied()).chain(step.also.iter().copied());
            for v in values.map(|v| root(plan, v)) {
                let input =
                    matches!(plan.values[v].storage, Storage::Input { .. } | Storage::Param(_) | Storage::Const);
                if *copy_rows || bp.modes[v] != Mode::Batched || input || in_place.contains_key(&v) {
                    continue;
                }
                // Every row's part the same size (so row `r`'s at `r` parts), whole in one buffer.
                let bytes_of = |t: &kiln_compiler::graph::SymTable| 4 * t.elements(&plan.values[v].shape) as u64;
                let bytes = bytes_of(&row_tables[0]);
                let same = row_tables.iter().all(|t| bytes_of(t) == bytes);
                if let ([whole_buffer], true) = (whole_buffers.of(v), same)
                    && bytes > 0
                    && bytes.is_multiple_of(align)
                    && whole_buffer.size() >= b as u64 * bytes
                {
                    in_place.insert(v, (whole_buffer.clone(), bytes));
                }
            }
        }
        let mut row_grids: Vec<Grids> = Vec::with_capacity(b);
        for (r, (row, st)) in rows.iter_mut().zip(row_states.iter_mut()).enumerate() {
            let Row { bound, appends, substitutes } = row;
            self.upload_inputs(st, &bound.host)?;
            self.grow_buffers(st, &bound.syms, appends, &mut substitutes.instead)?;
            let at = Placement {
                syms: &bound.syms,
                resident: &bound.resident,
                instead: &substitutes.instead,
                starts: None,
                parts: &in_place,
                row: r as u64,
            };
            row_grids.push(self.encode_part(st, at, appends, &per_row)?);
        }

        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch") });
        for row in &rows {
            for c in &row.substitutes.copies {
                c.record(&mut encoder, 0, gpu.chunk_bytes)?;
            }
        }
        let row_buffers: Vec<Buffers<'_>> = rows
            .iter()
            .zip(row_states.iter())
            .enumerate()
            .map(|(r, (row, st))| {
                let (syms, resident, instead) = (&row.bound.syms, &row.bound.resident, &row.substitutes.instead);
                st.buffers(self, Placement { syms, resident, instead, starts: None, parts: &in_place, row: r as u64 })
            })
            .collect();
        // Each row's part of a batched value and the row's own copy, copied one way or the other.
        let copy_parts = |encoder: &mut wgpu::CommandEncoder, v: usize, into_rows: bool| -> Result<(), GpuError> {
            for (r, rb) in row_buffers.iter().enumerate() {
                let bytes = 4 * rb.table.elements(&plan.values[v].shape) as u64;
                let (part, own) = ((whole_buffers.of(v), r as u64 * bytes), (rb.of(v), 0));
                let (from, to) = if into_rows { (part, own) } else { (own, part) };
                copy_range(encoder, from, to, bytes, gpu.chunk_bytes)?;
            }
            Ok(())
        };
        // Batched values whose rows' copies hold the current data (written per row this run).
        let mut in_rows: HashSet<usize> = HashSet::new();
        // Whether step `i`, run per row, reads or writes a batched value through copies (one not
        // bound in place).
        let copied = |i: usize| {
            let step = &plan.steps[i];
            let values =
                std::iter::once(step.output).chain(step.operands.iter().copied()).chain(step.also.iter().copied());
            values.map(|v| root(plan, v)).any(|v| {
                let input = matches!(plan.values[v].storage, Storage::Input { .. });
                bp.modes[v] == Mode::Batched && !input && !in_place.contains_key(&v)
            })
        };
        let mut i = 0;
        while i < plan.steps.len() {
            let step = &plan.steps[i];
            match bp.steps[i] {
                Exec::Skip => i += 1,
                Exec::Batched => {
                    let end = (i..plan.steps.len()).find(|&j| per_row(j)).unwrap_or(plan.steps.len());
                    let groups = (&whole.bind_groups[..], &whole.second_groups[..]);
                    super::run::record_forward(&mut encoder, groups, &whole_grids, i..end)?;
                    i = end;
                }
                Exec::PerRow | Exec::Append(_) if !copied(i) => {
                    // A run of per-row steps whose batched values are all bound in place: one
                    // pass, each step dispatched for every row in turn.
                    let end = (i..plan.steps.len())
                        .find(|&j| !(bp.steps[j] == Exec::Skip || (per_row(j) && !copied(j))))
                        .unwrap_or(plan.steps.len());
                    let mut pass = encoder
                        .begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                    for j in (i..end).filter(|&j| per_row(j)) {
                        for (st, grids) in row_states.iter().zip(&row_grids) {
                            dispatch_steps(&mut pass, (&st.bind_groups, &st.second_groups), grids, j..j + 1)?;
                        }
                    }
                    i = end;
                }
                Exec::PerRow | Exec::Append(_) => {
                    for &o in &step.operands {
                        let v = root(plan, o);
                        let input = matches!(plan.values[v].storage, Storage::Input { .. });
                        if bp.modes[v] == Mode::Batched && !input && !in_place.contains_key(&v) && in_rows.insert(v) {
                            copy_parts(&mut encoder, v, true)?;
                        }
                    }
                    {
                        let mut pass = encoder
                            .begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                        for (st, grids) in row_states.iter().zip(&row_grids) {
                            dispatch_steps(&mut pass, (&st.bind_groups, &st.second_groups), grids, i..i + 1)?;
                        }
                    }
                    for v in std::iter::once(step.output).chain(step.also.iter().copied()) {
                        let v = root(plan, v);
                        if bp.modes[v] == Mode::Batched && !in_place.contains_key(&v) {
                            in_rows.insert(v);
                            copy_parts(&mut encoder, v, false)?;
                        }
                    }
                    i += 1;
                }
            }
        }
        let not_present = |name: &str| !is_present(name);
        let (readbacks, _) = self.record_outputs(&mut encoder, &whole_buffers, &[], &[], None, &not_present)?;
        let mut kept = Vec::with_capacity(b);
        for (row, rb) in rows.iter().zip(&row_buffers) {
            kept.push(self.record_outputs(&mut encoder, rb, &row.appends, &presents, None, &is_present)?.1);
        }
        gpu.queue.submit([encoder.finish()]);
        self.host.add(started.elapsed());
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Rejected { what: "a batched step", message: e.to_string() });
        }
        let outputs = read_outputs(gpu, readbacks)?;
        drop(row_buffers);
        drop(rows);
        // Every sequence's presents found before any becomes a cache: all caches move, or none.
        let mut caches = Vec::with_capacity(b);
        for mut kept in kept {
            let cache = links
                .iter()
                .map(|(present, past)| match kept.remove(present) {
                    Some(t) => Ok((past.clone(), t)),
                    None => Err(GpuError::Internal(format!("the batched step kept no `{present}`"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            caches.push(cache);
        }
        for (seq, cache) in seqs.iter_mut().zip(caches) {
            seq.cache.extend(cache);
        }
        Ok(outputs)
    }
}
