"""Reads the batch trace of four_streams_batches.py (lines written by an instrumented Batcher._run_one, one file a
worker process: start, end, rows, positions, each row's seconds queued, calls left queued) after the run's mark."""

import collections
import glob
import statistics


def p50_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return round(1e3 * statistics.median(ordered), 1), round(1e3 * ordered[int(0.9 * len(ordered))], 1)


marks = [line.split() for line in open("/tmp/batchtrace/marks")]
t0 = float(marks[0][1])
t1 = float(marks[1][1]) if len(marks) > 1 else float("inf")
for path in sorted(glob.glob("/tmp/batchtrace/*.log")):
    rows = []
    for line in open(path):
        p = line.split()
        start, end, n, cost = float(p[0]), float(p[1]), int(p[2]), int(p[3])
        if t0 <= start <= t1:
            rows.append((start, end, n, cost, [float(x) for x in p[4 : 4 + n]], int(p[-1])))
    if not rows:
        continue
    busy = sum(e - s for s, e, *_ in rows)
    span = rows[-1][1] - rows[0][0]
    sizes = collections.Counter(n for _, _, n, *_ in rows)
    print(path.split("/")[-1], "batches", len(rows), "sizes", sorted(sizes.items()), f"busy {busy:.2f} of {span:.2f} s")
    run_ms = {k: round(1e3 * statistics.median([e - s for s, e, n, *_ in rows if n == k]), 1) for k in sorted(sizes)}
    print("  run ms p50 by size", run_ms)
    print("  cost p50 by size", {k: statistics.median([c for _, _, n, c, *_ in rows if n == k]) for k in sorted(sizes)})
    print("  queued ms p50/p90", *p50_p90([w for *_, waits, _ in rows for w in waits]))
    gaps = [rows[i + 1][0] - rows[i][1] for i in range(len(rows) - 1)]
    left = statistics.median(r[-1] for r in rows)
    print("  idle between batches ms p50/p90", *p50_p90(gaps), "left queued p50", left)
