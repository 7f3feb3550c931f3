//! Faults outside the input: a GPU device lost under a model or a generation session, and
//! tensors larger than the adapter can put in one buffer. A fault is an error naming it, never a
//! panic.
//! (No adapter at all: `tests/cli/commands.rs` `an_unknown_adapter_is_a_clear_error`. Out of host memory:
//! `tests/cli/limits.rs`. A kill while writing: `tests/cli/atomic_writes.rs`.)

use crate::common;

use common::{root, spec};

use kiln_compiler::FrontEnd;
use kiln_compiler::graph::build::build_cached;
use kiln_compiler::lower::lower;
use kiln_compiler::tensor::Tensor;
use kiln_runtime::GpuEngine;
use kiln_runtime::generate::Session;
use kiln_runtime::{Gpu, GpuError, GpuModel};
use std::collections::HashMap;
use std::sync::Arc;

/// The spec of fixture `name`, its weights and its inputs and golden outputs.
fn fixture(name: &str) -> (FrontEnd, HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let fe = spec(name);
    let dir = root().join("tests/fixtures").join(name);
    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    (fe, params, io)
}

/// A generation session of `fe` on `gpu`.
fn session(gpu: Arc<Gpu>, fe: &FrontEnd, params: &HashMap<String, Tensor>) -> Session {
    let cached = build_cached(&fe.spec).unwrap();
    let names: Vec<String> = cached.outputs.iter().map(|(n, _)| n.clone()).collect();
    let model = GpuModel::new(gpu, lower(&cached), params).unwrap();
    Session::new(Box::new(GpuEngine::new(model)), &names, fe.spec.spec.model.max_positions as usize).unwrap()
}

/// A device of its own: destroying the shared one would break the other tests of this binary.
fn own_gpu() -> Option<Arc<Gpu>> {
    common::gpu()?;
    Some(Arc::new(Gpu::new(None).expect("an adapter was found above")))
}

#[test]
fn a_lost_device_fails_the_next_run_with_a_clear_error() {
    let Some(gpu) = own_gpu() else { return };
    let (fe, params, io) = fixture("gpt2");
    let model = GpuModel::new(gpu.clone(), lower(&fe.graph), &params).unwrap();
    model.run(&io).unwrap();

    gpu.destroy();
    let err = model.run(&io).expect_err("a run on a destroyed device");
    assert!(matches!(err, GpuError::Lost(_)), "{err:?}");
    let message = err.to_string();
    assert!(message.starts_with("the GPU device was lost: Destroyed"), "{message}");
    // Nor can a new model be built on it.
    let err = GpuModel::new(gpu, lower(&fe.graph), &params).err().expect("a model on a destroyed device");
    assert!(matches!(err, GpuError::Lost(_)), "{err:?}");
}

#[test]
fn a_lost_device_ends_a_generation_session_with_an_error() {
    let Some(gpu) = own_gpu() else { return };
    let (fe, params, _) = fixture("llama");
    let mut session = session(gpu.clone(), &fe, &params);
    session.forward(&[1, 2, 3]).unwrap();

    gpu.destroy();
    let err = session.forward(&[4]).expect_err("a step on a destroyed device");
    assert!(err.to_string().contains("the GPU device was lost"), "{err}");
    // The cache lives on the device and is gone with it.
    let err = session.cache().expect_err("reading a cache from a destroyed device");
    assert!(err.to_string().contains("the GPU device was lost"), "{err}");
}

/// No buffer is larger than the adapter allows: tensors, and the staging buffers that read them
/// back, are split into chunks (`tests/engines/gpu.rs` runs every fixture so). A generation session's
/// device-resident cache, read back in 4 KiB chunks, holds what whole buffers hold.
#[test]
fn device_tensors_over_the_buffer_limit_are_read_back_whole() {
    let Some(gpu) = common::gpu() else { return };
    let small = common::gpu_with_buffer_limit(4096).expect("an adapter was found above");
    let (fe, params, _) = fixture("gpt2");
    let caches: Vec<_> = [gpu, small]
        .into_iter()
        .map(|gpu| {
            let mut session = session(gpu, &fe, &params);
            session.forward(&(5..25).collect::<Vec<i64>>()).unwrap();
            session.forward(&[9]).unwrap();
            session.cache().unwrap()
        })
        .collect();
    assert!(!caches[0].is_empty());
    for (name, a) in &caches[0] {
        let b = &caches[1][name];
        assert_eq!(a.shape, b.shape, "{name}");
        assert!(a.max_abs_diff(b) == 0.0, "{name}");
        // More than one chunk each, so the split readback was exercised.
        assert!(4 * a.shape.iter().product::<usize>() > 4096, "{name}: {:?}", a.shape);
    }
}

/// A tensor split into more chunks than a kernel can bind is refused before the dispatch (the
/// count depends on the run's sizes), naming the kernel and both counts, instead of failing
/// inside wgpu.
#[test]
fn a_tensor_needing_more_bindings_than_the_adapter_has_is_refused() {
    let Some(_) = common::gpu() else { return };
    let mut tiny = Gpu::new(None).unwrap();
    tiny.limit_buffer_bytes(1);
    assert_eq!(tiny.chunk_bytes(), 256, "the smallest chunk");
    let (fe, params, io) = fixture("gpt2");
    let model = GpuModel::new(Arc::new(tiny), lower(&fe.graph), &params).unwrap();
    let err = model.run(&io).expect_err("too many bindings");
    let message = err.to_string();
    assert!(message.contains("storage buffers after splitting large tensors, more than this adapter's"), "{message}");
    // (The tied table is gathered from the head's transposed pieces, 256 bytes each: 152 of them.)
    assert!(message.starts_with("`embed`: gather_columns needs 153 storage buffers"), "{message}");
}
