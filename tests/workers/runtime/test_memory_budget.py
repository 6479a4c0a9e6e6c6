"""A worker's KV capacity from its memory budget (workers/runtime/memory_budget.py): a capacity or a byte budget the
settings name; on a CPU the space asked within a quarter of the available memory; on CUDA what
gpu_memory_utilization leaves after the weights, other processes and the largest forward's activations."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig
from specserve.workers.runtime import memory_budget
from specserve.workers.runtime.memory_budget import GIB, kv_budget

CPU = torch.device("cpu")


def test_named_capacity_or_bytes_win():
    assert kv_budget(KVCacheConfig(capacity_tokens=1000), CPU, 64).capacity_bytes == 64_000
    budget = kv_budget(KVCacheConfig(kv_cache_memory_bytes=1 << 20), CPU, 100)
    assert budget.capacity_tokens == (1 << 20) // 100 and "kv_cache_memory_bytes" in budget.source


def test_a_cpu_takes_its_space_within_a_quarter_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(memory_budget, "available_ram_bytes", lambda: 64 * GIB)
    assert kv_budget(KVCacheConfig(), CPU, 1024).capacity_tokens == 4 * GIB // 1024
    monkeypatch.setattr(memory_budget, "available_ram_bytes", lambda: 8 * GIB)
    assert kv_budget(KVCacheConfig(cpu_kv_cache_space_gib=6), CPU, 1024).capacity_tokens == 2 * GIB // 1024
    assert memory_budget.available_ram_bytes.__module__ and memory_budget.available_ram_bytes() > 0


def test_cuda_leaves_room_for_the_weights_others_and_the_largest_forward(monkeypatch):
    allocated = {"now": 10 * GIB, "peak": 10 * GIB}

    def profile():
        allocated["peak"] = allocated["now"] + 3 * GIB  # the profiling forward's activations

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))  # 20 GiB used: weights, others
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    budget = kv_budget(KVCacheConfig(), torch.device("cuda", 0), 2048, profile=profile)
    assert budget.capacity_bytes == pytest.approx(int(80 * GIB * 0.9) - 20 * GIB - 3 * GIB, abs=2048)
    with pytest.raises(MemoryError, match="no memory left for the KV cache"):
        kv_budget(KVCacheConfig(gpu_memory_utilization=0.2), torch.device("cuda", 0), 2048, profile=profile)
