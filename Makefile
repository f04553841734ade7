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

## Container images, where a Docker engine runs.
images:
	docker build -f docker/Dockerfile -t berth:dev .
