//! Compiles the berth API under `proto/` into Rust, writes its descriptor set for
//! reflection, and turns each rpc's `(berth.auth.v1.access)` option into the
//! admission table `access.rs`. The SPIFFE Workload API (`proto/spiffe`) is
//! compiled on its own: the node agent serves it to workloads over a Unix
//! socket, outside the mesh, so it has no admission rule and no place in the
//! descriptor set the mesh's services reflect.
//!
//! # Invariants
//! Every rpc admits at least one known caller kind. The build fails, naming each rpc
//! that does not, so no RPC can be served without an admission rule.

use std::{
    env,
    fmt::Write as _,
    fs, io,
    path::{Path, PathBuf},
    process::ExitCode,
};

use prost_reflect::{DescriptorPool, Value};

/// The method option that carries an rpc's admission rule.
const ACCESS_EXTENSION: &str = "berth.auth.v1.access";

/// The file reflection serves, written beside the generated code.
const DESCRIPTOR_FILE: &str = "berth_descriptor.bin";

/// The SPIFFE Workload API, under `proto/`.
const SPIFFE_WORKLOAD_API: &str = "spiffe/workload/workload.proto";

/// The generated admission table, included by `lib.rs`.
const ACCESS_FILE: &str = "access.rs";

/// Why the API could not be built.
#[derive(Debug, thiserror::Error)]
enum BuildError {
    /// Cargo did not set a variable every build script gets.
    #[error("cargo did not set {name}")]
    CargoEnv {
        name: &'static str,
        #[source]
        source: env::VarError,
    },
    /// A file or directory could not be read or written.
    #[error("cannot access {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// protox rejected the .proto files.
    #[error("the .proto files do not compile: {0}")]
    Compile(#[source] protox::Error),
    /// Code generation from the descriptor set failed.
    #[error("code generation failed")]
    Codegen(#[source] io::Error),
    /// auth.proto is missing from the compiled set, so no rpc can declare access.
    #[error("the descriptor set has no {ACCESS_EXTENSION} extension: is berth/auth/v1/auth.proto under proto/?")]
    NoAccessExtension,
    /// Some rpcs lack a usable admission rule.
    #[error("every rpc must declare the caller kinds it admits:\n  {}", problems.join("\n  "))]
    Admission { problems: Vec<String> },
}

fn main() -> ExitCode {
    match build() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let mut report = format!("error: {error}");
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                let _ = write!(report, ": {cause}");
                source = cause.source();
            }
            eprintln!("{report}");
            ExitCode::FAILURE
        }
    }
}

