cd /work/main
for i in 1 2 3; do
 for v in old new; do
  rm -f /tmp/exp/ab-$v$i.json
  /usr/bin/time -f "rss_kb=%M wall=%e" /tmp/exp/sluice-$v serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --ctx 32768 --calibration-cache /tmp/exp/ab-$v$i.json --calibrate-only > /tmp/exp/ab-$v$i.log 2>&1
 done
done
echo done > /tmp/exp/ab.done
