# Samples, every 20 ms, the sluice process's threads' involuntary context
# switches, faults, and the box's /proc/stat cpu lines; writes JSON lines.
import sys, time, os, json
pid = int(sys.argv[1]); out = open(sys.argv[2], 'w'); t0 = float(sys.argv[3])
def snap():
    th = {}
    for tid in os.listdir(f'/proc/{pid}/task'):
        try:
            st = open(f'/proc/{pid}/task/{tid}/stat').read()
            name = st[st.index('(')+1:st.rindex(')')]
            f = st[st.rindex(')')+2:].split()
            s = open(f'/proc/{pid}/task/{tid}/status').read()
            nv = int(s.split('nonvoluntary_ctxt_switches:')[1].split()[0])
            th[tid] = [name, int(f[7]), int(f[9]), int(f[11]) + int(f[12]), nv, int(f[36])]
        except Exception:
            pass
    cpu = [l.split()[:8] for l in open('/proc/stat') if l.startswith('cpu')]
    return th, cpu
while True:
    try:
        th, cpu = snap()
    except Exception:
        break
    out.write(json.dumps([time.time() - t0, th, cpu]) + '\n')
    time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0.02)
