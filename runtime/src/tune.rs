//! Kernel forms tuned per adapter (`kiln tune`). Which of the WGSL kernels' forms is fastest — the
//! subgroup reductions and split GEMV, a decoder step's cache appends in the attention's own
//! dispatch, the attention's workgroup form and the invocation count below which it runs, the
//! projection's prefill tile and the attention's key tile, and how many submissions a run's
//! dispatches are split over ([`Tunables`]) — is a question of the device, and kiln runs on GPUs
//! its developers never see. So the forms are data: [`candidates`] are the combinations an
//! adapter can run ([`tile_candidates`] the tiles and the submissions, tried on the fastest of
//! those), [`tune`] times each on a model's real shapes (a decoder's prompt and decode steps,
//! greedy; another model's forward pass on a batch of samples), keeps only those
//! whose logits match the reference (the interpreter, or the CPU back end for quantized weights,
//! itself held to the interpreter), and the fastest is cached by adapter, driver and shape class
//! ([`shape_class`]: models of one architecture and size share it) under `tuning/` in kiln's
//! data directory, next to the cost models ([`crate::costs`]). Loading a model on that adapter
//! then takes the cached choice ([`options_for`]); without one, the adapter's default options.
//! A tuning holds for one kiln version and one driver: another reads as none.

use crate::costs::file_of;
use crate::device::{Device, Storage, Weights, lower_with_blocks};
use crate::engine::GenerateError;
use crate::generate::{Session, generate};
use crate::gpu::{Gpu, GpuError, GpuModel};
use crate::model::Model;
use crate::progress::{Phase, Progress};
use crate::quant::QuantWeight;
use crate::sample::Sampler;
use kiln_compiler::back::wgsl::{Options, Tunables};
use kiln_compiler::graph::Graph;
use kiln_compiler::lower::{Plan, Storage as ValueStorage};
use kiln_compiler::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What can go wrong tuning, or reading and writing a tuning.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// A file could not be read or written.
    #[error("cannot {what} `{}`", path.display())]
    Io {
        /// `read`, `write`, `create`.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A cached tuning is not what kiln writes.
    #[error("the tuning `{}` is not valid: delete it to tune again", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// Saving needs a data directory.
    #[error("no data directory to keep the tuning in: set KILN_DATA")]
    NoDataDir,
    /// The reference could not be loaded or run.
    #[error("the reference run failed: {0}")]
    Reference(String),
    /// Generation failed on the reference.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// The model needs more positions than it has for the tuning's prompt.
    #[error("the model has {positions} positions; tuning needs at least {needed}")]
    TooShort {
        /// The model's positions.
        positions: usize,
        /// Positions the tuning's prompt and steps need.
        needed: usize,
    },
    /// No candidate matched the reference (every form of the kernels disagrees with it).
    #[error(
        "no form of the kernels matched the reference on `{adapter}` (a bug in kiln's kernels or the driver: please report it; KILN_TUNE=off skips tuning at first use): {detail}"
    )]
    NoMatch {
        /// The adapter.
        adapter: String,
        /// Each candidate's verdict.
        detail: String,
    },
}

/// The forms `gpu` can run, its default options' first: subgroups only where the device has
/// them; the attention's workgroup form off, or on below 512, 2 048 (the built-in threshold)
/// and 16 384 blocked invocations; the cache appends in the attention's dispatch or not. (The
/// projection's prefill tiles are tried after these, on the fastest: [`tile_candidates`].)
pub fn candidates(gpu: &Gpu) -> Vec<Tunables> {
    let default = gpu.options().tunables();
    let subgroups: &[bool] = if gpu.supports_subgroups() { &[false, true] } else { &[false] };
    let attention = [(false, None), (true, Some(512)), (true, None), (true, Some(16_384))];
    let mut all = vec![default];
    for &subgroups in subgroups {
        for fold_appends in [false, true] {
            for (attention_workgroups, attention_workgroup_below) in attention {
                let t = Tunables {
                    f16_weights: default.f16_weights,
                    f16_math: default.f16_math,
                    subgroups,
                    fold_appends,
                    attention_workgroups,
                    attention_workgroup_below,
                    gemm_tile: None,
                    split_rows: default.split_rows,
                    split_groups: default.split_groups,
                    wide_gemv_from: default.wide_gemv_from,
                    attention_key_tile: None,
                    attention_split_keys: default.attention_split_keys,
                    submissions: default.submissions,
                };
                if !all.contains(&t) {
                    all.push(t);
                }
            }
        }
    }
    all
}

