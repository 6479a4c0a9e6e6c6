"""The benchmark's served rows: requests through Ray Serve's gRPC proxy to the Serve application (ingress, the
scheduler replica, a draft pool and a target pool), with the public client. Every disaggregated and tensor-parallel
row runs here (docs/architecture.md, one path per job); a row's acceptance comes from the scheduler replica's
`status()`, read before and after it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from specserve.cluster.bench.rows import BenchConfig, Row
from specserve.cluster.bench.timing import finish_stream_rows
from specserve.protos.wire import APP_NAME
from specserve.workers.speculation.request import RequestStats

MODEL = "bench"
SMALL_POOL = {"num_cpus": 0.5}  # small reservations, so that the app starts on 2 cores


def model_status() -> dict:
    """The bench model's status on the running app's scheduler replica (cluster/scheduling/model_serving.py: rounds,
    wire_bytes, finished, feature traffic, the round accounting, ...)."""
    from ray import serve

    return serve.get_deployment_handle("scheduler", APP_NAME).status.remote().result(timeout_s=60)[MODEL]


def round_accounting() -> dict | None:
    """The bench model's round accounting (cluster/scheduling/round_times.py); None where no Ray runs: a unit test's
    stand-in client."""
    import ray

    return model_status()["round_accounting"] if ray.is_initialized() else None


@dataclass
class ServedModel:
    """One model served by a running app: rows of its requests (greedy), and its scheduler replica's status."""

    client: object  # a SpecServeClient on the app's gRPC address
    new_tokens: int

    def status(self) -> dict:
        return model_status()

    def generate(self, prompt: list[int], method: str = "", k: int | None = None, new_tokens: int | None = None):
        out = self.client.generate(prompt, max_new_tokens=new_tokens or self.new_tokens, method=method, k=k)
        return out["token_ids"]

    def one_stream(self, name: str, kind: str, prompts: list[list[int]], method: str = "", k: int | None = None) -> Row:
        """The prompts one after another."""
        row, before = Row(name, kind, k, 0.0), self.status()
        for prompt in prompts:
            t0 = time.perf_counter()
            row.outputs.append(self.generate(prompt, method, k))
            row.seconds += time.perf_counter() - t0
        fill_speculation(row, before["finished"], self.status()["finished"])
        return row

    def streams(self, name: str, kind: str, prompts: list[list[int]], streams: int, method: str = "",
                k: int | None = None) -> Row:  # fmt: skip
        """`streams` closed loops, each sending the next prompt when its last request finished."""
        row, before = Row(name, kind, k, 0.0, streams=streams), self.status()
        row.outputs = [[] for _ in prompts]
        waiting = list(range(len(prompts)))

        def stream() -> None:
            while waiting:
                i = waiting.pop(0)  # one bytecode: the loops never take the same prompt
                row.outputs[i] = self.generate(prompts[i], method, k)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(lambda _: stream(), range(streams)))
        row.seconds = time.perf_counter() - t0
        fill_speculation(row, before["finished"], self.status()["finished"])
        return row


def fill_speculation(row: Row, before: dict, after: dict) -> None:
    """A row's acceptance from two readings of the replica's counts over finished requests (RequestStats' fields)."""
    row_stats = RequestStats(
        *(after[key] - before[key] for key in ("rounds", "drafted", "accepted")),
        *(_minus(after[key], before[key]) for key in ("reached_by_position", "accepted_by_position")),
    )
    row.acceptance_rate = row_stats.acceptance_rate
    row.mean_accepted_length = 1 + row_stats.accepted / max(1, row_stats.rounds)
    row.acceptance_by_position = row_stats.by_position()


def _minus(after: list[int], before: list[int]) -> list[int]:
    return [a - (before[j] if j < len(before) else 0) for j, a in enumerate(after)]


@contextmanager
def served_model(target: str, draft: str | None, device: str, new_tokens: int, k: int | None = None,
                 dtype: str | None = None, target_pool: dict | None = None) -> Iterator[ServedModel]:  # fmt: skip
    """The Serve app with one model, `target` drafted by `draft` (a draft model, an EAGLE-3 head directory or
    'ngram'; None: the model's default), on a local Ray unless one is connected; stopped on exit."""
    from specserve.client import SpecServeClient
    from specserve.cluster.app_config import AppConfig, serve_config
    from specserve.cluster.serve.server import start, stop
    from specserve.workers.service.local_processes import free_port

    model = {"name": MODEL, "target": target, "device": device, "target_pool": target_pool or SMALL_POOL,
             "draft_pool": SMALL_POOL, **({"draft": draft} if draft else {}), **({"k": k} if k else {}),
             **({"dtype": dtype} if dtype else {})}  # fmt: skip
    app = AppConfig.model_validate({"models": [model], "scheduler": {"num_cpus": 0.5}, "auth": {"api_key_env": None}})
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=600)
    try:
        with SpecServeClient(info["grpc"], timeout_s=600) as client:
            yield ServedModel(client, new_tokens)
    finally:
        stop(info)


def serve_rows(target_path: str, draft_path: str, prompts: list[list[int]], cfg: BenchConfig, k: int, device: str,
               base: Row) -> tuple[list[Row], dict]:  # fmt: skip
    """The model's default drafting at k: one stream, and every prompt at once; and the scheduler replica's status of
    the model afterwards (rounds, orchestration_ms_p50, wire_bytes_per_round, ...)."""
    with served_model(target_path, draft_path, device, cfg.max_new_tokens, k) as served:
        served.generate(prompts[0][:16], k=k, new_tokens=4)  # warm-up
        one = served.one_stream(f"serve gRPC e2e k={k} greedy, 1 stream", "serve", prompts, k=k)
        many = served.streams(f"serve gRPC e2e k={k} greedy, {len(prompts)} streams", "serve", prompts, len(prompts),
                              k=k)  # fmt: skip
        status = served.status()
    return finish_stream_rows([one, many], base), status
