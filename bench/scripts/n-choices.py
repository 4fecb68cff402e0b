"""n > 1 sharing the prompt's cells: one prompt of ~1,000 tokens, greedy, 16
tokens a choice; wall time and prefilled tokens for n = 1 and n = 4, against
a running sluice started with --prefix-cache-mb 0 (so that nothing else is
reused). Usage: python3 bench/scripts/n-choices.py BASE_URL [ROUNDS]"""
import json
import statistics
import sys
import time
import urllib.request

base = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3


def metric(name):
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    return float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name + " ")))


def run(n, seed):
    words = [f"Line {i}: the fox {seed} jumped over fence {i * 7 % 101}." for i in range(60)]
    body = {"prompt": "\n".join(words), "max_tokens": 16, "temperature": 0, "ignore_eos": True, "n": n}
    before = metric("sluice_prefill_tokens_total")
    t0 = time.monotonic()
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    v = json.load(urllib.request.urlopen(req, timeout=600))
    wall = time.monotonic() - t0
    return wall, metric("sluice_prefill_tokens_total") - before, v["usage"]["prompt_tokens"]


rows = {1: [], 4: []}
for r in range(rounds):
    for n in (1, 4):
        rows[n].append(run(n, seed=r * 10 + n))  # a fresh prompt each time
for n, rs in rows.items():
    print(json.dumps({"n": n, "wall_s": [round(w, 3) for w, _, _ in rs],
                      "wall_s_median": round(statistics.median(w for w, _, _ in rs), 3),
                      "prefilled_tokens": [p for _, p, _ in rs], "prompt_tokens": [t for _, _, t in rs]}))
