import http.client, json, time, sys, statistics, random
port = int(sys.argv[1]); label = sys.argv[2]; n = int(sys.argv[3]) if len(sys.argv) > 3 else 15
words = "the quick brown fox jumps over a lazy dog while seven curious cats watch from the old stone wall near river".split()
def prompt(i):
    rnd = random.Random(i)
    return f"Request {i} {rnd.randint(0,10**9)}: " + " ".join(rnd.choice(words) for _ in range(100))
def one(i):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt(i)}],
                       "max_tokens": 8, "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None; ptoks = None
    buf = b""
    while True:
        line = r.readline()
        if not line: break
        line = line.strip()
        if not line.startswith(b"data: "): continue
        data = line[6:]
        if data == b"[DONE]": break
        ev = json.loads(data)
        ch = ev.get("choices") or []
        if ch and (ch[0].get("delta") or {}).get("content") and first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    c.close()
    return first, total
for i in range(2): one(10**6 + i)
res = [one(int(time.time()) * 100 + i) for i in range(n)]
f = [x[0] * 1000 for x in res if x[0] is not None]; t = [x[1] * 1000 for x in res]
print(f"{label}: ttft p50 {statistics.median(f):.1f} ms (min {min(f):.1f}, max {max(f):.1f}); total p50 {statistics.median(t):.1f} ms; n={len(f)}")
