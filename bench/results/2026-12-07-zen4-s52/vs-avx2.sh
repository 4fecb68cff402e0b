#!/usr/bin/env bash
# Session 52, from the repository root, nothing else running: the whole
# side-by-side on the AVX2 leg, b71f834's AVX2 build (copied to /tmp first)
# against the AVX2 llama-server of session 51 (/work/peer/build-avx2), 3
# alternating rounds, every workload; the mixes at the rates session 51 chose
# for this CPU (0.1/s below capacity, 0.4/s over it).
SLUICE_BIN=/tmp/s52/sluice-avx2 ROUNDS=3 MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
  bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server /tmp/s52/vs-avx2
