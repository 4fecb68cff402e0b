# Which pairing each cache's timings choose by the rule before session 47
# (worst ratio over the two timed depths) and by the new one (also 4,096
# deep on the line through them, at most 8x the deepest timing).
import json, sys
names = ["off/q8_0/f16", "off/f16", "on/q8_0", "on/f16"]
def worst(by):  # by[pairing][depth] = (decode, prefill)
    n = min(len(b) for b in by)
    best = [[min(b[d][k] for b in by) for k in (0, 1)] for d in range(n)]
    return [max(b[d][k] / best[d][k] for d in range(n) for k in (0, 1)) for b in by]
def choice(by):
    w = worst(by); b = min(range(len(w)), key=lambda i: w[i])
    return (b if w[b] < w[0] * 0.95 else 0), w
for f in sys.argv[1:]:
    e = json.load(open(f))["entries"][0]
    t = e["attention_timings"]
    by = [[(d["decode_s_per_token"], d["prefill_s_per_token"]) for d in p] for p in t]
    deep = []
    for p in t:
        (d0, a), (d1, b) = (p[0]["depth"], p[0]), (p[-1]["depth"], p[-1])
        line = lambda k: max(a[k] + (b[k] - a[k]) * (4096 - d0) / (d1 - d0), min(a[k], b[k]))
        deep.append(by[len(deep)] + [(line("decode_s_per_token"), line("prefill_s_per_token"))])
    (o, wo), (n, wn) = choice(by), choice(deep)
    print(f"{f}: old rule {names[o]} (worst {', '.join(f'{x:.2f}' for x in wo)}); "
          f"new {names[n]} (worst {', '.join(f'{x:.2f}' for x in wn)}); kept: {e['attention']}")
