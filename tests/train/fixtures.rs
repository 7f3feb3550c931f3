//! The training fixtures on the interpreter and the CPU back end, within the tolerances of the
//! fixtures' README: per-step loss within 1e-4 absolute, each first-step gradient within 1e-4 of
//! its tensor's largest magnitude.

use crate::common::root;
use kiln_compiler::front_end;
use kiln_compiler::spec::PackDims;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::train::{Objective, training_graph};
use kiln_runtime::train::batches::Batches;
use kiln_runtime::train::run::StepRunner;
use kiln_runtime::{Checkpoint, Device, read_tensors};
use std::path::PathBuf;

fn dir(case: &str) -> PathBuf {
    root().join("tests/fixtures").join(case)
}

/// `train.json`'s `frozen` and `label_smoothing`.
fn recipe(case: &str) -> (Vec<String>, f64) {
    let text = std::fs::read_to_string(dir(case).join("train.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let frozen = v["frozen"].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
    (frozen, v.get("label_smoothing").and_then(|x| x.as_f64()).unwrap_or(0.0))
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f32_vec().iter().map(|&x| f64::from(x)).collect()
}

/// Step 0's loss and every trained tensor's gradient, on `device`, against PyTorch's.
fn first_step(case: &str, device: &Device) {
    let imported = kiln_runtime::import::import(&dir(case)).unwrap();
    let fe = front_end(case, &imported.imported.text).unwrap_or_else(|e| panic!("{}", e.render()));
    let (frozen, label_smoothing) = recipe(case);
    let (graph, uses) =
        training_graph(&fe.graph, Objective { label_smoothing }, &fe.spec.weights, &PackDims::of(&fe.spec), |t| {
            !frozen.iter().any(|f| f == t)
        })
        .unwrap();
    let params = Checkpoint::open(&dir(case).join("model.safetensors")).unwrap().all().unwrap();
    let batches = Batches::new(read_tensors(&dir(case).join("data.safetensors")).unwrap()).unwrap();
    let expected = read_tensors(&dir(case).join("expected.safetensors")).unwrap();
    let mut runner = StepRunner::new(device, graph).unwrap();
    let out = runner.run(&params, &batches.step(0).unwrap(), &()).unwrap();

    let loss0 = f64s(&expected["loss"])[0];
    assert!((out.loss - loss0).abs() < 1e-4, "{case} on {}: loss {} vs PyTorch's {loss0}", device.name(), out.loss);
    let mut checked = 0;
    for (name, want) in &expected {
        let Some(tensor) = name.strip_prefix("grad.") else { continue };
        let got = out.grads.get(tensor).unwrap_or_else(|| panic!("{case}: no gradient for `{tensor}`"));
        assert_eq!(got.shape, want.shape, "{case}: shape of grad.{tensor}");
        let (got, want) = (f64s(got), f64s(want));
        let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(
            worst <= 1e-4 * scale,
            "{case} on {}: grad.{tensor} is {worst:.3e} off (scale {scale:.3e})",
            device.name()
        );
        checked += 1;
    }
    // Every trained tensor was compared, and nothing frozen was differentiated.
    let trained: Vec<&String> = uses.iter().map(|u| &u.tensor).filter(|t| !frozen.contains(t)).collect();
    assert!(checked > 0);
    assert_eq!(out.grads.len(), checked, "{case}: gradients {:?}", out.grads.keys().collect::<Vec<_>>());
    for t in trained {
        assert!(out.grads.contains_key(t), "{case}: `{t}` got no gradient");
    }
}

#[test]
fn gpt2_first_step_on_the_interpreter() {
    first_step("train_gpt2", &Device::Interp);
}

#[test]
fn gpt2_first_step_on_the_cpu() {
    first_step("train_gpt2", &Device::Cpu { threads: 2 });
}

#[test]
fn llama_first_step_on_the_interpreter() {
    first_step("train_llama", &Device::Interp);
}

#[test]
fn llama_first_step_on_the_cpu() {
    first_step("train_llama", &Device::Cpu { threads: 2 });
}
