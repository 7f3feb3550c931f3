//! Block-quantized projection weights kept as blocks on the device.
//!
//! A [`QuantWeight`] is a `[rows, k]` weight (the canonical `[out, in]` layout) of GGUF Q8_0,
//! Q4_1 or Q5_0 blocks or Q4_K or Q6_K super-blocks, repacked from the file's blocks into the
//! aligned device layout the projection kernels read (see [`kiln_compiler::lower::format`]: per
//! row, the f16 scales (and minimums) widened to f32, then each other field of the blocks in turn,
//! as `u32` words). Its dequantization is exactly the f32 tensor [`crate::gguf`] produces, which
//! the interpreter and every f32 path use. Row operations of the weight map (unpacking Q/K/V,
//! undoing llama.cpp's RoPE row order) and the load-time folds that keep blocks (stacking rows,
//! scaling) apply to the rows as they are. [`block`] reads any format 32 elements at a time,
//! as scale, minimum and integer quants, for the CPU kernels. [`QuantWeight::quantize`] is a
//! small reference quantizer for tests.

use crate::gguf::GgmlType;
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::{BLOCK, SUPER_BLOCK};
use kiln_compiler::tensor::Tensor;

/// A block-quantized weight in the device layout.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantWeight {
    /// A quantized format.
    pub format: WeightFormat,
    /// Rows (outputs).
    pub rows: usize,
    /// Elements per row (inputs), a multiple of the format's [`WeightFormat::row_multiple`].
    pub k: usize,
    /// `rows * format.row_words(k)` words.
    pub words: Vec<u32>,
}

impl QuantWeight {
    /// Repacks GGUF blocks (`bytes`: the rows' blocks in order) of a `[rows, k]` tensor of type
    /// `ty`. Errors (a message) unless `ty` is Q8_0, Q4_1, Q5_0, Q4_K or Q6_K, `k` is a positive
    /// multiple of its block and `bytes` holds exactly the blocks of the shape.
    pub fn from_blocks(ty: GgmlType, rows: usize, k: usize, bytes: &[u8]) -> Result<QuantWeight, String> {
        let Some((format, block_bytes, fields)) = file_layout(ty) else {
            return Err(format!(
                "type {ty} cannot stay quantized on the device (only Q8_0, Q4_1, Q5_0, Q4_K and Q6_K can)"
            ));
        };
        let per = format.row_multiple();
        let stride = match format.row_words(k) {
            Some(stride) if k > 0 => stride,
            _ => return Err(format!("rows of {k} elements are not whole {format} blocks of {per}")),
        };
        let nb = k / per;
        let expected = rows.checked_mul(nb * block_bytes).ok_or_else(|| format!("[{rows}, {k}] overflows"))?;
        if bytes.len() != expected {
            return Err(format!(
                "{} bytes of {format} blocks do not fit a [{rows}, {k}] tensor ({expected} expected)",
                bytes.len()
            ));
        }
        let f16 = |&b: &[u8; 2]| half::f16::from_le_bytes(b).to_f32().to_bits();
        let mut words = Vec::with_capacity(rows * stride);
        for row in bytes.chunks_exact(nb * block_bytes) {
            // Each field of every block of the row in turn: the f16s widened, the rest as words.
            for &(at, len, half) in fields {
                for field in row.chunks_exact(block_bytes).filter_map(|b| b.get(at..at + len)) {
                    if half {
                        words.extend(field.as_chunks().0.iter().map(f16));
                    } else {
                        words.extend(field.as_chunks().0.iter().map(|&w| u32::from_le_bytes(w)));
                    }
                }
            }
        }
        if words.len() != rows * stride {
            return Err(format!("internal error: {format} rows repacked to {} words, not {stride}", words.len()));
        }
        Ok(QuantWeight { format, rows, k, words })
    }

    fn stride(&self) -> usize {
        self.format.row_words(self.k).unwrap_or(0)
    }

