//! The fused attention kernel ([`Op::Attention`], [`Op::PackedAttention`]), specialised at
//! lowering time to its head geometry (query heads, key/value heads, head width), which shape
//! inference keeps fixed.
//!
//! An invocation owns a block of *query slots*: `QB` consecutive query rows times `GC` query heads
//! of one key/value group, all reading the same keys and values. It walks the keys in tiles of
//! [`KEY_TILE`], with an online softmax per slot (one running maximum and rescale per tile, not
//! per key). Each key and value element loaded from storage serves every slot of the block, so a
//! block of `R = QB * GC` slots loads `R` times fewer K/V elements than one thread per query row
//! (grouped-query heads share their K/V loads this way), the analogue of register blocking in a
//! matmul: on lavapipe, where storage loads are issued lane by lane, loads are what bound it. The
//! slots' queries and accumulators live in private arrays, their scores in registers.
//!
//! Keys no query of the block attends are never visited: a causal block stops at its last row's
//! position, a sliding window starts at its first row's earliest key. Keys masked for only some
//! rows of a tile get probability 0.
//!
//! Loops over the head width run to the uniform `d` (equal to the baked width) rather than a
//! literal: with literal bounds LLVM (lavapipe) unrolls them whole and scalarises the private
//! arrays, and one kernel took over ten seconds to compile.
//!
//! Three forms, chosen per dispatch by `dims[7]` (see [`dims`]): `QB` rows per invocation for a
//! prefill, one row for a decode step (one query, so a block of rows would idle), and, in a
//! kernel compiled with [`Options::attention_workgroups`] (a hardware adapter's), the
//! **workgroup form** wherever those two would run fewer invocations than a GPU runs at once
//! ([`WORKGROUP_FORM_BELOW`]): a decode step's blocked forms run `batch x kv_heads` invocations
//! (3 for SmolLM2), each walking every key alone.
//!
//! The workgroup form runs a workgroup of [`WIDE_LANES`] per (batch, query row, query head) and
//! walks the keys in chunks of 64, each in two passes:
//!
//! - *scores*: lane `j` takes key `c0 + j`, dots the query (in workgroup memory, read whole by
//!   every lane) with the key's row and applies the modifiers and masks, as the blocked forms do.
//!   The chunk's maximum (`row_max`) updates the running maximum, which every lane then holds, so
//!   each lane keeps its own share of the softmax's denominator, added once at the end (`row_sum`);
//! - *values*: the chunk's probabilities and key rows go through workgroup memory, and the lanes
//!   switch to owning output columns (`lane`, `lane + 64`, ... below the head width), each
//!   walking the chunk's keys, so adjacent lanes read adjacent floats of a value row.
//!
//! Chosen over an online softmax per lane over a strided share of the keys: combining those
//! states needs every lane's accumulator of the head in workgroup memory (`64 x d` floats, 64 KiB
//! at `d` = 256) or a reduction per column, and each lane's value loads would lie a row apart from
//! its neighbours'. Here a chunk of 64 keys costs one reduction and two barriers. Grouped-query
//! heads do not share their key/value loads (each head's workgroup reads its group's rows; a GPU's
//! caches serve the repeats), and a head narrower than 64 leaves lanes idle in the value pass. A
//! block pattern's attended key blocks are walked as one list of keys, 64 at a time. Appending to
//! the caches, the copying threads follow the attention's whole workgroups, so which threads
//! attend is decided per workgroup, as barriers need (uniform control flow).
//!
//! **Split over key ranges** (flash-decoding, with [`Options::attention_split_keys`]): where the
//! workgroup form would launch fewer than [`FILL_WORKGROUPS`] workgroups (a decode step: one per
//! query head, 9 for SmolLM2) and a row has more keys than one range, each (batch, row, head)
//! gets `splits` workgroups (`dims[14]`, at most [`MAX_SPLITS`]), each walking one range of the
//! row's keys (of the attended keys, for a block pattern) as above and writing its partial state
//! — its running maximum, its share of the denominator and its unnormalized output row — to the
//! kernel's scratch buffer `part` (`dims[15]` = 1). A second dispatch of the same kernel
//! (`dims[15]` = 2, [`combine_dims`]) then combines each row's states: rescaled to their common
//! maximum, summed, divided by the summed denominator. A range whose keys are all masked keeps
//! the initial maximum and adds nothing.
//!
//! A row whose every key is masked gets the reference's answer (the softmax of equal logits):
//! the mean of all values.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::emit::{WORKGROUP, indent, lit};
use super::scores;
use super::{Options, append};
use crate::graph::{Op, PackedAttention, ScoreMods};

/// Keys per tile of the blocked forms (unless [`Options::attention_key_tile`] names one of
/// [`KEY_TILES`]).
pub const KEY_TILE: usize = 4;

/// The key tiles the blocked forms can take ([`Options::attention_key_tile`]): scores are `slots x
/// tile` registers an invocation.
pub const KEY_TILES: [usize; 3] = [2, 4, 8];

