//! Progress reports while loading weights: every parameter is reported once, in order, from 0 to
//! the total; a phase with nothing to do and a failed one end as documented on `Progress`.

mod support;

use half::f16;
use kiln_compiler::spec::{PackDims, WeightMap};
use kiln_runtime::gguf::GgmlType;
use kiln_runtime::weights::{graph_params, load_named_with_progress, quantized_named_with_progress};
use kiln_runtime::{Checkpoint, Phase};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use support::Builder;

/// Every report, in order.
#[derive(Default)]
struct Recorder(RefCell<Vec<(Phase, usize, usize)>>);

impl kiln_runtime::Progress for Recorder {
    fn update(&self, phase: Phase, done: usize, total: usize) {
        self.0.borrow_mut().push((phase, done, total));
    }
}

impl Recorder {
    fn take(&self) -> Vec<(Phase, usize, usize)> {
        self.0.take()
    }
}

/// `(phase, 0, n), (phase, 1, n), ..., (phase, n, n)`.
fn counted(phase: Phase, n: usize) -> Vec<(Phase, usize, usize)> {
    (0..=n).map(|done| (phase, done, n)).collect()
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn reading_a_fixture_reports_every_parameter_once_and_ends_at_the_total() {
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    let fe = kiln_compiler::front_end("llama.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let ckpt = Checkpoint::open(&root().join("tests/fixtures/llama/model.safetensors")).unwrap();
    let (dims, names) = (PackDims::of(&fe.spec), graph_params(&fe.graph));
    assert!(names.len() > 10, "{names:?}");
    let recorder = Recorder::default();
    let params = load_named_with_progress(&fe.spec.weights, &dims, &names, &ckpt, &recorder).unwrap();
    assert_eq!(params.len(), names.len());
    assert_eq!(recorder.take(), counted(Phase::Read, names.len()));
    // A safetensors file keeps no blocks: nothing to repack, nothing reported.
    let blocks = quantized_named_with_progress(&fe.spec.weights, &dims, &names, &ckpt, &recorder).unwrap();
    assert!(blocks.is_empty());
    assert_eq!(recorder.take(), []);
    // A missing tensor stops the phase where it failed.
    let mut missing = names.clone();
    missing.insert(2, ("no.such.param".into(), vec![4]));
    assert!(load_named_with_progress(&fe.spec.weights, &dims, &missing, &ckpt, &recorder).is_err());
    assert_eq!(recorder.take(), counted(Phase::Read, missing.len())[..3]);
}

#[test]
fn repacking_reports_every_parameter_looked_at() {
    // One Q8_0 matrix (two rows of one block) and one f32 vector.
    let mut q8 = Vec::new();
    for row in 0..2u8 {
        q8.extend(f16::from_f32(0.5).to_le_bytes());
        q8.extend((0..32).map(|k| k + row));
    }
    let norm: Vec<u8> = [1.0f32; 32].iter().flat_map(|x| x.to_le_bytes()).collect();
    let bytes =
        Builder::new().tensor("w", &[32, 2], GgmlType::Q8_0, &q8).tensor("norm", &[32], GgmlType::F32, &norm).bytes();
    let dir = std::env::temp_dir().join(format!("kiln-progress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let names = [("w".to_string(), vec![2, 32]), ("norm".to_string(), vec![32])];
    let (map, dims) = (WeightMap::default(), PackDims { heads: 1, kv_heads: 1, head_dim: 32, d_ff: 32 });
    let recorder = Recorder::default();
    let blocks = quantized_named_with_progress(&map, &dims, &names, &ckpt, &recorder).unwrap();
    assert_eq!(blocks.keys().collect::<Vec<_>>(), ["w"]);
    assert_eq!(recorder.take(), counted(Phase::Repack, 2));
    let params = load_named_with_progress(&map, &dims, &names, &ckpt, &recorder).unwrap();
    assert_eq!(params.len(), 2);
    assert_eq!(recorder.take(), counted(Phase::Read, 2));
}
