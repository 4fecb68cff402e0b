#!/usr/bin/env bash
# Session 48, as run after vs-native.sh (nothing else running): start-up
# (acceptance 4) with f93c26f's native and AVX2 builds, then the retry storm
# (acceptance 3) against the native build, 3 rounds, each a fresh start at
# the defaults with a copy of vs-native's calibration cache (a second start).
# From the repository root.
set -eu
out=bench/results/2026-12-07-xeon-s48
ROUNDS=3 bench/scripts/startup-time /tmp/s48/sluice-native-f93c26f $out/startup-native
ROUNDS=3 bench/scripts/startup-time /tmp/s48/sluice-avx2-f93c26f $out/startup-avx2
mkdir -p $out/retry-storm
for r in 1 2 3; do
  cp $out/vs-native/calibration.json $out/retry-storm/cal-r$r.json
  /tmp/s48/sluice-native-f93c26f serve --port 18150 --calibration-cache $out/retry-storm/cal-r$r.json 2> $out/retry-storm/sluice-r$r.log &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/readyz > /dev/null && break; sleep 0.2; done
  python3 bench/scripts/retry-storm.py 127.0.0.1:18150 $out/retry-storm/r$r.json > $out/retry-storm/r$r.txt 2>&1
  kill $pid; wait $pid 2>/dev/null || true
done
