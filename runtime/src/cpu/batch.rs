//! Several sequences' decode steps as one run: continuous batching's step
//! ([`CpuModel::run_batched`]).
//!
//! How the plan runs batched is [`crate::batching`]'s (shared with the wgpu engine); on the CPU,
//! a projection whose epilogue rotates (RoPE) and a `heads` step that rotates run once over the
//! batch, each row at its own sequence's position ([`Positions::PerSequence`]), learned positions
//! (`positions` then its gathers) once per sequence, and the appends of each sequence's keys and
//! values write into its own cache buffer ([`Exec::Append`]).
//!
//! What each sequence's part computes is what its own step would compute: the same kernels on
//! the same rows (a projection's rows are independent), each sequence bound and checked as its
//! own step binds it (its cache lengths, its token against the tables). A plan this cannot run
//! is refused with the reason ([`CpuModel::batching`]); its sequences take turns.

use super::cache::{AppendSite, CacheBuf, KvCache};
use super::{Arg, Buf, CpuError, CpuModel, Positions, R, cache_copies, elementwise, poll, read_copies, scoped};
use crate::batching::{BatchPlan, Exec, Mode};
use crate::prepare::{self, root};
use kiln_compiler::back::cpu as back;
use kiln_compiler::graph::{Op, Sym};
use kiln_compiler::interp::PAST_LEN;
use kiln_compiler::lower::{Storage, resolve};
use kiln_compiler::tensor::{DType, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

/// One sequence of a batched step: its cache, the token it runs, and the tokens before it (where
/// its token's position is; a sliding window's cache may hold fewer).
pub struct SeqStep<'a> {
    /// The sequence's cache: read in place, appended to on success, as it was on an error.
    pub cache: &'a mut KvCache,
    /// The token to run.
    pub token: i64,
    /// Tokens before it.
    pub past: usize,
}

impl BatchPlan {
    /// How `model`'s plan runs batched on the CPU, or why it cannot: the weights read in place
    /// are not run, the appends run in place, and projections and `heads` steps that rotate take
    /// a position per row ([`Positions::PerSequence`]; the reference form's interpreter ops know
    /// one position only).
    pub(super) fn of(model: &CpuModel) -> Result<BatchPlan, String> {
        let sites: HashMap<usize, usize> = model.appends.iter().enumerate().map(|(k, a)| (a.step, k)).collect();
        let plan = &model.plan;
        BatchPlan::new(
            plan,
            |i| model.skipped.contains(&i),
            &sites,
            |step| {
                !model.reference
                    && plan.values[step.output].dtype == DType::F32
                    && matches!(step.op, Op::Linear { .. } | Op::Heads { .. })
            },
        )
    }
}

/// A sequence's own binding: its symbols, its inputs bound (the empty caches it does not hold
/// yet), the values that are its cache buffers (by past name) and its position.
struct Row {
    syms: HashMap<Sym, usize>,
    inputs: HashMap<usize, Cow<'static, Tensor>>,
    views: HashMap<usize, String>,
    past: usize,
}

impl CpuModel {
    /// Whether [`CpuModel::run_batched`] can run this plan; if not, why (in words that follow
    /// "cannot run sequences together: ").
    pub fn batching(&self) -> Result<(), String> {
        self.batch_plan().map(|_| ())
    }

    fn batch_plan(&self) -> Result<&BatchPlan, String> {
        self.batch.get_or_init(|| BatchPlan::of(self)).as_ref().map_err(Clone::clone)
    }

