"""The Ray Serve application: a draft pool and a target pool deployment per served model, a scheduler deployment
that runs requests' rounds against them, and an ingress deployment that answers the public SpecServe gRPC service
(through Serve's gRPC proxy) and the OpenAI-compatible HTTP API (FastAPI) and hands each request to a scheduler
replica through a deployment handle.

`build_app(args)` is the import path of the Serve config file (`serve run`, `serve deploy`, RayService
serveConfigV2); `specserve serve` calls it too. Pool replicas host a worker's own gRPC server (the scheduler calls it
directly, per request, with the KV state protocol) and register its address in the app's registry actor.
"""

import asyncio
import contextlib
import hmac
import math
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from specserve.cluster.serve import openai_api as oai
from specserve.cluster.app_config import APP_NAME, DEMO, AppConfig, ModelPairConfig, app_config
from specserve.cluster.serve.edge import PayloadTooLargeError, client_message
from specserve.cluster.serve.public_proto import (
    http_status_for,
    refused_status,
    request_from_proto,
    response,
    status_for,
)
from specserve.cluster.serve.registry import registry_actor
from specserve.workers.errors import (
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)

HEARTBEAT_S = 5.0
POLL_S = 1.0
# A restarted registry knows only the workers that re-registered since: within this long of its restart, pollers keep
# the workers they knew (every live one re-registers within a heartbeat).
REJOIN_S = 2 * HEARTBEAT_S + POLL_S


def resolve_paths(model: ModelPairConfig) -> tuple[str, str | None]:
    """(target directory, draft directory or None): 'demo' means the demo family, installed here if missing; names
    and .gguf files are pulled and converted once per machine (cached under $SPECSERVE_HOME)."""
    from specserve.workers.models.catalog import resolve_model

    if model.target == DEMO:
        from specserve.workers.training.demo_build import ensure_demo_family

        family = ensure_demo_family()
        target, demo_draft = family.target, family.draft
    else:
        target, demo_draft = resolve_model(model.target), None
    if not model.drafts_with_model:
        return target, None
    return target, demo_draft if model.draft == DEMO else resolve_model(model.draft)


def _app_name() -> str:
    try:
        return serve.get_replica_context().app_name or APP_NAME
    except Exception:  # noqa: BLE001 - outside a replica
        return APP_NAME


