#!/usr/bin/env bash
# old (s53 build) vs fillers, alternating: fresh sampled 4 clients, 20 s, /metrics around each
cd /work/main; out=$1; rounds=$2; mkdir -p $out
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
for r in $(seq $rounds); do
  order="old fill"; [ $((r % 2)) = 0 ] && order="fill old"
  for v in $order; do
    bin=/tmp/s54/sluice-native; [ $v = fill ] && bin=/tmp/s54/sluice-fill
    cp /tmp/s53/cal-native.json $out/cal-$v-$r.json
    $bin serve --model $model --port 18161 --threads 2 --ctx 32768 --calibration-cache $out/cal-$v-$r.json > $out/$v-$r.log 2>&1 & pid=$!
    until curl -sf http://127.0.0.1:18161/health >/dev/null; do sleep 0.3; done
    curl -s http://127.0.0.1:18161/metrics > $out/$v-$r.m0
    ./target/release/sluice-bench closed --url http://127.0.0.1:18161 --quiet --timeout-s 120 --temperature 0.7 --concurrency 4 --duration-s 20 --seed $((r*1000+81)) --out $out/$v-$r.json > $out/$v-$r.txt 2>/dev/null
    curl -s http://127.0.0.1:18161/metrics > $out/$v-$r.m1
    kill $pid; wait $pid 2>/dev/null
    echo "$v r$r $(sed -n 4p $out/$v-$r.txt | awk '{print "done",$3,"ttft50",$9,"itl50",$11,"tok/s",$13}') | $(python3 /tmp/s53/mdelta.py $out/$v-$r.m0 $out/$v-$r.m1 | head -1) fillers $(grep '^sluice_pass_fillers_total' $out/$v-$r.m1 | cut -d' ' -f2)"
  done
done
