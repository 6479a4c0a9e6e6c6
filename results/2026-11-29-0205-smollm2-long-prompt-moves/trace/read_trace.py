"""Read what trace.patch wrote to /tmp/trace during one long-prompt bench run (bench.json: every chat request's and
long prompt's chunk times; batch-PID.jsonl: every batch of each worker, [start, end, thread CPU s, [[request, cost,
prefill, waited s], ...]]).

    python read_trace.py gaps     # the worst chat gaps while long prompts ran, and the target passes under each
    python read_trace.py chunks   # every chunk: start s, its positions / its pass ms + the other positions in it
"""

import glob
import json
import sys

TRACE = "/tmp/trace"


def load():
    bench = json.load(open(f"{TRACE}/bench.json"))
    workers = {f: [json.loads(line) for line in open(f)] for f in glob.glob(f"{TRACE}/batch-*.jsonl")}
    # the target worker: the one whose batches hold decoding (not prefill) rows with several positions
    target = max(workers, key=lambda f: sum(1 for b in workers[f] for job in b[3] if not job[2]))
    return bench, workers[target], min(sent for sent, _ in bench["longs"])


def gaps(bench, passes, start, worst=12):
    out = []
    for _, sent, arrivals in bench["chat"]:
        if sent >= start:
            out += [(b - a, sent + a - start, sent + b - start) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    out.sort(reverse=True)
    print(f"{len(out)} gaps; the worst (ms):", [round(1e3 * g[0]) for g in out[:worst]])
    for gap, a, b in out[:worst]:
        print(f"gap {1e3 * gap:.0f} ms from {a:.2f} to {b:.2f} s")
        for s, e, _cpu, jobs in passes:
            if e - start > a - 0.05 and s - start < b:
                rows = [(key[-4:], cost, "P" if p else "", round(1e3 * w)) for key, cost, p, w in jobs]
                print(f"   pass at {s - start:6.2f} s, {1e3 * (e - s):4.0f} ms:", rows)


def chunks(passes, start):
    out = []
    for s, e, _cpu, jobs in passes:
        chunk = [cost for _, cost, prefill, _ in jobs if prefill and cost > 20]
        if s >= start and chunk:
            rest = sum(cost for _, cost, _, _ in jobs) - chunk[0]
            out.append(f"{s - start:.1f}:{chunk[0]}/{round(1e3 * (e - s))}+{rest}")
    print(" ".join(out))


if __name__ == "__main__":
    bench, passes, start = load()
    if sys.argv[1:] == ["gaps"]:
        gaps(bench, passes, start)
    else:
        chunks(passes, start)
