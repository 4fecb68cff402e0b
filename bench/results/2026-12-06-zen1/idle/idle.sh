#!/usr/bin/env bash
# idle CPU of a sluice binary: start, 3 requests, then 60 s idle after 10 s settle
bin=$1
$bin serve --port 18080 --calibration-cache /tmp/s39/cal/bench.json > /tmp/s39/idle-$2.log 2>&1 &
pid=$!
for i in $(seq 1 60); do curl -sf localhost:18080/readyz >/dev/null && break; sleep 0.5; done
for i in 1 2 3; do curl -s localhost:18080/v1/chat/completions -d '{"messages":[{"role":"user","content":"Write a short poem about rivers."}],"max_tokens":32}' >/dev/null; done
sleep 10
a=$(awk '{print $14+$15}' /proc/$pid/stat); sleep 60; b=$(awk '{print $14+$15}' /proc/$pid/stat)
echo "$2: $(( (b-a)*10 )) ms CPU in 60 s idle"
kill $pid; wait $pid 2>/dev/null
