//! [`Model`]: a compiled plan loaded on one of the back ends that execute plans (wgpu or the
//! native CPU kernels), behind one interface for the callers that do not care which.

use crate::cpu::{CpuError, CpuModel};
use crate::gpu::{GpuError, GpuModel};
use kiln_compiler::lower::{Plan, WeightFormat};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// A plan loaded on a back end.
pub enum Model {
    /// Generated WGSL kernels on a wgpu device.
    Gpu(Box<GpuModel>),
    /// Native kernels on the host's cores.
    Cpu(Box<CpuModel>),
}

/// What can go wrong running a [`Model`].
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// On the device.
    #[error(transparent)]
    Gpu(Box<GpuError>),
    /// On the CPU.
    #[error(transparent)]
    Cpu(Box<CpuError>),
}

impl From<GpuError> for ModelError {
    fn from(e: GpuError) -> Self {
        ModelError::Gpu(Box::new(e))
    }
}

impl From<CpuError> for ModelError {
    fn from(e: CpuError) -> Self {
        ModelError::Cpu(Box::new(e))
    }
}

impl Model {
    /// Runs one forward pass on named inputs; returns the named outputs.
    pub fn run(&self, given: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>, ModelError> {
        Ok(match self {
            Model::Gpu(m) => m.run(given)?,
            Model::Cpu(m) => m.run(given)?,
        })
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        match self {
            Model::Gpu(m) => m.plan(),
            Model::Cpu(m) => m.plan(),
        }
    }

    /// Unique kernels: the WGSL modules on wgpu; on the CPU, every step runs a native kernel or the
    /// interpreter's, so this is the number of distinct ops it runs.
    pub fn kernels(&self) -> usize {
        match self {
            Model::Gpu(m) => m.program().kernels.len(),
            Model::Cpu(m) => m.plan().steps.iter().map(|s| &s.op).collect::<std::collections::HashSet<_>>().len(),
        }
    }

    /// Bytes of the weights where the back end keeps them, by storage format.
    pub fn weight_bytes(&self) -> &[(WeightFormat, u64)] {
        match self {
            Model::Gpu(m) => m.weight_bytes(),
            Model::Cpu(m) => m.weight_bytes(),
        }
    }

    /// The back end's name (`wgpu`, `cpu`).
    pub fn backend(&self) -> &'static str {
        match self {
            Model::Gpu(_) => "wgpu",
            Model::Cpu(_) => "cpu",
        }
    }
}
