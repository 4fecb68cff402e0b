#!/bin/bash
# usage: ab2.sh OUT ROUNDS "variant:args" ...
set -u
cd /work/main
out=$1; rounds=$2; shift 2
mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
B=./target/release/sluice-bench
SL=${SLUICE_BIN:-./target/release/sluice}
W=${W:-fresh-sampled-c4}
for r in $(seq $rounds); do
  for v in "$@"; do
    name=${v%%:*}; args=${v#*:}
    if [ "$name" = llama ]; then
      /work/peer/build-native/bin/llama-server -m $M --host 127.0.0.1 --port 18150 -t 2 -tb 2 -c 32768 -np 4 2>/dev/null >/dev/null & p=$!
    else
      $SL serve --model $M --port 18150 --threads 2 --ctx 32768 --calibration-cache /tmp/s36/cal-bench.json $args 2>$out/$name-r$r.log & p=$!
    fi
    for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/health >/dev/null && break; sleep 0.2; done
    c=${W##*-c}; t=0.7; case $W in *greedy*) t=0;; esac
    curl -s http://127.0.0.1:18150/metrics > $out/$name-r$r.m0 2>/dev/null
    $B closed --url http://127.0.0.1:18150 --quiet --timeout-s 120 --temperature $t --concurrency $c \
       --duration-s ${DUR:-30} --seed $((r*1000+77)) --pid $p --out $out/$name-r$r.json > /dev/null 2>&1
    curl -s http://127.0.0.1:18150/metrics > $out/$name-r$r.m1 2>/dev/null
    python3 - $out/$name-r$r.json $name $r <<'PY'
import json,sys
j=json.load(open(sys.argv[1]))['result'];p=j['phases'][0]
print(sys.argv[3],sys.argv[2],'tok/s %.1f'%p['tokens_per_s'],'ttft50 %.0f mean %.0f'%(p['ttft']['p50_ms'],p['ttft']['mean_ms']),'itl50 %.1f p99 %.0f max %.0f'%(p['itl']['p50_ms'],p['itl']['p99_ms'],p['itl']['max_ms']),'tpot mean %.1f'%p['tpot']['mean_ms'],'done',p['outcomes'].get('completed'),'wall %.1f'%j['wall_s'],flush=True)
PY
    if [ "$name" != llama ]; then
      join <(grep -E '^sluice_(steps|passes|graphs|step_seconds_sum|step_seconds_count|prefill_tokens|tokens_generated|decode)' $out/$name-r$r.m0 | grep -v bucket | sort) <(grep -E '^sluice_(steps|passes|graphs|step_seconds_sum|step_seconds_count|prefill_tokens|tokens_generated|decode)' $out/$name-r$r.m1 | grep -v bucket | sort) | awk '{printf "   %s %g\n",$1,$3-$2}'
    fi
    kill $p; wait $p 2>/dev/null
  done
done
