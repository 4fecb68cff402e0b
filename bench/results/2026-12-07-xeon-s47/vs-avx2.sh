#!/usr/bin/env bash
# As run, session 47 (03:29-04:56 UTC), from the repository root: the
# side-by-side's closed loops, long-prompt loops and mixes, 3 alternating
# rounds, AVX2 leg (eb11c03's AVX2 build; the peer's AVX2 llama-server).
# The head-of-line workload ran apart (hol/run.sh); the 2x overload and the
# conversation were left out for the session's time.
SLUICE_BIN=/tmp/s47/sluice-avx2-eb11c03 ROUNDS=3 SKIP_HOL=1 SKIP_OVERLOAD=1 SKIP_CONVERSATION=1 \
    MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server \
    bench/results/2026-12-07-xeon-s47/vs-avx2
