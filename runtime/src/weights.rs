//! Checkpoint loading: safetensors or GGUF files -> graph parameters, through the spec's weight
//! map.
//!
//! For every parameter of the graph the weight map names a checkpoint tensor; the tensor is
//! converted to f32, transposed if stored `[in, out]`, cut out of a packed tensor if it is one part
//! of one, put back in rotate-half row order if it comes from llama.cpp, and checked against the
//! shape the graph expects. Every failure names the parameter, the tensor and what was expected.

use crate::gguf::{self, Gguf, GgufError};
use crate::progress::{Counter, Phase, Progress};
use crate::quant::QuantWeight;
use kiln_compiler::graph::Graph;
use kiln_compiler::memory;
use kiln_compiler::spec::{Pack, PackDims, PackPart, Resolved, Source, WeightMap};
use kiln_compiler::tensor::Tensor;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// An error loading weights or tensors from a file.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The file could not be read. (The cause is part of the message, not an error `source`, so
    /// error chains do not print it twice.)
    #[error("cannot read `{path}`: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// The file is not a valid safetensors file.
    #[error("`{path}` is not a valid safetensors file: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The file is text — a spec, most likely — where a checkpoint was expected.
    #[error("`{path}` is {what}, not a checkpoint: weights are a safetensors or GGUF file")]
    Text {
        /// The file.
        path: PathBuf,
        /// What it looks like: `a kiln spec (TOML)`, `a text file`.
        what: &'static str,
    },
    /// The file is not a valid GGUF file, or holds a tensor kiln cannot convert. (The cause is
    /// part of the message, not an error `source`, so error chains do not print it twice.)
    #[error("`{path}`: {error}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        error: GgufError,
    },
    /// A tensor the weight map names is not in the file.
    #[error("tensor `{tensor}` (for parameter `{param}`) is not in `{path}`{}", nearest_hint(.nearest))]
    MissingTensor {
        /// The graph parameter.
        param: String,
        /// The tensor name looked for.
        tensor: String,
        /// The file.
        path: PathBuf,
        /// The closest names in the file.
        nearest: Vec<String>,
    },
    /// The tensor's shape does not give the parameter's shape.
    #[error("tensor `{tensor}` (for parameter `{param}`): expected shape {expected:?}{how}, found {found:?}")]
    Shape {
        /// The graph parameter.
        param: String,
        /// The checkpoint tensor.
        tensor: String,
        /// The shape the graph needs (or the packed shape implied by it).
        expected: Vec<usize>,
        /// What the file holds.
        found: Vec<usize>,
        /// How the tensor is read (` after transpose`, ...), for the message.
        how: String,
    },
    /// The tensor's element type cannot be converted to f32.
    #[error("tensor `{tensor}` has dtype {dtype}, expected a float type (F32, F16, BF16, F64)")]
    DType {
        /// The checkpoint tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// A quantized tensor's blocks do not fit its shape (or its type cannot stay quantized).
    #[error("tensor `{tensor}` (for parameter `{param}`) cannot stay quantized on the device: {message}")]
    Quantized {
        /// The graph parameter.
        param: String,
        /// The checkpoint tensor.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor, or the file, would not fit in memory.
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    /// A file could not be written.
    #[error("cannot write `{path}`: {error}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// The tensor holds NaN or infinite values.
    #[error("tensor `{tensor}` holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        /// The checkpoint tensor.
        tensor: String,
        /// The first bad element.
        index: usize,
        /// Its value.
        value: f32,
    },
}

fn nearest_hint(nearest: &[String]) -> String {
    if nearest.is_empty() { String::new() } else { format!("; nearest names in the file: {}", nearest.join(", ")) }
}

/// A checkpoint read into memory: a safetensors or a GGUF file.
pub struct Checkpoint {
    path: PathBuf,
    format: Format,
}

enum Format {
    /// The file's bytes, whose header was validated in `open`.
    Safetensors(Vec<u8>),
    Gguf(Gguf),
}

/// What a file that is no checkpoint looks like when it is text (its first 4 KiB UTF-8, with no
/// NUL): `a kiln spec (TOML)` when a line opens its `[model]` table, else `a text file`. `None`
/// for binary bytes.
pub fn text_kind(bytes: &[u8]) -> Option<&'static str> {
    let head = bytes.get(..bytes.len().min(4096)).unwrap_or_default();
    let text = match std::str::from_utf8(head) {
        Ok(text) => text,
        // A multi-byte character cut at the 4 KiB mark.
        Err(e) if e.error_len().is_none() => std::str::from_utf8(head.get(..e.valid_up_to())?).ok()?,
        Err(_) => return None,
    };
    if text.is_empty() || text.contains('\0') {
        return None;
    }
    Some(match text.lines().any(|l| l.trim() == "[model]") {
        true => "a kiln spec (TOML)",
        false => "a text file",
    })
}

