//! GGUF reading: llama.cpp's single-file checkpoint format, versions 2 and 3, little-endian.
//!
//! A file is a header (magic `GGUF`, version, tensor count, metadata count), typed metadata
//! key/value pairs, one info record per tensor (name, dimensions, element type, offset), padding
//! to a multiple of `general.alignment` (default 32), then the tensor data. The format is
//! specified in ggml's `docs/gguf.md`.
//!
//! [`Gguf::parse`] validates everything up front: every count and length is checked against the
//! bytes that remain before anything is allocated, and every tensor's byte range against the end
//! of the file. Afterwards only element conversion can fail (a type kiln does not dequantize).
//!
//! **Dimension order.** GGUF lists a tensor's dimensions fastest-varying first (ggml's `ne`): a
//! llama.cpp matrix listed as `[n_embd, n_vocab]` is row-major `[n_vocab][n_embd]`.
//! [`TensorInfo::dims`] keeps the file's order; [`TensorInfo::shape`] is kiln's row-major order,
//! the dimensions reversed.
//!
//! **Element types.** F32, F16, BF16 and F64 convert to f32; I8, I16, I32 and I64 to i64; the
//! block quantizations Q4_0, Q4_1, Q5_0, Q8_0 (blocks of 32) and Q4_K, Q6_K (super-blocks of 256)
//! dequantize to f32, with the arithmetic of ggml's reference dequantizers (every product of an
//! f16 scale and small integers is exact in f32, so the results are bit for bit ggml's). Every
//! other type is listed, and its bytes are available through [`Gguf::raw`] when its block size is
//! known, but it is not converted. The block layouts are documented on the [`GgmlType`]
//! constants.

use kiln_compiler::tensor::Tensor;
use std::collections::BTreeMap;
use std::fmt;

