//! What the quantized kernels' unit tests share: a deterministic generator and the formats.

use kiln_compiler::lower::WeightFormat;
use kiln_compiler::lower::format::BLOCK;

/// A small deterministic generator (64-bit LCG, high bits).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 32) as u32
    }

    /// Uniform in [-1, 1).
    pub(super) fn unit(&mut self) -> f32 {
        (self.next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }

    /// Values in [-1, 1) times a per-block magnitude spread over 1e-3..1e1.
    pub(super) fn values(&mut self, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n.div_ceil(BLOCK) {
            let m = 10f32.powf(self.unit() * 2.0 - 1.0);
            out.extend((0..BLOCK).map(|_| self.unit() * m));
        }
        out.truncate(n);
        out
    }
}

/// The quantized formats the kernels read.
pub(super) const FORMATS: [WeightFormat; 5] =
    [WeightFormat::Q8_0, WeightFormat::Q4_1, WeightFormat::Q5_0, WeightFormat::Q4_K, WeightFormat::Q6_K];

/// `k` rounded up to whole blocks of `format`.
pub(super) fn k_of(format: WeightFormat, k: usize) -> usize {
    k.next_multiple_of(format.row_multiple())
}