    /// The weight's rows in the order `rows` lists them (a gather of whole rows), or `None` if
    /// one is out of range.
    pub fn take_rows(&self, rows: &[usize]) -> Option<QuantWeight> {
        let s = self.stride();
        let mut words = Vec::with_capacity(rows.len() * s);
        for &r in rows {
            let row = self.words.get(r.checked_mul(s)?..).and_then(|rest| rest.get(..s))?;
            words.extend_from_slice(row);
        }
        Some(QuantWeight { format: self.format, rows: rows.len(), k: self.k, words })
    }

    /// The same values in `format`, where it holds every value of this weight's format exactly
    /// ([`WeightFormat::holds_exactly`]: Q5_0 in Q8_0, each block's quants at its scale); `None`
    /// for any other pair.
    pub fn exactly_as(&self, format: WeightFormat) -> Option<QuantWeight> {
        if format == self.format {
            return Some(self.clone());
        }
        if !(format.holds_exactly(self.format) && format == WeightFormat::Q8_0) {
            return None;
        }
        let nb = self.k / BLOCK;
        let mut words = Vec::with_capacity(self.rows * format.row_words(self.k)?);
        for row in self.words.chunks_exact(self.stride().max(1)) {
            let blocks: Vec<Block> = (0..nb).map(|b| block(self.format, row, self.k, b)).collect::<Option<_>>()?;
            // Q8_0's row: the blocks' scales, then each block's 32 quants as bytes.
            words.extend(blocks.iter().map(|b| b.scale[0].to_bits()));
            for b in &blocks {
                for q in b.q.as_chunks::<4>().0 {
                    words.push(u32::from_le_bytes(q.map(|q| q as i8 as u8)));
                }
            }
        }
        Some(QuantWeight { format, rows: self.rows, k: self.k, words })
    }

