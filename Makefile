# The two set-up commands (see README.md):
#   make serve   installs build dependencies, fetches the default model, builds
#                sluice for this CPU and serves on 127.0.0.1:8080
#   make test    the same set-up, then the whole test suite
# and, to install it as a service:
#   make deb     the Debian package, built for x86-64-v3 (any AVX2 CPU)
#   make install that package, installed with apt (as root or with sudo)
#
# Everything is built with --release: the tests run the real model, and a debug
# build of llama.cpp is too slow to serve it.

# The first cargo at least as new as Cargo.toml's rust-version (PATH, then
# rustup's ~/.cargo/bin, then under sudo the invoking user's); a sentence and
# exit 1 when there is none.
CARGO ?= ./deploy/cargo
ARGS ?=
# The package's binary is built in its own target directory, for x86-64-v3,
# so that `make build`'s binary stays the one for this CPU.
DEB_TARGET ?= target/x86-64-v3
DEB_VERSION = $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -n 1)
DEB = target/debian/sluice_$(DEB_VERSION)-1_amd64.deb

# llama.cpp is compiled through ccache where it is installed (install-deps
# installs it): its model code and ggml's base compile to the same objects in
# `make build` and `make deb`, about 3 of the 4 minutes each takes here. The
# cache is kept in target/, so `cargo clean` empties it; CCACHE_BASEDIR makes
# the two build directories' paths the same to it.
export CMAKE_C_COMPILER_LAUNCHER = $(CURDIR)/deploy/compiler-cache
export CMAKE_CXX_COMPILER_LAUNCHER = $(CURDIR)/deploy/compiler-cache
export CCACHE_BASEDIR = $(CURDIR)
export CCACHE_DIR ?= $(CURDIR)/target/ccache
# The package's build only reads the cache, and without its -march=x86-64-v3,
# which llama-cpp-sys-2 puts on every file: so llama.cpp's model code and
# ggml's base come from `make build`'s objects, compiled for any x86-64 (no
# -march there). ggml's CPU kernels still differ in their own flags (AVX2,
# FMA, F16C, BMI2 here; -march=native there) and are compiled for the package.
DEB_CCACHE = CCACHE_READONLY=1 CCACHE_IGNOREOPTIONS=-march=x86-64-v3

.PHONY: serve test unit integration test-setup service-unit lint deps model test-models build deb install

serve: deps model build
	./target/release/sluice serve $(ARGS)

# The unit tests' build (llama.cpp, minutes of CPU) and the integration
# tests' set-up (the second model, the test virtualenv: about a minute here,
# a third of it waiting on the network) run side by side; then the package's
# build and the suite.
test: deps model
	@$(MAKE) --no-print-directory test-setup & setup=$$!; \
	$(MAKE) --no-print-directory unit; unit=$$?; \
	wait $$setup && [ $$unit -eq 0 ]
	@$(MAKE) --no-print-directory integration service-unit

deps:
	./deploy/install-deps

model:
	./models/fetch

# The second model family the suite runs (Gemma 3, 270M, Q4_K_M).
test-models: model
	./models/fetch gemma3

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
integration: test-setup build deb
	$(CARGO) test --release --test it -- --test-threads=1

# What the integration tests need beside sluice: the second model, HAProxy,
# promtool, Chromium, ss, qemu-user and the test virtualenv.
test-setup: deps test-models
	./deploy/install-deps --for-tests

# The Debian package (cargo-deb): /usr/bin/sluice built for x86-64-v3, the
# units, /etc/default/sluice, the default model. In target/debian/.
deb: deps model
	./deploy/install-deps --for-package
	RUSTFLAGS="-C target-cpu=x86-64-v3" $(DEB_CCACHE) $(CARGO) build --release --bin sluice --target-dir $(DEB_TARGET)
	CARGO_TARGET_DIR=$(DEB_TARGET) $(CARGO) deb --no-build --strip --fast --output $(DEB)

# Installs (or upgrades to) the package: the service starts on 127.0.0.1:8080.
install: deb
	$(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y ./$(DEB)

# deploy/sluice.service passes `systemd-analyze verify`.
service-unit: build
	./deploy/verify-unit

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
