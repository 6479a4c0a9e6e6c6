"""The long-prompt workload of `specserve bench --load long-prompt`: chat streams while long prompts arrive, with
chunked prefill on (the default chunk) and off.

Per arm (a Serve app with that `prefill_chunk_tokens`): the long prompt alone (its TTFT alone); the chat streams alone
for a window (their inter-token latency alone: gaps between streamed chunks, as vLLM's benchmark measures it on a
stream); then the same streams while a long prompt arrives every `interval_s`, `arrivals` times (their inter-token
latency beside it, and each long prompt's TTFT). Every long prompt is a different document (traffic.document) that
shares only the chat template's opening with the others, so no prefix cache serves it.

`interval_s` is `every_s` (10 s), or 1.5x the long prompt's TTFT alone where that is longer: a machine that prefills
a long prompt more slowly than one arrives could never keep up (its queue would grow without end), whatever the
scheduler did; the JSON says which interval ran.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from specserve.cluster.bench.burst import percentiles
from specserve.cluster.bench.traffic import Timed, document, served, timed_stream
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids

DEFAULT_CHUNK = "default"  # the app's own setting
CHUNK = 256  # vLLM's max_num_batched_tokens for a small model


@dataclass(frozen=True)
class LongPromptConfig:
    streams: int = 4  # chat streams, closed loops
    chat_tokens: int = 32  # max_tokens of a chat request
    long_tokens: int = 4096  # a long prompt's document
    long_new_tokens: int = 16
    every_s: float = 10.0
    arrivals: int = 3  # long prompts per mixed window
    chunks: tuple[int | str | None, ...] = (CHUNK, None)  # the arms: chunks of 256, and one call


QUICK_LONG_PROMPT = LongPromptConfig(arrivals=2, chunks=(CHUNK,))


class _Chat:
    """Closed-loop chat streams over the chat prompts until stopped; every request's timing kept."""

    def __init__(self, client, prompts: list[list[int]], cfg: LongPromptConfig):
        self.client, self.prompts, self.cfg = client, prompts, cfg
        self.done: list[tuple[int, Timed]] = []  # (prompt index, its request)
        self._stop = threading.Event()
        self._next = 0
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next, self._next + 1
            i %= len(self.prompts)
            self.done.append((i, timed_stream(self.client, self.prompts[i], self.cfg.chat_tokens)))

    def run_while(self, work) -> list[tuple[float, float]]:
        """Run the streams while `work()` runs (it returns when the window ends); the gaps of requests sent within:
        (when each ended, perf_counter; its seconds)."""
        start = time.perf_counter()
        with ThreadPoolExecutor(self.cfg.streams) as pool:
            futures = [pool.submit(self._loop) for _ in range(self.cfg.streams)]
            work()
            self._stop.set()
            for f in futures:
                f.result()
        self._stop.clear()
        return [(t.sent_at + end, gap) for _, t in self.done if t.sent_at >= start
                for end, gap in zip(t.arrivals[1:], t.gaps(), strict=True)]  # fmt: skip


def _long_prompts(tokenizer, cfg: LongPromptConfig):
    n = 0

    def make() -> list[int]:
        nonlocal n
        n += 1
        doc = document(tokenizer, cfg.long_tokens, start=11 * n)
        return chat_prompt_ids(tokenizer, [ChatMessage("user", f"Report {n}.\n\n{doc}\n\nSummarize the report.")])

    return make


def _arm(target, draft, device, dtype, tokenizer, chat_prompts, cfg: LongPromptConfig, chunk) -> dict:
    fields = {} if chunk == DEFAULT_CHUNK else {"prefill_chunk_tokens": chunk}
    make_long = _long_prompts(tokenizer, cfg)
    with served(target, draft, device, dtype, **fields) as client:
        timed_stream(client, chat_prompts[0], 8)  # the first request waits for the workers' cost measurement
        timed_stream(client, make_long(), cfg.long_new_tokens)  # unmeasured: the first long one grows the buffers
        first = make_long()
        alone = timed_stream(client, first, cfg.long_new_tokens)
        interval = max(cfg.every_s, 1.5 * alone.ttft_s)
        chat = _Chat(client, chat_prompts, cfg)
        chat_alone = chat.run_while(lambda: time.sleep(interval * cfg.arrivals))
        alone_requests = len(chat.done)
        longs: list[Timed] = []

        def arrivals() -> None:
            with ThreadPoolExecutor(cfg.arrivals) as pool:
                futures = []
                for a in range(cfg.arrivals):
                    futures.append(pool.submit(timed_stream, client, make_long(), cfg.long_new_tokens))
                    if a + 1 < cfg.arrivals:
                        time.sleep(interval)
                longs.extend(f.result() for f in futures)

        chat_mixed = chat.run_while(arrivals)
    outputs: dict[int, list[int]] = {}
    identical = all(outputs.setdefault(i, t.token_ids) == t.token_ids for i, t in chat.done)
    alone_p, mixed_p = percentiles([g for _, g in chat_alone]), percentiles([g for _, g in chat_mixed])
    return {
        "prefill_chunk_tokens": chunk,
        "long_prompt_tokens": len(first),
        "interval_s": interval,
        "long_ttft_alone_s": alone.ttft_s,
        "long_ttft_s": [t.ttft_s for t in longs],
        "long_ttft_vs_alone": max(t.ttft_s for t in longs) / alone.ttft_s,
        "chat_gap_alone_s": alone_p,
        "chat_gap_s": mixed_p,
        "chat_p99_vs_alone": mixed_p["p99"] / alone_p["p99"],
        "chat_gap_by_phase_s": _by_phase(chat_mixed, longs),
        # ~1.0: the streams ran plain steps; more: they drafted (k: auto's choice, which moves the figures above)
        "chat_tokens_per_round_alone": _per_round([t for _, t in chat.done[:alone_requests]]),
        "chat_tokens_per_round": _per_round([t for _, t in chat.done[alone_requests:]]),
        "chat_requests": len(chat.done),
        "chat_identical": identical,
    }


