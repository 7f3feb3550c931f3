//! The differential target's machinery: a spec drawn from the whole language, inputs drawn for
//! the graph it builds, and every engine held to the reference interpreter on them.
//!
//! The spec is drawn knob by knob so that most draws front-end: dimensions are small and
//! consistent (`kv_heads` divides `heads`, `heads · head_dim = d_model`, options only under the
//! scheme they belong to), and a rarer *wild* draw lets any integer stray out of its range and
//! options appear where they do not apply, so refusals are drawn too. Once the fuzzer's bytes run
//! out every draw takes its first, plainest value, so short inputs are small ordinary models.

use arbitrary::Unstructured;
use kiln_compiler::FrontEnd;
use kiln_compiler::graph::build::{build_cached, build_encoder};
use kiln_compiler::graph::{Graph, InputRole, Op, Sym};
use kiln_compiler::lower::{Options, Plan, WeightFormat, lower, lower_with};
use kiln_compiler::spec::{BlockKind, PositionKind, Resolved};
use kiln_compiler::tensor::{Tensor, Tensor64};
use kiln_compiler::{interp, optimize};
use kiln_runtime::generate::Session;
use kiln_runtime::{CpuEngine, CpuModel, Engine, Gpu, GpuEngine, GpuModel, InterpEngine, Memory, QuantWeight};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, LazyLock};

/// Agreement required of every engine: `TOLERANCE · max(1, max |x|)` of the reference output.
pub const TOLERANCE: f32 = 1e-4;

/// wgpu may differ from the interpreter by up to this many times the CPU back end's largest
/// difference on the same run, when that is above [`TOLERANCE`]. The CPU back end's difference
/// measures how far f32 arithmetic in another order drifts on the model drawn: on a badly
/// conditioned one (sharp attention and norm gains near 2 over several layers) lavapipe's `exp`
/// and its orders of summation drift some ten times further, with no bug behind it.
pub const WGPU_DRIFT: f32 = 16.0;

/// How much further from the graph evaluated in f64 (`interp::run_f64`) than the f32
/// interpreter an engine may be where the two disagree past every other tolerance: the engine's
/// f32 arithmetic in another order is no less accurate by right than the interpreter's, but no
/// more either; twice as far from the exact value is still rounding, a kernel computing
/// something else is not. The f64 evaluation is made only then.
pub const REFERENCE_SLACK: f32 = 2.0;

/// Every engine may also differ by as much as the interpreter's own outputs move when every
/// parameter is scaled by `1 ± NUDGE` (a few f32 ulps, signs at random): how far this model
/// amplifies rounding. Sharp attention (a large `attention.scale` over normalised queries and
/// keys) and gains near 2 through several layers amplify it past [`TOLERANCE`] with no bug behind.
pub const NUDGE: f32 = 1.0 / (1 << 20) as f32;

/// How many nudged parameter sets (independent signs) the sensitivity is the largest of. One
/// draw is a noisy estimate: on `fuzz/regressions/differential/deepnorm-moe-cpu-drift`, twelve
/// draws moved the logits by 0.0026 to 0.149 (median about 0.06), and the one drawn, 0.0063, fell
/// under the CPU back end's 0.009; the largest of three falls that low about once in 250 such runs.
pub const NUDGES: u64 = 3;

/// Longest sequence drawn (positions are at most this many too).
const MAX_SEQ: u64 = 40;

/// The wgpu device, when an adapter opens (and `KILN_SKIP_GPU=1` does not say to leave it).
/// Compiling a model's kernels on lavapipe costs about a second, thirty times the rest of a case,
/// so wgpu runs one accepted spec in eight, as drawn, unless `KILN_FUZZ_GPU=always`.
static GPU: LazyLock<Option<Arc<Gpu>>> = LazyLock::new(|| {
    if std::env::var("KILN_SKIP_GPU").is_ok_and(|v| v == "1") {
        return None;
    }
    Gpu::new(None).ok().map(Arc::new)
});

/// The wgpu device of [`GPU`], for the other differential targets.
pub(crate) fn gpu() -> Option<&'static Arc<Gpu>> {
    GPU.as_ref()
}

/// `KILN_FUZZ_VERBOSE=1`: every comparison's largest difference on stderr (to judge a finding).
static VERBOSE: LazyLock<bool> = LazyLock::new(|| std::env::var("KILN_FUZZ_VERBOSE").is_ok_and(|v| v == "1"));

/// SplitMix64: the bulk data of a case (ids, masks, parameters' seed) from one drawn seed, so the
/// fuzzer's bytes go to the decisions.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Decisions drawn from the fuzzer's bytes.
pub(crate) struct Draw<'a, 'u> {
    u: &'u mut Unstructured<'a>,
    /// Integers may leave their ranges and options appear out of place.
    wild: bool,
}

impl Draw<'_, '_> {
    /// `true` with probability `n / d`; `false` once the bytes are spent.
    pub(crate) fn chance(&mut self, n: u8, d: u8) -> bool {
        !self.u.is_empty() && self.u.ratio(n, d).unwrap_or(false)
    }

    /// An integer in `lo..=hi` (`lo` once the bytes are spent); in a wild draw, now and then
    /// anything from 0 to twice `hi`.
    fn int(&mut self, lo: u64, hi: u64) -> u64 {
        if self.wild && self.chance(1, 8) {
            return self.u.int_in_range(0..=2 * hi + 1).unwrap_or(0);
        }
        self.tame(lo, hi)
    }

    /// An integer in `lo..=hi`, wild or not (`lo` once the bytes are spent).
    pub(crate) fn tame(&mut self, lo: u64, hi: u64) -> u64 {
        self.u.int_in_range(lo..=hi.max(lo)).unwrap_or(lo)
    }

    /// One of `items`, which are not empty (the first once the bytes are spent).
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        let i = self.u.choose_index(items.len()).unwrap_or(0);
        items[i]
    }

    /// Whether an option that belongs elsewhere is written anyway (wild draws only).
    fn stray(&mut self) -> bool {
        self.wild && self.chance(1, 10)
    }
}

/// TOML text, a table at a time.
#[derive(Default)]
struct Toml(String);

