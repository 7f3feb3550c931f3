//! Memory is checked before it is allocated (`kiln_compiler::memory`): parameters, activations
//! and weights larger than the machine can hold are refused with what needed how much, exit code 1
//! and no abort, instead of the allocator killing the process; a failed device allocation is
//! reported as out of GPU memory.

use crate::common;

use common::{root, scratch};
use kiln_compiler::tensor::Tensor;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `models/NAME.toml` with some lines replaced, written to `dir`.
fn spec_with(dir: &Path, name: &str, replace: &[(&str, &str)]) -> PathBuf {
    let mut source = std::fs::read_to_string(root().join(format!("models/{name}.toml"))).unwrap();
    for (from, to) in replace {
        assert!(source.contains(from), "{from}");
        source = source.replace(from, to);
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, source).unwrap();
    path
}

fn refused(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected a clean failure:\n{err}");
    assert!(!err.contains("panicked") && !err.contains("memory allocation of"), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "the message lacks {needle:?}:\n{err}");
    }
}

/// A spec within every dimension limit whose random parameters (1.3 TiB) fit no machine that
/// runs this test: `kiln bench` refuses before drawing any.
#[test]
fn random_parameters_larger_than_memory_are_refused() {
    let dir = scratch("bench");
    let spec = spec_with(
        &dir,
        "gpt2",
        &[("vocab = 128", "vocab = 4000000"), ("d_model = 64", "d_model = 65536"), ("heads = 4", "heads = 64")],
    );
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["--quiet", "bench", "forward", "--seq", "4", "--runs", "1"])
        .arg(&spec)
        .current_dir(root())
        .output()
        .unwrap();
    refused(&o, &["random parameters for `gpt2`: needs 1.3 TiB of memory"]);
}

/// `kiln run --no-optimize` of LLaMA at 16384 tokens (each attention score matrix is then 4 GiB)
/// on `backend`, under an address-space limit of `limit_kb` (`ulimit -v`). Returns the output and
/// whether an outputs file was written.
#[cfg(unix)]
fn long_llama_run_under_ulimit(name: &str, backend: &str, limit_kb: u64) -> (Output, bool) {
    let dir = scratch(name);
    let spec = spec_with(&dir, "llama", &[("max_positions = 64", "max_positions = 16384")]);
    let n = 16384;
    let ids = Tensor::i64(vec![1, n], (0..n as i64).map(|i| i * 7 % 128).collect());
    let inputs = dir.join("inputs.safetensors");
    kiln_runtime::write_tensors(&inputs, &[("input_ids".into(), ids)]).unwrap();
    let out = dir.join("out.safetensors");
    let o = Command::new("sh")
        .args(["-c", &format!("ulimit -v {limit_kb} && exec \"$0\" \"$@\"")])
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .args(["run", "--backend", backend, "--no-optimize", "--weights", "tests/fixtures/llama/model.safetensors"])
        .arg(&spec)
        .arg("--inputs")
        .arg(&inputs)
        .arg("--output")
        .arg(&out)
        .current_dir(root())
        .output()
        .unwrap();
    (o, out.exists())
}

/// An activation larger than the process may allocate (4 GiB of attention scores under a 3 GB
/// address-space limit): the interpreter refuses the first such result by name before
/// allocating it.
#[cfg(unix)]
#[test]
fn an_activation_larger_than_the_process_may_allocate_is_refused() {
    let (o, written) = long_llama_run_under_ulimit("activation", "interp", 3_000_000);
    refused(&o, &["`layers.0.attn`: a matmul_t result: needs 4.0 GiB of memory"]);
    assert!(!written);
}

/// The same activation on the CPU backend: its step is refused by name, as the interpreter's
/// result is, before its buffer is grown.
#[cfg(unix)]
#[test]
fn an_activation_larger_than_the_process_may_allocate_is_refused_on_the_cpu_backend() {
    let (o, written) = long_llama_run_under_ulimit("activation-cpu", "cpu", 3_000_000);
    refused(&o, &["`layers.0.attn`: a matmul_t result: needs 4.0 GiB of memory"]);
    assert!(!written);
}

/// Out of device memory: on a CPU adapter (lavapipe), device memory is the process's, so the same
/// run on wgpu under a 4 GB limit runs out of it while allocating the attention scores, and says
/// so. (On a real GPU the limit would not apply to device memory, and drivers reserve address
/// space of their own, so the test runs on CPU adapters only.)
#[cfg(unix)]
#[test]
fn a_device_allocation_that_fails_is_out_of_gpu_memory() {
    let Some(gpu) = common::gpu() else { return };
    if !gpu.describe().contains("Cpu") {
        return;
    }
    let (o, written) = long_llama_run_under_ulimit("device", "wgpu", 4_000_000);
    refused(&o, &["out of GPU memory while allocating intermediate buffer"]);
    assert!(!written);
}

/// Benchmark inputs at an absurd batch (23 TiB of ids) are refused before any is drawn; a
/// sequence over the model's positions is refused before anything runs.
#[test]
fn benchmark_sizes_are_checked_before_anything_runs() {
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["--quiet", "bench", "forward", "models/gpt2.toml", "--runs", "1"])
            .args(extra)
            .current_dir(root())
            .output()
            .unwrap()
    };
    refused(
        &bench(&["--seq", "32", "--batch", "100000000000"]),
        &["sample inputs of batch 100000000000 x seq 32: needs 23.3 TiB of memory"],
    );
    refused(&bench(&["--seq", "33"]), &["--seq 33 is more than `gpt2` holds (model.max_positions = 32)"]);
    refused(&bench(&["--seq", "0"]), &["--seq 0 measures nothing"]);
}
