import json
S=[]
for l in open('/tmp/s50/steal.log'):
    t,rest=l.split(' ',1)
    cpus=[list(map(int,c.split())) for c in rest.split('|')]
    S.append((float(t),cpus))
def around(T):
    for (a,ca),(b,cb) in zip(S,S[1:]):
        if a-0.5<=T<=b+0.5:
            d=[[y-x for x,y in zip(p,q)] for p,q in zip(ca,cb)]
            print('   %.2f..%.2f  cpu0 usr,sys,idle,iow,irq,sirq,steal=%s cpu1=%s' % (a-T,b-T,[d[1][i] for i in (0,2,3,4,5,6,7)],[d[2][i] for i in (0,2,3,4,5,6,7)]))
for r,off in [(3,75.40),(3,83.48),(5,23.92),(4,78.19),(6,40.0)]:
    L=[json.loads(l) for l in open('/tmp/s50/hol/r%d/trace.jsonl'%r)]
    T=L[0]['end']+off
    if T<S[0][0]: print('r%d before sampler'%r); continue
    print('r%d +%.2f'%(r,off)); around(T)