impl Toml {
    fn table(&mut self, name: &str) {
        let _ = write!(self.0, "\n[{name}]\n");
    }

    fn key(&mut self, key: &str, value: impl std::fmt::Display) {
        let _ = writeln!(self.0, "{key} = {value}");
    }

    fn float(&mut self, key: &str, value: f64) {
        self.key(key, format!("{value:?}"));
    }

    fn string(&mut self, key: &str, value: &str) {
        self.key(key, format!("\"{value}\""));
    }
}

/// A spec drawn from every table of the language (all but `[weights]`, which random parameters
/// by canonical name make moot), as TOML text.
fn draw_spec(d: &mut Draw) -> String {
    let mut t = Toml::default();
    let kind = d.pick(&["decoder", "encoder", "encoder-decoder"]);
    let heads = d.int(1, 4);
    // At least 8 wide in all, so that `d_model` = heads · head_dim.
    let head_dim = d.pick(&[4u64, 2, 6, 8, 16]).max(8u64.div_ceil(heads.max(1)).next_multiple_of(2));
    // `d_model` in 8..=64: heads · head_dim, or another width with `head_dim` written out.
    let explicit_head_dim = d.chance(1, 5);
    let d_model = match explicit_head_dim {
        true => d.int(8, 64),
        false => (heads * head_dim).clamp(8, 64),
    };
    let max_positions = d.int(4, MAX_SEQ);
    let layers = d.int(1, 3);

    t.table("model");
    t.string("kind", kind);
    t.key("vocab", d.int(2, 64));
    t.key("d_model", d_model);
    t.key("layers", layers);
    // The layers of the stack the mask applies to (an encoder-decoder's decoder).
    let mut masked_layers = layers;
    if kind == "encoder-decoder" || d.stray() {
        for key in ["encoder_layers", "decoder_layers"] {
            if d.chance(1, 3) {
                let n = d.int(1, 3);
                t.key(key, n);
                if key == "decoder_layers" {
                    masked_layers = n;
                }
            }
        }
    }
    t.key("max_positions", max_positions);

    t.table("embedding");
    match d.pick(&[0u8, 0, 1, 2]) {
        1 => t.float("scale", d.pick(&[2.0, 0.5, 1.7, -1.0])),
        2 => t.string("scale", "sqrt-d-model"),
        _ => {}
    }
    if d.chance(1, 4) {
        t.key("norm", true);
    }
    if d.chance(1, 5) {
        t.key("token_types", d.int(1, 3));
    }
    if (kind == "encoder-decoder" || d.stray()) && d.chance(1, 3) {
        t.key("shared", false);
    }

    t.table("positions");
    let positions = d.pick(&["learned", "rope", "none", "sinusoidal", "alibi", "relative-bias"]);
    t.string("kind", positions);
    if positions == "rope" || d.stray() {
        if d.chance(1, 2) {
            t.float("theta", d.pick(&[10000.0, 100.0, 1e6]));
        }
        if d.chance(1, 3) {
            t.float("fraction", d.pick(&[0.5, 0.25, 0.75, 1.0]));
        }
    }
    if matches!(positions, "rope" | "sinusoidal") && d.chance(1, 3) {
        t.string("style", d.pick(&["rotate-half", "interleaved"]));
    }
    if positions == "relative-bias" || d.stray() {
        let buckets = 2 * d.int(2, 8);
        if d.chance(1, 2) {
            t.key("buckets", buckets);
        }
        if d.chance(1, 2) {
            t.key("max_distance", d.int(buckets / 2 + 1, 48));
        }
    }

    t.table("norm");
    t.string("kind", d.pick(&["layernorm", "rmsnorm", "layernorm-no-bias"]));
    let placement = d.pick(&["pre", "post", "deepnorm", "sandwich", "post-sublayer"]);
    t.string("placement", placement);
    if d.chance(1, 3) {
        t.float("eps", d.pick(&[1e-6, 1e-5, 1e-12, 0.1]));
    }
    if (placement == "deepnorm" || d.stray()) && d.chance(1, 2) {
        t.float("alpha", d.pick(&[1.5, 0.5, 2.0]));
    }
    if d.chance(1, 3) {
        t.key("final", d.chance(1, 2));
    }
    if d.chance(1, 5) {
        t.float("gain_offset", d.pick(&[1.0, 0.5]));
    }
    if (placement == "pre" || d.stray()) && d.chance(1, 4) {
        t.key("parallel_residual", true);
    }

    t.table("attention");
    t.key("heads", heads);
    if d.chance(1, 2) {
        let divisors: Vec<u64> = (1..=heads.max(1)).filter(|k| heads.is_multiple_of(*k)).collect();
        let kv = d.pick(&divisors);
        t.key("kv_heads", d.int(kv, kv));
    }
    if explicit_head_dim {
        t.key("head_dim", d.int(head_dim, head_dim));
    }
    let default_mask = if kind == "encoder" { "bidirectional" } else { "causal" };
    let mask = match d.chance(1, 3) {
        true => default_mask,
        false => {
            let mask = d.pick(&["sliding-window", "bidirectional", "causal"]);
            t.string("mask", mask);
            mask
        }
    };
    if mask == "sliding-window" || d.stray() {
        t.key("window", d.int(1, max_positions));
        // Global layers: periodic, or each layer's kind listed (in either spelling).
        let global = match d.pick(&[0u8, 0, 1, 2]) {
            1 => {
                t.key("global_every", d.int(1, 3));
                true
            }
            2 => {
                let n = d.int(masked_layers, masked_layers);
                let kinds = ["\"sliding-window\"", "\"global\"", "\"sliding_attention\"", "\"full_attention\""];
                let list: Vec<&str> = (0..n.min(8)).map(|_| d.pick(&kinds)).collect();
                t.key("layer_types", format!("[{}]", list.join(", ")));
                true
            }
            _ => false,
        };
        if (global || d.stray()) && positions == "rope" && d.chance(1, 2) {
            t.float("global_theta", d.pick(&[1e6, 500.0]));
        }
    }
    if d.chance(1, 4) {
        t.key("padding_mask", true);
    }
    if d.chance(1, 4) {
        t.key("bias", true);
    }
    for key in ["q_bias", "k_bias", "v_bias", "o_bias"] {
        if d.chance(1, 8) {
            t.key(key, d.chance(1, 2));
        }
    }
    if d.chance(1, 5) {
        t.float("scale", d.pick(&[0.25, 0.1, 1.0, 3.0]));
    }
    if d.chance(1, 5) {
        t.string("qk_norm", d.pick(&["head", "width"]));
    }
    if d.chance(1, 5) {
        t.float("softcap", d.pick(&[5.0, 0.5, 50.0]));
    }
    if mask == "bidirectional" || d.stray() {
        if d.chance(1, 6) {
            t.key("low_rank", d.int(1, 8));
            if d.chance(1, 2) {
                t.key("low_rank_shared", true);
            }
        }
        if d.chance(1, 5) {
            let (block, global, window, random, seed) =
                (d.int(1, 6), d.int(0, 2), d.int(0, 2), d.int(0, 3), d.int(0, 100));
            t.key(
                "block_sparse",
                format!(
                    "{{ block = {block}, global = {global}, window = {window}, random = {random}, seed = {seed} }}"
                ),
            );
        }
    }

    t.table("ffn");
    if d.chance(2, 3) {
        t.string("activation", d.pick(&["gelu", "relu", "gelu-tanh", "silu"]));
    }
    if d.chance(1, 3) {
        t.key("gated", true);
    }
    if d.chance(2, 3) {
        t.key("d_ff", d.int(4, 64));
    }
    if d.chance(1, 3) {
        t.key("bias", true);
    }

    if d.chance(1, 5) {
        t.table("moe");
        let experts = d.int(1, 4);
        t.key("experts", experts);
        t.key("top_k", d.int(1, experts));
        if d.chance(1, 3) {
            t.key("renormalize", false);
        }
    }

    // Outputs first: a head's options need logits, and a model needs an output.
    let mut outputs = Toml::default();
    let logits = match d.chance(1, 4) {
        true => {
            let logits = d.chance(1, 2);
            outputs.key("logits", logits);
            logits
        }
        false => kind != "encoder",
    };
    let hidden = if logits { d.chance(1, 3) } else { kind == "encoder-decoder" || !d.chance(1, 4) };
    if hidden {
        outputs.key("hidden_states", true);
    }
    if (kind == "encoder-decoder" || d.stray()) && d.chance(1, 3) {
        outputs.key("encoder_hidden_state", true);
    }
    // Pooling reads an encoder's or decoder's `attention_mask` (an encoder-decoder has none).
    let poolable = kind != "encoder-decoder" || d.stray();
    if poolable && (d.chance(1, 4) || (!logits && !hidden && !d.stray())) {
        outputs.string("pooling", "mean");
        if d.chance(1, 2) {
            outputs.key("normalize", true);
        }
        if d.chance(1, 5) {
            outputs.key("max_seq_length", d.int(1, max_positions));
        }
    }

    t.table("head");
    if d.chance(1, 3) {
        t.key("tied", false);
    }
    if (logits || d.stray()) && d.chance(1, 4) {
        t.key("bias", true);
    }
    if d.chance(1, 5) {
        t.float("softcap", d.pick(&[30.0, 1.0]));
    }
    if d.chance(1, 5) {
        t.float("scale", d.pick(&[0.5, 0.125, 2.0]));
    }

    t.table("outputs");
    t.0.push_str(&outputs.0);
    t.0
}

