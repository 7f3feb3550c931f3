//! The key/value caches a run appends to in place on the device: which steps can
//! ([`in_place_sites`], at load), which of them do in a given run ([`GpuModel::appends_in_place`]:
//! a cache with room, grown to twice the room when full), and the copies of cache rows between
//! buffers ([`CacheCopy`]).

#![expect(
    clippy::indexing_slicing,
    reason = "value and step indices come from a plan `Plan::check` bounded, and the sites from \
              `append_sites` over that plan"
)]

use super::tensor::{STORAGE, copy_range};
use super::{DeviceTensor, GpuError, GpuModel};
use kiln_compiler::back::wgsl;
use kiln_compiler::graph::{Sym, SymTable};
use kiln_compiler::lower::{Plan, Storage};
use kiln_compiler::tensor::Tensor;
use std::collections::{HashMap, HashSet};

/// A step that appends to a cache in place on the device ([`crate::prepare::append_sites`]),
/// whose present only attentions read as keys or values, through the row strides their sizes
/// give (`wgsl::reads_strided_keys`): they then read the cache buffer itself, with room for more
/// rows than it holds, and the step writes only its new rows there.
#[derive(Clone, Debug)]
pub(super) struct InPlace {
    pub(super) site: crate::prepare::AppendSite,
    /// The present's value (the step's output, through reshapes).
    pub(super) present_value: usize,
    /// The steps reading the present, and as which of their operands (1: keys, 2: values).
    pub(super) readers: Vec<(usize, usize)>,
    /// The step is a cached attention that appends to both caches itself (`fold_appends`), the
    /// present one of its extra outputs: it appends to both in place or to neither.
    pub(super) folded: bool,
}

/// The `rows` rows of each of `heads` heads of width `d` copied from one cache buffer to another,
/// each given with its rows of room per head.
pub(super) struct CacheCopy {
    pub(super) from: (Vec<wgpu::Buffer>, usize),
    pub(super) to: (Vec<wgpu::Buffer>, usize),
    pub(super) heads: usize,
    pub(super) rows: usize,
    pub(super) d: usize,
}

impl CacheCopy {
    /// Records the copy on `encoder`, one range per head, the rows read from row `skip` of each
    /// source head; buffers are chunks of `chunk` bytes.
    pub(super) fn record(&self, encoder: &mut wgpu::CommandEncoder, skip: usize, chunk: u64) -> Result<(), GpuError> {
        let row_bytes = 4 * self.d as u64;
        for h in 0..self.heads as u64 {
            let from = (h * self.from.1 as u64 + skip as u64) * row_bytes;
            let to = h * self.to.1 as u64 * row_bytes;
            copy_range(encoder, (&self.from.0, from), (&self.to.0, to), self.rows as u64 * row_bytes, chunk)?;
        }
        Ok(())
    }
}

/// A cache one run appends to in place.
pub(super) struct Append<'m> {
    pub(super) site: &'m InPlace,
    /// The cache's buffer, with room for `room` rows per head.
    pub(super) buffer: wgpu::Buffer,
    pub(super) room: usize,
    /// `[b * heads, .., d]` of the cache, and the rows it holds before the step.
    pub(super) heads: usize,
    pub(super) d: usize,
    pub(super) held: usize,
    /// The buffer (and its room) the held rows are copied from first, when it grew.
    pub(super) grown_from: Option<(Vec<wgpu::Buffer>, usize)>,
}

/// The appends of `plan` (a legalized plan) that can run in place.
pub(super) fn in_place_sites(plan: &Plan) -> Vec<InPlace> {
    let root = |v: usize| crate::prepare::root(plan, v);
    let mut sites = Vec::new();
    for site in crate::prepare::append_sites(plan) {
        let present_value = root(plan.steps[site.step].output);
        let mut readers = Vec::new();
        let mut strided = true;
        for (i, step) in plan.steps.iter().enumerate() {
            for (j, &o) in step.operands.iter().enumerate() {
                if root(o) == present_value {
                    strided &= (j == 1 || j == 2) && wgsl::reads_strided_keys(plan, step);
                    readers.push((i, j));
                }
            }
            strided &= !step.also.iter().any(|&a| root(a) == present_value);
        }
        strided &= !plan.folds.iter().any(|f| f.operands.iter().any(|&o| root(o) == present_value));
        if strided {
            sites.push(InPlace { site, present_value, readers, folded: false });
        }
    }
    // Cached attentions appending themselves: their pasts read by nothing else, their presents
    // only outputs.
    let read = |v: usize| {
        plan.steps.iter().flat_map(|s| &s.operands).filter(|&&o| root(o) == v).count()
            + plan.folds.iter().flat_map(|f| &f.operands).filter(|&&o| root(o) == v).count()
    };
    for (i, step) in plan.steps.iter().enumerate() {
        let (
            kiln_compiler::graph::Op::PackedAttention(kiln_compiler::graph::PackedAttention { appends: true, .. }),
            [_, pk, pv, ..],
            &[ak, av],
        ) = (&step.op, step.operands.as_slice(), step.also.as_slice())
        else {
            continue;
        };
        let site = |past_operand: usize, present: usize| -> Option<InPlace> {
            let (past_value, present_value) = (root(past_operand), root(present));
            let Storage::Input { name: past, .. } = &plan.values[past_value].storage else { return None };
            let names: Vec<&String> =
                plan.outputs.iter().filter(|(_, o)| root(*o) == present_value).map(|(n, _)| n).collect();
            let ([name], 1, 0) = (names.as_slice(), read(past_value), read(present_value)) else { return None };
            let site = crate::prepare::AppendSite { step: i, past_value, past: past.clone(), present: (*name).clone() };
            Some(InPlace { site, present_value, readers: Vec::new(), folded: true })
        };
        if let (Some(k), Some(v)) = (site(*pk, ak), site(*pv, av)) {
            sites.extend([k, v]);
        }
    }
    sites
}