/// `best` with each other prefill tile of the projection
/// ([`kiln_compiler::back::wgsl::projection::GEMM_TILES`]), with subgroups each other row limit of
/// the split GEMV ([`kiln_compiler::back::wgsl::projection::SPLIT_ROWS`]) and each other width
/// ([`kiln_compiler::back::wgsl::projection::SPLIT_GROUPS`]) and a vocabulary head's GEMV in the
/// `vec4` form ([`kiln_compiler::back::wgsl::projection::WIDE_GEMV_FROM`]), each other key tile of the
/// attention's blocked forms ([`kiln_compiler::back::wgsl::attention::KEY_TILES`]), each other
/// key range of a split attention of [`SPLIT_KEYS`] (with the workgroup form), each other count
/// of submissions of [`SUBMISSIONS`], and, where the adapter has f16 (`f16`), f32 weights stored
/// as f16 and multiplied in f32 or in f16.
pub fn tile_candidates(best: Tunables, f16: bool) -> Vec<Tunables> {
    use kiln_compiler::back::wgsl::attention::{KEY_TILE, KEY_TILES};
    use kiln_compiler::back::wgsl::projection::{
        GEMM_TILES, GEMV_MAX_ROWS, SPLIT_GEMV_GROUPS, SPLIT_GROUPS, SPLIT_ROWS, VEC_GEMM_GROUPS, VEC_GEMM_ROWS,
        WIDE_GEMV_FROM,
    };
    let gemm = (GEMM_TILES.iter())
        .filter(|&&t| t != (VEC_GEMM_ROWS, VEC_GEMM_GROUPS))
        .map(|&t| Tunables { gemm_tile: Some(t), ..best });
    let rows = SPLIT_ROWS.iter().filter(|&&n| best.subgroups && n != best.split_rows.unwrap_or(GEMV_MAX_ROWS));
    let rows = rows.map(|&n| Tunables { split_rows: (n != GEMV_MAX_ROWS).then_some(n), ..best });
    let width = best.split_groups.unwrap_or(SPLIT_GEMV_GROUPS);
    let widths = SPLIT_GROUPS.iter().filter(|&&g| best.subgroups && g != width);
    let widths = widths.map(|&g| Tunables { split_groups: Some(g), ..best });
    let wide = (best.subgroups && best.wide_gemv_from.is_none())
        .then_some(Tunables { wide_gemv_from: Some(WIDE_GEMV_FROM), ..best });
    let keys = KEY_TILES.iter().filter(|&&t| t != KEY_TILE).map(|&t| Tunables { attention_key_tile: Some(t), ..best });
    let splits = SPLIT_KEYS.iter().filter(|&&n| best.attention_workgroups && n != best.attention_split_keys);
    let splits = splits.map(|&n| Tunables { attention_split_keys: n, ..best });
    let parts = SUBMISSIONS.iter().filter(|&&n| n != Options::default().tuned(best).submission_count());
    let parts = parts.map(|&n| Tunables { submissions: (n > 1).then_some(n), ..best });
    let precisions =
        [(true, false), (true, true)].into_iter().filter(|&p| f16 && p != (best.f16_weights, best.f16_math));
    let precisions = precisions.map(|(f16_weights, f16_math)| Tunables { f16_weights, f16_math, ..best });
    gemm.chain(rows).chain(widths).chain(wide).chain(keys).chain(splits).chain(parts).chain(precisions).collect()
}

/// The key ranges a split attention is tried with (see
/// [`kiln_compiler::back::wgsl::Options::attention_split_keys`]; `None`: not split).
pub const SPLIT_KEYS: [Option<usize>; 5] = [None, Some(64), Some(128), Some(256), Some(512)];

/// The counts of submissions a run's dispatches are tried in (see
/// [`kiln_compiler::back::wgsl::Options::submissions`]).
pub const SUBMISSIONS: [usize; 4] = [1, 2, 4, 8];

