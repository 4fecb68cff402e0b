# The two set-up commands (see README.md):
#   make serve   installs build dependencies, fetches the default model, builds
#                sluice for this CPU and serves on 127.0.0.1:8080
#   make test    the same set-up, then the whole test suite
#
# Everything is built with --release: the tests run the real model, and a debug
# build of llama.cpp is too slow to serve it.

CARGO ?= cargo
ARGS ?=

.PHONY: serve test unit integration service-unit lint deps model build

serve: deps model build
	./target/release/sluice serve $(ARGS)

test: deps model unit integration service-unit

deps:
	./deploy/install-deps

model:
	./models/fetch

build:
	$(CARGO) build --release --workspace

# Pure logic (planner, detokenizer, validation, SSE and HTTP framing, ...), in parallel;
# then the vendored tiny_http's (headers, methods).
unit: deps
	$(CARGO) test --release --workspace --bins --lib
	$(CARGO) test --release --test structure
	$(CARGO) test --release -p tiny_http --lib

# The real binary and the real model over real sockets; one at a time, since
# each test's server uses every core. `build` provides the sluice-bench binary.
integration: deps model build
	./deploy/install-deps --for-tests
	$(CARGO) test --release --test it -- --test-threads=1

# deploy/sluice.service passes `systemd-analyze verify`.
service-unit: build
	./deploy/verify-unit

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
