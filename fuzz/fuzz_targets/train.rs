//! Fuzz target `train`: see [`kiln_fuzz::train`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::train(data));
