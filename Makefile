# The two commands that matter: `make dev` runs the mesh, `make test` passes
# the tests. Both do their own set-up on a machine with Rust.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo

.PHONY: dev test test-faults lint deny audit fmt build bench images check-manifests test-deps vminit

## Run the whole mesh in one process on .berth/dev (Ctrl-C stops it, and
## the dev node's workloads with it). As root, the dev node contains its
## workloads through runc, which this installs first where it is missing.
## berth-runtime, the process runtime's launcher, is built beside berth
## for `berth dev --runtime process`.
dev:
	@if [ "$$(id -u)" = 0 ]; then scripts/runtime-deps.sh; fi
	$(CARGO) build -p berth-agent --bin berth-runtime
	$(CARGO) run --bin berth -- dev

## Lint, then every test against real PostgreSQL, Redis and grpcurl.
test: lint deny check-manifests
	grpcurl="$$(scripts/test-deps.sh)"; \
	$(MAKE) --no-print-directory vminit; \
	if $(CARGO) nextest --version >/dev/null 2>&1; then \
	  BERTH_GRPCURL="$$grpcurl" $(CARGO) nextest run --workspace --no-fail-fast; \
	else \
	  BERTH_GRPCURL="$$grpcurl" $(CARGO) test --workspace --no-fail-fast; \
	fi
	$(MAKE) --no-print-directory test-faults

## The mesh as processes (two replicas of each service, a private
## PostgreSQL and Redis, agents): the fault suite under load, through one
## fault at a time (prints a table, fails on any broken promise), one
## trace followed across every hop into an in-test OTLP collector, the
## README's compose walkthrough, line by line, with compose.yaml's services
## run as processes, and a fleet upgrade of the agents from a registry.
##
## It runs on the workspace test build (whose agent has error injection, see
## tests/Cargo.toml), so after `make test` nothing is built again.
test-faults:
	grpcurl="$$(scripts/test-deps.sh)"; \
	if $(CARGO) nextest --version >/dev/null 2>&1; then \
	  BERTH_GRPCURL="$$grpcurl" $(CARGO) nextest run --workspace --run-ignored only --no-capture \
	    -E 'package(berth-e2e) & (binary(faults) | binary(traces) | binary(compose) | binary(upgrade) | binary(caches))'; \
	else \
	  $(CARGO) build --bins -p berth -p berth-identity -p berth-revisions -p berth-leases -p berth-egress \
	    -p berth-router -p berth-agent --features berth-agent/fault-injection; \
	  BERTH_GRPCURL="$$grpcurl" $(CARGO) test -p berth-e2e --test faults --test traces --test compose --test upgrade --test caches \
	    -- --ignored --nocapture --test-threads 1; \
	fi

## The microVM guest's init, linked statically (it runs alone in the
## guest's initramfs), built for the target named so that its flags do not
## reach the workspace's other builds:
## target/x86_64-unknown-linux-gnu/release/berth-vminit.
vminit:
	$(CARGO) rustc --quiet --release --target x86_64-unknown-linux-gnu -p berth-vminit --bin berth-vminit \
	  -- -C target-feature=+crt-static

## Formatting and clippy, as CI runs them.
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p berth-agent --lib --bins -- -D warnings

## The dependency tree held to deny.toml: only the licenses it lists, no
## second version of a crate it does not list, crates.io as the only source.
deny:
	@scripts/test-deps.sh >/dev/null
	$(CARGO) deny check bans licenses sources

## The dependency tree against the RustSec advisory database (needs the network).
audit:
	@scripts/test-deps.sh >/dev/null
	$(CARGO) deny check advisories

fmt:
	$(CARGO) fmt --all

build:
	$(CARGO) build --workspace --bins

## Install or start what the tests need, without running them.
test-deps:
	@scripts/test-deps.sh >/dev/null

## Release binaries, then `berth-bench heartbeats` against PostgreSQL and
## Redis (each run in a scratch database and Redis logical database 15, both
## removed afterwards): a quick 1,000-node run, then the issue's scenario of
## 10,000 nodes heartbeating every second; lease placement and launch; and
## deploys (apply to RUNNING, warm and cold from a loopback registry, and the
## mint rate); the egress compile, the node proxy's overhead, and how long
## a route edit takes to be in force on a real node; and requests through
## the router beside direct ones and two bare byte relays, route changes,
## and the router's memory;
## a tenant's resolver beside a direct query (needs root, as a node does);
## a pull through a failing registry mirror beside a direct one.
## BENCHMARKS.md records the figures.
bench:
	$(CARGO) build --release --bins
	@scripts/test-deps.sh >/dev/null
	bench="$${CARGO_TARGET_DIR:-target}/release/berth-bench"; \
	database="$${BERTH_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"; \
	redis="$${BERTH_BENCH_REDIS_URL:-redis://127.0.0.1:6379/15}"; \
	"$$bench" heartbeats --nodes 1000 --interval 1s --duration 10s --warmup 3s \
	  --database-url "$$database" --redis-url "$$redis"; \
	"$$bench" heartbeats --nodes 10000 --interval 1s --duration 30s --warmup 5s \
	  --database-url "$$database" --redis-url "$$redis"
	bench="$${CARGO_TARGET_DIR:-target}/release/berth-bench"; \
	database="$${BERTH_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"; \
	redis="$${BERTH_BENCH_REDIS_URL:-redis://127.0.0.1:6379/15}"; \
	"$$bench" leases --nodes 100 --leases 10000 --concurrency 32 --duration 5s \
	  --database-url "$$database" --redis-url "$$redis"; \
	"$$bench" launch --leases 100 --records 10000; \
	"$$bench" launch --runtime runc --leases 30 --records 0 --compare 50; \
	"$$bench" launch --runtime runsc --leases 30 --records 0 --compare 50; \
	"$$bench" deploy --warm 30 --cold 10 --bundle-mib 10 --mints 200 \
	  --database-url "$$database" --redis-url "$$redis"; \
	"$$bench" egress; \
	"$$bench" egress-push; \
	"$$bench" router; \
	"$$bench" svids; \
	"$$bench" dns; \
	"$$bench" mirror; \
	"$$bench" cache

## Container images, where a Docker engine runs: one per binary, tagged
## <binary>:dev, from one build of the workspace (docker/Dockerfile).
images:
	for target in berth berth-identity berth-revisions berth-leases berth-egress berth-router; do \
	  docker build -f docker/Dockerfile --target "$$target" -t "$$target:dev" .; \
	done
	# As compose builds it: examples/hello runs python3 in the agent's container.
	docker build -f docker/Dockerfile --target berth-agent --build-arg AGENT_PACKAGES=python3 -t berth-agent:dev .

## The Dockerfile, compose.yaml and the k8s/ kustomizations, checked with
## the real tools (installed from PyPI when missing); no engine or cluster.
check-manifests:
	scripts/check-manifests.sh
