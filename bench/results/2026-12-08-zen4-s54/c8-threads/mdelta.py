import sys
def load(f):
    d={}
    for l in open(f):
        if l.startswith('#'): continue
        p=l.rsplit(' ',1)
        if len(p)==2:
            try: d[p[0]]=float(p[1])
            except: pass
    return d
a,b=load(sys.argv[1]),load(sys.argv[2])
keys=['sluice_passes_total','sluice_passes_split_total','sluice_steps_total','sluice_step_seconds_sum','sluice_step_tokens_total','sluice_steps_mixed_total','sluice_short_context_requests_total','sluice_graphs_reused_total','sluice_tokens_generated_total','sluice_prefill_tokens_total','sluice_steps_ahead_chunk_total']
d={k:b.get(k,0)-a.get(k,0) for k in keys}
st=d['sluice_steps_total'] or 1
print(' '.join(f"{k.replace('sluice_','').replace('_total','')}={d[k]:.0f}" for k in keys if k!='sluice_step_seconds_sum'), f"ms/step={1000*d['sluice_step_seconds_sum']/st:.2f}", f"tok/step={d['sluice_step_tokens_total']/st:.2f}")
for name in ['sluice_inter_token_seconds_bucket{class="interactive"', 'sluice_step_seconds_bucket{']:
    ks=[k for k in b if k.startswith(name)]
    prev=0; parts=[]
    for k in ks:
        v=b[k]-a.get(k,0)
        le=k.split('le="')[1].split('"')[0]
        if v-prev>0: parts.append(f"<={le}:{v-prev:.0f}")
        prev=v
    print('  ', name.split('_bucket')[0].replace('sluice_',''), ' '.join(parts))
