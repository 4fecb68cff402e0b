import sys,re
def load(f):
    d={}
    for l in open(f):
        if l.startswith('#'): continue
        m=re.match(r'(\S+)\s+(\S+)$',l.strip())
        if m:
            try: d[m.group(1)]=float(m.group(2))
            except: pass
    return d
a=load(sys.argv[1]); b=load(sys.argv[2])
for k in sorted(b):
    if any(x in k for x in ['steps_','step_seconds_sum','step_seconds_count','step_tokens','prefill_tokens_total','prompt_tokens_total','reused','tokens_generated','attention','whole','mixed','kv_pages']):
        dv=b[k]-a.get(k,0)
        if dv: print('%-60s %g'%(k,dv))
