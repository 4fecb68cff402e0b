# A lower bound on the head-of-line prompt's first token in sluice's shape on
# this CPU's AVX2 leg (per-sequence KV: every step one pass decoding the two
# streams and one pass of a prompt chunk), with every step at the acceptance's
# 200 ms largest gap and no headroom. Costs, flash attention off with K in
# q8_0 (the pairing chosen here), 32-token chunks: ms a prompt token 128 deep
# from --calibrate-only (../calibrate/avx2-1.log), 4,096 deep from llama-bench
# (../llama-bench/bench-d4096.md: 78.78 tok/s); linear in depth between. The
# streams' decode pass at its cheapest (both streams shallow): 15 ms, from the
# calibration's decode rates (10.7 ms one sequence, 24.2 ms four).
P, S, D = 6279, 0.200, 0.015
c = lambda d: (4.26 + (1000 / 78.78 - 4.26) * (d - 128) / (4096 - 128)) / 1e3
compute = sum(c(d) for d in range(P))
first_token = compute * S / (S - D)
llama = sorted([51.52, 50.70, 51.36])[1]  # llama-r*.txt, this run
print(f"prompt chunks' compute {compute:.1f} s; first token no sooner than {first_token:.1f} s "
      f"= {first_token / llama:.2f}x llama-server's median {llama:.2f} s")
