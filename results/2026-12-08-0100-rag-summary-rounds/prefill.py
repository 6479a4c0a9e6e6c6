"""The prefill's share (README section 1): per question of one Spec-Bench category (first 10, first turns), in
process and cold, target-only and the default each at 1, 2 and 128 new tokens: `python prefill.py question.jsonl rag`
prints per question [prompt tokens, off 1 / 2 / 128 s, tokens, rounds, default 1 / 2 / 128 s, tokens, rounds] and
the totals."""

import sys

from common import prompt_ids, questions, run, warm_up

warm_up()
totals = {}
for q in questions(sys.argv[1], sys.argv[2]):
    prompt = prompt_ids(q.turns[0])
    row = [len(prompt)]
    for arm in ("off", "default"):
        for n in (1, 2, 128):
            s, r = run(arm, prompt, n)
            row.append(round(s, 3))
            totals[(arm, n)] = totals.get((arm, n), 0) + s
        row += [len(r.token_ids), r.stats.rounds]
    print(q.question_id, row, flush=True)
print({k: round(v, 2) for k, v in totals.items()})