impl Checkpoint {
    /// Reads the file and validates its header. A file that starts with `GGUF` or is named
    /// `*.gguf` is read as GGUF, any other as safetensors.
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let size = std::fs::metadata(path).map_err(|error| WeightError::Io { path: path.into(), error })?.len();
        memory::check(|| format!("reading `{}`", path.display()), size)?;
        let bytes = std::fs::read(path).map_err(|error| WeightError::Io { path: path.into(), error })?;
        Self::from_bytes(path, bytes)
    }

    /// [`Checkpoint::open`] on a file's bytes already read; `path` names it in errors (and a
    /// `.gguf` extension selects GGUF as in `open`).
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, WeightError> {
        let is_gguf = gguf::sniff(&bytes) || path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let format = if is_gguf {
            Format::Gguf(Gguf::parse(bytes).map_err(|error| WeightError::Gguf { path: path.into(), error })?)
        } else {
            if let Err(e) = SafeTensors::deserialize(&bytes) {
                return Err(match text_kind(&bytes) {
                    Some(what) => WeightError::Text { path: path.into(), what },
                    None => WeightError::Format { path: path.into(), message: e.to_string() },
                });
            }
            Format::Safetensors(bytes)
        };
        Ok(Checkpoint { path: path.into(), format })
    }

    #[expect(clippy::expect_used, reason = "`from_bytes` validated these bytes, which never change after")]
    fn safetensors(bytes: &[u8]) -> SafeTensors<'_> {
        SafeTensors::deserialize(bytes).expect("validated in open")
    }

    /// The parsed GGUF file (metadata, tokenizer, raw quantized tensors), if this is one.
    pub fn gguf(&self) -> Option<&Gguf> {
        match &self.format {
            Format::Gguf(g) => Some(g),
            Format::Safetensors(_) => None,
        }
    }

    /// Names of every tensor in the file, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = match &self.format {
            Format::Safetensors(bytes) => Self::safetensors(bytes).names().into_iter().map(str::to_string).collect(),
            Format::Gguf(g) => g.tensors().iter().map(|t| t.name().to_string()).collect(),
        };
        names.sort();
        names
    }

    /// A tensor converted to f32 (floats, dequantized blocks) or i64 (integers and booleans), in
    /// row-major shape.
    pub fn get(&self, name: &str) -> Option<Result<Tensor, WeightError>> {
        match &self.format {
            Format::Safetensors(bytes) => {
                let st = Self::safetensors(bytes);
                let view = st.tensor(name).ok()?;
                let converted = fits_as_f32(name, view.shape())
                    .and_then(|()| convert(name, view.dtype(), view.shape(), view.data()));
                Some(converted)
            }
            Format::Gguf(g) => {
                if let Err(e) = fits_as_f32(name, g.info(name)?.shape()) {
                    return Some(Err(e));
                }
                Some(g.tensor(name)?.map_err(|error| WeightError::Gguf { path: self.path.clone(), error }))
            }
        }
    }

    /// Every tensor of the file, converted.
    pub fn all(&self) -> Result<HashMap<String, Tensor>, WeightError> {
        self.names().into_iter().filter_map(|n| Some(self.get(&n)?.map(|t| (n, t)))).collect()
    }

    /// The checkpoint's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Whether tensor `name` of `shape` fits in memory as f32 ([`memory::check`]), before it is
/// converted. Counted wide: a GGUF tensor's dimensions are checked against the file only when it
/// is read, so their product may not fit a `usize` yet.
fn fits_as_f32(name: &str, shape: &[usize]) -> Result<(), WeightError> {
    let elements = shape.iter().fold(1u128, |n, &d| n.saturating_mul(d as u128));
    Ok(memory::check(|| format!("tensor `{name}` as f32"), memory::f32_bytes(elements))?)
}

