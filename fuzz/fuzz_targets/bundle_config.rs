//! `cargo fuzz run bundle_config`: see [`berth_fuzz::bundle_config`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| berth_fuzz::bundle_config(data));
