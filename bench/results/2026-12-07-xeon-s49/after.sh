#!/usr/bin/env bash
# Session 49, as run after vs-avx2.sh (nothing else running): the retry storm
# (acceptance 3) against f93c26f's AVX2 build, 3 rounds, each a fresh start
# at the defaults with a copy of vs-avx2's calibration cache (a second start).
# From the repository root.
set -eu
out=bench/results/2026-12-07-xeon-s49
mkdir -p $out/retry-storm-avx2
for r in 1 2 3; do
  cp $out/vs-avx2/calibration.json $out/retry-storm-avx2/cal-r$r.json
  /tmp/s49/sluice-avx2-f93c26f serve --port 18150 --calibration-cache $out/retry-storm-avx2/cal-r$r.json 2> $out/retry-storm-avx2/sluice-r$r.log &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/readyz > /dev/null && break; sleep 0.2; done
  python3 bench/scripts/retry-storm.py 127.0.0.1:18150 $out/retry-storm-avx2/r$r.json > $out/retry-storm-avx2/r$r.txt 2>&1
  kill $pid; wait $pid 2>/dev/null || true
done
