"""The public service behind both ingresses (Serve gRPC and OpenAI HTTP): validates a request against the app's
limits, runs it through the model's scheduler and pipelined driver, and streams what each round commits.

Framework-free: `cluster/serve/serve_app.py` wraps it in a Serve deployment, tests drive it directly. Workers join and leave
through `sync_workers` (fed from the registry), so pools can scale while requests run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.cluster.app_config import AppConfig, ModelPairConfig
from specserve.cluster.serve.edge import Request
from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.policies import SpeculationControl
from specserve.cluster.scheduling.scheduler import NoTargetWorker, Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.workers.models.chat import ChatPrompt, chat_prompt_ids
from specserve.workers.config import SamplingParams, SpecParams
from specserve.workers.speculation.engine import encode_prompt
from specserve.workers.errors import InvalidRequestError, OverloadedError, UnavailableError
from specserve.workers.runtime.loading import directory_eos_ids
from specserve.workers.runtime.worker_state import check_token_ids


@dataclass
class Prepared:
    """A validated request, ready to run."""

    model: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams


@dataclass
class Chunk:
    """What one round committed. text: the new text (incrementally detokenized, so chunks concatenate to the full
    completion); stats: cumulative RequestStats so far."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict
    prompt_tokens: int
    first: bool = False


