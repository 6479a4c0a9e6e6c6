"""The serving of a scheduler replica's models (`ModelServing`): the requests an ingress prepared, admitted or refused
(admission control, draining), run through their model's round pipeline and streamed back a chunk per round (text
detokenized incrementally, cut at stop sequences); and each model's workers, attached and detached as the registry's
rows say (`sync_workers`), so pools can scale while requests run.

Framework-free: cluster/serve/scheduler_replica.py wraps it in a Serve deployment, tests drive it directly. Below it,
per model: the round pipeline (pipeline.py: `Pipeline`, rounds over gRPC) and the round state machine (scheduler.py:
`Scheduler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from specserve.cluster.app_config import AppConfig, ModelPairConfig
from specserve.cluster.scheduling.admission import Admission
from specserve.cluster.scheduling.detokenize import IncrementalText, byte_pieces
from specserve.cluster.scheduling.pipeline import Pipeline, build_pipeline
from specserve.cluster.scheduling.prefixes import PrefixRecord
from specserve.cluster.scheduling.prepared import Chunk, Prepared
from specserve.cluster.scheduling.scheduler import NoTargetWorker, Scheduler
from specserve.cluster.scheduling.stops import StopCut, StopMatcher
from specserve.cluster.scheduling.tokens import ModelTokenizer
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.workers.errors import (
    InvalidRequestError,
    OverloadedError,
    SpecServeError,
    UnavailableError,
)
from specserve.workers.runtime.eos import directory_eos_ids
from specserve.workers.speculation.eagle.config import resolve_eagle_head
from specserve.workers.speculation.request import RequestStats

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One served model as a replica holds it: its tokenizer, its round pipeline (and the scheduler in it) and the
    workers attached to them. Data, plus the event that wakes what waits on its workers."""

    config: ModelPairConfig
    tokens: ModelTokenizer
    eos: frozenset[int]
    byte_pieces: frozenset[int]  # held back by the detokenizer until a run of them ends
    pipeline: Pipeline
    addresses: dict[str, str] = field(default_factory=dict)  # worker id -> address
    kv_capacity: dict[str, dict[str, int]] = field(default_factory=dict)  # worker id -> its KV tokens and bytes
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Summed over the requests that finished here (a cancelled one is not counted)
    finished: RequestStats = field(default_factory=RequestStats)

    @classmethod
    def load(cls, config: ModelPairConfig, target_path: str, worker_wait_s: float = 600.0) -> ServedModel:
        """The model's tokenizer (from its target directory) and an empty scheduler: no workers until they attach.
        worker_wait_s: how long a request whose target worker failed waits for a healthy one."""
        tokens = ModelTokenizer(target_path)
        head = resolve_eagle_head(config.draft, target_path)
        pipeline = build_pipeline({}, {}, head, predraft=config.predraft, max_k=config.max_k, ngram=config.ngram,
                                  worker_wait_s=worker_wait_s, prefill_chunk=config.prefill_chunk_tokens,
                                  decode_steps=config.decode_steps)  # fmt: skip
        eos = directory_eos_ids(target_path, tokens.tokenizer)
        model = cls(config, tokens, eos, byte_pieces(tokens.tokenizer), pipeline)
        pipeline.faults.wait_changed, pipeline.faults.on_rejoin = model.wait_changed, model.notify_changed
        return model

    @property
    def scheduler(self) -> Scheduler:
        return self.pipeline.scheduler

    @property
    def ready(self) -> bool:
        """A healthy target worker (and a draft worker, if the model drafts with one)."""
        if not self.scheduler.healthy("target"):
            return False
        return not self.config.drafts_with_model or bool(self.scheduler.healthy("draft"))

    def notify_changed(self) -> None:
        """Wake whatever waits on membership (readiness, requests waiting for a target worker)."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_changed(self, deadline: float) -> None:
        """Until the membership changes or the deadline (re-checked at least every second)."""
        timeout = max(0.0, min(1.0, deadline - time.monotonic()))
        with contextlib.suppress(TimeoutError):  # the deadline is the caller's to judge
            await asyncio.wait_for(self.changed.wait(), timeout)


class ModelServing:
    """The served models of one scheduler replica: the requests running here (admission control, draining, each
    round's chunk), readiness, and each model's workers as the registry lists them."""

    def __init__(self, app: AppConfig, resolved_paths: dict[str, tuple[str, str | None]], metrics=None):
        """resolved_paths: model name -> (target directory, draft directory or None), demo paths already resolved.
        metrics: a `SchedulerMetrics` (cluster/serve/metrics.py) or None."""
        self.app = app
        self.metrics = metrics
        self.secret: str | None = None  # the workers' shared secret, sent with every worker call
        self.admission = Admission(app.scheduler.max_active_requests, app.scheduler.max_queued_requests)
        self.closing: set[asyncio.Future] = set()  # detached workers' clients closing (the loop holds tasks weakly)
        self.models = {
            m.name: ServedModel.load(m, resolved_paths[m.name][0], app.scheduler.worker_wait_s) for m in app.models
        }
        if metrics is not None:
            for name, model in self.models.items():
                model.pipeline.times.on_add = lambda record, name=name: metrics.round_time(name, record)

    @property
    def draining(self) -> bool:
        """The app is stopping (the registry says so): finish what runs and waits, admit nothing new."""
        return self.admission.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.admission.draining = value

    @property
    def active(self) -> int:
        """Requests admitted here, running or queued: what a drain waits for."""
        return self.admission.running + self.admission.queued

    # -- membership ----------------------------------------------------------------------------------------------

    def take_prefix_records(self) -> dict[str, list[tuple]]:
        """Per model, the prefix records made here since the last call (for the other scheduler replicas)."""
        out = {name: [tuple(r) for r in model.scheduler.prefixes.take_outbox()] for name, model in self.models.items()}
        return {name: rows for name, rows in out.items() if rows}

    def merge_prefix_records(self, records: dict[str, list]) -> None:
        """The other scheduler replicas' prefix records, per model (prefixes.py)."""
        for name, rows in records.items():
            if name in self.models:
                self.models[name].scheduler.prefixes.merge(PrefixRecord(*row) for row in rows)

    def sync_workers(self, members: list[dict]) -> None:
        """Make each model's workers match the registry's members (rows of model, kind, worker_id, address)."""
        for name, model in self.models.items():
            rows = {r["worker_id"]: r for r in members if r["model"] == name}
            for worker_id in [w for w in model.addresses if w not in rows]:
                self._detach(model, worker_id)
            for row in rows.values():
                model.kv_capacity[row["worker_id"]] = {"tokens": row.get("kv_capacity_tokens", 0),
                                                       "bytes": row.get("kv_capacity_bytes", 0)}  # fmt: skip
                if model.addresses.get(row["worker_id"]) != row["address"]:
                    self._attach(model, row["kind"], row["worker_id"], row["address"])
            model.notify_changed()

    def _attach(self, model: ServedModel, kind: str, worker_id: str, address: str) -> None:
        settings, pipeline = self.app.scheduler, model.pipeline
        model.addresses[worker_id] = address
        clients, client = (pipeline.drafts, DraftClient) if kind == "draft" else (pipeline.targets, TargetClient)
        clients[worker_id] = client(address, settings.call_timeout_s, self.secret, settings.max_call_s)
        model.scheduler.add_worker(kind, worker_id)
        if model.ready:  # measure the costs now (a draft worker's too), not when the first request waits for them
            with contextlib.suppress(RuntimeError):  # no event loop: the first request with k='auto' asks
                pipeline.fetch_costs_soon()
        log.info("model %r: %s worker %s attached at %s", model.config.name, kind, worker_id, address)

    def _detach(self, model: ServedModel, worker_id: str) -> None:
        model.addresses.pop(worker_id)
        model.kv_capacity.pop(worker_id, None)
        model.scheduler.remove_worker(worker_id)
        for client in (model.pipeline.drafts.pop(worker_id, None), model.pipeline.targets.pop(worker_id, None)):
            if client is not None:
                with contextlib.suppress(RuntimeError):  # no event loop: nothing of the client's is open
                    self.closing.add(closed := asyncio.ensure_future(client.close()))  # its stream's reader, channel
                    closed.add_done_callback(self.closing.discard)
        log.info("model %r: worker %s detached (it left the registry)", model.config.name, worker_id)

    async def wait_ready(self, model: str, timeout_s: float | None = None, costs: bool = False) -> None:
        """Until the model has a healthy target worker (and a draft worker, if it drafts with a model); with `costs`,
        also until its workers' costs are measured (a server's start: its first request is then planned at once,
        not after seconds of profiling)."""
        served = self.models[model]
        deadline = time.monotonic() + (self.app.scheduler.worker_wait_s if timeout_s is None else timeout_s)
        while not served.ready:
            if time.monotonic() >= deadline:
                raise UnavailableError(f"model {model!r} has no healthy target worker yet; retry later")
            await served.wait_changed(deadline)
        if costs:
            await served.pipeline.measure_costs()

    def status(self, accounting: bool = True) -> dict:
        """Per model, what the replica knows; `accounting`: with the round accounting's percentiles (a readiness
        probe, which runs often, needs none of it)."""
        return {
            name: {
                "targets": s.scheduler.healthy("target"),
                "drafts": s.scheduler.healthy("draft"),
                "active_requests": len(s.scheduler.requests),
                "rounds": s.pipeline.times.rounds,
                "orchestration_ms_p50": s.pipeline.times.p50_ms(),
                "orchestration_s": s.pipeline.times.orchestration_s,
                # every round's wall time split: plan, draft and verify hops (queue, work, the rest), stream back
                "round_accounting": s.pipeline.times.summary() if accounting else None,
                "wire_bytes": s.pipeline.wire_bytes(),
                "wire_bytes_per_round": s.pipeline.wire_bytes() / max(1, s.pipeline.times.rounds),
                "verify_calls": s.pipeline.verify_calls,  # and the requests a target forward served, on average:
                "mean_target_batch": s.pipeline.mean_target_batch,
                # The requests that finished here: counts only (positions 0-based), so that two readings subtract
                "finished": asdict(s.finished),
                # The goodput planner's, per target worker: chain width, measured slowdowns, features paused or not
                "planner": {w: b.summary() for w, b in s.scheduler.batches.items()},
                "head_acceptance": list(s.scheduler.head_acceptance.known_rates()),  # by position, recent rounds
                "lookup_acceptance": {n: list(a.known_rates()) for n, a in s.scheduler.lookup_acceptance.items()},
                **s.scheduler.feature_traffic.to_dict(),
                "kv_capacity": dict(s.kv_capacity),  # per worker, as it registered (memory_budget.py)
                # requests placed on the worker that held their prompt's prefix (affinity.py), by kind
                "prefix_affinity_placed": {k: a.placed for k, a in s.scheduler.prefixes.affinity.items()},
                "prefill_chunks": s.scheduler.chunks.status(),  # per target worker: its chunks' pacing
                "admission": self.admission.summary(),  # this replica's, over every model it serves
            }
            for name, s in self.models.items()
        }

    # -- requests --------------------------------------------------------------------------------------------------

    async def run(self, req: Prepared) -> AsyncIterator[Chunk]:
        """Run a prepared request; yields one Chunk per round (the last one carries finish_reason)."""
        model = self.models[req.model]
        what = f"{req.request_id} (model {req.model!r})"
        try:
            self.admission.check(what)
        except OverloadedError:
            if self.metrics:
                self.metrics.request_rejected(req.model)
            raise
        status = "error"
        # RequestMetrics, from the request's arrival at the ingress: its queue time includes the hop here
        track = self.metrics.request(req.model, len(req.prompt_ids), req.arrived_at) if self.metrics else None
        try:
            async with self.admission.slot(what):
                await self.wait_ready(req.model)
                async with contextlib.aclosing(self._rounds(model, req, track)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            status = "ok"
        except InvalidRequestError:
            status = "invalid"
            raise
        except UnavailableError as e:
            status = "unavailable"
            log.warning("model %r: request %s stopped: %s", req.model, req.request_id, e)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except SpecServeError as e:  # the client's to act on (a full KV cache, ...): no traceback
            log.warning("model %r: request %s failed: %s", req.model, req.request_id, e)
            raise
        except Exception:
            log.error("model %r: request %s failed", req.model, req.request_id, exc_info=True)
            raise
        finally:
            if track:
                track.finished(status)

    async def _rounds(self, model: ServedModel, req: Prepared, track=None) -> AsyncIterator[Chunk]:
        try:
            # The client's id names the request on the workers too, made unique: two clients may send the same one.
            internal = f"{req.request_id}.{uuid.uuid4().hex[:8]}" if req.request_id else None
            sched_req = model.scheduler.add(req.prompt_ids, req.params, req.spec, model.eos, request_id=internal)
        except NoTargetWorker as e:
            raise UnavailableError(str(e)) from None
        if track:
            track.scheduled()
        text = IncrementalText(model.tokens.tokenizer, model.byte_pieces)
        stops = StopMatcher(req.stop, text.delta) if req.stop else None
        prev = sched_req.state.stats.to_dict()
        prompt_logprobs = req.params.prompt_logprobs is not None  # still to send: with the first chunk
        try:
            async with contextlib.aclosing(model.pipeline.rounds(sched_req)) as rounds:
                async for committed in rounds:
                    state = sched_req.state
                    stats = state.stats.to_dict()
                    cut = (
                        stops.feed(state.generated, len(committed), state.finished)
                        if stops
                        else StopCut(text.delta(state.generated, final=state.finished), len(committed), False)
                    )
                    finish = "stop" if cut.stopped else state.finish_reason
                    if track:
                        track.round(prev, stats, cut.tokens, finish)
                    if finish:  # counted before the last chunk leaves: a caller's next status() includes it
                        model.finished.add(state.stats)
                    start = len(state.generated) - len(committed)  # the round's first token: its logprob's index
                    logprobs = state.logprobs[start : start + cut.tokens] if req.params.logprobs is not None else None
                    prompt = state.prompt_logprobs if prompt_logprobs else None
                    prompt_logprobs = False
                    yield Chunk(text=cut.text, token_ids=committed[: cut.tokens], finish_reason=finish, stats=stats,
                                logprobs=logprobs, prompt_logprobs=prompt)  # fmt: skip
                    if cut.stopped:
                        return  # a stop sequence ended it: the rest of the round is dropped, the workers released
                    prev = stats
        except NoTargetWorker as e:
            raise UnavailableError(str(e)) from None

    async def generate(self, req: Prepared) -> dict:
        """The whole completion: the CLI's JSON contract (text, token_ids, finish_reason, stats) plus usage, and the
        tokens' logprobs and the prompt's (TokenLogprobs: `logprobs`, `prompt_logprobs`) when the request asks."""
        text, tokens, chunk, prompt_logprobs = [], [], None, None
        logprobs = [] if req.params.logprobs is not None else None
        async for chunk in self.run(req):
            prompt_logprobs = prompt_logprobs or chunk.prompt_logprobs
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if logprobs is not None:
                logprobs.extend(chunk.logprobs)
        out = {
            "model": req.model,
            "text": "".join(text),
            "token_ids": tokens,
            "finish_reason": chunk.finish_reason,
            "stats": chunk.stats,
            "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(tokens)},
        }
        if logprobs is not None:
            out["logprobs"] = logprobs
        if req.params.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs or []
        return out