    /// One step of several sequences together, each running one token after its own cache:
    /// what [`CpuModel::run_cached`] gives each sequence alone, with every weight read once for
    /// all of them (see the module's docs). Returns the outputs other than the presents,
    /// `[batch, ..]` with sequence `i`'s row `i` (`logits`: `[batch, 1, vocab]`); each present
    /// named by `links` becomes its sequence's cache. On an error every cache is as it was.
    pub fn run_batched(&self, seqs: &mut [SeqStep<'_>], links: &[(String, String)]) -> R<Vec<(String, Tensor)>> {
        let bp = self.batch_plan().map_err(CpuError::Unbatched)?;
        let plan = &self.plan;
        let b = seqs.len();
        if b == 0 {
            return Err(CpuError::Operands("a batched step needs at least one sequence".into()));
        }
        let linked: HashSet<(&str, &str)> = links.iter().map(|(p, q)| (p.as_str(), q.as_str())).collect();
        if let Some(site) = self.appends.iter().find(|a| !linked.contains(&(a.present.as_str(), a.past.as_str()))) {
            return Err(CpuError::Unbatched(format!(
                "its present `{}` is not linked to `{}`",
                site.present, site.past
            )));
        }
        // Each sequence bound as its own step binds it.
        let mut rows: Vec<Row> = Vec::with_capacity(b);
        for seq in seqs.iter() {
            let given = HashMap::from([
                (bp.ids.1.clone(), Tensor::i64(vec![1, 1], vec![seq.token])),
                (PAST_LEN.to_string(), Tensor::i64(vec![1], vec![seq.past as i64])),
            ]);
            let held: HashMap<&str, Vec<usize>> = seq.cache.iter().map(|(n, c)| (n.as_str(), c.shape())).collect();
            let bound = prepare::bind_values(plan, &bp.inputs, &given, &held)?;
            let (mut inputs, mut views): (HashMap<usize, Cow<'static, Tensor>>, _) = (HashMap::new(), HashMap::new());
            for ((id, tensor), name) in bound.inputs.into_iter().zip(&bound.names) {
                match tensor {
                    Some(t) => drop(inputs.insert(id, Cow::Owned(t))),
                    None if held.contains_key(name.as_str()) => drop(views.insert(id, name.clone())),
                    None => return Err(CpuError::MissingInput(name.clone())),
                }
            }
            let by_value: HashMap<usize, &Tensor> = inputs.iter().map(|(&id, t)| (id, t.as_ref())).collect();
            prepare::check_indices(plan, &by_value, &bound.syms)?;
            rows.push(Row { syms: bound.syms, inputs, views, past: seq.past });
        }
        let mut syms = rows[0].syms.clone();
        syms.insert(Sym::Batch, b);
        let tokens: Vec<i64> = seqs.iter().map(|s| s.token).collect();
        let batch_inputs: HashMap<usize, Cow<'_, Tensor>> =
            HashMap::from([(bp.ids.0, Cow::Owned(Tensor::i64(vec![b, 1], tokens)))]);
        let starts: Vec<usize> = seqs.iter().map(|s| s.past).collect();

        let mut state = self.slots.lock().map_err(|_| CpuError::Poisoned)?;
        let mut slots = std::mem::take(&mut *state);
        if slots.len() < plan.slots {
            slots.resize_with(plan.slots, || Buf::F32(Vec::new()));
        }
        // Per sequence: the cache buffers this run creates (removed again on an error), and the
        // rows each appended one holds once the run succeeds.
        let mut created: Vec<Vec<String>> = vec![Vec::new(); b];
        let mut appended: Vec<HashMap<String, usize>> = vec![HashMap::new(); b];
        let mut per_row: HashMap<usize, Vec<Buf>> = HashMap::new();
        let (none, no_views) = (KvCache::new(), HashMap::new());
        let run = poll::polling(&self.pool, || -> R<()> {
            for (i, step) in plan.steps.iter().enumerate() {
                let start = self.step_times.as_ref().map(|_| std::time::Instant::now());
                match bp.steps[i] {
                    Exec::Skip => {}
                    Exec::Batched => {
                        let positions = Positions::PerSequence(&starts);
                        self.step(step, &batch_inputs, &mut slots, &syms, &no_views, &none, positions)?;
                    }
                    Exec::Append(k) => {
                        let site: &AppendSite = &self.appends[k];
                        for (r, (row, seq)) in rows.iter_mut().zip(seqs.iter_mut()).enumerate() {
                            let args = [step.operands[1]]
                                .into_iter()
                                .chain(step.operands.get(2).copied())
                                .map(|o| self.row_arg(bp, o, r, row, &batch_inputs, &syms, &slots, &per_row, &none))
                                .collect::<R<Vec<_>>>()?;
                            let x = args[0].1.f32("x").map_err(|e| scoped(e, &step.scope, &step.op))?;
                            let gain = match args.get(1) {
                                Some((_, g)) => Some(g.f32("the gain").map_err(|e| scoped(e, &step.scope, &step.op))?),
                                None => None,
                            };
                            if !seq.cache.contains_key(&site.past) {
                                let (heads, d) = match &step.op {
                                    Op::Heads { heads, head_dim, .. } => (*heads, *head_dim),
                                    _ => {
                                        return Err(CpuError::Internal(format!("`{}`: not a heads step", step.scope)));
                                    }
                                };
                                seq.cache.insert(site.past.clone(), CacheBuf::empty(1, heads, d));
                                created[r].push(site.past.clone());
                            }
                            let buf = seq
                                .cache
                                .get_mut(&site.past)
                                .ok_or_else(|| CpuError::Cache("the cache vanished".into()))?;
                            let held = elementwise::append_heads(&step.op, &args[0].0, x, gain, row.past, buf)
                                .map_err(|e| scoped(e, &step.scope, &step.op))?;
                            appended[r].insert(site.past.clone(), held);
                            row.views.insert(root(plan, step.output), site.past.clone());
                        }
                    }
                    Exec::PerRow => {
                        let out = step.output;
                        let Storage::Slot(s) = plan.values[out].storage else {
                            return Err(CpuError::Internal(format!("`{}`: a step writes no slot", step.scope)));
                        };
                        // Each sequence's part, the sequences spread over the pool (a part's
                        // kernel may spread its own work too: a decode step's attention has a
                        // task per key/value head, too few alone to keep the threads busy).
                        let parts: Vec<(Buf, usize)> = rows
                            .par_iter()
                            .zip(seqs.par_iter())
                            .enumerate()
                            .map(|(r, (row, seq))| -> R<(Buf, usize)> {
                                let shape = resolve(&plan.values[out].shape, &row.syms);
                                let mut part = Buf::F32(Vec::new());
                                let kv: &KvCache = seq.cache;
                                self.row_step(
                                    bp,
                                    step,
                                    r,
                                    row,
                                    kv,
                                    &batch_inputs,
                                    &syms,
                                    &slots,
                                    &per_row,
                                    &shape,
                                    &mut part,
                                )
                                .map_err(|e| scoped(e, &step.scope, &step.op))?;
                                Ok((part, shape.iter().product()))
                            })
                            .collect::<R<_>>()?;
                        if bp.modes[out] == Mode::Batched {
                            let mut whole = std::mem::replace(&mut slots[s], Buf::F32(Vec::new()));
                            let written = parts
                                .iter()
                                .enumerate()
                                .try_for_each(|(r, (part, n))| write_row(&mut whole, part, r, b, *n));
                            slots[s] = whole;
                            written?;
                        } else {
                            per_row.insert(out, parts.into_iter().map(|(part, _)| part).collect());
                        }
                    }
                }
                self.note_step(i, start);
            }
            Ok(())
        });
        self.note_run();
        let presents: HashMap<&str, &str> = links.iter().map(|(p, q)| (p.as_str(), q.as_str())).collect();
        let outputs = run.and_then(|()| {
            let mut outputs = Vec::new();
            // Per sequence: presents that replace its cache (a plan that concatenates them).
            let mut replaced: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); b];
            for (name, v) in &plan.outputs {
                let r = root(plan, *v);
                match (bp.modes[r], presents.get(name.as_str())) {
                    (Mode::Cache, Some(_)) => {} // appended in place
                    (Mode::Rows, Some(past)) => {
                        for (seq, row) in replaced.iter_mut().enumerate() {
                            let shape = resolve(&plan.values[*v].shape, &rows[seq].syms);
                            let data = match per_row.get(&r).and_then(|p| p.get(seq)) {
                                Some(Buf::F32(x)) => x.get(..shape.iter().product()).map(<[f32]>::to_vec),
                                _ => None,
                            };
                            let data =
                                data.ok_or_else(|| CpuError::Cache(format!("the step did not produce `{name}`")))?;
                            row.push((past.to_string(), Tensor::f32(shape, data)));
                        }
                    }
                    (Mode::Batched, _) => {
                        let (shape, arg) = self.arg(*v, &batch_inputs, &slots, &syms, &no_views, &none)?;
                        let t = match arg {
                            Arg::F32(x) => Tensor::f32(shape, self.output_buffer(x)),
                            Arg::I64(x) => Tensor::i64(shape, x.to_vec()),
                            _ => return Err(CpuError::Internal(format!("output `{name}` is not a tensor"))),
                        };
                        outputs.push((name.clone(), t));
                    }
                    (mode, _) => {
                        return Err(CpuError::Unbatched(format!(
                            "its output `{name}` is held per sequence ({mode:?}) but is not a cache"
                        )));
                    }
                }
            }
            Ok((outputs, replaced))
        });
        *state = slots;
        match outputs {
            Ok((outputs, replaced)) => {
                for (seq, (appended, replaced)) in seqs.iter_mut().zip(appended.into_iter().zip(replaced)) {
                    for (past, held) in appended {
                        if let Some(buf) = seq.cache.get_mut(&past) {
                            buf.set_len(held);
                        }
                    }
                    for (past, t) in replaced {
                        let buf = CacheBuf::from_tensor(t).ok_or_else(|| {
                            CpuError::Cache(format!("`{past}` is not an f32 [b, heads, len, d] tensor"))
                        })?;
                        seq.cache.insert(past, buf);
                    }
                }
                Ok(outputs)
            }
            Err(e) => {
                for (seq, created) in seqs.iter_mut().zip(created) {
                    for name in created {
                        seq.cache.remove(&name);
                    }
                }
                Err(e)
            }
        }
    }

