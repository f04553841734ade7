//! `cargo fuzz run tar_layer`: see [`berth_fuzz::tar_layer`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| berth_fuzz::tar_layer(data));
