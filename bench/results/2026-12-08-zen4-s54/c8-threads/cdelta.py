import json,sys,collections,re
a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2]))
g=collections.defaultdict(lambda:[0,0,0,0,0])
for t,v in b.items():
    v=v+[0]*(5-len(v)); c=v[0]; v0=a.get(t,[c,0,0,0,0]); v0=v0+[0]*(5-len(v0))
    k=re.sub(r'[0-9]+$','#',c)
    if k=='llama-server' : k = 'llama-main' if len(sys.argv)>3 and t==sys.argv[3] else 'llama-thr'
    for i in range(1,5): g[k][i-1]+=v[i]-v0[i]
    g[k][4]+=1
tot=sum(v[0]+v[1] for v in g.values())
print("cpu %.2f"%(tot/100), " ".join("%s:cpu%.2f vcs%d ncs%d (n%d)"%(k,(v[0]+v[1])/100,v[2],v[3],v[4]) for k,v in sorted(g.items(),key=lambda x:-(x[1][0]+x[1][1])) if v[0]+v[1]+v[2]+v[3]>0))
