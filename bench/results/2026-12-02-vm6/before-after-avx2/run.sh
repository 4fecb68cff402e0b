#!/usr/bin/env bash
# Issue 26, acceptance 5 on the AVX2 leg, as run: closed loops only, one round
# each, sluice's x86-64-v3 build at ff713b5 (after) then 46713e1 (before),
# each beside the same x86-64-v3 llama-server.
cd /work/main
export ROUNDS=1 SKIP_OVERLOAD=1 SKIP_LONG=1 SKIP_MIX=1 SKIP_HOL=1 SKIP_CONVERSATION=1
for which in after before; do
  SLUICE_BIN=/tmp/sluice-avx2-$which bench/scripts/vs-llama-server \
    /work/peer/build-fork-avx2/bin/llama-server /tmp/ba-avx2/$which > /tmp/ba-avx2/$which.out 2>&1
done
echo finished > /tmp/ba-avx2/done
