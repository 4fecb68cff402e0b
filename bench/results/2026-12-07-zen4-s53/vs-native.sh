#!/usr/bin/env bash
# Session 53, from the repository root, nothing else running: the whole
# side-by-side on the native leg, 5f67197's native build (target-cpu=native,
# GGML_NATIVE: AVX-512 on this Zen 4; copied to /tmp first) against the native
# llama-server (/work/peer/build-native, GGML_NATIVE=ON, same llama.cpp/ggml
# as the crate vendors), 3 alternating rounds, every workload; the mixes at
# the rates session 51 chose for this CPU (0.1/s below capacity, 0.4/s over).
SLUICE_BIN=/tmp/s53/sluice-native ROUNDS=3 MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
  bench/scripts/vs-llama-server /work/peer/build-native/bin/llama-server /tmp/s53/vs-native