/// A sequence length for a spec: one token, the positions' end, and the edges of its windows,
/// blocks, low-rank rows and relative-bias distances, else any; now and then one past the
/// positions, which every engine must refuse or accept alike.
fn draw_length(d: &mut Draw, r: &Resolved) -> usize {
    let max = r.spec.model.max_positions.min(MAX_SEQ);
    let a = &r.spec.attention;
    let mut marks = vec![1, 2, max, max - 1];
    for edge in [a.window, a.low_rank, (r.spec.positions.kind == PositionKind::RelativeBias).then_some(r.relative.1)]
        .into_iter()
        .flatten()
    {
        marks.extend([edge.saturating_sub(1), edge, edge + 1]);
    }
    if let Some(bs) = a.block_sparse {
        for k in 1..=3 {
            marks.extend([k * bs.block - 1, k * bs.block, k * bs.block + 1]);
        }
    }
    if d.chance(1, 40) {
        return max as usize + 1;
    }
    let len = if d.chance(1, 2) { d.pick(&marks) } else { d.int(1, max) };
    len.clamp(1, max) as usize
}

/// Attend bits of a padding mask row of `len` keys: all, a prefix, random with the first key
/// kept, or (rarely) none.
fn mask_row(d: &mut Draw, rng: &mut SplitMix, len: usize) -> Vec<bool> {
    match d.pick(&[0u8, 1, 2, 1, 3]) {
        1 => {
            let keep = 1 + rng.below(len as u64) as usize;
            (0..len).map(|i| i < keep).collect()
        }
        2 => (0..len).map(|i| i == 0 || rng.below(3) != 0).collect(),
        3 => vec![false; len],
        _ => vec![true; len],
    }
}

