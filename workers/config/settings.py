"""Settings, as opposed to a request's parameters (request.py): how a worker hosts its model (`ModelConfig`), its KV
cache (`KVCacheConfig`) and continuous batching (`BatchingConfig`), and prompt lookup's n-gram sizes (`NgramConfig`).
The Serve app's settings (cluster/app_config.py) hold them per pool and per model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from specserve.workers.config.strict import StrictModel


class ModelConfig(StrictModel):
    """Where a model lives and how to host it."""

    path: str = Field(..., min_length=1, description="Local directory of a Hugging Face causal LM and its tokenizer.")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Weights and activations dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="auto = cuda when available, else cpu.")
    packed_linears: bool = Field(
        True,
        description="float32 on a CPU: run the linear layers on oneDNN's prepacked weights (faster for the one- and "
        "few-position forwards of decoding and verification; the model's parameters then omit the packed layers' "
        "original weights); false: PyTorch's default kernels.",
    )
    enforce_eager: bool = Field(
        False, description="On CUDA, run every forward pass eagerly (vLLM's enforce_eager); by default a batch that "
        "fits a bucket (up to 64 rows of 16 new positions over 8,192 attended) replays a CUDA graph captured for it."
    )  # fmt: skip


class KVCacheConfig(StrictModel):
    """The memory of a worker's KV cache, and prefix caching."""

    capacity_tokens: int | None = Field(
        None, gt=0, description="Positions the worker's KV arena holds, in all (each request's run of 16-position "
        "blocks counts what it reserves): unset, as many as the memory budget holds (below)."
    )  # fmt: skip
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="The KV cache's memory budget in bytes on any device, as vLLM's "
        "kv_cache_memory_bytes (overrides gpu_memory_utilization and cpu_kv_cache_space_gib)."
    )  # fmt: skip
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="On CUDA, the share of the GPU's memory this worker may use (vLLM's, per "
        "instance: two workers at 0.45 share one GPU): the KV cache gets what is left of it after the worker's "
        "weights and its largest batch's activations (measured once after loading), never more than is free."
    )  # fmt: skip
    cpu_kv_cache_space_gib: float = Field(
        4.0, gt=0, description="On a CPU, the KV cache's budget in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE), at most a "
        "quarter of the memory available when the worker starts."
    )  # fmt: skip
    prefix_caching: bool = Field(
        True, description="Keep a finished request's cache for later requests that start with the same tokens (a "
        "conversation's next turn, a shared system prompt), as vLLM's enable_prefix_caching: within the capacity, "
        "least recently used first out."
    )  # fmt: skip


class BatchingConfig(StrictModel):
    """Continuous batching on a worker: calls that arrive while a forward pass runs join the next one."""

    max_batch_size: int = Field(32, gt=0, le=4096, description="Most requests in one forward pass.")
    max_batch_tokens: int = Field(
        4096,
        gt=0,
        description="Most new positions one batch may feed (prefills count their whole uncached prompt); a single "
        "call larger than this still runs, alone.",
    )
    max_padding_per_row: int = Field(
        8,
        ge=0,
        description="Where a worker pads its rows to the batch's widest (an EAGLE-3 head's drafting), a pass computes "
        "rows x widest positions: a call joins a batch only while the padding stays within this many positions per "
        "row or half the batch's real positions. Target workers and draft models run packed passes (no padding): a "
        "prompt's chunk joins decoding rows there.",
    )
    max_context_padding_per_row: int = Field(
        512,
        ge=0,
        description="Where a worker pads its rows (an EAGLE-3 head's drafting attends over every row's entries "
        "right-padded to the longest row's), a call joins a batch only while the padded entries stay within this many "
        "a row or half the batch's real entries: a long prompt's request drafts apart from short chats, whose steps "
        "would otherwise each attend over its thousands of entries.",
    )
    max_wait_ms: float = Field(
        50.0,
        ge=0,
        description="How long a batch may wait for the requests expected back with their next round (by their "
        "measured return times: a plain step's few ms, a draft call's tens), at most the previous batch's run time; 0 "
        "runs whatever is queued at once. Without it, requests that once fell out of step split into batches that "
        "alternate for good.",
    )
    prefill_wait_ms: float = Field(
        150.0,
        ge=0,
        description="How long a batch holding a prompt's positions (a long prompt's chunk, a new request's prompt, "
        "a chunk fed to a draft worker) may wait for the decoding requests expected back, at most the previous "
        "batch's run time: their rounds ride in its pass instead of waiting it out and then running their own.",
    )


class NgramConfig(StrictModel):
    """Prompt-lookup drafting: match the last n tokens against earlier text and propose what followed."""

    max_ngram: int = Field(4, gt=0, le=16, description="Longest suffix n-gram to look up.")
    min_ngram: int = Field(1, gt=0, le=16, description="Shortest suffix n-gram to look up.")