/// The class of models a tuning holds for: a digest (FNV-1a, stable across builds) of the plan's
/// ops with their attributes and of its parameters' shapes and formats, so models of one
/// architecture and size share it whatever their weights, and no other does.
pub fn shape_class(plan: &Plan) -> String {
    let mut text = String::new();
    for step in &plan.steps {
        text += &format!("{} {};", step.op.name(), step.op.attrs());
    }
    for v in &plan.values {
        if let ValueStorage::Param(name) = &v.storage {
            text += &format!("{name}:{:?}:{:?};", v.shape, v.format);
        }
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{}-{h:016x}", plan.name)
}

/// One candidate's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timed {
    /// The forms.
    pub tunables: Tunables,
    /// The largest difference of its logits from the reference's, relative to the reference's
    /// largest magnitude (at least 1); `None` when it did not run.
    pub error: Option<f64>,
    /// Milliseconds per decode step (the fastest of the timed generations); `None` unless it
    /// matched and was timed.
    pub decode_ms: Option<f64>,
    /// Milliseconds of the prompt's prefill (same generation), or of a forward pass.
    pub prefill_ms: Option<f64>,
    /// Why it was not timed: `differs`, `not timed: out of time`, or its error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
}

/// A shape class's tuning.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The model tuned (its graph's name), for people reading the file.
    pub model: String,
    /// The forms chosen: the matching candidate whose timed generation (the prompt's prefill and
    /// the decode steps) took the least time, or the adapter's default forms (the first
    /// candidate) when none is faster by more than [`MARGIN`].
    pub chosen: Tunables,
    /// Tokens of the timed prompt and decode steps.
    pub prompt: usize,
    /// Decode steps timed.
    pub steps: usize,
    /// Every candidate, in the order tried.
    pub candidates: Vec<Timed>,
}

/// An adapter's tunings, as cached.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Tunings {
    adapter: String,
    driver: String,
    kiln: String,
    classes: BTreeMap<String, Entry>,
}

/// The kernel forms' revision: raised when a form or tunable is added or changed, so that a
/// tuning chosen among the earlier forms is not applied to the new ones (a tuning saved before
/// `split_rows` would have kept a hardware adapter's short prompts on the GEMM that leaves it
/// idle).
const FORMS_REVISION: u32 = 3;

/// Which kiln made a tuning: its version and [`FORMS_REVISION`].
fn kiln_forms() -> String {
    format!("{} (forms {FORMS_REVISION})", env!("CARGO_PKG_VERSION"))
}

/// Where tunings live: `tuning` in kiln's data directory.
pub fn dir() -> Option<PathBuf> {
    crate::data_dir().map(|d| d.join("tuning"))
}

/// The tunings cached for `gpu`'s adapter, if any were saved by this kiln for its driver.
fn read(gpu: &Gpu, path: &Path) -> Result<Option<Tunings>, TuneError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).map_err(|source| TuneError::Io { what: "read", path: path.into(), source })?;
    let t: Tunings = serde_json::from_str(&text).map_err(|source| TuneError::Json { path: path.into(), source })?;
    let current = t.adapter == gpu.adapter_name() && t.driver == gpu.driver() && t.kiln == kiln_forms();
    Ok(current.then_some(t))
}

/// The forms cached for `plan`'s shape class on `gpu`'s adapter, if it was tuned (by this kiln,
/// on this driver).
pub fn cached(gpu: &Gpu, plan: &Plan) -> Result<Option<Entry>, TuneError> {
    let Some(dir) = dir() else { return Ok(None) };
    Ok(read(gpu, &file_of(&dir, gpu.adapter_name()))?.and_then(|mut t| t.classes.remove(&shape_class(plan))))
}

/// `options` with the forms cached for `plan` on `gpu` (see [`cached`]), else as they are.
/// `options` with the forms tuned for `plan` on `gpu`, if any are cached; the tuned precision of
/// f32 weights only where `precision` is left to the tuning (else `options`' own, the caller's
/// choice).
pub fn options_for(gpu: &Gpu, plan: &Plan, options: Options, precision: bool) -> Result<Options, TuneError> {
    Ok(match cached(gpu, plan)? {
        Some(entry) => with_tuning(options, entry.chosen, precision),
        None => options,
    })
}

/// `options` with the `chosen` forms, and the chosen precision where `precision` leaves it to the
/// tuning.
fn with_tuning(options: Options, chosen: Tunables, precision: bool) -> Options {
    match precision {
        true => options.tuned(chosen),
        false => options.tuned(Tunables { f16_weights: options.f16_weights, f16_math: options.f16_math, ..chosen }),
    }
}

