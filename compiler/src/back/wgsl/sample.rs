//! The sampling kernel: picks the next token from the logits row of a decoder step's last
//! position without reading the row back, so a generation step on wgpu reads back one id.
//!
//! It lives with the other WGSL because naga validates it here, in the crate that owns every
//! kernel's text; unlike them it is not a step of a plan (it runs after the head, once per
//! generation step, on a row the runtime copies out of the `logits` output), so it takes its own
//! bindings (below) rather than the 16 sizes of [`super::kernel`]'s convention, and is one fixed
//! module: the vocabulary and the settings are uniforms.
//!
//! **Semantics** — those of the host sampler (`kiln_runtime::Sampler::sample`), step by step:
//!
//! 1. Repetition penalty: each seen id (given once each) below the vocabulary has its logit `v`
//!    replaced by `v / penalty` when `v > 0`, else `v * penalty`.
//! 2. A row holding a NaN (an overflow in the model's arithmetic) is no row to sample from: the
//!    kernel writes [`NAN_ROW`] in place of an id, and the runtime refuses it, as its host path
//!    refuses such a row before the host sampler sees it. Otherwise, greedy (`temperature == 0`)
//!    or with no finite logit: the argmax, ties to the lowest id (`-inf` never wins; `0` when
//!    nothing does).
//! 3. Otherwise the candidates are the finite logits in *candidate order*: decreasing logit, ties
//!    by increasing id, where logits compare as IEEE `totalOrder` (`-0.0` before `+0.0`), as
//!    Rust's `f32::total_cmp` does. Each candidate `i` weighs `exp((v_i - max) / temperature)`,
//!    `max` the largest finite logit. Top-k keeps the first `k` (`k = 0`: all); top-p keeps the
//!    shortest prefix of those whose weight reaches `top_p` of theirs (`top_p >= 1`: all); the
//!    pick is the first kept candidate at which the running weight reaches `uniform` times the
//!    kept weight (the last kept candidate with a positive weight when rounding leaves the target
//!    unreached). `uniform` is drawn on the host from the sampler's SplitMix64 state, so a seed
//!    gives one stream of draws on either side.
//!
//! **Parts.** A long row's first pass (the penalty, the argmax, the largest finite logit and the
//! counts) runs over many workgroups: with `parts > 0` the `parts` entry point, dispatched with
//! `parts` workgroups before `main`, takes a chunk of [`CHUNK`] logits each, applies the penalty
//! of the seen ids in its chunk and writes its chunk's five figures to binding 4; `main` then
//! combines the parts instead of reading the row, so greedy decoding (the argmax alone) reads the
//! row once across the device rather than from one workgroup. [`parts`] says how many a row
//! takes: none below [`PARTS_FROM`] logits, where one workgroup's pass is as fast.
//!
//! **Kept candidates.** With top-k (`0 < top_k <=` [`KEEP`]) and parts, each part also keeps its
//! chunk's first `top_k` candidates in candidate order (all its finite logits where it has no
//! more), found by the same radix search over its chunk, and writes them to its [`KEEP`] slots of
//! binding 4 (logit bits and id; the unused slots' id `0xffffffff`), in a fixed order. The row's
//! first `top_k` candidates are among them (each is among its own chunk's first `top_k`), so
//! `main` makes its cuts — top-k, top-p, the draw — over the parts' slots instead of the row: a
//! few thousand candidates rather than a 262144-logit row, read by one workgroup per pass.
//!
//! No sort: one workgroup finds each cut with a radix search. The candidate order is the order of
//! a 64-bit key, `(order_key(v), !id)` descending, and "the first candidate at which a running
//! count (top-k) or weight (top-p, the draw) reaches a target" is found four bits at a time from
//! the top: each pass over the row sums the count and weight of the candidates in each of 16
//! bins of the next digit (among those matching the digits fixed so far), fixes the digit of the
//! bin where the running sum crosses, and stops as soon as that bin holds one candidate — a few
//! passes for real logits; the id digits are needed only for equal logits. The cuts are therefore
//! exact in candidate order, ties included; the weights and their sums are f32 (the host's are
//! f64), so the two samplers can differ only where a cut or the draw falls within rounding of a
//! boundary between two candidates.
//!
//! Bindings: `0` the [`Settings`] uniform, `1` the picked id (one `u32`, written by invocation
//! 0), `2` the logits row (read-write: the penalty is applied in place), `3` the seen ids (`u32`,
//! each once; at least one element, unread when `seen == 0`), `4` the parts ([`part_words`]:
//! five words each — the chunk's argmax logit's bits and id, its largest finite logit's bits, its
//! finite logits and its NaNs — then [`KEEP`] slots of two words each; at least one element,
//! unread when `parts == 0`). Dispatch `parts` workgroups of the
//! `parts` entry point (when `parts > 0`), then one of `main`.

