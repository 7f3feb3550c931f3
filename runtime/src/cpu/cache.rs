//! The key/value cache of a CPU session, appended in place.
//!
//! A cached decoder step reads `L.past_k [b, heads, p, d]` and returns `L.present_k [b, heads,
//! p + s, d]`. Returned as a fresh tensor, every step would copy the whole cache — O(context) per
//! token and layer. Instead each cached tensor lives in a [`CacheBuf`] with room for more rows
//! than it holds (`[b, heads, cap, d]`, head stride `cap * d`): the step that appends to it (a
//! `heads` step reading the past, see [`append_sites`]) writes only its `s` new rows per head,
//! and the attention that reads the present reads the buffer in place through its strides. The
//! room doubles when it runs out (amortized O(1) per row). Rows past `len` are invisible until a
//! run succeeds, so a failed step leaves the cache as it was.
//!
//! A sliding-window layer's cache keeps only its latest `window - 1` rows
//! ([`InputRole::Cache`](kiln_compiler::graph::InputRole::Cache)): [`CacheBuf::slide`] drops the
//! oldest by moving where the held rows start, not the rows; when an append would run past the
//! room, the held rows move back to the start first. The room stays at twice the window, so the
//! rows move once every `window` or so tokens (amortized O(1) per row) and the memory is bounded.

#![expect(
    clippy::indexing_slicing,
    reason = "rows and heads are indexed within `[b, heads, cap, d]`, which `reserve` keeps the buffer at"
)]

use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// One cached tensor: `[b, heads, len, d]` stored with room for `cap >= start + len` rows per
/// head, the held ones from row `start`.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheBuf {
    data: Vec<f32>,
    b: usize,
    heads: usize,
    d: usize,
    start: usize,
    len: usize,
    cap: usize,
}

impl CacheBuf {
    /// A buffer holding `t` (`[b, heads, len, d]`) with no spare room.
    pub fn from_tensor(t: Tensor) -> Option<CacheBuf> {
        let &[b, heads, len, d] = t.shape.as_slice() else { return None };
        let data = match t.data {
            kiln_compiler::tensor::Data::F32(v) => v,
            kiln_compiler::tensor::Data::I64(_) => return None,
        };
        Some(CacheBuf { data, b, heads, d, start: 0, len, cap: len })
    }

    /// An empty buffer of `b` sequences of `heads` heads of width `d`.
    pub fn empty(b: usize, heads: usize, d: usize) -> CacheBuf {
        CacheBuf { data: Vec::new(), b, heads, d, start: 0, len: 0, cap: 0 }
    }

    /// `[b, heads, len, d]`.
    pub fn shape(&self) -> Vec<usize> {
        vec![self.b, self.heads, self.len, self.d]
    }

    /// Rows per head it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows per head it has room for (the head stride of [`data`](Self::data)).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Rows per head a view from the first held row can have: `capacity - start`.
    pub fn room(&self) -> usize {
        self.cap - self.start
    }

    /// The elements from the first held row, with head stride `capacity * d`: `[b, heads, rows, d]`
    /// for any `rows <= room`.
    pub fn data(&self) -> &[f32] {
        &self.data[self.start * self.d..]
    }

    /// Makes room for `rows` held rows per head (keeping the `len` held now): moves them to the
    /// start if that makes room, else doubles the capacity.
    pub fn reserve(&mut self, rows: usize) -> Result<(), kiln_compiler::memory::MemoryError> {
        if self.start + rows <= self.cap {
            return Ok(());
        }
        let (heads, d, len) = (self.b * self.heads, self.d, self.len);
        if rows <= self.cap {
            for h in 0..heads {
                let from = (h * self.cap + self.start) * d;
                self.data.copy_within(from..from + len * d, h * self.cap * d);
            }
            self.start = 0;
            return Ok(());
        }
        self.relocate(rows.max(2 * self.cap).max(16))
    }

    /// Moves the held rows to the start of a new buffer with room for `cap >= len` rows per head.
    fn relocate(&mut self, cap: usize) -> Result<(), kiln_compiler::memory::MemoryError> {
        let (heads, d, len) = (self.b * self.heads, self.d, self.len);
        kiln_compiler::memory::check(|| "the key/value cache".to_string(), 4 * (heads * cap * d) as u64)?;
        let mut data = vec![0.0f32; heads * cap * d];
        for h in 0..heads {
            let (from, to) = ((h * self.cap + self.start) * d, h * cap * d);
            data[to..to + len * d].copy_from_slice(&self.data[from..from + len * d]);
        }
        self.data = data;
        self.cap = cap;
        self.start = 0;
        Ok(())
    }

