#!/bin/bash
# A/B of sluice pairings vs llama: PAIR_A, PAIR_B as "fa kv"; conversation + c4 fresh greedy
cd "$(dirname "$0")/../../../.."  # the repository root
out=${1:?}; rounds=${2:-2}; mkdir -p $out
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
BIN=${BIN:-./target/release/sluice}
set -- $PAIR_A; fa_a=$1; kv_a=$2
set -- $PAIR_B; fa_b=$1; kv_b=$2
cp bench/results/2026-12-05-zen4-g/native-paired/calibration.json $out/cal.json
cp bench/results/2026-12-05-zen4-g/native-paired/calibration.json $out/calb.json
$BIN serve --model $M --port 18140 --threads 2 --ctx 32768 --calibration-cache $out/cal.json --flash-attn $fa_a --kv-type $kv_a 2> $out/a.log &
ap=$!
sleep 3
$BIN serve --model $M --port 18142 --threads 2 --ctx 32768 --calibration-cache $out/calb.json --flash-attn $fa_b --kv-type $kv_b 2> $out/b.log &
bp=$!
${LLAMA_SERVER:-/work/peer/build-native/bin/llama-server} -m $M --host 127.0.0.1 --port 18141 -t 2 -tb 2 -c 32768 -np 4 2> $out/llama.log >/dev/null &
lp=$!
for u in 18140 18141 18142; do for i in $(seq 300); do curl -sf http://127.0.0.1:$u/health >/dev/null && break; sleep 0.2; done; done
for r in $(seq $rounds); do
  order="a b llama"; [ $((r%2)) = 0 ] && order="llama b a"
  for s in $order; do
    case $s in a) p=18140; pid=$ap;; b) p=18142; pid=$bp;; llama) p=18141; pid=$lp;; esac
    [ -z "$SKIP_CONV" ] && ./target/release/sluice-bench conversation --url http://127.0.0.1:$p --quiet --timeout-s 120 --temperature 0 --seed $((r+10)) --pid $pid --out $out/conv-$s-r$r.json > $out/conv-$s-r$r.txt
    sleep 2
    [ -z "$SKIP_C4" ] && ./target/release/sluice-bench closed --url http://127.0.0.1:$p --quiet --timeout-s 120 --duration-s ${DUR:-30} --temperature 0 --concurrency ${CONC:-4} --seed $((r*1000+11)) --pid $pid --out $out/c4-$s-r$r.json > $out/c4-$s-r$r.txt
    sleep 2
  done
done
kill $ap $bp $lp; wait
echo done
