#!/bin/bash
# HOL variants, AVX2 sluice build, fixed pairing off/q8_0/f16 (no calibration of the pairing)
cd /work/main
bin=target/x86-64-v3/release/sluice
out=/tmp/s30/hol
port=18150
for r in 1 2; do
  for v in base itl187 unified; do
    case $v in
      base) extra=();;
      itl187) extra=(--itl-target-ms 187);;
      unified) extra=(--kv-layout unified);;
    esac
    $bin serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port $port --threads 2 --ctx 32768 \
      --flash-attn off --kv-type q8_0/f16 --calibration-cache $out/cal-$v.json "${extra[@]}" 2> $out/$v-r$r.log &
    pid=$!
    for _ in $(seq 600); do curl -sf http://127.0.0.1:$port/readyz >/dev/null && break; sleep 0.2; done
    target/release/sluice-bench hol --url http://127.0.0.1:$port --quiet --timeout-s 600 --slo-ttft-ms 5000 \
      --slo-itl-ms 250 --pid $pid --temperature 0 --hol-stream-tokens 3000 --seed $r --out $out/$v-r$r.json > $out/$v-r$r.txt
    kill $pid; wait $pid
  done
done
echo done > $out/DONE
