//! The `kiln` binary as a user runs it: its commands and their output, the README's commands,
//! bad inputs and weights, faults, memory limits and atomic writes.
//!
//! One test binary for several files, so the suite links fewer of them (each links wgpu, naga
//! and egg).

#[path = "../common/mod.rs"]
mod common;

mod architecture;
mod atomic_writes;
mod bad_inputs;
mod bad_weights;
mod bench;
mod chat;
mod commands;
mod embed;
mod faults;
mod init;
mod limits;
mod messages;
mod names;
mod overwrite;
mod prompts;
mod readme;
mod recorded_weights;
mod serve;
mod serve_embed;
mod tune;
