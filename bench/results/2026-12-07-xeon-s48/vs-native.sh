#!/usr/bin/env bash
# As run, session 48, from the repository root: the whole side-by-side in
# one run (every workload), 3 alternating rounds, 30 s loops, native leg
# (f93c26f's native build, AVX-512/VNNI/AMX; the peer's native llama-server,
# llama.cpp 3f545becc with the crate's ggml). Mix rates as session 44's
# native leg.
SLUICE_BIN=/tmp/s48/sluice-native-f93c26f ROUNDS=3 \
    MIX_S=90 MIX_BELOW_RPS=0.3 MIX_OVER_RPS=1.0 \
    bench/scripts/vs-llama-server /work/peer/build-native/bin/llama-server \
    bench/results/2026-12-07-xeon-s48/vs-native
