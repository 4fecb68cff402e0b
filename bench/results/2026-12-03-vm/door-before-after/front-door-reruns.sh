#!/usr/bin/env bash
set -euo pipefail
cd /work/main
out=bench/results/2026-12-03-vm/door-before-after
for w in gate before gate before; do
  n=$((${n:-0} + 1))
  SLUICE_BIN=/tmp/sluice-$w bench/scripts/front-door "" "$out/front-door-rerun$n-$w" > /tmp/fd-rerun$n.out 2>&1
done
for w in pool2 before pool2; do
  n=$((n + 1))
  SLUICE_BIN=/tmp/sluice-$w bench/scripts/front-door "" "$out/front-door-rerun$n-$w" > /tmp/fd-rerun$n.out 2>&1
done