/// Invocations of the kernel's one workgroup.
pub const INVOCATIONS: u32 = 256;

/// What the kernel writes in place of an id when the row holds a NaN.
pub const NAN_ROW: u32 = 0xffff_fffe;

/// The most tokens the kernel samples from: counts are summed in f32, exact below 2^24.
pub const MAX_VOCAB: u32 = 1 << 24;

/// Logits one workgroup of the `parts` entry point takes: 16 for each invocation.
pub const CHUNK: u32 = 16 * INVOCATIONS;

/// The shortest row whose first pass runs in parts (two chunks).
pub const PARTS_FROM: u32 = 2 * CHUNK;

/// Words a part's figures take in binding 4 (its kept candidates follow every part's figures).
pub const PART_WORDS: u32 = 5;

/// The most candidates a part keeps for top-k, and the slots each part has: a larger `top_k`
/// makes its cuts over the row.
pub const KEEP: u32 = INVOCATIONS;

/// The words of binding 4 for `parts` parts: each part's figures, then each part's kept
/// candidates' slots.
pub fn part_words(parts: u32) -> u32 {
    parts * (PART_WORDS + 2 * KEEP)
}

/// The candidates each part keeps for the cuts of `main` ([`Settings::keep`]): `top_k`, where the
/// row runs in parts and samples with a top-k of at most [`KEEP`]; else 0 (the cuts read the
/// row).
pub fn keep(parts: u32, greedy: bool, top_k: u32) -> u32 {
    if parts > 0 && !greedy && (1..=KEEP).contains(&top_k) { top_k } else { 0 }
}

/// The workgroups of the `parts` entry point a row of `vocab` logits takes (0: `main` alone).
pub fn parts(vocab: u32) -> u32 {
    if vocab >= PARTS_FROM { vocab.div_ceil(CHUNK) } else { 0 }
}

/// The sampler's settings, as the kernel's uniform (binding 0) holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Settings {
    /// Logits in the row (at most [`MAX_VOCAB`]).
    pub vocab: u32,
    /// Keep the `top_k` first candidates (0 = all).
    pub top_k: u32,
    /// Seen ids in binding 3 (0: no repetition penalty).
    pub seen: u32,
    /// Take the argmax (temperature 0).
    pub greedy: bool,
    /// Softmax temperature (> 0 unless greedy).
    pub temperature: f32,
    /// Keep candidates up to this share of the weight (1 = all).
    pub top_p: f32,
    /// Repetition penalty of the seen ids.
    pub penalty: f32,
    /// The draw, uniform in [0, 1).
    pub uniform: f32,
    /// Parts the row's first pass ran in ([`parts`]; 0: `main` reads the row itself).
    pub parts: u32,
    /// Candidates each part keeps for `main`'s cuts ([`keep`]; 0: the cuts read the row).
    pub keep: u32,
}

impl Settings {
    /// The uniform's twelve words, in the order of the WGSL struct (the last two padding, to a
    /// multiple of 16 bytes).
    pub fn words(&self) -> [u32; 12] {
        [
            self.vocab,
            self.top_k,
            self.seen,
            u32::from(self.greedy),
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.penalty.to_bits(),
            self.uniform.to_bits(),
            self.parts,
            self.keep,
            0,
            0,
        ]
    }
}

