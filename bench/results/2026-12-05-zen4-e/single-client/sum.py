import json,glob,sys,re,collections
d=sys.argv[1]
rows=collections.defaultdict(list)
for f in sorted(glob.glob(d+'/*-w*.json')):
    m=re.match(r'.*/(\w+)-r(\d+)-w(\d+)\.json',f)
    lab,r,w=m.groups()
    try: p=json.load(open(f))['result']['phases'][0]
    except Exception as e: continue
    rows[(int(w),lab)].append((p['tokens_per_s'],p['ttft']['p50_ms'],p['tpot']['p50_ms'],p.get('decode_tok_s_per_stream',{}).get('p50'),p['outcomes'].get('completed',0)))
for k in sorted(rows):
    v=rows[k]
    print(k, ' | '.join('tok/s %.1f ttft %.0f tpot %.2f done %d'%(a,b,c,e) for a,b,c,dd,e in v))
