#!/usr/bin/env bash
# sluice variants only, alternating: c=$C, 60 s each.
cd /work/main
out=/tmp/ttft1/var-c${C:-4}; mkdir -p $out
bench=./target/release/sluice-bench
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
port=18151; url=http://127.0.0.1:$port
declare -A args=( [base]="" [itl200]="--itl-target-ms 200" [f16]="--flash-attn on --kv-type f16" [unified]="--kv-layout unified" [itl200f16]="--itl-target-ms 200 --flash-attn on --kv-type f16" )
for r in 1 2; do
  for v in ${VARIANTS:-base itl200 f16}; do
    /work/avx2-target/release/sluice serve --model $model --port $port --threads 2 --ctx 32768 --calibration-cache /tmp/ttft1/c1/cal.json ${args[$v]} 2> $out/$v-r$r.log &
    pid=$!
    for _ in $(seq 300); do curl -sf $url/health >/dev/null && break; sleep 0.2; done
    $bench closed --url $url --quiet --timeout-s 120 --temperature 0 --concurrency ${C:-4} --duration-s ${D:-60} --seed $((r*1000+11)) --pid $pid --out $out/$v-r$r.json > $out/$v-r$r.txt
    kill $pid; wait $pid 2>/dev/null
    python3 - "$out/$v-r$r.json" "$v" "$r" <<'PY'
import json,sys
d=json.load(open(sys.argv[1]));p=d['result']['phases'][0]
print(sys.argv[2], sys.argv[3], 'n', p['outcomes'], 'ttft p50', p['ttft']['p50_ms'], 'mean', round(p['ttft']['mean_ms'],1), 'tok/s', round(p['tokens_per_s'],1), 'itl p99', p['itl']['p99_ms'])
PY
  done
done