/// The kernel's WGSL module (see the module docs).
pub const KERNEL: &str = r#"// kiln: sample one token from a logits row (see compiler/src/back/wgsl/sample.rs)
struct Settings {
    vocab: u32,
    top_k: u32,
    seen: u32,
    greedy: u32,
    temperature: f32,
    top_p: f32,
    penalty: f32,
    uniform: f32,
    parts: u32,
    keep: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> s: Settings;
@group(0) @binding(1) var<storage, read_write> picked: array<u32>;
@group(0) @binding(2) var<storage, read_write> row: array<f32>;
@group(0) @binding(3) var<storage, read> seen: array<u32>;
@group(0) @binding(4) var<storage, read_write> part: array<u32>;

const WG: u32 = 256u;
const CHUNK: u32 = 4096u;
const KEEP: u32 = 256u;
const NONE: u32 = 0xffffffffu;
const NAN_ROW: u32 = 0xfffffffeu;
const F32_MAX: f32 = 3.40282347e38;

// Tree reductions: 8 bins of WG lanes at a time, or one (value, id) pair and one value per lane.
var<workgroup> red_f: array<f32, 2048>;
var<workgroup> red_u: array<u32, 256>;
// Per bin of a search pass: candidates, lowest id, weight.
var<workgroup> counts: array<atomic<u32>, 16>;
var<workgroup> firsts: array<atomic<u32>, 16>;
var<workgroup> bin_weight: array<f32, 16>;
var<workgroup> finite: atomic<u32>;
var<workgroup> nans: atomic<u32>;
// A search's state, written by lane 0: the digits fixed so far (key bits, key mask, id bits, id
// mask), what is left of the target, and the candidate found (NONE while searching).
var<workgroup> prefix: vec4<u32>;
var<workgroup> goal: f32;
var<workgroup> found: u32;
// What the searches read (set by the entry point): the row's logits `lo..hi` (`x` 0), or the
// parts' kept candidates' slots `lo..hi` (`x` 1).
var<private> space: vec3<u32>;

fn is_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) != 0x7f800000u;
}

fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// A u32 in the order of the logits (IEEE totalOrder): sign-flipped bits.
fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// Whether token `i` of logit `v` comes at or before `bound` (a key, !id) in candidate order.
fn within(v: f32, i: u32, bound: vec2<u32>) -> bool {
    let key = order_key(v);
    return key > bound.x || (key == bound.x && ~i >= bound.y);
}

// Element `j` of the search space: a logit's bits and its id (`NONE`: an unused slot).
fn element(j: u32) -> vec2<u32> {
    if space.x == 0u {
        return vec2<u32>(bitcast<u32>(row[j]), j);
    }
    let at = 5u * s.parts + 2u * j;
    return vec2<u32>(part[at], part[at + 1u]);
}

fn weight(v: f32, top: f32) -> f32 {
    return exp((v - top) / s.temperature);
}

// Whether (v, i) wins the argmax over the best (bv, bi) so far (bi = NONE: nothing yet).
fn beats(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    if i == NONE || is_nan(v) {
        return false;
    }
    if bi == NONE {
        return bitcast<u32>(v) != 0xff800000u;
    }
    return v > bv || (v == bv && i < bi);
}

// The sum of every lane's `x`, in a fixed tree order.
fn sum_all(lane: u32, x: f32) -> f32 {
    workgroupBarrier();
    red_f[lane] = x;
    workgroupBarrier();
    for (var n = WG / 2u; n > 0u; n >>= 1u) {
        if lane < n {
            red_f[lane] += red_f[lane + n];
        }
        workgroupBarrier();
    }
    let total = red_f[0];
    workgroupBarrier();
    return total;
}

// Sums every lane's 16 bin weights into `bin_weight`, 8 bins at a time.
fn sum_bins(lane: u32, w: ptr<function, array<f32, 16>>) {
    for (var half = 0u; half < 2u; half++) {
        for (var b = 0u; b < 8u; b++) {
            red_f[b * WG + lane] = (*w)[half * 8u + b];
        }
        workgroupBarrier();
        for (var n = WG / 2u; n > 0u; n >>= 1u) {
            for (var j = lane; j < 8u * n; j += WG) {
                let at = (j / n) * WG + j % n;
                red_f[at] += red_f[at + n];
            }
            workgroupBarrier();
        }
        if lane < 8u {
            bin_weight[half * 8u + lane] = red_f[lane * WG];
        }
        workgroupBarrier();
    }
}

