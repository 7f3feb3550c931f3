//! What every engine does with a [`Plan`] before its own kernels run, shared by the wgpu
//! ([`crate::gpu`]) and native CPU ([`crate::cpu`]) back ends so they cannot drift apart:
//!
//! - [`constants`]: the parameters a plan's steps read, and its load-time folds evaluated on the
//!   host (by the reference interpreter, or on quantized blocks for the folds that keep them);
//! - [`bind`]: run-time inputs bound exactly as the interpreter binds them (defaults, mask
//!   polarity, symbol values), inputs already held by the engine (a cache) by shape only;
//! - [`check_indices`]: token ids and positions checked against the tables they index, which a
//!   kernel would otherwise clamp (wgpu) or read out of bounds of, and a loss's labels against the
//!   vocabulary;
//! - [`append_sites`]: the steps that can append to a session's cache in place.

#![expect(
    clippy::indexing_slicing,
    reason = "a plan is lowered from a checked graph or read from an artifact, whose `Plan::check` \
              bounds its value indices; the fold and step tables are built from the plan itself"
)]

use crate::progress::{Counter, Phase, Progress};
use crate::quant::QuantWeight;
use kiln_compiler::graph::{Dim, InputRole, Op, Sym};
use kiln_compiler::interp::{InputSpec, InterpError, bind_named_with};
use kiln_compiler::lower::{Plan, Storage, resolve};
use kiln_compiler::tensor::Tensor;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

/// Why a plan cannot be prepared or its inputs bound.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// A parameter, fold or input failed the interpreter's checks.
    #[error(transparent)]
    Interp(#[from] InterpError),
    /// The plan and what was given for it disagree.
    #[error("{0}")]
    Invalid(String),
}

/// The constants a plan's steps read: parameters (borrowed from the caller) and fold results
/// (owned), as f32 tensors or as quantized blocks, by value index.
pub struct Constants<'a> {
    /// f32 constants.
    pub host: HashMap<usize, Cow<'a, Tensor>>,
    /// Block-quantized constants (parameters' blocks, and folds that keep blocks).
    pub quant: HashMap<usize, Cow<'a, QuantWeight>>,
}

/// The value whose storage `v` uses (following reshape aliases).
pub fn root(plan: &Plan, mut v: usize) -> usize {
    while let Storage::Alias(a) = plan.values[v].storage {
        v = a;
    }
    v
}

/// Checks every parameter the plan names against `params` / `blocks`, evaluates the load-time
/// folds in order (reported to `progress` as [`Phase::Fold`]) and keeps the constants the steps
/// or outputs read; parameters only folds read are dropped.
pub fn constants<'a>(
    plan: &Plan,
    params: &'a HashMap<String, Tensor>,
    blocks: &'a HashMap<String, QuantWeight>,
    progress: &dyn Progress,
) -> Result<Constants<'a>, PrepareError> {
    constants_except(plan, params, blocks, &HashSet::new(), progress)
}

/// The values whose data an engine needs: what the steps and outputs read, and the operands of
/// the folds that compute those (following reshapes to the values that hold the data). A fold
/// whose result nothing reads — the f32 stack of weights a projection reads as blocks — is not
/// needed, nor are its operands.
pub fn needed(plan: &Plan) -> HashSet<usize> {
    let mut read: HashSet<usize> = plan.steps.iter().flat_map(|s| s.operands.iter().map(|&o| root(plan, o))).collect();
    read.extend(plan.outputs.iter().map(|(_, v)| root(plan, *v)));
    // Folds read only earlier values, so one pass from the last fold back closes the set.
    for fold in plan.folds.iter().rev() {
        if read.contains(&fold.output) {
            read.extend(fold.operands.iter().map(|&o| root(plan, o)));
        }
    }
    read
}

