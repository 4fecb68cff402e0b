import sys,re,glob
def chunks(path):
    fc=None; out=[]
    for l in open(path):
        if not l.startswith('TRACE'): continue
        m=re.search(r'ahead remaining (\d+) chunk (\d+) forecast ([\d.]+) ms first (\w+) stretch ([\d.]+) needed ([\d.]+) ms short 0',l)
        if m: fc=(float(m.group(3)),m.group(4)=='true',float(m.group(5))); continue
        m=re.search(r'pass entries 1 tokens (\d+) prefill (\d+) decode ([\d.]+) ms',l)
        if m and fc and int(m.group(2))>0:
            out.append((float(m.group(3))/fc[0],fc[1],fc[0],fc[2])); fc=None
    return out
runs=[chunks(p) for p in sys.argv[1:]]
def sim(C, decay=0.2, window=0):
    worst=[]
    for ch in runs:
        s={True:1.5,False:1.5}; hist=[]; w=0
        for ratio,first,f,st in ch:
            stretch=s[first]
            if window and not first and hist: stretch=max(stretch,max(hist[-window:]))
            excess=(ratio - C*stretch)*f
            w=max(w,150+max(0,excess))
            nxt = ratio if ratio>s[first] else s[first]+decay*(ratio-s[first])
            s[first]=min(3,max(1,nxt))
            if not first: hist.append(ratio)
        worst.append(round(w))
    return worst
print('logged stretch check', [ [round(x[3],2) for x in ch[:3]] for ch in runs][:2])
for C in (1.1,1.2,1.3,1.4):
    print('C',C,'max gap ms per run',sim(C))
for win in (8,16,32):
    print('C 1.1 window',win,sim(1.1,window=win))
