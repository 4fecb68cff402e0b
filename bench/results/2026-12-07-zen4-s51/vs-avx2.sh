#!/usr/bin/env bash
# Session 51 (16:05-17:07 UTC: vs-avx2.start, vs-avx2.end): the AVX2 leg at 630f3ad,
# the fresh-prompt closed loops, the long prompts, both mixes and the
# head-of-line figure (the repeated-prompt loops, the conversation and the
# 2x overload left out). /tmp/s51/sluice-avx2-4 was 630f3ad's AVX2 build.
SLUICE_BIN=/tmp/s51/sluice-avx2-4 ROUNDS=3 CLOSED_PROMPTS=fresh SKIP_CONVERSATION=1 SKIP_OVERLOAD=1 \
    MIX_S=90 MIX_BELOW_RPS=0.1 MIX_OVER_RPS=0.4 \
    bench/scripts/vs-llama-server /work/peer/build-avx2/bin/llama-server /tmp/s51/vs-avx2/out
