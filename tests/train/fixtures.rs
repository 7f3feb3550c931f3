//! The training fixtures on the interpreter, the CPU back end and wgpu, within the tolerances of the
//! fixtures' README: per-step loss within 1e-4 absolute, each first-step gradient within 1e-4 of
//! its tensor's largest magnitude — or within 1e-8 absolute, for a tensor whose gradient is zero
//! by symmetry and holds only rounding noise in both (a key bias: a softmax is invariant to one
//! shift of every score of its row, so PyTorch's `key.bias` gradients are about 1e-12).
//!
//! wgpu (lavapipe) meets the CPU's tolerances, with as much room: its worst first-step gradient
//! is 7.8e-7 of its tensor's scale (the CPU's 7.5e-7), its losses within 1e-6 of PyTorch's, and
//! after BERT's 16 steps its parameters within 1.2e-5 (the CPU's 6e-6) and its gradient norms
//! within 1.7e-7 relative.

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
            worst <= (1e-4 * scale).max(1e-8),
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

/// The wgpu device (lavapipe where there is no GPU); `None`, the test skipped, where there is no
/// adapter and `KILN_SKIP_GPU=1` (see `common::gpu`).
fn wgpu() -> Option<Device> {
    crate::common::gpu().map(Device::Gpu)
}

#[test]
fn gpt2_first_step_on_wgpu() {
    let Some(device) = wgpu() else { return };
    first_step("train_gpt2", &device);
}

#[test]
fn llama_first_step_on_the_interpreter() {
    first_step("train_llama", &Device::Interp);
}

#[test]
fn llama_first_step_on_the_cpu() {
    first_step("train_llama", &Device::Cpu { threads: 2 });
}

#[test]
fn llama_first_step_on_wgpu() {
    let Some(device) = wgpu() else { return };
    first_step("train_llama", &device);
}

#[test]
fn bert_mlm_first_step_on_the_interpreter() {
    first_step("train_bert_mlm", &Device::Interp);
}

#[test]
fn bert_mlm_first_step_on_the_cpu() {
    first_step("train_bert_mlm", &Device::Cpu { threads: 2 });
}

#[test]
fn bert_mlm_first_step_on_wgpu() {
    let Some(device) = wgpu() else { return };
    first_step("train_bert_mlm", &device);
}

/// `kiln train` on a fixture's batches and recipe, on `backend`: every step's loss, gradient norm
/// and learning rate, the evaluation loss and every tensor after the last step, against PyTorch.
fn whole_run(case: &str, backend: &str) {
    let out = crate::common::scratch(&format!("{case}-{backend}"));
    let (log, weights) = (out.join("steps.jsonl"), out.join("final.safetensors"));
    let d = dir(case);
    crate::common::ok(&[
        "train",
        d.to_str().unwrap(),
        "--batches",
        d.join("data.safetensors").to_str().unwrap(),
        "--recipe",
        d.join("train.json").to_str().unwrap(),
        "--log",
        log.to_str().unwrap(),
        "-o",
        weights.to_str().unwrap(),
        "--backend",
        backend,
    ]);
    let expected = read_tensors(&d.join("expected.safetensors")).unwrap();
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("grad_norm").is_some()).collect();
    let (loss, norm, lr) = (f64s(&expected["loss"]), f64s(&expected["grad_norm"]), f64s(&expected["lr"]));
    assert_eq!(steps.len(), loss.len(), "{case}: one log line per step");
    for (s, line) in steps.iter().enumerate() {
        let get = |k: &str| line[k].as_f64().unwrap();
        assert_eq!(line["step"].as_u64(), Some(s as u64));
        assert!(
            (get("loss") - loss[s]).abs() < 1e-4,
            "{case} on {backend}: step {s} loss {} vs {}",
            get("loss"),
            loss[s]
        );
        assert!(
            (get("grad_norm") - norm[s]).abs() < 1e-4 * norm[s],
            "{case} on {backend}: step {s} grad norm {} vs {}",
            get("grad_norm"),
            norm[s]
        );
        assert!((get("lr") - lr[s]).abs() < 1e-9, "{case}: step {s} lr {} vs {}", get("lr"), lr[s]);
    }
    let eval = lines.last().unwrap()["eval_loss"].as_f64().unwrap();
    let want = f64s(&expected["eval_loss"])[0];
    assert!((eval - want).abs() < 1e-3, "{case} on {backend}: eval loss {eval} vs {want}");

    let got = read_tensors(&weights).unwrap();
    let initial = read_tensors(&d.join("model.safetensors")).unwrap();
    let (frozen, _) = recipe(case);
    let mut compared = 0;
    for (name, want) in &expected {
        let Some(tensor) = name.strip_prefix("final.") else { continue };
        let t = got.get(tensor).unwrap_or_else(|| panic!("{case}: `{tensor}` not written"));
        assert_eq!(t.shape, want.shape);
        let worst = f64s(t).iter().zip(f64s(want)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-3, "{case} on {backend}: final {tensor} is {worst:.3e} off");
        if frozen.iter().any(|f| f == tensor) {
            assert_eq!(t, &initial[tensor], "{case}: frozen `{tensor}` changed");
        }
        compared += 1;
    }
    assert_eq!(compared, got.len(), "{case}: the weights written are the checkpoint's tensors");
}

#[test]
fn gpt2_trains_as_pytorch_does() {
    whole_run("train_gpt2", "cpu");
    whole_run("train_gpt2", "interp");
}

#[test]
fn llama_with_a_frozen_embedding_trains_as_pytorch_does() {
    whole_run("train_llama", "cpu");
    whole_run("train_llama", "interp");
}

#[test]
fn bert_mlm_trains_as_pytorch_does() {
    whole_run("train_bert_mlm", "cpu");
    whole_run("train_bert_mlm", "interp");
}

/// The whole runs on wgpu, where the parameters, gradients and AdamW's moments stay on the
/// device between steps: GPT-2's (a tied head, a packed projection), Llama's (a frozen
/// embedding, never written there), BERT's (a masked-LM head).
#[test]
fn gpt2_and_llama_train_on_wgpu_as_pytorch_does() {
    if wgpu().is_none() {
        return;
    }
    whole_run("train_gpt2", "wgpu");
    whole_run("train_llama", "wgpu");
}

#[test]
fn bert_mlm_trains_on_wgpu_as_pytorch_does() {
    if wgpu().is_none() {
        return;
    }
    whole_run("train_bert_mlm", "wgpu");
}
