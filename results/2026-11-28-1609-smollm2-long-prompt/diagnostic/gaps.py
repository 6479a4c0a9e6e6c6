"""Where the chat streams' long gaps go while a long prompt prefills: the time of every chat chunk, the long prompt's
send / first token / end, and the scheduler's chunk pacing (`status()["prefill_chunks"]`) every 0.5 s. One app with
the app's defaults (chunks of 256, its EAGLE-3 head); the chat questions are the training half, not the bench's.

    python gaps.py OUT_DIR   # writes OUT_DIR/gaps.json and OUT_DIR/polls.json
"""

import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

from specserve.cluster.bench.long_prompt import LongPromptConfig, _long_prompts
from specserve.cluster.bench.serve import model_status
from specserve.cluster.bench.traffic import served, timed_stream
from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.chat_questions import TRAIN_QUESTIONS, question_prompt_ids

out_dir = Path(sys.argv[1])
target = resolve_model("smollm2-135m-instruct", progress=False)
tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
prompts = [question_prompt_ids(tok, q) for q in TRAIN_QUESTIONS[:8]]
make_long = _long_prompts(tok, LongPromptConfig())
T0 = time.perf_counter()
chats, longs, polls = [], [], []
stop = threading.Event()


def chat_loop(first: int) -> None:
    i = first
    while not stop.is_set():
        t = timed_stream(client, prompts[i % len(prompts)], 32)
        i += 4
        chats.append((t.sent_at - T0, t.arrivals))


def poll() -> None:
    while not stop.is_set():
        polls.append((time.perf_counter() - T0, model_status().get("prefill_chunks")))
        time.sleep(0.5)


with served(target, None, "cpu", "float32") as client:
    timed_stream(client, prompts[0], 8)  # the workers' cost measurement
    timed_stream(client, make_long(), 16)  # unmeasured, as the bench's
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(chat_loop, s) for s in range(4)]
        time.sleep(8)  # the streams alone: their rounds measured
        threading.Thread(target=poll, daemon=True).start()
        long = timed_stream(client, make_long(), 16)
        longs.append((long.sent_at - T0, long.arrivals))
        time.sleep(3)
        stop.set()
        for f in streams:
            f.result()

gaps = sorted((sent + a, b - a) for sent, arr in chats for a, b in zip(arr, arr[1:], strict=False))
(out_dir / "polls.json").write_text(json.dumps(polls))
(out_dir / "gaps.json").write_text(json.dumps({"longs": [(s, s + a[0], s + a[-1]) for s, a in longs], "gaps": gaps}))
print("long prompt (sent, first token, end):", [tuple(round(x, 1) for x in (s, s + a[0], s + a[-1])) for s, a in longs])
print("gaps over 1 s (start, seconds):", [(round(t, 1), round(g, 2)) for t, g in gaps if g > 1.0])
print("gaps", len(gaps), "p50", statistics.median(g for _, g in gaps))
