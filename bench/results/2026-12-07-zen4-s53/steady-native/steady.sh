#!/usr/bin/env bash
# usage: steady.sh OUT ROUNDS CLIENTS...  steady decode: fixed 1-token prompt spec, 256-token answers (ignore_eos)
# env: TEMP (0), SLUICE_BIN, LLAMA_BIN, DUR (20), VARIANTS ("s0 ll"), CAL (calibration cache to copy)
# variants: ll = llama-server; s0 = sluice defaults; s1 = --short-cells 0; s2 = --flash-attn on --kv-type f16; sX from env ARGS_sX
set -uo pipefail
cd /work/main
out=$1; rounds=$2; shift 2
mkdir -p $out
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
bench=./target/release/sluice-bench
SL=${SLUICE_BIN:-/tmp/s52/sluice-avx2}; LL=${LLAMA_BIN:-/work/peer/build-avx2/bin/llama-server}
[ -f $out/calibration.json ] || cp ${CAL:-/tmp/s52/vs-avx2/calibration.json} $out/calibration.json
ARGS_s0=""; ARGS_s1="--short-cells 0"; ARGS_s2="--flash-attn on --kv-type f16"
start() {
  case $1 in
   ll) $LL -m $model --host 127.0.0.1 --port 18162 -t 2 -tb 2 -c 32768 -np 4 > /dev/null 2> $out/ll-$r.log & pid=$!; url=http://127.0.0.1:18162;;
   s*) local a="ARGS_$1"; cp $out/calibration.json $out/cal-$1.json
       $SL serve --model $model --port 18161 --threads 2 --ctx 32768 --calibration-cache $out/cal-$1.json ${!a} > $out/$1-$r.log 2>&1 & pid=$!; url=http://127.0.0.1:18161;;
  esac
  until curl -sf $url/health > /dev/null 2>&1; do sleep 0.3; done
}
for r in $(seq $rounds); do
  for c in "$@"; do
    order="${VARIANTS:-s0 ll}"; [ $(( r % 2 )) = 0 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
    for s in $order; do
      start $s
      case $s in s*) curl -s $url/metrics > $out/$s-r$r-c$c.m0;; esac
      $bench closed --url $url --quiet --timeout-s 120 --pid $pid --concurrency $c --duration-s ${DUR:-20} \
        --prompt-tokens fixed:1 --max-tokens fixed:256 --temperature ${TEMP:-0} --seed $((r*100+c)) \
        --out $out/$s-r$r-c$c.json > $out/$s-r$r-c$c.txt 2>$out/$s-r$r-c$c.err
      case $s in s*) curl -s $url/metrics > $out/$s-r$r-c$c.m1;; esac
      kill $pid; wait $pid 2>/dev/null
      printf "%-3s r%s c%s %s  decode/stream p50 %s\n" $s $r $c "$(sed -n 4p $out/$s-r$r-c$c.txt)" \
        "$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['result']['phases'][0]; print(round(r['decode_tok_s_per_stream']['p50'],1))" $out/$s-r$r-c$c.json)"
    done
  done
done
