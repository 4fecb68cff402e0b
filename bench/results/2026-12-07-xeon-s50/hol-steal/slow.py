import json,sys
for f in sys.argv[1:]:
    L=[json.loads(l) for l in open(f)]
    t0=L[0]['end']
    dec=[x for x in L if x['seqs']==2]
    ds=sorted(x['pass_ms'] for x in dec)
    print(f, 'decode passes', len(dec), 'p50 %.1f p99 %.1f max %.1f' % (ds[len(ds)//2], ds[int(len(ds)*.99)], ds[-1]))
    for x in dec:
        if x['pass_ms']>40: print('  slow decode pass %.1f ms at +%.2f s (start %.3f frac)' % (x['pass_ms'], x['end']-t0, (x['end']-x['pass_ms']/1e3)%1))
    pre=[(i,x) for i,x in enumerate(L) if x['seqs']==1 and x['n_decode']==2]
    for i,x in pre:
        # compare with neighbours
        nb=[L[j]['pass_ms'] for j in range(max(0,i-6),min(len(L),i+7)) if L[j]['seqs']==1 and j!=i]
        if nb and x['pass_ms']>1.4*sorted(nb)[len(nb)//2]:
            print('  slow prefill pass %.1f ms (neighbours %.1f) at +%.2f s' % (x['pass_ms'], sorted(nb)[len(nb)//2], x['end']-t0))
