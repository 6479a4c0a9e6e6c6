"""Builds the distributed deployment on a Ray cluster: `ray.remote` is applied here, with resources chosen from what
the cluster offers, so the actor bodies in cluster/pools/actors.py stay plain classes."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import ray

from specserve.cluster.config import DisaggregatedConfig, PoolConfig
from specserve.cluster.pools.actors import DraftWorkerActor, SchedulerActor, TargetWorkerActor


def actor_options(pool: PoolConfig) -> dict:
    """Ask for the pool's custom resource when the cluster has it (draft_gpu / target_gpu nodes), else a GPU when
    the model runs on CUDA, else plain CPUs: the same config runs on a laptop and on a KubeRay cluster."""
    available = ray.cluster_resources()
    options: dict = {"num_cpus": pool.num_cpus, "max_restarts": pool.max_restarts}
    if available.get(pool.resource, 0) > 0:
        options["resources"] = {pool.resource: 1}
    elif pool.model.device == "cuda" and available.get("GPU", 0) > 0:
        options["num_gpus"] = 1
    return options


def tensor_parallel_options(pool: PoolConfig, options: dict) -> dict:
    """A tensor-parallel worker gets its own STRICT_PACK placement group, one bundle per rank; the worker actor is
    rank 0 in bundle 0 and places its follower ranks in the others."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": options["num_cpus"], **options.get("resources", {})}
    if options.get("num_gpus"):
        bundle["GPU"] = options["num_gpus"]
    pg = placement_group([dict(bundle) for _ in range(pool.tensor_parallel_size)], strategy="STRICT_PACK")
    return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}


def _pool_actor_options(pool: PoolConfig) -> dict:
    options = actor_options(pool)
    return tensor_parallel_options(pool, options) if pool.tensor_parallel_size > 1 else options


@dataclass
class Deployment:
    scheduler: ray.actor.ActorHandle
    drafts: dict[str, ray.actor.ActorHandle]
    targets: dict[str, ray.actor.ActorHandle]
    draft_addresses: dict[str, str]
    target_addresses: dict[str, str]

    def shutdown(self) -> None:
        for handle in (self.scheduler, *self.drafts.values(), *self.targets.values()):
            ray.kill(handle, no_restart=True)


def target_vocab_size(config: DisaggregatedConfig) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.target.model.path, local_files_only=True).get_text_config().vocab_size


def _start(handles: dict[str, ray.actor.ActorHandle], timeout_s: float, secret: str) -> dict[str, str]:
    addresses = ray.get([h.start.remote(secret) for h in handles.values()], timeout=timeout_s)
    return dict(zip(handles, addresses, strict=True))


def deploy(config: DisaggregatedConfig, timeout_s: float = 300.0) -> Deployment:
    """Start the target pool, the draft pool and the scheduler; returns once every gRPC server is up."""
    target_cls = ray.remote(TargetWorkerActor)
    draft_cls = ray.remote(DraftWorkerActor)
    targets = {
        f"target-{i}": target_cls.options(**_pool_actor_options(config.target)).remote(config.target, config.eagle_head)
        for i in range(config.target.replicas)
    }
    drafts = {}
    if config.draft is not None:
        vocab = target_vocab_size(config)
        drafts = {
            f"draft-{i}": draft_cls.options(**_pool_actor_options(config.draft)).remote(
                config.draft, vocab, config.eagle_head
            )
            for i in range(config.draft.replicas)
        }
    secret = secrets.token_urlsafe(32)  # worker ports accept only this deployment's scheduler
    target_addresses = _start(targets, timeout_s, secret)
    draft_addresses = _start(drafts, timeout_s, secret)
    scheduler = (
        ray.remote(SchedulerActor)
        .options(num_cpus=0)
        .remote(config, draft_addresses, target_addresses, {**drafts, **targets}, secret)
    )
    return Deployment(scheduler, drafts, targets, draft_addresses, target_addresses)
