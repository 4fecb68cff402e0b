#!/usr/bin/env bash
# A/B of the binaries before (571028f) and after the front-door change: closed
# loops at 1 and 4 clients, alternating, same seeds.
set -euo pipefail
out=$1
port=18160; url="http://127.0.0.1:$port"
bench=./target/release/sluice-bench
for r in 1 2 3; do
  if [ $((r % 2)) -eq 1 ]; then order=(old new); else order=(new old); fi
  for v in "${order[@]}"; do
    /tmp/sluice-$v serve --port $port 2> "$out/$v-r$r.log" & pid=$!
    for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 0.2; done
    for c in 1 4; do
      $bench closed --url "$url" --quiet --concurrency $c --duration-s 20 --temperature 0.7 --seed $((r*10+c)) \
         --timeout-s 120 --out "$out/$v-r$r-c$c.json" > /dev/null
    done
    kill $pid; wait $pid 2>/dev/null || true
  done
done