// The first candidate at or before `bound` at which the running count (`by_weight` false) or
// weight of the candidates in candidate order reaches `aim`; the last candidate with a
// positive weight when none does. Needs one such candidate.
fn search(lane: u32, by_weight: bool, aim: f32, bound: vec2<u32>, top: f32) -> u32 {
    // Digits of 4 bits: 8 of the key, then as many of !id as ids below the vocabulary have.
    let id_digits = firstLeadingBit(max(s.vocab, 2u) - 1u) / 4u + 1u;
    let digits = 8u + id_digits;
    workgroupBarrier();
    if lane == 0u {
        prefix = vec4<u32>(0u);
        goal = aim;
        found = NONE;
    }
    for (var d = 0u; d < digits; d++) {
        if lane < 16u {
            atomicStore(&counts[lane], 0u);
            atomicStore(&firsts[lane], NONE);
        }
        workgroupBarrier();
        let p = prefix;
        let of_id = d >= 8u;
        let shift = select(28u - 4u * d, 4u * (digits - 1u - d), of_id);
        var n: array<u32, 16>;
        var first: array<u32, 16>;
        var w: array<f32, 16>;
        for (var b = 0u; b < 16u; b++) {
            first[b] = NONE;
        }
        for (var j = space.y + lane; j < space.z; j += WG) {
            let e = element(j);
            let v = bitcast<f32>(e.x);
            let i = e.y;
            if i == NONE || !is_finite(v) || !within(v, i, bound) {
                continue;
            }
            let x = select(1.0, weight(v, top), by_weight);
            let key = order_key(v);
            if x <= 0.0 || (key & p.y) != p.x || (~i & p.w) != p.z {
                continue;
            }
            let digit = (select(key, ~i, of_id) >> shift) & 15u;
            n[digit] += 1u;
            first[digit] = min(first[digit], i);
            w[digit] += x;
        }
        for (var b = 0u; b < 16u; b++) {
            if n[b] > 0u {
                atomicAdd(&counts[b], n[b]);
                atomicMin(&firsts[b], first[b]);
            }
        }
        sum_bins(lane, &w);
        if lane == 0u {
            // Bins in candidate order: the highest digit first.
            var acc = 0.0;
            var pick = NONE;
            var last = NONE;
            for (var b = 15i; b >= 0i; b--) {
                let c = atomicLoad(&counts[b]);
                if c == 0u {
                    continue;
                }
                last = u32(b);
                let x = select(f32(c), bin_weight[b], by_weight);
                if acc + x >= goal {
                    pick = u32(b);
                    break;
                }
                acc += x;
            }
            if pick == NONE {
                // Never reached (rounding): the last candidate.
                pick = last;
                goal = F32_MAX;
            } else {
                goal -= acc;
            }
            if pick == NONE {
                found = 0u;
            } else {
                if of_id {
                    prefix.z |= pick << shift;
                    prefix.w |= 15u << shift;
                } else {
                    prefix.x |= pick << shift;
                    prefix.y |= 15u << shift;
                }
                if atomicLoad(&counts[pick]) == 1u || d + 1u == digits {
                    found = atomicLoad(&firsts[pick]);
                }
            }
        }
        if workgroupUniformLoad(&found) != NONE {
            break;
        }
    }
    return workgroupUniformLoad(&found);
}

// Sum of the weights of the candidates at or before `bound`.
fn kept_weight(lane: u32, bound: vec2<u32>, top: f32) -> f32 {
    var x = 0.0;
    for (var j = space.y + lane; j < space.z; j += WG) {
        let e = element(j);
        let v = bitcast<f32>(e.x);
        if e.y != NONE && is_finite(v) && within(v, e.y, bound) {
            x += weight(v, top);
        }
    }
    return sum_all(lane, x);
}

