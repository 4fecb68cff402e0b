#!/usr/bin/env bash
S=/tmp/s51/sluice-avx2-proto; C="--calibration-cache /tmp/s51/cal-avx2.json"
/tmp/s51/hol.sh a-base $S $C
/tmp/s51/hol.sh a-ahead1000 $S $C --decode-ahead-ms 1000
/tmp/s51/peer-hol.sh a-peer /work/peer/build-avx2/bin/llama-server
/tmp/s51/hol.sh a-ahead2000 $S $C --decode-ahead-ms 2000
