//! Block-quantized projection weights kept as blocks on the device.
//!
//! A [`QuantWeight`] is a `[rows, k]` weight (the canonical `[out, in]` layout) of GGUF Q8_0 or
//! Q4_1 blocks, repacked from the file's 34- or 20-byte blocks into the aligned device layout the
//! projection kernel reads (see [`kiln_compiler::lower::format`]: per row, the block scales as f32,
//! Q4_1's block minimums as f32, then the quants as `u32` words). Its dequantization is exactly the
//! f32 tensor [`crate::gguf`] produces, which the interpreter and every f32 path use. Row
//! operations of the weight map (unpacking Q/K/V, undoing llama.cpp's RoPE row order) and the
//! load-time folds that keep blocks (stacking rows, scaling) apply to the rows as they are.
//! [`QuantWeight::quantize`] is a small reference quantizer (llama.cpp's rounding) for tests.

use crate::gguf::GgmlType;
use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::BLOCK;
use kiln_compiler::tensor::Tensor;

/// A block-quantized weight in the device layout.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantWeight {
    /// `Q8_0` or `Q4_1`.
    pub format: WeightFormat,
    /// Rows (outputs).
    pub rows: usize,
    /// Elements per row (inputs), a multiple of 32.
    pub k: usize,
    /// `rows * format.row_words(k)` words.
    pub words: Vec<u32>,
}

impl QuantWeight {
    /// Repacks GGUF blocks (`bytes`: the rows' blocks in order) of a `[rows, k]` tensor of type
    /// `ty`. Errors (a message) unless `ty` is Q8_0 or Q4_1, `k` is a multiple of 32 and `bytes`
    /// holds exactly the blocks of the shape.
    pub fn from_blocks(ty: GgmlType, rows: usize, k: usize, bytes: &[u8]) -> Result<QuantWeight, String> {
        let (format, block_bytes) = match ty {
            GgmlType::Q8_0 => (WeightFormat::Q8_0, 34),
            GgmlType::Q4_1 => (WeightFormat::Q4_1, 20),
            other => return Err(format!("type {other} cannot stay quantized on the device (only Q8_0 and Q4_1 can)")),
        };
        if k == 0 || !k.is_multiple_of(BLOCK) {
            return Err(format!("rows of {k} elements are not whole blocks of {BLOCK}"));
        }
        let nb = k / BLOCK;
        if bytes.len() != rows * nb * block_bytes {
            return Err(format!(
                "{} bytes of {format} blocks do not fit a [{rows}, {k}] tensor ({} expected)",
                bytes.len(),
                rows * nb * block_bytes
            ));
        }
        let f16 = |&b: &[u8; 2]| half::f16::from_le_bytes(b).to_f32().to_bits();
        // A block holds `fields` f16s (its scale, then Q4_1's minimum), then its quants.
        let fields = if format == WeightFormat::Q4_1 { 2 } else { 1 };
        let stride = format.row_words(k).unwrap_or(0);
        let mut words = Vec::with_capacity(rows * stride);
        for row in bytes.chunks_exact(nb * block_bytes) {
            let blocks = || row.chunks_exact(block_bytes);
            for field in 0..fields {
                words.extend(blocks().filter_map(|b| b.as_chunks().0.get(field)).map(f16));
            }
            for quants in blocks().filter_map(|b| b.get(2 * fields..)) {
                words.extend(quants.as_chunks().0.iter().map(|&w| u32::from_le_bytes(w)));
            }
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

    /// The rows of `parts` stacked (all of one format and `k`), or `None` if they differ.
    pub fn stack(parts: &[&QuantWeight]) -> Option<QuantWeight> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.k != first.k) {
            return None;
        }
        let words = parts.iter().flat_map(|p| p.words.iter().copied()).collect();
        Some(QuantWeight { format: first.format, rows: parts.iter().map(|p| p.rows).sum(), k: first.k, words })
    }

    /// Every element multiplied by `factor` (the block scales and minimums are).
    pub fn scaled(&self, factor: f32) -> QuantWeight {
        let nb = self.k / BLOCK;
        let floats = if self.format == WeightFormat::Q4_1 { 2 * nb } else { nb };
        let s = self.stride();
        let mut words = self.words.clone();
        for row in words.chunks_exact_mut(s) {
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

    /// One row's words: the blocks' scales, Q4_1's minimums, then the quants (8 or 4 words a block).
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
            _ => {
                let (mins, quants) = rest.split_at_checked(nb).unwrap_or_default();
                let mins = mins.iter().map(|&m| f32::from_bits(m));
                for ((d, m), q) in scales.zip(mins).zip(quants.chunks_exact(4)) {
                    let q: Vec<u8> = q.iter().flat_map(|w| w.to_le_bytes()).collect();
                    out.extend(q.iter().map(|&x| f32::from(x & 0x0f) * d + m));
                    out.extend(q.iter().map(|&x| f32::from(x >> 4) * d + m));
                }
            }
        }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        4 * self.words.len() as u64
    }

