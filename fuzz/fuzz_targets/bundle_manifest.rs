//! `cargo fuzz run bundle_manifest`: see [`berth_fuzz::bundle_manifest`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| berth_fuzz::bundle_manifest(data));
