import json, sys, os, statistics as st
d, conc = sys.argv[1], sys.argv[2]
rat = {'short': [], 'wide': []}; tt = {'short': [], 'wide': []}
lines = []
for r in range(1, 10):
    row = {}
    for cfg in ('short', 'wide', 'llama'):
        f = f'{d}/{cfg}-c{conc}-r{r}.json'
        if os.path.exists(f):
            p = json.load(open(f))['result']['phases'][0]
            row[cfg] = p
    if 'llama' not in row: continue
    l = row['llama']
    parts = [f'r{r}: llama {l["tokens_per_s"]:.1f} tok/s ttft50 {l["ttft"]["p50_ms"]:.0f}']
    for cfg in ('short', 'wide'):
        if cfg in row:
            p = row[cfg]
            rat[cfg].append(p['tokens_per_s'] / l['tokens_per_s']); tt[cfg].append(p['ttft']['p50_ms'] / l['ttft']['p50_ms'])
            refused = p['requests'] - p['good'] if False else sum(v for k, v in (p.get('outcomes') or {}).items() if k not in ('ok', 'good')) if isinstance(p.get('outcomes'), dict) else None
            parts.append(f'{cfg} {p["tokens_per_s"]:.1f} ({rat[cfg][-1]:.3f}) ttft50 {p["ttft"]["p50_ms"]:.0f} ({tt[cfg][-1]:.3f}) reqs {p["requests"]}')
    lines.append('  ' + '; '.join(parts))
print(f'c{conc}:'); print('\n'.join(lines))
for cfg in ('short', 'wide'):
    if rat[cfg]: print(f'  median {cfg}: tok/s {st.median(rat[cfg]):.3f}, ttft p50 {st.median(tt[cfg]):.3f}')
