#!/usr/bin/env bash
rm -f /tmp/s54/l5-done
( cd /tmp/l5-b; n=0; while [ ! -f /tmp/s54/l5-done ]; do n=$((n+1)); rm -rf target; ( time ./deploy/cargo build --release --workspace > /tmp/s54/l5-build-$n.log 2>&1 ) 2> /tmp/s54/l5-build-$n.time; done ) &
for i in 1 2; do
  rm -rf /tmp/l5-c$i; git clone -q /work/main /tmp/l5-c$i
  date -u +%T > /tmp/s54/l5-c$i.start
  ( cd /tmp/l5-c$i && ( time make test > /tmp/s54/l5-c$i.log 2>&1; echo rc=$? >> /tmp/s54/l5-c$i.log ) 2> /tmp/s54/l5-c$i.time )
  date -u +%T > /tmp/s54/l5-c$i.end
done
touch /tmp/s54/l5-done