/// When a load tunes a model's kernels first ([`at_first_use`]): `KILN_TUNE` unset, on a hardware
/// adapter; `off`, never; `always`, on a software adapter too.
fn tunes_at_first_use(gpu: &Gpu) -> bool {
    match std::env::var("KILN_TUNE").as_deref() {
        Ok("off") => false,
        Ok("always") => true,
        _ => !gpu.is_software(),
    }
}

/// Seconds a first use's tuning may start candidates for, unless `KILN_TUNE_BUDGET` says.
const FIRST_USE_BUDGET: f64 = 30.0;
/// The prompt and decode steps a first use's tuning times.
const FIRST_USE_SHAPES: (usize, usize) = (16, 32);
/// Sequences of the forward pass a first use of a graph that is no decoder step times.
const FIRST_USE_BATCH: usize = 4;

/// The first use of an adapter for a model's shapes: where no tuning is cached for `plan`
/// (lowered from `graph`) and the adapter tunes at first use (by `KILN_TUNE`: a hardware one
/// unless it says otherwise), its forms are tuned as `kiln tune` does, bounded by
/// `KILN_TUNE_BUDGET` seconds (30), shown on `progress`, and cached. A cached decoder step (with
/// its `logits` and caches) is timed generating (`FIRST_USE_SHAPES`); another graph reading
/// token ids (an encoder's, a decoder's whole forward pass), on a forward pass of
/// `FIRST_USE_BATCH` (as many tokens as a decoder step's prompt and steps, within its
/// positions). A training graph, or one too short to time, is left untuned; every form
/// disagreeing with the interpreter is an error.
pub fn at_first_use(
    gpu: &Arc<Gpu>,
    graph: &Graph,
    plan: &Plan,
    params: &HashMap<String, Tensor>,
    blocks: &HashMap<String, QuantWeight>,
    progress: &dyn Progress,
) -> Result<(), TuneError> {
    use kiln_compiler::graph::{Dim, InputRole, Op};
    if !tunes_at_first_use(gpu) || cached(gpu, plan)?.is_some() {
        return Ok(());
    }
    let decoder_step = graph.outputs.iter().any(|(n, _)| n == "logits")
        && graph.outputs.iter().any(|(n, _)| n.ends_with(".present_k"));
    let roles: Vec<InputRole> = graph.inputs().into_iter().map(|(_, _, role)| role).collect();
    let forward = !decoder_step
        && roles.contains(&InputRole::Ids)
        && !roles.iter().any(|r| matches!(r, InputRole::Labels | InputRole::Cache { .. }));
    // The rows of the tables gathered by token ids (the vocabulary) and by positions.
    let tables = |by: &dyn Fn(&Op) -> bool| -> Option<usize> {
        (graph.g.node_indices().filter(|&n| matches!(graph.g[n].op, Op::Gather)))
            .filter_map(|n| {
                let [table, ids] = graph.operands(n)[..] else { return None };
                match graph.g[table].shape.first() {
                    Some(Dim::Fixed(rows)) if by(&graph.g[ids].op) => Some(*rows),
                    _ => None,
                }
            })
            .min()
    };
    let vocab = match decoder_step {
        true => graph.outputs.iter().find(|(n, _)| n == "logits").and_then(|&(_, l)| match graph.g[l].shape.last() {
            Some(Dim::Fixed(v)) => Some(*v),
            _ => None,
        }),
        false => tables(&|op| matches!(op, Op::Input { role: InputRole::Ids, .. })),
    };
    let Some(vocab) = vocab.filter(|_| decoder_step || forward) else { return Ok(()) };
    // A learned position table bounds the tokens a generation may run.
    let (prompt, steps) = FIRST_USE_SHAPES;
    let learned = tables(&|op| matches!(op, Op::Positions { .. }));
    let inputs = match decoder_step {
        true if learned.is_some_and(|rows| rows < prompt + steps + 1) => return Ok(()),
        true => None,
        false => {
            let tokens = learned.map_or(prompt + steps, |rows| rows.min(prompt + steps));
            match kiln_compiler::interp::sample_inputs(graph, vocab, FIRST_USE_BATCH, tokens) {
                Ok(inputs) => Some(inputs),
                Err(_) => return Ok(()),
            }
        }
    };
    let budget = std::env::var("KILN_TUNE_BUDGET").ok().and_then(|s| s.parse::<f64>().ok());
    let budget = budget.filter(|b| b.is_finite() && *b >= 0.0).unwrap_or(FIRST_USE_BUDGET);
    let work = Workload {
        graph,
        params,
        blocks,
        vocab,
        // The positions the timed generation needs (a learned table's rows were checked above).
        max_positions: prompt + steps + 1,
        prompt,
        steps,
        budget: Duration::from_secs_f64(budget),
        inputs: inputs.as_ref(),
    };
    match tune(gpu, &work, progress) {
        Ok(_) => Ok(()),
        Err(e @ TuneError::NoMatch { .. }) => Err(e),
        // Too short a model, or a reference that cannot run it: the adapter's defaults serve.
        Err(_) => Ok(()),
    }
}

