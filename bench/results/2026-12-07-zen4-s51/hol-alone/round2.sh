#!/usr/bin/env bash
S=/tmp/s51/sluice-avx2-proto2; C="--calibration-cache /tmp/s51/cal-avx2.json"
/tmp/s51/hol.sh b-ahead1000 $S $C --decode-ahead-ms 1000
/tmp/s51/hol.sh b-ahead600 $S $C --decode-ahead-ms 600
/tmp/s51/hol.sh b-ahead1500 $S $C --decode-ahead-ms 1500
