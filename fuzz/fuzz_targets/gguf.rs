//! Fuzz target `gguf`: see [`kiln_fuzz::gguf`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kiln_fuzz::gguf(data));
