import socket, sys, time, statistics
addr = ("127.0.0.1", int(sys.argv[1])); n = int(sys.argv[2])
lat = []; conn_lat = []
for _ in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection(addr, timeout=30)
    t1 = time.perf_counter()
    s.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    s.recv(4096)
    t2 = time.perf_counter()
    s.close()
    lat.append((t2 - t0) * 1000); conn_lat.append((t1 - t0) * 1000)
    time.sleep(0.05)
q = lambda v, p: sorted(v)[int(p * (len(v) - 1))]
print(f"answer ms p50 {q(lat,.5):.1f} p90 {q(lat,.9):.1f} p99 {q(lat,.99):.1f}; connect ms p50 {q(conn_lat,.5):.2f} p90 {q(conn_lat,.9):.2f}")
