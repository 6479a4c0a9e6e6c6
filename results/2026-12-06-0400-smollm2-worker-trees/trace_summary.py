"""Summarises the prune and round trace of an instrumented run (not landed): TreePruning._losing_rounds wrote one
line a judgement to DIR/<pid>.log (count, others, drafting rows, recent accepted and width, fixed_s, plain_s, tree
tokens and seconds, plain tokens and seconds, the verify belief by width) and Scheduler.apply_round one line a tree
request's round to DIR/apply-<pid>.log (planned nodes, kept, accepted path, batch rows, batch tokens, batch seconds,
queued seconds, round seconds, drafted, chain k). Usage: python trace_summary.py DIR"""

import ast
import collections
import glob
import statistics as st
import sys


def ms(values) -> int:
    return round(1e3 * st.median(values))


trace_dir = sys.argv[1]
rounds = [line.split() for f in glob.glob(trace_dir + "/apply-*.log") for line in open(f)]
prunes = [line.split(" ", 11) for f in glob.glob(trace_dir + "/[0-9]*.log") for line in open(f)]
print("rounds", len(rounds), "prunes", len(prunes))
passes = collections.defaultdict(list)  # (rows, positions) -> measured pass seconds
for r in rounds:
    if int(r[3]):
        passes[(int(r[3]), int(r[4]))].append(float(r[5]))
for rows in sorted({k[0] for k in passes}):
    points = sorted((t, st.median(v), len(v)) for (n, t), v in passes.items() if n == rows)
    print("measured rows", rows, "(positions, ms, passes)", [(t, round(1e3 * s), n) for t, s, n in points if n >= 3])
belief = {int(p[1]) + 1: ast.literal_eval(p[11].strip()) for p in prunes}
for rows, curve in sorted(belief.items()):
    print("belief rows", rows, "T(mean width 1..10) ms", [round(1e3 * c) for c in curve[:10]])
kinds = collections.Counter()
for r in rounds:
    nodes, kept, k = int(r[0]), int(r[1]), int(r[9])
    kinds["plain" if not nodes and not k else "lookup" if k else "head tree" if kept else "pruned-to-0"] += 1
print(kinds)
trees = [r for r in rounds if int(r[0]) and not int(r[9]) and int(r[1])]
plain = [r for r in rounds if not int(r[0]) and not int(r[9])]
lookups = [r for r in rounds if int(r[9])]
print("head trees: kept p50", st.median(int(r[1]) for r in trees), "accepted mean",
      round(st.mean(int(r[2]) for r in trees), 2), "round ms p50", ms(float(r[7]) for r in trees))  # fmt: skip
if plain:
    print("plain: round ms p50", ms(float(r[7]) for r in plain))
if lookups:
    print("lookups: k p50", st.median(int(r[9]) for r in lookups), "accepted mean",
          round(st.mean(int(r[2]) for r in lookups), 2), "round ms p50", ms(float(r[7]) for r in lookups))  # fmt: skip
by_kept = collections.defaultdict(list)
for r in trees:
    by_kept[int(r[1])].append(int(r[2]))
print("accepted by kept", {k: (round(st.mean(v), 2), len(v)) for k, v in sorted(by_kept.items())})
