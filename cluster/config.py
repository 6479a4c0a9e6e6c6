"""Validated configuration of a distributed deployment: the draft and target pools and the scheduler."""

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


class DisaggregatedConfig(BaseModel):
    """Disaggregated speculative decoding: separate draft and target pools driven by one scheduler."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: PoolConfig = Field(..., description="Target workers (large models, big GPUs).")
    draft: PoolConfig | None = Field(None, description="Draft workers (small models, cheap GPUs); None: n-gram only.")
    eagle_head: str | None = Field(
        None, description="An EAGLE-3 head directory: the draft workers draft with it (their model is then the target, "
        "whose config and input embedding the head reads) and the target workers capture the features it reads."
    )  # fmt: skip
    predraft: bool = Field(True, description="Within-request pipelining: draft round r+1 while round r verifies.")
    call_timeout_s: float = Field(60.0, gt=0, description="Deadline of every scheduler -> worker call.")
    restart_timeout_s: float = Field(120.0, gt=0, description="How long to wait for a restarted worker.")


def local_config(
    target_path: str,
    draft_path: str | None,
    device: str = "auto",
    dtype: str = "float32",
    eagle_head: str | None = None,
) -> DisaggregatedConfig:
    """One draft and one target worker on this machine, asking for the default custom resources. With `eagle_head`
    (and no draft_path) the draft worker drafts with that head."""
    target = PoolConfig(model=ModelConfig(path=target_path, device=device, dtype=dtype), resource="target_gpu")
    draft_model = target_path if eagle_head else draft_path
    draft = None
    if draft_model:
        draft = PoolConfig(model=ModelConfig(path=draft_model, device=device, dtype=dtype), resource="draft_gpu")
    return DisaggregatedConfig(target=target, draft=draft, eagle_head=eagle_head)
