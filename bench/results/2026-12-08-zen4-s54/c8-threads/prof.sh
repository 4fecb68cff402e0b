#!/usr/bin/env bash
# usage: prof.sh OUT server clients   perf record (cpu-clock) over a 20 s repeat-sampled loop
set -uo pipefail
cd /work/main
out=$1; s=$2; c=$3; mkdir -p $out
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bench=./target/release/sluice-bench
case $s in
 sluice) /tmp/s54/sluice-native serve --model $model --port 18161 --threads 2 --ctx 32768 --calibration-cache /tmp/s54/cpu2/calibration.json ${SLUICE_ARGS:-} > $out/$s-c$c.log 2>&1 & pid=$!; url=http://127.0.0.1:18161;;
 llama) /work/peer/build-native/bin/llama-server -m $model --host 127.0.0.1 --port 18162 -t 2 -tb 2 -c 32768 -np 4 > /dev/null 2> $out/$s-c$c.log & pid=$!; url=http://127.0.0.1:18162;;
esac
until curl -sf $url/health > /dev/null 2>&1; do sleep 0.3; done; sleep 1
[ $s = sluice ] && curl -s $url/metrics > $out/$s-c$c.m0
perf record -F 999 -e cpu-clock -g -p $pid -o $out/$s-c$c.perf -- sleep 19 2>/dev/null &
ppid=$!
$bench closed --url $url --quiet --timeout-s 120 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid --repeat-prompt \
   --temperature ${TEMP:-0.7} --concurrency $c --duration-s 20 --seed $((1000+77+c)) --out $out/$s-c$c.json > $out/$s-c$c.txt 2>$out/$s-c$c.err
wait $ppid
[ $s = sluice ] && curl -s $url/metrics > $out/$s-c$c.m1
kill $pid; wait $pid 2>/dev/null
echo "$s c$c $(sed -n 4p $out/$s-c$c.txt)"