def _per_round(requests: list[Timed]) -> float:
    """Tokens the requests committed a round, all together: each round its accepted drafts and one more."""
    rounds = sum(t.rounds for t in requests)
    return 1 + sum(t.accepted for t in requests) / rounds if rounds else 0.0


def _by_phase(gaps: list[tuple[float, float]], longs: list[Timed]) -> dict[str, dict]:
    """The streams' gaps beside the long prompts split by what the long ones were doing when each gap ended: some
    long request decoding its answer (its rows attend over its whole prompt in every pass), else some prefilling,
    else neither (between them): their count and percentiles. Where the tail is, the scheduler's work is."""

    def phase(at: float) -> str:
        if any(t.sent_at + t.ttft_s <= at <= t.sent_at + t.arrivals[-1] for t in longs if t.arrivals):
            return "decoding"
        if any(t.sent_at <= at < t.sent_at + t.ttft_s for t in longs):
            return "prefilling"
        return "neither"

    split: dict[str, list[float]] = {"prefilling": [], "decoding": [], "neither": []}
    for at, gap in gaps:
        split[phase(at)].append(gap)
    return {name: {"gaps": len(values), **percentiles(values)} for name, values in split.items()}


def run_long_prompt(target: str, draft: str | None, device: str, dtype: str, tokenizer, chat_prompts: list[list[int]],
                    cfg: LongPromptConfig = LongPromptConfig(), progress: bool = True) -> dict:  # fmt: skip
    """Every arm; the JSON entry (meta['long_prompt'])."""
    arms = []
    for i, chunk in enumerate(cfg.chunks):
        if progress:
            print(f"long-prompt: arm {i + 1} of {len(cfg.chunks)} (prefill_chunk_tokens {chunk})", file=sys.stderr,
                  flush=True)  # fmt: skip
        arms.append(_arm(target, draft, device, dtype, tokenizer, chat_prompts, cfg, chunk))
    return {"config": asdict(cfg), "arms": arms}


def format_long_prompt(entry: dict) -> str:
    lines = [f"{'chunk':>8} {'prompt':>6} {'every s':>7} {'TTFT alone s':>12} {'TTFT max s':>10} {'vs alone':>8} "
             f"{'chat gap p50/p99 alone ms':>25} {'beside it ms':>14} {'p99 vs alone':>12}"]  # fmt: skip
    for a in entry["arms"]:
        lines.append(
            f"{str(a['prefill_chunk_tokens']):>8} {a['long_prompt_tokens']:>6} {a['interval_s']:>7.1f} "
            f"{a['long_ttft_alone_s']:>12.2f} {max(a['long_ttft_s']):>10.2f} {a['long_ttft_vs_alone']:>7.2f}x "
            f"{1e3 * a['chat_gap_alone_s']['p50']:>12.0f} / {1e3 * a['chat_gap_alone_s']['p99']:<10.0f} "
            f"{1e3 * a['chat_gap_s']['p50']:>6.0f} / {1e3 * a['chat_gap_s']['p99']:<6.0f} "
            f"{a['chat_p99_vs_alone']:>11.2f}x"
        )
        if "chat_tokens_per_round" in a:
            alone, beside = a["chat_tokens_per_round_alone"], a["chat_tokens_per_round"]
            lines.append(f"         the streams' tokens a round alone / beside: {alone:.2f} / {beside:.2f} (1: plain)")
        phases = a.get("chat_gap_by_phase_s", {})
        lines.append("         the gaps beside, by what the long prompts did: " + ", ".join(
            f"{name} {p['gaps']} (p50 / p99 {1e3 * p['p50']:.0f} / {1e3 * p['p99']:.0f} ms)"
            for name, p in phases.items() if p.get("gaps")))  # fmt: skip
    return "\n".join(lines)
