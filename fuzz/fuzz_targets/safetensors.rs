//! Fuzz target `safetensors`: see [`kiln_fuzz::safetensors`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::safetensors(data));