/// The blocked forms' key tile with `options`: [`Options::attention_key_tile`] if it is one of
/// [`KEY_TILES`], else [`KEY_TILE`].
pub fn key_tile(options: &Options) -> usize {
    options.attention_key_tile.filter(|t| KEY_TILES.contains(t)).unwrap_or(KEY_TILE)
}

/// Lanes of the workgroup form's workgroups, which take the keys this many at a time (a
/// *chunk*).
pub const WIDE_LANES: usize = WORKGROUP as usize;

/// Floats of one invocation's private query (and accumulator) array: bounds the slots per
/// invocation to `SLOT_FLOATS / head_dim`.
const SLOT_FLOATS: usize = 512;
/// At most this many slots per invocation (scores are `slots x KEY_TILE` registers).
const MAX_SLOTS: usize = 8;

/// The head geometry a kernel is specialised to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl Geometry {
    /// Slots per invocation: `(query rows in the prefill form, heads of the group)`.
    fn block(self) -> (usize, usize) {
        let budget = (SLOT_FLOATS / self.head_dim.max(1)).clamp(1, MAX_SLOTS);
        let group = self.heads / self.kv_heads.max(1);
        let gc = (1..=group.min(budget)).rev().find(|g| group.is_multiple_of(*g)).unwrap_or(1);
        ((budget / gc).max(1), gc)
    }
}

/// Where an attention dispatch's sizes say how far apart the heads of its `[b, kv, k, d]` key and
/// value operands lie, in rows: `dims[KEY_STRIDES.0]` and `dims[KEY_STRIDES.1]`, each `k` when 0. A cache
/// appended in place has room for more rows than it holds (see `kiln_runtime`'s device cache).
pub const KEY_STRIDES: (usize, usize) = (11, 12);

/// Keys per workgroup of a split attention a hardware adapter starts from
/// ([`Options::attention_split_keys`]): 2 chunks of the workgroup's 64 lanes, so SmolLM2's 9
/// heads at 1 024 keys run 72 workgroups (about one per multiprocessor of a large GPU) where
/// they ran 9. Not yet timed on a GPU; `kiln tune` tries 64 to 512 and no split.
pub const SPLIT_KEYS: usize = 128;

/// Workgroups below which the workgroup form splits a row's keys over several
/// ([`Options::attention_split_keys`]): a few per multiprocessor of a large GPU (132 on an H100).
pub const FILL_WORKGROUPS: usize = 512;

/// At most this many workgroups share a row's keys (bounding the scratch buffer of partial
/// states: `MAX_SPLITS x (d + 2)` floats a row and head).
pub const MAX_SPLITS: usize = 64;

/// Invocations of the blocked forms below which a kernel with the workgroup form runs that
/// instead: where the blocked forms' few invocations, each walking all of its keys alone, leave a
/// GPU idle. A decode step's attention runs `batch x kv` of them (3 for SmolLM2). Measured on an
/// NVIDIA H200 (BENCHMARKS.md, 2026-11-26): at 48 invocations (SmolLM2's prefill of 128 tokens)
/// the workgroup form took a forward pass from 106.6 to 68.0 ms; at 6 144 (MiniLM, 32 sentences
/// of 128 tokens) it was slower, 22.8 -> 40.0 ms, one workgroup per query row being more work
/// than the blocked forms' shared key loads. 2 048 (16 per multiprocessor of that device) lies
/// between; `kiln tune` chooses it per adapter ([`Options::attention_workgroup_below`]).
pub const WORKGROUP_FORM_BELOW: usize = 2_048;

/// The sizes of an attention dispatch: `[threads, heads, s, t, d, kv, width, form, rows]` for
/// `s` queries over `t` keys, `width` the packed row width (0 unpacked), `form` 1 for blocks of
/// `rows` query rows (prefill), 0 for one row per invocation (always, when `sparse`: an
/// invocation then serves one query block, whose key blocks it visits), and 2 for the workgroup
/// form (a kernel that has it: see [`has_workgroup_form`]), a workgroup of 64 per query row and
/// head, where the blocked forms would run fewer than `below` invocations ([`workgroup_below`]; 0
/// for a kernel without the form).
///
/// The workgroup form splits each row's keys over `splits` workgroups where `split_keys` is given
/// (a kernel with [`has_partials`]) and fewer than [`FILL_WORKGROUPS`] would run: `splits` is the
/// keys over `split_keys`, at most enough to fill them and at most [`MAX_SPLITS`]; then
/// `dims[14]` is `splits` and `dims[15]` 1 (the partial states; see [`combine_dims`]).
#[expect(clippy::too_many_arguments, reason = "a dispatch's sizes")]
pub fn dims(
    g: Geometry,
    batch: usize,
    s: usize,
    t: usize,
    width: usize,
    sparse: bool,
    below: usize,
    split_keys: Option<usize>,
) -> Vec<usize> {
    let (qb, gc) = g.block();
    let (form, rows) = if s >= qb && qb > 1 && !sparse { (1, qb) } else { (0, 1) };
    let threads = batch * s.div_ceil(rows) * (g.heads / gc);
    if threads < below {
        let groups = batch * s * g.heads;
        let splits = match split_keys {
            Some(n) if groups < FILL_WORKGROUPS => {
                t.div_ceil(n.max(1)).min(FILL_WORKGROUPS.div_ceil(groups.max(1))).clamp(1, MAX_SPLITS)
            }
            _ => 1,
        };
        let mut d = vec![groups * splits * WIDE_LANES, g.heads, s, t, g.head_dim, g.kv_heads, width, 2, 1];
        if splits > 1 {
            // 9..=13 unset here (the appends' and strides' sizes), 14: splits, 15: phase 1.
            d.extend([0, 0, 0, 0, 0, splits, 1]);
        }
        return d;
    }
    vec![threads, g.heads, s, t, g.head_dim, g.kv_heads, width, form, rows]
}

