"""Tiny real models for tests, made from configs (no hub, no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig
from specserve.workers.models import packaged_heads
from specserve.workers.speculation import engine as engine_module
from tests.helpers.sampler_pool import close_sampler_pool
from tests.helpers.workers import save_chatty_target, save_tiny_llama

# Keep tests quiet and single-threaded per process: CI has 2 cores and Ray tests start several processes.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Serve kills a proxy that is not ready within 5 s (three times in a row) and the test's serve.start then fails with
# ActorDiedError; on 2 busy cores a proxy start took longer. Ray processes inherit this from the driver.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
if torch.cuda.is_available():
    # A test builds several runners in one process (a module's engines stay alive together): each takes 2% of the
    # GPU here, not a worker's 0.9 or an in-process engine's 0.4.
    KVCacheConfig.model_fields["gpu_memory_utilization"].default = 0.02
    KVCacheConfig.model_rebuild(force=True)
    engine_module.IN_PROCESS_GPU_SHARE = 0.02


@pytest.fixture(scope="session", autouse=True)
def _sampler_processes():
    """The statistical tests' sampling processes (tests/helpers/sampler_pool.py) close with the session."""
    yield
    close_sampler_pool()


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    """Each device this machine has: CI (no GPU) runs the tests that take it on cpu; a GPU machine runs them on cuda
    as well, so the cuda path is checked by the same assertions."""
    return request.param


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_target(models_dir) -> str:
    return save_tiny_llama(models_dir / "target", seed=0, layers=2, hidden=48)


@pytest.fixture(scope="session")
def tiny_draft(models_dir) -> str:
    # A different seed: a poor draft, so rejections (recovered tokens) are exercised on every prompt.
    return save_tiny_llama(models_dir / "draft", seed=1, layers=1, hidden=32, vocab_pad=5)


@pytest.fixture(scope="session")
def tiny_vocab_target(models_dir) -> str:
    return save_tiny_llama(models_dir / "tv_target", seed=10, layers=1, hidden=16, tiny_vocab=True, init_range=0.5)


@pytest.fixture(scope="session")
def tiny_vocab_draft(models_dir) -> str:
    return save_tiny_llama(models_dir / "tv_draft", seed=11, layers=1, hidden=16, tiny_vocab=True, init_range=0.5)


@pytest.fixture(scope="module")
def chatty_target(tmp_path_factory) -> str:
    """A tiny target that chats (tests.helpers.workers.save_chatty_target), built once per module that asks."""
    return save_chatty_target(tmp_path_factory.mktemp("eagle") / "target")


@pytest.fixture
def heads_dir(tmp_path, monkeypatch):
    """An empty directory of packaged EAGLE-3 heads in place of the package's own."""
    heads = tmp_path / "eagle_heads"
    monkeypatch.setattr(packaged_heads, "HEADS_DIR", heads)
    packaged_heads.packaged_heads.cache_clear()
    yield heads
    packaged_heads.packaged_heads.cache_clear()
