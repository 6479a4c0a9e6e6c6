import sys, collections, statistics
marks = [l.split() for l in open('/tmp/batchtrace/marks')]
t0 = float(marks[0][1]); t1 = float(marks[1][1]) if len(marks) > 1 else 1e18
import glob
for f in sorted(glob.glob('/tmp/batchtrace/*.log')):
    rows = []
    for l in open(f):
        p = l.split(); s, e, n, cost = float(p[0]), float(p[1]), int(p[2]), int(p[3])
        if t0 <= s <= t1: rows.append((s, e, n, cost, [float(x) for x in p[4:4 + n]], int(p[-1])))
    if not rows: continue
    busy = sum(e - s for s, e, *_ in rows); span = rows[-1][1] - rows[0][0]
    sizes = collections.Counter(n for _, _, n, *_ in rows)
    print(f.split('/')[-1], 'batches', len(rows), 'sizes', sorted(sizes.items()), 'busy %.2f of %.2f s' % (busy, span))
    print('  run ms p50 by size', {k: round(1e3 * statistics.median([e - s for s, e, n, *_ in rows if n == k]), 1) for k in sorted(sizes)})
    print('  cost p50 by size', {k: statistics.median([c for s, e, n, c, *_ in rows if n == k]) for k in sorted(sizes)})
    waits = [w for *_, ws, q in rows for w in ws]
    print('  queued ms p50/p90', round(1e3 * statistics.median(waits), 1), round(1e3 * sorted(waits)[int(.9 * len(waits))], 1))
    gaps = [rows[i + 1][0] - rows[i][1] for i in range(len(rows) - 1)]
    print('  idle between batches ms p50/p90', round(1e3 * statistics.median(gaps), 1), round(1e3 * sorted(gaps)[int(.9 * len(gaps))], 1), 'left queued p50', statistics.median(q for *_, q in rows))