class PoolWorker:
    """One replica of a draft or target pool: loads the model, serves it over its own gRPC server and keeps its
    address registered (a heartbeat, so a restarted registry relearns it)."""

    async def __init__(self, model: dict, kind: str, max_message_bytes: int | None = None):
        import ray

        from specserve.cluster.pools.actors import DraftWorkerActor, TargetWorkerActor
        from specserve.cluster.config import PoolConfig
        from specserve.cluster.serve.metrics import WorkerMetrics
        from specserve.workers.config import ModelConfig

        cfg = ModelPairConfig.model_validate(model)
        target_path, draft_path = resolve_paths(cfg)
        pool_cfg = cfg.target_pool if kind == "target" else cfg.draft_pool
        path = target_path if kind == "target" else draft_path
        pool = PoolConfig(model=ModelConfig(path=path, dtype=cfg.dtype, device=cfg.device), resource=f"{kind}_gpu",
                          kv_cache=pool_cfg.kv_cache, batching=pool_cfg.batching, num_cpus=pool_cfg.num_cpus,
                          num_gpus=pool_cfg.num_gpus, tensor_parallel_size=pool_cfg.tensor_parallel_size)  # fmt: skip
        if kind == "target":
            self.body = TargetWorkerActor(pool)
            self.store = self.body.worker.verifier.runner.store
        else:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config().vocab_size
            self.body = DraftWorkerActor(pool, vocab)
            self.store = self.body.worker.store
        self.registry = registry_actor(_app_name())
        self.address = await self.body.start(await self.registry.secret.remote(), max_message_bytes)
        self.model, self.kind = cfg.name, kind
        ctx = serve.get_replica_context()
        self.worker_id = f"{kind}-{cfg.name}-{ctx.replica_id.unique_id}"
        self.node = ray.get_runtime_context().get_node_id()
        self.metrics = WorkerMetrics()
        await self._register()
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _register(self) -> None:
        await self.registry.register.remote(self.model, self.kind, self.worker_id, self.address)
        if self.store is not None:
            self.metrics.report(self.model, self.kind, self.worker_id, self.store)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            with contextlib.suppress(Exception):  # the registry restarting: the next beat registers again
                await self._register()

    async def info(self) -> dict:
        return {"worker_id": self.worker_id, "address": self.address, "node_id": self.node, "kind": self.kind}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (Serve sees no handle traffic to pools: requests come over gRPC)."""
        now, busy = time.monotonic(), self.body.servicer.busy_s
        last_t, last_busy = getattr(self, "_last_stats", (now, busy))
        self._last_stats = (now, busy)
        fraction = (busy - last_busy) / (now - last_t) if now > last_t else 0.0
        return {
            "busy_fraction": min(1.0, max(0.0, fraction)),
            "requests": float(len(self.store) if self.store is not None else 0),
        }

    async def check_health(self) -> None:
        if self._beat.done():
            raise RuntimeError("the worker's heartbeat stopped")
        failed = getattr(self.body.runner, "failed", None)
        if failed:  # a tensor-parallel rank died: Serve replaces the whole replica (its ranks die with it)
            raise RuntimeError(failed)

    async def __del__(self):
        with contextlib.suppress(Exception):
            self._beat.cancel()
            await self.registry.unregister.remote(self.worker_id)
            await self.body.server.stop(grace=2.0)


class SchedulerReplica:
    """One scheduler: tracks the pools' workers (from the app's registry) and runs requests' draft/verify rounds
    against them over gRPC. The ingress calls it through a deployment handle, so when a scheduler replica dies the
    ingress sees it and answers UNAVAILABLE (Serve's proxy would report a dead replica as INTERNAL). Pool handles are
    passed in only so Serve deploys the pools with the app; requests go to the workers over their own gRPC
    servers."""

    def __init__(self, app_args: dict, *pools: Any):
        from specserve.cluster.serve.metrics import ServiceMetrics
        from specserve.cluster.scheduling.service import SpecService

        self.config: AppConfig = app_config(app_args)
        paths = {m.name: resolve_paths(m) for m in self.config.models}
        self.service = SpecService(self.config, paths, metrics=ServiceMetrics([m.name for m in self.config.models]))
        self._poller: asyncio.Task | None = None
        self._seen: tuple[str, int] | None = None  # (registry incarnation, version) last applied
        self._rows: list[dict] = []

    # -- worker membership ---------------------------------------------------------------------------------------

    async def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self.registry = registry_actor(_app_name())
            self.service.secret = await self.registry.secret.remote()
            await self._poll_once()
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll_once(self) -> None:
        snap = await self.registry.snapshot.remote()
        rows, seen = snap["members"], (snap["incarnation"], snap["version"])
        if snap["uptime_s"] < REJOIN_S:  # a restarted registry: workers it has not heard from yet are still there
            known = {r["worker_id"] for r in rows}
            rows = rows + [r for r in self._rows if r["worker_id"] not in known]
            seen = None  # merged, not the registry's own: apply again next time
        if seen is None or seen != self._seen:
            self.service.sync_workers(rows)
        self._seen, self._rows = seen, rows

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            with contextlib.suppress(Exception):
                await self._poll_once()

    async def check_health(self) -> None:
        await self._ensure_polling()

    async def status(self) -> dict:
        await self._ensure_polling()
        return self.service.status()

    async def wait_ready(self, timeout_s: float | None = None, model: str | None = None) -> None:
        await self._ensure_polling()
        for m in self.config.models:
            if model is None or m.name == model:
                await self.service.wait_ready(m.name, timeout_s)

    async def admit(self, model: str) -> None:
        """Whether a request for `model` would start now (ready and under capacity); raises like `run` would."""
        await self.wait_ready(None, model)
        self.service.check_capacity(model)

    # -- requests (Prepared by the ingress) ------------------------------------------------------------------------

    async def generate(self, prepared) -> dict:
        await self._ensure_polling()
        return await self.service.generate(prepared)

    async def run(self, prepared) -> AsyncIterator:
        """The request's chunks, one per round (a streaming handle method)."""
        await self._ensure_polling()
        async for chunk in self.service.run(prepared):
            yield chunk


http_app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding", docs_url=None)


class SpecServeIngress:
    """Both public APIs: authenticates, validates and tokenizes each request, then runs it on a scheduler replica
    through a deployment handle. Holds no request state, so a replica lost here loses no work that a retry would not
    redo."""

    def __init__(self, app_args: dict, scheduler: Any):
        from specserve.cluster.serve.metrics import IngressMetrics
        from specserve.cluster.scheduling.service import SpecService

        self.config: AppConfig = app_config(app_args)
        self.metrics = IngressMetrics()
        paths = {m.name: resolve_paths(m) for m in self.config.models}
        self.requests = SpecService(self.config, paths)  # tokenizers and limits only: no workers behind it
        self.scheduler = scheduler
        self.created = int(time.time())
        env = self.config.auth.api_key_env
        self._api_key = (os.environ.get(env) or None) if env else None

    async def status(self) -> dict:
        return await _call(self.scheduler.status.remote())

    async def wait_ready(self, timeout_s: float) -> None:
        await _call(self.scheduler.wait_ready.remote(timeout_s))

    def _check_key(self, authorization: str | None) -> None:
        if self._api_key is None:
            return
        sent = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent.encode(errors="surrogatepass"), self._api_key.encode(errors="surrogatepass")):
            raise UnauthenticatedError("missing or wrong API key (send 'authorization: Bearer <key>')")

    def _check_grpc_key(self, grpc_context) -> None:
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        self._check_key(metadata.get("authorization"))

    async def _generate(self, prepared) -> dict:
        return await _call(self.scheduler.generate.remote(prepared))

    async def _run(self, prepared) -> AsyncIterator:
        chunks = self.scheduler.options(stream=True).run.remote(prepared)
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # noqa: BLE001 - a scheduler replica's error or death, as a specserve error
            raise _scheduler_error(e) from None

    # -- gRPC: the public SpecServe service ------------------------------------------------------------------------

    async def Generate(self, request, grpc_context):  # noqa: N802 - gRPC method name
        try:
            self._check_grpc_key(grpc_context)
            prepared = self.requests.prepare(request_from_proto(request))
            out = await self._generate(prepared)
            return response(out["text"], out["token_ids"], out["finish_reason"], out["stats"])
        except Exception as e:
            self._grpc_failed("Generate", grpc_context, e)
            raise

    async def GenerateStream(self, request, grpc_context):  # noqa: N802 - gRPC method name
        started = False
        try:
            self._check_grpc_key(grpc_context)
            prepared = self.requests.prepare(request_from_proto(request))
            async for chunk in self._run(prepared):
                started = True
                yield response(chunk.text, chunk.token_ids, chunk.finish_reason, chunk.stats)
        except Exception as e:
            self._grpc_failed("GenerateStream", grpc_context, e, refused=not started)
            raise

    def _grpc_failed(self, method: str, grpc_context, error: BaseException, refused: bool = True) -> None:
        status = refused_status(error, http=False) if refused else None
        if status:
            self.metrics.refuse(f"/specserve.v1.SpecServe/{method}", status)
        _set_grpc_error(grpc_context, error)

    # -- HTTP: OpenAI-compatible -----------------------------------------------------------------------------------

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._check_key(request.headers.get("authorization"))
        except UnauthenticatedError as e:
            return self._refuse("/v1/models", e)
        return JSONResponse(oai.models_list([m.name for m in self.config.models], self.created))

    @http_app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            return JSONResponse(await self.status())
        except Exception as e:  # noqa: BLE001
            return _http_error(e)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, "/v1/completions")

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, "/v1/chat/completions")

    async def _openai(self, request: Request, route: str):
        chat = route == "/v1/chat/completions"
        try:
            self._check_key(request.headers.get("authorization"))
            body = await _json_body(request, self.config.limits.max_request_bytes)
            parsed = oai.parse_chat(body) if chat else oai.parse_completion(body)
            prepared = self.requests.prepare(parsed.request)
            rid = oai.new_id("chatcmpl" if chat else "cmpl")
            if not parsed.stream:
                out = await self._generate(prepared)
                return JSONResponse(oai.completion_response(rid, prepared.model, out, chat))
            await _call(self.scheduler.admit.remote(prepared.model))  # before the 200 and its headers are sent
            return StreamingResponse(self._sse(rid, prepared, parsed.include_usage, chat),
                                     media_type="text/event-stream")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-shaped error
            return self._refuse(route, e)

    def _refuse(self, route: str, error: BaseException) -> JSONResponse:
        """The error response; counted when the client caused it (4xx)."""
        status = refused_status(error, http=True)
        if status and not getattr(error, "counted", False):
            self.metrics.refuse(route, status)
        return _http_error(error)

    async def _sse(self, rid: str, prepared, include_usage: bool, chat: bool) -> AsyncIterator[str]:
        generated, stats = 0, {}
        try:
            async for chunk in self._run(prepared):
                generated += len(chunk.token_ids)
                stats = chunk.stats
                if chunk.text or chunk.finish_reason:
                    yield oai.stream_chunk(rid, prepared.model, chunk.text, chunk.finish_reason, chat, chunk.first)
            if include_usage:
                yield oai.usage_chunk(rid, prepared.model, len(prepared.prompt_ids), generated, stats, chat)
            yield oai.sse("[DONE]")
        except Exception as e:  # noqa: BLE001 - headers are sent: report the error as an event
            _, kind = http_status_for(e)
            yield oai.sse(oai.error_body(client_message(e), kind, getattr(e, "field", None)))