class IncrementalText:
    """Turns a growing token list into text deltas whose concatenation equals decoding all tokens at once: a delta
    is held back while the text ends in an incomplete UTF-8 sequence (decoded as U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.emitted = ""

    def delta(self, tokens: list[int], final: bool) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not final and (text.endswith("\ufffd") or not text.startswith(self.emitted)):
            return ""
        out = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return out


@dataclass
class ModelServing:
    """One served model: its tokenizer, its scheduler and the clients of its workers."""

    config: ModelPairConfig
    tokenizer: Any
    vocab_size: int
    max_positions: int | None
    eos: frozenset[int]
    pipeline: Pipeline
    max_token_chars: int = 64  # characters of the vocabulary's longest token (a bound on a prompt's length)
    speculation: SpeculationControl = field(default_factory=SpeculationControl)
    addresses: dict[str, str] = field(default_factory=dict)  # worker id -> address
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def scheduler(self) -> Scheduler:
        return self.pipeline.scheduler


class SpecService:
    def __init__(self, app: AppConfig, resolved_paths: dict[str, tuple[str, str | None]], metrics=None):
        """resolved_paths: model name -> (target directory, draft directory or None), demo paths already resolved.
        metrics: a `ServiceMetrics` (cluster/serve/metrics.py) or None."""
        from transformers import AutoConfig, AutoTokenizer

        self.app = app
        self.metrics = metrics
        self.secret: str | None = None  # the workers' shared secret, sent with every worker call
        self.active = 0  # requests running now (admission control)
        self.models: dict[str, ModelServing] = {}
        for m in app.models:
            target_path, _ = resolved_paths[m.name]
            tok = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
            text_cfg = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config()
            scheduler = Scheduler([], [], cost_ratio=m.cost_ratio)
            pipeline = Pipeline(scheduler, {}, {}, predraft=m.predraft, reconnect=self._reconnect_for(m.name))
            self.models[m.name] = ModelServing(
                config=m,
                tokenizer=tok,
                vocab_size=text_cfg.vocab_size,
                max_positions=getattr(text_cfg, "max_position_embeddings", None),
                eos=directory_eos_ids(target_path, tok),
                pipeline=pipeline,
                max_token_chars=max_token_chars(tok),
            )

    # -- membership ----------------------------------------------------------------------------------------------

    def sync_workers(self, members: list[dict]) -> None:
        """Make each model's workers match the registry's members (rows of model, kind, worker_id, address)."""
        timeout = self.app.ingress.call_timeout_s
        for name, serving in self.models.items():
            rows = {r["worker_id"]: r for r in members if r["model"] == name}
            for worker_id in list(serving.addresses):
                if worker_id not in rows:
                    serving.addresses.pop(worker_id)
                    serving.scheduler.remove_worker(worker_id)
                    serving.pipeline.drafts.pop(worker_id, None)
                    serving.pipeline.targets.pop(worker_id, None)
            for worker_id, row in rows.items():
                if serving.addresses.get(worker_id) == row["address"]:
                    continue
                serving.addresses[worker_id] = row["address"]
                if row["kind"] == "draft":
                    serving.pipeline.drafts[worker_id] = DraftClient(row["address"], timeout, self.secret)
                else:
                    serving.pipeline.targets[worker_id] = TargetClient(row["address"], timeout, self.secret)
                serving.scheduler.add_worker(row["kind"], worker_id)
            serving.changed.set()
            serving.changed = asyncio.Event()

    def _reconnect_for(self, model: str) -> Callable:
        async def reconnect(worker: str) -> str | None:
            """A failed target worker's requests wait for another healthy target (Serve restarts a dead replica
            under a new id, which registers and joins); a failed draft worker's requests go target-only now."""
            serving = self.models[model]
            if worker in serving.pipeline.drafts:
                return None
            deadline = time.monotonic() + self.app.ingress.worker_wait_s
            while time.monotonic() < deadline:
                if [w for w in serving.scheduler.healthy("target") if w != worker]:
                    return None
                await _wait(serving, deadline)
            return None

        return reconnect

    async def wait_ready(self, model: str, timeout_s: float | None = None) -> None:
        """Until the model has a healthy target worker (and a draft worker, if it drafts with a model)."""
        serving = self.models[model]
        deadline = time.monotonic() + (self.app.ingress.worker_wait_s if timeout_s is None else timeout_s)
        while not self._ready(serving):
            if time.monotonic() >= deadline:
                raise UnavailableError(f"model {model!r} has no healthy target worker yet; retry later")
            await _wait(serving, deadline)

    @staticmethod
    def _ready(serving: ModelServing) -> bool:
        if not serving.scheduler.healthy("target"):
            return False
        return not serving.config.drafts_with_model or bool(serving.scheduler.healthy("draft"))

    def status(self) -> dict:
        return {
            name: {
                "targets": s.scheduler.healthy("target"),
                "drafts": s.scheduler.healthy("draft"),
                "active_requests": len(s.scheduler.requests),
                "rounds": s.pipeline.times.rounds,
                "orchestration_ms_p50": s.pipeline.times.p50_ms(),
                "auto_k_cap": s.scheduler.auto_k_cap,
                "speculation_on": s.speculation.switch.on,
                "measured_speedup": s.speculation.switch.measured_speedup(),
            }
            for name, s in self.models.items()
        }

    # -- requests --------------------------------------------------------------------------------------------------

    def prepare(self, request: Request) -> Prepared:
        """Check a request an edge validated against the served model and the app's limits, cheapest first (a
        prompt's size before it is tokenized), and tokenize it. Raises InvalidRequestError naming the client's
        field."""
        cfg = self.app.model(request.model)
        serving = self.models[cfg.name]
        limits = self.app.limits
        if request.max_new_tokens is not None and request.max_new_tokens > limits.max_new_tokens:
            raise InvalidRequestError(request.max_tokens_field, f"{request.max_new_tokens} exceeds this server's "
                                      f"limit of {limits.max_new_tokens}")  # fmt: skip
        default_method = "draft" if cfg.drafts_with_model else ("ngram" if cfg.draft == "ngram" else "none")
        spec = SpecParams(method=request.method or default_method, k=cfg.k if request.k is None else request.k)
        if spec.method == "draft" and not cfg.drafts_with_model:
            raise InvalidRequestError("speculation.method", f"model {cfg.name!r} has no draft model (use ngram/none)")
        ids = _prompt_ids(serving, request, limits.max_prompt_tokens)
        room = None if serving.max_positions is None else serving.max_positions - len(ids)
        if request.max_new_tokens is None:  # what fits, not an error
            max_new = limits.default_max_new_tokens if room is None else min(limits.default_max_new_tokens, room)
        elif room is not None and request.max_new_tokens > room:
            raise InvalidRequestError(request.max_tokens_field, f"{request.max_new_tokens} new tokens after a "
                                      f"{len(ids)}-token prompt exceed the model's context of {serving.max_positions} "
                                      f"positions (at most {room}; leave it unset for what fits)")  # fmt: skip
        else:
            max_new = request.max_new_tokens
        params = SamplingParams(
            temperature=request.temperature,
            top_k=0 if request.top_k >= serving.vocab_size else request.top_k,  # the same distribution
            top_p=request.top_p,
            max_new_tokens=max_new,
            seed=request.seed,
        )
        return Prepared(cfg.name, ids, params, spec)

    def check_capacity(self, model: str) -> None:
        """Admission control: OverloadedError (RESOURCE_EXHAUSTED / 429 with a retry hint) at the replica's limit."""
        limit = self.app.ingress.max_active_requests
        if self.active >= limit:
            if self.metrics:
                self.metrics.request_finished(model, "rejected", started=False)
            raise OverloadedError(f"{self.active} requests are running, the limit of this replica is {limit}")

    async def run(self, req: Prepared) -> AsyncIterator[Chunk]:
        """Run a prepared request; yields one Chunk per round (the last one carries finish_reason)."""
        serving = self.models[req.model]
        self.check_capacity(req.model)
        self.active += 1
        started = time.perf_counter()
        status = "error"
        if self.metrics:
            self.metrics.request_started(req.model)
        try:
            await self.wait_ready(req.model)
            try:
                sched_req = serving.scheduler.add(req.prompt_ids, req.params, req.spec, serving.eos)
            except NoTargetWorker as e:
                raise UnavailableError(str(e)) from None
            text = IncrementalText(serving.tokenizer)
            last = time.perf_counter()
            prev = sched_req.state.stats.to_dict()
            first, generated = True, 0
            try:
                async for committed in serving.pipeline.rounds(sched_req):
                    now = time.perf_counter()
                    state = sched_req.state
                    stats = state.stats.to_dict()
                    if self.metrics:  # TTFT at the round that commits the first token, TPOT for each one after it
                        first_token = generated == 0 and bool(committed)
                        self.metrics.round(req.model, prev, stats, len(committed), now - last, first_token,
                                           now - started)  # fmt: skip
                    generated += len(committed)
                    serving.speculation.after_round(
                        stats["drafted"] - prev["drafted"], stats["accepted"] - prev["accepted"], len(committed),
                        now - last, now - started if state.finished else None,
                    )  # fmt: skip
                    serving.speculation.apply(serving.pipeline, serving.config.cost_ratio,
                                              serving.config.saturation_requests)  # fmt: skip
                    prev, last = stats, now
                    yield Chunk(
                        text=text.delta(state.generated, final=state.finished),
                        token_ids=committed,
                        finish_reason=state.finish_reason,
                        stats=stats,
                        prompt_tokens=len(req.prompt_ids),
                        first=first,
                    )
                    first = False
            except NoTargetWorker as e:
                raise UnavailableError(str(e)) from None
            status = "ok"
        except InvalidRequestError:
            status = "invalid"
            raise
        except UnavailableError:
            status = "unavailable"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            self.active -= 1
            if self.metrics:
                self.metrics.request_finished(req.model, status)

    async def generate(self, req: Prepared) -> dict:
        """The whole completion: the CLI's JSON contract (text, token_ids, finish_reason, stats) plus usage."""
        text, tokens, chunk = [], [], None
        async for chunk in self.run(req):
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
        return {
            "model": req.model,
            "text": "".join(text),
            "token_ids": tokens,
            "finish_reason": chunk.finish_reason,
            "stats": chunk.stats,
            "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(tokens)},
        }


