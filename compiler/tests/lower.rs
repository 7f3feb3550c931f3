//! Lowering: every model of `models/` lowers, every kernel passes naga validation, and buffers are
//! shared by liveness.

use kiln_compiler::graph::Sym;
use kiln_compiler::lower::{dispatch, lower};
use std::collections::HashMap;

#[test]
fn every_model_lowers_with_valid_kernels() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let source = std::fs::read_to_string(&path).unwrap();
        let fe = kiln_compiler::front_end(&path.display().to_string(), &source).unwrap();
        let plan = lower(&fe.graph).unwrap_or_else(|e| panic!("{e}"));
        let syms = HashMap::from([(Sym::Batch, 1), (Sym::Seq, 128), (Sym::SrcSeq, 128)]);
        let (sum, placed) = plan.memory(&syms);
        println!(
            "{}: {} kernels, {} steps, {} slots, intermediates {} B, placed {} B",
            plan.name,
            plan.kernels.len(),
            plan.steps.len(),
            plan.slots,
            sum,
            placed
        );
        assert!(placed < sum, "{}: liveness shares buffers", plan.name);
    }
}

#[test]
fn broadcast_dims_use_zero_strides() {
    let d = dispatch(&kiln_compiler::graph::Op::Add, &[vec![2, 3, 4], vec![4]], &[2, 3, 4], 0).unwrap();
    assert_eq!(&d[..13], &[24, 1, 2, 3, 4, 0, 12, 4, 1, 0, 0, 0, 1]);
}
