#!/usr/bin/env bash
# Session 44, as run: is the AVX2 leg's long-prompt gap the main context's
# pairing? The side-by-side's closed-long-greedy-c1 loop (500-2,000-token
# prompts, 64-token answers, greedy), 45 s, seed 1501, against the AVX2 sluice
# at its defaults (main context off/q8_0/f16 from the leg's cache), sluice with
# --flash-attn on --kv-type f16 (llama-server's pairing), and the AVX2
# llama-server at its defaults. From the repository root.
set -eu
out=bench/results/2026-12-06-xeon/long-fa-avx2
cal=bench/results/2026-12-06-xeon/vs-avx2/calibration.json
bench=./target/release/sluice-bench
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
run() { # name url pid
  $bench closed --url "$2" --quiet --timeout-s 120 --slo-ttft-ms 5000 --slo-itl-ms 250 --pid "$3" \
    --temperature 0 --concurrency 1 --prompt-tokens uniform:500:2000 --max-tokens 64 \
    --duration-s 45 --seed 1501 --out "$out/$1.json" > "$out/$1.txt" 2> "$out/$1.err"
}
wait_ready() { for _ in $(seq 600); do curl -sf "$1" > /dev/null && return; sleep 0.2; done; }
for variant in default fa-on-f16; do
  cp $cal $out/cal-$variant.json
  args=(); [ $variant = fa-on-f16 ] && args=(--flash-attn on --kv-type f16)
  ./target/avx2/release/sluice serve --port 18160 --threads 2 --ctx 32768 --calibration-cache $out/cal-$variant.json "${args[@]}" 2> $out/sluice-$variant.log &
  pid=$!; wait_ready http://127.0.0.1:18160/readyz
  run sluice-$variant http://127.0.0.1:18160 $pid
  kill $pid; wait $pid 2>/dev/null || true
done
/work/peer/build-avx2/bin/llama-server -m $M --host 127.0.0.1 --port 18161 -t 2 -tb 2 -c 32768 -np 4 2> $out/llama.log > /dev/null &
pid=$!; wait_ready http://127.0.0.1:18161/health
run llama http://127.0.0.1:18161 $pid
kill $pid; wait $pid 2>/dev/null || true