    /// Operand `o` of sequence `r`'s part of a step, at that sequence's shape: a shared value
    /// whole, its part of a batched one, its own of one held per sequence, its own cache.
    #[expect(clippy::too_many_arguments, reason = "the run's state, borrowed apart")]
    fn row_arg<'a>(
        &'a self,
        bp: &BatchPlan,
        o: usize,
        r: usize,
        row: &'a Row,
        batch_inputs: &'a HashMap<usize, Cow<'_, Tensor>>,
        syms: &HashMap<Sym, usize>,
        slots: &'a [Buf],
        per_row: &'a HashMap<usize, Vec<Buf>>,
        kv: &'a KvCache,
    ) -> R<(Vec<usize>, Arg<'a>)> {
        let plan = &self.plan;
        let v = root(plan, o);
        let shape = resolve(&plan.values[o].shape, &row.syms);
        let n: usize = shape.iter().product();
        let missing = || CpuError::Internal(format!("value {o} has no part for sequence {r}"));
        let arg = match bp.modes[v] {
            Mode::Shared => return self.arg(o, batch_inputs, slots, syms, &HashMap::new(), kv),
            Mode::Cache => return self.arg(o, &row.inputs, &[], &row.syms, &row.views, kv),
            Mode::Batched => match self.arg(o, batch_inputs, slots, syms, &HashMap::new(), kv)?.1 {
                Arg::F32(x) => Arg::F32(x.get(r * n..(r + 1) * n).ok_or_else(missing)?),
                Arg::I64(x) => Arg::I64(x.get(r * n..(r + 1) * n).ok_or_else(missing)?),
                _ => return Err(missing()),
            },
            Mode::Rows => match per_row.get(&v).and_then(|p| p.get(r)).ok_or_else(missing)? {
                Buf::F32(x) => Arg::F32(x.get(..n).ok_or_else(missing)?),
                Buf::I64(x) => Arg::I64(x.get(..n).ok_or_else(missing)?),
            },
        };
        Ok((shape, arg))
    }

    /// Sequence `r`'s part of `step` into `out`, at its output shape `shape` and its position.
    #[expect(clippy::too_many_arguments, reason = "the run's state, borrowed apart")]
    fn row_step(
        &self,
        bp: &BatchPlan,
        step: &kiln_compiler::lower::Step,
        r: usize,
        row: &Row,
        kv: &KvCache,
        batch_inputs: &HashMap<usize, Cow<'_, Tensor>>,
        syms: &HashMap<Sym, usize>,
        slots: &[Buf],
        per_row: &HashMap<usize, Vec<Buf>>,
        shape: &[usize],
        out: &mut Buf,
    ) -> R<()> {
        let plan = &self.plan;
        let args: Vec<(Vec<usize>, Arg<'_>)> = step
            .operands
            .iter()
            .enumerate()
            .map(|(i, &o)| match back::reads_as_weight(&step.op, i).then(|| self.weight(o)).flatten() {
                Some(w) => Ok((resolve(&plan.values[o].shape, &row.syms), w?)),
                None => self.row_arg(bp, o, r, row, batch_inputs, syms, slots, per_row, kv),
            })
            .collect::<R<_>>()?;
        let copies = cache_copies(&step.op, &args);
        let args = read_copies(args, &copies);
        let dtype = plan.values[step.output].dtype;
        self.exec(&step.op, &args, out, dtype, shape, Positions::From(row.past))
    }
}

/// Writes `part` (the first `n` elements of one sequence's result) as part `r` of `b` of `whole`,
/// which is made a buffer of `b * n` elements of the part's type.
fn write_row(whole: &mut Buf, part: &Buf, r: usize, b: usize, n: usize) -> R<()> {
    fn put<T: Copy + Default>(whole: &mut Vec<T>, part: &[T], r: usize, b: usize, n: usize) -> Option<()> {
        if whole.len() < b * n {
            whole.resize(b * n, T::default());
        }
        whole.get_mut(r * n..(r + 1) * n)?.copy_from_slice(part.get(..n)?);
        Some(())
    }
    match (part, &mut *whole) {
        (Buf::F32(_), Buf::I64(_)) => *whole = Buf::F32(Vec::new()),
        (Buf::I64(_), Buf::F32(_)) => *whole = Buf::I64(Vec::new()),
        _ => {}
    }
    let written = match (part, whole) {
        (Buf::F32(p), Buf::F32(w)) => put(w, p, r, b, n),
        (Buf::I64(p), Buf::I64(w)) => put(w, p, r, b, n),
        _ => None,
    };
    written.ok_or_else(|| CpuError::Internal(format!("a result of {n} elements for sequence {r} is short")))
}
