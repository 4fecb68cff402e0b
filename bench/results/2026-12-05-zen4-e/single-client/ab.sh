#!/usr/bin/env bash
# ab.sh OUT ROUNDS "label|cmd" ... ; each cmd starts a server on 18140; workloads from $WL (bench args)
set -u
out=$1; rounds=$2; shift 2
mkdir -p $out
cd /work/main
for r in $(seq $rounds); do
 for spec in "$@"; do
  label=${spec%%|*}; cmd=${spec#*|}
  bash -c "exec $cmd" > $out/$label-r$r.log 2>&1 & pid=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:18140/health >/dev/null && break; sleep 0.2; done
  i=0
  while IFS= read -r wl; do
    [ -z "$wl" ] && continue
    i=$((i+1))
    ./target/release/sluice-bench closed --url http://127.0.0.1:18140 --quiet --timeout-s 120 --pid $pid $wl --seed $((r*100+i)) --out $out/$label-r$r-w$i.json > /dev/null 2>&1
  done <<< "$WL"
  kill $pid; wait $pid 2>/dev/null
 done
done