    /// The rows of `parts` stacked (all of one format and `k`), or `None` if they differ.
    pub fn stack(parts: &[&QuantWeight]) -> Option<QuantWeight> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.k != first.k) {
            return None;
        }
        let words = parts.iter().flat_map(|p| p.words.iter().copied()).collect();
        Some(QuantWeight { format: first.format, rows: parts.iter().map(|p| p.rows).sum(), k: first.k, words })
    }

    /// Rows `start..start + len` (`None` past the end).
    pub fn rows(&self, start: usize, len: usize) -> Option<QuantWeight> {
        let s = self.stride();
        let words = self.words.get(start.checked_mul(s)?..start.checked_add(len)?.checked_mul(s)?)?.to_vec();
        Some(QuantWeight { format: self.format, rows: len, k: self.k, words })
    }

    /// Every element multiplied by `factor` (the row's leading floats are: the block scales and
    /// minimums, or a K-quant's super-block scales).
    pub fn scaled(&self, factor: f32) -> QuantWeight {
        let floats = self.format.row_floats(self.k).unwrap_or(0);
        let s = self.stride();
        let mut words = self.words.clone();
        for row in words.chunks_exact_mut(s.max(1)) {
            for w in row.iter_mut().take(floats) {
                *w = (f32::from_bits(*w) * factor).to_bits();
            }
        }
        QuantWeight { format: self.format, rows: self.rows, k: self.k, words }
    }

    /// The f32 tensor the blocks stand for (what [`crate::gguf`] dequantizes the file's blocks to).
    pub fn dequantize(&self) -> Tensor {
        let mut out = Vec::with_capacity(self.rows * self.k);
        for row in self.words.chunks_exact(self.stride()) {
            self.dequantize_words(row, &mut out);
        }
        Tensor::f32(vec![self.rows, self.k], out)
    }

    /// Row `r` as f32 appended to `out` (as [`QuantWeight::dequantize`] gives it); `false` if
    /// there is no such row.
    pub fn dequantize_row(&self, r: usize, out: &mut Vec<f32>) -> bool {
        let s = self.stride();
        match r.checked_mul(s).and_then(|at| self.words.get(at..)).and_then(|rest| rest.get(..s)) {
            Some(row) => {
                self.dequantize_words(row, out);
                true
            }
            None => false,
        }
    }

    /// One row's words: the blocks' scales, Q4_1's minimums, then the quants (8 or 4 words a
    /// block); the other formats block by block through [`block`].
    fn dequantize_words(&self, row: &[u32], out: &mut Vec<f32>) {
        let nb = self.k / BLOCK;
        let (scales, rest) = row.split_at_checked(nb).unwrap_or_default();
        let scales = scales.iter().map(|&d| f32::from_bits(d));
        match self.format {
            WeightFormat::Q8_0 => {
                for (d, q) in scales.zip(rest.chunks_exact(8)) {
                    out.extend(q.iter().flat_map(|w| w.to_le_bytes()).map(|x| f32::from(x as i8) * d));
                }
            }
            WeightFormat::Q4_1 => {
                let (mins, quants) = rest.split_at_checked(nb).unwrap_or_default();
                let mins = mins.iter().map(|&m| f32::from_bits(m));
                for ((d, m), q) in scales.zip(mins).zip(quants.chunks_exact(4)) {
                    let q: Vec<u8> = q.iter().flat_map(|w| w.to_le_bytes()).collect();
                    out.extend(q.iter().map(|&x| f32::from(x & 0x0f) * d + m));
                    out.extend(q.iter().map(|&x| f32::from(x >> 4) * d + m));
                }
            }
            format => {
                let mins = format.has_mins();
                for b in 0..nb {
                    let Some(blk) = block(format, row, self.k, b) else { return };
                    let (low, high) = blk.q.split_at(BLOCK / 2);
                    for (half, scale) in [low, high].into_iter().zip(blk.scale) {
                        if mins {
                            out.extend(half.iter().map(|&q| q as f32 * scale + blk.min));
                        } else {
                            out.extend(half.iter().map(|&q| q as f32 * scale));
                        }
                    }
                }
            }
        }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        4 * self.words.len() as u64
    }

    /// Quantizes a `[rows, k]` f32 tensor, returning the GGUF block bytes: Q8_0 and Q4_1 the way
    /// llama.cpp does (Q8_0: scale `max|x| / 127`, rounded quants; Q4_1: minimum and
    /// `(max - min) / 15` per block), Q5_0 as gguf-py does (scale `-max / 16` of the element
    /// largest in magnitude), and the K-quants by a plain rule (no search for the best scales):
    /// Q4_K a range `[min(0, lo), hi]` per sub-block of 32, Q6_K a signed maximum per 16, with
    /// the sub-block scales quantized against their largest. For tests and the kernel benchmark;
    /// `None` unless the tensor is 2-D f32 with rows of whole blocks and `format` is quantized.
    pub fn quantize_blocks(format: WeightFormat, t: &Tensor) -> Option<Vec<u8>> {
        let x = t.as_f32()?;
        let [_, k] = t.shape.as_slice() else { return None };
        if !format.quantized() || !k.is_multiple_of(format.row_multiple()) {
            return None;
        }
        let mut out = Vec::new();
        for block in x.chunks_exact(format.row_multiple()) {
            match format {
                WeightFormat::Q8_0 => {
                    let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = inverse(d);
                    out.extend(f16(d));
                    out.extend(block.iter().map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8));
                }
                WeightFormat::Q4_1 => {
                    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let id = inverse(d);
                    out.extend(f16(d));
                    out.extend(f16(min));
                    let q = |v: f32| ((v - min) * id).round().clamp(0.0, 15.0) as u8;
                    // Byte j holds element j in its low nibble and element j + 16 in its high one.
                    let (low, high) = block.split_at(BLOCK / 2);
                    out.extend(low.iter().zip(high).map(|(&l, &h)| q(l) | (q(h) << 4)));
                }
                WeightFormat::Q5_0 => {
                    let max = block.iter().copied().fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
                    let d = max / -16.0;
                    let id = inverse(d);
                    let q: Vec<u8> = block.iter().map(|v| (v * id + 16.5).trunc().clamp(0.0, 31.0) as u8).collect();
                    out.extend(f16(d));
                    let qh = q.iter().enumerate().fold(0u32, |h, (j, &q)| h | (u32::from(q >> 4) << j));
                    out.extend(qh.to_le_bytes());
                    let (low, high) = q.split_at(BLOCK / 2);
                    out.extend(low.iter().zip(high).map(|(&l, &h)| (l & 0x0f) | ((h & 0x0f) << 4)));
                }
                WeightFormat::Q4_K => out.extend(quantize_q4_k(block)?),
                WeightFormat::Q6_K => out.extend(quantize_q6_k(block)?),
                WeightFormat::F32 | WeightFormat::F16 => return None,
            }
        }
        Some(out)
    }

    /// [`QuantWeight::quantize_blocks`], repacked into the device layout.
    pub fn quantize(format: WeightFormat, t: &Tensor) -> Option<QuantWeight> {
        let bytes = Self::quantize_blocks(format, t)?;
        let &[rows, k] = t.shape.as_slice() else { return None };
        let ty = match format {
            WeightFormat::Q8_0 => GgmlType::Q8_0,
            WeightFormat::Q4_1 => GgmlType::Q4_1,
            WeightFormat::Q5_0 => GgmlType::Q5_0,
            WeightFormat::Q4_K => GgmlType::Q4_K,
            WeightFormat::Q6_K => GgmlType::Q6_K,
            WeightFormat::F32 | WeightFormat::F16 => return None,
        };
        Self::from_blocks(ty, rows, k, &bytes).ok()
    }

    /// The device format a GGUF type is kept in as blocks, or `None` if it is read as f32.
    pub fn format_of(ty: GgmlType) -> Option<WeightFormat> {
        file_layout(ty).map(|(format, ..)| format)
    }
}

