# The two commands that matter: `make dev` runs the mesh, `make test` passes
# the tests. Both do their own set-up on a machine with Rust.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo

.PHONY: dev test lint fmt build bench images test-deps

## Run the whole mesh in one process on .berth/dev (Ctrl-C stops it).
dev:
	$(CARGO) run --bin berth -- dev

## Lint, then every test against real PostgreSQL, Redis and grpcurl.
test: lint
	grpcurl="$$(scripts/test-deps.sh)"; \
	if $(CARGO) nextest --version >/dev/null 2>&1; then \
	  BERTH_GRPCURL="$$grpcurl" $(CARGO) nextest run --workspace --no-fail-fast; \
	else \
	  BERTH_GRPCURL="$$grpcurl" $(CARGO) test --workspace --no-fail-fast; \
	fi

## Formatting and clippy, as CI runs them.
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

build:
	$(CARGO) build --workspace --bins

## Install or start what the tests need, without running them.
test-deps:
	@scripts/test-deps.sh >/dev/null

## Release binaries, then `berth bench heartbeats` against PostgreSQL and
## Redis (each run in a scratch database and Redis logical database 15, both
## removed afterwards): a quick 1,000-node run, then the issue's scenario of
## 10,000 nodes heartbeating every second. BENCHMARKS.md records the figures.
bench:
	$(CARGO) build --release --bins
	@scripts/test-deps.sh >/dev/null
	berth="$${CARGO_TARGET_DIR:-target}/release/berth"; \
	database="$${BERTH_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"; \
	redis="$${BERTH_BENCH_REDIS_URL:-redis://127.0.0.1:6379/15}"; \
	"$$berth" bench heartbeats --nodes 1000 --interval 1s --duration 10s --warmup 3s \
	  --database-url "$$database" --redis-url "$$redis"; \
	"$$berth" bench heartbeats --nodes 10000 --interval 1s --duration 30s --warmup 5s \
	  --database-url "$$database" --redis-url "$$redis"
	berth="$${CARGO_TARGET_DIR:-target}/release/berth"; \
	database="$${BERTH_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"; \
	redis="$${BERTH_BENCH_REDIS_URL:-redis://127.0.0.1:6379/15}"; \
	"$$berth" bench leases --nodes 100 --leases 10000 --concurrency 32 --duration 5s \
	  --database-url "$$database" --redis-url "$$redis"; \
	"$$berth" bench launch --leases 100 --records 10000

## Container images, where a Docker engine runs.
images:
	docker build -f docker/Dockerfile -t berth:dev .