/// The sizes of the second dispatch of a split attention (see the module docs), which combines
/// the partial states the first (`dims`) wrote: one workgroup per (batch, row, head), none
/// appending to the caches. `None` where `dims` did not split.
pub fn combine_dims(dims: &[u32; 16]) -> Option<[u32; 16]> {
    if dims[7] != 2 || dims[15] != 1 || dims[14] < 2 {
        return None;
    }
    let mut c = *dims;
    // The attention's threads: all of them, or those before the cache appends' (`dims[9]`).
    let attention = if dims[9] != 0 { dims[9] } else { dims[0] };
    c[0] = attention / dims[14];
    c[9] = if dims[9] != 0 { c[0] } else { 0 };
    c[15] = 2;
    Some(c)
}

/// Bytes of the partial states a split attention's first dispatch (`dims`) writes: `d + 2`
/// floats per workgroup (its maximum, its share of the denominator, its output row); 0 where it
/// does not split.
pub fn partials_bytes(dims: &[u32; 16]) -> u64 {
    match combine_dims(dims) {
        Some(_) => {
            let attention = u64::from(if dims[9] != 0 { dims[9] } else { dims[0] });
            attention / WIDE_LANES as u64 * (u64::from(dims[4]) + 2) * 4
        }
        None => 0,
    }
}

/// Whether the kernel of `op` compiled with `options` may split its keys over workgroups and
/// binds a scratch buffer for their partial states ([`Options::attention_split_keys`], with the
/// workgroup form).
pub fn has_partials(op: &Op, options: &Options) -> bool {
    has_workgroup_form(op, options) && options.attention_split_keys.is_some()
}

/// The keys per split `op`'s kernel compiled with `options` takes (see [`has_partials`]).
pub fn split_keys(op: &Op, options: &Options) -> Option<usize> {
    options.attention_split_keys.filter(|_| has_partials(op, options))
}

/// Invocations of the blocked forms below which `op`'s kernel compiled with `options` runs its
/// workgroup form: [`Options::attention_workgroup_below`], else [`WORKGROUP_FORM_BELOW`]; 0 for a
/// kernel without the form.
pub fn workgroup_below(op: &Op, options: &Options) -> usize {
    match has_workgroup_form(op, options) {
        true => options.attention_workgroup_below.unwrap_or(WORKGROUP_FORM_BELOW),
        false => 0,
    }
}

/// Whether the kernel of `op` compiled with `options` has the workgroup form
/// ([`Options::attention_workgroups`], an attention specialised to its head geometry).
pub fn has_workgroup_form(op: &Op, options: &Options) -> bool {
    options.attention_workgroups && matches!(op, Op::Attention { .. } | Op::PackedAttention(_))
}

/// A WGSL element index from WGSL expressions for a row and a head.
type RowHeadIndex = Box<dyn Fn(&str, &str) -> String>;

/// Where a kernel reads its operands.
struct Layout {
    /// Element index of query head `h` of row `si`, from WGSL expressions for `si` and `h` (and
    /// `b`, `s_len`, `heads`, `w` in scope).
    q: RowHeadIndex,
    /// Buffer of the queries.
    qbuf: &'static str,
    /// Where the keys and values are: one range of keys, or (appending to a cache) the cache's
    /// keys, then this step's.
    keys: Vec<Keys>,
    /// Buffers of the key mask and the relative bias table, if any.
    buffers: (Option<String>, Option<String>),
}

/// An element index from a WGSL expression for a key.
type KeyIndex = Box<dyn Fn(&str) -> String>;

/// Keys `from..to` (WGSL expressions) and their values, read from one buffer each.
struct Keys {
    /// Element index of key `kk` of key/value head `kvh`, from an expression for `kk`.
    k: KeyIndex,
    /// The same for its value.
    v: KeyIndex,
    kbuf: &'static str,
    vbuf: &'static str,
    from: &'static str,
    to: &'static str,
}

impl Keys {
    /// All `k` keys of the `[b, kv, k, d]` operands 1 and 2, whose heads lie `ks` and `vs` rows
    /// apart (see [`KEY_STRIDES`]).
    fn heads() -> Vec<Keys> {
        Keys::all(
            Box::new(|kk| format!("((b * kv + kvh) * ks + {kk}) * d")),
            Box::new(|kk| format!("((b * kv + kvh) * vs + {kk}) * d")),
            "in1",
            "in2",
        )
    }

