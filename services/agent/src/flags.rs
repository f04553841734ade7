//! The flags that choose what contains a node's workloads, written once for
//! every binary that runs a node: `berth-agent` and `berth dev`'s own node
//! (flattened into each one's arguments, as `berth_bundle::RegistryArgs`
//! is), so both take the same names, values and environment variables.

use crate::config::WorkloadRuntime;
use crate::container::OciRuntime;
use crate::microvm::MicroVmAccel;

/// `--runtime`, `--microvm-accel` and `--oci-runtime`.
#[derive(Debug, Clone, clap::Args)]
pub struct RuntimeArgs {
    /// What runs workloads, each contained (its own user, no capabilities,
    /// its own PID and mount namespaces on a read-only root, the lease's
    /// memory and CPU as cgroup limits): `oci`, through the --oci-runtime
    /// binary, or `process`, by the agent itself with no runtime binary
    /// (the fastest start); or `microvm`, each in a QEMU microVM with a
    /// kernel of its own. Where the choice cannot run, --allow-uncontained
    /// runs plain host processes as the agent's user instead.
    #[arg(long, env = "BERTH_RUNTIME", value_name = "RUNTIME", default_value = "oci",
        value_parser = ["oci", "process", "microvm"])]
    pub runtime: String,
    /// How microVMs run guest code under --runtime microvm: `kvm`, `tcg`
    /// (QEMU's translator: no /dev/kvm, several times slower), or `auto`,
    /// KVM where a probe VM boots under it.
    #[arg(long, env = "BERTH_MICROVM_ACCEL", value_name = "ACCEL", default_value = "auto",
        value_parser = str::parse::<MicroVmAccel>)]
    pub microvm_accel: MicroVmAccel,
    /// The OCI runtime binary for --runtime oci: `runc` (cgroup v1, hybrid
    /// and v2), `crun` (cgroup v2 only), or `runsc` (gVisor: a user-space
    /// kernel between each workload and the host, for untrusted code).
    #[arg(long, env = "BERTH_OCI_RUNTIME", value_name = "NAME", default_value = "runc",
        value_parser = str::parse::<OciRuntime>)]
    pub oci_runtime: OciRuntime,
}

impl RuntimeArgs {
    /// The runtime the flags name.
    pub fn workload_runtime(&self) -> Result<WorkloadRuntime, String> {
        WorkloadRuntime::from_flags(&self.runtime, self.oci_runtime)
    }
}
