//! Training, checked against PyTorch: the fixtures `tests/fixtures/train_*` (see their
//! `CASE.md`) record a few AdamW steps of small models — every loss, gradient norm and learning
//! rate, each tensor's first-step gradient and each tensor after the last step.

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod engines;
mod fixtures;
mod init;