/// The alignment of the data section when the file does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// How deeply metadata arrays may nest (arrays of arrays ...). The format allows nesting; the
/// bound keeps a hostile file from exhausting the stack.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// A malformed or unsupported GGUF file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    /// The file does not start with `GGUF`.
    #[error("bad magic \"{}\": a GGUF file starts with \"GGUF\"", .found.escape_ascii())]
    BadMagic {
        /// The first bytes of the file (fewer than four if it is shorter).
        found: Vec<u8>,
    },
    /// A version other than 2 or 3.
    #[error("GGUF version {version} is not supported (kiln reads versions 2 and 3)")]
    UnsupportedVersion {
        /// The version in the header.
        version: u32,
    },
    /// The file ends inside a field.
    #[error("truncated file: {what} at byte {offset} needs {needed} bytes, but the file ends at byte {len}")]
    Truncated {
        /// The field being read.
        what: String,
        /// Where it starts.
        offset: usize,
        /// Its size in bytes.
        needed: u64,
        /// The file's length.
        len: usize,
    },
    /// A count or length that the rest of the file cannot hold, rejected before allocating.
    #[error(
        "{what} at byte {offset} claims {count} items of at least {min_size} bytes each, \
         more than the {remaining} bytes left in the file"
    )]
    TooLarge {
        /// What is counted.
        what: String,
        /// Where the count is stored.
        offset: usize,
        /// The count.
        count: u64,
        /// The smallest encoding of one item, in bytes.
        min_size: u64,
        /// The bytes that follow the count.
        remaining: usize,
    },
    /// A string that is not UTF-8.
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// The string's role.
        what: String,
        /// Where its bytes start.
        offset: usize,
    },
    /// A metadata value type outside the specification.
    #[error("{what} at byte {offset} has unknown value type {type_id}")]
    UnknownValueType {
        /// The value's role.
        what: String,
        /// Where the type is stored.
        offset: usize,
        /// The type id found.
        type_id: u32,
    },
    /// A boolean stored as something other than 0 or 1.
    #[error("{what} at byte {offset} is a bool stored as {byte}, not 0 or 1")]
    InvalidBool {
        /// The value's role.
        what: String,
        /// Where it is stored.
        offset: usize,
        /// The byte found.
        byte: u8,
    },
    /// Arrays nested deeper than [`MAX_ARRAY_DEPTH`].
    #[error("metadata `{key}` nests arrays more than {MAX_ARRAY_DEPTH} deep")]
    NestingTooDeep {
        /// The metadata key.
        key: String,
    },
    /// The same metadata key twice.
    #[error("metadata key `{key}` appears twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// The same tensor name twice.
    #[error("tensor `{name}` appears twice")]
    DuplicateTensor {
        /// The tensor name.
        name: String,
    },
    /// `general.alignment` is not a power-of-two `u32`.
    #[error("`general.alignment` must be a power of two stored as u32, found {found}")]
    BadAlignment {
        /// The value found, as text.
        found: String,
    },
    /// More dimensions than [`MAX_DIMS`].
    #[error("tensor `{tensor}` has {n_dims} dimensions, more than the {MAX_DIMS} GGUF allows")]
    TooManyDims {
        /// The tensor.
        tensor: String,
        /// Its dimension count.
        n_dims: u32,
    },
    /// The product of the dimensions (or the byte size it implies) overflows.
    #[error("tensor `{tensor}`: dimensions {dims:?} overflow the element count")]
    DimsOverflow {
        /// The tensor.
        tensor: String,
        /// Its dimensions, as the file lists them.
        dims: Vec<u64>,
    },
    /// A row length that does not split into whole quantization blocks.
    #[error(
        "tensor `{tensor}` has type {ty}, whose blocks hold {block} elements, but its rows have \
         {row} (dimensions {dims:?})"
    )]
    NotBlockMultiple {
        /// The tensor.
        tensor: String,
        /// Its element type.
        ty: GgmlType,
        /// Elements per block.
        block: u64,
        /// Elements per row (the first dimension).
        row: u64,
        /// Its dimensions, as the file lists them.
        dims: Vec<u64>,
    },
    /// A tensor offset that is not a multiple of the alignment.
    #[error("tensor `{tensor}`: data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        /// The tensor.
        tensor: String,
        /// Its offset in the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// Tensor data that runs past the end of the file.
    #[error(
        "tensor `{tensor}`: {size} bytes at data offset {offset} (file byte {start}) run past the end \
         of the file ({len} bytes)"
    )]
    DataOutOfRange {
        /// The tensor.
        tensor: String,
        /// Its offset in the data section.
        offset: u64,
        /// Where the data section starts in the file.
        start: u64,
        /// Its size in bytes.
        size: u64,
        /// The file's length.
        len: usize,
    },
    /// Tensor data whose length is not that of the tensor's blocks (a tensor of a known type
    /// read from a file always has the right length; this guards every other caller).
    #[error("tensor `{tensor}` of type {ty} and shape {shape:?} needs {expected} bytes of data, but has {found}")]
    DataSize {
        /// The tensor.
        tensor: String,
        /// Its element type.
        ty: GgmlType,
        /// Its row-major shape.
        shape: Vec<usize>,
        /// The bytes its blocks take.
        expected: u64,
        /// The bytes given.
        found: usize,
    },
    /// A tensor type kiln cannot read or convert.
    #[error("tensor `{tensor}` has type {ty}, which kiln cannot {action} (it dequantizes {SUPPORTED})")]
    UnsupportedType {
        /// The tensor.
        tensor: String,
        /// Its element type.
        ty: GgmlType,
        /// `read` (block layout unknown) or `convert`.
        action: &'static str,
    },
}

/// The element types [`Gguf::tensor`] converts, for messages.
const SUPPORTED: &str = "F32, F16, BF16, F64, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K; reads I8, I16, I32, I64";

