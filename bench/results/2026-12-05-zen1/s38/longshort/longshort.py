# A long prompt alone, then a short one while it is prefilled: each one's time to first token.
import http.client, json, random, sys, threading, time
port = int(sys.argv[1]); seed = int(sys.argv[2]); long_words = int(sys.argv[3]); short_words = int(sys.argv[4]); delay = float(sys.argv[5])
rng = random.Random(seed)
words = "river stone cloud maple signal orange window copper garden silent rocket paper yellow engine thunder velvet harbor candle mirror forest".split()
def text(n): return " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(n))
res = {}
def run(name, prompt, t0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": prompt}]})
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    for line in r:
        if line.startswith(b"data: ") and b"content" in line and first is None:
            d = json.loads(line[6:])
            if d["choices"] and d["choices"][0].get("delta", {}).get("content"):
                first = time.time() - t0
    res[name] = (r.status, first)
long_p, short_p = text(long_words), text(short_words)
t0 = time.time()
a = threading.Thread(target=run, args=("long", long_p, t0)); a.start()
time.sleep(delay)
t1 = time.time()
b = threading.Thread(target=run, args=("short", short_p, t1)); b.start()
a.join(); b.join()
print(f"long ttft {res['long'][1]:.2f} s  short ttft {res['short'][1]:.2f} s  (status {res['long'][0]}/{res['short'][0]})", flush=True)
