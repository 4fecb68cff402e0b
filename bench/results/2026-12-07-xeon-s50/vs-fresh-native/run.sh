#!/usr/bin/env bash
# Session 50, 13:54-14:23 UTC, as run from the repository root (nothing else
# running): the fresh-prompt closed loops of the side-by-side (8 loops, 3
# alternating rounds, 30 s each) against the native llama-server (AMX
# kernels on both sides), with e0815ff's native build (its engine is
# da6c9bb's; e0815ff changed tests only).
set -euo pipefail
./deploy/cargo build --release --workspace
cp target/release/sluice /tmp/s50/sluice-native-e0815ff
SLUICE_BIN=/tmp/s50/sluice-native-e0815ff ROUNDS=3 CLOSED_PROMPTS=fresh SKIP_LONG=1 SKIP_MIX=1 \
    SKIP_CONVERSATION=1 SKIP_HOL=1 SKIP_OVERLOAD=1 \
    bench/scripts/vs-llama-server /work/peer/build-native/bin/llama-server /tmp/s50/vs-fresh-native