/// A ggml element type: the numeric id a tensor info stores. Ids the format does not define are
/// kept as they are, so a file can be listed even if one of its tensors cannot be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    /// 32-bit float.
    pub const F32: Self = Self(0);
    /// 16-bit IEEE float.
    pub const F16: Self = Self(1);
    /// Blocks of 32: f16 scale `d`, 16 bytes of nibbles; `x = (q - 8) * d`.
    pub const Q4_0: Self = Self(2);
    /// Blocks of 32: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; `x = q * d + m`.
    pub const Q4_1: Self = Self(3);
    /// Blocks of 32: f16 scale `d`, a little-endian `u32` of fifth bits (bit `j` for element
    /// `j`), then 16 bytes of low nibbles as in Q4_0 (byte `j`: element `j` low, `j + 16` high);
    /// `x = (q - 16) * d` with `q` the 5-bit value.
    pub const Q5_0: Self = Self(6);
    /// Blocks of 32: f16 scale `d`, 32 signed bytes; `x = q * d`.
    pub const Q8_0: Self = Self(8);
    /// Super-blocks of 256 (144 bytes): f16 `d`, f16 `dmin`, 12 bytes packing eight 6-bit
    /// scales and eight 6-bit minimums (one pair per sub-block of 32; see [`q4_k_scale_min`]),
    /// then 128 bytes of nibbles: 32 bytes per 64 elements, sub-block `2c` in the low nibbles of
    /// bytes `32c..32c + 32` and sub-block `2c + 1` in their high nibbles;
    /// `x = (d * scale) * q - dmin * min`.
    pub const Q4_K: Self = Self(12);
    /// Super-blocks of 256 (210 bytes): 128 bytes `ql` of low nibbles, 64 bytes `qh` of high
    /// bit pairs, 16 signed 8-bit scales (one per 16 elements), then f16 `d`. Each half of 128
    /// elements takes 64 bytes of `ql` and 32 of `qh`: its element `32c + l` (`c` in 0..4) has
    /// low bits in nibble `c / 2` of `ql[32 (c % 2) + l]` and high bits `2c..2c + 2` of `qh[l]`;
    /// `x = (d * scale) * (q - 32)` with `q` the 6-bit value.
    pub const Q6_K: Self = Self(14);
    /// 8-bit signed integer.
    pub const I8: Self = Self(24);
    /// 16-bit signed integer.
    pub const I16: Self = Self(25);
    /// 32-bit signed integer.
    pub const I32: Self = Self(26);
    /// 64-bit signed integer.
    pub const I64: Self = Self(27);
    /// 64-bit float.
    pub const F64: Self = Self(28);
    /// bfloat16.
    pub const BF16: Self = Self(30);

    /// The type's name (`Q4_1`, `Q5_K`, ...), or `None` for an id the format does not define.
    pub fn name(self) -> Option<&'static str> {
        TYPES.iter().find(|t| t.0 == self.0).map(|t| t.1)
    }

    /// The type's storage unit, when kiln knows it.
    pub fn block(self) -> Option<Block> {
        TYPES.iter().find(|t| t.0 == self.0).and_then(|t| t.2)
    }
}

/// A type's storage unit: `elements` values in `bytes` bytes. Plain types are blocks of one
/// element; ggml's quantized types store fixed-size blocks along each row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Values per block.
    pub elements: u64,
    /// Bytes per block.
    pub bytes: u64,
}

const fn block(elements: u64, bytes: u64) -> Option<Block> {
    Some(Block { elements, bytes })
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown type {}", self.0),
        }
    }
}

/// Every type id in ggml's `ggml_type` (ids 4, 5, 31-33 and 36-38 were removed), its name and,
/// where kiln knows it, its block. Block sizes are `sizeof(block_...)` in ggml's `ggml-common.h`.
const TYPES: &[(u32, &str, Option<Block>)] = &[
    (0, "F32", block(1, 4)),
    (1, "F16", block(1, 2)),
    (2, "Q4_0", block(32, 18)),
    (3, "Q4_1", block(32, 20)),
    (6, "Q5_0", block(32, 22)),
    (7, "Q5_1", block(32, 24)),
    (8, "Q8_0", block(32, 34)),
    (9, "Q8_1", block(32, 36)),
    (10, "Q2_K", block(256, 84)),
    (11, "Q3_K", block(256, 110)),
    (12, "Q4_K", block(256, 144)),
    (13, "Q5_K", block(256, 176)),
    (14, "Q6_K", block(256, 210)),
    (15, "Q8_K", block(256, 292)),
    (16, "IQ2_XXS", None),
    (17, "IQ2_XS", None),
    (18, "IQ3_XXS", None),
    (19, "IQ1_S", None),
    (20, "IQ4_NL", None),
    (21, "IQ3_S", None),
    (22, "IQ2_S", None),
    (23, "IQ4_XS", None),
    (24, "I8", block(1, 1)),
    (25, "I16", block(1, 2)),
    (26, "I32", block(1, 4)),
    (27, "I64", block(1, 8)),
    (28, "F64", block(1, 8)),
    (29, "IQ1_M", None),
    (30, "BF16", block(1, 2)),
    (34, "TQ1_0", None),
    (35, "TQ2_0", None),
    (39, "MXFP4", None),
];

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// `string` (UTF-8).
    String(String),
    /// `array`, typed by its element type.
    Array(Array),
}

