"""The default against each fixed k, paired by round (cluster/bench/concurrency.py's judge_k), recomputed from the
segment throughputs of earlier runs' JSON (which predate judge_k). Usage: python paired_from_json.py FILE.json ..."""

import json
import math
import statistics
import sys

from specserve.cluster.bench.concurrency import ratio_ci95


def levels(doc):
    """The load bench's rows wherever the JSON keeps them (a script's {"levels"} or the bench's meta)."""
    if isinstance(doc, dict):
        if isinstance(doc.get("levels"), list) and doc["levels"] and "speculation" in doc["levels"][0]:
            return doc["levels"]
        doc = list(doc.values())
    if isinstance(doc, list):
        for value in doc:
            found = levels(value)
            if found:
                return found
    return None


for path in sys.argv[1:]:
    rows = levels(json.load(open(path)))
    for streams in sorted({r["streams"] for r in rows}):
        by = {r["speculation"]: r for r in rows if r["streams"] == streams}
        default = by["default"]["segment_tokens_per_s"]
        for mode, row in by.items():
            if not mode.startswith("k="):
                continue
            ratios = [d / k for d, k in zip(default, row["segment_tokens_per_s"], strict=False)]
            mean = math.exp(statistics.fmean(math.log(r) for r in ratios))
            lo, hi = ratio_ci95(ratios)
            by_ratios = by["default"]["vs_off"] / row["vs_off"]
            print(
                f"{path} | {streams} streams | default / {mode}: {mean:.2f} ({lo:.2f}-{hi:.2f}), {len(ratios)} rounds; "
                f"as a ratio of ratios to off: {by_ratios:.2f}"
            )