# Applied at import time in every process: Serve pickles the ingress class by reference to this module, and the
# FastAPI routes must be rebound to the class in the replica's copy of `http_app` too.
IngressDeployment = serve.ingress(http_app)(SpecServeIngress)


async def _call(response):
    """Await a scheduler handle call; its errors (and the scheduler replica's death) as specserve errors."""
    try:
        return await response
    except Exception as e:  # noqa: BLE001
        raise _scheduler_error(e) from None


def _scheduler_error(error: BaseException) -> BaseException:
    """What a scheduler call's failure means to the client: the scheduler's own error as raised there; its replica
    dying (or none being up) as UnavailableError, which says the call did not complete and can be retried."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(error, RayTaskError) and isinstance(getattr(error, "cause", None), Exception):
        return _scheduler_error(error.cause)
    if isinstance(error, RayActorError):
        return UnavailableError(f"the scheduler replica running this request stopped ({type(error).__name__}); "
                                "retry: nothing of the request is kept")  # fmt: skip
    if isinstance(error, DeploymentUnavailableError):
        return UnavailableError("no scheduler replica is up right now; retry")
    if isinstance(error, BackPressureError):
        return OverloadedError("every scheduler replica is busy", retry_after_s=1.0)
    return error


def _set_grpc_error(grpc_context, error: BaseException) -> None:
    if grpc_context is not None:
        grpc_context.set_code(status_for(error))
        grpc_context.set_details(client_message(error))


async def _json_body(request: Request, max_bytes: int) -> Any:
    from starlette.requests import ClientDisconnect

    try:
        return await oai.read_json(request.stream(), request.headers.get("content-length"), max_bytes)
    except ClientDisconnect:  # Serve's proxy cut an oversize chunked body off: its 413 is sent and counted already
        error = PayloadTooLargeError("body", f"is longer than the limit of {max_bytes} bytes")
        error.counted = True
        raise error from None


def _http_error(error: BaseException) -> JSONResponse:
    status, kind = http_status_for(error)
    field = getattr(error, "field", None)
    code = "model_not_found" if field == "model" and "unknown model" in str(error) else None
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if isinstance(error, OverloadedError) else None
    return JSONResponse(oai.error_body(client_message(error), kind, field, code), status_code=status, headers=headers)


def _pool_options(name: str, pool) -> dict:
    actor: dict = {"num_cpus": pool.num_cpus}
    if pool.num_gpus:
        actor["num_gpus"] = pool.num_gpus
    if pool.resources:
        actor["resources"] = dict(pool.resources)
    # A short health-check period: Serve notices a dead pool replica and starts its replacement within seconds
    # (requests meanwhile run target-only or on the other target replicas).
    options: dict = {"name": name, "ray_actor_options": actor, "max_ongoing_requests": 16,
                     "health_check_period_s": 2.0, "health_check_timeout_s": 20.0}  # fmt: skip
    if pool.tensor_parallel_size > 1:
        # One bundle per rank, packed on one node; the replica itself is rank 0 in bundle 0.
        bundle = {"CPU": pool.num_cpus, **({"GPU": pool.num_gpus} if pool.num_gpus else {}), **pool.resources}
        options["placement_group_bundles"] = [dict(bundle) for _ in range(pool.tensor_parallel_size)]
        options["placement_group_strategy"] = "STRICT_PACK"
    if pool.autoscaling is not None:
        options["autoscaling_config"] = pool.autoscaling.model_dump()
    else:
        options["num_replicas"] = pool.replicas
    return options


def worker_message_bytes(app: AppConfig) -> int:
    """Largest message a worker's gRPC server accepts: the app's gRPC limit, raised to what its largest legitimate
    call needs (a whole context's token ids, at most 5 bytes each, and a round's sparse draft distributions)."""
    limits = app.limits
    return max(limits.max_grpc_message_bytes, 5 * (limits.max_prompt_tokens + limits.max_new_tokens) + (1 << 20))


def build_app(args: dict | AppConfig | None = None):
    """The Serve application for `args` (an AppConfig or its dict; the Serve config file's `args`)."""
    app = app_config(args or {})
    pools = []
    message_bytes = worker_message_bytes(app)
    for m in app.models:
        model = m.model_dump(mode="json")
        pools.append(serve.deployment(PoolWorker).options(**_pool_options(f"target-{m.name}", m.target_pool))
                     .bind(model, "target", message_bytes))  # fmt: skip
        if m.drafts_with_model:
            pools.append(serve.deployment(PoolWorker).options(**_pool_options(f"draft-{m.name}", m.draft_pool))
                         .bind(model, "draft", message_bytes))  # fmt: skip
    args = app.model_dump(mode="json")
    scheduler = serve.deployment(SchedulerReplica).options(
        name="scheduler",
        num_replicas=app.ingress.replicas,
        max_ongoing_requests=app.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": app.ingress.num_cpus},
    )
    # The front holds no request state and does little work per request: no CPU reserved (like Serve's proxies).
    ingress = serve.deployment(IngressDeployment).options(
        name="ingress",
        num_replicas=app.ingress.replicas,
        max_ongoing_requests=app.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(args, scheduler.bind(args, *pools))
