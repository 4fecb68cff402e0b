#!/usr/bin/env bash
# llama-bench (the peer's, same ggml as llama-cpp-sys-2 0.1.161), one sequence,
# prompt passes of 32-128 tokens at depths 0-4096, by attention pairing.
# Usage: run.sh LLAMA_BENCH (from the repository's root)
set -euo pipefail
B=$1; M=models/SmolLM2-135M-Instruct.Q4_1.gguf
d=$(dirname "$0")
for cfg in "-fa off -ctk q8_0 -ctv f16" "-fa on -ctk q8_0 -ctv q8_0" "-fa on -ctk f16 -ctv f16"; do
    $B -m $M -t 2 $cfg -p 32,96 -n 0 -d 0,128,1024 -r 5 -o csv 2>/dev/null | tail -n +2
done > "$d/llama-bench-depths.csv"
for cfg in "-fa off -ctk q8_0 -ctv f16" "-fa on -ctk f16 -ctv f16"; do
    $B -m $M -t 2 $cfg -p 32,64,128 -n 0 -d 1024,4096 -r 3 -o csv 2>/dev/null | tail -n +2
done > "$d/llama-bench-chunks.csv"
