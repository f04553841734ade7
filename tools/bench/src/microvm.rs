//! `berth-bench microvm`: what the microVM runtime costs a launch and a
//! node, at the provider, beside a runc container of the same workload in
//! the same run.
//!
//! # What it measures
//! - **launch**: `Provider::launch` of `sleep` (the host's `/usr`, shared
//!   over virtio-fs in the VM, bound in the container) until the workload
//!   runs: for a VM, until its init reports the workload started (boot,
//!   drives, root, user); for the container, until its pid is known. One
//!   at a time, each destroyed before the next, the two kinds interleaved.
//! - **memory**: each VM's VMM process (QEMU) while its workload runs:
//!   its resident memory, the part of it that is the guest's memory (the
//!   one mapping the size of the guest's RAM: what the guest touched), and
//!   the rest, the VMM's own overhead, which is what the target holds;
//!   beside it, what the `virtiofsd` daemons sharing the node's `/usr` with
//!   the VM hold (the VM's cost too).
//! - **at once**: `--at-once` VMs launched together, each until its
//!   workload runs: how many fail, and how long the last took.
//!
//! Targets: a VM's workload runs within 500 ms of the request, p50; a VMM
//! costs at most 40 MiB beyond its guest; 10 VMs at once, none failing.

use std::time::{Duration, Instant};

use berth_agent::{
    ContainerProvider, ContainerSettings, MicroVmAccel, MicroVmConfig, MicroVmProvider, MicroVmSettings, OciRuntime,
    ProcessTiming, Provider, UidRange, guest_memory_mib,
};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::dev::Series;
use crate::output::{OutputFormat, print_report, progress};
use crate::runtime_launch::sleep_spec;

/// A VM's workload should run within this of the request, p50, ms.
const TARGET_LAUNCH_P50_MS: f64 = 500.0;
/// A VMM should cost at most this beyond its guest, MiB.
const TARGET_OVERHEAD_MIB: f64 = 40.0;
/// How long one VM may take to run its workload before it counts as failed.
const START_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct MicroVmArgs {
    /// Launches timed of each kind.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    launches: u32,
    /// VMs launched together.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100))]
    at_once: u32,
    /// How guest code runs: auto, kvm or tcg.
    #[arg(long, default_value = "auto", value_parser = str::parse::<MicroVmAccel>)]
    accel: MicroVmAccel,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table, value_name = "FORMAT")]
    output: OutputFormat,
}

#[derive(Debug, Serialize)]
struct Report {
    scenario: &'static str,
    accel: String,
    guest_memory_mib: u64,
    launch_container: Series,
    launch_microvm: Series,
    vmm_rss_mib: Series,
    vmm_guest_mib: Series,
    vmm_overhead_mib: Series,
    share_daemons_mib: Series,
    at_once: u32,
    at_once_failed: u32,
    at_once_all_running_ms: f64,
    target_launch_p50_ms: f64,
    target_overhead_mib: f64,
}

pub(crate) async fn run(args: MicroVmArgs) -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("running containers beside the VMs needs root".into());
    }
    let dir = tempfile::tempdir().map_err(|e| format!("cannot make a directory: {e}"))?;
    let stop = CancellationToken::new();
    let timing = ProcessTiming { stop_grace: Duration::from_secs(2), exit_poll: Duration::from_millis(50) };
    let config = MicroVmConfig { accel: args.accel, ..MicroVmConfig::default() };
    let settings = MicroVmSettings::from_config(&config, timing)?;
    let vms = MicroVmProvider::new(&dir.path().join("vms"), settings, stop.clone());
    let runc = OciRuntime::Runc;
    let containers = ContainerProvider::new(
        &dir.path().join("containers"),
        ContainerSettings::new(
            runc,
            runc.binary().ok_or("runc is not installed (make test installs it)")?,
            UidRange { first: 320_000, count: 1000 },
            timing,
        ),
        stop.clone(),
    );

    // The first VM builds the initramfs and the root image, and decides
    // the accelerator: not a launch a node makes twice.
    progress("warming up: the first VM builds its images");
    let accel = launch_vm(&vms, "warm-up").await?.1;
    vms.destroy("warm-up").await.map_err(|e| e.to_string())?;

    progress(&format!("{} launches of sleep as a microVM and as a runc container, interleaved", args.launches));
    let guest_mib = u64::from(guest_memory_mib(sleep_spec("x").resources.memory_bytes));
    let (mut in_vm, mut in_container) = (Vec::new(), Vec::new());
    let (mut rss, mut guest, mut overhead, mut daemons) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for index in 0..args.launches {
        let lease_id = format!("vm-{index}");
        let (took, _, pid) = launch_vm(&vms, &lease_id).await?;
        in_vm.push(took);
        if let Some((resident, of_guest)) = memory_of(pid, guest_mib) {
            rss.push(resident);
            guest.push(of_guest);
            overhead.push(resident - of_guest);
        }
        daemons.push(daemons_of(&dir.path().join("vms/leases").join(&lease_id)));
        vms.destroy(&lease_id).await.map_err(|e| e.to_string())?;
        vms.remove(&lease_id).await.map_err(|e| e.to_string())?;

        let lease_id = format!("ct-{index}");
        let sent = Instant::now();
        let launched = containers.launch(sleep_spec(&lease_id)).await.map_err(|e| format!("launch {lease_id}: {e}"))?;
        if launched.record.pid.is_none() {
            return Err(format!("container {lease_id} did not start"));
        }
        in_container.push(sent.elapsed().as_secs_f64() * 1000.0);
        let _ = containers.destroy(&lease_id).await;
        let _ = containers.remove(&lease_id).await;
    }

    progress(&format!("{} microVMs at once", args.at_once));
    let sent = Instant::now();
    let launches = (0..args.at_once).map(|index| {
        let vms = vms.clone();
        async move { launch_vm(&vms, &format!("many-{index}")).await }
    });
    let results = futures::future::join_all(launches).await;
    let all_running_ms = sent.elapsed().as_secs_f64() * 1000.0;
    let failed = results.iter().filter(|r| r.is_err()).count();
    for error in results.iter().filter_map(|r| r.as_ref().err()) {
        progress(&format!("failed: {error}"));
    }
    for index in 0..args.at_once {
        let _ = vms.destroy(&format!("many-{index}")).await;
    }
    stop.cancel();

    let report = Report {
        scenario: "microvm",
        accel: accel.to_owned(),
        guest_memory_mib: guest_mib,
        launch_container: Series::of(in_container),
        launch_microvm: Series::of(in_vm),
        vmm_rss_mib: Series::of(rss),
        vmm_guest_mib: Series::of(guest),
        vmm_overhead_mib: Series::of(overhead),
        share_daemons_mib: Series::of(daemons),
        at_once: args.at_once,
        at_once_failed: u32::try_from(failed).unwrap_or(u32::MAX),
        at_once_all_running_ms: all_running_ms,
        target_launch_p50_ms: TARGET_LAUNCH_P50_MS,
        target_overhead_mib: TARGET_OVERHEAD_MIB,
    };
    print_report(args.output, &report, table)
}