def _prompt_ids(serving: ModelServing, request: Request, max_prompt_tokens: int) -> list[int]:
    """The prompt's token ids, refused by its length in characters (or messages) before the tokenizer runs when it
    cannot fit: a token spans at most `max_token_chars` characters, so that many per allowed token is a bound that
    never refuses a prompt that would fit."""
    prompt, field = request.prompt, request.prompt_field
    limit, why = max_prompt_tokens, f"this server's limit of {max_prompt_tokens} prompt tokens"
    if serving.max_positions is not None and serving.max_positions - 1 < limit:
        limit = serving.max_positions - 1
        why = f"the model's context of {serving.max_positions} positions, less one for the answer"
    if isinstance(prompt, tuple):
        ids = list(prompt[: limit + 1])
    else:
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m.content) for m in prompt.messages)
        if chars > limit * serving.max_token_chars:
            raise InvalidRequestError(field, f"{chars} characters cannot fit in {why}")
        if isinstance(prompt, ChatPrompt):
            if len(prompt.messages) > limit:  # each message renders to a token at least
                raise InvalidRequestError(field, f"{len(prompt.messages)} messages cannot fit in {why}")
            ids = chat_prompt_ids(serving.tokenizer, prompt.messages)
        else:
            ids = encode_prompt(serving.tokenizer, prompt)
    if len(ids) > limit:
        size = f"{len(prompt)} tokens" if isinstance(prompt, tuple) else f"{len(ids)} tokens"
        raise InvalidRequestError(field, f"{size} exceed {why}")
    check_token_ids(field, ids, serving.vocab_size)
    return ids


def max_token_chars(tokenizer) -> int:
    """Characters of the longest token in the vocabulary (added tokens too): no token spans more of a text."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


async def _wait(serving: ModelServing, deadline: float) -> None:
    """Until the model's membership changes or the deadline (re-checked at least every second)."""
    timeout = max(0.0, min(1.0, deadline - time.monotonic()))
    try:
        await asyncio.wait_for(serving.changed.wait(), timeout)
    except TimeoutError:
        pass
