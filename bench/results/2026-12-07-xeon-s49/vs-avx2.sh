#!/usr/bin/env bash
# As run, session 49, from the repository root: the whole side-by-side in
# one run (every workload), 3 alternating rounds, 30 s loops, AVX2 leg
# (f93c26f's AVX2 build, RUSTFLAGS="-C target-cpu=x86-64-v3": the engine
# code of eb11c03 and of c4caa84; the peer's AVX2 llama-server, llama.cpp
# 3f545becc with the crate's ggml). Mix rates as session 47's AVX2 leg.
SLUICE_BIN=/tmp/s49/sluice-avx2-f93c26f ROUNDS=3 \
    MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server \
    bench/results/2026-12-07-xeon-s49/vs-avx2