fn build() -> Result<(), BuildError> {
    let manifest_dir = PathBuf::from(cargo_env("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(cargo_env("OUT_DIR")?);
    let proto_dir = manifest_dir.join("../../proto");
    let proto_dir =
        fs::canonicalize(&proto_dir).map_err(|source| BuildError::Io { path: proto_dir.clone(), source })?;
    println!("cargo:rerun-if-changed={}", proto_dir.display());

    let mut files = Vec::new();
    collect_protos(&proto_dir.join("berth"), &mut files)?;
    files.sort();

    let mut compiler = protox::Compiler::new([&proto_dir]).map_err(BuildError::Compile)?;
    // Source info keeps the comments, for rustdoc and for `grpcurl describe`; imports
    // keep the well-known types, so reflection clients can resolve every dependency.
    compiler.include_source_info(true).include_imports(true);
    compiler.open_files(&files).map_err(BuildError::Compile)?;

    let descriptor_path = out_dir.join(DESCRIPTOR_FILE);
    fs::write(&descriptor_path, compiler.encode_file_descriptor_set())
        .map_err(|source| BuildError::Io { path: descriptor_path, source })?;

    let access = admission_table(&compiler.descriptor_pool())?;
    let access_path = out_dir.join(ACCESS_FILE);
    fs::write(&access_path, access).map_err(|source| BuildError::Io { path: access_path, source })?;

    // Type names (`prost::Name`) let a client find any message's descriptor, so
    // `berth_proto::json` prints every message by the proto3 JSON mapping.
    let mut config = prost_build::Config::new();
    config.enable_type_names();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // An RPC a service has not built yet answers UNIMPLEMENTED instead
        // of being stubbed by hand in every service.
        .generate_default_stubs(true)
        .compile_fds_with_config(compiler.file_descriptor_set(), config)
        .map_err(BuildError::Codegen)?;

    let mut spiffe = protox::Compiler::new([&proto_dir]).map_err(BuildError::Compile)?;
    spiffe.include_imports(true);
    spiffe.open_files([proto_dir.join(SPIFFE_WORKLOAD_API)]).map_err(BuildError::Compile)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(spiffe.file_descriptor_set())
        .map_err(BuildError::Codegen)
}

fn cargo_env(name: &'static str) -> Result<String, BuildError> {
    env::var(name).map_err(|source| BuildError::CargoEnv { name, source })
}

fn collect_protos(dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), BuildError> {
    let io_error = |source| BuildError::Io { path: dir.to_owned(), source };
    for entry in fs::read_dir(dir).map_err(io_error)? {
        let path = entry.map_err(io_error)?.path();
        if path.is_dir() {
            collect_protos(&path, files)?;
        } else if path.extension().is_some_and(|ext| ext == "proto") {
            files.push(path);
        }
    }
    Ok(())
}

/// Reads the access option of every rpc and renders the Rust source of the table,
/// sorted by path so `access::allowed` can binary-search it.
fn admission_table(pool: &DescriptorPool) -> Result<String, BuildError> {
    let extension = pool.get_extension_by_name(ACCESS_EXTENSION).ok_or(BuildError::NoAccessExtension)?;

    let mut services = Vec::new();
    let mut methods = Vec::new();
    let mut problems = Vec::new();
    for service in pool.services() {
        services.push(service.full_name().to_owned());
        for method in service.methods() {
            let path = format!("/{}/{}", service.full_name(), method.name());
            let options = method.options();
            if !options.has_extension(&extension) {
                problems.push(format!("rpc {path} has no ({ACCESS_EXTENSION}) option"));
                continue;
            }
            let mut values = Vec::new();
            if let Value::Message(access) = options.get_extension(&extension).as_ref()
                && let Some(allow) = access.get_field_by_name("allow")
                && let Value::List(list) = allow.as_ref()
            {
                values.clone_from(list);
            }
            if values.is_empty() {
                problems.push(format!("rpc {path} admits no caller kind"));
                continue;
            }
            let mut kinds = Vec::new();
            for value in &values {
                match value.as_enum_number().and_then(caller_kind) {
                    Some(kind) => kinds.push(kind),
                    None => problems
                        .push(format!("rpc {path} admits {}, which names no caller kind", describe_kind(pool, value))),
                }
            }
            if kinds.len() != values.len() {
                continue;
            }
            kinds.sort_by_key(|(number, _)| *number);
            kinds.dedup();
            methods.push((path, kinds));
        }
    }
    if !problems.is_empty() {
        return Err(BuildError::Admission { problems });
    }
    services.sort();
    methods.sort();

    let mut out = String::from("// Generated by build.rs from the (berth.auth.v1.access) option of every rpc.\n\n");
    out.push_str(
        "/// Every RPC of the API by its gRPC path (\"/berth.identity.v1.JoinTokens/CreateJoinToken\")\n\
         /// with the caller kinds it admits, sorted by path.\n\
         pub static METHODS: &[(&str, &[berth_core::CallerKind])] = &[\n",
    );
    for (path, kinds) in &methods {
        let kinds: Vec<String> = kinds.iter().map(|(_, name)| format!("berth_core::CallerKind::{name}")).collect();
        let _ = writeln!(out, "    ({path:?}, &[{}]),", kinds.join(", "));
    }
    out.push_str(
        "];\n\n\
         /// The fully qualified names of every gRPC service in the API (\"berth.identity.v1.JoinTokens\", ...), sorted.\n\
         pub static SERVICES: &[&str] = &[\n",
    );
    for service in &services {
        let _ = writeln!(out, "    {service:?},");
    }
    out.push_str("];\n");
    Ok(out)
}

/// How an admitted value is spelled in the .proto file, for error messages.
fn describe_kind(pool: &DescriptorPool, value: &Value) -> String {
    let Some(number) = value.as_enum_number() else {
        return format!("{value:?}");
    };
    pool.get_enum_by_name("berth.auth.v1.CallerKind")
        .and_then(|kinds| kinds.get_value(number))
        .map_or_else(|| number.to_string(), |kind| kind.name().to_owned())
}

/// The `berth_core::CallerKind` variant for a `berth.auth.v1.CallerKind` number, with
/// the number to order by; `None` for UNSPECIFIED and numbers the enum does not define.
fn caller_kind(number: i32) -> Option<(i32, &'static str)> {
    let name = match number {
        1 => "Anonymous",
        2 => "Node",
        3 => "Service",
        4 => "Admin",
        5 => "Router",
        6 => "Workload",
        _ => return None,
    };
    Some((number, name))
}