/// Inputs for `graph`: a batch, a length per sequence symbol, ids in the vocabulary (now and then
/// one outside it), token types, and padding masks with some keys padded (or the mask left out).
fn draw_inputs(d: &mut Draw, rng: &mut SplitMix, fe: &FrontEnd) -> HashMap<String, Tensor> {
    let r = &fe.spec;
    let batch = d.tame(1, 3) as usize;
    let mut lengths: HashMap<Sym, usize> = HashMap::new();
    let mut inputs = HashMap::new();
    for (node, name, role) in fe.graph.inputs() {
        let Op::Input { seq, .. } = &fe.graph.g[node].op else { continue };
        let len = *lengths.entry(*seq).or_insert_with(|| draw_length(d, r));
        // `sample_inputs` as the base: its tensor for this input at this length.
        let Ok(mut base) = interp::sample_inputs(&fe.graph, r.spec.model.vocab as usize, batch, len) else { continue };
        let Some(tensor) = base.remove(name) else { continue };
        let n = batch * len;
        let tensor = match role {
            InputRole::Ids => {
                let vocab = r.spec.model.vocab;
                let mut ids: Vec<i64> = (0..n).map(|_| rng.below(vocab) as i64).collect();
                if d.chance(1, 40) {
                    ids[rng.below(n as u64) as usize] = d.pick(&[vocab as i64, -1]);
                }
                Tensor::i64(vec![batch, len], ids)
            }
            InputRole::TokenTypes => {
                if d.chance(1, 4) {
                    continue;
                }
                let types = r.spec.embedding.token_types.max(1);
                let mut data: Vec<i64> = (0..n).map(|_| rng.below(types) as i64).collect();
                if d.chance(1, 40) {
                    data[0] = types as i64;
                }
                Tensor::i64(vec![batch, len], data)
            }
            InputRole::KeyMask { pad_is_one } => {
                if d.chance(1, 8) {
                    continue;
                }
                let bits: Vec<i64> = (0..batch)
                    .flat_map(|_| mask_row(d, rng, len))
                    .map(|attend| i64::from(attend != pad_is_one))
                    .collect();
                Tensor::i64(vec![batch, len], bits)
            }
            // Forward graphs take no labels; a training graph's are `sample_inputs`' own.
            InputRole::Cache { .. } | InputRole::Labels => tensor,
        };
        inputs.insert(name.to_string(), tensor);
    }
    inputs
}

/// What an engine made of a run: outputs by name, or its refusal.
type Outcome = Result<Vec<(String, Tensor)>, String>;

/// A failed check, with the spec and run it was on.
fn fail(spec: &str, what: String) -> ! {
    panic!("differential: {what}\n--- spec ---{spec}")
}

/// `graph`'s outputs evaluated in f64 ([`interp::run_f64`]) at the f32 `params`: the exact
/// values to f64's rounding, where the f32 interpreter carries f32's. `None` where the f64
/// evaluation refuses (it evaluates what the f32 one does: only memory limits would).
pub(crate) fn run_exact(
    graph: &Graph,
    params: &HashMap<String, Tensor>,
    inputs: &HashMap<String, Tensor>,
) -> Option<Vec<(String, Tensor64)>> {
    let wide: HashMap<String, Tensor64> = params.iter().map(|(n, t)| (n.clone(), t.into())).collect();
    interp::run_f64(graph, &wide, inputs).ok()
}

/// [`run_exact`]'s outputs, each rounded once to f32 (the nearest an f32 engine could come).
fn exact_outputs(
    graph: &Graph,
    params: &HashMap<String, Tensor>,
    inputs: &HashMap<String, Tensor>,
) -> Option<Vec<(String, Vec<f32>)>> {
    let outputs = run_exact(graph, params, inputs)?;
    Some(outputs.into_iter().map(|(n, t)| (n, t.data.iter().map(|&x| x as f32).collect())).collect())
}

/// For a value off the reference `want` past every tolerance: `Ok` where `got` is no further
/// from the exact value (`exact`, from [`run_exact`]) than [`REFERENCE_SLACK`] times `want` is —
/// rounding, not a finding; else the message's account of both distances (empty without an
/// exact value of `want`'s length).
pub(crate) fn against_exact(exact: Option<&[f32]>, want: &[f32], got: &[f32]) -> Result<(), String> {
    let Some(exact) = exact.filter(|e| e.len() == want.len()) else { return Err(String::new()) };
    let (engine, reference) = (distance(exact, got), distance(exact, want));
    match engine <= REFERENCE_SLACK * reference {
        true => Ok(()),
        false => Err(format!("; from the f64 evaluation {engine:e}, the interpreter {reference:e}")),
    }
}

/// The largest difference of two outputs' elements; non-finite values count as infinitely far
/// unless both are the same (a NaN against a NaN, an infinity against itself).
pub(crate) fn distance(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| {
        let e = match (x.is_finite(), y.is_finite()) {
            (true, true) => (x - y).abs(),
            _ if x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()) => 0.0,
            _ => f32::INFINITY,
        };
        m.max(e)
    })
}

/// `got` agrees with the reference outcome `want`: both refuse, or both give the same outputs
/// within [`TOLERANCE`] of the reference's scale, or `floor` if larger (non-finite values where
/// the reference has them) — or, past those, no more than [`REFERENCE_SLACK`] times as far from
/// the outputs in f64 (`exact`) as the reference is.
fn check<'e>(
    spec: &str,
    label: &str,
    want: &Outcome,
    got: &Outcome,
    floor: f32,
    exact: &impl Fn() -> Option<&'e [(String, Vec<f32>)]>,
) {
    match (want, got) {
        (Err(_), Err(_)) => {}
        (Ok(_), Err(e)) => fail(spec, format!("{label} refused what the interpreter ran: {e}")),
        (Err(e), Ok(_)) => fail(spec, format!("{label} ran what the interpreter refused ({e})")),
        (Ok(want), Ok(got)) => {
            let names = |o: &[(String, Tensor)]| o.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
            if names(want) != names(got) {
                fail(spec, format!("{label} outputs {:?}, the interpreter {:?}", names(got), names(want)));
            }
            for ((name, a), (_, b)) in want.iter().zip(got) {
                if *VERBOSE {
                    eprintln!("{label}: `{name}` max abs difference {}", a.max_abs_diff(b));
                }
                if a.shape != b.shape {
                    fail(spec, format!("{label}: `{name}` has shape {:?}, the interpreter's {:?}", b.shape, a.shape));
                }
                let (a, b) = (a.as_f32().unwrap_or_default(), b.as_f32().unwrap_or_default());
                if let Some(err) = differs(a, b, floor) {
                    let exact = exact().and_then(|e| e.iter().find(|(n, _)| n == name)).map(|(_, e)| e.as_slice());
                    if let Err(why) = against_exact(exact, a, b) {
                        fail(spec, format!("{label}: `{name}` {err}{why}"));
                    }
                }
            }
        }
    }
}

