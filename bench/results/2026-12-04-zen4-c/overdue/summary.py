#!/usr/bin/env python3
"""Per round and median: the long-prompt loop and the mix at 0.8 req/s, old vs new."""
import json, os, statistics, sys
d = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
def ph(f):
    return json.load(open(f))['result']['phases'][0]
rows = {}
for s in ('old', 'new', 'new2'):
    for r in (1, 2, 3):
        lf, mf = f'{d}/long-{s}-r{r}.json', f'{d}/mix-{s}-r{r}.json'
        if not (os.path.exists(lf) and os.path.exists(mf)):
            continue
        l, m = ph(lf), ph(mf)
        met = open(f'{d}/metrics-{s}-r{r}.txt').read().split() if os.path.exists(f'{d}/metrics-{s}-r{r}.txt') else []
        od = met[met.index('sluice_steps_overdue_first_total') + 1] if 'sluice_steps_overdue_first_total' in met else '-'
        rows[(s, r)] = dict(
            l_done=l['outcomes'].get('completed', 0), l_tok=l['tokens_per_s'],
            l_p50=l['ttft']['p50_ms'] / 1e3, l_mean=l['ttft']['mean_ms'] / 1e3, l_max=l['ttft']['max_ms'] / 1e3,
            m_req=m['requests'], m_ok=m['outcomes'].get('completed', 0), m_ref=m['requests'] - m['outcomes'].get('completed', 0),
            m_good=m['goodput_rps'], m_p50=m['ttft']['p50_ms'] / 1e3, m_p99=m['ttft']['p99_ms'] / 1e3,
            m_itl99=m['short_requests']['itl']['p99_ms'], od=od)
print('| binary | round | long: done, tok/s, TTFT p50 / mean / max (s) | mix 0.8: requests, completed, not completed, goodput, TTFT p50 / p99 (s), ITL p99 (ms) | overdue-first steps (both phases) |')
print('|---|---|---|---|---|')
for (s, r), x in sorted(rows.items()):
    print(f"| {s} | {r} | {x['l_done']}, {x['l_tok']:.2f}, {x['l_p50']:.1f} / {x['l_mean']:.1f} / {x['l_max']:.1f} | "
          f"{x['m_req']}, {x['m_ok']}, {x['m_ref']}, {x['m_good']:.3f}, {x['m_p50']:.1f} / {x['m_p99']:.1f}, {x['m_itl99']:.0f} | {x['od']} |")
for s in ('old', 'new', 'new2'):
    xs = [x for (t, _), x in rows.items() if t == s]
    if not xs:
        continue
    med = lambda k: statistics.median(x[k] for x in xs)
    print(f"| {s} | median | {med('l_tok'):.2f} tok/s, {med('l_p50'):.1f} / {med('l_mean'):.1f} / {med('l_max'):.1f} | "
          f"goodput {med('m_good'):.3f}, {med('m_p50'):.1f} / {med('m_p99'):.1f}, {med('m_itl99'):.0f} | |")
