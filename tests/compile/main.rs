//! The compiler's outputs, checked as text: invalid specs' rendered errors, each model's graph,
//! optimized graph and plan, imported specs, `kiln diff` and `kiln inspect`, and artifacts.
//!
//! One test binary for several files, so the suite links fewer of them (each links wgpu, naga
//! and egg).

#[path = "../common/mod.rs"]
mod common;

mod artifact;
mod diff;
mod import;
mod inspect;
mod invalid_specs;
mod model_snapshots;
