//! Fuzz target `artifact`: see [`kiln_fuzz::artifact`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::artifact(data));