    /// Held row `t` of head `h` of sequence `bi` (within the room), to write into.
    pub fn row_mut(&mut self, bi: usize, h: usize, t: usize) -> &mut [f32] {
        let at = ((bi * self.heads + h) * self.cap + self.start + t) * self.d;
        &mut self.data[at..at + self.d]
    }

    /// Commits rows written past `len`: the buffer now holds `len` rows per head.
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.room());
    }

    /// Keeps only the latest `rows` rows (a sliding window's cache). Once it holds more, the room
    /// is set to twice `rows` (at least 16) and stays there: the memory does not grow with the
    /// context, and [`reserve`](Self::reserve) moves the rows back once every `rows` appends.
    pub fn slide(&mut self, rows: usize) -> Result<(), kiln_compiler::memory::MemoryError> {
        if self.len <= rows {
            return Ok(());
        }
        if rows == 0 {
            *self = CacheBuf::empty(self.b, self.heads, self.d);
            return Ok(());
        }
        self.start += self.len - rows;
        self.len = rows;
        let room = (2 * rows).max(16);
        if self.cap != room { self.relocate(room) } else { Ok(()) }
    }

    /// The rows held, as a contiguous tensor.
    pub fn to_tensor(&self) -> Tensor {
        Tensor::f32(self.shape(), contiguous(self.data(), self.b * self.heads, self.len, self.cap, self.d))
    }
}

/// `heads` blocks of `rows` rows of `d`, read from a buffer whose head stride is `cap * d` (the
/// last head may end right after its rows).
pub fn contiguous(data: &[f32], heads: usize, rows: usize, cap: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(heads * rows * d);
    for h in 0..heads {
        out.extend_from_slice(&data[h * cap * d..][..rows * d]);
    }
    out
}

/// A session's cache on the CPU, by past input name.
pub type KvCache = HashMap<String, CacheBuf>;

pub use crate::prepare::{AppendSite, append_sites};

#[cfg(test)]
mod tests {
    use super::*;

    /// Appends `s` rows (row `t` of head `h` of sequence `bi` holds `[value, h, bi]`) as a step does.
    fn append(buf: &mut CacheBuf, values: &[f32]) {
        let held = buf.len();
        buf.reserve(held + values.len()).unwrap();
        for (t, &v) in values.iter().enumerate() {
            for bi in 0..2 {
                for h in 0..3 {
                    buf.row_mut(bi, h, held + t).copy_from_slice(&[v, h as f32, bi as f32]);
                }
            }
        }
        buf.set_len(held + values.len());
    }

    #[test]
    fn a_sliding_cache_keeps_the_latest_rows_in_bounded_memory() {
        let mut buf = CacheBuf::empty(2, 3, 3);
        let window = 9; // keeps 8
        append(&mut buf, &(0..20).map(|v| v as f32).collect::<Vec<_>>()); // a long prefill
        buf.slide(window - 1).unwrap();
        let mut moves = 0;
        for v in 20..200 {
            let before = buf.data().as_ptr();
            append(&mut buf, &[v as f32]);
            if buf.data().as_ptr() != before {
                moves += 1;
            }
            buf.slide(window - 1).unwrap();
            assert_eq!(buf.capacity(), 16, "bounded at twice the rows kept");
            let t = buf.to_tensor();
            assert_eq!(t.shape, [2, 3, 8, 3]);
            let data = t.as_f32().unwrap();
            for (i, row) in data.chunks(3).enumerate() {
                let (bi, h, r) = (i / 24, i / 8 % 3, i % 8);
                assert_eq!(row, [(v - 7 + r) as f32, h as f32, bi as f32], "row {r} of head {h} of {bi} at {v}");
            }
        }
        // 180 appends, each moving the rows back once every `room - kept` = 8 of them.
        assert!((20..=25).contains(&moves), "{moves} moves");
        buf.slide(0).unwrap();
        assert!(buf.is_empty());
    }
}
