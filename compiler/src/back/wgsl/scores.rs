//! WGSL for what a fused softmax or attention does to its scores besides the scale, ALiBi and the
//! causal/window mask ([`ScoreMods`]): the soft-cap, T5's relative position bias read from its
//! table, and BigBird's block pattern. Every kernel that computes scores (the masked softmax, both
//! attention kernels, the block-sparse mask) takes its code from here, so they agree with each
//! other and with `interp` by construction.
//!
//! The block pattern is computed in the kernel, per query block, as `semantics::block_pattern_row`
//! does: SplitMix64 in pairs of u32 (WGSL has no 64-bit integers), the random picks kept in
//! registers (at most 8, the spec's limit), so the attended key blocks are known before any key
//! is read.

// The parent module's `expect` of indexing does not extend here.
#![deny(clippy::indexing_slicing)]

use super::emit::lit;
use crate::graph::{BlockPattern, Bucketing, ScoreMods};

/// The most random blocks per query block (the spec's limit, `attention.block_sparse.random`).
pub const MAX_RANDOM: usize = 8;

/// The buffers of a fused softmax's or attention's optional operands — the key mask, then the
/// relative bias table when `mods` has one — for an op with `fixed` operands before them and
/// `operands` in all (as `semantics::score_operands` reads them).
pub fn optional_buffers(mods: &ScoreMods, fixed: usize, operands: usize) -> (Option<String>, Option<String>) {
    let table = mods.relative.is_some().then(|| format!("in{}", operands.saturating_sub(1)));
    let masks = operands.saturating_sub(fixed + usize::from(table.is_some()));
    ((masks > 0).then(|| format!("in{fixed}")), table)
}

/// Statement: `x = cap * tanh(x / cap)` when `mods` soft-caps, else nothing.
pub fn softcap(mods: &ScoreMods, x: &str) -> String {
    match mods.softcap {
        Some(cap) => format!("{x} = {c} * tanh_({x} / {c});\n", c = lit(cap.0)),
        None => String::new(),
    }
}

/// Statement: adds the relative position bias of key `ki` for a query at key position `qi`, head
/// `h` of `heads`, read from buffer `table` (`[buckets, heads]`), when `mods` has one. The bucket
/// is [`bucket`]'s.
pub fn relative(mods: &ScoreMods, x: &str, ki: &str, qi: &str, h: &str, heads: &str, table: &str) -> String {
    let Some(b) = mods.relative else { return String::new() };
    format!("{{\n{}    {x} = {x} + {table}[bk * {heads} + {h}];\n}}\n", bucket(b, ki, qi))
}

/// Statements (indented by four spaces) declaring `bk`, the bucket of the pair of key `ki` and a
/// query at key position `qi` (`u32`s): `semantics::relative_bucket`'s arithmetic, the logarithm in
/// f32. Also declares `rel`, `off` and `dist`, so it goes in a block of its own.
pub fn bucket(b: Bucketing, ki: &str, qi: &str) -> String {
    let Bucketing { buckets, max_distance, bidirectional } = b;
    let n = if bidirectional { buckets / 2 } else { buckets };
    let max_exact = (n / 2).max(1);
    let ln_ratio = (max_distance as f64 / max_exact as f64).ln() as f32;
    let direction = if bidirectional {
        format!("if (rel > 0) {{ off = {n}u; }}\n    dist = u32(abs(rel));")
    } else {
        "dist = u32(max(-rel, 0));".into()
    };
    format!(
        "    let rel = i32({ki}) - i32({qi});\n    var off = 0u;\n    var dist = 0u;\n    {direction}\n    var bk = dist;\n    \
         if (dist >= {max_exact}u) {{\n        let large = {me} + log(f32(dist) / {me}) / {ln} * {span};\n        \
         bk = min(u32(large), {last_n}u);\n    }}\n    bk = min(off + bk, {last}u);\n",
        me = lit(max_exact as f32),
        ln = lit(ln_ratio),
        span = lit(n.saturating_sub(max_exact) as f32),
        last_n = n.max(1) - 1,
        last = buckets.saturating_sub(1),
    )
}

