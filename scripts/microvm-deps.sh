#!/usr/bin/env bash
# Installs what a node needs to run leases as microVMs, where missing:
# QEMU's x86 system emulator (Debian's qemu-system-x86, whose `microvm`
# machine berth drives) and a guest kernel laid out as berth's microVM
# runtime reads it: Debian's cloud kernel (linux-image-cloud-amd64),
# unpacked from its package rather than installed (nothing of the host's
# boot changes), its vmlinuz and the modules the guest loads copied into
# ${BERTH_MICROVM_KERNEL:-/opt/berth/microvm/kernel}; and virtiofsd, which
# shares a node's directories with a guest (cache volumes, the host's /usr
# for bundles, identity files): Debian's bookworm has no package of it, so
# it is built from crates.io into /opt/berth/virtiofsd where no virtiofsd is
# found. Needs root (or sudo).
set -euo pipefail

log() { echo "microvm-deps: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
kernel_dir=${BERTH_MICROVM_KERNEL:-/opt/berth/microvm/kernel}
# The modules the guest loads (berth_microvm::kernel::MODULES) and where
# the cloud kernel keeps them.
modules="drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_mmio
  drivers/block/virtio_blk drivers/char/virtio_console fs/overlayfs/overlay
  net/core/failover drivers/net/net_failover drivers/net/virtio_net fs/fuse/fuse fs/fuse/virtiofs"

apt_ready=
apt_update() { if [ -z "$apt_ready" ]; then as_root apt-get update -qq >&2; apt_ready=1; fi; }

# socat relays a guest's Workload API connections to its lease's socket.
if ! command -v socat >/dev/null; then
  log "installing socat"
  apt_update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends socat >&2
fi

if ! command -v qemu-system-x86_64 >/dev/null; then
  log "installing qemu-system-x86"
  apt_update
  packages=(qemu-system-x86)
  # A newer qemu-utils (from backports) refuses to stand beside bookworm's
  # emulator; take the emulator's own release of it instead of dropping it.
  if dpkg-query -W -f '${Status}' qemu-utils 2>/dev/null | grep -q "ok installed"; then
    packages+=("qemu-utils=$(apt-cache policy qemu-system-x86 | sed -n 's/^ *Candidate: //p')")
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --allow-downgrades \
    "${packages[@]}" >&2
fi

laid_out() {
  [ -f "$kernel_dir/vmlinuz" ] || return 1
  for module in $modules; do [ -f "$kernel_dir/modules/$(basename "$module").ko" ] || return 1; done
}
if ! laid_out; then
  apt_update
  image=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*\)$/\1/p' | head -1)
  [ -n "$image" ] || { log "no linux-image-cloud-amd64 in the package lists"; exit 1; }
  log "unpacking $image into $kernel_dir"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download "$image" >&2 2>/dev/null || (cd "$work" && as_root apt-get download "$image" >&2))
  dpkg-deb -x "$work"/*.deb "$work/root"
  version=${image#linux-image-}
  as_root mkdir -p "$kernel_dir.partial/modules"
  as_root cp "$work/root/boot/vmlinuz-$version" "$kernel_dir.partial/vmlinuz"
  for module in $modules; do
    source=$(ls "$work/root/lib/modules/$version/kernel/$module".ko* | head -1)
    case "$source" in
      *.ko) as_root cp "$source" "$kernel_dir.partial/modules/" ;;
      *.ko.xz) xz -dc "$source" | as_root tee "$kernel_dir.partial/modules/$(basename "$module").ko" >/dev/null ;;
      *) log "no module $module in $image"; exit 1 ;;
    esac
  done
  echo "$version" | as_root tee "$kernel_dir.partial/version" >/dev/null
  as_root rm -rf "$kernel_dir"
  as_root mv "$kernel_dir.partial" "$kernel_dir"
fi

# The Rust virtiofsd, where the distribution's is not installed (berth_microvm::install::VIRTIOFSD_PLACES;
# QEMU's older C one in /usr/lib/qemu takes another command line).
virtiofsd_version=1.14.0
if ! command -v virtiofsd >/dev/null && ! [ -x /usr/libexec/virtiofsd ] && ! [ -x /opt/berth/virtiofsd/bin/virtiofsd ]; then
  if apt-cache show virtiofsd >/dev/null 2>&1; then
    log "installing virtiofsd"
    apt_update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends virtiofsd >&2
  else
    log "building virtiofsd $virtiofsd_version from crates.io into /opt/berth/virtiofsd"
    apt_update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libcap-ng-dev libseccomp-dev pkg-config >&2
    work=$(mktemp -d)
    env -u CARGO_TARGET_DIR cargo install --locked --quiet virtiofsd --version "$virtiofsd_version" \
      --root "$work/root" --target-dir "$work/target" >&2
    as_root mkdir -p /opt/berth/virtiofsd/bin
    as_root install -m 0755 "$work/root/bin/virtiofsd" /opt/berth/virtiofsd/bin/virtiofsd
    rm -rf "$work"
  fi
fi