/// A GGUF type kept as blocks: its format, the bytes of a file block, and the block's fields in
/// the order the device layout stores them, each `(byte offset, bytes, f16)`: an f16 field is
/// widened to f32 words, any other is copied as little-endian words (its length a multiple of 4).
type FileLayout = (WeightFormat, usize, &'static [(usize, usize, bool)]);

/// The file layout of `ty`, or `None` if it does not stay quantized (see the layouts in
/// [`kiln_compiler::lower::format`] and the file's in [`GgmlType`]'s constants).
fn file_layout(ty: GgmlType) -> Option<FileLayout> {
    Some(match ty {
        GgmlType::Q8_0 => (WeightFormat::Q8_0, 34, &[(0, 2, true), (2, 32, false)]),
        GgmlType::Q4_1 => (WeightFormat::Q4_1, 20, &[(0, 2, true), (2, 2, true), (4, 16, false)]),
        GgmlType::Q5_0 => (WeightFormat::Q5_0, 22, &[(0, 2, true), (2, 4, false), (6, 16, false)]),
        GgmlType::Q4_K => (WeightFormat::Q4_K, 144, &[(0, 2, true), (2, 2, true), (4, 12, false), (16, 128, false)]),
        GgmlType::Q6_K => {
            (WeightFormat::Q6_K, 210, &[(208, 2, true), (192, 16, false), (0, 128, false), (128, 64, false)])
        }
        _ => return None,
    })
}

/// One block of 32 elements of a row in the device layout, as integers and their scales:
/// element `i` is `q[i] * scale[i / 16]` (a multiply then, for formats with minimums, `+ min`;
/// never fused), which is exactly the element [`crate::gguf`] dequantizes, bit for bit. Both
/// halves have the block's scale except in Q6_K, whose scales are per 16 elements. A K-quant's
/// sub-block has its scales applied: Q4_K's scale is `d * sc` and `min` is `-(dmin * m)`; Q6_K's
/// are `d * sc` of each half, and its `q` the 6-bit quants less 32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Block {
    /// The factor of the quants of each half (elements `0..16` and `16..32`).
    pub scale: [f32; 2],
    /// The term added to every element (0 without minimums).
    pub min: f32,
    /// The integers.
    pub q: [i32; BLOCK],
}

