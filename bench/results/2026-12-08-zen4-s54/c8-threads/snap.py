import os,sys,json
pid=sys.argv[1]; out={}
for t in os.listdir(f"/proc/{pid}/task"):
    try:
        comm=open(f"/proc/{pid}/task/{t}/comm").read().strip()
        f=open(f"/proc/{pid}/task/{t}/stat").read().rsplit(')',1)[1].split()
        st={l.split(':')[0]:l.split(':')[1].strip() for l in open(f"/proc/{pid}/task/{t}/status")}
        out[t]=[comm,int(f[11]),int(f[12]),int(st['voluntary_ctxt_switches']),int(st['nonvoluntary_ctxt_switches'])]
    except Exception: pass
json.dump(out,open(sys.argv[2],'w'))
