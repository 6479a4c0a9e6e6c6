"""Writes own.jsonl: 24 long-input questions of our own (never Spec-Bench's), 12 summaries and 12 document questions
over 500-1,000-token openings of Python's pydoc topics and the long descriptions of the installed packages' METADATA,
in Spec-Bench's question.jsonl form. The texts depend on the packages installed (pip install -e '.[dev]')."""

import glob
import json
import pydoc_data.topics as T
import random

from transformers import AutoTokenizer

from specserve.workers.models.catalog import resolve_model

tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct", progress=False))
texts = []
keys = sorted(T.topics)
random.Random(7).shuffle(keys)
for k in keys:
    if len(tok(T.topics[k])["input_ids"]) > 600:
        texts.append(T.topics[k])
for f in sorted(glob.glob("/usr/local/lib/python3*/site-packages/*.dist-info/METADATA")) + sorted(
    glob.glob("/usr/lib/python3*/site-packages/*.dist-info/METADATA")
):
    body = open(f, errors="ignore").read().split("\n\n", 1)[-1]
    if len(tok(body)["input_ids"]) > 700 and body.count("```") < 2:
        texts.append(body)
random.Random(1).shuffle(texts)
asks = [
    "What is the main idea of the passage?",
    "Which feature does the passage describe first?",
    "What does the text say about errors?",
    "Who is this meant for, according to the passage?",
    "What is one example given in the passage?",
    "How is this used, according to the text?",
]
out = []
for i, t in enumerate(texts[:24]):
    p = tok.decode(tok(t)["input_ids"][: random.Random(i).randint(500, 1000)])
    if i % 2 == 0:
        turn, category = f"Summarize the following text in a few sentences.\n\n{p}", "summarization"
    else:
        turn, category = (
            f"Answer the question using the document below.\n\nDocument: {p}\n\nQuestion: {asks[i % 6]}",
            "rag",
        )
    out.append({"question_id": 9000 + i, "category": category, "turns": [turn]})
with open("own.jsonl", "w") as f:
    for o in out:
        f.write(json.dumps(o) + "\n")