/// The parameters an engine must be given as f32 tensors: those the plan reads in f32 (not as
/// blocks), except the values in `provided`, which the engine serves another way.
pub fn f32_params(plan: &Plan, provided: &HashSet<usize>) -> Vec<String> {
    let needed = needed(plan);
    let mut names: Vec<String> = plan
        .values
        .iter()
        .enumerate()
        .filter(|(id, v)| v.format.is_f32() && needed.contains(id) && !provided.contains(id))
        .filter_map(|(_, v)| match &v.storage {
            Storage::Param(name) => Some(name.clone()),
            _ => None,
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// [`constants`] for every parameter the plan reads but those in `provided` (values an engine
/// serves itself, such as a gather table the CPU reads from blocks).
pub fn constants_except<'a>(
    plan: &Plan,
    params: &'a HashMap<String, Tensor>,
    blocks: &'a HashMap<String, QuantWeight>,
    provided: &HashSet<usize>,
    progress: &dyn Progress,
) -> Result<Constants<'a>, PrepareError> {
    let no_syms = HashMap::new();
    let needed = needed(plan);
    let mut host: HashMap<usize, Cow<'a, Tensor>> = HashMap::new();
    let mut quant: HashMap<usize, Cow<'a, QuantWeight>> = HashMap::new();
    for (id, v) in plan.values.iter().enumerate() {
        let Storage::Param(name) = &v.storage else { continue };
        if !needed.contains(&id) || provided.contains(&id) {
            continue;
        }
        let expected = resolve(&v.shape, &no_syms);
        if v.format.quantized() {
            let q = blocks.get(name).ok_or_else(|| {
                PrepareError::Invalid(format!(
                    "the plan reads parameter `{name}` as {} blocks, which were not given",
                    v.format
                ))
            })?;
            if q.format != v.format || [q.rows, q.k] != expected[..] {
                return Err(PrepareError::Invalid(format!(
                    "parameter `{name}`: the plan reads {} blocks of shape {expected:?}, given {} blocks of shape [{}, {}]",
                    v.format, q.format, q.rows, q.k
                )));
            }
            quant.insert(id, Cow::Borrowed(q));
            continue;
        }
        let t = params.get(name).ok_or_else(|| InterpError::MissingParam(name.clone()))?;
        if t.shape != expected {
            return Err(InterpError::ParamShape { name: name.clone(), expected, found: t.shape.clone() }.into());
        }
        if t.as_f32().is_none() {
            return Err(PrepareError::Invalid(format!("parameter `{name}` is not f32")));
        }
        host.insert(id, Cow::Borrowed(t));
    }
    let mut counter = Counter::start(progress, Phase::Fold, plan.folds.len());
    for fold in &plan.folds {
        if !needed.contains(&fold.output) {
            counter.advance();
            continue;
        }
        if plan.values[fold.output].format.quantized() {
            let args: Vec<&QuantWeight> =
                fold.operands.iter().map(|o| quant.get(o).map(|q| q.as_ref())).collect::<Option<_>>().ok_or_else(
                    || PrepareError::Invalid("internal error: a quantized fold reads a non-quantized value".into()),
                )?;
            let format = plan.values[fold.output].format;
            let q = match (&fold.op, args.as_slice()) {
                // Parts in other formats are re-encoded in the stack's, which holds them exactly.
                (Op::Concat { axis: 0 }, _) => {
                    args.iter()
                        .map(|&a| {
                            if a.format == format {
                                Some(Cow::Borrowed(a))
                            } else {
                                a.exactly_as(format).map(Cow::Owned)
                            }
                        })
                        .collect::<Option<Vec<Cow<'_, QuantWeight>>>>()
                        .and_then(|parts| QuantWeight::stack(&parts.iter().map(|p| p.as_ref()).collect::<Vec<_>>()))
                }
                (Op::Scale { factor }, [a]) => Some(a.scaled(factor.0)),
                (Op::Slice { axis: 0, start, len }, [a]) => a.rows(*start, *len),
                _ => None,
            }
            .ok_or_else(|| {
                PrepareError::Invalid(format!("internal error: {} cannot fold quantized blocks", fold.op.name()))
            })?;
            quant.insert(fold.output, Cow::Owned(q));
            counter.advance();
            continue;
        }
        // An operand read through a reshape gets its own shape (a copy only then).
        let args: Vec<Cow<'_, Tensor>> = fold
            .operands
            .iter()
            .map(|&o| {
                let t = host.get(&root(plan, o)).ok_or_else(|| {
                    PrepareError::Invalid(format!("internal error: fold operand {o} is not a constant"))
                })?;
                let shape = resolve(&plan.values[o].shape, &no_syms);
                Ok(if t.shape == shape {
                    Cow::Borrowed(t.as_ref())
                } else {
                    Cow::Owned(Tensor { shape, data: t.data.clone() })
                })
            })
            .collect::<Result<_, PrepareError>>()?;
        let refs: Vec<&Tensor> = args.iter().map(|t| t.as_ref()).collect();
        let t = kiln_compiler::interp::eval_op(&fold.op, &refs, resolve(&plan.values[fold.output].shape, &no_syms))?;
        drop(args);
        host.insert(fold.output, Cow::Owned(t));
        counter.advance();
    }
    // Values the steps and outputs read (parameters only read by load-time folds are dropped).
    let mut read: HashSet<usize> = plan.steps.iter().flat_map(|s| s.operands.iter().map(|&o| root(plan, o))).collect();
    read.extend(plan.outputs.iter().map(|(_, v)| root(plan, *v)));
    host.retain(|id, _| read.contains(id));
    quant.retain(|id, _| read.contains(id));
    Ok(Constants { host, quant })
}

/// Inputs bound for one run: by value index, the tensors given (`None` for an input the engine
/// already holds, named in `held`), and the symbol values (batch, sequence, cache lengths).
pub struct Bound {
    /// `(value, tensor)` per plan input, in value order.
    pub inputs: Vec<(usize, Option<Tensor>)>,
    /// The input specs, in the same order.
    pub names: Vec<String>,
    /// Symbol values.
    pub syms: HashMap<Sym, usize>,
}

/// Binds `given` to the plan's inputs exactly as the interpreter binds a graph's; `held` gives
/// the shapes of inputs the engine keeps itself (a cache on the device), which are not in
/// `given`.
pub fn bind<S: AsRef<[usize]>>(
    plan: &Plan,
    given: &HashMap<String, Tensor>,
    held: &HashMap<&str, S>,
) -> Result<Bound, PrepareError> {
    bind_values(plan, &input_values(plan), given, held)
}

/// The values of `plan` that are its inputs, in value order: what [`bind_values`] binds (an
/// engine running a plan every decode step finds them once, not in every run's pass over
/// thousands of values).
pub fn input_values(plan: &Plan) -> Vec<usize> {
    (plan.values.iter().enumerate())
        .filter(|(_, v)| matches!(v.storage, Storage::Input { .. }))
        .map(|(i, _)| i)
        .collect()
}

/// [`bind`], for the plan's inputs `input_ids` ([`input_values`]).
pub fn bind_values<S: AsRef<[usize]>>(
    plan: &Plan,
    input_ids: &[usize],
    given: &HashMap<String, Tensor>,
    held: &HashMap<&str, S>,
) -> Result<Bound, PrepareError> {
    let specs: Vec<InputSpec> = input_ids
        .iter()
        .filter_map(|&i| {
            let v = &plan.values[i];
            let Storage::Input { name, role } = &v.storage else { return None };
            // The length axis: `[batch, seq]` for ids and masks, `[batch, heads, len, hd]` for
            // caches.
            let seq = v
                .shape
                .iter()
                .find_map(|d| match d {
                    Dim::Sym(s) if *s != Sym::Batch => Some(*s),
                    _ => None,
                })
                .unwrap_or(Sym::Seq);
            Some(InputSpec { name, role: *role, seq })
        })
        .collect();
    let (tensors, syms) = bind_named_with(&specs, given, held)?;
    let names = specs.iter().map(|s| s.name.to_string()).collect();
    Ok(Bound { inputs: input_ids.iter().copied().zip(tensors).collect(), names, syms })
}

/// Token ids and positions must index inside their tables: a GPU kernel would clamp silently, a
/// CPU one read out of bounds. A loss's labels must be in its vocabulary (see `check_labels`).
/// `inputs` are the bound inputs by value.
pub fn check_indices(
    plan: &Plan,
    inputs: &HashMap<usize, &Tensor>,
    syms: &HashMap<Sym, usize>,
) -> Result<(), PrepareError> {
    for step in &plan.steps {
        if let Op::CrossEntropy { ignore_index, .. } | Op::CrossEntropyGrad { ignore_index, .. } = step.op {
            check_labels(plan, step, inputs, syms, ignore_index)?;
            continue;
        }
        let (gathered_rows, tables) = match &step.op {
            Op::Gather => (None, 1),
            Op::GatherColumns { splits } => (Some(splits.iter().sum::<usize>()), splits.len()),
            _ => continue,
        };
        // A plan read from a file is not type-checked: a gather's arity and table are checked
        // here, before they are relied on.
        let (Some(&table), Some(&ids), true) =
            (step.operands.first(), step.operands.last(), step.operands.len() == tables + 1)
        else {
            return Err(PrepareError::Invalid(format!(
                "a gather step has {} operands, not {}",
                step.operands.len(),
                tables + 1
            )));
        };
        let Some(rows) = gathered_rows.or_else(|| resolve(&plan.values[table].shape, syms).first().copied()) else {
            return Err(PrepareError::Invalid("a gather step's table has no rows".into()));
        };
        // A table the back end holds transposed is named by the parameter it was folded from.
        let mut source = table;
        while let Some(fold) = plan.folds.iter().find(|f| f.output == source)
            && let Some(&from) = fold.operands.first()
        {
            source = from;
        }
        let table_name = match &plan.values[source].storage {
            Storage::Param(n) => n.clone(),
            _ => "table".into(),
        };
        if let Some(t) = inputs.get(&root(plan, ids)) {
            let what = match &plan.values[root(plan, ids)].storage {
                Storage::Input { role: InputRole::TokenTypes, .. } => "token type id",
                _ => "token id",
            };
            if let Some(&bad) = t.as_i64().unwrap_or(&[]).iter().find(|&&x| x < 0 || x as usize >= rows) {
                return Err(InterpError::IndexOutOfRange { what, index: bad, table: table_name, rows }.into());
            }
        } else if let Some(step_def) = plan.steps.iter().find(|s| s.output == ids)
            && let Op::Positions { .. } = step_def.op
        {
            let len = kiln_compiler::lower::elements(&plan.values[ids].shape, syms);
            let past = syms.get(&Sym::Past).copied().unwrap_or(0);
            if len + past > rows {
                return Err(InterpError::IndexOutOfRange {
                    what: "position",
                    // The first position out of range.
                    index: rows.max(past) as i64,
                    table: table_name,
                    rows,
                }
                .into());
            }
        }
    }
    Ok(())
}

/// The labels of a cross-entropy step (or its gradient's), when they are an input, must each be
/// `ignore` or a token of the vocabulary, and not all `ignore` (the mean loss would be 0 / 0): the
/// interpreter's refusals, which a kernel cannot make.
fn check_labels(
    plan: &Plan,
    step: &kiln_compiler::lower::Step,
    inputs: &HashMap<usize, &Tensor>,
    syms: &HashMap<Sym, usize>,
    ignore: i64,
) -> Result<(), PrepareError> {
    let (Some(&logits), Some(&labels)) = (step.operands.first(), step.operands.get(1)) else {
        return Err(PrepareError::Invalid(format!("a {} step has {} operands", step.op.name(), step.operands.len())));
    };
    let Some(labels) = inputs.get(&root(plan, labels)) else { return Ok(()) };
    let vocab = resolve(&plan.values[logits].shape, syms).last().copied().unwrap_or(0);
    let labels = labels
        .as_i64()
        .ok_or_else(|| InterpError::BadInput { name: "labels".into(), message: "expected integer token ids".into() })?;
    if let Some(&bad) = labels.iter().find(|&&l| l != ignore && !usize::try_from(l).is_ok_and(|l| l < vocab)) {
        return Err(InterpError::IndexOutOfRange {
            what: "label",
            index: bad,
            table: "the vocabulary".into(),
            rows: vocab,
        }
        .into());
    }
    if labels.iter().all(|&l| l == ignore) {
        return Err(InterpError::BadInput {
            name: "labels".into(),
            message: format!("every label is the ignore index {ignore}: no position takes a loss"),
        }
        .into());
    }
    Ok(())
}

/// A step that appends in place: a `heads` step whose cache operand is the past input `past`
/// (read by nothing else), producing the plan output `present`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendSite {
    /// Index of the step in [`Plan::steps`].
    pub step: usize,
    /// The past input's value.
    pub past_value: usize,
    /// The past input's name.
    pub past: String,
    /// The output's name.
    pub present: String,
}