/// A metadata array: one vector per element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    /// `uint8` elements.
    U8(Vec<u8>),
    /// `int8` elements.
    I8(Vec<i8>),
    /// `uint16` elements.
    U16(Vec<u16>),
    /// `int16` elements.
    I16(Vec<i16>),
    /// `uint32` elements.
    U32(Vec<u32>),
    /// `int32` elements.
    I32(Vec<i32>),
    /// `uint64` elements.
    U64(Vec<u64>),
    /// `int64` elements.
    I64(Vec<i64>),
    /// `float32` elements.
    F32(Vec<f32>),
    /// `float64` elements.
    F64(Vec<f64>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// `string` elements.
    String(Vec<String>),
    /// Nested arrays.
    Array(Vec<Array>),
}

impl Value {
    /// Any integer value that is non-negative, widened to `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value, as `i64` when it fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float value (`float32` or `float64`), as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A boolean value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements of a string array.
    pub fn as_str(&self) -> Option<&[String]> {
        match self {
            Array::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of an `int32` array.
    pub fn as_i32(&self) -> Option<&[i32]> {
        match self {
            Array::I32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements of a `float32` array.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Array::F32(v) => Some(v),
            _ => None,
        }
    }
}

/// A metadata value type as the file encodes it (`gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        [U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64].get(usize::try_from(id).ok()?).copied()
    }

    /// The smallest encoding of one value: a fixed-size type's size, a string's length (8), an
    /// array's element type and count (12).
    fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One tensor's record in the file, validated: its byte range lies inside the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    name: String,
    dims: Vec<u64>,
    shape: Vec<usize>,
    ty: GgmlType,
    offset: u64,
    /// File byte range of the data, when the type's block layout is known.
    range: Option<std::ops::Range<usize>>,
}

impl TensorInfo {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dimensions as the file lists them, fastest-varying first (ggml's `ne`).
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// The row-major (kiln) shape: [`dims`](Self::dims) reversed.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of elements, saturating at `usize::MAX` (a tensor whose count overflows is
    /// refused when it is read: see [`Gguf::tensor`]).
    pub fn elements(&self) -> usize {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX)
    }

    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// The data's offset from the start of the data section, as the file stores it.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// A tensor's stored bytes, unconverted (for kernels that dequantize on the fly).
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    /// The tensor's record.
    pub info: &'a TensorInfo,
    /// Its data: whole blocks of [`TensorInfo::ty`], row by row.
    pub bytes: &'a [u8],
}

/// A parsed GGUF file, holding its bytes.
pub struct Gguf {
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    index: BTreeMap<String, usize>,
    bytes: Vec<u8>,
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// Whether `bytes` start like a GGUF file.
pub fn sniff(bytes: &[u8]) -> bool {
    bytes.starts_with(b"GGUF")
}

impl Gguf {
    /// Parses and validates a whole file held in memory.
    pub fn parse(bytes: Vec<u8>) -> Result<Self, GgufError> {
        let mut r = Reader { bytes: &bytes, pos: 0 };
        let magic = r.peek(4);
        if magic != b"GGUF" {
            return Err(GgufError::BadMagic { found: magic.to_vec() });
        }
        r.pos = 4;
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let tensor_count_at = r.pos;
        let tensor_count = r.u64("tensor count")?;
        let kv_count_at = r.pos;
        let kv_count = r.u64("metadata count")?;

        // Smallest encodings: a key/value pair is a key length (8), a value type (4) and at
        // least one byte of value; a tensor info is a name length (8), a dimension count (4), a
        // type (4) and an offset (8). Both lists must fit in what follows the header.
        r.check_count("metadata count", kv_count_at, kv_count, 13)?;
        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key {i}"))?;
            let what = format!("metadata `{key}`");
            let ty = r.value_type(&what)?;
            let value = r.value(&what, &key, ty, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(GgufError::DuplicateKey { key });
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(v) => return Err(GgufError::BadAlignment { found: format!("{v:?}") }),
        };

        r.check_count("tensor count", tensor_count_at, tensor_count, 24)?;
        let mut raw_infos = Vec::new();
        for i in 0..tensor_count {
            let name = r.string(&format!("tensor name {i}"))?;
            let what = format!("tensor `{name}`");
            let n_dims = r.u32(&what)?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::TooManyDims { tensor: name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&what)?);
            }
            let ty = GgmlType(r.u32(&what)?);
            let offset = r.u64(&what)?;
            raw_infos.push((name, dims, ty, offset));
        }
        // `r.pos` is at most the file length, so this cannot overflow.
        let data_start = (r.pos as u64).next_multiple_of(alignment);

