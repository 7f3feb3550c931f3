//! Every engine against the references: the golden fixtures, each fused op and weight format on
//! interp, cpu and wgpu, cached generation, sampling, tokenizers and embeddings.
//!
//! One test binary for several files, so the suite links fewer of them (each links wgpu, naga
//! and egg).

#[path = "../common/mod.rs"]
mod common;

mod cpu;
mod embed;
mod fused_ops;
mod generate;
mod golden;
mod gpu;
mod sample;
mod tokenize;
mod weight_formats;
