//! Back ends: each compiles the target-neutral [`Plan`](crate::lower::Plan) for its engine, with
//! its own legalization, the way naga keeps one IR and a writer per target.
//!
//! - [`wgsl`]: WGSL compute modules and their dispatch sizes, for `kiln-runtime`'s wgpu engine.
//!   Projection weights are transposed and padded (load-time folds) for its projection kernel.
//! - [`cpu`]: the layout `kiln-runtime`'s native CPU engine holds the plan's constants in
//!   (projection weights transposed, gather tables kept as blocks); it runs the steps as they are.
//!
//! What a back end tells the optimizer (its cost model, which projections run in a scalar form,
//! the widest attention head it fuses) is a [`Target`](crate::target::Target) it fills in
//! ([`wgsl::target`]), so rules and extraction depend on the target's facts, never on a back
//! end's module.

pub mod cpu;
pub mod wgsl;
