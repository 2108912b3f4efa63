import sys, re, statistics
def parse(path):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) > 7 and f[0] in ("AR","AG","RS") and f[-1] == "ok":
            out[(f[1], f[2], f[5])] = float(f[6])
    return out
pairs = sys.argv[1:]
olds = [parse(p) for p in pairs if "old" in p.split("/")[-1]]
news = [parse(p) for p in pairs if "new" in p.split("/")[-1]]
keys = sorted(olds[0], key=lambda k: (k[2], k[0], k[1]))
ratios = []
for k in keys:
    o = statistics.median([d[k] for d in olds if k in d]); n = statistics.median([d[k] for d in news if k in d])
    r = n / o
    if k[2] != "nccl": ratios.append(r)
    print(f"{k[0]:>5} {k[1]:>5} {k[2]:12s} old {o:9.3f} new {n:9.3f} new/old {r:6.3f}")
print("sparse points:", len(ratios), "median new/old", round(statistics.median(ratios), 3), "geomean", round(statistics.geometric_mean(ratios), 3))
