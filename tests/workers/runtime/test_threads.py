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


def test_the_containers_cpu_list_is_its_cpuset_cut_to_its_quota_not_this_processs_affinity(tmp_path):
    (tmp_path / "cpuset.cpus.effective").write_text("0-3,6\n")
    assert threads.container_cpu_list(str(tmp_path)) == [0, 1, 2, 3, 6]
    (tmp_path / "cpu.max").write_text("200000 100000\n")  # 2 CPUs of quota
    assert threads.container_cpu_list(str(tmp_path)) == [0, 1]
    bare = tmp_path / "bare"
    bare.mkdir()
    import os

    assert threads.container_cpu_list(str(bare)) == list(range(os.cpu_count()))


def test_the_serving_processes_keep_the_first_cpu_and_a_target_the_rest():
    assert threads.cpu_split([2, 3, 5]) == ([2], [3, 5])
    assert threads.cpu_split([0, 1]) == ([0], [1])
    assert threads.cpu_split([4]) is None  # one CPU: nothing to bind


def test_binding_a_process_binds_every_thread_of_it_and_later_ones():
    import os
    import subprocess
    import sys

    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = (
        "import os, threading, time\n"
        "from specserve.workers.runtime.threads import bind_process\n"
        "started = threading.Thread(target=time.sleep, args=(2,)); started.start()\n"
        f"bind_process([{cpu}])\n"
        "later = threading.Thread(target=time.sleep, args=(1,)); later.start()\n"
        "tids = os.listdir('/proc/self/task')\n"
        "print(sorted({frozenset(os.sched_getaffinity(int(t))) == {%d} for t in tids}), len(tids))\n" % cpu
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[True]", "3"]  # the main thread, the one started before and the one after
