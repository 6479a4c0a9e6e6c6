"""The torch threads a worker's forwards get (workers/runtime/threads.py)."""

import pytest

from specserve.workers.runtime import threads


@pytest.mark.parametrize(
    ("cpus", "tp", "expected"),
    [(2, 1, 1), (1, 1, 1), (8, 1, 7), (9, 2, 4), (3, 4, 1)],
)
def test_a_cpu_target_uses_the_containers_cpus_but_one_split_between_its_ranks(monkeypatch, cpus, tp, expected):
    monkeypatch.setattr(threads, "container_cpus", lambda: cpus)
    assert threads.worker_threads("auto", "target", "cpu", 0.5, tp) == expected


@pytest.mark.parametrize(("reserved", "expected"), [(0.5, 1), (1.0, 1), (2.0, 2), (3.7, 3)])
def test_drafts_and_gpu_targets_keep_rays_count(monkeypatch, reserved, expected):
    monkeypatch.setattr(threads, "container_cpus", lambda: 16)
    assert threads.worker_threads("auto", "draft", "cpu", reserved, 1) == expected
    assert threads.worker_threads("auto", "target", "cuda", reserved, 1) == expected


def test_an_explicit_count_wins(monkeypatch):
    monkeypatch.setattr(threads, "container_cpus", lambda: 16)
    assert threads.worker_threads(3, "target", "cpu", 0.5, 2) == 3
    assert threads.worker_threads(5, "draft", "cpu", 1.0, 1) == 5


def test_the_cgroup_quota_is_read_from_v2_then_v1(tmp_path):
    assert threads.cgroup_quota_cpus(str(tmp_path)) is None  # no cgroup files: no quota
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_quota_cpus(str(tmp_path)) == 2.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_quota_cpus(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_quota_cpus(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_quota_cpus(str(tmp_path)) is None


def test_the_container_cpus_are_at_most_the_affinity_and_the_quota_rounded_up(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "cgroup_quota_cpus", lambda: 1.5)
    assert threads.container_cpus() == 2
    monkeypatch.setattr(threads, "cgroup_quota_cpus", lambda: None)
    assert threads.container_cpus() == 4
    monkeypatch.setattr(threads, "cgroup_quota_cpus", lambda: 0.25)
    assert threads.container_cpus() == 1


def test_use_threads_sets_torchs_count():
    import torch

    before = torch.get_num_threads()  # 1: tests/conftest.py sets it, so each call below must change the count
    try:
        for n in (before + 1, before):
            threads.use_threads(n)
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)
