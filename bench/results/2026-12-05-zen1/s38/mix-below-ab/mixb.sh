#!/bin/bash
# usage: mixb.sh OUT "name:args" ... : the side-by-side's mix-below, seed SEED (default 31), 0.07 req/s, 180 s, one sluice per variant
cd /work/main
out=$1; shift; mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
for v in "$@"; do
  name=${v%%:*}; args=${v#*:}
  cp bench/results/2026-12-05-zen1/vs-mix/calibration.json $out/cal-$name.json
  ${SLUICE_BIN:-./target/release/sluice} serve --model $M --port 18154 --threads 2 --ctx 32768 --calibration-cache $out/cal-$name.json $args 2>$out/$name.log & p=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18154/health >/dev/null && break; sleep 0.2; done
  ./target/release/sluice-bench run --url http://127.0.0.1:18154 --quiet --timeout-s 120 --pid $p \
    --prompt-tokens lognormal:150:1.3:5:3000 --max-tokens lognormal:64:0.9:8:400 --temperature 0.7 \
    --slo-ttft-ms 5000 --slo-itl-ms 200 --duration-s 180 --rate 0.07 --seed ${SEED:-31} --out $out/$name.json > $out/$name.txt 2>&1
  python3 - $out/$name.json $name <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))['result'];p=r['phases'][0]
tt=sorted(round(q[2],1) for q in r['timeline']['requests'] if q[2] is not None and q[2]>5)
print(sys.argv[2],'good',p['good'],'of',p['requests'],'ttft p50 %.0f p99 %.0f'%(p['ttft']['p50_ms'],p['ttft']['p99_ms']),'tpot p50 %.0f p99 %.0f'%(p['tpot']['p50_ms'],p['tpot']['p99_ms']),'ttft>5s',tt,flush=True)
PY
  kill $p; wait $p 2>/dev/null
done
