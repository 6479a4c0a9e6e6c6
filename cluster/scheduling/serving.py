"""One served model as a scheduler replica holds it (`ModelServing`: tokenizer, scheduler, pipelined driver, the
clients of its workers) and its membership: workers attach and detach as the registry's rows say, and readiness
waits on those changes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from specserve.cluster.app_config import ModelPairConfig
from specserve.cluster.scheduling.detokenize import byte_pieces
from specserve.cluster.scheduling.pipeline import Pipeline, build_pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.tokens import ModelTokenizer
from specserve.cluster.scheduling.worker_clients import MAX_CALL_S, DraftClient, TargetClient
from specserve.workers.runtime.eos import directory_eos_ids
from specserve.workers.speculation.eagle.config import resolve_eagle_head
from specserve.workers.speculation.request import RequestStats

log = logging.getLogger(__name__)


@dataclass
class ModelServing:
    """One served model: its tokenizer, its scheduler and the clients of its workers."""

    config: ModelPairConfig
    tokens: ModelTokenizer
    eos: frozenset[int]
    byte_pieces: frozenset[int]  # held back by the detokenizer until a run of them ends
    pipeline: Pipeline
    addresses: dict[str, str] = field(default_factory=dict)  # worker id -> address
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Summed over the requests that finished here (a cancelled one is not counted)
    finished: RequestStats = field(default_factory=RequestStats)

    @property
    def scheduler(self) -> Scheduler:
        return self.pipeline.scheduler

    @classmethod
    def load(cls, config: ModelPairConfig, target_path: str, worker_wait_s: float = 600.0) -> ModelServing:
        """The model's tokenizer (from its target directory) and an empty scheduler: no workers until they attach.
        worker_wait_s: how long a request whose target worker failed waits for a healthy one."""
        tokens = ModelTokenizer(target_path)
        head = resolve_eagle_head(config.draft, target_path)
        pipeline = build_pipeline({}, {}, head, predraft=config.predraft, max_k=config.max_k, ngram=config.ngram,
                                  worker_wait_s=worker_wait_s, prefill_chunk=config.prefill_chunk_tokens)  # fmt: skip
        eos = directory_eos_ids(target_path, tokens.tokenizer)
        serving = cls(config, tokens, eos, byte_pieces(tokens.tokenizer), pipeline)
        pipeline.faults.wait_changed, pipeline.faults.on_rejoin = serving.wait_changed, serving.notify_changed
        return serving

    def sync(self, rows: dict[str, dict], timeout_s: float, secret: str | None, max_call_s: float = MAX_CALL_S) -> None:
        """Match the workers to the registry's rows for this model (worker id -> model, kind, worker_id, address)."""
        for worker_id in [w for w in self.addresses if w not in rows]:
            self.detach(worker_id)
        for row in rows.values():
            if self.addresses.get(row["worker_id"]) != row["address"]:
                self.attach(row["kind"], row["worker_id"], row["address"], timeout_s, secret, max_call_s)
        self.notify_changed()

    def notify_changed(self) -> None:
        """Wake whatever waits on membership (readiness, requests waiting for a target worker)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def attach(self, kind: str, worker_id: str, address: str, timeout_s: float, secret: str | None,
               max_call_s: float = MAX_CALL_S) -> None:  # fmt: skip
        self.addresses[worker_id] = address
        if kind == "draft":
            self.pipeline.drafts[worker_id] = DraftClient(address, timeout_s, secret, max_call_s)
        else:
            self.pipeline.targets[worker_id] = TargetClient(address, timeout_s, secret, max_call_s)
        self.scheduler.add_worker(kind, worker_id)
        if self.ready:  # measure the costs now (a draft worker's too), not when the first request waits for them
            with contextlib.suppress(RuntimeError):  # no event loop: the first request with k='auto' asks
                self.pipeline.fetch_costs_soon()
        log.info("model %r: %s worker %s attached at %s", self.config.name, kind, worker_id, address)

    def detach(self, worker_id: str) -> None:
        self.addresses.pop(worker_id)
        self.scheduler.remove_worker(worker_id)
        self.pipeline.drafts.pop(worker_id, None)
        self.pipeline.targets.pop(worker_id, None)
        log.info("model %r: worker %s detached (it left the registry)", self.config.name, worker_id)

    @property
    def ready(self) -> bool:
        """A healthy target worker (and a draft worker, if the model drafts with one)."""
        if not self.scheduler.healthy("target"):
            return False
        return not self.config.drafts_with_model or bool(self.scheduler.healthy("draft"))

    async def wait_changed(self, deadline: float) -> None:
        """Until the membership changes or the deadline (re-checked at least every second)."""
        timeout = max(0.0, min(1.0, deadline - time.monotonic()))
        with contextlib.suppress(TimeoutError):  # the deadline is the caller's to judge
            await asyncio.wait_for(self.changed.wait(), timeout)
