#!/usr/bin/env bash
# As run, session 46 (2026-12-07), 2-core Xeon KVM (AVX-512, AMX), from the
# repository root at b91a770: the whole side-by-side, AVX2 leg (both built for
# x86-64-v3), loops at the harness's new default of 30 s.
set -euo pipefail
RUSTFLAGS="-C target-cpu=x86-64-v3" ./deploy/cargo build --release -p sluice --target-dir target/avx2
./deploy/cargo build --release --workspace
out=bench/results/2026-12-07-xeon-s46/vs-avx2
SLUICE_BIN=./target/avx2/release/sluice ROUNDS=3 MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server "$out"
# (the script writes summary.md itself)