        let mut tensors = Vec::with_capacity(raw_infos.len());
        let mut index = BTreeMap::new();
        for (name, dims, ty, offset) in raw_infos {
            let info = validate_tensor(name, dims, ty, offset, alignment, data_start, bytes.len())?;
            if index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { name: info.name });
            }
            tensors.push(info);
        }
        Ok(Gguf { version, alignment, data_start, metadata, tensors, index, bytes })
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Every metadata pair, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A string value (`general.architecture`, `tokenizer.chat_template`, ...).
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// An integer value that fits in `u32` (`tokenizer.ggml.bos_token_id`, ...), whatever
    /// integer type the writer chose.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        u32::try_from(self.get(key)?.as_u64()?).ok()
    }

    /// A non-negative integer value.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// A float value (`float32` or `float64`).
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Option<&Array> {
        self.get(key)?.as_array()
    }

    /// A string array (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    pub fn get_array_str(&self, key: &str) -> Option<&[String]> {
        self.get_array(key)?.as_str()
    }

    /// Every tensor's record, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor's record.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// A tensor's stored bytes and type, or `None` if the file has no such tensor.
    pub fn raw(&self, name: &str) -> Option<Result<RawTensor<'_>, GgufError>> {
        let info = self.info(name)?;
        let Some(range) = info.range.clone() else {
            return Some(Err(unsupported(info, "read")));
        };
        // `parse` checked the range against the file, so `get` always succeeds.
        Some(self.bytes.get(range.clone()).map(|bytes| RawTensor { info, bytes }).ok_or_else(|| {
            GgufError::DataOutOfRange {
                tensor: info.name.clone(),
                offset: info.offset,
                start: self.data_start,
                size: range.len() as u64,
                len: self.bytes.len(),
            }
        }))
    }

    /// A tensor converted to a kiln tensor in row-major shape: floats and quantized blocks to
    /// f32, integers to i64. `None` if the file has no such tensor.
    pub fn tensor(&self, name: &str) -> Option<Result<Tensor, GgufError>> {
        Some(self.raw(name)?.and_then(convert))
    }
}

fn unsupported(info: &TensorInfo, action: &'static str) -> GgufError {
    GgufError::UnsupportedType { tensor: info.name.clone(), ty: info.ty, action }
}

/// Checks one tensor's dimensions and byte range and computes its shape.
fn validate_tensor(
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    offset: u64,
    alignment: u64,
    data_start: u64,
    len: usize,
) -> Result<TensorInfo, GgufError> {
    let overflow = |name: String, dims: Vec<u64>| GgufError::DimsOverflow { tensor: name, dims };
    let Some(elements) = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)) else {
        return Err(overflow(name, dims));
    };
    let mut shape = Vec::with_capacity(dims.len());
    for &d in dims.iter().rev() {
        match usize::try_from(d) {
            Ok(d) => shape.push(d),
            Err(_) => return Err(overflow(name, dims)),
        }
    }
    if usize::try_from(elements).is_err() {
        return Err(overflow(name, dims));
    }
    if !offset.is_multiple_of(alignment) {
        return Err(GgufError::Misaligned { tensor: name, offset, alignment });
    }
    let range = match ty.block() {
        None => None,
        Some(Block { elements: block, bytes: block_bytes }) => {
            // ggml quantizes along rows: the first dimension must be whole blocks.
            let row = dims.first().copied().unwrap_or(1);
            if !row.is_multiple_of(block) {
                return Err(GgufError::NotBlockMultiple { tensor: name, ty, block, row, dims });
            }
            let Some(size) = (elements / block).checked_mul(block_bytes) else {
                return Err(overflow(name, dims));
            };
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(start), Some(end)) if end <= len as u64 => Some(start as usize..end as usize),
                _ => return Err(GgufError::DataOutOfRange { tensor: name, offset, start: data_start, size, len }),
            }
        }
    };
    Ok(TensorInfo { name, dims, shape, ty, offset, range })
}

