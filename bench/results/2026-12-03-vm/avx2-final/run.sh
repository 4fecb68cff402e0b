#!/usr/bin/env bash
# The AVX2 leg at the session's last engine/admission code (d7a6508), as run
# (paths of the development VM): sluice and llama-server both built for
# x86-64-v3 (no AVX-512/VNNI/AMX), one round of the side-by-side's closed
# loops and overload.
set -euo pipefail
cd /work/main
ROUNDS=1 SKIP_LONG=1 SKIP_MIX=1 SKIP_CONVERSATION=1 SKIP_HOL=1 SLUICE_BIN=/tmp/sluice-avx2-final \
  bench/scripts/vs-llama-server /work/peer/build-fork-avx2/bin/llama-server \
  bench/results/2026-12-03-vm/avx2-final/vs
