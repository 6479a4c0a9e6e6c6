"""The Ray Serve application: a draft pool and a target pool deployment per served model (pool_worker.py), a
scheduler deployment that runs requests' rounds against them (scheduler_replica.py), and an ingress deployment that
answers the public SpecServe gRPC service and the OpenAI-compatible HTTP API and hands each request to a scheduler
replica through a deployment handle (ingress.py).

`build_app(args)` is the import path of the Serve config file (`serve run`, `serve deploy`, RayService
serveConfigV2); `specserve serve` calls it too.
"""

from __future__ import annotations

from ray import serve

from specserve.cluster.app_config import AppConfig, app_config
from specserve.cluster.serve.ingress import IngressDeployment
from specserve.cluster.serve.pool_worker import PoolWorker
from specserve.cluster.serve.prepare import MAX_NEW_TOKENS
from specserve.cluster.serve.scheduler_replica import SchedulerReplica
from specserve.protos.wire import MAX_FEATURE_BYTES


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
    call needs (a whole context's token ids, at most 5 bytes each, and a round's sparse draft distributions or an
    EAGLE-3 head's block of features)."""
    limits = app.limits
    rest = max(1 << 20, MAX_FEATURE_BYTES + (64 << 10))  # features: their data and a little framing
    new_tokens = limits.max_new_tokens or MAX_NEW_TOKENS  # no cap: the most a context may still hold
    return max(limits.max_grpc_message_bytes, 5 * (limits.max_prompt_tokens + new_tokens) + rest)


def build_app(args: dict | AppConfig | None = None):
    """The Serve application for `args` (an AppConfig or its dict; the Serve config file's `args`)."""
    app = app_config(args or {})
    pools = []
    message_bytes = worker_message_bytes(app)
    for m in app.models:
        model = m.model_dump(mode="json")
        if len(app.models) > 1:  # several target workers would share the one set of bound CPUs (`cpu_binding`)
            model["target_pool"]["cpu_binding"] = "off"
        pools.append(serve.deployment(PoolWorker).options(**_pool_options(f"target-{m.name}", m.target_pool))
                     .bind(model, "target", message_bytes))  # fmt: skip
        if m.drafts_with_model:
            pools.append(serve.deployment(PoolWorker).options(**_pool_options(f"draft-{m.name}", m.draft_pool))
                         .bind(model, "draft", message_bytes))  # fmt: skip
    args = app.model_dump(mode="json")
    scheduler = serve.deployment(SchedulerReplica).options(
        name="scheduler",
        num_replicas=app.scheduler.replicas,
        max_ongoing_requests=app.scheduler.serve_max_ongoing_requests,
        # Serve's caller-side queue holds requests while its router picks a replica: a burst of 512 at once overran a
        # queue of 64 there (2 spurious 429s); as large as the replica's bound, it refuses only past it.
        max_queued_requests=app.scheduler.serve_max_ongoing_requests,
        ray_actor_options={"num_cpus": app.scheduler.num_cpus},
        graceful_shutdown_timeout_s=app.scheduler.drain_timeout_s,  # a stopping replica finishes its streams
        graceful_shutdown_wait_loop_s=1.0,
    )
    # The front holds no request state and does little work per request: no CPU reserved (like Serve's proxies).
    ingress = serve.deployment(IngressDeployment).options(
        name="ingress",
        num_replicas=app.scheduler.replicas,
        max_ongoing_requests=app.scheduler.serve_max_ongoing_requests,
        max_queued_requests=app.scheduler.serve_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=app.scheduler.drain_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
    )
    return ingress.bind(args, scheduler.bind(args, *pools))
