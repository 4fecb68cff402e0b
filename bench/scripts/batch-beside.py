#!/usr/bin/env python3
"""The Batch API's side of bench/scripts/batch-beside (issue 27): batches made
and watched over plain HTTP (no SDK needed), and the idle-box comparison.

    batch-beside.py start URL LINES          create a batch of LINES chat lines; prints its id
    batch-beside.py done URL BATCH_ID        prints the lines completed so far
    batch-beside.py cancel URL BATCH_ID      cancels it and waits until it has ended
    batch-beside.py idle URL LINES CLIENTS   the same LINES requests as a closed loop of CLIENTS
                                             clients, then as one batch; prints JSON
"""

import json
import random
import sys
import threading
import time
import urllib.request

MAX_TOKENS = 64
WORDS = "river stone light window garden morning letter bridge music winter harbour orchard".split()


def bodies(n, seed=7):
    """n chat requests: prompts of 20-200 words, 64 tokens each (ignore_eos)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
        out.append({
            "messages": [{"role": "user", "content": f"Request {i}: summarise: {words}"}],
            "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": i, "ignore_eos": True,
        })
    return out


def call(url, method="GET", body=None, headers=None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def create(base, reqs):
    lines = "".join(
        json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
        for i, b in enumerate(reqs)
    )
    boundary = "benchBoundary7"
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n"
        f"{lines}\r\n--{boundary}--\r\n"
    ).encode()
    f = call(base + "/v1/files", "POST", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    b = call(base + "/v1/batches", "POST", json.dumps({
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
    }).encode(), {"Content-Type": "application/json"})
    return b["id"]


def batch(base, bid):
    return call(f"{base}/v1/batches/{bid}")


def closed_loop(base, reqs, clients):
    todo = list(reqs)
    lock = threading.Lock()
    tokens = [0]

    def client():
        while True:
            with lock:
                if not todo:
                    return
                b = todo.pop()
            r = call(base + "/v1/chat/completions", "POST", json.dumps(b).encode(),
                     {"Content-Type": "application/json"})
            with lock:
                tokens[0] += r["usage"]["completion_tokens"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0], time.monotonic() - t0


def idle(base, n, clients):
    reqs = bodies(n)
    loop_tokens, loop_s = closed_loop(base, reqs, clients)
    t0 = time.monotonic()
    bid = create(base, reqs)
    while (b := batch(base, bid))["status"] not in ("completed", "cancelled", "expired"):
        time.sleep(0.05)
    batch_s = time.monotonic() - t0
    assert b["request_counts"]["completed"] == n, b
    batch_tokens = n * MAX_TOKENS
    return {
        "lines": n, "clients": clients,
        "closed_loop_tok_s": loop_tokens / loop_s, "closed_loop_s": loop_s,
        "batch_tok_s": batch_tokens / batch_s, "batch_s": batch_s,
        "batch_over_closed_loop": (batch_tokens / batch_s) / (loop_tokens / loop_s),
    }


def main():
    cmd, base = sys.argv[1], sys.argv[2]
    if cmd == "start":
        print(create(base, bodies(int(sys.argv[3]), seed=11)))
    elif cmd == "done":
        print(batch(base, sys.argv[3])["request_counts"]["completed"])
    elif cmd == "cancel":
        call(f"{base}/v1/batches/{sys.argv[3]}/cancel", "POST", b"")
        while batch(base, sys.argv[3])["status"] not in ("completed", "cancelled", "expired"):
            time.sleep(0.2)
    elif cmd == "idle":
        print(json.dumps(idle(base, int(sys.argv[3]), int(sys.argv[4]))))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