    /// Quantizes a `[rows, k]` f32 tensor the way llama.cpp does (Q8_0: scale `max|x| / 127`,
    /// rounded quants; Q4_1: minimum and `(max - min) / 15` per block), returning the GGUF block
    /// bytes. For tests and the kernel benchmark; `None` unless the tensor is 2-D f32 with rows of
    /// whole blocks and `format` is quantized.
    pub fn quantize_blocks(format: WeightFormat, t: &Tensor) -> Option<Vec<u8>> {
        let x = t.as_f32()?;
        let [_, k] = t.shape.as_slice() else { return None };
        if !k.is_multiple_of(BLOCK) {
            return None;
        }
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        let mut out = Vec::new();
        for block in x.chunks_exact(BLOCK) {
            match format {
                WeightFormat::Q8_0 => {
                    let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend(f16(d));
                    out.extend(block.iter().map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8));
                }
                WeightFormat::Q4_1 => {
                    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend(f16(d));
                    out.extend(f16(min));
                    let q = |v: f32| ((v - min) * id).round().clamp(0.0, 15.0) as u8;
                    // Byte j holds element j in its low nibble and element j + 16 in its high one.
                    let (low, high) = block.split_at(BLOCK / 2);
                    out.extend(low.iter().zip(high).map(|(&l, &h)| q(l) | (q(h) << 4)));
                }
                _ => return None,
            }
        }
        Some(out)
    }

    /// [`QuantWeight::quantize_blocks`], repacked into the device layout.
    pub fn quantize(format: WeightFormat, t: &Tensor) -> Option<QuantWeight> {
        let bytes = Self::quantize_blocks(format, t)?;
        let &[rows, k] = t.shape.as_slice() else { return None };
        let ty = if format == WeightFormat::Q8_0 { GgmlType::Q8_0 } else { GgmlType::Q4_1 };
        Self::from_blocks(ty, rows, k, &bytes).ok()
    }
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

    /// The repacked blocks dequantize to what the GGUF reader's dequantizer (the reference) gives.
    #[test]
    fn repacked_blocks_dequantize_like_the_gguf_reader() {
        for (format, ty) in [(WeightFormat::Q8_0, GgmlType::Q8_0), (WeightFormat::Q4_1, GgmlType::Q4_1)] {
            let t = data(3, 64);
            let bytes = QuantWeight::quantize_blocks(format, &t).unwrap();
            let q = QuantWeight::from_blocks(ty, 3, 64, &bytes).unwrap();
            let reference = crate::gguf::dequantize_blocks(ty, vec![3, 64], &bytes).unwrap();
            assert_eq!(q.dequantize(), reference, "{format}");
            // Quantization error: Q8_0 within half a step of 1/127, Q4_1 within half of 2/15.
            let tol = if format == WeightFormat::Q8_0 { 0.5 / 127.0 + 1e-3 } else { 1.0 / 15.0 + 2e-3 };
            let worst = t
                .as_f32()
                .unwrap()
                .iter()
                .zip(q.dequantize().as_f32().unwrap())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= tol, "{format}: {worst}");
            // Row operations and scaling act on rows of the dequantized tensor.
            let rows = q.take_rows(&[2, 0]).unwrap();
            let d = q.dequantize();
            let x = d.as_f32().unwrap();
            assert_eq!(rows.dequantize().as_f32().unwrap(), [&x[128..192], &x[0..64]].concat());
            let both = QuantWeight::stack(&[&q, &rows]).unwrap();
            assert_eq!(both.rows, 5);
            let scaled = q.scaled(0.5).dequantize();
            for (a, b) in scaled.as_f32().unwrap().iter().zip(x) {
                assert!((a - 0.5 * b).abs() <= 1e-6 * b.abs().max(1.0));
            }
        }
    }

    #[test]
    fn bad_blocks_are_errors() {
        assert!(QuantWeight::from_blocks(GgmlType::Q8_0, 2, 48, &[0; 34 * 3]).unwrap_err().contains("whole blocks"));
        assert!(QuantWeight::from_blocks(GgmlType::Q8_0, 2, 64, &[0; 34 * 3]).unwrap_err().contains("do not fit"));
        assert!(QuantWeight::from_blocks(GgmlType::F16, 2, 64, &[0; 256]).unwrap_err().contains("F16"));
    }
}
