#!/usr/bin/env python3
"""TTFT of a fresh ~N-token prompt, alone and beside K running streams.
Usage: ttft_streams.py URL K PROMPT_WORDS REPEATS"""
import http.client, json, sys, threading, time, urllib.parse, random

url, k, words, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
u = urllib.parse.urlparse(url)
stop = threading.Event()
random.seed(5)
vocab = "river stone light apple cloud music paper garden window silver forest thunder ocean candle mountain".split()

def stream(i):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"messages": [{"role": "user", "content": f"Story {i}: tell a very long story."}],
            "max_tokens": 3000, "stream": True, "temperature": 0, "ignore_eos": True}
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    while not stop.is_set():
        line = r.fp.readline()
        if not line:
            break
    c.close()

def ttft(tag):
    text = f"{tag} " + " ".join(random.choice(vocab) for _ in range(words))
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse(); d = json.loads(r.read())
    dt = time.monotonic() - t0
    c.close()
    return dt, d.get("usage", {}).get("prompt_tokens")

ts = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(k)]
for t in ts: t.start()
time.sleep(3 if k else 0)
out = []
for i in range(reps):
    dt, n = ttft(f"Q{i}-{k}-{random.random()}")
    out.append(dt)
    print(f"k={k} prompt_tokens={n} ttft_s={dt:.3f}", flush=True)
stop.set()
out.sort()
print(f"k={k} median_s={out[len(out)//2]:.3f}")
