#!/bin/bash
# usage: ls-ab.sh OUT ROUNDS : old vs new binary (and llama), long prompt then a short one 5 s later
cd /work/main
out=$1; rounds=$2; mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
for r in $(seq $rounds); do
  order="old new llama"; [ $((r % 2)) -eq 0 ] && order="new old llama"
  for v in $order; do
    if [ $v = llama ]; then
      /work/peer/build-native/bin/llama-server -m $M --host 127.0.0.1 --port 18153 -t 2 -tb 2 -c 32768 -np 4 2>$out/$v-r$r.log >/dev/null & p=$!
    else
      cp /tmp/s37/cal.json $out/cal-$v-r$r.json
      /tmp/s37/sluice-$v serve --model $M --port 18153 --threads 2 --ctx 32768 --calibration-cache $out/cal-$v-r$r.json 2>$out/$v-r$r.log & p=$!
    fi
    for _ in $(seq 300); do curl -sf http://127.0.0.1:18153/health >/dev/null && break; sleep 0.2; done
    echo -n "r$r $v: "; python3 /tmp/s37/longshort.py 18153 $((r*7)) ${LW:-700} ${SW:-50} ${DELAY:-5}
    kill $p; wait $p 2>/dev/null
  done
done
