#!/usr/bin/env bash
# Acceptance 5: a fresh clone, `make test` twice while busy.sh builds another checkout.
rm -f /tmp/a5/stop /tmp/a5/busy.txt /tmp/a5/result.txt
rm -rf /tmp/a5/sluice && git clone -q /work/main /tmp/a5/sluice
(setsid /tmp/a5/busy.sh &)
cd /tmp/a5/sluice
for i in 1 2; do
  s=$(date +%s)
  make test > /tmp/a5/make-test-$i.log 2>&1; rc=$?
  echo "make test $i: rc=$rc $(( $(date +%s) - s )) s, ended $(date -u +%H:%M:%S)" >> /tmp/a5/result.txt
done
touch /tmp/a5/stop
echo done >> /tmp/a5/result.txt
