#!/usr/bin/env bash
# Session 45, as run (from the repository root, writing to /tmp/s45/{c1,c4n},
# copied here): the long-prompt loops (seed 1501, 90 s) with the AVX2 build of
# the working tree that became 248a042 (its one later change, where a later
# choice of n runs, does not touch these loops), copied to
# /tmp/s45/sluice-avx2-new; "alone" with the cache --calibrate-only wrote
# (calibration-avx2.json: whole-chunk timings, on/f16 5.17 vs off/q8_0 5.86 ms
# a token), "before" with the same cache stripped of them
# (calibration-avx2-nowhole.json: places as before the change), then the AVX2
# llama-server:
#   B=/tmp/s45/sluice-avx2-new
#   long2.sh /tmp/s45/c1 1 90 1501 "alone|$B|/tmp/s45/cal/avx2.json|" \
#       "before|$B|/tmp/s45/cal/avx2-nowhole.json|" "llama|/work/peer/build-avx2||"
#   (the same with /tmp/s45/c4n 4)
# usage: long2.sh OUTDIR CONC DURATION SEED name|bin|cal|args ...  (name llama: bin = peer dir)
set -u
out=$1; conc=$2; dur=$3; seed=$4; shift 4
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
  IFS='|' read -r name bin cal args <<< "$v"
  if [ $name = llama ]; then
    $bin/bin/llama-server -m $M --host 127.0.0.1 --port 18161 -t 2 -tb 2 -c 32768 -np 4 2> $out/llama.log > /dev/null &
    pid=$!; wait_ready http://127.0.0.1:18161/health
    run llama http://127.0.0.1:18161 $pid
  else
    cp $cal $out/cal-$name.json
    $bin serve --port 18160 --threads 2 --ctx 32768 --calibration-cache $out/cal-$name.json $args 2> $out/sluice-$name.log &
    pid=$!; wait_ready http://127.0.0.1:18160/readyz
    run sluice-$name http://127.0.0.1:18160 $pid
    curl -s http://127.0.0.1:18160/metrics | grep -E "^sluice_short_context|^sluice_passes" > $out/sluice-$name.metrics
  fi
  kill $pid; wait $pid 2>/dev/null
done
