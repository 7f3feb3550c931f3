//! Artifacts: a compiled model in one versioned, checksummed file.
//!
//! Layout (little-endian):
//!
//! ```text
//! offset  size  field
//! 0       8     magic "KILNART\0"
//! 8       4     format version (FORMAT_VERSION)
//! 12      8     payload length in bytes
//! 20      4     CRC-32 of the payload
//! 24      n     payload: JSON of `Artifact` (plan, spec source, weight map, pack sizes)
//! ```
//!
//! Weights stay in their own files; the artifact records how to find them (the weight map).
//! Files are written atomically: to a temporary file in the same directory, then renamed.

use crate::lower::Plan;
use crate::spec::{PackDims, WeightMap};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// First bytes of every artifact.
pub const MAGIC: &[u8; 8] = b"KILNART\0";
/// Bumped whenever the payload's meaning changes.
pub const FORMAT_VERSION: u32 = 3;
const HEADER: usize = 24;
/// Artifacts larger than this are refused before reading (they hold no weights, so real ones are
/// a few megabytes).
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// A compiled model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Artifact {
    /// kiln version that wrote it.
    pub kiln_version: String,
    /// The spec's file name when compiled.
    pub spec_file: String,
    /// The spec's source text.
    pub spec_source: String,
    /// Where each parameter comes from.
    pub weights: WeightMap,
    /// Sizes for cutting packed tensors.
    pub pack_dims: PackDims,
    /// The lowered program.
    pub plan: Plan,
}

/// Reading or writing an artifact failed.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// I/O. (The cause is part of the message, not an error `source`, so error chains do not
    /// print it twice.)
    #[error("cannot {action} `{path}`: {error}")]
    Io {
        /// read / write.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// Not an artifact at all.
    #[error("`{0}` is not a kiln artifact (bad magic bytes)")]
    Foreign(PathBuf),
    /// Written by an incompatible kiln.
    #[error(
        "`{path}` has artifact format {found}, this kiln reads format {FORMAT_VERSION}: recompile it with `kiln compile`"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// Shorter than its header says.
    #[error("`{path}` is truncated: {found} payload bytes, the header says {expected}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header announces.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// Checksum or payload broken.
    #[error("`{path}` is corrupt: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl Artifact {
    /// Serialises to bytes (header + payload).
    #[expect(clippy::expect_used, reason = "plain data with string map keys, which serde_json always serializes")]
    pub fn to_bytes(&self) -> Vec<u8> {
        let payload = serde_json::to_vec(self).expect("artifact types serialise");
        let mut out = Vec::with_capacity(HEADER + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Parses bytes read from `path` (named in errors).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Artifact, ArtifactError> {
        let p = || path.to_path_buf();
        let Some((magic, rest)) = bytes.split_first_chunk::<8>() else {
            return Err(ArtifactError::Foreign(p()));
        };
        if magic != MAGIC {
            return Err(ArtifactError::Foreign(p()));
        }
        // The rest of the header: version (u32), payload length (u64), payload CRC-32 (u32).
        let truncated = || ArtifactError::Truncated { path: p(), expected: HEADER as u64, found: bytes.len() as u64 };
        let (version, rest) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        let (len, rest) = rest.split_first_chunk::<8>().ok_or_else(truncated)?;
        let (crc, payload) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        let version = u32::from_le_bytes(*version);
        if version != FORMAT_VERSION {
            return Err(ArtifactError::Version { path: p(), found: version });
        }
        let len = u64::from_le_bytes(*len);
        let found = payload.len() as u64;
        if len > MAX_PAYLOAD {
            return Err(ArtifactError::Corrupt { path: p(), message: format!("payload length {len} is implausible") });
        }
        if found < len {
            return Err(ArtifactError::Truncated { path: p(), expected: len, found });
        }
        if found > len {
            return Err(ArtifactError::Corrupt { path: p(), message: format!("{} trailing bytes", found - len) });
        }
        if crc32fast::hash(payload) != u32::from_le_bytes(*crc) {
            return Err(ArtifactError::Corrupt { path: p(), message: "checksum mismatch".into() });
        }
        let artifact: Artifact = serde_json::from_slice(payload)
            .map_err(|e| ArtifactError::Corrupt { path: p(), message: format!("payload does not decode: {e}") })?;
        // A file can hold any plan: check it before anything is sized or run from it.
        artifact
            .plan
            .check()
            .map_err(|e| ArtifactError::Corrupt { path: p(), message: format!("invalid plan: {e}") })?;
        Ok(artifact)
    }

    /// Writes atomically ([`crate::file::write_atomic`]).
    pub fn write(&self, path: &Path) -> Result<(), ArtifactError> {
        crate::file::write_atomic(path, &self.to_bytes()).map_err(|error| ArtifactError::Io {
            action: "write",
            path: path.to_path_buf(),
            error,
        })
    }

    /// Reads and checks an artifact file.
    pub fn read(path: &Path) -> Result<Artifact, ArtifactError> {
        let io = |error| ArtifactError::Io { action: "read", path: path.to_path_buf(), error };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_PAYLOAD + HEADER as u64 {
            return Err(ArtifactError::Corrupt { path: path.into(), message: format!("{len} bytes is too large") });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        Self::from_bytes(path, &bytes)
    }

    /// Whether a file starts with the artifact magic (so `kiln run` can take a spec or an artifact).
    pub fn sniff(path: &Path) -> bool {
        use std::io::Read;
        let mut magic = [0u8; 8];
        std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == MAGIC
    }
}

/// Compiles a checked front end into an artifact. The artifact stores the target-neutral plan;
/// its wgpu kernels are generated and validated here too (and again by each load), so a compiler
/// bug surfaces when the artifact is made, not when it is first run on a GPU.
pub fn compile(file: &str, source: &str, fe: &crate::FrontEnd) -> Result<Artifact, crate::back::wgsl::CompileError> {
    let plan = crate::lower::lower(&fe.graph);
    crate::back::wgsl::compile(&plan, &crate::back::wgsl::Options::default())?;
    Ok(Artifact {
        kiln_version: env!("CARGO_PKG_VERSION").to_string(),
        spec_file: file.to_string(),
        spec_source: source.to_string(),
        weights: fe.spec.weights.clone(),
        pack_dims: PackDims::of(&fe.spec),
        plan,
    })
}
