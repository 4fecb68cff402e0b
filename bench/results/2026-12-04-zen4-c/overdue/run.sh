#!/usr/bin/env bash
# old (b633512: shortest first only) vs new (a first try: overdue at W_max in the slot goes first every other step); run2.sh: new2 (the committed rule):
# closed loop of 4 clients, 500-2,000-token prompts, 64 tokens, greedy, 60 s; and the mix at 0.8 req/s, 90 s.
set -u
cd /work/main
out=/tmp/s29/overdue
bench=./target/release/sluice-bench
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
declare -A bin=([old]=/tmp/s29/sluice-old [new]=/tmp/s29/sluice-new [new2]=/tmp/s29/sluice-new2)
port=18140; url=http://127.0.0.1:$port
start() {
  ${bin[$1]} serve --model $model --port $port --threads 2 --ctx 32768 --flash-attn off --kv-type q8_0/f16 \
     --calibration-cache $out/cal-$1.json 2> $out/$1-$2.log & pid=$!
  until curl -sf $url/readyz >/dev/null; do sleep 0.2; done
}
stop() { kill $pid; wait $pid 2>/dev/null; }
for s in old new; do start $s warm; stop; done
mix=(--prompt-tokens lognormal:150:1.3:5:3000 --max-tokens lognormal:64:0.9:8:400
     --temperature 0.7 --slo-ttft-ms 5000 --slo-itl-ms 200 --duration-s 90)
for r in 1 2 3; do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for s in $order; do
    start $s r$r
    echo "round $r $s long" >&2
    $bench closed --url $url --quiet --timeout-s 180 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid \
      --temperature 0 --concurrency 4 --prompt-tokens uniform:500:2000 --max-tokens 64 \
      --duration-s 60 --seed $((r * 1000 + 504)) --out $out/long-$s-r$r.json > $out/long-$s-r$r.txt
    echo "round $r $s mix-over" >&2
    $bench run --url $url --quiet --timeout-s 120 --pid $pid "${mix[@]}" --rate 0.8 \
      --seed $((r + 40)) --out $out/mix-$s-r$r.json > $out/mix-$s-r$r.txt
    curl -s $url/metrics | grep -E '^sluice_steps_(overdue_first|whole_prompt)_total' > $out/metrics-$s-r$r.txt
    stop
  done
done
echo done >&2
