"""A worker's KV capacity from its memory budget (workers/runtime/memory_budget.py): a capacity or a byte budget the
settings name; on a CPU the space asked within a quarter of the available memory; on CUDA what
gpu_memory_utilization leaves after the worker's own weights and largest forward's activations (per instance, as
vLLM's), never more than is free."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime import memory_budget
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.memory_budget import GIB, kv_budget
from specserve.workers.runtime.runner import ModelRunner

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


def _fake_cuda(monkeypatch, free_gib: float, total_gib: float = 80):
    """torch.cuda's memory queries, faked: `free_gib` free of `total_gib`, 10 GiB allocated in this process before
    the profiling forward, whose activations take 3 GiB."""
    allocated = {"now": 10 * GIB, "peak": 10 * GIB}

    def profile():
        allocated["peak"] = allocated["now"] + 3 * GIB

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (int(free_gib * GIB), int(total_gib * GIB)))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    return profile


CUDA = torch.device("cuda", 0)
WORKER = KVCacheConfig(gpu_memory_utilization=0.9)  # a worker's default, named: tests on a GPU lower the default


def test_cuda_counts_its_own_weights_and_activations_not_what_others_hold(monkeypatch):
    # 20 of 80 GiB used by another worker and this one's 2 GiB of weights: at 0.45 this worker still gets its share.
    profile = _fake_cuda(monkeypatch, free_gib=60)
    budget = kv_budget(KVCacheConfig(gpu_memory_utilization=0.45), CUDA, 2048, profile=profile, weights_bytes=2 * GIB)
    assert budget.capacity_bytes == pytest.approx(int(80 * GIB * 0.45) - 2 * GIB - 3 * GIB, abs=2048)
    # Alone on the GPU, the default 0.9 is what it gets.
    alone = kv_budget(WORKER, CUDA, 2048, profile=_fake_cuda(monkeypatch, free_gib=77.5), weights_bytes=2 * GIB)
    assert alone.capacity_bytes == pytest.approx(int(80 * GIB * 0.9) - 2 * GIB - 3 * GIB, abs=2048)


def test_cuda_takes_no_more_than_is_free_and_says_which_setting_asked_for_more(monkeypatch, caplog):
    profile = _fake_cuda(monkeypatch, free_gib=30)
    with caplog.at_level("WARNING", logger=memory_budget.__name__):
        budget = kv_budget(WORKER, CUDA, 2048, profile=profile, weights_bytes=2 * GIB)
    assert budget.capacity_bytes == pytest.approx(
        30 * GIB - 3 * GIB - int(memory_budget.LEFT_FREE * 80 * GIB), abs=2048
    )
    assert "gpu_memory_utilization 0.90" in caplog.text
    with pytest.raises(MemoryError, match="no memory left for the KV cache"):
        kv_budget(WORKER, CUDA, 2048, profile=_fake_cuda(monkeypatch, free_gib=5), weights_bytes=2 * GIB)
    with pytest.raises(MemoryError, match="no memory left for the KV cache"):
        kv_budget(KVCacheConfig(gpu_memory_utilization=0.05), CUDA, 2048, profile=profile, weights_bytes=2 * GIB)


def test_the_arena_allocated_up_front_leaves_no_request_behind_and_changes_no_logits(tiny_target, device):
    target = load_model(ModelConfig(path=tiny_target, device=device))
    early, lazy = ModelRunner(target, KVCacheConfig()), ModelRunner(target, KVCacheConfig())
    early.allocate_arena()
    # A GPU's runner holds its buffers from when it was built (its budget was measured then); a CPU's idle arena
    # gives its pages back (KVArena.reset).
    assert early.store.cache.allocated == lazy.store.cache.allocated == (device == "cuda")
    assert len(early.store) == 0 and early.store.cached_tokens == 0 and early.store.used_tokens == 0
    assert early.forward_calls == 0
    prompt = [3 + (5 * i) % 90 for i in range(40)]
    torch.testing.assert_close(early.logits_for("a", prompt, 3), lazy.logits_for("a", prompt, 3))


def test_the_passes_that_allocate_and_profile_memory_stay_inside_a_tiny_vocabulary(tiny_vocab_target, device):
    # On the H200 (2026-12-04) the profiling pass fed ids up to 102 to an 8-token model: a device-side assert that
    # failed every later test in the process. A CPU raises IndexError for the same ids.
    target = load_model(ModelConfig(path=tiny_vocab_target, device=device))
    runner = ModelRunner(target, KVCacheConfig())
    runner._profile_forward()
    runner.allocate_arena()
    assert runner.forward_calls == 0
    assert runner.logits_for("a", [1, 2, 3], 1).shape == (1, runner.vocab_size)
