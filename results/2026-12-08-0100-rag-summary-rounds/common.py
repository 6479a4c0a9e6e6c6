"""What prefill.py, trace.py and ab.py share: the engine (SmolLM2-135M-Instruct and its head, CPU, fp32), one Spec-Bench
category's first 10 questions, and a cold greedy run of target-only ("off") or the default."""

import time

from specserve.cluster.bench.spec_bench import read_spec_bench, select_per_category
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids
from specserve.workers.models.packaged_heads import resolve_head
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine

path = resolve_model("smollm2-135m-instruct", progress=False)
target = load_model(ModelConfig(path=path, device="cpu", dtype="float32"))
engine = SpecEngine(target, eagle_head=resolve_head("eagle", path))


def questions(spec_bench: str, category: str):
    return [q for q in select_per_category(read_spec_bench(spec_bench), 10) if q.category == category]


def prompt_ids(text: str) -> list[int]:
    return chat_prompt_ids(target.tokenizer, [ChatMessage(role="user", content=text)])


def run(arm: str, prompt, n: int = 128):
    """(seconds, GenerationResult) of one cold greedy generation: arm "off" is target-only, any other the default."""
    engine.forget_prefixes()
    spec = SpecParams(method="none") if arm == "off" else SpecParams(method="eagle-tree+ngram", k="auto")
    t = time.perf_counter()
    r = engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0), spec)
    return time.perf_counter() - t, r


def warm_up() -> None:
    hello = prompt_ids("Hello, how are you?")
    run("off", hello, 8)
    run("default", hello, 8)