/// Launches `lease_id` as a VM and waits until its workload runs: how long
/// that took (ms), the accelerator it ran under, and the VMM's pid.
async fn launch_vm(vms: &MicroVmProvider, lease_id: &str) -> Result<(f64, &'static str, u32), String> {
    let sent = Instant::now();
    let launched = vms.launch(sleep_spec(lease_id)).await.map_err(|e| format!("launch {lease_id}: {e}"))?;
    let pid = launched.record.pid.ok_or_else(|| format!("{lease_id}: no VMM pid"))?;
    while !vms.workload_started(lease_id) {
        if sent.elapsed() > START_TIMEOUT || launched.exit.borrow().is_some() {
            return Err(format!("{lease_id}: the workload did not start within {START_TIMEOUT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let took = sent.elapsed().as_secs_f64() * 1000.0;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let accel = if cmdline.windows(3).any(|w| w == b"kvm") { "kvm" } else { "tcg" };
    Ok((took, accel, pid))
}

/// The VMM's resident memory, and the part of it that is the guest's RAM
/// (the mapping of `guest_mib`), MiB.
fn memory_of(pid: u32, guest_mib: u64) -> Option<(f64, f64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let kib = |line: &str| line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let (mut total, mut of_guest, mut size) = (0, 0, 0);
    for line in smaps.lines() {
        if line.starts_with("Size:") {
            size = kib(line);
        } else if line.starts_with("Rss:") {
            total += kib(line);
            if size == guest_mib << 10 {
                of_guest += kib(line);
            }
        }
    }
    #[allow(clippy::cast_precision_loss, reason = "memory sizes far below 2^52 KiB")]
    Some((total as f64 / 1024.0, of_guest as f64 / 1024.0))
}

/// The resident memory of the `virtiofsd` daemons serving the VM whose run
/// directory is `run_dir` (their sockets are in it), MiB.
fn daemons_of(run_dir: &std::path::Path) -> f64 {
    let needle = run_dir.display().to_string();
    let mut kib = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let words = String::from_utf8_lossy(&cmdline);
        if words.contains("--socket-path") && words.contains(&needle) {
            let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
            kib += status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    #[allow(clippy::cast_precision_loss, reason = "memory sizes far below 2^52 KiB")]
    let mib = kib as f64 / 1024.0;
    mib
}

fn table(report: &Report) -> String {
    let mut out = Series::table(
        &format!(
            "microvm: sleep as a QEMU microVM ({}; guest {} MiB) and as a runc container, at the provider",
            report.accel, report.guest_memory_mib
        ),
        &[
            ("launch, runc container (baseline)", &report.launch_container),
            ("launch, microVM (to running)", &report.launch_microvm),
        ],
    );
    let mib = |series: &Series| series.p50_ms.map_or_else(|| "-".into(), |v| format!("{v:.1} MiB"));
    out.push_str(&format!(
        "VMM memory, median: resident {}, of which the guest's RAM {}, the VMM's own {} (target <= {} MiB)\n",
        mib(&report.vmm_rss_mib),
        mib(&report.vmm_guest_mib),
        mib(&report.vmm_overhead_mib),
        report.target_overhead_mib
    ));
    out.push_str(&format!(
        "virtiofsd sharing /usr with each VM, median: resident {}\n",
        mib(&report.share_daemons_mib)
    ));
    out.push_str(&format!(
        "{} VMs at once: {} failed, all running after {:.0} ms\n",
        report.at_once, report.at_once_failed, report.at_once_all_running_ms
    ));
    out.push_str(&format!("launch p50 target: <= {} ms\n", report.target_launch_p50_ms));
    out
}
