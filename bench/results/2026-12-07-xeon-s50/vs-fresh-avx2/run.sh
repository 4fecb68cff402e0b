#!/usr/bin/env bash
# Session 50, 12:52-13:27 UTC, as run from the repository root (nothing else
# running): the fresh-prompt closed loops of the side-by-side (8 loops, 3
# alternating rounds, 30 s each) against the AVX2 llama-server, with
# da6c9bb's AVX2 build (its --version says da6c9bbfbb76-dirty: an uncommitted
# results README at build time; the code is da6c9bb's).
set -euo pipefail
RUSTFLAGS="-C target-cpu=x86-64-v3" ./deploy/cargo build --release -p sluice --target-dir target/avx2
cp target/avx2/release/sluice /tmp/s50/sluice-avx2-da6c9bb
SLUICE_BIN=/tmp/s50/sluice-avx2-da6c9bb ROUNDS=3 CLOSED_PROMPTS=fresh SKIP_LONG=1 SKIP_MIX=1 \
    SKIP_CONVERSATION=1 SKIP_HOL=1 SKIP_OVERLOAD=1 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server /tmp/s50/vs-fresh
