bin=$1
$bin serve --port 18080 --calibration-cache /tmp/s39/cal/bench.json > /tmp/s39/wake.log 2>&1 &
pid=$!
for i in $(seq 1 60); do curl -sf localhost:18080/readyz >/dev/null && break; sleep 0.5; done
curl -s localhost:18080/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":8}' >/dev/null
sleep 3
s(){ cat /proc/$pid/task/*/status | awk '/^voluntary_ctxt_switches/{v+=$2} /^nonvoluntary/{n+=$2} END{print v, n}'; }
a=$(s); sleep 5; b=$(s)
echo "$2: before $a after $b"
for t in /proc/$pid/task/*; do echo "$(cat $t/comm) $(awk '/^voluntary/{print $2}' $t/status)"; done | sort -k2 -n -r | head -5
kill $pid; wait $pid 2>/dev/null
