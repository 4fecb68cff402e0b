#!/usr/bin/env bash
# Acceptance 5: fresh clone, `bash .ci/run` (make test, then make lint) twice, each beside a
# parallel `cargo build --release` of another fresh checkout (its own target dir, cold).
set -u
log=/tmp/s29/acc5.log
: > $log
for i in 1 2; do
  rm -rf /tmp/s29/ci-$i /tmp/s29/other-$i
  git clone -q /work/main /tmp/s29/ci-$i
  git clone -q /work/main /tmp/s29/other-$i
  echo "run $i: $(git -C /tmp/s29/ci-$i rev-parse --short HEAD) start $(date -u +%T)" >> $log
  ( cd /tmp/s29/other-$i && s=$(date +%s); cargo build --release > /tmp/s29/other-$i.log 2>&1; echo "run $i: parallel cargo build rc=$? took $(( $(date +%s) - s )) s, ended $(date -u +%T)" >> $log ) &
  other=$!
  s=$(date +%s)
  ( cd /tmp/s29/ci-$i && bash .ci/run > /tmp/s29/ci-$i.log 2>&1 ); rc=$?
  echo "run $i: .ci/run rc=$rc took $(( $(date +%s) - s )) s, ended $(date -u +%T); tests: $(grep -c '^test .* ok$' /tmp/s29/ci-$i.log) ok, $(grep -h 'test result' /tmp/s29/ci-$i.log | tail -3 | tr '\n' ' ')" >> $log
  wait $other
  rm -rf /tmp/s29/other-$i/target
done
echo "done $(date -u +%T)" >> $log