    /// All `k` keys, from one buffer each.
    fn all(k: KeyIndex, v: KeyIndex, kbuf: &'static str, vbuf: &'static str) -> Vec<Keys> {
        vec![Keys { k, v, kbuf, vbuf, from: "0u", to: "k" }]
    }
}

/// The kernel body of `op` (attention or packed attention, with `operands` operands) for head
/// geometry `g`, with the workgroup form if `workgroups` (then run with `wg`, `lane` and `i`
/// defined and no thread returned early: see `kernel::entry`), split over key ranges too if
/// `partials` (writing and combining partial states in the scratch buffer `part`), its blocked
/// forms taking keys `key_tile` at a time ([`key_tile`]). `None` for any other op.
pub fn body(
    op: &Op,
    operands: usize,
    g: Geometry,
    workgroups: bool,
    partials: bool,
    key_tile: usize,
) -> Option<String> {
    let layout = match *op {
        Op::Attention { mods, .. } => Layout {
            q: Box::new(|si, h| format!("((b * heads + {h}) * s_len + {si}) * d")),
            qbuf: "in0",
            keys: Keys::heads(),
            buffers: scores::optional_buffers(&mods, 3, operands),
        },
        // The queries read in place; the keys and values of the caches before this step (`pr`
        // rows), then this step's, read in place too (the threads past the attention's append
        // them to the caches, see `append::append_copy`).
        Op::PackedAttention(PackedAttention { mods, q, k: kc, v: vc, cached: true, appends: true, .. }) => Layout {
            q: Box::new(move |si, h| format!("(b * s_len + {si}) * w + {q}u + {h} * d")),
            qbuf: "in0",
            keys: vec![
                Keys {
                    k: Box::new(|kk| format!("((b * kv + kvh) * pr + {kk}) * d")),
                    v: Box::new(|kk| format!("((b * kv + kvh) * pr + {kk}) * d")),
                    kbuf: "in1",
                    vbuf: "in2",
                    from: "0u",
                    to: "pa",
                },
                // Appending in place: the caches are the outputs, `room` rows per head.
                Keys {
                    k: Box::new(|kk| format!("((b * kv + kvh) * room + {kk}) * d")),
                    v: Box::new(|kk| format!("((b * kv + kvh) * room + {kk}) * d")),
                    kbuf: "out1",
                    vbuf: "out2",
                    from: "0u",
                    to: "pb",
                },
                Keys {
                    k: Box::new(move |kk| format!("(b * s_len + {kk} - pr) * w + {kc}u + kvh * d")),
                    v: Box::new(move |kk| format!("(b * s_len + {kk} - pr) * w + {vc}u + kvh * d")),
                    kbuf: "in0",
                    vbuf: "in0",
                    from: "pr",
                    to: "k",
                },
            ],
            buffers: scores::optional_buffers(&mods, 3, operands),
        },
        // The queries read in place, keys and values from a cache: the two layouts mixed.
        Op::PackedAttention(PackedAttention { mods, q, cached: true, .. }) => Layout {
            q: Box::new(move |si, h| format!("(b * s_len + {si}) * w + {q}u + {h} * d")),
            qbuf: "in0",
            keys: Keys::heads(),
            buffers: scores::optional_buffers(&mods, 3, operands),
        },
        Op::PackedAttention(PackedAttention { mods, q, k, v, .. }) => Layout {
            q: Box::new(move |si, h| format!("(b * s_len + {si}) * w + {q}u + {h} * d")),
            qbuf: "in0",
            keys: Keys::all(
                Box::new(move |kk| format!("(b * k + {kk}) * w + {k}u + kvh * d")),
                Box::new(move |kk| format!("(b * k + {kk}) * w + {v}u + kvh * d")),
                "in0",
                "in0",
            ),
            buffers: scores::optional_buffers(&mods, 1, operands),
        },
        _ => return None,
    };
    // The scores as the unfused attention computes them (a packed attention's are its own).
    let Op::Attention { scale, alibi, causal, window, mods } = (match op {
        Op::PackedAttention(p) => p.unpacked(),
        other => other.clone(),
    }) else {
        return None;
    };
    let (qb, gc) = g.block();
    let form = |rows: usize| {
        block(&Block { rows, gc, d: g.head_dim, scale: scale.0, alibi, causal, window, mods, key_tile }, &layout)
    };
    let mut s = String::from(
        "let heads = dim(1u);\nlet s_len = dim(2u);\nlet k = dim(3u);\nlet d = dim(4u);\nlet kv = dim(5u);\nlet w = dim(6u);\n",
    );
    s += "let ks = select(k, dim(11u), dim(11u) != 0u);\nlet vs = select(k, dim(12u), dim(12u) != 0u);\n";
    let forms = if qb > 1 && mods.sparse.is_none() {
        format!("if (dim(7u) == 1u) {{\n{}}} else {{\n{}}}\n", indent(&form(qb)), indent(&form(1)))
    } else {
        form(1)
    };
    // The threads past the attention's (`dim(9u)` of them) append to the caches.
    let copy = match *op {
        Op::PackedAttention(PackedAttention { k, v, appends: true, .. }) => {
            // The caches' `pr` rows: in the operands, or (appending in place, `room` not 0) in
            // the outputs already, which then get only this step's rows.
            s += "let pr = k - min(s_len, k);\nlet room = dim(13u);\n\
                  let pa = select(pr, 0u, room != 0u);\nlet pb = select(0u, pr, room != 0u);\n";
            Some(append::append_copy(k, v))
        }
        _ => None,
    };
    let forms = match &copy {
        Some(copy) => format!("if (i < dim(9u)) {{\n{}}} else {{\n{}}}\n", indent(&forms), indent(copy)),
        None => forms,
    };
    if !workgroups {
        s += &forms;
        return Some(s);
    }
    // The workgroup form's attention threads are whole workgroups, so which threads attend is a
    // question of the workgroup alone (uniform, as its barriers need).
    let wide = workgroup_form(
        &Block { rows: 1, gc: 1, d: g.head_dim, scale: scale.0, alibi, causal, window, mods, key_tile },
        &layout,
        partials,
    );
    let mut inner = format!(
        "if (wg < {} / {WIDE_LANES}u) {{\n{}}}",
        if copy.is_some() { "dim(9u)" } else { "dim(0u)" },
        indent(&wide)
    );
    if let Some(copy) = &copy {
        inner += &format!(" else if (i < dim(0u)) {{\n{}}}", indent(copy));
    }
    s += &format!("if (dim(7u) == 2u) {{\n{}}} else if (i < dim(0u)) {{\n{}}}\n", indent(&inner), indent(&forms));
    Some(s)
}

