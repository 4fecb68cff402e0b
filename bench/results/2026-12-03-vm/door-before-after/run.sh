#!/usr/bin/env bash
# Issue 26, acceptance 5, as run (paths of the development VM): one round of
# the side-by-side's closed loops and overload per sluice build, native leg,
# each beside the same native llama-server build: gate = dc6af2c (the gate
# held by the handlers, engine reports on a channel), door = cf99169 (the
# front door in src/door/), before = c698f9f; then the front-door attack
# benchmark, sluice only, for each build.
set -euo pipefail
cd /work/main
out=bench/results/2026-12-03-vm/door-before-after
export ROUNDS=1 SKIP_LONG=1 SKIP_MIX=1 SKIP_CONVERSATION=1 SKIP_HOL=1
for which in ${WHICH:-gate door before}; do   # WHICH=final for the last commit
  SLUICE_BIN=/tmp/sluice-$which bench/scripts/vs-llama-server \
    /work/peer/build-fork-native/bin/llama-server "$out/vs-$which" > "/tmp/door-vs-$which.out" 2>&1
done
for which in ${WHICH:-before door gate}; do
  SLUICE_BIN=/tmp/sluice-$which bench/scripts/front-door "" "$out/front-door-$which" > "/tmp/door-fd-$which.out" 2>&1
done
