#!/usr/bin/env bash
# Session 44, as run: the committed side-by-side on the Xeon (AMX) box, the
# native leg (AMX kernels on both sides) and then the AVX2 leg (both built for
# x86-64-v3). Peers: /work/peer/build-{native,avx2} (bench/README.md's recipe).
# From the repository root: bench/results/2026-12-06-xeon/run.sh
set -euo pipefail
out=bench/results/2026-12-06-xeon
date -u +"native start %FT%TZ" >> $out/times.txt
SLUICE_BIN=./target/release/sluice ROUNDS=3 MIX_S=90 MIX_BELOW_RPS=0.3 MIX_OVER_RPS=1.0 \
    bench/scripts/vs-llama-server /work/peer/build-native/bin/llama-server $out/vs-native \
    > $out/vs-native.log 2>&1 || echo "native rc=$?" >> $out/times.txt
date -u +"avx2 start %FT%TZ" >> $out/times.txt
SLUICE_BIN=./target/avx2/release/sluice ROUNDS=3 SKIP_OVERLOAD=1 SKIP_CONVERSATION=1 \
    SKIP_MIX=1 SKIP_HOL=1 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server $out/vs-avx2 \
    > $out/vs-avx2.log 2>&1 || echo "avx2 rc=$?" >> $out/times.txt
date -u +"end %FT%TZ" >> $out/times.txt
