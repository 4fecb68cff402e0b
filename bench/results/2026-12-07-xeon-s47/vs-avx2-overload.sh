#!/usr/bin/env bash
# As run, session 47 (05:16-05:33 UTC), from the repository root: the
# side-by-side's 2x overload and conversation, 3 alternating rounds, AVX2 leg
# (eb11c03's AVX2 build; the peer's AVX2 llama-server), after the fresh-clone
# CI of f37ef2e had ended.
SLUICE_BIN=/tmp/s47/sluice-avx2-eb11c03 ROUNDS=3 SKIP_CLOSED=1 SKIP_LONG=1 SKIP_MIX=1 SKIP_HOL=1 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server \
    bench/results/2026-12-07-xeon-s47/vs-avx2-overload
