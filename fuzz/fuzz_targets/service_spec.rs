//! `cargo fuzz run service_spec`: see [`berth_fuzz::service_spec`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| berth_fuzz::service_spec(data));
