#!/usr/bin/env bash
# Acceptance 5 as worded: a fresh clone runs `make test` twice, and beside
# each run one `cargo build --release --workspace` of another checkout
# (from `cargo clean`) starts at the same moment. (Session 40 kept a build
# looping the whole time: the harsher case.)
# Usage: run.sh COMMIT   (results in /tmp/a5s43/)
set -u
W=/tmp/a5s43
rm -rf $W && mkdir -p $W
git clone -q /work/main $W/sluice && git -C $W/sluice checkout -q "${1:-HEAD}"
git clone -q /work/main $W/other
cd $W/sluice
for i in 1 2; do
  s=$(date +%s)
  ( cd $W/other && cargo clean -q 2>/dev/null
    b=$(date +%s)
    cargo build --release --workspace > $W/busy-build-$i.log 2>&1
    echo "build beside run $i: rc=$? $(( $(date +%s) - b )) s, ended $(date -u +%H:%M:%S)" >> $W/busy.txt ) &
  make test > $W/make-test-$i.log 2>&1; rc=$?
  echo "make test $i: rc=$rc $(( $(date +%s) - s )) s, ended $(date -u +%H:%M:%S)" >> $W/result.txt
  wait
done
echo done >> $W/result.txt
