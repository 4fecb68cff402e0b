import time,sys
out=open(sys.argv[1],'a')
while True:
    with open('/proc/stat') as f:
        lines=[l for l in f if l.startswith('cpu')]
    out.write('%.3f %s\n' % (time.time(), ' | '.join(' '.join(l.split()[1:9]) for l in lines)))
    out.flush()
    time.sleep(0.25)