/// Block `b` (elements `32 b..32 b + 32`) of `row`, a row of `k` elements in `format`'s device
/// layout; `None` if the row is too short or `format` is a float format. Q8_0 and Q4_1 are
/// read here too, for completeness; the kernels have their own paths for them.
pub fn block(format: WeightFormat, row: &[u32], k: usize, b: usize) -> Option<Block> {
    let (nb, ns) = (k / BLOCK, k / SUPER_BLOCK);
    let f = |i: usize| row.get(i).map(|&w| f32::from_bits(w));
    if b >= nb {
        return None;
    }
    let mut q = [0i32; BLOCK];
    let (scale, min) = match format {
        WeightFormat::Q8_0 => {
            for (q, x) in q.iter_mut().zip(le_bytes::<32>(row, nb + 8 * b)?) {
                *q = i32::from(x as i8);
            }
            (f(b)?, 0.0)
        }
        WeightFormat::Q4_1 | WeightFormat::Q5_0 => {
            let quants = le_bytes::<16>(row, 2 * nb + 4 * b)?;
            // Q5_0's fifth bits: bit `j` of the block's word is element `j`'s.
            let (fifth, offset) = match format {
                WeightFormat::Q5_0 => (*row.get(nb + b)?, 16),
                _ => (0, 0),
            };
            let (low, high) = q.split_at_mut(BLOCK / 2);
            for (j, ((x, lo), hi)) in quants.into_iter().zip(low).zip(high).enumerate() {
                *lo = i32::from(x & 0x0f) + 16 * ((fifth >> j) & 1) as i32 - offset;
                *hi = i32::from(x >> 4) + 16 * ((fifth >> (j + 16)) & 1) as i32 - offset;
            }
            let min = if format == WeightFormat::Q4_1 { f(nb + b)? } else { 0.0 };
            (f(b)?, min)
        }
        WeightFormat::Q4_K => {
            let s = b / 8;
            let (sc, m) = crate::gguf::q4_k_scale_min(&le_bytes::<12>(row, 2 * ns + 3 * s)?, b % 8);
            // Sub-blocks 2c and 2c + 1 are the low and high nibbles of 32 bytes.
            for (q, x) in q.iter_mut().zip(le_bytes::<32>(row, 5 * ns + 8 * (b / 2))?) {
                *q = i32::from((x >> (4 * (b % 2))) & 0x0f);
            }
            (f(s)? * f32::from(sc), -(f(ns + s)? * f32::from(m)))
        }
        WeightFormat::Q6_K => {
            let (s, c8) = (b / 8, b % 8);
            let (h, c) = (c8 / 4, c8 % 4);
            let scales = le_bytes::<16>(row, ns + 4 * s)?;
            let low = le_bytes::<32>(row, 5 * ns + 32 * s + 16 * h + 8 * (c % 2))?;
            let high = le_bytes::<32>(row, 37 * ns + 16 * s + 8 * h)?;
            for (q, (lo, hi)) in q.iter_mut().zip(low.into_iter().zip(high)) {
                let v = ((lo >> (4 * (c / 2))) & 0x0f) | (((hi >> (2 * c)) & 3) << 4);
                *q = i32::from(v) - 32;
            }
            // The two 16-element halves of the block have scales 2 c8 and 2 c8 + 1.
            let d = f(s)?;
            let (sc0, sc1) = (*scales.get(2 * c8)? as i8, *scales.get(2 * c8 + 1)? as i8);
            return Some(Block { scale: [d * f32::from(sc0), d * f32::from(sc1)], min: 0.0, q });
        }
        WeightFormat::F32 | WeightFormat::F16 => return None,
    };
    Some(Block { scale: [scale; 2], min, q })
}

