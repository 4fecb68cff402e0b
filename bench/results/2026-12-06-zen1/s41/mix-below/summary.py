import json,sys,os,statistics as st
d=sys.argv[1]
def load(cfg,seed):
    p=json.load(open(f'{d}/{cfg}-s{seed}.json'))['result']['phases'][0]
    return p
out=[]
for cfg in ('short','noshort'):
    rows={'goodput':[],'tpot p50':[],'tpot p99':[],'ttft p50':[],'ttft p99':[]}
    for seed in (31,32,33):
        a=load(cfg,seed); b=load('llama',seed)
        rows['goodput'].append(a['goodput_rps']/b['goodput_rps'])
        rows['tpot p50'].append(a['tpot']['p50_ms']/b['tpot']['p50_ms'])
        rows['tpot p99'].append(a['tpot']['p99_ms']/b['tpot']['p99_ms'])
        rows['ttft p50'].append(a['ttft']['p50_ms']/b['ttft']['p50_ms'])
        rows['ttft p99'].append(a['ttft']['p99_ms']/b['ttft']['p99_ms'])
    out.append(f'{cfg} / llama-server, medians of 3 (by seed 31/32/33):')
    for k,v in rows.items():
        out.append(f'  {k}: {st.median(v):.3f} ({" / ".join(f"{x:.3f}" for x in v)})')
print('\n'.join(out))
