//! The SIMD kernels written once over an ISA's vector operations: `kernels!` expands the drivers
//! (decode's streaming tiles, prefill's dequantization buffer and micro-kernel) inside an ISA's
//! module, compiled for its features, so every ISA runs the same loops in the same order.
//!
//! The interface an ISA's `ops` module provides (each a `#[target_feature]` function, `#[inline]`):
//! the vector type `V` of `LANES` floats and `BV = 32 / LANES` vectors a block; `DIRECT`, the most
//! activation rows the streaming kernel takes (up to 4), and `HOIST`, how many activation vectors
//! it keeps in registers; the prefill tile of `NR` weight rows, computed `SUB` rows at a time
//! (`NR` a multiple of `SUB` and of 4), and groups of `MR` activation rows (up to 4); `zero`,
//! `fma`, `add`, `load`, `store`, `prefetch`, `hsum4` (the lane sums of 4 vectors), and the block
//! dequantizations `q8`, `q4` and `kquant`.

/// The SIMD kernels and their drivers over a module of vector operations (`$ops`: the vector
/// type `V` of `LANES` floats, `BV = 32 / LANES` vectors a block; `DIRECT`, the most activation
/// rows the streaming kernel takes (up to 4), and `HOIST`, how many activation vectors it keeps
/// in registers; the prefill tile of `NR` weight rows, `SUB` at a time (`NR` a multiple of `SUB`
/// and of 4), and groups of `MR` activation rows (up to 4); and the operations), compiled for
/// `$features`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! kernels {
    ($module:ident, $features:literal, $ops:ident) => {
        pub(in super::super) mod $module {
            use super::super::{
                BLOCK, F_Q4_1, F_Q4_K, F_Q5_0, F_Q6_K, F_Q8_0, Job, KC, Line, PREFETCH, STREAMED, Shared, TILE,
                has_shared, shared, words_per_8_blocks,
            };
            use super::$ops as ops;
            use crate::cpu::debug_span;
            use kiln_compiler::lower::WeightFormat;

            /// The sums of the lanes of each of `a`.
            #[target_feature(enable = $features)]
            #[inline]
            fn sums<const N: usize>(a: [ops::V; N]) -> [f32; N] {
                let mut out = [0f32; N];
                for (o, a) in out.chunks_mut(4).zip(a.chunks(4)) {
                    let mut four = [ops::zero(); 4];
                    for (d, s) in four.iter_mut().zip(a) {
                        *d = *s;
                    }
                    for (o, s) in o.iter_mut().zip(ops::hsum4(four)) {
                        *o = s;
                    }
                }
                out
            }

            /// Block `b` of the row at `row` (`nb` blocks of the format tagged `F`) dequantized:
            /// Q8_0 and Q4_1 here, the other formats by the ISA's `kquant` (which reads a Q4_K
            /// block's scale and minimum from `sh`, its super-block's [`Shared`]).
            ///
            /// # Safety
            ///
            /// `row` is a whole row of the layout for `nb` blocks and `b < nb`; `sh` is the
            /// [`shared`] of its super-block (read by Q4_K only).
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn row_block<const F: u8>(row: *const u32, nb: usize, b: usize, sh: &Shared) -> [ops::V; ops::BV] {
                debug_assert!(b < nb, "block {b} of {nb}");
                match F {
                    // SAFETY: a Q8_0 row holds `nb` scales, then 8 quant words a block: word
                    // `b < nb` and words `nb + 8 b .. nb + 8 b + 8 <= 9 nb` (the caller's whole row).
                    F_Q8_0 => unsafe { ops::q8(row.add(nb + 8 * b), f32::from_bits(row.add(b).read())) },
                    // SAFETY: a Q4_1 row holds `nb` scales, `nb` minimums, then 4 quant words a
                    // block: words `b`, `nb + b` and `2 nb + 4 b .. 2 nb + 4 b + 4 <= 6 nb`.
                    F_Q4_1 => unsafe {
                        let (d, m) = (f32::from_bits(row.add(b).read()), f32::from_bits(row.add(nb + b).read()));
                        ops::q4(row.add(2 * nb + 4 * b), d, m)
                    },
                    // SAFETY: the caller's.
                    _ => unsafe { ops::kquant::<F>(row, nb, b, sh) },
                }
            }

            /// `R` weight rows against `M` activation rows, streaming: the dot products, by
            /// activation row then weight row.
            ///
            /// # Safety
            ///
            /// The CPU has the features; each of `rows` points at a whole row of the layout for
            /// `nb` blocks and each of `xs` at `32 nb` floats. The words `ahead` words past those
            /// read are prefetched (a hint: they need not exist).
            #[target_feature(enable = $features)]
            unsafe fn direct<const R: usize, const M: usize, const F: u8>(
                rows: &[*const u32; R],
                nb: usize,
                xs: &[*const f32; M],
                ahead: usize,
            ) -> [[f32; R]; M] {
                let mut acc = [[ops::zero(); M]; R];
                // Each row's super-block factors, unpacked at its first block.
                let mut sh: [Shared; R] = [[(0.0, 0.0); 8]; R];
                let hoist = M * ops::BV <= ops::HOIST;
                for b in 0..nb {
                    // The activation blocks, loaded once for the tile's rows when registers allow.
                    let mut xv = [[ops::zero(); ops::BV]; M];
                    if hoist {
                        for (v, &x) in xv.iter_mut().zip(xs) {
                            for (j, v) in v.iter_mut().enumerate() {
                                // SAFETY: `x` holds `32 nb` floats (the contract, asserted in
                                // `direct_tile`) and `BLOCK * b + LANES * (j + 1) <= 32 nb`
                                // (`b < nb`, `j < BV = 32 / LANES`).
                                *v = unsafe { ops::load(x.add(BLOCK * b + ops::LANES * j)) };
                            }
                        }
                    }
                    for ((a, &row), sh) in acc.iter_mut().zip(rows).zip(sh.iter_mut()) {
                        // The rows `ahead` swept a line a block: every region of them (scales,
                        // quants, a Q6_K's high bits) is under 64 bytes a block.
                        ops::prefetch(row.wrapping_add(ahead + b * words_per_8_blocks(F) / 8));
                        if has_shared(F) && b % 8 == 0 {
                            // SAFETY: `row` is a whole row and `b / 8 < nb / 8` (`nb` a multiple
                            // of 8 in the K formats).
                            *sh = unsafe { shared::<F>(row, nb, b / 8) };
                        }
                        // SAFETY: `row` is a whole row, `b < nb`, and `sh` its super-block's.
                        let w = unsafe { row_block::<F>(row, nb, b, sh) };
                        for ((a, xv), &x) in a.iter_mut().zip(&xv).zip(xs) {
                            for (j, (w, xv)) in w.iter().zip(xv).enumerate() {
                                let xv = if hoist {
                                    *xv
                                } else {
                                    // SAFETY: as above.
                                    unsafe { ops::load(x.add(BLOCK * b + ops::LANES * j)) }
                                };
                                *a = ops::fma(*w, xv, *a);
                            }
                        }
                    }
                }
                let mut out = [[0f32; R]; M];
                for (i, o) in out.iter_mut().enumerate() {
                    let mut col = [ops::zero(); R];
                    for (c, a) in col.iter_mut().zip(&acc) {
                        if let Some(a) = a.get(i) {
                            *c = *a;
                        }
                    }
                    *o = sums(col);
                }
                out
            }

            /// Blocks `b0..b1` of the row at `row` (`nb` blocks) dequantized into `dst`
            /// (`32 (b1 - b0)` floats).
            ///
            /// # Safety
            ///
            /// The CPU has the features; `row` is a whole row of the layout, `b1 <= nb`, and `dst`
            /// is writable for `32 (b1 - b0)` floats.
            #[target_feature(enable = $features)]
            unsafe fn dequant<const F: u8>(row: *const u32, nb: usize, b0: usize, b1: usize, dst: *mut f32) {
                debug_assert!(b1 <= nb, "blocks {b0}..{b1} of {nb}");
                let mut sh: Shared = [(0.0, 0.0); 8];
                for b in b0..b1 {
                    if has_shared(F) && (b % 8 == 0 || b == b0) {
                        // SAFETY: the caller's, `b / 8 < nb / 8`.
                        sh = unsafe { shared::<F>(row, nb, b / 8) };
                    }
                    // SAFETY: the caller's, `b < nb`, and `sh` its super-block's.
                    let w = unsafe { row_block::<F>(row, nb, b, &sh) };
                    for (j, v) in w.iter().enumerate() {
                        // SAFETY: `BLOCK * (b - b0) + LANES * (j + 1) <= 32 (b1 - b0)`, the floats
                        // `dst` is writable for (the contract, asserted in `buffered`).
                        unsafe { ops::store(dst.add(BLOCK * (b - b0) + ops::LANES * j), *v) };
                    }
                }
            }

            /// Weight rows the prefill micro-kernel computes at once.
            const SUB: usize = ops::SUB;
            // `group` runs the micro-kernel on the tile's rows `SUB` at a time, and `sums` reduces
            // them 4 at a time: neither may leave rows out.
            const _: () = assert!(ops::NR.is_multiple_of(SUB) && ops::NR.is_multiple_of(4));

            /// The prefill micro-kernel: [`SUB`] dequantized rows (`w`, rows `ldw` floats apart)
            /// against `G <= MR` activation rows (`xs`) over `kc` elements, added to `acc` (by
            /// weight row, then activation row: the first `G` of each).
            ///
            /// # Safety
            ///
            /// The CPU has the features; `w` is readable for `SUB` rows of `kc` floats, each of
            /// `xs` for `kc`, and `kc` is a multiple of `LANES`.
            #[target_feature(enable = $features)]
            unsafe fn micro<const G: usize>(
                w: *const f32,
                ldw: usize,
                kc: usize,
                xs: &[*const f32; G],
                acc: &mut [[ops::V; ops::MR]; SUB],
            ) {
                // Fresh accumulators, added to `acc` at the end: starting from `acc`'s values
                // can make LLVM shuffle the registers around the loop.
                let mut a = [[ops::zero(); G]; SUB];
                debug_assert!(kc.is_multiple_of(ops::LANES), "{kc} floats in vectors of {}", ops::LANES);
                let mut s = 0;
                while s < kc {
                    let mut xv = [ops::zero(); G];
                    for (v, &x) in xv.iter_mut().zip(xs) {
                        // SAFETY: `s + LANES <= kc` (`kc` whole vectors): inside `x`'s `kc` floats
                        // (the contract, asserted in `buffered`).
                        *v = unsafe { ops::load(x.add(s)) };
                    }
                    for (j, a) in a.iter_mut().enumerate() {
                        // SAFETY: `j < SUB` and `s + LANES <= kc`: inside row `j` of `w`'s `SUB`
                        // rows of `kc` floats (the contract, asserted in `buffered`).
                        let wv = unsafe { ops::load(w.add(j * ldw + s)) };
                        for (a, x) in a.iter_mut().zip(&xv) {
                            *a = ops::fma(wv, *x, *a);
                        }
                    }
                    s += ops::LANES;
                }
                for (acc, a) in acc.iter_mut().zip(&a) {
                    for (acc, a) in acc.iter_mut().zip(a) {
                        *acc = ops::add(*acc, *a);
                    }
                }
            }

            /// Computes `job` into `out` (see [`super::super::gemm_rows_f32`]).
            ///
            /// # Safety
            ///
            /// The CPU has the features. (The job's shapes were checked when it was made.)
            #[target_feature(enable = $features)]
            pub(in super::super) unsafe fn gemm(job: &Job<'_>, out: &mut [f32]) {
                let fits = job.k == BLOCK * job.nb
                    && job.format.row_words(job.k).is_some_and(|words| job.stride >= words)
                    && job.xs.len() >= job.m * job.k
                    && out.len() >= job.m * job.rows
                    && job.words.len() / job.stride <= job.rows;
                // The kernels below rely on these shapes (and a release build returns without
                // writing `out` when they do not hold); every job `gemm_rows_f32` makes fits.
                debug_assert!(
                    fits,
                    "a job of {} rows of {} {} floats ({} blocks) at stride {} against {} activations of {} rows, \
                     into {} outputs of {} a row",
                    job.words.len() / job.stride.max(1),
                    job.k,
                    job.format,
                    job.nb,
                    job.stride,
                    job.xs.len(),
                    job.m,
                    out.len(),
                    job.rows
                );
                if !fits || job.m == 0 {
                    return;
                }
                if job.m <= STREAMED {
                    for (t, w) in job.words.chunks(TILE * job.stride).enumerate() {
                        // The activation rows in groups the streaming kernel takes, each group
                        // dequantizing the tile's weights again (from L1).
                        for i0 in (0..job.m).step_by(ops::DIRECT) {
                            let m = ops::DIRECT.min(job.m - i0);
                            let xs = job.xs.get(i0 * job.k..(i0 + m) * job.k).unwrap_or_default();
                            let group = Job { xs, m, ..*job };
                            let out = out.get_mut(i0 * job.rows..).unwrap_or_default();
                            // SAFETY: the features; `w` holds whole rows (the words are whole
                            // rows); the group's rows are rows of the job's activations and of
                            // `out`.
                            unsafe {
                                match w.len() / job.stride {
                                    4 => direct_m::<4>(&group, w, t * TILE, out),
                                    3 => direct_m::<3>(&group, w, t * TILE, out),
                                    2 => direct_m::<2>(&group, w, t * TILE, out),
                                    _ => direct_m::<1>(&group, w, t * TILE, out),
                                }
                            }
                        }
                    }
                } else {
                    // SAFETY: the features.
                    unsafe { buffered(job, out) };
                }
            }

            /// The tile of `R` rows (`w`, from row `r0`) against all of the job's `m <= 4`
            /// activation rows.
            ///
            /// # Safety
            ///
            /// The CPU has the features; `job` fits `out` (see [`gemm`]).
            #[target_feature(enable = $features)]
            unsafe fn direct_m<const R: usize>(job: &Job<'_>, w: &[u32], r0: usize, out: &mut [f32]) {
                // SAFETY: the caller's.
                unsafe {
                    match job.m {
                        1 => direct_tile::<R, 1>(job, w, r0, out),
                        2 => direct_tile::<R, 2>(job, w, r0, out),
                        3 => direct_tile::<R, 3>(job, w, r0, out),
                        _ => direct_tile::<R, 4>(job, w, r0, out),
                    }
                }
            }

            /// The tile of `R` rows (`w`, from row `r0`) against the job's `M` activation rows;
            /// does nothing if the shapes do not fit.
            ///
            /// # Safety
            ///
            /// The CPU has the features.
            #[target_feature(enable = $features)]
            unsafe fn direct_tile<const R: usize, const M: usize>(
                job: &Job<'_>,
                w: &[u32],
                r0: usize,
                out: &mut [f32],
            ) {
                if job.m != M || w.len() < R * job.stride || job.xs.len() < M * job.k || job.k != BLOCK * job.nb {
                    return;
                }
                let rows: [*const u32; R] = std::array::from_fn(|r| w.as_ptr().wrapping_add(r * job.stride));
                let xs: [*const f32; M] = std::array::from_fn(|i| job.xs.as_ptr().wrapping_add(i * job.k));
                let ahead = PREFETCH * TILE * job.stride;
                // SAFETY: the kernel reads words `0..row_words` of row `r < R`, which starts at
                // `w[r * stride]`: inside `w` (`w.len() >= R * stride` checked above, `stride >=
                // row_words` by `gemm`); and floats `0..k` of activation row `i < M`, `xs[i * k..]`,
                // inside `xs` (`xs.len() >= M * k`, checked above). Both asserted in debug builds.
                let row_words = job.format.row_words(job.k).unwrap_or(usize::MAX);
                debug_span("f32 weight tile", w.len(), 0, (R, job.stride), (row_words, 1));
                debug_span("f32 activations", job.xs.len(), 0, (M, job.k), (job.k, 1));
                let v = unsafe {
                    match job.format {
                        WeightFormat::Q4_1 => direct::<R, M, F_Q4_1>(&rows, job.nb, &xs, ahead),
                        WeightFormat::Q5_0 => direct::<R, M, F_Q5_0>(&rows, job.nb, &xs, ahead),
                        WeightFormat::Q4_K => direct::<R, M, F_Q4_K>(&rows, job.nb, &xs, ahead),
                        WeightFormat::Q6_K => direct::<R, M, F_Q6_K>(&rows, job.nb, &xs, ahead),
                        _ => direct::<R, M, F_Q8_0>(&rows, job.nb, &xs, ahead),
                    }
                };
                for (i, v) in v.iter().enumerate() {
                    for (r, &v) in v.iter().enumerate() {
                        if let Some(o) = out.get_mut(i * job.rows + r0 + r) {
                            *o = v;
                        }
                    }
                }
            }

            /// Prefill: tiles of `NR` rows dequantized, a chunk of at most [`KC`] elements at a time,
            /// into a buffer, then the micro-kernel over the chunk for each group of at most `MR`
            /// activation rows, whose accumulators are kept from one chunk to the next.
            ///
            /// # Safety
            ///
            /// The CPU has the features; `job` fits `out` (see [`gemm`]).
            #[target_feature(enable = $features)]
            unsafe fn buffered(job: &Job<'_>, out: &mut [f32]) {
                let nr = ops::NR;
                // Chunks of equal whole blocks, at most `KC` elements.
                let chunks = job.nb.div_ceil(KC / BLOCK);
                let cb = job.nb.div_ceil(chunks);
                let ldw = BLOCK * cb;
                // Groups of `MR` activation rows, but never a last group of 1 when it can be 2.
                let mut groups = Vec::new();
                let mut i0 = 0;
                while i0 < job.m {
                    let left = job.m - i0;
                    let g = if left == ops::MR + 1 && ops::MR > 2 { ops::MR - 1 } else { left.min(ops::MR) };
                    groups.push((i0, g));
                    i0 += g;
                }
                let mut accs = vec![[[ops::zero(); ops::MR]; ops::NR]; groups.len()];
                // `ldw` is a multiple of 32, so every row of the buffer starts on a cache line.
                let mut buf = vec![Line([0.0; 16]); (nr * ldw).div_ceil(16)];
                for (t, w) in job.words.chunks(nr * job.stride).enumerate() {
                    let n = w.len() / job.stride;
                    if n < nr {
                        // The missing rows of the last tile: zeros, whose results are not written.
                        for c in buf.iter_mut().skip(n * ldw / 16) {
                            *c = Line([0.0; 16]);
                        }
                    }
                    for a in accs.iter_mut() {
                        *a = [[ops::zero(); ops::MR]; ops::NR];
                    }
                    let mut b0 = 0;
                    while b0 < job.nb {
                        let b1 = (b0 + cb).min(job.nb);
                        let dst = buf.as_mut_ptr().cast::<f32>();
                        for (j, row) in w.chunks_exact(job.stride).enumerate() {
                            // SAFETY: `row` is a whole row (`stride` at least its words, checked by
                            // `gemm`); `b1 <= nb`; `j < n <= NR`, so buffer row `j` (`ldw >=
                            // 32 (b1 - b0)` floats) is inside `buf`. Asserted in debug builds.
                            debug_assert!(
                                job.format.row_words(job.k).is_some_and(|words| row.len() >= words) && b1 <= job.nb
                            );
                            debug_span(
                                "dequantization buffer",
                                16 * buf.len(),
                                j * ldw,
                                (1, ldw),
                                (BLOCK * (b1 - b0), 1),
                            );
                            unsafe {
                                let (row, dst) = (row.as_ptr(), dst.add(j * ldw));
                                match job.format {
                                    WeightFormat::Q4_1 => dequant::<F_Q4_1>(row, job.nb, b0, b1, dst),
                                    WeightFormat::Q5_0 => dequant::<F_Q5_0>(row, job.nb, b0, b1, dst),
                                    WeightFormat::Q4_K => dequant::<F_Q4_K>(row, job.nb, b0, b1, dst),
                                    WeightFormat::Q6_K => dequant::<F_Q6_K>(row, job.nb, b0, b1, dst),
                                    _ => dequant::<F_Q8_0>(row, job.nb, b0, b1, dst),
                                }
                            }
                        }
                        let panel = Panel { w: buf.as_ptr().cast::<f32>(), ldw, k0: BLOCK * b0, kc: BLOCK * (b1 - b0) };
                        for (&(i0, g), acc) in groups.iter().zip(accs.iter_mut()) {
                            // SAFETY: the features; `i0 + g <= m`, `g <= MR`: the micro-kernel reads
                            // floats `k0..k0 + kc` (`<= k`) of activation rows `i0..i0 + g`, and
                            // `kc` floats of each of the buffer's `NR` rows, `ldw` apart. Asserted in
                            // debug builds.
                            debug_assert!(g <= ops::MR && panel.kc.is_multiple_of(BLOCK));
                            debug_span(
                                "prefill activations",
                                job.xs.len(),
                                i0 * job.k + panel.k0,
                                (g, job.k),
                                (panel.kc, 1),
                            );
                            debug_span("prefill panel", 16 * buf.len(), 0, (nr, ldw), (panel.kc, 1));
                            unsafe {
                                match g {
                                    1 => group::<1>(job, &panel, i0, acc),
                                    2 => group::<2>(job, &panel, i0, acc),
                                    3 if ops::MR > 3 => group::<3>(job, &panel, i0, acc),
                                    _ => group::<{ ops::MR }>(job, &panel, i0, acc),
                                }
                            }
                        }
                        b0 = b1;
                    }
                    for (&(i0, g), acc) in groups.iter().zip(&accs) {
                        for i in 0..g {
                            let mut col = [ops::zero(); ops::NR];
                            for (c, a) in col.iter_mut().zip(acc) {
                                if let Some(a) = a.get(i) {
                                    *c = *a;
                                }
                            }
                            let o = out.get_mut((i0 + i) * job.rows + t * nr..).unwrap_or_default();
                            for (o, v) in o.iter_mut().zip(sums(col)).take(n) {
                                *o = v;
                            }
                        }
                    }
                }
            }

            /// A panel of dequantized rows: `NR` rows of `kc` floats at `w`, `ldw` apart, holding
            /// elements `k0..k0 + kc` of the tile's rows.
            struct Panel {
                w: *const f32,
                ldw: usize,
                k0: usize,
                kc: usize,
            }

            /// The micro-kernel for activation rows `i0..i0 + G` over a panel, into their
            /// accumulators.
            ///
            /// # Safety
            ///
            /// The CPU has the features; `i0 + G <= job.m`, `G <= MR` (and `xs` holds `m` rows
            /// of `k`); the panel's buffer holds `NR` rows of `kc` floats `ldw` apart, and
            /// `k0 + kc <= k`, a multiple of 32.
            #[target_feature(enable = $features)]
            unsafe fn group<const G: usize>(
                job: &Job<'_>,
                panel: &Panel,
                i0: usize,
                acc: &mut [[ops::V; ops::MR]; ops::NR],
            ) {
                let xs: [*const f32; G] =
                    std::array::from_fn(|i| job.xs.as_ptr().wrapping_add((i0 + i) * job.k + panel.k0));
                for (h, acc) in acc.as_chunks_mut::<SUB>().0.iter_mut().enumerate() {
                    // SAFETY: the caller's; rows `h * SUB..(h + 1) * SUB` of the panel's `NR`.
                    unsafe { micro::<G>(panel.w.wrapping_add(h * SUB * panel.ldw), panel.ldw, panel.kc, &xs, acc) };
                }
            }
        }
    };
}
