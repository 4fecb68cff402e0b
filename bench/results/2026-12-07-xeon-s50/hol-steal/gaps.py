import json,sys
for f in sys.argv[1:]:
    L=[json.loads(l) for l in open(f)]
    dec=[i for i,x in enumerate(L) if x['n_decode']==2 and x['seqs']==2]
    print(f, len(L), 'decode passes', len(dec))
    for a,b in zip(dec,dec[1:]):
        g=(L[b]['end']-L[a]['end'])*1e3
        if g>165:
            print(' gap %.1f ms at +%.2fs' % (g, L[b]['end']-L[0]['end']))
            for i in range(a-1,b+2):
                x=L[i]; prev=L[i-1]['end']
                print('   end+%.4f dt=%.1f pass=%.1f samp=%.2f seqs=%d tok=%d' % (x['end']-L[0]['end'], (x['end']-prev)*1e3, x['pass_ms'], x['sample_ms'], x['seqs'], x['tokens']))
