#!/usr/bin/env bash
# Session 45, as run (from the repository root, writing to /tmp/s45/c4, copied
# here): is the AVX2 leg's 4-client long-prompt gap the ITL target? The
# side-by-side's closed-long-greedy-c4 loop for 90 s, seed 1501, against the
# AVX2 sluice of 901270e (the leg's binary of session 44) with its cache:
#   long.sh /tmp/s45/c4 4 90 1501 ./target/avx2/release/sluice default \
#       "sc0:--short-cells 0" llama
#   long.sh /tmp/s45/c4 4 90 1501 ./target/avx2/release/sluice \
#       "step512fa:--step-tokens 512 --flash-attn on --kv-type f16" "step512:--step-tokens 512"
# usage: long.sh OUTDIR CONC DURATION SEED BIN variant-name:args...  (llama as variant "llama")
set -u
out=$1; conc=$2; dur=$3; seed=$4; bin=$5; shift 5
cal=bench/results/2026-12-06-xeon/vs-avx2/calibration.json
bench=./target/release/sluice-bench
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $out
run() { # name url pid
  $bench closed --url "$2" --quiet --timeout-s 180 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid "$3" \
    --temperature 0 --concurrency $conc --prompt-tokens uniform:500:2000 --max-tokens 64 \
    --duration-s $dur --seed $seed --out "$out/$1.json" > "$out/$1.txt" 2> "$out/$1.err"
}
wait_ready() { for _ in $(seq 600); do curl -sf "$1" > /dev/null && return; sleep 0.2; done; }
for v in "$@"; do
  name=${v%%:*}; args=${v#*:}; [ "$args" = "$v" ] && args=
  if [ $name = llama ]; then
    /work/peer/build-avx2/bin/llama-server -m $M --host 127.0.0.1 --port 18161 -t 2 -tb 2 -c 32768 -np 4 2> $out/llama.log > /dev/null &
    pid=$!; wait_ready http://127.0.0.1:18161/health
    run llama http://127.0.0.1:18161 $pid
  else
    cp $cal $out/cal-$name.json
    $bin serve --port 18160 --threads 2 --ctx 32768 --calibration-cache $out/cal-$name.json $args 2> $out/sluice-$name.log &
    pid=$!; wait_ready http://127.0.0.1:18160/readyz
    run sluice-$name http://127.0.0.1:18160 $pid
    curl -s http://127.0.0.1:18160/metrics | grep -E "short_context|passes" > $out/sluice-$name.metrics
  fi
  kill $pid; wait $pid 2>/dev/null
done
