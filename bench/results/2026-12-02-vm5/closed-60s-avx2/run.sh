#!/usr/bin/env bash
# c1 fresh greedy closed loop, 60 s, alternating sluice (AVX2 build) and llama-server (AVX2 build).
cd /work/main
out=/tmp/ttft1/out; mkdir -p $out
bench=./target/release/sluice-bench
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
port=18150; url=http://127.0.0.1:$port
for r in 1 2; do
  for s in sluice llama; do
    case $s in
      sluice) /work/avx2-target/release/sluice serve --model $model --port $port --threads 2 --ctx 32768 --calibration-cache $out/cal.json ${SLUICE_ARGS:-} 2> $out/$s-r$r.log & ;;
      llama) /work/peer/build-fork-avx2/bin/llama-server -m $model --host 127.0.0.1 --port $port -t 2 -tb 2 -c 32768 -np 4 2> $out/$s-r$r.log >/dev/null & ;;
    esac
    pid=$!
    for _ in $(seq 300); do curl -sf $url/health >/dev/null && break; sleep 0.2; done
    $bench closed --url $url --quiet --timeout-s 120 --temperature 0 --concurrency ${C:-1} --duration-s ${D:-60} --seed $((r*1000+11)) --pid $pid --out $out/$s-r$r.json > $out/$s-r$r.txt
    kill $pid; wait $pid 2>/dev/null
    python3 - "$out/$s-r$r.json" "$s" "$r" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]));p=d['result']['phases'][0]
print(sys.argv[2], sys.argv[3], 'n', p['outcomes'], 'ttft p50', p['ttft']['p50_ms'], 'mean', round(p['ttft']['mean_ms'],1), 'tok/s', round(p['tokens_per_s'],1))
PY
  done
done