/// The largest difference between the finite values of two engines' outputs (0 if either refused).
fn drift(want: &Outcome, got: &Outcome) -> f32 {
    let (Ok(want), Ok(got)) = (want, got) else { return 0.0 };
    let values = |o: &[(String, Tensor)]| -> Vec<f32> {
        o.iter().flat_map(|(_, t)| t.as_f32().unwrap_or_default().to_vec()).collect()
    };
    largest_difference(&values(want), &values(got))
}

/// The largest difference between the values finite in both.
fn largest_difference(want: &[f32], got: &[f32]) -> f32 {
    want.iter().zip(got).filter(|(a, b)| a.is_finite() && b.is_finite()).fold(0.0, |m, (a, b)| m.max((a - b).abs()))
}

/// The tolerance of `label`'s engine above [`TOLERANCE`]: the model's sensitivity to rounding
/// (see [`NUDGE`]), and for wgpu the CPU back end's drift (see [`WGPU_DRIFT`]).
fn floor(label: &str, sensitivity: f32, cpu_drift: f32) -> f32 {
    let wgpu = if label.starts_with("wgpu") { WGPU_DRIFT * cpu_drift } else { 0.0 };
    sensitivity.max(wgpu)
}

/// [`NUDGES`] copies of `params`, each value of each scaled by `1 ± NUDGE` (signs from `seed`).
pub(crate) fn nudges(params: &HashMap<String, Tensor>, seed: u64) -> Vec<HashMap<String, Tensor>> {
    (0..NUDGES).map(|i| nudge(params, seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))).collect()
}

/// `params` with every value scaled by `1 ± NUDGE`.
fn nudge(params: &HashMap<String, Tensor>, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = SplitMix(seed);
    let mut names: Vec<&String> = params.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let t = &params[name];
            let data = (t.as_f32().unwrap_or_default().iter())
                .map(|&x| x * if rng.next_u64() & 1 == 0 { 1.0 + NUDGE } else { 1.0 - NUDGE })
                .collect();
            (name.clone(), Tensor::f32(t.shape.clone(), data))
        })
        .collect()
}

/// How `got` differs from `want` beyond [`TOLERANCE`] (or `floor`), if it does.
fn differs(want: &[f32], got: &[f32], floor: f32) -> Option<String> {
    if want.len() != got.len() {
        return Some(format!("has {} values, the interpreter's {}", got.len(), want.len()));
    }
    let scale = want.iter().filter(|x| x.is_finite()).fold(1.0f32, |m, x| m.max(x.abs()));
    let mut worst: Option<(usize, f32)> = None;
    for (i, (&a, &b)) in want.iter().zip(got).enumerate() {
        let err = match (a.is_finite(), b.is_finite()) {
            (true, true) => (a - b).abs(),
            _ if a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) => 0.0,
            _ => f32::INFINITY,
        };
        if err > (TOLERANCE * scale).max(floor) && worst.is_none_or(|(_, w)| err > w) {
            worst = Some((i, err));
        }
    }
    worst.map(|(i, err)| {
        format!("differs by {err} at {i} ({} vs the interpreter's {}; max |x| {scale})", got[i], want[i])
    })
}

/// An engine that runs a whole graph on inputs.
type Runner = Box<dyn Fn(&HashMap<String, Tensor>) -> Outcome>;

/// The engines held to the interpreter on `graph`: the interpreter itself, the CPU back end at 1
/// and 3 threads, and wgpu when there is an adapter. A back end that refuses to load the plan
/// refuses every run.
fn engines(
    graph: &Graph,
    params: &HashMap<String, Tensor>,
    tag: &str,
    gpu: Option<&Arc<Gpu>>,
) -> Vec<(String, Runner)> {
    quantized_engines(graph, params, None, tag, gpu)
}

/// [`engines`], with `quantized`'s blocks read by the projections whose weights have them (the
/// plan lowered with their formats) and `params` the weights the blocks stand for.
fn quantized_engines(
    graph: &Graph,
    params: &HashMap<String, Tensor>,
    quantized: Option<&Quantized>,
    tag: &str,
    gpu: Option<&Arc<Gpu>>,
) -> Vec<(String, Runner)> {
    let mut out: Vec<(String, Runner)> = Vec::new();
    let (g, p) = (graph.clone(), params.clone());
    out.push((format!("interp ({tag})"), Box::new(move |i| interp::run(&g, &p, i).map_err(|e| e.to_string()))));
    let plan = plan_of(graph, quantized);
    let blocks = quantized.map(|q| q.blocks.clone()).unwrap_or_default();
    for threads in [1, 3] {
        let label = format!("cpu x{threads} ({tag})");
        match CpuModel::new(plan.clone(), params, &blocks, threads, &()) {
            Ok(model) => out.push((label, Box::new(move |i| model.run(i).map_err(|e| e.to_string())))),
            Err(e) => {
                let e = e.to_string();
                out.push((label, Box::new(move |_| Err(format!("load: {e}")))));
            }
        }
    }
    if let Some(gpu) = gpu {
        let label = format!("wgpu ({tag})");
        match GpuModel::with_blocks(gpu.clone(), plan, params, &blocks) {
            Ok(model) => out.push((label, Box::new(move |i| model.run(i).map_err(|e| e.to_string())))),
            Err(e) => {
                let e = e.to_string();
                out.push((label, Box::new(move |_| Err(format!("load: {e}")))));
            }
        }
    }
    out
}

/// A case's parameters with its matrices block-quantized: what a GGUF checkpoint of the model
/// drawn would hold.
struct Quantized {
    /// The format.
    format: WeightFormat,
    /// Every parameter, the quantized ones as the weights their blocks stand for.
    params: HashMap<String, Tensor>,
    /// The blocks of every matrix whose rows are whole blocks of the format.
    blocks: HashMap<String, QuantWeight>,
}

/// The plan of `graph`, its projections reading `quantized`'s blocks where given.
fn plan_of(graph: &Graph, quantized: Option<&Quantized>) -> Plan {
    match quantized {
        Some(q) => {
            let formats = q.blocks.keys().map(|name| (name.clone(), q.format)).collect();
            lower_with(graph, Options { formats, ..Options::default() })
        }
        None => lower(graph),
    }
}

/// The block-quantized formats a quantized case chooses among.
const FORMATS: [WeightFormat; 5] =
    [WeightFormat::Q8_0, WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q4_K, WeightFormat::Q6_K];