fn convert(name: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<Tensor, WeightError> {
    let shape = shape.to_vec();
    macro_rules! ints {
        ($t:ty) => {
            Tensor::i64(shape, data.as_chunks().0.iter().map(|&c| <$t>::from_le_bytes(c) as i64).collect())
        };
    }
    Ok(match dtype {
        Dtype::F32 => Tensor::f32(shape, data.as_chunks().0.iter().map(|&c| f32::from_le_bytes(c)).collect()),
        Dtype::F64 => {
            Tensor::f32(shape, data.as_chunks::<8>().0.iter().map(|&c| f64::from_le_bytes(c) as f32).collect())
        }
        Dtype::F16 => {
            Tensor::f32(shape, data.as_chunks().0.iter().map(|&c| half::f16::from_le_bytes(c).to_f32()).collect())
        }
        Dtype::BF16 => {
            Tensor::f32(shape, data.as_chunks().0.iter().map(|&c| half::bf16::from_le_bytes(c).to_f32()).collect())
        }
        Dtype::I64 => ints!(i64),
        Dtype::I32 => ints!(i32),
        Dtype::I16 => ints!(i16),
        Dtype::I8 => ints!(i8),
        Dtype::U8 | Dtype::BOOL => Tensor::i64(shape, data.iter().map(|&b| b as i64).collect()),
        Dtype::U16 => ints!(u16),
        Dtype::U32 => ints!(u32),
        other => return Err(WeightError::DType { tensor: name.into(), dtype: format!("{other:?}") }),
    })
}

/// Loads every parameter of `graph` from the checkpoint at `path`.
pub fn load_params(spec: &Resolved, graph: &Graph, path: &Path) -> Result<HashMap<String, Tensor>, WeightError> {
    let ckpt = Checkpoint::open(path)?;
    load_named(&spec.weights, &PackDims::of(spec), &graph_params(graph), &ckpt)
}

/// Parameters as f32 by name, and the blocks of those kept quantized.
pub type ParamsAndBlocks = (HashMap<String, Tensor>, HashMap<String, QuantWeight>);

/// [`load_params`], and the quantized blocks (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K) of every 2-D parameter a GGUF checkpoint stores in
/// one of those types (see [`quantized_named`]), from one reading of the file.
pub fn load_params_with_blocks(spec: &Resolved, graph: &Graph, path: &Path) -> Result<ParamsAndBlocks, WeightError> {
    let ckpt = Checkpoint::open(path)?;
    let (dims, params) = (PackDims::of(spec), graph_params(graph));
    Ok((load_named(&spec.weights, &dims, &params, &ckpt)?, quantized_named(&spec.weights, &dims, &params, &ckpt)?))
}

/// The blocks of the named 2-D parameters whose GGUF tensor has one of the types kept quantized
/// (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K) and
/// is read untransposed, with the weight map's row operations (unpacking, RoPE row order) applied
/// to whole rows; other parameters (and every parameter of a safetensors file) are left out.
/// [`load_named`] gives the same parameters as f32 (their exact dequantization) and reports the
/// missing or misshapen ones; a tensor whose blocks do not fit its shape is an error here.
pub fn quantized_named(
    map: &WeightMap,
    dims: &PackDims,
    params: &[(String, Vec<usize>)],
    ckpt: &Checkpoint,
) -> Result<HashMap<String, QuantWeight>, WeightError> {
    quantized_named_with_progress(map, dims, params, ckpt, &())
}

/// [`quantized_named`], reporting each parameter looked at to `progress` ([`Phase::Repack`];
/// nothing for a safetensors file).
pub fn quantized_named_with_progress(
    map: &WeightMap,
    dims: &PackDims,
    params: &[(String, Vec<usize>)],
    ckpt: &Checkpoint,
    progress: &dyn Progress,
) -> Result<HashMap<String, QuantWeight>, WeightError> {
    let mut out = HashMap::new();
    let Some(gguf) = ckpt.gguf() else { return Ok(out) };
    let mut counter = Counter::start(progress, Phase::Repack, params.len());
    for (name, expected) in params {
        if let Some(q) = quantized_one(dims, ckpt, gguf, map, name, expected)? {
            out.insert(name.clone(), q);
        }
        counter.advance();
    }
    Ok(out)
}

/// The blocks of one parameter, if its GGUF tensor keeps them (see [`quantized_named`]).
fn quantized_one(
    dims: &PackDims,
    ckpt: &Checkpoint,
    gguf: &Gguf,
    map: &WeightMap,
    name: &str,
    expected: &[usize],
) -> Result<Option<QuantWeight>, WeightError> {
    let source = match map.resolve(name) {
        Some(r) => Source { tensor: r.tensor, ..r.source },
        None => Source::named(name),
    };
    let Some(info) = gguf.info(&source.tensor) else { return Ok(None) };
    let ty = info.ty();
    if expected.len() != 2 || source.transpose || QuantWeight::format_of(ty).is_none() {
        return Ok(None);
    }
    let error = |message: String| WeightError::Quantized { param: name.into(), tensor: source.tensor.clone(), message };
    let &[rows, k] = info.shape() else {
        return Err(error(format!("a {}-D tensor is not a matrix of rows of blocks", info.shape().len())));
    };
    let raw = match gguf.raw(&source.tensor) {
        Some(Ok(raw)) => raw,
        Some(Err(e)) => return Err(WeightError::Gguf { path: ckpt.path().into(), error: e }),
        None => return Ok(None),
    };
    let q = QuantWeight::from_blocks(ty, rows, k, raw.bytes).map_err(error)?;
    // The weight map's row operations, applied to row indices (exact in f32 below 2^24 rows).
    let mut order = Tensor::f32(vec![rows, 1], (0..rows).map(|r| r as f32).collect());
    if let (Some(pack), Some(part)) = (source.pack, source.part) {
        let Ok(t) = unpack(dims, &order, pack, part) else { return Ok(None) };
        order = t;
    }
    if source.rope_unpermute {
        let Some(t) = unpermute_rope(&order, dims.head_dim) else { return Ok(None) };
        order = t;
    }
    let order: Vec<usize> = order.as_f32().unwrap_or(&[]).iter().map(|&r| r as usize).collect();
    let Some(q) = q.take_rows(&order) else { return Ok(None) };
    Ok(([q.rows, q.k] == expected[..]).then_some(q))
}

/// The parameters of a graph with their shapes.
pub fn graph_params(graph: &Graph) -> Vec<(String, Vec<usize>)> {
    graph
        .params()
        .into_iter()
        .map(|(node, name)| {
            let shape = graph.g[node]
                .shape
                .iter()
                .map(|d| match d {
                    kiln_compiler::graph::Dim::Fixed(k) => *k,
                    kiln_compiler::graph::Dim::Sym(_) => 0,
                })
                .collect();
            (name.to_string(), shape)
        })
        .collect()
}

/// Loads the named parameters (with the shapes the model needs) through a weight map. An empty
/// map looks parameters up under their canonical names.
pub fn load_named(
    map: &WeightMap,
    dims: &PackDims,
    params: &[(String, Vec<usize>)],
    ckpt: &Checkpoint,
) -> Result<HashMap<String, Tensor>, WeightError> {
    load_named_with_progress(map, dims, params, ckpt, &())
}

/// [`load_named`], reporting each parameter read to `progress` ([`Phase::Read`]).
pub fn load_named_with_progress(
    map: &WeightMap,
    dims: &PackDims,
    params: &[(String, Vec<usize>)],
    ckpt: &Checkpoint,
    progress: &dyn Progress,
) -> Result<HashMap<String, Tensor>, WeightError> {
    let mut out = HashMap::new();
    let mut counter = Counter::start(progress, Phase::Read, params.len());
    for (name, expected) in params {
        let source = match map.resolve(name) {
            Some(r) => Source { tensor: r.tensor, ..r.source },
            None => Source::named(name),
        };
        let t = load_one(dims, ckpt, name, &source, expected)?;
        out.insert(name.clone(), t);
        counter.advance();
    }
    Ok(out)
}

fn load_one(
    dims: &PackDims,
    ckpt: &Checkpoint,
    param: &str,
    source: &Source,
    expected: &[usize],
) -> Result<Tensor, WeightError> {
    let tensor_name = &source.tensor;
    let raw = match ckpt.get(tensor_name) {
        Some(t) => t?,
        None => {
            let names = ckpt.names();
            let mut scored: Vec<(usize, &String)> =
                names.iter().map(|n| (strsim::levenshtein(n, tensor_name), n)).collect();
            scored.sort();
            return Err(WeightError::MissingTensor {
                param: param.into(),
                tensor: tensor_name.clone(),
                path: ckpt.path().into(),
                nearest: scored.into_iter().take(3).map(|(_, n)| n.clone()).collect(),
            });
        }
    };
    let Some(values) = raw.as_f32() else {
        return Err(WeightError::DType { tensor: tensor_name.clone(), dtype: "integer".into() });
    };
    if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(WeightError::NonFinite { tensor: tensor_name.clone(), index, value });
    }
    // Shape errors report the graph's shape ([out, in] for projections) against the file's, with
    // how the file's tensor is read.
    let mut how: Vec<String> = Vec::new();
    if source.transpose {
        how.push("stored transposed, [in, out]".into());
    }
    if let (Some(pack), Some(part)) = (source.pack, source.part) {
        how.push(format!("part {part:?} of a {pack:?} pack"));
    }
    let shape_error = |found: Vec<usize>, extra: Option<String>| {
        let mut notes = how.clone();
        notes.extend(extra);
        WeightError::Shape {
            param: param.into(),
            tensor: tensor_name.clone(),
            expected: expected.to_vec(),
            found,
            how: if notes.is_empty() { String::new() } else { format!(" ({})", notes.join("; ")) },
        }
    };
    let mut t = raw.clone();
    if source.transpose {
        let &[r, c] = t.shape.as_slice() else {
            return Err(shape_error(raw.shape.clone(), None));
        };
        t = transpose(r, c, values);
    }
    if let (Some(pack), Some(part)) = (source.pack, source.part) {
        t = unpack(dims, &t, pack, part).map_err(|note| shape_error(raw.shape.clone(), Some(note)))?;
    }
    if source.rope_unpermute {
        t = unpermute_rope(&t, dims.head_dim)
            .ok_or_else(|| shape_error(raw.shape.clone(), Some("rows must be a multiple of head_dim".into())))?;
    }
    if t.shape != expected {
        return Err(shape_error(raw.shape.clone(), None));
    }
    Ok(t)
}