/// Saves `entry` as the tuning of `class` on `gpu`'s adapter (keeping the adapter's other
/// classes); returns the file.
fn save(gpu: &Gpu, class: &str, entry: &Entry) -> Result<PathBuf, TuneError> {
    let dir = dir().ok_or(TuneError::NoDataDir)?;
    std::fs::create_dir_all(&dir).map_err(|source| TuneError::Io { what: "create", path: dir.clone(), source })?;
    let path = file_of(&dir, gpu.adapter_name());
    let mut tunings = read(gpu, &path).unwrap_or(None).unwrap_or_else(|| Tunings {
        adapter: gpu.adapter_name().to_string(),
        driver: gpu.driver(),
        kiln: kiln_forms(),
        classes: BTreeMap::new(),
    });
    tunings.classes.insert(class.to_string(), entry.clone());
    let text =
        serde_json::to_string_pretty(&tunings).map_err(|source| TuneError::Json { path: path.clone(), source })?;
    // Whole or not at all: a reader never sees half a file.
    kiln_compiler::file::write_atomic(&path, text.as_bytes()).map_err(|source| TuneError::Io {
        what: "write",
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// What a tuning runs: a cached decoder graph with its weights, and the shapes to time.
pub struct Workload<'a> {
    /// The cached (decode) graph, optimized for wgpu; or, with `inputs`, a forward graph (an
    /// encoder's).
    pub graph: &'a Graph,
    /// Its f32 parameters.
    pub params: &'a HashMap<String, Tensor>,
    /// Its quantized weights' blocks.
    pub blocks: &'a HashMap<String, QuantWeight>,
    /// Tokens of its vocabulary.
    pub vocab: usize,
    /// Positions it has.
    pub max_positions: usize,
    /// Tokens of the timed prompt.
    pub prompt: usize,
    /// Decode steps timed after it.
    pub steps: usize,
    /// Time after which no further candidate starts (the default options' always run).
    pub budget: Duration,
    /// A forward graph's inputs: then one forward pass on them is checked and timed, instead of
    /// a generation (`vocab`, `max_positions`, `prompt` and `steps` unused).
    pub inputs: Option<&'a HashMap<String, Tensor>>,
}

/// Every f32 output of a forward pass, in order.
fn floats(outputs: Vec<(String, Tensor)>) -> Vec<Vec<f32>> {
    outputs.into_iter().filter_map(|(_, t)| t.as_f32().map(<[f32]>::to_vec)).collect()
}

/// Tokens checked against the reference: a prompt, then single decode steps.
const CHECK_PROMPT: usize = 6;
/// Decode steps checked against the reference.
const CHECK_STEPS: usize = 2;
/// How much faster than the default forms another must be to be chosen: SmolLM2's generation on
/// lavapipe varied by up to 3% between forms that do the same work (the key tile 8 against 4
/// measured 0.05% apart, GEMM tiles 2-8%).
pub const MARGIN: f64 = 0.03;

/// The largest relative difference of a candidate's logits from the reference's that matches:
/// the f32 kernels' own agreement with the interpreter over a whole model (sums in other orders).
pub const TOLERANCE: f64 = 2e-3;

/// The same for a candidate storing f32 weights as f16 (and multiplying in f16): their rounding
/// moves logits by about 1e-3 of their range (GPT-2's fixture: within 3e-3). Such a candidate
/// must also pick every checked greedy token the reference picks.
pub const F16_TOLERANCE: f64 = 3e-3;

/// Why a candidate's outputs `got` (for `tunables`) do not match the reference's `want`, or their
/// relative error where they do; `rows_are_logits`: each output row is a position's logits, whose
/// greedy token an f16 candidate must keep.
fn verdict(tunables: &Tunables, want: &[Vec<f32>], got: &[Vec<f32>], rows_are_logits: bool) -> Result<f64, String> {
    let error = relative_error(want, got);
    let tolerance = if tunables.f16_weights { F16_TOLERANCE } else { TOLERANCE };
    if error.is_nan() || error > tolerance {
        return Err(format!("differs from the reference by {error:.1e}"));
    }
    let argmax = |row: &[f32]| row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
    if tunables.f16_weights && rows_are_logits && want.iter().zip(got).any(|(w, g)| argmax(w) != argmax(g)) {
        return Err(format!("changes a greedy token (differs by {error:.1e})"));
    }
    Ok(error)
}

/// The logits of the check's prompt and each of its steps on `session`.
fn check_logits(session: &mut Session, vocab: usize) -> Result<Vec<Vec<f32>>, GenerateError> {
    let ids: Vec<i64> = (0..CHECK_PROMPT as i64).map(|i| (i * 7919 + 13) % vocab.max(1) as i64).collect();
    let mut out = vec![session.forward(&ids)?];
    for i in 0..CHECK_STEPS as i64 {
        out.push(session.forward(&[(i * 104_729 + 7) % vocab.max(1) as i64])?);
    }
    session.reset();
    Ok(out)
}

/// The largest difference of `got` from `want`, relative to `want`'s largest magnitude (at least
/// 1); infinite when the shapes differ or a value is not finite.
pub fn relative_error(want: &[Vec<f32>], got: &[Vec<f32>]) -> f64 {
    let scale = want.iter().flatten().fold(1.0f64, |m, &x| m.max(f64::from(x).abs()));
    if want.len() != got.len() || want.iter().zip(got).any(|(a, b)| a.len() != b.len()) {
        return f64::INFINITY;
    }
    let worst = want.iter().flatten().zip(got.iter().flatten()).fold(0.0f64, |m, (&a, &b)| {
        let d = (f64::from(a) - f64::from(b)).abs();
        if d.is_nan() { f64::INFINITY } else { m.max(d) }
    });
    worst / scale
}

/// Times every candidate form of the kernels on `gpu` for `work` (see the module's
/// documentation), the default options' first and the others while `work.budget` lasts, one
/// progress unit each ([`Phase::Tune`]); caches the fastest that matches and returns it with
/// the file it was saved in.
pub fn tune(gpu: &Arc<Gpu>, work: &Workload<'_>, progress: &dyn Progress) -> Result<(Entry, PathBuf), TuneError> {
    let needed = (work.prompt + work.steps + 1).max(CHECK_PROMPT + CHECK_STEPS);
    if work.inputs.is_none() && needed > work.max_positions {
        return Err(TuneError::TooShort { positions: work.max_positions, needed });
    }
    let outputs: Vec<String> = work.graph.outputs.iter().map(|(n, _)| n.clone()).collect();
    // The reference: the interpreter where every weight is f32, else the CPU back end (which
    // reads the blocks as the device does, and is held to the interpreter).
    let reference = match work.blocks.is_empty() {
        true => Device::Interp,
        false => Device::Cpu { threads: std::thread::available_parallelism().map_or(1, |n| n.get()) },
    };
    let weights = Weights::Given { params: work.params, blocks: work.blocks };
    let loaded = reference
        .load(work.graph, weights, Storage::default(), &())
        .map_err(|e| TuneError::Reference(e.to_string()))?;
    let want = match work.inputs {
        Some(inputs) => floats(loaded.run(inputs).map_err(|e| TuneError::Reference(e.to_string()))?),
        None => {
            let mut session = Session::new(loaded.into_engine(), &outputs, work.max_positions)?;
            check_logits(&mut session, work.vocab)?
        }
    };
    // A forward pass is timed alone: no decode steps.
    let steps = if work.inputs.is_some() { 0 } else { work.steps };

    let plan = lower_with_blocks(work.graph, work.blocks);
    let class = shape_class(&plan);
    let base = gpu.options();
    let first = candidates(gpu);
    // The count shown: the first candidates and (until the fastest of those is known) the
    // refinements of the default forms.
    let f16 = gpu.supports_f16();
    let count = std::cell::Cell::new(first.len() + tile_candidates(base.tunables(), f16).len());
    let start = Instant::now();
    let mut timed: Vec<Timed> = Vec::with_capacity(count.get());
    progress.update(Phase::Tune, 0, count.get());
    let run = |tunables: Tunables, timed: &mut Vec<Timed>| {
        let outcome = if !timed.is_empty() && start.elapsed() > work.budget {
            let rejected = Some("not timed: out of time".to_string());
            Timed { tunables, error: None, decode_ms: None, prefill_ms: None, rejected }
        } else {
            match time(gpu, &plan, base.tuned(tunables), work, &outputs, &want) {
                Ok(t) => t,
                Err(e) => Timed { tunables, error: None, decode_ms: None, prefill_ms: None, rejected: Some(e) },
            }
        };
        timed.push(Timed { tunables, ..outcome });
        progress.update(Phase::Tune, timed.len(), count.get());
    };
    // The fastest generation: the prompt's prefill and the decode steps together; the default
    // forms unless another is faster by more than the timings' noise ([`MARGIN`]).
    let total =
        |t: &Timed| Some(t.prefill_ms? + steps as f64 * t.decode_ms.unwrap_or(0.0)).filter(|_| t.rejected.is_none());
    let fastest = |timed: &[Timed]| {
        let best = (timed.iter()).filter_map(|t| Some((total(t)?, t.tunables))).min_by(|a, b| a.0.total_cmp(&b.0))?;
        match timed.first().and_then(|d| Some((total(d)?, d.tunables))) {
            Some((ms, default)) if ms <= best.0 * (1.0 + MARGIN) => Some(default),
            _ => Some(best.1),
        }
    };
    for tunables in first {
        run(tunables, &mut timed);
    }
    // Then the projection's prefill tiles, the attention's key tiles and the submissions, on the
    // fastest of those.
    if let Some(best) = fastest(&timed) {
        let refinements = tile_candidates(best, f16);
        count.set(timed.len() + refinements.len());
        for tunables in refinements {
            run(tunables, &mut timed);
        }
    }
    let chosen = fastest(&timed).ok_or_else(|| TuneError::NoMatch {
        adapter: gpu.describe(),
        detail: (timed.iter())
            .map(|t| format!("{}: {}", t.tunables.describe(), t.rejected.as_deref().unwrap_or("?")))
            .collect::<Vec<_>>()
            .join("; "),
    })?;
    let entry = Entry { model: work.graph.name.clone(), chosen, prompt: work.prompt, steps, candidates: timed };
    let path = save(gpu, &class, &entry)?;
    Ok((entry, path))
}

/// One candidate: its model built with `options`, its logits checked, its generation timed (the
/// faster of two); the reason as text where it is rejected.
fn time(
    gpu: &Arc<Gpu>,
    plan: &Plan,
    options: Options,
    work: &Workload<'_>,
    outputs: &[String],
    want: &[Vec<f32>],
) -> Result<Timed, String> {
    let tunables = options.tunables();
    let model = GpuModel::with_progress(gpu.clone(), plan, &options, work.params, work.blocks, &())
        .map_err(|e: GpuError| e.to_string())?;
    if let Some(inputs) = work.inputs {
        // A forward pass: checked, then timed alone (the faster of two).
        let got = floats(model.run(inputs).map_err(|e| e.to_string())?);
        let error = match verdict(&tunables, want, &got, false) {
            Ok(error) => error,
            Err(why) => {
                let error = Some(relative_error(want, &got));
                return Ok(Timed { tunables, error, decode_ms: None, prefill_ms: None, rejected: Some(why) });
            }
        };
        let mut best = f64::INFINITY;
        for _ in 0..2 {
            let t = Instant::now();
            model.run(inputs).map_err(|e| e.to_string())?;
            best = best.min(1e3 * t.elapsed().as_secs_f64());
        }
        return Ok(Timed { tunables, error: Some(error), decode_ms: None, prefill_ms: Some(best), rejected: None });
    }
    let mut session =
        Session::new(Model::Gpu(Box::new(model)).into(), outputs, work.max_positions).map_err(|e| e.to_string())?;
    let got = check_logits(&mut session, work.vocab).map_err(|e| e.to_string())?;
    let error = match verdict(&tunables, want, &got, true) {
        Ok(error) => error,
        Err(why) => {
            let error = Some(relative_error(want, &got));
            return Ok(Timed { tunables, error, decode_ms: None, prefill_ms: None, rejected: Some(why) });
        }
    };
    let ids: Vec<i64> = (0..work.prompt as i64).map(|i| (i * 7919 + 13) % work.vocab.max(1) as i64).collect();
    let (mut decode, mut prefill) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..2 {
        let (_, stats) = generate(&mut session, &ids, work.steps + 1, &mut Sampler::greedy(), &[], |_| true)
            .map_err(|e| e.to_string())?;
        decode = decode.min(1e3 * stats.decode_s / work.steps.max(1) as f64);
        prefill = prefill.min(1e3 * stats.prefill_s);
        session.reset();
    }
    Ok(Timed { tunables, error: Some(error), decode_ms: Some(decode), prefill_ms: Some(prefill), rejected: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_the_default_and_are_distinct() {
        let Some(gpu) = Gpu::new(None).ok() else { return };
        let all = candidates(&gpu);
        assert_eq!(all[0], gpu.options().tunables());
        let mut seen = std::collections::HashSet::new();
        assert!(all.iter().all(|t| seen.insert(*t)), "{all:?}");
        assert!(all.iter().all(|t| !t.subgroups || gpu.supports_subgroups()));
        assert!(all.len() >= 8);
    }

    #[test]
    fn a_tuned_precision_applies_only_where_left_to_the_tuning() {
        let chosen = Tunables { f16_weights: true, f16_math: true, subgroups: true, ..Tunables::default() };
        let f32 = Options::default();
        let f16 = Options { f16_weights: true, ..Options::default() };
        let tuned = with_tuning(f32, chosen, true);
        assert!(tuned.f16_weights && tuned.f16_math && tuned.subgroups);
        // The caller's own precision (`--precision f32`, `--precision f16`) is kept; the forms are
        // taken.
        let kept = with_tuning(f32, chosen, false);
        assert!(!kept.f16_weights && !kept.f16_math && kept.subgroups);
        let kept = with_tuning(f16, Tunables::default(), false);
        assert!(kept.f16_weights && !kept.f16_math);
    }

    #[test]
    fn an_f16_form_must_keep_the_greedy_tokens() {
        let want = vec![vec![1.0f32, 3.0, 2.0], vec![5.0, 0.0, 4.999]];
        let flipped = vec![vec![1.0f32, 3.0, 2.0], vec![4.999, 0.0, 5.0]];
        let f16 = Tunables { f16_weights: true, ..Tunables::default() };
        assert!(verdict(&Tunables::default(), &want, &flipped, true).is_ok());
        assert!(verdict(&f16, &want, &flipped, true).unwrap_err().contains("greedy token"));
        assert!(verdict(&f16, &want, &flipped, false).is_ok());
        // Past its own tolerance (3e-3 of the largest logit), or the f32 forms' (2e-3).
        let off = vec![vec![1.0f32, 3.0, 2.0], vec![5.0, 0.0, 4.999 - 0.0125]];
        assert!(verdict(&f16, &want, &off, true).is_ok());
        assert!(verdict(&Tunables::default(), &want, &off, true).unwrap_err().contains("differs"));
        let far = vec![vec![1.0f32, 3.0, 2.0], vec![5.0, 0.0, 4.999 - 0.02]];
        assert!(verdict(&f16, &want, &far, true).unwrap_err().contains("differs"));
    }

    #[test]
    fn relative_error_is_scaled_and_catches_shapes_and_nans() {
        let want = vec![vec![10.0f32, -20.0], vec![1.0]];
        assert_eq!(relative_error(&want, &want), 0.0);
        let got = vec![vec![10.0f32, -19.0], vec![1.0]];
        assert!((relative_error(&want, &got) - 0.05).abs() < 1e-12);
        assert!(relative_error(&want, &[vec![10.0, -20.0]]).is_infinite());
        assert!(relative_error(&want, &[vec![f32::NAN, -20.0], vec![1.0]]).is_infinite());
    }

    #[test]
    fn file_names_are_slugs() {
        let f = file_of(Path::new("/d"), "llvmpipe (LLVM 15.0.7, 256 bits)");
        assert_eq!(f, Path::new("/d/llvmpipe-llvm-15-0-7-256-bits.json"));
    }
}
