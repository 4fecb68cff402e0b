#!/usr/bin/env bash
# Session 50: head-of-line runs of sluice alone (AVX2 build with a temporary
# per-pass trace, SLUICE_DIAG_TRACE), looking for the 215-221 ms steps.
set -euo pipefail
cd /work/main
out=/tmp/s50/hol
sluice=/tmp/s50/sluice-avx2-diag
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
url=http://127.0.0.1:18150
mkdir -p $out
[ -f $out/cal.json ] || cp bench/results/2026-12-07-xeon-s49/vs-avx2/calibration.json $out/cal.json
for i in $(seq ${FIRST:-1} ${LAST:-6}); do
    d=$out/r$i; mkdir -p $d
    SLUICE_DIAG_TRACE=$d/trace.jsonl "$sluice" serve --model "$model" --threads 2 --ctx 32768 --port 18150 \
        --calibration-cache "$out/cal.json" > "$d/sluice.log" 2>&1 &
    pid=$!
    until curl -sf $url/health > /dev/null 2>&1; do sleep 0.5; done
    python3 -c 'import time; print(time.time())' > $d/t0
    /tmp/s50/sluice-bench hol --url $url --quiet --timeout-s 600 \
        --slo-ttft-ms 5000 --slo-itl-ms 250 --pid $pid --temperature 0 --hol-stream-tokens 3000 \
        --out "$d/hol.json" > "$d/hol.txt"
    curl -s $url/metrics > $d/metrics-after
    kill $pid; wait $pid || true
    cat $d/hol.txt
done
