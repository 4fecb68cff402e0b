#!/usr/bin/env bash
# As run, session 47 (the peer's AVX2 llama-bench, crate's ggml): prompt
# chunks 4,096 tokens deep by attention pairing, then 512-token chunks there
# for flash attention on with f16 (llama-server's default) and off with K in
# q8_0. From the repository root.
B=/work/peer/build-avx2/bin/llama-bench; M=models/SmolLM2-135M-Instruct.Q4_1.gguf
out=bench/results/2026-12-07-xeon-s47/llama-bench
for cfg in "-fa 0 -ctk q8_0 -ctv f16" "-fa 1 -ctk f16 -ctv f16" "-fa 0 -ctk f16 -ctv f16" "-fa 1 -ctk q8_0 -ctv q8_0"; do
    $B -m $M -t 2 -p 16,32,64,128 -n 0 -d 4096 -r 2 $cfg -o md
done > $out/bench-d4096.md
for cfg in "-fa 1 -ctk f16 -ctv f16" "-fa 0 -ctk q8_0 -ctv f16"; do
    $B -m $M -t 2 -p 512 -n 0 -d 4096 -r 2 $cfg -o md
done > $out/bench-d4096-512.md
