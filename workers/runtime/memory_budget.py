"""How many positions a worker's KV buffers may hold: sized from the device's memory after the weights load, as
vLLM sizes its KV cache (`gpu_memory_utilization` on CUDA after a profiling forward; a fixed space on a CPU,
VLLM_CPU_KVCACHE_SPACE), unless the settings name a budget in bytes or a capacity in positions."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.workers.config.settings import KVCacheConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_SHARE = 0.25  # of the memory available at start, at most, for a CPU worker's KV cache
LEFT_FREE = 0.05  # of the GPU, always left free when a worker sizes its KV cache (kernels' workspaces, HF rows)


@dataclass(frozen=True)
class KVBudget:
    capacity_tokens: int  # positions the KV arena holds (kv_arena.py)
    capacity_bytes: int
    source: str  # what set it, for the log and status


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo; the physical memory where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cuda_kv_bytes(device: torch.device, utilization: float, profile: Callable[[], None], weights_bytes: int) -> int:
    """What `utilization` of the GPU leaves for this worker's KV cache once its own weights and the activations of
    its largest forward (`profile()` runs it) are counted: vLLM's per-instance rule, so two workers at 0.45 share
    one GPU whatever the other holds. Never more than is free on the device less LEFT_FREE of it (what else the
    process runs: kernels' workspaces, a runner beside it, HF's rows), with a warning naming the setting when that
    binds."""
    gc.collect()  # a dropped runner's arena goes back to the device before the device is asked
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile()
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    asked = int(total * utilization) - weights_bytes - activations
    room = free - activations - int(LEFT_FREE * total)
    if asked > room:
        log.warning("gpu_memory_utilization %.2f asks %.2f GiB for the KV cache but %.2f GiB of the GPU is free: "
                    "taking %.2f GiB (other workers or processes hold the rest; lower gpu_memory_utilization per "
                    "worker or set kv_cache_memory_bytes)", utilization, asked / GIB, free / GIB,
                    max(room, 0) / GIB)  # fmt: skip
        return room
    return asked


def kv_budget(config: KVCacheConfig, device: torch.device, bytes_per_token: int,
              profile: Callable[[], None] | None = None, weights_bytes: int = 0) -> KVBudget:  # fmt: skip
    """The worker's KV capacity: capacity_tokens when set; else the bytes kv_cache_memory_bytes names, or on CUDA
    what gpu_memory_utilization leaves after this worker's weights (`weights_bytes`) and activations, or on a CPU
    cpu_kv_cache_space_gib within a quarter of the available memory; in positions of `bytes_per_token`."""
    if config.capacity_tokens is not None:
        return KVBudget(config.capacity_tokens, config.capacity_tokens * bytes_per_token, "kv_cache.capacity_tokens")
    if config.kv_cache_memory_bytes is not None:
        budget, source = config.kv_cache_memory_bytes, "kv_cache.kv_cache_memory_bytes"
    elif device.type == "cuda":
        budget = cuda_kv_bytes(device, config.gpu_memory_utilization, profile or (lambda: None), weights_bytes)
        source = f"gpu_memory_utilization {config.gpu_memory_utilization}"
    else:
        budget = min(int(config.cpu_kv_cache_space_gib * GIB), int(CPU_SHARE * available_ram_bytes()))
        source = f"cpu_kv_cache_space_gib {config.cpu_kv_cache_space_gib} (a quarter of available memory at most)"
    tokens = budget // max(1, bytes_per_token)
    if tokens <= 0:
        raise MemoryError(f"no memory left for the KV cache ({budget / GIB:.2f} GiB by {source}): lower the weights' "
                          "footprint or raise the budget")  # fmt: skip
    log.debug("KV cache: %.2f GiB (%s), %d positions of %d bytes", budget / GIB, source, tokens, bytes_per_token)
    return KVBudget(tokens, tokens * bytes_per_token, source)
