#!/usr/bin/env bash
# usage: peer-hol.sh LABEL LLAMA_SERVER
set -uo pipefail
cd /work/main
label=$1; bin=$2
d=/tmp/s52/hol/$label; mkdir -p $d
port=18161; url=http://127.0.0.1:$port
"$bin" -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -c 32768 -np 4 --port $port --host 127.0.0.1 > $d/server.log 2>&1 &
pid=$!
until curl -sf $url/health > /dev/null 2>&1; do sleep 0.5; done
/work/main/target/release/sluice-bench hol --url $url --quiet --timeout-s 600 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid \
   --temperature 0 --hol-stream-tokens 3000 --out $d/hol.json > $d/hol.txt 2>$d/hol.err
kill $pid; wait $pid 2>/dev/null
cat $d/hol.txt
