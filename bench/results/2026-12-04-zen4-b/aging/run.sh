#!/usr/bin/env bash
# old (135e513) vs new (ebba500): closed loop of 4 clients, 500-2,000-token prompts, 64 tokens, greedy
set -u
cd /work/main
out=/tmp/s28/long
bench=./target/release/sluice-bench
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
declare -A bin=([old]=/tmp/s28/old/target/release/sluice [new]=/work/main/target/release/sluice)
port=18140; url=http://127.0.0.1:$port
start() {
  ${bin[$1]} serve --model $model --port $port --threads 2 --ctx 32768 --flash-attn off --kv-type q8_0/f16 \
     --calibration-cache $out/cal-$1.json 2> $out/$1-$2.log & pid=$!
  until curl -sf $url/readyz >/dev/null; do sleep 0.2; done
}
stop() { kill $pid; wait $pid 2>/dev/null; }
for s in old new; do start $s warm; stop; done
for r in 1 2 3; do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for s in $order; do
    start $s r$r
    echo "round $r $s" >&2
    $bench closed --url $url --quiet --timeout-s 180 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid \
      --temperature 0 --concurrency 4 --prompt-tokens uniform:500:2000 --max-tokens 64 \
      --duration-s 60 --seed $((r * 1000 + 504)) --out $out/$s-r$r.json > $out/$s-r$r.txt
    stop
  done
done
echo done >&2
