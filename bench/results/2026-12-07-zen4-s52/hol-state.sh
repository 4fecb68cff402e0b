#!/usr/bin/env bash
# usage: hol-state.sh LABEL PRE  (PRE: none | mix-over | conversation) -> /tmp/s52/hol/LABEL/
# The head-of-line workload on a fresh start of the AVX2 build with a copy of
# vs-avx2's final calibration cache, alone or after another workload, with
# /metrics around it: does the state a round leaves slow the long prompt?
set -uo pipefail
cd /work/main
label=$1; pre=$2
d=/tmp/s52/hol/$label; mkdir -p $d
cp /tmp/s52/vs-avx2/calibration.json $d/calibration.json
port=18151; url=http://127.0.0.1:$port
bench=./target/release/sluice-bench
/tmp/s52/sluice-avx2 serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --ctx 32768 --port $port \
  --calibration-cache $d/calibration.json > $d/sluice.log 2>&1 &
pid=$!
until curl -sf $url/health > /dev/null 2>&1; do sleep 0.5; done
case $pre in
  mix-over) $bench run --url $url --quiet --timeout-s 120 --pid $pid --prompt-tokens lognormal:150:1.3:5:3000 \
      --max-tokens lognormal:64:0.9:8:400 --temperature 0.7 --slo-ttft-ms 5000 --slo-itl-ms 200 --duration-s 90 \
      --rate 0.4 --seed 42 --out $d/pre.json > $d/pre.txt 2>$d/pre.err ;;
  conversation) $bench conversation --url $url --quiet --timeout-s 120 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid \
      --temperature 0 --seed 12 --out $d/pre.json > $d/pre.txt 2>$d/pre.err ;;
esac
sleep 3
curl -s $url/metrics > $d/metrics-before
$bench hol --url $url --quiet --timeout-s 600 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid \
   --temperature 0 --hol-stream-tokens 3000 --out $d/hol.json > $d/hol.txt 2>$d/hol.err
curl -s $url/metrics > $d/metrics-after
kill $pid; wait $pid 2>/dev/null
grep -E "long|gap" $d/hol.txt | head -5
