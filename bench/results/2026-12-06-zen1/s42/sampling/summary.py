import json, sys, os, statistics as st
# Per run: requests, tokens, tok/s, inter-token gap p50 (ms); then per server
# the ratio of the sampled run to the greedy one of the same round.
d = sys.argv[1]
ratio = {'sluice': [], 'llama': []}
for r in range(1, 10):
    for srv in ('sluice', 'llama'):
        row = {}
        for t in ('0', '0.7'):
            f = f'{d}/{srv}-t{t}-r{r}.json'
            if os.path.exists(f):
                row[t] = json.load(open(f))['result']['phases'][0]
        if len(row) < 2:
            continue
        g, s = row['0'], row['0.7']
        ratio[srv].append(s['tokens_per_s'] / g['tokens_per_s'])
        print(f"r{r} {srv}: greedy {g['requests']} req {g['tokens']} tok {g['tokens_per_s']:.1f} tok/s itl50 {g['itl']['p50_ms']:.1f}; "
              f"sampled {s['requests']} req {s['tokens']} tok {s['tokens_per_s']:.1f} tok/s itl50 {s['itl']['p50_ms']:.1f}; "
              f"sampled/greedy {ratio[srv][-1]:.3f}")
for srv, v in ratio.items():
    if v:
        print(f"median {srv}: sampled/greedy tok/s {st.median(v):.3f}")
