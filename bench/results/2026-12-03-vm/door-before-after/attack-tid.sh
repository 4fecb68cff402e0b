#!/usr/bin/env bash
set -u
bin=$1; port=18162
ulimit -n "$(ulimit -Hn)"
$bin serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port $port --threads 2 2>/tmp/attack-srv.log &
pid=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
python3 bench/scripts/front-door-attackers.py "127.0.0.1:$port" --tricklers 3000 > /tmp/attack-att.log 2>&1 &
att=$!
sleep 12
m0=$(ls /proc/$pid/task | sort -n | tail -1); r0=$(grep -o "'reconnects': [0-9]*" /tmp/attack-att.log | tail -1)
sleep 10
m1=$(ls /proc/$pid/task | sort -n | tail -1); r1=$(grep -o "'reconnects': [0-9]*" /tmp/attack-att.log | tail -1)
echo "max tid grew by $((m1 - m0)) in 10 s; $r0 -> $r1"
kill $att; kill $pid; wait 2>/dev/null