/// The module-scope declarations of the workgroup form for heads of `head_dim`: the query
/// (`wq`), and a chunk's probabilities (`wp`) and keys (`wk`), in workgroup memory.
pub fn workgroup_declarations(head_dim: usize) -> String {
    format!(
        "var<workgroup> wq: array<f32, {head_dim}>;\nvar<workgroup> wp: array<f32, {WIDE_LANES}>;\n\
         var<workgroup> wk: array<u32, {WIDE_LANES}>;\n"
    )
}

/// The workgroup form (see the module docs): a workgroup per (batch, query row, query head),
/// `wg` its index and `lane` its invocation's, with `heads`, `s_len`, `k`, `d`, `kv`, `w`, `ks`,
/// `vs` (and the appending layout's `pr`, `room`, `pa`, `pb`) in scope. Every statement that
/// reaches a barrier (the reductions, `workgroupBarrier`) depends only on the workgroup, so
/// control flow is uniform there. With `partials`, `dims[14]` workgroups share a row's keys and
/// `dims[15]` says the phase: 0 whole rows, 1 each workgroup's partial state into `part`, 2 the
/// states combined (uniform, so the branches on it are too).
fn workgroup_form(f: &Block, l: &Layout, partials: bool) -> String {
    let cols = f.d.div_ceil(WIDE_LANES);
    let lanes = WIDE_LANES;
    let mut s = String::new();
    if partials {
        s += "let splits = max(dim(14u), 1u);\nlet phase = dim(15u);\n\
              // The key range of this workgroup (0 of 1 unsplit, and when combining).\n\
              let split = select(wg % splits, 0u, phase == 2u);\nlet row = select(wg / splits, wg, phase == 2u);\n";
    } else {
        s += "let splits = 1u;\nlet split = 0u;\nlet row = wg;\n";
    }
    s += "let h = row % heads;\nlet si = (row / heads) % s_len;\nlet b = row / (heads * s_len);\n\
          let kvh = h / (heads / kv);\n\
          // The query's position among the keys (queries are the last `s_len` of `k`).\n\
          let qi = si + k - min(s_len, k);\n";
    s += &format!("let hi = {};\n", if f.causal { "min(k, qi + 1u)" } else { "k" });
    s += &match f.window {
        Some(w) => format!("let lo = select(0u, qi + 1u - {w}u, qi + 1u > {w}u);\n"),
        None => "let lo = 0u;\n".into(),
    };
    if f.alibi {
        s += &format!("let slope = {};\n", super::emit::ALIBI_SLOPE);
    }
    s +=
        "var m = -3.40282347e38;\n// This lane's share of the softmax's denominator.\nvar l = 0.0;\nvar total = 0.0;\n";
    for c in 0..cols {
        s += &format!("var acc{c} = 0.0;\n");
    }
    // Combining: each range's state rescaled to the row's maximum (a range that attended nothing
    // kept the initial maximum and adds nothing), summed.
    let combine = {
        let mut c = String::from(
            "let first_state = row * splits;\n\
             for (var r = 0u; r < splits; r = r + 1u) { m = max(m, part[(first_state + r) * (d + 2u)]); }\n\
             for (var r = 0u; r < splits; r = r + 1u) {\n    let p0 = (first_state + r) * (d + 2u);\n    \
             let f = exp(part[p0] - m);\n    total = total + part[p0 + 1u] * f;\n",
        );
        for col in 0..cols {
            c += &format!(
                "    let col{col} = lane + {}u;\n    if (col{col} < d) {{ acc{col} = acc{col} + part[p0 + 2u + col{col}] * f; }}\n",
                col * lanes
            );
        }
        c + "}\n"
    };
    let mut walk = String::new();
    // The scaled query, which every lane reads whole, in workgroup memory.
    walk += &format!(
        "let q0 = {};\nfor (var c = lane; c < d; c = c + {lanes}u) {{ wq[c] = {}[q0 + c] * {}; }}\nworkgroupBarrier();\n",
        (l.q)("si", "h"),
        l.qbuf,
        lit(f.scale)
    );
    for keys in &l.keys {
        // Each chunk: key `c0 + lane` (of those this range holds, or, block-sparse, of the
        // attended blocks' keys in turn) is this lane's, `kk` its row in the range's buffers.
        // Split, this workgroup takes its share of the keys (or of the attended list), in whole
        // chunks where it can.
        let (count, key, mut chunk) = match f.mods.sparse {
            Some(p) => {
                walk += "{\n";
                walk += &scores::sparse_setup(&f.mods, "qi", "s_len", "k");
                walk += &scores::sparse_list(&p);
                walk += &format!(
                    "let listed = sp_n * {}u;\nlet per = ((listed + splits - 1u) / splits + {lanes}u - 1u) / {lanes}u * {lanes}u;\n\
                     let count = min(listed, (split + 1u) * per);\n\
                     for (var c0 = split * per; c0 < count; c0 = c0 + {lanes}u) {{\n",
                    p.block
                );
                let key = format!(
                    "let vi = c0 + lane;\nlet e = min(vi / {b}u, max(sp_n, 1u) - 1u);\n\
                     let key = {} * {b}u + vi % {b}u;\nlet valid = vi < count && key < k;\nlet kk = min(key, k - 1u);\n",
                    scores::sparse_block(&p, "e"),
                    b = p.block
                );
                ("count", "key", key)
            }
            None => {
                walk += &format!(
                    "{{\nlet span = select(hi - lo, 0u, hi < lo);\n\
                     let per = ((span + splits - 1u) / splits + {lanes}u - 1u) / {lanes}u * {lanes}u;\n\
                     let first = max(lo + split * per, {});\nlet end = min(min(hi, lo + (split + 1u) * per), {});\n\
                     for (var c0 = first; c0 < end; c0 = c0 + {lanes}u) {{\n",
                    keys.from, keys.to
                );
                let key = "let key = c0 + lane;\nlet valid = key < end;\nlet kk = min(key, end - 1u);\n".to_string();
                ("end", "key", key)
            }
        };
        chunk += &format!("let kr = {};\nvar x = 0.0;\n", (keys.k)("kk"));
        chunk += &format!("for (var c = 0u; c < d; c = c + 1u) {{ x = x + wq[c] * {}[kr + c]; }}\n", keys.kbuf);
        chunk += &scores::softcap(&f.mods, "x");
        if f.alibi {
            chunk += &format!("x = x + slope * (f32({key}) - f32(qi));\n");
        }
        if let Some(table) = &l.buffers.1 {
            chunk += &scores::relative(&f.mods, "x", key, "qi", "h", "heads", table);
        }
        let mut on = String::from("valid");
        if let Some(m) = &l.buffers.0 {
            on += &format!(" && {m}[b * k + kk] != 0.0");
        }
        if f.causal {
            on += &format!(" && {key} <= qi");
        }
        if let Some(w) = f.window {
            on += &format!(" && {key} + {w}u > qi");
        }
        chunk += &format!(
            "let on = {on};\nx = select(-3.40282347e38, x, on);\n\
             // One maximum for the workgroup, so every lane rescales by the same factor.\n\
             let mn = max(m, row_max(lane, x));\nlet corr = exp(m - mn);\nm = mn;\n\
             let p = select(0.0, exp(x - m), on);\nl = l * corr + p;\nwp[lane] = p;\nwk[lane] = kk;\nworkgroupBarrier();\n"
        );
        // The value pass: lanes own columns, so a value row is read by adjacent lanes.
        for c in 0..cols {
            chunk += &format!("acc{c} = acc{c} * corr;\n");
        }
        chunk += &format!(
            "let n = min({lanes}u, {count} - c0);\nfor (var j = 0u; j < n; j = j + 1u) {{\n    let pj = wp[j];\n    let vr = {};\n",
            (keys.v)("wk[j]")
        );
        for c in 0..cols {
            chunk += &format!(
                "    let col{c} = lane + {}u;\n    if (col{c} < d) {{ acc{c} = acc{c} + pj * {}[vr + col{c}]; }}\n",
                c * lanes,
                keys.vbuf
            );
        }
        chunk +=
            "}\n// Every lane done with this chunk's probabilities before the next writes them.\nworkgroupBarrier();\n";
        walk += &indent(&chunk);
        walk += "}\n}\n";
    }
    walk += "total = row_sum(lane, l);\n";
    if partials {
        // This range's state: its maximum, its denominator, its unnormalized output row.
        let mut store = String::from(
            "let p0 = wg * (d + 2u);\nif (lane == 0u) {\n    part[p0] = m;\n    part[p0 + 1u] = total;\n}\n",
        );
        for c in 0..cols {
            store += &format!(
                "let col{c} = lane + {}u;\nif (col{c} < d) {{ part[p0 + 2u + col{c}] = acc{c}; }}\n",
                c * lanes
            );
        }
        walk += &format!("if (phase == 1u) {{\n{}}}\n", indent(&store));
        s += &format!("if (phase == 2u) {{\n{}}} else {{\n{}}}\n", indent(&combine), indent(&walk));
    } else {
        s += &walk;
    }
    let mut finish = String::from("let o0 = ((b * s_len + si) * heads + h) * d;\n");
    for c in 0..cols {
        finish += &format!("let col{c} = lane + {}u;\nif (col{c} < d) {{\n    var y = acc{c} / total;\n", c * lanes);
        // Every key masked: the mean of all values, as the reference softmax of equal logits.
        finish += "    if (total == 0.0) {\n        y = 0.0;\n";
        for keys in &l.keys {
            finish += &format!(
                "        for (var kk = {}; kk < {}; kk = kk + 1u) {{ y = y + {}[{} + col{c}]; }}\n",
                keys.from,
                keys.to,
                keys.vbuf,
                (keys.v)("kk")
            );
        }
        finish += &format!("        y = y / f32(k);\n    }}\n    out[o0 + col{c}] = y;\n}}\n");
    }
    match partials {
        true => s += &format!("if (phase != 1u) {{\n{}}}\n", indent(&finish)),
        false => s += &finish,
    }
    s
}

