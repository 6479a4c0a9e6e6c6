"""A worker pool's validated configuration as the worker bodies read it (cluster/pools/actors.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.workers.config import BatchingConfig, KVCacheConfig, ModelConfig


class PoolConfig(BaseModel):
    """A pool of identical workers hosting one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(..., description="The model every worker of the pool hosts.")
    replicas: int = Field(1, gt=0, le=1024, description="Workers in the pool.")
    resource: str = Field(..., min_length=1, description="Ray custom resource each worker asks for (one unit).")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per worker.")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="KV cache capacity per worker.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Continuous batching per worker.")
    max_restarts: int = Field(3, ge=-1, description="Times Ray restarts a dead worker (-1: always).")
    tensor_parallel_size: int = Field(1, gt=0, le=64, description="Ranks per worker (target pools).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per rank.")
    threads: Annotated[int, Field(gt=0, le=1024)] | Literal["auto"] = Field(
        "auto", description="torch CPU threads per rank (workers/runtime/threads.py); auto: a CPU target's ranks "
        "share the container's CPUs but one, a draft worker keeps Ray's count (its reserved CPUs)."
    )  # fmt: skip
