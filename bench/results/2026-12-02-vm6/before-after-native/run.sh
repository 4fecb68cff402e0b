#!/usr/bin/env bash
# Issue 26, acceptance 5, as run (paths of the development VM): one round of the
# side-by-side each, sluice's native build at 46713e1 (before the renovation),
# dd429c8 (after it) and 86a0a0b (with the admission thread, since reverted),
# each beside the same native llama-server build, one run after the other:
# after-dd429c8, before-46713e1, then after-86a0a0b.
cd /work/main
export ROUNDS=1 SKIP_OVERLOAD=1 MIX_S=45
for which in ${WHICH:-after before}; do   # WHICH=after2 for the third run
  SLUICE_BIN=/tmp/sluice-$which bench/scripts/vs-llama-server \
    /work/peer/build-fork-native/bin/llama-server /tmp/ba/$which > /tmp/ba/$which.out 2>&1
done
