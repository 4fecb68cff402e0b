import json, random, threading, time, urllib.request, sys
URL = sys.argv[1]; C = int(sys.argv[2]); DUR = float(sys.argv[3])
words = "river stone light garden window paper music winter forest candle ocean mountain bridge silver morning".split()
out = []; lock = threading.Lock()
def client(i):
    rng = random.Random(i)
    end = time.time() + DUR
    while time.time() < end:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 150)))
        body = {"model": "x", "messages": [{"role": "user", "content": "Read these notes, then write a long story about them.\n" + text}],
                "max_tokens": rng.randint(32, 128), "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(URL + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        t = time.time()
        u = json.load(urllib.request.urlopen(req))["usage"]
        with lock:
            out.append((round(t, 2), i, u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens")))
ts = [threading.Thread(target=client, args=(i,)) for i in range(C)]
[t.start() for t in ts]; [t.join() for t in ts]
for o in sorted(out): print(*o)
tot = sum(o[2] for o in out); cached = sum(o[3] or 0 for o in out)
print("requests", len(out), "prompt", tot, "cached", cached, "share %.3f" % (cached / tot))
