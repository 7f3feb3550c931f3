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

#![expect(
    clippy::indexing_slicing,
    reason = "rows and heads are indexed within `[b, heads, cap, d]`, which `reserve` keeps the buffer at"
)]

use kiln_compiler::graph::Op;
use kiln_compiler::lower::{Plan, Storage};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// One cached tensor: `[b, heads, len, d]` stored with room for `cap >= len` rows per head.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheBuf {
    data: Vec<f32>,
    b: usize,
    heads: usize,
    d: usize,
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
        Some(CacheBuf { data, b, heads, d, len, cap: len })
    }

    /// An empty buffer of `b` sequences of `heads` heads of width `d`.
    pub fn empty(b: usize, heads: usize, d: usize) -> CacheBuf {
        CacheBuf { data: Vec::new(), b, heads, d, len: 0, cap: 0 }
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

    /// Rows per head it has room for.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The elements with their head stride, as `[b, heads, rows, d]` for any `rows <= cap`.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Makes room for `rows` rows per head (keeping the first `len`), doubling the capacity.
    pub fn reserve(&mut self, rows: usize) -> Result<(), kiln_compiler::memory::MemoryError> {
        if rows <= self.cap {
            return Ok(());
        }
        let cap = rows.max(2 * self.cap).max(16);
        let (heads, d) = (self.b * self.heads, self.d);
        kiln_compiler::memory::check(|| "the key/value cache".to_string(), 4 * (heads * cap * d) as u64)?;
        let mut data = vec![0.0f32; heads * cap * d];
        for h in 0..heads {
            let (from, to) = (h * self.cap * d, h * cap * d);
            data[to..to + self.len * d].copy_from_slice(&self.data[from..from + self.len * d]);
        }
        self.data = data;
        self.cap = cap;
        Ok(())
    }

    /// Row `t` of head `h` of sequence `bi` (within the capacity), to write into.
    pub fn row_mut(&mut self, bi: usize, h: usize, t: usize) -> &mut [f32] {
        let at = ((bi * self.heads + h) * self.cap + t) * self.d;
        &mut self.data[at..at + self.d]
    }

    /// Commits rows written past `len`: the buffer now holds `len` rows per head.
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.cap);
    }

    /// The rows held, as a contiguous tensor.
    pub fn to_tensor(&self) -> Tensor {
        Tensor::f32(self.shape(), contiguous(&self.data, self.b * self.heads, self.len, self.cap, self.d))
    }
}

/// `heads` blocks of `rows` rows of `d`, read from a buffer whose head stride is `cap * d`.
pub fn contiguous(data: &[f32], heads: usize, rows: usize, cap: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(heads * rows * d);
    for h in 0..heads {
        out.extend_from_slice(&data[h * cap * d..][..rows * d]);
    }
    out
}

/// A session's cache on the CPU, by past input name.
pub type KvCache = HashMap<String, CacheBuf>;

/// A step that appends in place: a `heads` step whose cache operand is the past input `past`
/// (read by nothing else), producing the plan output `present`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendSite {
    /// Index of the step in [`Plan::steps`].
    pub step: usize,
    /// The past input's value.
    pub past_value: usize,
    /// The past input's name.
    pub past: String,
    /// The output's name.
    pub present: String,
}

/// Every step of `plan` that can append to a cache in place.
pub fn append_sites(plan: &Plan) -> Vec<AppendSite> {
    let root = |v: usize| crate::prepare::root(plan, v);
    let readers = |value: usize| {
        plan.steps.iter().flat_map(|s| &s.operands).filter(|&&o| root(o) == value).count()
            + plan.folds.iter().flat_map(|f| &f.operands).filter(|&&o| root(o) == value).count()
            + plan.outputs.iter().filter(|(_, o)| root(*o) == value).count()
    };
    let mut sites = Vec::new();
    for (i, step) in plan.steps.iter().enumerate() {
        let (Op::Heads { .. }, [cache, _]) = (&step.op, step.operands.as_slice()) else { continue };
        let past_value = root(*cache);
        let Some(Storage::Input { name: past, .. }) = plan.values.get(past_value).map(|v| &v.storage) else {
            continue;
        };
        let presents: Vec<&String> =
            plan.outputs.iter().filter(|(_, o)| root(*o) == step.output).map(|(name, _)| name).collect();
        if let ([present], 1) = (presents.as_slice(), readers(past_value)) {
            sites.push(AppendSite { step: i, past_value, past: past.clone(), present: (*present).clone() });
        }
    }
    sites
}
