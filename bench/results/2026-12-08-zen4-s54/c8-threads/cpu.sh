#!/usr/bin/env bash
# usage: cpu.sh OUT ROUNDS WORKLOADS...  per-thread CPU of each server over a closed loop
set -uo pipefail
cd /work/main
out=$1; rounds=$2; shift 2
mkdir -p $out
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bench=./target/release/sluice-bench
SL=${SLUICE_BIN:-/tmp/s54/sluice-native}; LL=${LLAMA_BIN:-/work/peer/build-native/bin/llama-server}
cp ${CAL:-/tmp/s53/cal-native.json} $out/calibration.json
start() {
  case $1 in
   sluice) $SL serve --model $model --port 18161 --threads 2 --ctx 32768 --calibration-cache $out/calibration.json ${SLUICE_ARGS:-} > $out/sluice-$r.log 2>&1 & pid=$!; url=http://127.0.0.1:18161;;
   llama) $LL -m $model --host 127.0.0.1 --port 18162 -t 2 -tb 2 -c 32768 -np 4 > /dev/null 2> $out/llama-$r.log & pid=$!; url=http://127.0.0.1:18162;;
  esac
  until curl -sf $url/health > /dev/null 2>&1; do sleep 0.3; done
  sleep 1
}
for r in $(seq $rounds); do
  for w in "$@"; do
    order="sluice llama"; [ $(( (r + ${#w}) % 2 )) = 1 ] && order="llama sluice"
    for s in $order; do
      start $s
      c=${w##*-c}; temp=0.7; extra=()
      case $w in *greedy*) temp=0;; esac
      case $w in repeat*) extra=(--repeat-prompt);; esac
      [ $s = sluice ] && curl -s $url/metrics > $out/$s-r$r-$w.m0
      python3 /tmp/s54/snap.py $pid $out/$s-r$r-$w.c0
      $bench closed --url $url --quiet --timeout-s 120 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid "${extra[@]}" \
        --temperature $temp --concurrency $c --duration-s ${DUR:-30} --seed $((r*1000+77+c)) --out $out/$s-r$r-$w.json > $out/$s-r$r-$w.txt 2>$out/$s-r$r-$w.err
      python3 /tmp/s54/snap.py $pid $out/$s-r$r-$w.c1
      [ $s = sluice ] && curl -s $url/metrics > $out/$s-r$r-$w.m1
      kill $pid; wait $pid 2>/dev/null
      printf "%s r%s %-20s %s\n" $s $r $w "$(sed -n 4p $out/$s-r$r-$w.txt)"
      echo "   $(python3 /tmp/s54/cdelta.py $out/$s-r$r-$w.c0 $out/$s-r$r-$w.c1 $pid)"
    done
  done
done