/// One case in [`QUANTIZED_ONE_IN`] runs again with its matrices block-quantized ([`Quantized`]),
/// in a format some matrix's rows take whole blocks of; chosen from the parameters' `seed`, so no
/// decision of the input is spent and every input replays as it did before this mode. `None`:
/// not this case, or no matrix takes any format.
fn quantize(params: &HashMap<String, Tensor>, seed: u64) -> Option<Quantized> {
    let mut rng = SplitMix(seed ^ 0x5155_414e_5449_5a45);
    if !rng.next_u64().is_multiple_of(QUANTIZED_ONE_IN) {
        return None;
    }
    let mut names: Vec<&String> = params.keys().collect();
    names.sort();
    let takes = |f: WeightFormat| {
        names
            .iter()
            .any(|n| matches!(params[*n].shape.as_slice(), [_, k] if *k > 0 && k.is_multiple_of(f.row_multiple())))
    };
    let usable: Vec<WeightFormat> = FORMATS.into_iter().filter(|&f| takes(f)).collect();
    let format = *usable.get((rng.next_u64() % usable.len().max(1) as u64) as usize)?;
    let mut quantized = params.clone();
    let mut blocks = HashMap::new();
    for name in names {
        if let Some(q) = QuantWeight::quantize(format, &params[name]) {
            quantized.insert(name.clone(), q.dequantize());
            blocks.insert(name.clone(), q);
        }
    }
    Some(Quantized { format, params: quantized, blocks })
}

/// See [`quantize`].
const QUANTIZED_ONE_IN: u64 = 4;

/// How a differential case went, for the campaign's counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// The rule and message of the front end's first diagnostic, when it refused the spec.
    pub refused_spec: Option<(&'static str, String)>,
    /// The spec drawn.
    pub spec: String,
    /// Runs every engine ran.
    pub ran: usize,
    /// Runs every engine refused.
    pub refused_runs: usize,
    /// Cached decoding steps compared.
    pub cached_steps: usize,
    /// The format the case's matrices were also run quantized in, if they were.
    pub quantized: Option<WeightFormat>,
}

/// Kiln bugs this target found that are reported and not fixed yet: the regression name of
/// each, the checks it would fail, and whether a spec meets it. [`run`] leaves those checks out
/// of such a spec, so a campaign looks for new bugs; [`run_all`] does not (the `#[ignore]`d
/// regression tests named after them in `tests/fuzz_regressions.rs`). Remove an entry with its fix.
pub const KNOWN: [Known; 0] = [
    // Fixed on main: `cached-decoder-with-bidirectional-mask` (generation refuses a decoder with
    // a bidirectional mask) and `parallel-residual-drops-cross-attention` (`check` refuses a
    // parallel residual in an encoder-decoder); their inputs stay in the regressions.
];

/// A [`KNOWN`] bug.
#[derive(Clone, Copy, Debug)]
pub struct Known {
    /// Its regression name: its input in `fuzz/regressions/differential/`, its test.
    pub name: &'static str,
    /// The checks it fails.
    pub voids: Voids,
    /// Whether a spec meets it.
    pub meets: fn(&Resolved) -> bool,
}

/// The checks a [`KNOWN`] bug fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Voids {
    /// Cached decoding against recomputation.
    Cached,
    /// Every check: the spec is only front-ended.
    All,
}

/// The differential target's body (see [`crate::differential`]), returning what it compared;
/// checks that would only meet a [`KNOWN`] bug are left out.
pub fn run(data: &[u8]) -> Tally {
    run_with(data, true, None)
}

/// [`run`] with every check, the [`KNOWN`] bugs' included.
pub fn run_all(data: &[u8]) -> Tally {
    run_with(data, false, None)
}

/// [`run_all`] on `spec` in place of the one `data` draws (its other decisions as `data` takes
/// them): a finding replayed on its spec as written, or with a knob changed.
pub fn run_spec(spec: &str, data: &[u8]) -> Tally {
    run_with(data, false, Some(spec))
}

/// The spec `data` draws (what [`run`] front-ends first), to report a failing input by.
pub fn spec(data: &[u8]) -> String {
    begin(&mut Unstructured::new(data)).1
}

/// The first decisions of an input: whether it is wild, and its spec.
pub(crate) fn begin<'a, 'u>(u: &'u mut Unstructured<'a>) -> (Draw<'a, 'u>, String) {
    let wild = !u.is_empty() && u.ratio(1, 8).unwrap_or(false);
    let mut d = Draw { u, wild };
    let spec = draw_spec(&mut d);
    (d, spec)
}