/// Statements computing, for a query at key position `qi` among `q` queries and `k` keys, its
/// query block `sp_qb`, the block count `sp_nb` and its random picks `sp_p` (`sp_np` of them; unused
/// entries hold `0xFFFFFFFF`), when `mods` is block-sparse.
pub fn sparse_setup(mods: &ScoreMods, qi: &str, q: &str, k: &str) -> String {
    let Some(p) = mods.sparse else { return String::new() };
    let BlockPattern { block, global, window, random, seed } = p;
    let random = random.min(MAX_RANDOM);
    // 64-bit products and shifts on (lo, hi) pairs.
    let mul = |v: &str, c: u64| {
        let (lo, hi) = (c as u32, (c >> 32) as u32);
        format!(
            "{{ let a0 = {v}.x & 0xFFFFu; let a1 = {v}.x >> 16u; let b0 = {lo}u & 0xFFFFu; let b1 = {lo}u >> 16u;\n\
             let p00 = a0 * b0; let p01 = a0 * b1; let p10 = a1 * b0; let p11 = a1 * b1;\n\
             let mid = (p00 >> 16u) + (p01 & 0xFFFFu) + (p10 & 0xFFFFu);\n\
             {v} = vec2<u32>((p00 & 0xFFFFu) | (mid << 16u), p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u) + {v}.x * {hi}u + {v}.y * {lo}u); }}\n"
        )
    };
    let shift =
        |v: &str, s: u32| format!("{v} = {v} ^ vec2<u32>(({v}.x >> {s}u) | ({v}.y << {}u), {v}.y >> {s}u);\n", 32 - s);
    let golden = 0x9E37_79B9_7F4A_7C15u64;
    let fixed = format!("(c < {global}u || max(sp_qb, c) - min(sp_qb, c) <= {window}u)");
    format!(
        "let sp_nb = (max({q}, {k}) + {block}u - 1u) / {block}u;\nlet sp_qb = ({qi}) / {block}u;\n\
         var sp_p = array<u32, {MAX_RANDOM}>({unused});\nvar sp_np = 0u;\n\
         if (sp_qb >= {global}u && {random}u > 0u) {{\n\
         // Blocks neither global nor in the window: the candidates.\n\
         var base = 0u;\nfor (var c = 0u; c < sp_nb; c = c + 1u) {{ if (!{fixed}) {{ base = base + 1u; }} }}\n\
         var state = vec2<u32>(sp_qb, {seed_lo}u);\n\
         for (var d = 0u; d < {random}u; d = d + 1u) {{\n\
         let len = base - d;\nif (len == 0u) {{ break; }}\n\
         let sum = state.x + {g_lo}u;\nstate = vec2<u32>(sum, state.y + {g_hi}u + select(0u, 1u, sum < state.x));\n\
         var z = state;\n{s30}{m1}{s27}{m2}{s31}\
         // z mod len, from its halves.\n\
         let pow32 = (0xFFFFFFFFu % len + 1u) % len;\nvar idx = ((z.y % len) * pow32 % len + z.x % len) % len;\n\
         var pick = 0u;\n\
         for (var c = 0u; c < sp_nb; c = c + 1u) {{\n\
         if {fixed} {{ continue; }}\n\
         var taken = false;\nfor (var e = 0u; e < d; e = e + 1u) {{ if (sp_p[e] == c) {{ taken = true; }} }}\n\
         if (taken) {{ continue; }}\nif (idx == 0u) {{ pick = c; break; }}\nidx = idx - 1u;\n}}\n\
         sp_p[d] = pick;\nsp_np = d + 1u;\n}}\n}}\n",
        unused = ["0xFFFFFFFFu"; MAX_RANDOM].join(", "),
        seed_lo = seed as u32,
        g_lo = golden as u32,
        g_hi = (golden >> 32) as u32,
        s30 = shift("z", 30),
        m1 = mul("z", 0xBF58_476D_1CE4_E5B9),
        s27 = shift("z", 27),
        m2 = mul("z", 0x94D0_49BB_1331_11EB),
        s31 = shift("z", 31),
    )
}

/// A boolean expression: whether the query of [`sparse_setup`] attends key `ki` under the block
/// pattern (`true` when `mods` is not block-sparse).
pub fn sparse_keep(mods: &ScoreMods, ki: &str) -> String {
    let Some(p) = mods.sparse else { return "true".into() };
    let kb = format!("(({ki}) / {}u)", p.block);
    let picks: String = (0..p.random.min(MAX_RANDOM)).map(|e| format!(" || sp_p[{e}] == {kb}")).collect();
    format!(
        "(sp_qb < {g}u || {kb} < {g}u || max(sp_qb, {kb}) - min(sp_qb, {kb}) <= {w}u{picks})",
        g = p.global,
        w = p.window
    )
}

/// Statements declaring the attended key blocks of [`sparse_setup`]'s query block as a list
/// walked by index: `sp_n` entries, entry `e`'s block given by [`sparse_block`] — every block for a
/// global query block, else the global blocks, the window (past the global ones), then the picks.
pub fn sparse_list(p: &BlockPattern) -> String {
    let (g, w) = (p.global, p.window);
    format!(
        "let sp_all = sp_qb < {g}u;\nlet sp_wlo = max(min({g}u, sp_nb), sp_qb - min(sp_qb, {w}u));\n\
         let sp_whi = min(sp_qb + {w}u + 1u, sp_nb);\nlet sp_wn = select(0u, sp_whi - sp_wlo, sp_whi > sp_wlo);\n\
         let sp_n = select(min({g}u, sp_nb) + sp_wn + sp_np, sp_nb, sp_all);\n"
    )
}

/// Expression: the key block of entry `e` of [`sparse_list`].
pub fn sparse_block(p: &BlockPattern, e: &str) -> String {
    let g = p.global;
    format!(
        "select(select(select(sp_p[min({e} - min({e}, {g}u + sp_wn), {last}u)], sp_wlo + {e} - min({e}, {g}u), {e} < {g}u + sp_wn), {e}, {e} < {g}u), {e}, sp_all)",
        last = MAX_RANDOM - 1
    )
}
