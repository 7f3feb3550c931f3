//! Artifacts: compile -> write -> read -> run equals running from the spec; corrupt, truncated,
//! foreign and version-mismatched files give clear errors.

use crate::common;

use common::{root, scratch};

use kiln_compiler::artifact::{self, Artifact, ArtifactError, FORMAT_VERSION};
use kiln_compiler::front_end;
use kiln_compiler::lower::lower;
use kiln_runtime::GpuModel;
use std::path::Path;

fn compiled(name: &str) -> (Artifact, kiln_compiler::FrontEnd) {
    let file = format!("models/{name}.toml");
    let source = std::fs::read_to_string(root().join(&file)).unwrap();
    let fe = front_end(&file, &source).unwrap();
    (artifact::compile(&file, &source, &fe).unwrap(), fe)
}

#[test]
fn every_model_round_trips_through_a_file() {
    let dir = scratch("roundtrip");
    for entry in std::fs::read_dir(root().join("models")).unwrap() {
        let name = entry.unwrap().path().file_stem().unwrap().to_string_lossy().to_string();
        let (art, _) = compiled(&name);
        let path = dir.join(format!("{name}.kiln"));
        art.write(&path).unwrap();
        assert!(Artifact::sniff(&path));
        assert_eq!(Artifact::read(&path).unwrap(), art, "{name}");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "atomic write leaves no temporary file");
    }
}

#[test]
fn running_an_artifact_equals_running_the_spec() {
    let Some(gpu) = common::gpu() else { return };
    let (art, fe) = compiled("llama");
    let path = scratch("run").join("llama.kiln");
    art.write(&path).unwrap();
    let loaded = Artifact::read(&path).unwrap();
    let dir = root().join("tests/fixtures/llama");
    let ckpt = kiln_runtime::Checkpoint::open(&dir.join("model.safetensors")).unwrap();
    let io = kiln_runtime::read_tensors(&dir.join("io.safetensors")).unwrap();
    let names = kiln_runtime::weights::graph_params(&fe.graph);
    let params = kiln_runtime::weights::load_named(&loaded.weights, &loaded.pack_dims, &names, &ckpt).unwrap();
    let from_artifact = GpuModel::new(gpu.clone(), loaded.plan, &params).unwrap().run(&io).unwrap();
    let from_spec = GpuModel::new(gpu, lower(&fe.graph), &params).unwrap().run(&io).unwrap();
    assert_eq!(from_artifact, from_spec);
}

fn corrupt(bytes: &[u8]) -> ArtifactError {
    Artifact::from_bytes(Path::new("m.kiln"), bytes).unwrap_err()
}

#[test]
fn damaged_artifacts_are_refused_with_the_reason() {
    let (art, _) = compiled("gpt2");
    let good = art.to_bytes();

    let mut flipped = good.clone();
    let last = flipped.len() - 10;
    flipped[last] ^= 0x20;
    assert_eq!(corrupt(&flipped).to_string(), "`m.kiln` is corrupt: checksum mismatch");

    let e = corrupt(&good[..good.len() - 100]).to_string();
    assert!(e.starts_with("`m.kiln` is truncated:"), "{e}");
    assert!(corrupt(&good[..10]).to_string().contains("truncated"));

    assert_eq!(corrupt(b"PK\x03\x04 a zip file").to_string(), "`m.kiln` is not a kiln artifact (bad magic bytes)");
    assert!(corrupt(b"").to_string().contains("not a kiln artifact"));

    let mut future = good.clone();
    future[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    assert_eq!(
        corrupt(&future).to_string(),
        format!(
            "`m.kiln` has artifact format {}, this kiln reads format {FORMAT_VERSION}: recompile it with `kiln compile`",
            FORMAT_VERSION + 1
        )
    );

    let mut trailing = good.clone();
    trailing.extend_from_slice(b"junk");
    assert!(corrupt(&trailing).to_string().contains("trailing bytes"));

    // A valid header over a payload that is not an artifact.
    let payload = b"{\"not\": \"an artifact\"}";
    let mut forged = Vec::new();
    forged.extend_from_slice(b"KILNART\0");
    forged.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    forged.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    forged.extend_from_slice(&crc32fast_hash(payload).to_le_bytes());
    forged.extend_from_slice(payload);
    assert!(corrupt(&forged).to_string().contains("payload does not decode"));

    // A well-formed file whose plan is not one lowering makes: refused before anything is sized
    // or run from it.
    let seal = |art: &Artifact| {
        let payload = serde_json::to_vec(art).unwrap();
        let mut file = b"KILNART\0".to_vec();
        file.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        file.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        file.extend_from_slice(&crc32fast_hash(&payload).to_le_bytes());
        file.extend_from_slice(&payload);
        file
    };
    let mut no_slots = art.clone();
    no_slots.plan.slots = 0;
    assert!(corrupt(&seal(&no_slots)).to_string().contains("invalid plan: value"), "{}", corrupt(&seal(&no_slots)));
    let mut bad_operand = art.clone();
    bad_operand.plan.steps[0].operands[0] = 999_999;
    let err = corrupt(&seal(&bad_operand)).to_string();
    assert!(err.contains("invalid plan: step 0 reads value 999999"), "{err}");
    assert!(Artifact::from_bytes(Path::new("m.kiln"), &seal(&art)).is_ok(), "sealing alone changes nothing");
}

/// CRC-32 (IEEE), written out so the test does not trust the code under test.
fn crc32fast_hash(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}
