"""What the traffic workloads of `specserve bench --load` share (multi_turn.py, long_prompt.py): documents to talk
about, a streamed request timed chunk by chunk, percentiles, and the Serve app started with settings of a run's arm.

Documents are specserve's own module docstrings, joined in a fixed order from a given module on: English prose that
ships with the package, so a bench needs no dataset and no network, and the same arguments give the same document.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@functools.cache
def _docstrings() -> tuple[str, ...]:
    """The longer module docstrings of specserve's cluster and workers packages (read, never imported)."""
    texts = []
    for package in ("specserve.cluster", "specserve.workers"):
        for root in importlib.util.find_spec(package).submodule_search_locations:
            for path in sorted(Path(root).rglob("*.py")):
                doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
                if doc and len(doc) > 400:
                    texts.append(" ".join(doc.split()))
    return tuple(texts)


def document(tokenizer, tokens: int, start: int = 0) -> str:
    """About `tokens` tokens of prose: module docstrings from the start-th on (wrapping around), the last one cut at
    a word."""
    texts = _docstrings()
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    parts, used = [], 0
    for i in range(len(texts) * 8):
        text = texts[(start + i) % len(texts)]
        n = count(text)
        if used + n > tokens:
            words, lo, hi = text.split(), 0, len(text.split())
            while lo < hi:  # the most words that fit: cutting a tenth at a time could fall 10% of a docstring short
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if used + count(" ".join(words[:mid])) <= tokens else (lo, mid - 1)
            parts.append(" ".join(words[:lo]))
            break
        parts.append(text)
        used += n
    return "\n\n".join(p for p in parts if p)


@dataclass
class Timed:
    """One streamed request: when its chunks arrived (seconds after it was sent) and what it said."""

    sent_at: float  # perf_counter when sent
    arrivals: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: int = 0

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] if self.arrivals else math.inf

    @property
    def latency_s(self) -> float:
        return self.arrivals[-1] if self.arrivals else math.inf

    def gaps(self) -> list[float]:
        """Seconds between consecutive chunks (a chunk: what a round committed), as vLLM's benchmark measures
        inter-token latency on a stream."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def timed_stream(client, prompt: list[int], new_tokens: int) -> Timed:
    """Send `prompt` (greedy, `new_tokens` at most) and time its chunks."""
    timed = Timed(time.perf_counter())
    for chunk in client.generate_stream(prompt, max_new_tokens=new_tokens, temperature=0.0):
        timed.arrivals.append(time.perf_counter() - timed.sent_at)
        timed.token_ids += chunk["token_ids"]
        timed.rounds, timed.accepted = chunk["stats"]["rounds"], chunk["stats"]["accepted"]
    return timed


@contextmanager
def served(target: str, draft: str | None, device: str, dtype: str, **model: object) -> Iterator:
    """The Serve app of `specserve bench --load` (concurrency.bench_app) with these fields of its model set (an arm's
    settings: prefill_chunk_tokens, target_pool.kv_cache ...); yields (client, its gRPC address); stopped on exit."""
    from specserve.client import SpecServeClient
    from specserve.cluster.bench.concurrency import bench_app
    from specserve.cluster.serve.server import start, stop

    config = bench_app(target, draft, device, dtype)
    _merge(config["applications"][0]["args"]["models"][0], model)
    info = start(config, ready_timeout_s=1800)
    try:
        with SpecServeClient(info["grpc"], timeout_s=1800) as client:
            yield client
    finally:
        stop(info)


def _merge(into: dict, fields: dict) -> None:
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
