#!/usr/bin/env bash
# Acceptance 3, ROUNDS times: a fresh start of sluice at its defaults (a copy
# of CAL as its calibration cache: a second start), then
# bench/scripts/retry-storm.py (30 s without the storm, 30 s with 16 clients
# that retry at once), then stop.  Usage: run.sh OUT CAL [ROUNDS]  (repo root)
set -eu
out=$1 cal=$2 rounds=${3:-3}
mkdir -p "$out"
for r in $(seq "$rounds"); do
  cp "$cal" "$out/cal-r$r.json"
  ./target/release/sluice serve --port 18150 --calibration-cache "$out/cal-r$r.json" 2> "$out/sluice-r$r.log" &
  pid=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/readyz > /dev/null && break; sleep 0.2; done
  python3 bench/scripts/retry-storm.py 127.0.0.1:18150 "$out/r$r.json" > "$out/r$r.txt" 2>&1
  kill $pid; wait $pid 2>/dev/null || true
done
