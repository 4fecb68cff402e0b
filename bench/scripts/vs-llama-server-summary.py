#!/usr/bin/env python3
"""Medians over rounds of bench/scripts/vs-llama-server's figures, and the
ratio sluice / llama-server of each, as a Markdown table (and summary.json).
Also each round's own ratio: in round r each workload ran on one server and
then at once on the other (the script alternates which goes first), so the
per-round ratios show whether a median's ratio held in every round or came
from one.

Usage: vs-llama-server-summary.py OUT_DIR
"""
import glob
import json
import os
import statistics
import sys

out = sys.argv[1]
SERVERS = ["sluice", "llama"]


def rounds(server):
    return sorted(glob.glob(os.path.join(out, server, "r*")))


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def closed(d, name):
    r = load(os.path.join(d, f"{name}.json"))
    if r is None:
        return None
    p = r["result"]["phases"][0]
    ttft = (p.get("ttft") or {}).get("p50_ms")
    return {"tok_s": p["tokens_per_s"], "ttft_p50_ms": ttft, "done": p["outcomes"].get("completed", 0),
            "requests": p["requests"], "refused": p["requests"] - p["outcomes"].get("completed", 0)}


def mix(d, name):
    r = load(os.path.join(d, f"{name}.json"))
    if r is None:
        return None
    p = r["result"]["phases"][0]
    lat = lambda k, q: (p.get(k) or {}).get(q)
    refused = sum(v for k, v in p["statuses"].items() if k in ("429", "503"))
    return {"goodput_rps": p["goodput_rps"], "requests": p["requests"], "refused": refused,
            "ttft_p50_ms": lat("ttft", "p50_ms"), "ttft_p99_ms": lat("ttft", "p99_ms"),
            "tpot_p50_ms": lat("tpot", "p50_ms"), "tpot_p99_ms": lat("tpot", "p99_ms"),
            "refused_within_10ms_share": p.get("refused_within_10ms_share")}


def conversation(d):
    r = load(os.path.join(d, "conversation.json"))
    if r is None:
        return None
    return [t["ttft_ms"] for t in r["result"]["turns"]]


def hol(d):
    r = load(os.path.join(d, "hol.json"))
    if r is None:
        return None
    res = r["result"]
    # The host's steal from the box's CPUs around the largest gap (a VM; the
    # harness reads /proc/stat): the part of that gap the server did not set.
    steal = res.get("steal") or {}
    return {"long_ttft_s": res["long_ttft_ms"] / 1e3, "gap_max_ms": res["gaps_during_long_prefill"]["max_ms"],
            "steal_in_gap_max_ms": steal.get("in_largest_gap_ms")}


def overload(d):
    r = load(os.path.join(d, "overload.json"))
    if r is None:
        return None
    phases = r["result"]["phases"]
    over = phases[-1]
    proc = r["result"].get("target_process") or {}
    return {"goodput_rps": over["goodput_rps"], "offered_rps": over["offered_rps"],
            "capacity_rps": r["capacity_rps"], "rss_mb_max": proc.get("rss_mb_max")}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


figures = {}  # name -> server -> [per round]
for s in SERVERS:
    for d in rounds(s):
        for prompts in ["fresh", "repeat"]:
            for sampling in ["greedy", "sampled"]:
                for c in [1, 2, 4, 8]:
                    name = f"closed-{prompts}-{sampling}-c{c}"
                    v = closed(d, name)
                    for k in ["tok_s", "ttft_p50_ms", "done", "refused"]:
                        figures.setdefault(f"{name} {k}", {}).setdefault(s, []).append(v and v[k])
        for c in [1, 4]:
            name = f"closed-long-greedy-c{c}"
            v = closed(d, name)
            for k in ["tok_s", "ttft_p50_ms", "done", "refused"]:
                figures.setdefault(f"{name} {k}", {}).setdefault(s, []).append(v and v[k])
        for name in ["mix-below", "mix-over"]:
            v = mix(d, name)
            for k in ["goodput_rps", "requests", "refused", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                      "tpot_p99_ms", "refused_within_10ms_share"]:
                figures.setdefault(f"{name} {k}", {}).setdefault(s, []).append(v and v[k])
        conv = conversation(d)
        for t in range(5):
            figures.setdefault(f"conversation turn {t + 1} ttft_ms", {}).setdefault(s, []).append(
                conv[t] if conv and len(conv) > t else None)
        h = hol(d)
        for k in ["long_ttft_s", "gap_max_ms", "steal_in_gap_max_ms"]:
            figures.setdefault(f"hol {k}", {}).setdefault(s, []).append(h and h[k])
        o = overload(d)
        for k in ["capacity_rps", "goodput_rps", "rss_mb_max"]:
            figures.setdefault(f"overload {k}", {}).setdefault(s, []).append(o and o[k])
        if o:
            figures.setdefault("overload goodput / capacity", {}).setdefault(s, []).append(
                o["goodput_rps"] / o["capacity_rps"] if o["capacity_rps"] else None)

summary = {}
print(f"# sluice vs llama-server: medians over {len(rounds('sluice'))} rounds\n")
print("| figure | sluice | llama-server | sluice / llama | rounds (sluice; llama) | per round: sluice / llama |")
print("|---|---|---|---|---|---|")
fmt = lambda x: "-" if x is None else (f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}")
for name, by in figures.items():
    a, b = med(by.get("sluice", [])), med(by.get("llama", []))
    ratio = a / b if a is not None and b else None
    paired = [x / y if x is not None and y else None
              for x, y in zip(by.get("sluice", []), by.get("llama", []))]
    summary[name] = {"sluice": a, "llama": b, "ratio": ratio,
                     "rounds": {"sluice": by.get("sluice", []), "llama": by.get("llama", [])},
                     "ratio_by_round": paired}
    per = "; ".join(" ".join(fmt(x) for x in by.get(s, [])) for s in SERVERS)
    print(f"| {name} | {fmt(a)} | {fmt(b)} | {fmt(ratio)} | {per} | {' '.join(fmt(x) for x in paired)} |")
# What the idle server used while the other was loaded (the script's
# idle-check.tsv): a server still computing for clients who left would
# have slowed the other's figures.
idle = os.path.join(out, "idle-check.tsv")
if os.path.exists(idle):
    with open(idle) as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    rows = [r for r in rows if len(r) == 5]
    if rows:
        top = max(rows, key=lambda r: int(r[4]))
        print(f"\nThe idle server's CPU while the other was loaded: at most {top[4]} ms "
              f"({top[3]}, round {top[0]}, during {top[2]}'s {top[1]}); "
              f"{sum(int(r[4]) > 1000 for r in rows)} of {len(rows)} workloads over 1,000 ms.")
        summary["idle_cpu_ms_max"] = {"ms": int(top[4]), "round": int(top[0]), "workload": top[1],
                                      "loaded": top[2], "idle": top[3]}
# Workloads the harness could not finish on a server (the script's
# failed.tsv), with the harness's last words.
failed = os.path.join(out, "failed.tsv")
if os.path.exists(failed):
    with open(failed) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    if rows:
        print("\nNot finished (the figure is missing from the table):")
        for r in rows:
            print(f"- round {r[0]}, {r[2]}: {r[1]}: {r[3] if len(r) > 3 else ''}")
        summary["failed"] = [{"round": int(r[0]), "workload": r[1], "server": r[2],
                              "error": r[3] if len(r) > 3 else ""} for r in rows]
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