/// The `N` bytes (`N` a multiple of 4) of the words of `row` from word `at`, little-endian, or
/// `None` past the row's end.
fn le_bytes<const N: usize>(row: &[u32], at: usize) -> Option<[u8; N]> {
    let words = row.get(at..at.checked_add(N / 4)?)?;
    let mut out = [0u8; N];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    Some(out)
}

/// An f16's little-endian bytes.
fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// `1 / d`, or 0 for `d = 0`.
fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// One Q4_K super-block (256 values) as its 144 file bytes (see [`QuantWeight::quantize_blocks`]).
fn quantize_q4_k(x: &[f32]) -> Option<Vec<u8>> {
    // Per sub-block of 32: the step and the (non-negative) offset subtracted.
    let ranges: Vec<(f32, f32)> = x
        .chunks_exact(BLOCK)
        .map(|b| {
            let lo = b.iter().copied().fold(0f32, f32::min);
            let hi = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            ((hi - lo) / 15.0, -lo)
        })
        .collect();
    let d = half::f16::from_f32(ranges.iter().fold(0f32, |a, r| a.max(r.0)) / 63.0).to_f32();
    let dmin = half::f16::from_f32(ranges.iter().fold(0f32, |a, r| a.max(r.1)) / 63.0).to_f32();
    let six = |v: f32, unit: f32| (v * inverse(unit)).round().clamp(0.0, 63.0) as u8;
    let scales: Vec<u8> = ranges.iter().map(|r| six(r.0, d)).collect();
    let mins: Vec<u8> = ranges.iter().map(|r| six(r.1, dmin)).collect();
    let mut out = Vec::with_capacity(144);
    out.extend(f16(d));
    out.extend(f16(dmin));
    // The packing `gguf::q4_k_scale_min` reads.
    let (sc, mn) = (|j: usize| scales.get(j).copied().unwrap_or(0), |j: usize| mins.get(j).copied().unwrap_or(0));
    out.extend((0..4).map(|i| sc(i) | ((sc(i + 4) >> 4) << 6)));
    out.extend((0..4).map(|i| mn(i) | ((mn(i + 4) >> 4) << 6)));
    out.extend((0..4).map(|i| (sc(i + 4) & 0x0f) | ((mn(i + 4) & 0x0f) << 4)));
    let q: Vec<u8> = x
        .chunks_exact(BLOCK)
        .enumerate()
        .flat_map(|(j, b)| {
            let step = d * f32::from(sc(j));
            let offset = dmin * f32::from(mn(j));
            b.iter().map(move |&v| ((v + offset) * inverse(step)).round().clamp(0.0, 15.0) as u8)
        })
        .collect();
    // Sub-blocks 2c and 2c + 1 share bytes 32c..32c + 32, low and high nibbles.
    for pair in q.chunks_exact(2 * BLOCK) {
        let (a, b) = pair.split_at(BLOCK);
        out.extend(a.iter().zip(b).map(|(&l, &h)| l | (h << 4)));
    }
    (out.len() == 144).then_some(out)
}