// Part `p` keeps the first `s.keep` candidates of its chunk `start..end` (of `finite` finite
// logits; all of them where that is not more) in its slots: each lane's in its stride's order,
// after those of the lanes before it; the slots left over unused.
fn keep_candidates(lane: u32, p: u32, start: u32, end: u32, finite: u32) {
    space = vec3<u32>(0u, start, end);
    var bound = vec2<u32>(0u, 0u);
    if s.keep < finite {
        let k = search(lane, false, f32(s.keep), bound, 0.0);
        bound = vec2<u32>(order_key(row[k]), ~k);
    }
    var mine = 0u;
    for (var i = start + lane; i < end; i += WG) {
        let v = row[i];
        mine += select(0u, 1u, is_finite(v) && within(v, i, bound));
    }
    workgroupBarrier();
    red_u[lane] = mine;
    workgroupBarrier();
    if lane == 0u {
        var before = 0u;
        for (var l = 0u; l < WG; l++) {
            let n = red_u[l];
            red_u[l] = before;
            before += n;
        }
    }
    workgroupBarrier();
    let base = 5u * s.parts + 2u * KEEP * p;
    var slot = red_u[lane];
    for (var i = start + lane; i < end; i += WG) {
        let v = row[i];
        if is_finite(v) && within(v, i, bound) {
            part[base + 2u * slot] = bitcast<u32>(v);
            part[base + 2u * slot + 1u] = i;
            slot += 1u;
        }
    }
    for (var j = min(s.keep, finite) + lane; j < KEEP; j += WG) {
        part[base + 2u * j + 1u] = NONE;
    }
}

// Applies the repetition penalty to the seen ids in `start..end`.
fn penalize(lane: u32, start: u32, end: u32) {
    for (var j = lane; j < s.seen; j += WG) {
        let t = seen[j];
        if t >= start && t < end {
            let v = row[t];
            row[t] = select(v * s.penalty, v / s.penalty, v > 0.0);
        }
    }
    storageBarrier();
    workgroupBarrier();
}

// A lane's (or a workgroup's) share of the first pass: the argmax (logit, id), the largest
// finite logit, the finite logits and the NaNs.
struct First {
    bv: f32,
    bi: u32,
    top: f32,
    n: u32,
    nan: u32,
}

// This lane's first pass over `start..end`.
fn first_pass(lane: u32, start: u32, end: u32) -> First {
    var f = First(0.0, NONE, -F32_MAX, 0u, 0u);
    for (var i = start + lane; i < end; i += WG) {
        let v = row[i];
        f.nan += select(0u, 1u, is_nan(v));
        if beats(v, i, f.bv, f.bi) {
            f.bv = v;
            f.bi = i;
        }
        if is_finite(v) {
            f.top = max(f.top, v);
            f.n += 1u;
        }
    }
    return f;
}

// The workgroup's first pass: every lane's combined (the same for every lane).
fn reduce_first(lane: u32, f: First) -> First {
    if lane == 0u {
        atomicStore(&finite, 0u);
        atomicStore(&nans, 0u);
    }
    workgroupBarrier();
    atomicAdd(&finite, f.n);
    atomicAdd(&nans, f.nan);
    red_f[lane] = f.bv;
    red_u[lane] = f.bi;
    red_f[WG + lane] = f.top;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h >>= 1u) {
        if lane < h {
            if beats(red_f[lane + h], red_u[lane + h], red_f[lane], red_u[lane]) {
                red_f[lane] = red_f[lane + h];
                red_u[lane] = red_u[lane + h];
            }
            red_f[WG + lane] = max(red_f[WG + lane], red_f[WG + lane + h]);
        }
        workgroupBarrier();
    }
    let out = First(red_f[0], red_u[0], red_f[WG], workgroupUniformLoad(&finite), workgroupUniformLoad(&nans));
    workgroupBarrier();
    return out;
}

