#!/usr/bin/env bash
# TTFT of a ~600-token prompt alone and beside 3 streams: sluice (AVX2 build) vs llama-server (AVX2 build).
cd /work/main
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
O=/tmp/exp/ttft-out; mkdir -p $O
wait_up() { for _ in $(seq 300); do curl -sf http://127.0.0.1:18150/health >/dev/null && return 0; sleep 0.2; done; return 1; }
for s in sluice llama sluice-itl300; do
  case $s in
    sluice) /work/avx2-target/release/sluice serve --model $M --port 18150 --threads 2 --ctx 32768 --calibration-cache bench/results/2026-12-02-vm4/mix-tokens-ahead-avx2/calibration.json 2> $O/$s.log & ;;
    sluice-itl300) /work/avx2-target/release/sluice serve --model $M --port 18150 --threads 2 --ctx 32768 --itl-target-ms 300 --calibration-cache bench/results/2026-12-02-vm4/mix-tokens-ahead-avx2/calibration.json 2> $O/$s.log & ;;
    llama) /work/peer/build-fork-avx2/bin/llama-server -m $M --host 127.0.0.1 --port 18150 -t 2 -tb 2 -c 32768 -np 4 2> $O/$s.log >/dev/null & ;;
  esac
  pid=$!
  wait_up
  python3 /tmp/exp/ttft_streams.py http://127.0.0.1:18150 0 450 3 > $O/$s-k0.txt
  python3 /tmp/exp/ttft_streams.py http://127.0.0.1:18150 3 450 5 > $O/$s-k3.txt
  curl -s http://127.0.0.1:18150/metrics > $O/$s-metrics.txt
  kill $pid; wait $pid 2>/dev/null
done
echo done > $O/done
