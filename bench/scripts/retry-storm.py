#!/usr/bin/env python3
"""A retry storm against a running server (issue 25, acceptance 3).

Two phases of DURATION_S seconds each, on loopback:
  baseline  STEADY clients in a closed loop (each sends its next request when
            its last one is answered; after a 429/503 it waits what
            retry-after-ms says, as the OpenAI SDKs do) and one more such
            client, "polite", counted on its own;
  storm     the same, plus STORM clients that retry at once: each keeps one
            connection (as an SDK's pool does) and, the moment it has an
            answer, sends the same request again after a refusal, or its next
            request after a completion.
Every request is a chat completion of ANSWER_TOKENS tokens (ignore_eos,
greedy), not streamed. Completions counts every client's 200s; the ratio
storm / baseline says what the storm cost the server's throughput.

Usage: retry-storm.py HOST:PORT [OUT.json]
  env: DURATION_S (30), STEADY (4), STORM (16), ANSWER_TOKENS (32)
"""
import http.client
import json
import os
import sys
import threading
import time

host, port = sys.argv[1].rsplit(":", 1)
port = int(port)
out = sys.argv[2] if len(sys.argv) > 2 else None
duration = float(os.environ.get("DURATION_S", "30"))
steady = int(os.environ.get("STEADY", "4"))
storm = int(os.environ.get("STORM", "16"))
answer = int(os.environ.get("ANSWER_TOKENS", "32"))


def body(i, n):
    return json.dumps({
        "model": "m", "max_tokens": answer, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Client {i}, request {n}: write about rivers."}],
    })


def client(i, patient, stop, counts):
    conn = None
    n = 0
    while not stop.is_set():
        try:
            if conn is None:
                conn = http.client.HTTPConnection(host, port, timeout=120)
            conn.request("POST", "/v1/chat/completions", body=body(i, n),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            counts["attempts"] += 1
            counts[str(r.status)] = counts.get(str(r.status), 0) + 1
            if r.status == 200:
                counts["completed"] += 1
            if r.status not in (429, 503):
                # The next request is a new one; after a refusal it is the
                # same one again (a retry re-sends the same body).
                n += 1
            elif patient and r.status in (429, 503):
                ms = r.getheader("retry-after-ms")
                wait = int(ms) / 1000 if ms else float(r.getheader("retry-after", "1"))
                stop.wait(min(wait, 60))
            if r.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            counts["errors"] += 1
            conn = None
            stop.wait(0.05)


def phase(with_storm):
    stop = threading.Event()
    groups = {"steady": [], "polite": [], "storm": []}
    threads = []
    def start(group, i, patient):
        c = {"attempts": 0, "completed": 0, "errors": 0}
        groups[group].append(c)
        t = threading.Thread(target=client, args=(i, patient, stop, c), daemon=True)
        threads.append(t)
    for i in range(steady):
        start("steady", i, True)
    start("polite", steady, True)
    if with_storm:
        for i in range(storm):
            start("storm", 100 + i, False)
    t0 = time.time()
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    elapsed = time.time() - t0
    for t in threads:
        t.join(timeout=130)
    total = lambda g, k: sum(c.get(k, 0) for c in groups[g])
    res = {"seconds": round(elapsed, 1)}
    for g in groups:
        res[g] = {k: total(g, k) for k in ["attempts", "completed", "200", "429", "503", "errors"]}
    res["completed"] = sum(res[g]["completed"] for g in groups)
    return res


base = phase(False)
print(f"baseline: {json.dumps(base)}", flush=True)
stormy = phase(True)
print(f"storm:    {json.dumps(stormy)}", flush=True)
ratio = stormy["completed"] / base["completed"] if base["completed"] else None
summary = {"duration_s": duration, "steady": steady, "storm": storm, "answer_tokens": answer,
           "baseline": base, "with_storm": stormy, "completed_ratio": ratio,
           "polite_served": stormy["polite"]["completed"]}
print(f"completions with the storm / without: {ratio:.2f}; polite client served {stormy['polite']['completed']} "
      f"(without the storm {base['polite']['completed']}); storm attempts {stormy['storm']['attempts']}")
if out:
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
