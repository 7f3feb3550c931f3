//! Dense host tensors: what the interpreter computes on and what weights and inputs load into.

use std::fmt;

/// Element types a graph value can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit float (every activation and weight).
    F32,
    /// 64-bit signed integer (token ids).
    I64,
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::I64 => "i64",
        })
    }
}

/// The elements of a tensor, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// Floats.
    F32(Vec<f32>),
    /// Integers.
    I64(Vec<i64>),
}

/// A dense, row-major tensor with a concrete shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Extent of each axis.
    pub shape: Vec<usize>,
    /// The elements; `data.len() == shape.iter().product()`.
    pub data: Data,
}

impl Tensor {
    /// A float tensor. Panics if the lengths disagree (a caller bug, not user input).
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "shape {shape:?} vs {} elements", data.len());
        Tensor { shape, data: Data::F32(data) }
    }

    /// An integer tensor. Panics if the lengths disagree (a caller bug, not user input).
    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "shape {shape:?} vs {} elements", data.len());
        Tensor { shape, data: Data::I64(data) }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The floats, if this is a float tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(v) => Some(v),
            Data::I64(_) => None,
        }
    }

    /// The integers, if this is an integer tensor.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            Data::I64(v) => Some(v),
            Data::F32(_) => None,
        }
    }

    /// Entries `start .. start + len` of the leading axis, as a tensor of that many (`None` when
    /// the range runs past the axis or the tensor is a scalar).
    pub fn leading(&self, start: usize, len: usize) -> Option<Tensor> {
        let (&rows, rest) = self.shape.split_first()?;
        if start.checked_add(len)? > rows {
            return None;
        }
        let row: usize = rest.iter().product();
        let range = start * row..(start + len) * row;
        let shape = [len].into_iter().chain(rest.iter().copied()).collect();
        Some(match &self.data {
            Data::F32(x) => Tensor::f32(shape, x.get(range)?.to_vec()),
            Data::I64(x) => Tensor::i64(shape, x.get(range)?.to_vec()),
        })
    }

    /// Elements as floats, converting integers.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            Data::F32(v) => v.clone(),
            Data::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// Largest absolute difference to `other` (infinite if shapes differ or a value is NaN).
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        if self.shape != other.shape {
            return f32::INFINITY;
        }
        self.to_f32_vec()
            .iter()
            .zip(other.to_f32_vec())
            .map(|(a, b)| {
                let d = (a - b).abs();
                if d.is_nan() { f32::INFINITY } else { d }
            })
            .fold(0.0, f32::max)
    }
}

/// A dense, row-major f64 tensor: the parameters and results of the interpreter's f64 reference
/// mode ([`crate::interp::run_f64`]), which checks gradients free of f32 rounding.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor64 {
    /// Extent of each axis.
    pub shape: Vec<usize>,
    /// The elements; `data.len() == shape.iter().product()`.
    pub data: Vec<f64>,
}

impl From<&Tensor> for Tensor64 {
    /// The tensor's elements widened to f64 (integers converted).
    fn from(t: &Tensor) -> Self {
        let data = match &t.data {
            Data::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
        };
        Tensor64 { shape: t.shape.clone(), data }
    }
}