impl GpuModel {
    /// The caches this run appends to in place: each site whose past is held on the device
    /// (`resident`, by value) or not given at all (empty), and whose present is kept, where the
    /// cache and every binding of the attentions reading it fit in one buffer (the chunked
    /// kernels take no strides). A cache without room for the new rows moves to a buffer with
    /// twice the room (amortized O(1) per row), at least 16 rows.
    pub(super) fn appends_in_place(
        &self,
        given: &HashMap<String, Tensor>,
        resident: &HashMap<usize, &DeviceTensor>,
        keep: &[String],
        syms: &HashMap<Sym, usize>,
    ) -> Result<Vec<Append<'_>>, GpuError> {
        let plan = &self.program.plan;
        let gpu = &self.gpu;
        let table = SymTable::new(syms);
        let fits = |v: usize| 4 * table.elements(&plan.values[v].shape) as u64 <= gpu.chunk_bytes;
        let keep: HashSet<&str> = keep.iter().map(String::as_str).collect();
        let mut appends = Vec::new();
        let mut shape = Vec::new();
        for site in &self.in_place {
            if !keep.contains(site.site.present.as_str()) || given.contains_key(&site.site.past) {
                continue;
            }
            table.resolve_into(&plan.values[site.present_value].shape, &mut shape);
            let &[b, h, rows, d] = shape.as_slice() else { continue };
            let held = resident.get(&site.site.past_value);
            let (len, room) = match held {
                Some(t) => match t.heads()? {
                    (heads, len, hd, room) if heads == b * h && hd == d => (len, room),
                    _ => continue,
                },
                None => (0, 0),
            };
            // The steps whose kernels take the room: every binding in one buffer.
            let past = site.site.past_value;
            let mut steps = site.readers.iter().map(|&(r, _)| r).chain(site.folded.then_some(site.site.step));
            let readers_fit = steps.all(|r| {
                let step = &plan.steps[r];
                fits(step.output)
                    && (step.operands.iter())
                        .map(|&o| crate::prepare::root(plan, o))
                        .all(|o| o == site.present_value || o == past || fits(o))
            });
            let reuse = held.filter(|t| room >= rows && t.buffers.len() == 1);
            let new_room = if reuse.is_some() { room } else { rows.max(2 * room).max(16) };
            let bytes = 4 * (b * h * new_room * d) as u64;
            if !readers_fit || bytes > gpu.chunk_bytes || len > rows {
                continue;
            }
            let (buffer, grown_from) = match reuse {
                Some(t) => (t.buffers[0].clone(), None),
                None => {
                    kiln_compiler::memory::check(|| "the key/value cache".to_string(), bytes)?;
                    let buffer = gpu.buffer("the key/value cache", bytes, STORAGE)?;
                    (buffer, held.filter(|_| len > 0).map(|t| (t.buffers.clone(), room)))
                }
            };
            appends.push(Append { site, buffer, room: new_room, heads: b * h, d, held: len, grown_from });
        }
        // A folded attention appends to both its caches in place, with one room, or to neither.
        let mut by_step: HashMap<usize, Vec<usize>> = HashMap::new();
        for a in appends.iter().filter(|a| a.site.folded) {
            by_step.entry(a.site.site.step).or_default().push(a.room);
        }
        let paired = |a: &Append<'_>| {
            let same = by_step.get(&a.site.site.step).map_or(&[][..], Vec::as_slice);
            !a.site.folded || (same.len() == 2 && same[0] == same[1])
        };
        let keep: Vec<bool> = appends.iter().map(paired).collect();
        Ok(appends.into_iter().zip(keep).filter(|(_, k)| *k).map(|(a, _)| a).collect())
    }
}
