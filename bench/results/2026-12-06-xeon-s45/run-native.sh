#!/usr/bin/env bash
# Session 45, as run after run.sh: the same parts of the side-by-side on the
# native leg (AMX kernels on both sides; peer /work/peer/build-native), to see
# that 248a042 changes nothing there (--calibrate-only times flash attention
# with f16 9.56x worse on this CPU, so no request alone moves; only the rule
# for deep prompts beside short streams applies). Mix rates as session 44's.
set -euo pipefail
out=bench/results/2026-12-06-xeon-s45
date -u +"native start %FT%TZ" >> $out/times.txt
SLUICE_BIN=./target/release/sluice ROUNDS=3 DURATION_S=45 SKIP_CLOSED=1 SKIP_OVERLOAD=1 \
    SKIP_HOL=1 MIX_S=90 MIX_BELOW_RPS=0.3 MIX_OVER_RPS=1.0 \
    bench/scripts/vs-llama-server /work/peer/build-native/bin/llama-server $out/vs-native \
    > $out/vs-native.log 2>&1 || echo "native rc=$?" >> $out/times.txt
date -u +"end %FT%TZ" >> $out/times.txt
