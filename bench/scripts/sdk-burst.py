"""A burst from the official OpenAI Python client: N concurrent chat requests,
the client's own retry policy (max_retries), against one server. Prints one
JSON line: makespan (first send to last answer), how many succeeded, the
attempts the client made (its retries, counted by an httpx event hook), and
the 429/503 answers it saw.

Usage: python bench/scripts/sdk-burst.py BASE_URL [N] [MAX_RETRIES] [MAX_TOKENS]
Run by bench/scripts/sdk-burst (sluice and llama-server side by side).
"""

import json
import sys
import threading
import time

import httpx
import openai

base = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 24
max_retries = int(sys.argv[3]) if len(sys.argv) > 3 else 4
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64

lock = threading.Lock()
statuses = {}


def on_response(resp):
    with lock:
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1


http_client = httpx.Client(event_hooks={"response": [on_response]}, timeout=600)
client = openai.OpenAI(
    base_url=base + "/v1", api_key="unused", max_retries=max_retries, http_client=http_client
)
barrier = threading.Barrier(n)
done = [None] * n
errors = []


def one(i):
    barrier.wait()
    try:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"Request {i}: tell me a short story about a robot."}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        done[i] = time.perf_counter()
    except Exception as e:  # noqa: BLE001 -- counted, not raised
        with lock:
            errors.append(type(e).__name__)


threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join()
ok = [d for d in done if d is not None]
print(
    json.dumps(
        {
            "requests": n,
            "succeeded": len(ok),
            "makespan_s": round(max(ok) - t0, 2) if ok else None,
            "attempts": sum(statuses.values()),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "errors": errors,
        }
    )
)
