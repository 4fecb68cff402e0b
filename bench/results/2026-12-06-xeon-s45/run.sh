#!/usr/bin/env bash
# Session 45, as run: the AVX2 leg of the side-by-side on the Xeon (AMX) box
# (both built for x86-64-v3; peer /work/peer/build-avx2, bench/README.md's
# recipe), after 248a042 (a prompt alone in the context where whole chunks were
# timed faster). Only what that change touches: the long-prompt loops (45 s,
# not 15: 1-2 requests a loop at 15), the mixes, the conversation. From the
# repository root: bench/results/2026-12-06-xeon-s45/run.sh
set -euo pipefail
out=bench/results/2026-12-06-xeon-s45
date -u +"avx2 start %FT%TZ" >> $out/times.txt
SLUICE_BIN=./target/avx2/release/sluice ROUNDS=3 DURATION_S=45 SKIP_CLOSED=1 SKIP_OVERLOAD=1 \
    SKIP_HOL=1 MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server $out/vs-avx2 \
    > $out/vs-avx2.log 2>&1 || echo "avx2 rc=$?" >> $out/times.txt
date -u +"end %FT%TZ" >> $out/times.txt