/// One form of the kernel: `rows` query rows x `gc` heads per invocation.
struct Block {
    rows: usize,
    gc: usize,
    d: usize,
    scale: f32,
    alibi: bool,
    causal: bool,
    window: Option<usize>,
    mods: ScoreMods,
    /// Keys per tile.
    key_tile: usize,
}

fn block(f: &Block, l: &Layout) -> String {
    let (rows, gc, d, t) = (f.rows, f.gc, f.d, f.key_tile);
    let slots = rows * gc;
    let mut s = String::new();
    // Invocation -> (batch, block of rows, chunk of heads); adjacent invocations take adjacent
    // head chunks of one block, so their key ranges agree.
    s += &format!(
        "let chunks = heads / {gc}u;\nlet blocks = (s_len + {}u) / {rows}u;\nlet hc = i % chunks;\n\
         let row0 = ((i / chunks) % blocks) * {rows}u;\nlet b = i / (chunks * blocks);\n\
         let kvh = (hc * {gc}u) / (heads / kv);\n\
         // Rows past the end compute on the last row and store nothing.\n\
         let last = min(row0 + {}u, s_len - 1u);\n",
        rows - 1,
        rows - 1
    );
    // A query row's position among the keys (queries are the last `s_len` of `k`).
    s += "let shift = k - min(s_len, k);\n";
    // The keys any row of the block attends: [lo, hi).
    s += &format!("let hi = {};\n", if f.causal { "min(k, last + shift + 1u)" } else { "k" });
    s += &match f.window {
        Some(w) => format!("let lo = select(0u, row0 + shift + 1u - {w}u, row0 + shift + 1u > {w}u);\n"),
        None => "let lo = 0u;\n".into(),
    };
    s += &format!("var qv: array<f32, {}>;\nvar acc: array<f32, {}>;\n", slots * d, slots * d);
    for r in 0..slots {
        let (j, g) = (r / gc, r % gc);
        s += &format!(
            "let qi{r} = min(row0 + {j}u, last) + shift;\nlet h{r} = hc * {gc}u + {g}u;\n\
             var m{r} = -3.40282347e38;\nvar l{r} = 0.0;\n"
        );
        if f.alibi {
            s += &format!(
                "var slope{r} = 0.0;\n{{\n    let h = h{r};\n    slope{r} = {};\n}}\n",
                super::emit::ALIBI_SLOPE
            );
        }
        let q = (l.q)(&format!("min(row0 + {j}u, last)"), &format!("h{r}"));
        s += &format!(
            "{{\n    let q0 = {q};\n    for (var c = 0u; c < d; c = c + 1u) {{ qv[{o}u + c] = {qb}[q0 + c] * {scale}; acc[{o}u + c] = 0.0; }}\n}}\n",
            o = r * d,
            qb = l.qbuf,
            scale = lit(f.scale),
        );
    }
    // The key tiles: of [lo, hi) (of each range of keys a buffer holds, within it), or of each
    // key block the query block attends.
    for keys in &l.keys {
        let split = keys.from != "0u" || keys.to != "k";
        let key_end = match f.mods.sparse {
            Some(p) => {
                s += &scores::sparse_setup(&f.mods, "qi0", "s_len", "k");
                s += &scores::sparse_list(&p);
                s += &format!(
                    "for (var e = 0u; e < sp_n; e = e + 1u) {{\nlet blo = {} * {b}u;\nlet bhi = min(blo + {b}u, k);\n\
                 for (var kt = blo; kt < bhi; kt = kt + {t}u) {{\n",
                    scores::sparse_block(&p, "e"),
                    b = p.block
                );
                "bhi"
            }
            None if !split => {
                s += &format!("for (var kt = lo; kt < hi; kt = kt + {t}u) {{\n");
                "hi"
            }
            None => {
                s += &format!(
                    "{{\nlet end = min(hi, {});\nfor (var kt = max(lo, {}); kt < end; kt = kt + {t}u) {{\n",
                    keys.to, keys.from
                );
                "end"
            }
        };
        let mut tile = String::new();
        for u in 0..t {
            tile += &format!(
                "let key{u} = kt + {u}u;\nlet kk{u} = min(key{u}, {} - 1u);\nlet kr{u} = {};\nlet vr{u} = {};\n",
                keys.to,
                (keys.k)(&format!("kk{u}")),
                (keys.v)(&format!("kk{u}"))
            );
        }
        for r in 0..slots {
            for u in 0..t {
                tile += &format!("var x{r}_{u} = 0.0;\n");
            }
        }
        // Scores: each key element loaded once for every slot.
        tile += "for (var c = 0u; c < d; c = c + 1u) {\n";
        for u in 0..t {
            tile += &format!("    let k{u} = {}[kr{u} + c];\n", keys.kbuf);
        }
        for r in 0..slots {
            tile += &format!("    let q{r} = qv[{}u + c];\n", r * d);
            for u in 0..t {
                tile += &format!("    x{r}_{u} = x{r}_{u} + q{r} * k{u};\n");
            }
        }
        tile += "}\n";
        // Which keys each slot attends.
        for u in 0..t {
            let mut keep = format!("key{u} < {key_end}");
            if let Some(m) = &l.buffers.0 {
                keep += &format!(" && {m}[b * k + kk{u}] != 0.0");
            }
            tile += &format!("let keep{u} = {keep};\n");
        }
        for r in 0..slots {
            let mut mt = String::from("-3.40282347e38");
            for u in 0..t {
                let mut keep = format!("keep{u}");
                if f.causal {
                    keep += &format!(" && key{u} <= qi{r}");
                }
                if let Some(w) = f.window {
                    keep += &format!(" && key{u} + {w}u > qi{r}");
                }
                tile += &scores::softcap(&f.mods, &format!("x{r}_{u}"));
                if f.alibi {
                    tile += &format!("x{r}_{u} = x{r}_{u} + slope{r} * (f32(key{u}) - f32(qi{r}));\n");
                }
                if let Some(table) = &l.buffers.1 {
                    tile += &scores::relative(
                        &f.mods,
                        &format!("x{r}_{u}"),
                        &format!("key{u}"),
                        &format!("qi{r}"),
                        &format!("h{r}"),
                        "heads",
                        table,
                    );
                }
                tile += &format!("let on{r}_{u} = {keep};\nx{r}_{u} = select(-3.40282347e38, x{r}_{u}, on{r}_{u});\n");
                mt = format!("max({mt}, x{r}_{u})");
            }
            tile += &format!("let m{r}n = max(m{r}, {mt});\nlet corr{r} = exp(m{r} - m{r}n);\nm{r} = m{r}n;\n");
            let mut sum = String::from("0.0");
            for u in 0..t {
                tile += &format!("let p{r}_{u} = select(0.0, exp(x{r}_{u} - m{r}), on{r}_{u});\n");
                sum = format!("{sum} + p{r}_{u}");
            }
            tile += &format!("l{r} = l{r} * corr{r} + {sum};\n");
        }
        // Values: each element loaded once for every slot.
        tile += "for (var c = 0u; c < d; c = c + 1u) {\n";
        for u in 0..t {
            tile += &format!("    let v{u} = {}[vr{u} + c];\n", keys.vbuf);
        }
        for r in 0..slots {
            let terms: String = (0..t).map(|u| format!(" + p{r}_{u} * v{u}")).collect();
            tile += &format!("    acc[{o}u + c] = acc[{o}u + c] * corr{r}{terms};\n", o = r * d);
        }
        tile += "}\n";
        s += &indent(&tile);
        s += if f.mods.sparse.is_some() || split { "}\n}\n" } else { "}\n" };
    }
    // Store the rows of the block that exist.
    for r in 0..slots {
        let j = r / gc;
        s += &format!(
            "if (row0 + {j}u < s_len) {{\n    let si = row0 + {j}u;\n    let h = h{r};\n    let o0 = ((b * s_len + si) * heads + h) * d;\n"
        );
        // Every key masked: the mean of all values, as the reference softmax of equal logits.
        s += &format!("    if (l{r} == 0.0) {{\n");
        for keys in &l.keys {
            s += &format!(
                "        for (var kk = {}; kk < {}; kk = kk + 1u) {{\n            let vr = {};\n            \
                 for (var c = 0u; c < d; c = c + 1u) {{ acc[{o}u + c] = acc[{o}u + c] + {}[vr + c]; }}\n        }}\n",
                keys.from,
                keys.to,
                (keys.v)("kk"),
                keys.vbuf,
                o = r * d
            );
        }
        s += &format!("        l{r} = f32(k);\n    }}\n");
        s += &format!("    for (var c = 0u; c < d; c = c + 1u) {{ out[o0 + c] = acc[{}u + c] / l{r}; }}\n}}\n", r * d);
    }
    s
}
