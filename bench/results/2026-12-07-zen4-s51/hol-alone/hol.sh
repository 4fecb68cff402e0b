#!/usr/bin/env bash
# usage: hol.sh LABEL SLUICE_BIN [flags...]  -> /tmp/s51/hol/LABEL/
set -uo pipefail
cd /work/main
label=$1; bin=$2; shift 2
d=/tmp/s51/hol/$label; mkdir -p $d
port=18151; url=http://127.0.0.1:$port
"$bin" serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --ctx 32768 --port $port "$@" > $d/sluice.log 2>&1 &
pid=$!
until curl -sf $url/health > /dev/null 2>&1; do sleep 0.5; done
/tmp/s51/sluice-bench hol --url $url --quiet --timeout-s 600 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid \
   --temperature 0 --hol-stream-tokens 3000 --out $d/hol.json > $d/hol.txt 2>$d/hol.err
curl -s $url/metrics > $d/metrics-after
kill $pid; wait $pid 2>/dev/null
cat $d/hol.txt
