//! The service binaries a test of `berth` starts beside it (`berth bench`
//! and `berth bootstrap` run the real `berth-identity`, `berth-leases` and
//! `berth-agent` from the directory `berth` is in).
//!
//! A workspace test run (`make test`, `cargo nextest run --workspace`)
//! builds every package's binaries before any test starts, so they are
//! there; a test never runs cargo itself. Run alone (`cargo test -p
//! berth`), the test says what to build.

use std::path::{Path, PathBuf};

/// `name`, of `package`, beside the `berth` under test.
pub(crate) fn sibling(name: &str, package: &str) -> PathBuf {
    let berth = Path::new(env!("CARGO_BIN_EXE_berth"));
    let binary = berth.with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let release = berth.parent().and_then(Path::file_name).is_some_and(|profile| profile == "release");
    assert!(
        binary.is_file(),
        "{} is not built: a workspace test run builds it, or run `cargo build{} -p {package} --bin {name}` first",
        binary.display(),
        if release { " --release" } else { "" },
    );
    binary
}