/// One Q6_K super-block (256 values) as its 210 file bytes (see [`QuantWeight::quantize_blocks`]).
fn quantize_q6_k(x: &[f32]) -> Option<Vec<u8>> {
    // Per 16 values, the scale mapping the one largest in magnitude to -32.
    let group: Vec<f32> = x
        .chunks_exact(16)
        .map(|g| g.iter().copied().fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a }) / -32.0)
        .collect();
    let d = half::f16::from_f32(group.iter().fold(0f32, |a, g| a.max(g.abs())) / 127.0).to_f32();
    let scales: Vec<i8> = group.iter().map(|&g| (g * inverse(d)).round().clamp(-128.0, 127.0) as i8).collect();
    let q: Vec<u8> = x
        .chunks_exact(16)
        .zip(&scales)
        .flat_map(|(g, &sc)| {
            let step = d * f32::from(sc);
            g.iter().map(move |&v| ((v * inverse(step)).round() + 32.0).clamp(0.0, 63.0) as u8)
        })
        .collect();
    let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
    for (e, &v) in q.iter().enumerate() {
        let (h, c, l) = (e / 128, e % 128 / 32, e % 32);
        *ql.get_mut(64 * h + 32 * (c % 2) + l)? |= (v & 0x0f) << (4 * (c / 2));
        *qh.get_mut(32 * h + l)? |= (v >> 4) << (2 * c);
    }
    let mut out = [ql, qh].concat();
    out.extend(scales.iter().map(|&s| s as u8));
    out.extend(f16(d));
    (out.len() == 210).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(rows: usize, k: usize) -> Tensor {
        let mut s = 12345u64;
        let v = (0..rows * k)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::f32(vec![rows, k], v)
    }

    const TYPES: [(WeightFormat, GgmlType); 5] = [
        (WeightFormat::Q8_0, GgmlType::Q8_0),
        (WeightFormat::Q4_1, GgmlType::Q4_1),
        (WeightFormat::Q5_0, GgmlType::Q5_0),
        (WeightFormat::Q4_K, GgmlType::Q4_K),
        (WeightFormat::Q6_K, GgmlType::Q6_K),
    ];

    /// The repacked blocks dequantize to what the GGUF reader's dequantizer (the reference) gives.
    #[test]
    fn repacked_blocks_dequantize_like_the_gguf_reader() {
        for (format, ty) in TYPES {
            let k = 2 * format.row_multiple().max(BLOCK);
            let t = data(3, k);
            let bytes = QuantWeight::quantize_blocks(format, &t).unwrap();
            let q = QuantWeight::from_blocks(ty, 3, k, &bytes).unwrap();
            assert_eq!(q.words.len(), 3 * format.row_words(k).unwrap());
            let reference = crate::gguf::dequantize_blocks(ty, vec![3, k], &bytes).unwrap();
            let bits = |t: &Tensor| t.as_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&q.dequantize()), bits(&reference), "{format}");
            // `block` gives the same elements.
            let x = reference.as_f32().unwrap();
            for (r, row) in q.words.chunks_exact(format.row_words(k).unwrap()).enumerate() {
                for b in 0..k / BLOCK {
                    let blk = block(format, row, k, b).unwrap();
                    for (i, &v) in blk.q.iter().enumerate() {
                        let e = v as f32 * blk.scale[i / 16];
                        let e = if format.has_mins() { e + blk.min } else { e };
                        assert_eq!(e, x[r * k + b * BLOCK + i], "{format} row {r} block {b} element {i}");
                    }
                }
            }
            assert!(block(format, &q.words[..2], k, 0).is_none());
            assert!(block(format, &q.words, k, k / BLOCK).is_none());
            // Quantization error (data in [-1, 1)): Q8_0 within half a step of 1/127, Q4_1
            // within half of 2/15, the others within a step of their coarsest scale.
            let tol = match format {
                WeightFormat::Q8_0 => 0.5 / 127.0 + 1e-3,
                WeightFormat::Q4_1 => 1.0 / 15.0 + 2e-3,
                WeightFormat::Q5_0 => 1.0 / 16.0 + 2e-3,
                WeightFormat::Q4_K => 2.0 / 15.0 + 0.05,
                _ => 1.0 / 32.0 + 0.02,
            };
            let worst = t.as_f32().unwrap().iter().zip(x).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= tol, "{format}: {worst}");
            // Row operations and scaling act on rows of the dequantized tensor.
            let rows = q.take_rows(&[2, 0]).unwrap();
            assert_eq!(rows.dequantize().as_f32().unwrap(), [&x[2 * k..3 * k], &x[0..k]].concat());
            let both = QuantWeight::stack(&[&q, &rows]).unwrap();
            assert_eq!(both.rows, 5);
            let scaled = q.scaled(0.5).dequantize();
            for (a, b) in scaled.as_f32().unwrap().iter().zip(x) {
                assert!((a - 0.5 * b).abs() <= 1e-6 * b.abs().max(1.0), "{format}");
            }
        }
    }

    /// A weight re-encoded in a format that holds its values exactly dequantizes to the same bits
    /// (Q5_0 as Q8_0, zeros and extremes included), and stacks with that format's weights; no
    /// other pair is re-encoded.
    #[test]
    fn q5_0_is_held_exactly_as_q8_0() {
        let mut x = data(3, 96).as_f32().unwrap().to_vec();
        x[..32].fill(0.0);
        x[32] = 1e4;
        x[40] = -1e4;
        let t = Tensor::f32(vec![3, 96], x);
        let q5 = QuantWeight::quantize(WeightFormat::Q5_0, &t).unwrap();
        let q8 = q5.exactly_as(WeightFormat::Q8_0).unwrap();
        assert_eq!(q8.format, WeightFormat::Q8_0);
        assert_eq!(q8.words.len(), 3 * WeightFormat::Q8_0.row_words(96).unwrap());
        let bits = |q: &QuantWeight| q.dequantize().as_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&q8), bits(&q5));
        let other = QuantWeight::quantize(WeightFormat::Q8_0, &data(2, 96)).unwrap();
        let stacked = QuantWeight::stack(&[&q8, &other]).unwrap();
        assert_eq!(bits(&stacked), [bits(&q5), bits(&other)].concat());
        assert_eq!(q5.exactly_as(WeightFormat::Q5_0).unwrap(), q5);
        for (from, to) in [(WeightFormat::Q8_0, WeightFormat::Q5_0), (WeightFormat::Q4_1, WeightFormat::Q8_0)] {
            let q = QuantWeight::quantize(from, &t).unwrap();
            assert!(q.exactly_as(to).is_none(), "{from} as {to}");
            assert!(!to.holds_exactly(from));
        }
        assert_eq!(WeightFormat::common_exact(&[WeightFormat::Q5_0, WeightFormat::Q8_0]), Some(WeightFormat::Q8_0));
        assert_eq!(WeightFormat::common_exact(&[WeightFormat::Q4_K, WeightFormat::Q6_K]), None);
    }

    #[test]
    fn bad_blocks_are_errors() {
        assert!(
            QuantWeight::from_blocks(GgmlType::Q8_0, 2, 48, &[0; 34 * 3]).unwrap_err().contains("whole Q8_0 blocks")
        );
        assert!(QuantWeight::from_blocks(GgmlType::Q8_0, 2, 64, &[0; 34 * 3]).unwrap_err().contains("do not fit"));
        assert!(QuantWeight::from_blocks(GgmlType::F16, 2, 64, &[0; 256]).unwrap_err().contains("F16"));
        // The K-quants' rows are whole super-blocks of 256.
        let e = QuantWeight::from_blocks(GgmlType::Q4_K, 1, 640, &[0; 144 * 2]).unwrap_err();
        assert!(e.contains("whole Q4_K blocks of 256"), "{e}");
        let e = QuantWeight::from_blocks(GgmlType::Q6_K, 2, 256, &[0; 210]).unwrap_err();
        assert!(e.contains("420 expected"), "{e}");
        let e = QuantWeight::from_blocks(GgmlType::Q5_0, 1, 48, &[0; 22]).unwrap_err();
        assert!(e.contains("whole Q5_0 blocks of 32"), "{e}");
        assert!(QuantWeight::from_blocks(GgmlType(13), 1, 256, &[0; 176]).unwrap_err().contains("Q5_K"));
    }
}
