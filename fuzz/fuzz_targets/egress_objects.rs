//! `cargo fuzz run egress_objects`: see [`berth_fuzz::egress_objects`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| berth_fuzz::egress_objects(data));
