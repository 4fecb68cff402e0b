# Lower bound on the head-of-line prompt's TTFT in sluice's shape on this CPU:
# every step carries both streams' decode pass and one prompt chunk pass, and
# lasts at most S; costs from llama-bench (flash attention off, K q8_0, V f16).
P = 6279          # prompt tokens
def m(d):  return (7.5 + 3.8 * d / 1000) / 1e3        # marginal s/token of a chunk at depth d
def o(d):  return (5.8 + 4.4 * d / 1000) / 1e3        # fixed s of a chunk pass at depth d
def D2(d): return (14.5 + 16.4 * d / 1000) / 1e3      # one pass decoding 2 streams d deep
for S in (0.120, 0.150, 0.200):
    t, dp, ds = 0.0, 0.0, 130.0
    while dp < P:
        room = S - D2(ds) - o(dp)
        n = max(room / m(dp), 0.0)
        if n <= 0: t = float('inf'); break
        dp += n; ds += 1; t += S
    alone = sum(m(d) for d in range(P))
    print(f"steps of {S*1e3:.0f} ms: prompt done after {t:.0f} s (streams end {ds:.0f} deep); the prompt alone in big chunks {alone:.0f} s")
