# ruff: noqa: E402, F821
# One question's rounds, arm by arm: runs ab.py's set-up (its engine, questions, params) by exec, hence the noqa.
import os
import sys

exec(open("/tmp/exp/ab.py").read().split("res = {}")[0])
from specserve.workers.speculation import round_drafting as RD

orig = RD.TreeRounds.observe
log = []


def obs(self, plan, tree, accepted):
    log.append((("L" if plan.chain.k else "H" if plan.nodes else "P"), len(tree.tokens) if tree else 0, accepted))
    return orig(self, plan, tree, accepted)


RD.TreeRounds.observe = obs
q = qs[int(sys.argv[3])]
prompt = chat_prompt_ids(tok, [ChatMessage(role="user", content=q["turns"][0])])
for arm in ("base", "graft", "graft2"):
    engine.forget_prefixes()
    log.clear()
    os.environ.pop("SPEC_GRAFT", None)
    if arm.startswith("graft"):
        os.environ["SPEC_GRAFT"] = arm[5:] or "1"
    r = engine.generate(prompt, params, SpecParams(method="eagle-tree+ngram", k="auto"))
    print(arm, len(r.token_ids), r.stats.rounds, log)
