//! Fuzz target `spec`: see [`kiln_fuzz::spec`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::spec(data));
