#!/bin/bash
# usage: lone.sh OUT ROUNDS "name:args" ... ("llama:" for llama-server)
# c1 closed loop of fresh fixed-size prompts, 8-token answers: TTFT = prefill time of a lone prompt
cd /work/main
out=$1; rounds=$2; shift 2; mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
for r in $(seq $rounds); do for v in "$@"; do
  name=${v%%:*}; args=${v#*:}
  if [ "$name" = llama ]; then
    /work/peer/build-native/bin/llama-server -m $M --host 127.0.0.1 --port 18152 -t 2 -tb 2 -c 32768 -np 4 $args 2>$out/$name-r$r.log >/dev/null & p=$!
  else
    cp /tmp/s37/cal.json $out/cal-$name.json 2>/dev/null
    ./target/release/sluice serve --model $M --port 18152 --threads 2 --ctx 32768 --calibration-cache $out/cal-$name.json $args 2>$out/$name-r$r.log & p=$!
  fi
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18152/health >/dev/null && break; sleep 0.2; done
  ./target/release/sluice-bench closed --url http://127.0.0.1:18152 --quiet --timeout-s 120 --temperature 0 --concurrency 1 \
     --prompt-tokens ${PT:-fixed:680} --max-tokens 8 --duration-s ${DUR:-40} --seed $((r*100+7)) --pid $p --out $out/$name-r$r.json > /dev/null 2>&1
  python3 - $out/$name-r$r.json $name $r <<'PY'
import json,sys
p=json.load(open(sys.argv[1]))['result']['phases'][0]
print(sys.argv[3],sys.argv[2],'n',p['outcomes'].get('completed'),'ttft p50 %.0f mean %.0f'%(p['ttft']['p50_ms'],p['ttft']['mean_ms']),'itl50 %.1f'%p['itl']['p50_ms'],flush=True)
PY
  kill $p; wait $p 2>/dev/null
done; done
