//! Fuzz target `differential`: see [`kiln_fuzz::differential`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::differential(data));
