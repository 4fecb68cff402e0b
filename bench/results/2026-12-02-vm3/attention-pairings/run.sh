#!/usr/bin/env bash
# usage: run.sh NAME DURATION "CLIENTS" [sluice-args...]   or NAME=llama...
set -u
cd /work/main
name=$1; dur=$2; clients=$3; shift 3
out=/tmp/exp/$name; mkdir -p $out
port=18190; url=http://127.0.0.1:$port
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
case $name in
  llama*) /work/peer/build-fork-${LEG:-avx2}/bin/llama-server -m $model --host 127.0.0.1 --port $port -t 2 -tb 2 -c 32768 -np 4 "$@" 2> $out/server.log > /dev/null & ;;
  *) ${SLUICE:-/work/avx2-target/release/sluice} serve --model $model --port $port --threads 2 --ctx 32768 --calibration-cache /tmp/exp/calib.json "$@" 2> $out/server.log & ;;
esac
pid=$!
for _ in $(seq 600); do curl -sf $url/health >/dev/null && break; sleep 0.2; done
for c in $clients; do
  ./target/release/sluice-bench closed --url $url --quiet --timeout-s 120 --temperature 0 --concurrency $c --duration-s $dur --seed $((7000+c)) ${BENCH_ARGS:-} --out $out/c$c.json > $out/c$c.txt
  python3 - $out/c$c.json <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))['result']['phases'][0]
def g(k):
    v=r.get(k); return v.get('p50', v.get('p50_ms')) if isinstance(v,dict) else v
print(sys.argv[1], 'tok/s %.1f'%r['tokens_per_s'], 'done', r.get('requests'), 'ttft_p50', g('ttft'), 'decode/stream', g('decode_tok_s_per_stream'))
PY
done
curl -s $url/metrics > $out/metrics.txt
kill $pid; wait $pid 2>/dev/null
