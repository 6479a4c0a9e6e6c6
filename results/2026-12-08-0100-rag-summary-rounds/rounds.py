"""Reads trace.py's trace-CATEGORY.json files: per kind of round (a question's first two apart: its prefill and the
head's catch-up over the prompt) its count, accepted tokens, milliseconds and committed tokens a second, and what
prompt lookup's continuation (up to 8 tokens, the most recent match of the longest suffix n-gram, n 1-4) would have
accepted there; then, in the lookup rounds, what prompt lookup's trie (`ngram_tree`, every recent match) would have
accepted at B nodes and depth D (k: the round's chain length)."""

import collections
import json
import sys

from specserve.workers.speculation.ngram import ngram_match, ngram_tree


def chain_accepted(follow, truth):
    n = 0
    for x, y in zip(follow, truth, strict=False):
        if x != y:
            break
        n += 1
    return n


def tree_accepted(tree, truth):
    if tree is None:
        return 0
    best, depth = 0, {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        d = 0 if parent < 0 else depth.get(parent, -10) + 1
        ok = (parent < 0 or depth.get(parent, -10) >= 0) and d < len(truth) and truth[d] == token
        depth[i] = d if ok else -10
        best = max(best, d + 1) if ok else best
    return best


for path in sys.argv[1:]:
    questions = json.load(open(path))
    kinds = collections.defaultdict(lambda: [0, 0, 0.0, 0])
    trie = collections.Counter()
    for q in questions:
        full = q["full"]
        for i, t in enumerate(q["trace"]):
            tokens, truth = full[: t["pos"]], full[t["pos"] : t["pos"] + 12]
            lookup = chain_accepted(ngram_match(tokens, 8, 4, 1)[1], truth)
            kind = t["kind"] if i > 1 else ("prefill", "head catch-up")[i]
            if kind == "head":
                kind += " (a lookup offered)" if ngram_match(tokens, 8, 4, 1)[1] else " (no lookup)"
            k = kinds[kind]
            k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + t["acc"], k[2] + t["s"], k[3] + lookup
            if t["kind"] != "lookup" or i < 2:
                continue
            trie["rounds"] += 1
            trie["as verified"] += t["acc"]
            for name, nodes in (("k", t["k"]), ("k+1", t["k"] + 1), ("k+3", t["k"] + 3), ("8", 8), ("16", 16)):
                for dname, depth in (("k", t["k"]), ("8", 8)):
                    trie[f"B {name}, D {dname}"] += tree_accepted(ngram_tree(tokens, nodes, depth, 4, 1), truth)
    print(path, f"off {sum(q['off'] for q in questions):.1f} s, default {sum(q['d'] for q in questions):.1f} s,",
          f"{sum(q['n'] for q in questions)} tokens")  # fmt: skip
    for kind, (n, acc, s, lookup) in kinds.items():
        print(f"  {kind:26s} rounds {n:4d}  accepted/round {acc / n:.2f}  ms/round {1e3 * s / n:7.1f}  "
              f"tokens/s {(n + acc) / s:5.1f}  lookup's 8 would accept/round {lookup / n:.2f}")  # fmt: skip
    n = trie.pop("rounds")
    print("  lookup rounds, accepted a round:", ", ".join(f"{k} {v / n:.2f}" for k, v in trie.items()))