fn run_with(data: &[u8], skip_known: bool, given: Option<&str>) -> Tally {
    let mut u = Unstructured::new(data);
    let (mut d, drawn) = begin(&mut u);
    let spec = given.map_or(drawn, str::to_string);
    let mut tally = Tally::default();
    let fe = match kiln_compiler::front_end("differential.toml", &spec) {
        Ok(fe) => fe,
        Err(e) => {
            let _ = e.render();
            tally.refused_spec = e.diagnostics.first().map(|d| (d.rule, d.message.clone()));
            tally.spec = spec;
            return tally;
        }
    };
    tally.spec = spec.clone();
    let voids = |what| skip_known && KNOWN.iter().any(|k| k.voids == what && (k.meets)(&fe.spec));
    if voids(Voids::All) {
        return tally;
    }
    let mut rng = SplitMix(d.u.arbitrary::<u64>().unwrap_or(0));
    let seed = rng.next_u64();
    let Ok(params) = interp::random_params(&fe.graph, seed) else { return tally };
    let nudged = nudges(&params, !seed);
    let Ok((optimized, _)) = optimize::optimize(&fe.graph) else {
        fail(&spec, "the optimizer failed on a graph the front end accepted".into())
    };
    let always = std::env::var("KILN_FUZZ_GPU").is_ok_and(|v| v == "always");
    // Drawn whether or not there is an adapter, so a replay takes the same decisions anywhere.
    let on_gpu = d.chance(1, 8) || always;
    let gpu = GPU.as_ref().filter(|_| on_gpu);
    let mut all = engines(&fe.graph, &params, "unoptimized", gpu);
    all.extend(engines(&optimized, &params, "optimized", gpu));
    // Each group's first engine is its reference, the interpreter on the group's parameters.
    let quantized = quantize(&params, seed).map(|q| {
        let nudged = nudges(&q.params, !seed);
        (q, nudged)
    });
    let mut groups = vec![(all, nudged.as_slice(), &params)];
    if let Some((q, nudged)) = &quantized {
        let mut all = quantized_engines(&fe.graph, &q.params, Some(q), &format!("unoptimized, {}", q.format), gpu);
        all.extend(quantized_engines(&optimized, &q.params, Some(q), &format!("optimized, {}", q.format), gpu));
        groups.push((all, nudged.as_slice(), &q.params));
        tally.quantized = Some(q.format);
    }
    let cases = d.tame(1, 3);
    for _ in 0..cases {
        let inputs = draw_inputs(&mut d, &mut rng, &fe);
        let shapes: Vec<String> = {
            let mut s: Vec<String> = inputs.iter().map(|(n, t)| format!("{n} {:?}", t.shape)).collect();
            s.sort();
            s
        };
        for (group, (all, nudged, group_params)) in groups.iter().enumerate() {
            let (_, reference) = &all[0];
            let want = reference(&inputs);
            match (&want, group) {
                (Ok(_), 0) => tally.ran += 1,
                (Err(_), 0) => tally.refused_runs += 1,
                _ => {}
            }
            let sensitivity = match &want {
                Ok(_) => nudged.iter().fold(0.0, |m, nudged| {
                    drift(&want, &interp::run(&fe.graph, nudged, &inputs).map_err(|e| e.to_string())).max(m)
                }),
                Err(_) => 0.0,
            };
            if *VERBOSE {
                eprintln!("sensitivity to rounding: {sensitivity}");
            }
            let outcomes: Vec<(&String, Outcome)> = all[1..].iter().map(|(label, run)| (label, run(&inputs))).collect();
            let cpu_drift = (outcomes.iter())
                .filter(|(label, _)| label.starts_with("cpu"))
                .fold(0.0, |m, (_, got)| drift(&want, got).max(m));
            // The graph in f64, made only where an engine is off past the tolerances.
            let exact = std::cell::OnceCell::new();
            let exact = || exact.get_or_init(|| exact_outputs(&fe.graph, group_params, &inputs)).as_deref();
            for (label, got) in &outcomes {
                let floor = floor(label, sensitivity, cpu_drift);
                check(&spec, &format!("{label} on {}", shapes.join(", ")), &want, got, floor, &exact);
            }
        }
    }
    if fe.spec.logits && !voids(Voids::Cached) {
        tally.cached_steps = cached(&mut d, &mut rng, &fe, (&params, &nudged), None, &spec, gpu);
        // Decoding with the blocks: the decode steps' GEMV forms read them.
        if let Some((q, nudged)) = &quantized {
            tally.cached_steps += cached(&mut d, &mut rng, &fe, (&q.params, nudged), Some(q), &spec, gpu);
        }
    }
    tally
}

/// The last position's logits after a chunk of cached decoding, or its refusal.
type Step = Result<Vec<f32>, String>;

/// A decoder engine and, for an encoder-decoder, its encoder's.
type EnginePair = (String, Box<dyn Engine>, Option<Box<dyn Engine>>);

/// The engines of cached decoding: the interpreter on both graphs, the CPU back end on both (1
/// and 3 threads), and wgpu on the optimized one when there is an adapter, the back ends reading
/// `quantized`'s blocks where given (`params` then the weights they stand for). A back end that
/// refuses to load a plan the interpreter runs is a finding.
fn cached_engines(
    step: &Graph,
    encoder: Option<&Graph>,
    params: &HashMap<String, Tensor>,
    quantized: Option<&Quantized>,
    gpu: Option<&Arc<Gpu>>,
) -> Result<Vec<EnginePair>, String> {
    let optimized = |g: &Graph| optimize::optimize(g).map(|(g, _)| g).map_err(|e| format!("optimize: {e}"));
    let (step_opt, encoder_opt) = (optimized(step)?, encoder.map(optimized).transpose()?);
    let interp = |g: &Graph| Box::new(InterpEngine::new(g.clone(), params.clone())) as Box<dyn Engine>;
    let blocks = quantized.map(|q| q.blocks.clone()).unwrap_or_default();
    let plan = |g: &Graph| plan_of(g, quantized);
    let cpu = |g: &Graph, threads| -> Result<Box<dyn Engine>, String> {
        let model = CpuModel::new(plan(g), params, &blocks, threads, &())
            .map_err(|e| format!("cpu x{threads} refused to load: {e}"))?;
        Ok(Box::new(CpuEngine::new(model)))
    };
    let format = quantized.map(|q| format!(", {}", q.format)).unwrap_or_default();
    let mut out: Vec<EnginePair> = vec![
        ("interp (unoptimized)".into(), interp(step), encoder.map(interp)),
        ("interp (optimized)".into(), interp(&step_opt), encoder_opt.as_ref().map(interp)),
    ];
    for (tag, s, e, threads) in [("unoptimized", step, encoder, 1), ("optimized", &step_opt, encoder_opt.as_ref(), 3)] {
        let enc = e.map(|e| cpu(e, threads)).transpose()?;
        out.push((format!("cpu x{threads} ({tag}{format})"), cpu(s, threads)?, enc));
    }
    if let Some(gpu) = gpu {
        let model = |g: &Graph| -> Result<Box<dyn Engine>, String> {
            let model = GpuModel::with_blocks(gpu.clone(), plan(g), params, &blocks)
                .map_err(|e| format!("wgpu refused to load: {e}"))?;
            Ok(Box::new(GpuEngine::new(model)))
        };
        let enc = encoder_opt.as_ref().map(model).transpose()?;
        out.push((format!("wgpu (optimized{format})"), model(&step_opt)?, enc));
    }
    Ok(out)
}