/// The `[c, r]` transpose of an `[r, c]` matrix (`x`, row-major).
fn transpose(r: usize, c: usize, x: &[f32]) -> Tensor {
    // Column j of `x` is every c-th element from j: row j of the transpose.
    let out = (0..c).flat_map(|j| x.iter().skip(j).step_by(c).take(r)).copied().collect();
    Tensor::f32(vec![c, r], out)
}

/// Cuts one part out of a packed tensor (rows of a 2-D tensor, or elements of a bias). On a size
/// mismatch returns a note with the row count the spec implies and a description of the packing.
fn unpack(dims: &PackDims, t: &Tensor, pack: Pack, part: PackPart) -> Result<Tensor, String> {
    let hd = dims.head_dim;
    let (q, kv) = (dims.heads * hd, dims.kv_heads * hd);
    let ff = dims.d_ff;
    let mismatch = |total: usize, what: &str| format!("the pack should have {total} rows {what}");
    let Some((&rows, row_shape)) = t.shape.split_first() else {
        return Err("a scalar is not a pack of rows".into());
    };
    let width: usize = row_shape.iter().product();
    let Some(x) = t.as_f32() else { return Err(mismatch(rows, "as floats")) };
    // The rows of each `(start, len)` range, or `None` if one runs past the tensor.
    let take = |ranges: &[(usize, usize)]| {
        let mut out = Vec::new();
        let mut n = 0;
        for &(start, len) in ranges {
            out.extend_from_slice(x.get(start * width..(start + len) * width)?);
            n += len;
        }
        let shape = [n].iter().chain(row_shape).copied().collect();
        Some(Tensor::f32(shape, out))
    };
    let blocks = |sizes: &[usize], index: usize, what: &str| {
        let total: usize = sizes.iter().sum();
        let (Some(before), Some(&len)) = (sizes.get(..index), sizes.get(index)) else {
            return Err(mismatch(total, what));
        };
        if rows != total {
            return Err(mismatch(total, what));
        }
        take(&[(before.iter().sum(), len)]).ok_or_else(|| mismatch(total, what))
    };
    match (pack, part) {
        (Pack::QkvBlocks, p @ (PackPart::Q | PackPart::K | PackPart::V)) => {
            let index = [PackPart::Q, PackPart::K, PackPart::V].iter().position(|&x| x == p).unwrap_or(0);
            blocks(&[q, kv, kv], index, "as Q, K, V blocks")
        }
        (Pack::QkvPerHead, p @ (PackPart::Q | PackPart::K | PackPart::V)) => {
            let heads = dims.heads;
            let what = "per head as [head][q|k|v][head_dim]";
            if rows != 3 * heads * hd {
                return Err(mismatch(3 * heads * hd, what));
            }
            let index = [PackPart::Q, PackPart::K, PackPart::V].iter().position(|&x| x == p).unwrap_or(0);
            let ranges: Vec<(usize, usize)> = (0..heads).map(|h| (h * 3 * hd + index * hd, hd)).collect();
            take(&ranges).ok_or_else(|| mismatch(3 * heads * hd, what))
        }
        (Pack::GateUpBlocks, PackPart::Gate) => blocks(&[ff, ff], 0, "as gate, up blocks"),
        (Pack::GateUpBlocks, PackPart::Up) => blocks(&[ff, ff], 1, "as gate, up blocks"),
        (pack, part) => Err(mismatch(rows, &format!("{pack:?} has no part {part:?}"))),
    }
}

