#!/usr/bin/env bash
# c8.sh OUT SLUICE_BIN CAL LLAMA ROUNDS [extra sluice args]
out=$1; sb=$2; cal=$3; ll=$4; rounds=$5; shift 5
mkdir -p $out; cd /work/main
$sb serve --port 18140 --threads 2 --ctx 32768 --calibration-cache $cal "$@" 2> $out/sluice.log & sp=$!
$ll -m models/SmolLM2-135M-Instruct.Q4_1.gguf --host 127.0.0.1 --port 18141 -t 2 -tb 2 -c 32768 -np 4 > /dev/null 2> $out/llama.log & lp=$!
for p in 18140 18141; do for _ in $(seq 300); do curl -sf localhost:$p/health >/dev/null && break; sleep 0.2; done; done
for r in $(seq $rounds); do
  for s in sluice llama; do
    if [ $s = sluice ]; then port=18140; pid=$sp; else port=18141; pid=$lp; fi
    [ $s = sluice ] && curl -s localhost:18140/metrics > $out/m-$r-before.txt
    ./target/release/sluice-bench closed --url http://127.0.0.1:$port --quiet --timeout-s 120 --pid $pid --concurrency ${C:-8} --temperature ${TEMP:-0} --duration-s ${D:-30} --seed $((r*1000+18)) --out $out/$s-r$r.json > /dev/null 2>&1
    [ $s = sluice ] && curl -s localhost:18140/metrics > $out/m-$r-after.txt
  done
done
kill $sp $lp; wait
