#!/usr/bin/env bash
# Installs what a node needs to contain its workloads, from Debian's
# packages, where missing: the OCI runtimes (runc for cgroup v1, hybrid and
# v2; crun for cgroup v2; runsc, gVisor's user-space kernel), tini, the init
# each container's workload runs under, and busybox-static, which the tests
# build container images from. Needs root (or sudo) to install.
set -euo pipefail

log() { echo "runtime-deps: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

missing=()
for pair in runc:runc crun:crun runsc:runsc tini-static:tini busybox:busybox-static; do
  binary=${pair%%:*} package=${pair##*:}
  if ! command -v "$binary" >/dev/null && [ ! -x "/usr/bin/$binary" ] && [ ! -x "/usr/sbin/$binary" ]; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  as_root apt-get update -qq >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
fi
