#!/usr/bin/env bash
# Keeps a cargo build of another checkout running: clean, build, repeat.
cd /tmp/a5/other
n=0
while [ ! -e /tmp/a5/stop ]; do
  n=$((n+1)); s=$(date +%s)
  cargo clean -q 2>/dev/null
  cargo build --release --workspace >/tmp/a5/busy-build.log 2>&1
  echo "build $n: $(( $(date +%s) - s )) s rc=$?" >> /tmp/a5/busy.txt
done
