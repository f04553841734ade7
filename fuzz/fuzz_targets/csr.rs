//! `cargo fuzz run csr`: see [`berth_fuzz::csr`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| berth_fuzz::csr(data));
