//! Fuzz target `generate`: see [`kiln_fuzz::generate`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::generate(data));
