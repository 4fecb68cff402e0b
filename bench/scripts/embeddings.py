"""/v1/embeddings against sluice and llama-server: throughput and agreement.

Run by bench/scripts/embeddings. Sends the same seeded texts to BASE_URL in
requests of BATCH inputs, CLIENTS at a time, and prints one JSON line:
inputs/s, prompt tokens/s, the wall time, and the vectors (for the
agreement between servers, computed by the script).
"""
import json
import random
import sys
import threading
import time
import urllib.request

base, n_inputs, batch, clients = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
words = ("river stone light garden market engine window winter music paper ocean "
         "mountain letter station bridge silver forest morning number system").split()
rng = random.Random(7)
texts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(n_inputs)]
batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
vectors = [None] * len(texts)
tokens = [0]
errors = []
lock = threading.Lock()


def post(inputs):
    req = urllib.request.Request(
        base + "/v1/embeddings",
        data=json.dumps({"input": inputs, "model": "m", "encoding_format": "float"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def worker(queue):
    while True:
        with lock:
            if not queue:
                return
            i = queue.pop(0)
        try:
            v = post(batches[i])
        except Exception as e:  # noqa: BLE001 -- reported in the result
            with lock:
                errors.append(str(e))
            continue
        with lock:
            tokens[0] += v["usage"]["prompt_tokens"]
            for d in v["data"]:
                vectors[i * batch + d["index"]] = d["embedding"]


post(texts[:1])  # warm
queue = list(range(len(batches)))
t0 = time.monotonic()
threads = [threading.Thread(target=worker, args=(queue,)) for _ in range(clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.monotonic() - t0
print(json.dumps({"inputs": n_inputs, "batch": batch, "clients": clients, "wall_s": round(wall, 3),
                  "inputs_per_s": round(n_inputs / wall, 2), "prompt_tokens_per_s": round(tokens[0] / wall, 1),
                  "prompt_tokens": tokens[0], "errors": errors[:3], "vectors": vectors}))
