#!/usr/bin/env bash
# native: fresh prompts at 4 clients, sluice vs llama-server, with sluice's /metrics around each loop
cp /tmp/s53/vs-native/calibration.json /tmp/s53/cal-native.json
SLUICE_BIN=/tmp/s53/sluice-native LLAMA_BIN=/work/peer/build-native/bin/llama-server CAL=/tmp/s53/cal-native.json \
  /tmp/s53/c8.sh /tmp/s53/fresh-native 2 fresh-greedy-c4 fresh-sampled-c4
for f in /tmp/s53/fresh-native/sluice-*.m1; do echo "$(basename $f .m1): $(python3 /tmp/s53/mdelta.py ${f%.m1}.m0 $f)"; done
