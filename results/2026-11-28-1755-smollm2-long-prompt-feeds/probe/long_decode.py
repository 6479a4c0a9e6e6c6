"""Does the head draft better on a long prompt when it reads all of it? One served app with the defaults
(`eagle-tree+ngram`, chunks of 256); three ~2.5K-token documents, each asked for a summary, 96 new tokens greedy,
one at a time after a warm-up. Prints and writes each request's TTFT, decode seconds, rounds and tokens a round.

    python long_decode.py PROMPTS.json OUT.json   # PROMPTS.json written on the first run, read on later ones (the
                                                  # documents are this code's docstrings: the runs must share them)
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from specserve.cluster.bench.traffic import document, served, timed_stream
from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids

target = resolve_model("smollm2-135m-instruct", progress=False)
tok = AutoTokenizer.from_pretrained(target, local_files_only=True)


def prompt(start: int) -> list[int]:
    doc = document(tok, 2500, start=start)
    return chat_prompt_ids(tok, [ChatMessage("user", f"{doc}\n\nSummarize the text above, quoting its key sentences.")])


saved = Path(sys.argv[1])
if not saved.exists():
    saved.write_text(json.dumps([prompt(start) for start in (3, 5, 11, 23, 37)]))
warm_short, warm_long, *prompts = json.loads(saved.read_text())
rows = []
with served(target, None, "cpu", "float32") as client:
    timed_stream(client, warm_short[:200], 8)  # the workers' cost measurement
    timed_stream(client, warm_long, 8)  # unmeasured: the buffers' growth
    for ids in prompts:
        t = timed_stream(client, ids, 96)
        rows.append(
            {
                "prompt_tokens": len(ids),
                "ttft_s": t.ttft_s,
                "decode_s": t.latency_s - t.ttft_s,
                "tokens": len(t.token_ids),
                "rounds": t.rounds,
                "accepted": t.accepted,
                "tokens_per_round": len(t.token_ids) / max(1, t.rounds),
                "token_ids": t.token_ids,
            }
        )
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items() if k != "token_ids"})
json.dump(rows, open(sys.argv[2], "w"), indent=1)
