#!/usr/bin/env bash
# Session 52, run after vs-avx2 (nothing else running), from the repository
# root: the retry storm (issue 25, acceptance 3) against b71f834's AVX2 build,
# 3 rounds, each a fresh start at the defaults with a copy of vs-avx2's
# calibration cache (a second start); then start-up to ready (acceptance 4),
# 3 first and second starts of the same build.
set -eu
out=bench/results/2026-12-07-zen4-s52
bin=/tmp/s52/sluice-avx2
mkdir -p $out/retry-storm-avx2
for r in 1 2 3; do
  cp $out/vs-avx2/calibration.json $out/retry-storm-avx2/cal-r$r.json
  $bin serve --port 18150 --calibration-cache $out/retry-storm-avx2/cal-r$r.json 2> $out/retry-storm-avx2/sluice-r$r.log &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/readyz > /dev/null && break; sleep 0.2; done
  python3 bench/scripts/retry-storm.py 127.0.0.1:18150 $out/retry-storm-avx2/r$r.json > $out/retry-storm-avx2/r$r.txt 2>&1
  kill $pid; wait $pid 2>/dev/null || true
done
bench/scripts/startup-time $bin $out/startup-time-avx2
