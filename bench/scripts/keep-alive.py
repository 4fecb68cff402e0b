"""What a streaming request sees while a ~6,000-token prefill runs: the time
to its response head, to its first `: keep-alive` comment, and to its first
token, for (a) a stream whose own prompt is ~6,000 tokens and (b) a short
stream sent just after a ~6,000-token request. Prints one JSON line per case.

Usage: python bench/scripts/keep-alive.py HOST:PORT    (a server already up)
"""

import http.client
import json
import sys
import threading
import time

host, port = sys.argv[1].split(":")


def long_prompt(lines):
    animals = ["fox", "cat", "owl", "horse", "otter", "crow", "lynx", "mole"]
    colors = ["red", "blue", "green", "amber", "grey", "violet"]
    return "\n".join(
        f"Line {i}: the {animals[i % 8]} jumped over the {colors[i % 6]} fence near house {i * 7 % 101}."
        for i in range(lines)
    )


def stream(content, max_tokens=4):
    body = json.dumps(
        {"messages": [{"role": "user", "content": content}], "stream": True,
         "max_tokens": max_tokens, "temperature": 0}
    )
    c = http.client.HTTPConnection(host, int(port), timeout=900)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    seen = {"status": r.status, "head_s": round(time.perf_counter() - t0, 3)}
    buf = b""
    while "first_token_s" not in seen:
        piece = r.read1(65536)
        if not piece:
            break
        now = round(time.perf_counter() - t0, 3)
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b":"):
                seen.setdefault("first_keep_alive_s", now)
                seen["keep_alives"] = seen.get("keep_alives", 0) + 1
            elif event.startswith(b"data: {"):
                d = json.loads(event[6:])
                if d["choices"] and d["choices"][0]["delta"].get("content"):
                    seen["first_token_s"] = now
    c.close()
    return seen


own = stream(long_prompt(300))
print(json.dumps({"case": "a stream whose own prompt is ~6k tokens", **own}), flush=True)

other = {}
blocker = threading.Thread(target=lambda: other.update(stream(long_prompt(301), 1)))
blocker.start()
time.sleep(0.5)
behind = stream("Say hi.")
blocker.join()
print(json.dumps({"case": "a short stream sent 0.5 s after a ~6k-token request", **behind}), flush=True)
