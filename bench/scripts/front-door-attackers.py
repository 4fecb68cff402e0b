#!/usr/bin/env python3
"""Hostile clients against an HTTP server on loopback, until killed (issue 15).

Usage: front-door-attackers.py HOST:PORT [--tricklers N]

Runs at once, each in its own threads, each reconnecting when the server
closes it:
  - pipeliner: one connection, `GET /<8,000 bytes>` pipelined 200 at a time
    (as fast as the connection takes them), a 4 KiB receive buffer, never reads;
  - tricklers: N connections that send one header byte each second;
  - big bodies: a 16 MiB body in one write, then read the answer (one a second);
  - bad framing: duplicate Content-Length, TE gzip, TE + CL, bare LF (in a loop).
Every second it prints one line: connections open, reconnects, answers seen.
"""

import socket
import sys
import threading
import time

addr = sys.argv[1]
host, port = addr.rsplit(":", 1)
port = int(port)
tricklers = 3000
if "--tricklers" in sys.argv:
    tricklers = int(sys.argv[sys.argv.index("--tricklers") + 1])

counts = {"open": 0, "reconnects": 0, "answers": 0, "refused": 0}
lock = threading.Lock()


def bump(key, n=1):
    with lock:
        counts[key] += n


def connect(rcvbuf=None):
    while True:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        try:
            s.connect((host, port))
            return s
        except OSError:
            bump("refused")
            s.close()
            time.sleep(0.5)


def pipeliner():
    one = ("GET /" + "a" * 8000 + f" HTTP/1.1\r\nHost: {addr}\r\n\r\n").encode()
    while True:
        s = connect(rcvbuf=4096)
        bump("open")
        try:
            # 200 at once, then more whenever there is room; never read. The
            # send blocks once the buffers are full, until the server closes.
            s.settimeout(600)
            while True:
                s.sendall(one * 200)
        except OSError:
            pass
        finally:
            bump("open", -1)
            bump("reconnects")
            s.close()


def trickler_group(n):
    head = f"GET /livez HTTP/1.1\r\nHost: {addr}\r\nX-Slow: ".encode()
    conns = []
    for _ in range(n):
        s = connect()
        s.setblocking(False)
        conns.append([s, 0])
        bump("open")
    while True:
        for c in conns:
            s, i = c
            try:
                s.send(head[i : i + 1] if i < len(head) else b"x")
                c[1] = i + 1
                try:
                    data = s.recv(4096)
                    if data == b"":
                        raise OSError("closed")
                    bump("answers")
                    raise OSError("answered")
                except BlockingIOError:
                    pass
            except OSError:
                s.close()
                bump("reconnects")
                s = connect()
                s.setblocking(False)
                c[0], c[1] = s, 0
        time.sleep(1.0)


def big_bodies():
    size = 16 << 20
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()
    body = b"x" * size
    while True:
        s = connect()
        bump("open")
        try:
            s.settimeout(60)
            s.sendall(head + body)
            if s.recv(4096):
                bump("answers")
        except OSError:
            pass
        finally:
            bump("open", -1)
            bump("reconnects")
            s.close()
        # One client sending a large body, not a flood of them: a flood is a
        # bandwidth attack any server must read (or reset) at line rate.
        time.sleep(1.0)


def bad_framing():
    post = f"POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n"
    cases = [
        post + "Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        post + "Transfer-Encoding: gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        post + "Transfer-Encoding: chunked\r\nContent-Length: 7\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        f"GET /health HTTP/1.1\nHost: {addr}\n\n",
    ]
    while True:
        for case in cases:
            s = connect()
            try:
                s.settimeout(10)
                s.sendall(case.encode())
                if s.recv(4096):
                    bump("answers")
            except OSError:
                pass
            finally:
                s.close()
            time.sleep(0.05)


threads = [threading.Thread(target=pipeliner, daemon=True)]
group = 250
for start in range(0, tricklers, group):
    threads.append(
        threading.Thread(target=trickler_group, args=(min(group, tricklers - start),), daemon=True)
    )
threads.append(threading.Thread(target=big_bodies, daemon=True))
threads.append(threading.Thread(target=bad_framing, daemon=True))
for t in threads:
    t.start()
t0 = time.time()
while True:
    time.sleep(1.0)
    with lock:
        print(f"{time.time() - t0:.0f}s {counts}", flush=True)