/// Every step of `plan` that can append to a cache in place.
pub fn append_sites(plan: &Plan) -> Vec<AppendSite> {
    let root = |v: usize| root(plan, v);
    let readers = |value: usize| {
        plan.steps.iter().flat_map(|s| &s.operands).filter(|&&o| root(o) == value).count()
            + plan.folds.iter().flat_map(|f| &f.operands).filter(|&&o| root(o) == value).count()
            + plan.outputs.iter().filter(|(_, o)| root(*o) == value).count()
    };
    let mut sites = Vec::new();
    for (i, step) in plan.steps.iter().enumerate() {
        let cache = match (&step.op, step.operands.as_slice()) {
            (Op::Heads { norm: None, .. }, [cache, _]) | (Op::Heads { norm: Some(_), .. }, [cache, _, _]) => cache,
            _ => continue,
        };
        let past_value = root(*cache);
        let Some(Storage::Input { name: past, .. }) = plan.values.get(past_value).map(|v| &v.storage) else {
            continue;
        };
        let presents: Vec<&String> =
            plan.outputs.iter().filter(|(_, o)| root(*o) == step.output).map(|(name, _)| name).collect();
        if let ([present], 1) = (presents.as_slice(), readers(past_value)) {
            sites.push(AppendSite { step: i, past_value, past: past.clone(), present: (*present).clone() });
        }
    }
    sites
}