/// llama.cpp stores Q/K rows of each head as interleaved pairs; HF's rotate-half layout wants the
/// even rows of a head first, then the odd ones: `hf[h, j * hd/2 + i] = gguf[h, 2i + j]`.
fn unpermute_rope(t: &Tensor, hd: usize) -> Option<Tensor> {
    let (&rows, row_shape) = t.shape.split_first()?;
    if hd == 0 || !hd.is_multiple_of(2) || !rows.is_multiple_of(hd) {
        return None;
    }
    let width: usize = row_shape.iter().product();
    let x = t.as_f32()?;
    let mut out = Vec::with_capacity(x.len());
    let half = hd / 2;
    // Destination rows in order: head h's row j * half + i is source row 2i + j.
    for h in 0..rows / hd {
        for j in 0..2 {
            for i in 0..half {
                let src = h * hd + 2 * i + j;
                out.extend_from_slice(x.get(src * width..(src + 1) * width)?);
            }
        }
    }
    Some(Tensor::f32(t.shape.clone(), out))
}

/// Reads every tensor of a safetensors (or GGUF) file (inputs for `kiln run`).
pub fn read_tensors(path: &Path) -> Result<HashMap<String, Tensor>, WeightError> {
    Checkpoint::open(path)?.all()
}

/// Writes f32/i64 tensors to a safetensors file, atomically ([`kiln_compiler::file::write_atomic`]).
pub fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), WeightError> {
    let io = |error| WeightError::Write { path: path.into(), error };
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| match &t.data {
            kiln_compiler::tensor::Data::F32(v) => {
                (name.clone(), Dtype::F32, t.shape.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            kiln_compiler::tensor::Data::I64(v) => {
                (name.clone(), Dtype::I64, t.shape.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map_err(|e| WeightError::Format { path: path.into(), message: format!("tensor `{n}`: {e}") })?;
            Ok((n.clone(), view))
        })
        .collect::<Result<_, WeightError>>()?;
    let data = safetensors::serialize(views, None)
        .map_err(|e| WeightError::Format { path: path.into(), message: e.to_string() })?;
    kiln_compiler::file::write_atomic(path, &data).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        // One head of 4 rows: HF order r0 r1 r2 r3 is stored by llama.cpp as r0 r2 r1 r3.
        let gguf = Tensor::f32(vec![4, 1], vec![0.0, 2.0, 1.0, 3.0]);
        let hf = unpermute_rope(&gguf, 4).unwrap();
        assert_eq!(hf.as_f32().unwrap(), &[0.0, 1.0, 2.0, 3.0]);
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        assert_eq!(
            transpose(2, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            Tensor::f32(vec![3, 2], vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0])
        );
    }

    #[test]
    fn unpack_cuts_a_block_and_rejects_a_scalar() {
        let dims = PackDims { heads: 1, kv_heads: 1, head_dim: 1, d_ff: 2 };
        let packed = Tensor::f32(vec![4, 1], vec![0.0, 1.0, 2.0, 3.0]);
        let up = unpack(&dims, &packed, Pack::GateUpBlocks, PackPart::Up).unwrap();
        assert_eq!(up, Tensor::f32(vec![2, 1], vec![2.0, 3.0]));
        let err = unpack(&dims, &packed, Pack::QkvBlocks, PackPart::V).unwrap_err();
        assert_eq!(err, "the pack should have 3 rows as Q, K, V blocks");
        // A scalar has no rows to cut or permute (this used to index past its empty shape).
        let scalar = Tensor::f32(vec![], vec![1.0]);
        assert_eq!(unpack(&dims, &scalar, Pack::QkvBlocks, PackPart::Q).unwrap_err(), "a scalar is not a pack of rows");
        assert_eq!(unpermute_rope(&scalar, 2), None);
    }
}
