#!/usr/bin/env bash
# Session 44, as run after run.sh: start-up (acceptance 4) with both builds,
# then the retry storm (acceptance 3) against the native build, 3 rounds, each
# a fresh start at the defaults with a copy of vs-native's calibration cache
# (a second start). From the repository root.
set -eu
out=bench/results/2026-12-06-xeon
ROUNDS=3 bench/scripts/startup-time ./target/release/sluice $out/startup-native
ROUNDS=3 bench/scripts/startup-time ./target/avx2/release/sluice $out/startup-avx2
mkdir -p $out/retry-storm
for r in 1 2 3; do
  cp $out/vs-native/calibration.json $out/retry-storm/cal-r$r.json
  ./target/release/sluice serve --port 18150 --calibration-cache $out/retry-storm/cal-r$r.json 2> $out/retry-storm/sluice-r$r.log &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/readyz > /dev/null && break; sleep 0.2; done
  python3 bench/scripts/retry-storm.py 127.0.0.1:18150 $out/retry-storm/r$r.json > $out/retry-storm/r$r.txt 2>&1
  kill $pid; wait $pid 2>/dev/null || true
done