/// The reference dequantization of `bytes` as a tensor of type `ty` and `shape` (for tests of
/// other readers of the blocks).
#[cfg(test)]
pub(crate) fn dequantize_blocks(ty: GgmlType, shape: Vec<usize>, bytes: &[u8]) -> Result<Tensor, GgufError> {
    let dims = shape.iter().rev().map(|&d| d as u64).collect();
    let info = TensorInfo { name: "test".into(), dims, shape, ty, offset: 0, range: None };
    convert(RawTensor { info: &info, bytes })
}

/// Converts a tensor's bytes: floats and quantized blocks to f32, integers to i64. The bytes
/// must be exactly the tensor's blocks ([`GgufError::DataSize`] otherwise).
fn convert(raw: RawTensor<'_>) -> Result<Tensor, GgufError> {
    let info = raw.info;
    let Some(Block { elements: block, bytes: block_bytes }) = info.ty.block() else {
        return Err(unsupported(info, "read"));
    };
    let size = (info.elements() as u64 / block.max(1)).checked_mul(block_bytes);
    if !(info.elements() as u64).is_multiple_of(block.max(1)) || size != Some(raw.bytes.len() as u64) {
        return Err(GgufError::DataSize {
            tensor: info.name.clone(),
            ty: info.ty,
            shape: info.shape.clone(),
            expected: size.unwrap_or(u64::MAX),
            found: raw.bytes.len(),
        });
    }
    let shape = info.shape.clone();
    let b = raw.bytes;
    let f16 = |lo: u8, hi: u8| half::f16::from_le_bytes([lo, hi]).to_f32();
    let mut out = Vec::with_capacity(info.elements());
    match info.ty {
        GgmlType::F32 => out.extend(b.as_chunks().0.iter().map(|&c| f32::from_le_bytes(c))),
        GgmlType::F16 => out.extend(b.as_chunks().0.iter().map(|&[lo, hi]| f16(lo, hi))),
        GgmlType::BF16 => out.extend(b.as_chunks().0.iter().map(|&c| half::bf16::from_le_bytes(c).to_f32())),
        GgmlType::F64 => out.extend(b.as_chunks().0.iter().map(|&c| f64::from_le_bytes(c) as f32)),
        GgmlType::Q8_0 => {
            for [lo, hi, qs @ ..] in b.as_chunks::<34>().0 {
                let d = f16(*lo, *hi);
                out.extend(qs.iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        GgmlType::Q4_0 => {
            // Byte j holds element j in its low nibble and element j + 16 in its high nibble.
            for [lo, hi, qs @ ..] in b.as_chunks::<18>().0 {
                let d = f16(*lo, *hi);
                out.extend(qs.iter().map(|&q| f32::from(i16::from(q & 0x0f) - 8) * d));
                out.extend(qs.iter().map(|&q| f32::from(i16::from(q >> 4) - 8) * d));
            }
        }
        GgmlType::Q4_1 => {
            for [d_lo, d_hi, m_lo, m_hi, qs @ ..] in b.as_chunks::<20>().0 {
                let (d, m) = (f16(*d_lo, *d_hi), f16(*m_lo, *m_hi));
                out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
            }
        }
        GgmlType::Q5_0 => {
            for [lo, hi, h0, h1, h2, h3, qs @ ..] in b.as_chunks::<22>().0 {
                let d = f16(*lo, *hi);
                let qh = u32::from_le_bytes([*h0, *h1, *h2, *h3]);
                // Element j's fifth bit is bit j of `qh`.
                let x = |nibble: u8, j: usize| f32::from(i16::from(nibble) + 16 * ((qh >> j) & 1) as i16 - 16) * d;
                out.extend(qs.iter().enumerate().map(|(j, &q)| x(q & 0x0f, j)));
                out.extend(qs.iter().enumerate().map(|(j, &q)| x(q >> 4, j + 16)));
            }
        }
        GgmlType::Q4_K => {
            for [d_lo, d_hi, m_lo, m_hi, rest @ ..] in b.as_chunks::<144>().0 {
                let (d, dmin) = (f16(*d_lo, *d_hi), f16(*m_lo, *m_hi));
                let (scales, qs) = rest.split_first_chunk::<12>().unwrap_or((&[0; 12], &[]));
                // 32 bytes per pair of sub-blocks: the low nibbles, then the high ones.
                for (c, bytes) in qs.chunks_exact(32).enumerate() {
                    for (s, shift) in [(2 * c, 0), (2 * c + 1, 4)] {
                        let (scale, min) = q4_k_scale_min(scales, s);
                        let (ds, dm) = (d * f32::from(scale), dmin * f32::from(min));
                        out.extend(bytes.iter().map(|&q| f32::from((q >> shift) & 0x0f) * ds - dm));
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            for block in b.as_chunks::<210>().0 {
                let (ql, rest) = block.split_at_checked(128).unwrap_or_default();
                let (qh, rest) = rest.split_at_checked(64).unwrap_or_default();
                let (scales, d) = rest.split_at_checked(16).unwrap_or_default();
                let d = match d {
                    &[lo, hi] => f16(lo, hi),
                    _ => 0.0,
                };
                // Two halves of 128 elements, each of 64 bytes of `ql`, 32 of `qh`, 8 scales.
                for ((ql, qh), scales) in ql.chunks_exact(64).zip(qh.chunks_exact(32)).zip(scales.chunks_exact(8)) {
                    for c in 0..4 {
                        let low = ql.get(32 * (c % 2)..).unwrap_or_default();
                        for (l, (&lo, &hi)) in low.iter().zip(qh).enumerate() {
                            let q = ((lo >> (4 * (c / 2))) & 0x0f) | (((hi >> (2 * c)) & 3) << 4);
                            let scale = scales.get(2 * c + l / 16).map_or(0, |&s| s as i8);
                            out.push(d * f32::from(scale) * f32::from(i16::from(q) - 32));
                        }
                    }
                }
            }
        }
        GgmlType::I8 => return Ok(Tensor::i64(shape, b.iter().map(|&v| i64::from(v as i8)).collect())),
        GgmlType::I16 => {
            return Ok(Tensor::i64(shape, b.as_chunks().0.iter().map(|&c| i64::from(i16::from_le_bytes(c))).collect()));
        }
        GgmlType::I32 => {
            return Ok(Tensor::i64(shape, b.as_chunks().0.iter().map(|&c| i64::from(i32::from_le_bytes(c))).collect()));
        }
        GgmlType::I64 => {
            return Ok(Tensor::i64(shape, b.as_chunks().0.iter().map(|&c| i64::from_le_bytes(c)).collect()));
        }
        _ => return Err(unsupported(info, "convert")),
    }
    Ok(Tensor::f32(shape, out))
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K super-block, from its 12 packed
/// bytes: for `j < 4`, the low 6 bits of bytes `j` (scale) and `j + 4` (minimum); for `j >= 4`,
/// the low (scale) and high (minimum) nibbles of byte `j + 4`, with bits 4-5 the top two bits of
/// bytes `j - 4` (scale) and `j` (minimum). `(0, 0)` for `j >= 8`.
pub fn q4_k_scale_min(scales: &[u8; 12], j: usize) -> (u8, u8) {
    let byte = |i: usize| scales.get(i).copied().unwrap_or(0);
    match j {
        0..4 => (byte(j) & 63, byte(j + 4) & 63),
        4..8 => ((byte(j + 4) & 0x0f) | ((byte(j - 4) >> 6) << 4), (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4)),
        _ => (0, 0),
    }
}

/// A cursor over the file's bytes whose reads report what they were reading and where.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Up to `n` bytes at the cursor, without moving it.
    fn peek(&self, n: usize) -> &'a [u8] {
        let end = self.pos.saturating_add(n).min(self.bytes.len());
        self.bytes.get(self.pos..end).unwrap_or_default()
    }

    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// The error for a read of `n` bytes of `what` at the cursor that runs past the end.
    fn truncated(&self, what: &str, n: u64) -> GgufError {
        GgufError::Truncated { what: what.to_string(), offset: self.pos, needed: n, len: self.bytes.len() }
    }

    /// The next `n` bytes, or a `Truncated` error naming `what`.
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let truncated = || self.truncated(what, n);
        let n = usize::try_from(n).map_err(|_| truncated())?;
        let end = self.pos.checked_add(n).ok_or_else(truncated)?;
        let slice = self.bytes.get(self.pos..end).ok_or_else(truncated)?;
        self.pos = end;
        Ok(slice)
    }

    /// The next `N` bytes, or a `Truncated` error naming `what`.
    fn fixed<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        match self.peek(N).first_chunk() {
            Some(&chunk) => {
                self.pos += N;
                Ok(chunk)
            }
            None => Err(self.truncated(what, N as u64)),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.fixed(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.fixed(what)?))
    }

    /// Rejects a count of items of at least `min_size` bytes each that the rest of the file
    /// cannot hold. `count_at` is where the count is stored, for the message.
    fn check_count(&self, what: &str, count_at: usize, count: u64, min_size: u64) -> Result<(), GgufError> {
        let fits = count.checked_mul(min_size).is_some_and(|need| need <= self.remaining() as u64);
        if fits {
            Ok(())
        } else {
            Err(GgufError::TooLarge {
                what: what.to_string(),
                offset: count_at,
                count,
                min_size,
                remaining: self.remaining(),
            })
        }
    }

    /// A length-prefixed UTF-8 string.
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { what: what.to_string(), offset: start })
    }

    /// A value type id.
    fn value_type(&mut self, what: &str) -> Result<ValueType, GgufError> {
        let offset = self.pos;
        let type_id = self.u32(what)?;
        ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            what: what.to_string(),
            offset,
            type_id,
        })
    }

    /// A value of type `ty`; `depth` counts enclosing arrays.
    fn value(&mut self, what: &str, key: &str, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.fixed(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.fixed(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.fixed(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.fixed(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.fixed(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.fixed(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.fixed(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array(what, key, depth + 1)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.fixed(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.fixed(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.fixed(what)?)),
        })
    }

    fn bool(&mut self, what: &str) -> Result<bool, GgufError> {
        let at = self.pos;
        match self.fixed::<1>(what)? {
            [0] => Ok(false),
            [1] => Ok(true),
            [byte] => Err(GgufError::InvalidBool { what: what.to_string(), offset: at, byte }),
        }
    }

    /// An array body: element type, count, elements. `depth` is this array's nesting level.
    fn array(&mut self, what: &str, key: &str, depth: usize) -> Result<Array, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep { key: key.to_string() });
        }
        let elem = self.value_type(what)?;
        let count_at = self.pos;
        let count = self.u64(what)?;
        let min_size = elem.min_size();
        self.check_count(what, count_at, count, min_size)?;
        // `check_count` bounded `count * min_size` by the file length, so it fits in usize.
        let n = count as usize;
        // Fixed-size elements: `min_size` is their size.
        macro_rules! numbers {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(count * min_size, what)?;
                // `min_size` is the element's size, so the chunks are exactly the elements.
                Array::$variant(bytes.as_chunks().0.iter().map(|&c| <$t>::from_le_bytes(c)).collect())
            }};
        }
        Ok(match elem {
            ValueType::U8 => numbers!(U8, u8),
            ValueType::I8 => numbers!(I8, i8),
            ValueType::U16 => numbers!(U16, u16),
            ValueType::I16 => numbers!(I16, i16),
            ValueType::U32 => numbers!(U32, u32),
            ValueType::I32 => numbers!(I32, i32),
            ValueType::F32 => numbers!(F32, f32),
            ValueType::U64 => numbers!(U64, u64),
            ValueType::I64 => numbers!(I64, i64),
            ValueType::F64 => numbers!(F64, f64),
            ValueType::Bool => Array::Bool((0..n).map(|_| self.bool(what)).collect::<Result<_, _>>()?),
            ValueType::String => Array::String((0..n).map(|_| self.string(what)).collect::<Result<_, _>>()?),
            ValueType::Array => {
                Array::Array((0..n).map(|_| self.array(what, key, depth + 1)).collect::<Result<_, _>>()?)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_type_has_a_unique_id_and_name() {
        for (i, a) in TYPES.iter().enumerate() {
            for b in &TYPES[i + 1..] {
                assert!(a.0 != b.0 && a.1 != b.1, "{a:?} / {b:?}");
            }
        }
        assert_eq!(GgmlType::Q4_1.to_string(), "Q4_1");
        assert_eq!(GgmlType(13).to_string(), "Q5_K");
        assert_eq!(GgmlType(99).to_string(), "unknown type 99");
    }
}
