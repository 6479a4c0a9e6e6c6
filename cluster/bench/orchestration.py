"""The orchestration tax of `specserve bench --load`: served speculation-off decoding at one stream against in-process
target-only decoding, on the same prompts and lengths, in the same run.

In process, one forward runs on every core. Served, the target worker's forward runs on the threads its pool gives it
(workers/runtime/threads.py: on a CPU, every core but one, left to the scheduler, the ingress and Serve's proxy, whose
wake-ups otherwise stall a multi-threaded forward at each barrier). So the tax is reported twice: against in-process
decoding at the served target's thread count (what the hops cost: gRPC, the scheduler, the batcher, Serve's
streaming) and against in-process decoding on every core (what a user sees, the threads included)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from specserve.workers.config.request import SamplingParams, SpecParams


@dataclass(frozen=True)
class OrchestrationTax:
    max_new_tokens: int
    served_threads: int  # the served target worker's torch threads
    served_off_tok_s: float  # served, speculation off, one stream, whole requests (prefill included)
    in_process_same_threads_tok_s: float  # in-process target-only at served_threads
    in_process_all_cores_tok_s: float  # in-process target-only on every core, without the app running
    identical: bool  # served tokens == in-process tokens, every prompt
    served_tpot_ms_p50: float = 0.0  # per request: (last token - first token) / (tokens - 1); the median
    in_process_tpot_ms_p50: float = 0.0  # per prompt: (T(n tokens) - T(1 token)) / (n - 1) at served_threads
    served_round_ms: dict | None = None  # the served rounds' accounting, each part's mean (round_times.py)

    @property
    def served_overhead_ms(self) -> float:
        """Issue 56's figure to drive down: a served round's cost beyond the same forward in process."""
        return self.served_tpot_ms_p50 - self.in_process_tpot_ms_p50

    @property
    def vs_same_threads(self) -> float:
        return self.served_off_tok_s / self.in_process_same_threads_tok_s

    @property
    def vs_all_cores(self) -> float:
        return self.served_off_tok_s / self.in_process_all_cores_tok_s

    def to_dict(self) -> dict:
        return {**asdict(self), "vs_same_threads": self.vs_same_threads, "vs_all_cores": self.vs_all_cores,
                "served_overhead_ms": self.served_overhead_ms}  # fmt: skip

    def line(self) -> str:
        return (f"served speculation off, 1 stream, {self.max_new_tokens} tokens: {self.served_off_tok_s:.1f} tok/s = "
                f"{self.vs_same_threads:.2f}x in-process target-only at the served target's {self.served_threads} "
                f"thread(s) ({self.in_process_same_threads_tok_s:.1f} tok/s), {self.vs_all_cores:.2f}x the target-only "
                f"row on every core ({self.in_process_all_cores_tok_s:.1f} tok/s); outputs "
                f"{'identical' if self.identical else 'DIFFERENT'}; TPOT p50 {self.served_tpot_ms_p50:.1f} ms served, "
                f"{self.in_process_tpot_ms_p50:.1f} in process: served overhead {self.served_overhead_ms:.1f} ms a "
                "token")  # fmt: skip


def served_one_stream(client, prompts: list[list[int]], max_new_tokens: int):
    """(tokens per second, outputs, TPOT p50 s): each prompt in turn through the served app, speculation off, greedy,
    streamed; timed from the call to the last token, as the in-process rows are."""
    outputs, seconds, tpots = [], 0.0, []
    for prompt in prompts:
        start, tokens, first = time.perf_counter(), [], None
        for chunk in client.generate_stream(prompt, max_new_tokens=max_new_tokens, temperature=0.0, method="none"):
            tokens += chunk["token_ids"]
            if first is None and tokens:
                first = time.perf_counter()
        end = time.perf_counter()
        seconds += end - start
        outputs.append(tokens)
        if first is not None and len(tokens) > 1:
            tpots.append((end - first) / (len(tokens) - 1))
    return sum(map(len, outputs)) / seconds, outputs, statistics.median(tpots) if tpots else 0.0


def in_process(engine, prompts: list[list[int]], max_new_tokens: int, threads: int | None = None):
    """(tokens per second, outputs) of in-process target-only decoding, on `threads` torch threads (None: as set)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        params, off = SamplingParams(max_new_tokens=max_new_tokens), SpecParams(method="none")
        engine.generate(prompts[0][:8], SamplingParams(max_new_tokens=2), off)  # warm-up at this thread count
        outputs, seconds, tpots = [], 0.0, []
        for prompt in prompts:
            start = time.perf_counter()
            outputs.append(engine.generate(prompt, params, off).token_ids)
            whole = time.perf_counter() - start
            seconds += whole
            if len(outputs[-1]) > 1:  # a step's time: the whole run less its prefill and first token
                start = time.perf_counter()
                engine.generate(prompt, SamplingParams(max_new_tokens=1), off)
                tpots.append((whole - (time.perf_counter() - start)) / (len(outputs[-1]) - 1))
    finally:
        torch.set_num_threads(before)
    return sum(map(len, outputs)) / seconds, outputs, statistics.median(tpots) if tpots else 0.0


def measure_tax(client, engine, prompts: list[list[int]], max_new_tokens: int, served_threads: int,
                all_cores_tok_s: float) -> OrchestrationTax:  # fmt: skip
    """Served, then in process at the served threads, back to back while the app runs (its idle processes wake
    too); `all_cores_tok_s`: the bench's in-process target-only row, measured on every core before the app started
    (beside the idle app a forward on every core loses about a quarter of its speed on 2 cores)."""
    from specserve.cluster.bench.serve import round_accounting
    from specserve.cluster.scheduling.round_times import per_round_ms

    before = round_accounting()
    served, served_out, served_tpot = served_one_stream(client, prompts, max_new_tokens)
    rounds = per_round_ms([(before, round_accounting())]) if before is not None else None
    same, same_out, same_tpot = in_process(engine, prompts, max_new_tokens, served_threads)
    return OrchestrationTax(max_new_tokens, served_threads, served, same, all_cores_tok_s, served_out == same_out,
                            1e3 * served_tpot, 1e3 * same_tpot, rounds)  # fmt: skip