/// Cached decoding of a decoder (an encoder-decoder's with its encoder run once) on every engine
/// equals recomputing the whole model on the tokens so far: a prompt, then chunks of one to three
/// tokens, the last position's logits compared after each. Returns the steps compared.
fn cached(
    d: &mut Draw,
    rng: &mut SplitMix,
    fe: &FrontEnd,
    (params, nudged): (&HashMap<String, Tensor>, &[HashMap<String, Tensor>]),
    quantized: Option<&Quantized>,
    spec: &str,
    gpu: Option<&Arc<Gpu>>,
) -> usize {
    let r = &fe.spec;
    let Ok(step) = build_cached(r) else { return 0 };
    let encoder = match r.spec.model.kind {
        BlockKind::EncoderDecoder => match build_encoder(r) {
            Ok(g) => Some(g),
            Err(e) => fail(spec, format!("an encoder-decoder with a cached decoder has no encoder: {e}")),
        },
        _ => None,
    };
    let max = r.spec.model.max_positions.min(MAX_SEQ) as usize;
    let vocab = r.spec.model.vocab;
    // The source of an encoder-decoder: one row, maybe padded.
    let mut source: HashMap<String, Tensor> = HashMap::new();
    if let Some(enc) = &encoder {
        let len = draw_length(d, r).min(max);
        for (_, name, role) in enc.inputs() {
            let t = match role {
                InputRole::Ids => Tensor::i64(vec![1, len], (0..len).map(|_| rng.below(vocab) as i64).collect()),
                InputRole::KeyMask { pad_is_one } => {
                    let bits = mask_row(d, rng, len).into_iter().map(|a| i64::from(a != pad_is_one)).collect();
                    Tensor::i64(vec![1, len], bits)
                }
                _ => continue,
            };
            source.insert(name.to_string(), t);
        }
    }
    let Some(ids_name) = fe
        .graph
        .inputs()
        .into_iter()
        .find(|&(n, _, role)| role == InputRole::Ids && matches!(fe.graph.g[n].op, Op::Input { seq: Sym::Seq, .. }))
        .map(|(_, name, _)| name.to_string())
    else {
        return 0;
    };
    let total = d.tame(1, max as u64) as usize;
    let tokens: Vec<i64> = (0..total).map(|_| rng.below(vocab) as i64).collect();
    let mut ends = vec![d.tame(1, total as u64) as usize];
    while let Some(&end) = ends.last().filter(|&&e| e < total) {
        ends.push((end + d.tame(1, 3) as usize).min(total));
    }
    // The reference: the whole model recomputed on the tokens so far, last position's logits.
    let recompute = |params: &HashMap<String, Tensor>, end: usize| -> Step {
        let mut inputs = source.clone();
        inputs.insert(ids_name.clone(), Tensor::i64(vec![1, end], tokens[..end].to_vec()));
        let out = interp::run(&fe.graph, params, &inputs).map_err(|e| e.to_string())?;
        let logits = &out.iter().find(|(n, _)| n == "logits").ok_or("no logits")?.1;
        let data = logits.as_f32().unwrap_or_default();
        Ok(data[data.len() - r.spec.model.vocab as usize..].to_vec())
    };
    let reference: Vec<Step> = ends.iter().map(|&end| recompute(params, end)).collect();
    // Each step's sensitivity to rounding (see [`NUDGE`] and [`NUDGES`]).
    let sensitivity: Vec<f32> = (ends.iter().zip(&reference))
        .map(|(&end, want)| {
            nudged.iter().fold(0.0, |m, nudged| match (want, recompute(nudged, end)) {
                (Ok(want), Ok(got)) => largest_difference(want, &got).max(m),
                _ => m,
            })
        })
        .collect();
    let names: Vec<String> = step.outputs.iter().map(|(n, _)| n.clone()).collect();
    let max_positions = r.spec.model.max_positions as usize;
    let engines = cached_engines(&step, encoder.as_ref(), params, quantized, gpu).unwrap_or_else(|e| fail(spec, e));
    // Each engine's logits after each chunk; a chunk refused ends its session (it is as it was,
    // and the tokens after are not its own).
    let mut decoded: Vec<(String, Vec<Step>)> = Vec::new();
    for (label, engine, enc) in engines {
        let memory = match &enc {
            Some(enc) => match Memory::encode(enc.as_ref(), &source) {
                Ok(m) => m,
                Err(e) => fail(spec, format!("{label}: the encoder refused its source: {e}")),
            },
            None => Memory::default(),
        };
        let mut session = match Session::new(engine, &names, max_positions) {
            Ok(s) => s.with_memory(memory),
            Err(e) => fail(spec, format!("{label}: no session on a cached decoder: {e}")),
        };
        let mut steps = Vec::new();
        let mut start = 0;
        for &end in &ends {
            let got = session.forward(&tokens[start..end]).map_err(|e| e.to_string());
            let refused = got.is_err();
            steps.push(got);
            if refused {
                break;
            }
            start = end;
        }
        decoded.push((label, steps));
    }
    let cpu_drift = (decoded.iter().filter(|(label, _)| label.starts_with("cpu")))
        .flat_map(|(_, steps)| steps.iter().zip(&reference))
        .fold(0.0, |m, step| match step {
            (Ok(got), Ok(want)) => largest_difference(want, got).max(m),
            _ => m,
        });
    let mut compared = 0;
    for (label, steps) in &decoded {
        for (i, (got, want)) in steps.iter().zip(&reference).enumerate() {
            let start = if i == 0 { 0 } else { ends[i - 1] };
            let what = format!("{label}: cached logits after tokens {:?} (fed from {start})", &tokens[..ends[i]]);
            match (want, got) {
                (Ok(want), Ok(got)) => {
                    if *VERBOSE {
                        eprintln!("{what}: max abs difference {}", largest_difference(want, got));
                    }
                    if let Some(err) = differs(want, got, floor(label, sensitivity[i], cpu_drift)) {
                        fail(spec, format!("{what} {err}"));
                    }
                }
                (Err(_), Err(_)) => {}
                (Ok(_), Err(e)) => fail(spec, format!("{what}: refused what recomputation ran: {e}")),
                (Err(e), Ok(_)) => fail(spec, format!("{what}: ran what recomputation refused ({e})")),
            }
            compared += 1;
        }
    }
    compared
}
