#!/usr/bin/env python3
"""sluice's own figures of each build's run, side by side (and llama-server's
tok/s per run, to show how much the box moved between runs)."""
import json, os, sys
root = os.path.dirname(os.path.abspath(__file__))
builds = sys.argv[1:] or ["before", "door", "gate"]

def phase(b, server, name, i=0):
    p = os.path.join(root, f"vs-{b}", server, "r1", f"{name}.json")
    if not os.path.exists(p):
        return None
    return json.load(open(p))["result"]["phases"][i]

def row(label, f):
    cells = []
    for b in builds:
        try:
            cells.append(f(b))
        except (TypeError, KeyError):
            cells.append("-")
    print(f"| {label} | " + " | ".join(cells) + " |")

print("| figure | " + " | ".join(builds) + " |")
print("|---|" + "---|" * len(builds))
for prompts in ["fresh", "repeat"]:
    for sampling in ["greedy", "sampled"]:
        for server in ["sluice", "llama"]:
            row(f"{server} tok/s, {prompts} {sampling}, 1 / 2 / 4 / 8",
                lambda b: " / ".join(f"{phase(b, server, f'closed-{prompts}-{sampling}-c{c}')['tokens_per_s']:.0f}" for c in [1, 2, 4, 8]))
for prompts in ["fresh", "repeat"]:
    for sampling in ["greedy", "sampled"]:
        row(f"sluice TTFT p50 ms, {prompts} {sampling}, 1 / 2 / 4",
            lambda b: " / ".join(f"{phase(b, 'sluice', f'closed-{prompts}-{sampling}-c{c}')['ttft']['p50_ms']:.1f}" for c in [1, 2, 4]))
row("sluice closed loops: requests served / sent",
    lambda b: "{} / {}".format(*[sum(phase(b, 'sluice', f'closed-{p}-{s}-c{c}')[k] for p in ['fresh', 'repeat'] for s in ['greedy', 'sampled'] for c in [1, 2, 4, 8]) for k in ['good', 'requests']]))
row("sluice overload 2x: goodput req/s, refused, within 10 ms",
    lambda b: (lambda p: f"{p['goodput_rps']:.2f}, {p['requests'] - p['good']}, {100 * p['refused_within_10ms_share']:.0f} %")(phase(b, 'sluice', 'overload', 1)))
