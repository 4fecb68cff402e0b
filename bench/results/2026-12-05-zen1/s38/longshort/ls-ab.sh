#!/bin/bash
# usage: ls-ab.sh OUT ROUNDS : old vs new binary, a ~2,700-token prompt alone, then a
# 226-token one DELAY s later (session 37's longshort.py, run from /tmp then); alternating order.
cd /work/main
out=$1; rounds=$2; mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
for r in $(seq $rounds); do
  order="old new"; [ $((r % 2)) -eq 0 ] && order="new old"
  for v in $order; do
    cp /tmp/s38/cal.json $out/cal-$v-r$r.json
    /tmp/s38/sluice-$v serve --model $M --port 18153 --threads 2 --ctx 32768 --calibration-cache $out/cal-$v-r$r.json 2>$out/$v-r$r.log & p=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:18153/health >/dev/null && break; sleep 0.2; done
    echo -n "r$r $v: "; python3 bench/results/2026-12-05-zen1/longshort/longshort.py 18153 $((r*7)) ${LW:-700} ${SW:-50} ${DELAY:-5}
    curl -s http://127.0.0.1:18153/metrics | grep -E "^sluice_(steps|passes)" > $out/$v-r$r.metrics
    kill $p; wait $p 2>/dev/null
  done
done