// A chunk of the row's first pass (see the module docs): the penalty of its seen ids, then its
// figures into its part.
@compute @workgroup_size(256)
fn parts(@builtin(local_invocation_index) lane: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let start = wg.x * CHUNK;
    let end = min(start + CHUNK, s.vocab);
    penalize(lane, start, end);
    let f = reduce_first(lane, first_pass(lane, start, end));
    if lane == 0u {
        let at = 5u * wg.x;
        part[at] = bitcast<u32>(f.bv);
        part[at + 1u] = f.bi;
        part[at + 2u] = bitcast<u32>(f.top);
        part[at + 3u] = f.n;
        part[at + 4u] = f.nan;
    }
    if s.keep > 0u {
        keep_candidates(lane, wg.x, start, end, f.n);
    }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lane: u32) {
    // 1. The repetition penalty, once per seen id (in parts, by the parts already).
    if s.parts == 0u {
        penalize(lane, 0u, s.vocab);
    }
    // 2. The argmax, the largest finite logit and the number of finite logits (and of NaNs): of
    // the row, or of its parts.
    var f = First(0.0, NONE, -F32_MAX, 0u, 0u);
    if s.parts == 0u {
        f = first_pass(lane, 0u, s.vocab);
    } else {
        for (var j = lane; j < s.parts; j += WG) {
            let at = 5u * j;
            let v = bitcast<f32>(part[at]);
            if beats(v, part[at + 1u], f.bv, f.bi) {
                f.bv = v;
                f.bi = part[at + 1u];
            }
            f.top = max(f.top, bitcast<f32>(part[at + 2u]));
            f.n += part[at + 3u];
            f.nan += part[at + 4u];
        }
    }
    let totals = reduce_first(lane, f);
    let argmax = totals.bi;
    let top = totals.top;
    let candidates = totals.n;
    if totals.nan != 0u {
        if lane == 0u {
            picked[0] = NAN_ROW;
        }
        return;
    }
    if s.greedy != 0u || candidates == 0u {
        if lane == 0u {
            picked[0] = select(argmax, 0u, argmax == NONE);
        }
        return;
    }

    // 3. Top-k, top-p, then the draw, each a cut in candidate order: over the row, or over the
    // candidates the parts kept.
    space = select(vec3<u32>(0u, 0u, s.vocab), vec3<u32>(1u, 0u, s.parts * KEEP), s.keep > 0u);
    let all = vec2<u32>(0u, 0u);
    var bound = all;
    if s.top_k != 0u && s.top_k < candidates {
        let k = search(lane, false, f32(s.top_k), all, top);
        bound = vec2<u32>(order_key(row[k]), ~k);
    }
    var kept = kept_weight(lane, bound, top);
    if s.top_p < 1.0 {
        let p = search(lane, true, s.top_p * kept, bound, top);
        bound = vec2<u32>(order_key(row[p]), ~p);
        kept = kept_weight(lane, bound, top);
    }
    let id = search(lane, true, s.uniform * kept, bound, top);
    if lane == 0u {
        picked[0] = id;
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_validates() {
        super::super::validate(KERNEL).unwrap_or_else(|e| panic!("{e}"));
        assert!(KERNEL.contains(&format!("@workgroup_size({INVOCATIONS})")));
        assert!(KERNEL.contains(&format!("const WG: u32 = {INVOCATIONS}u;")));
        assert!(KERNEL.contains(&format!("const NAN_ROW: u32 = {NAN_ROW:#x}u;")));
        assert!(KERNEL.contains(&format!("const CHUNK: u32 = {CHUNK}u;")));
        assert!(KERNEL.contains(&format!("let at = {PART_WORDS}u * wg.x;")));
        assert!(KERNEL.contains(&format!("const KEEP: u32 = {KEEP}u;")));
        assert!(KERNEL.contains(&format!("let at = {PART_WORDS}u * s.parts + 2u * j;")));
        assert_eq!((keep(0, false, 40), keep(3, true, 40), keep(3, false, 0), keep(3, false, 40)), (0, 0, 0, 40));
        assert_eq!((keep(3, false, KEEP), keep(3, false, KEEP + 1)), (KEEP, 0));
        assert_eq!((parts(PARTS_FROM - 1), parts(PARTS_FROM), parts(262_144)), (0, 2, 64));
    }

    #[test]
    fn settings_are_twelve_words_in_struct_order() {
        let s = Settings {
            vocab: 7,
            top_k: 3,
            seen: 2,
            greedy: true,
            temperature: 0.5,
            top_p: 0.9,
            penalty: 1.1,
            uniform: 0.25,
            parts: 9,
            keep: 3,
        };
        let words = [7, 3, 2, 1, 0.5f32.to_bits(), 0.9f32.to_bits(), 1.1f32.to_bits(), 0.25f32.to_bits(), 9, 3, 0, 0];
        assert_eq!(s.words(), words);
    }
}
