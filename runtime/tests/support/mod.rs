//! Test support shared by the runtime's integration tests: a GGUF writer.
#![allow(dead_code)]

use kiln_runtime::gguf::{GgmlType, Gguf, GgufError};

/// A GGUF file under construction: metadata and tensors are appended already encoded, so a test
/// can also write what a correct writer never would.
pub struct Builder {
    /// The header's version (3 unless a test changes it).
    pub version: u32,
    alignment: usize,
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

pub const U32: u32 = 4;
pub const I32: u32 = 5;
pub const BOOL: u32 = 7;
pub const STRING: u32 = 8;
pub const ARRAY: u32 = 9;

pub fn string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// An array's element type and count, which its elements follow.
fn array_header(element_type: u32, count: usize) -> Vec<u8> {
    let mut out = element_type.to_le_bytes().to_vec();
    out.extend((count as u64).to_le_bytes());
    out
}

impl Builder {
    pub fn new() -> Self {
        Builder {
            version: 3,
            alignment: 32,
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            n_tensors: 0,
            data: Vec::new(),
        }
    }

    /// A metadata pair whose value (after its type) is `payload`, encoded by the caller.
    pub fn kv(mut self, key: &str, type_id: u32, payload: &[u8]) -> Self {
        self.kv.extend(string(key));
        self.kv.extend(type_id.to_le_bytes());
        self.kv.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }

    pub fn kv_str(self, key: &str, value: &str) -> Self {
        self.kv(key, STRING, &string(value))
    }

    pub fn kv_u32(self, key: &str, value: u32) -> Self {
        self.kv(key, U32, &value.to_le_bytes())
    }

    pub fn kv_bool(self, key: &str, value: bool) -> Self {
        self.kv(key, BOOL, &[u8::from(value)])
    }

    /// An array of strings.
    pub fn kv_strs(self, key: &str, values: &[&str]) -> Self {
        let mut payload = array_header(STRING, values.len());
        payload.extend(values.iter().flat_map(|v| string(v)));
        self.kv(key, ARRAY, &payload)
    }

    /// An array of `int32`.
    pub fn kv_i32s(self, key: &str, values: &[i32]) -> Self {
        let mut payload = array_header(I32, values.len());
        payload.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self.kv(key, ARRAY, &payload)
    }

    /// `general.alignment`, also used for the tensors added after it.
    pub fn alignment(mut self, alignment: u32) -> Self {
        self.alignment = alignment as usize;
        self.kv("general.alignment", U32, &alignment.to_le_bytes())
    }

    /// A tensor info with an explicit offset and no data.
    pub fn info(mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        self.infos.extend(string(name));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// A tensor with its data, placed at the next aligned offset of the data section.
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: &[u8]) -> Self {
        let offset = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(offset, 0);
        self.data.extend_from_slice(data);
        self.info(name, dims, ty.0, offset as u64)
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend_from_slice(&self.kv);
        out.extend_from_slice(&self.infos);
        out.resize(out.len().next_multiple_of(self.alignment), 0);
        out.extend_from_slice(&self.data);
        out
    }

    pub fn parse(&self) -> Result<Gguf, GgufError> {
        Gguf::parse(self.bytes())
    }
}
