"""How many CPU threads a worker's forward passes use.

Ray gives an actor as many OpenMP threads as the whole CPUs it reserves, at least one. A reservation is a placement
hint: a target replica that reserves 1 CPU (the default) or 0.5 (to fit a whole app on 2 cores) would verify on one
thread while the machine's other cores idle, and the target's forward is the critical path of every round (measured
on SmolLM2, 2 cores: served speculation-off decoding ran at 0.55x the in-process rate for exactly this reason).

But a forward on several threads stalls at every parallel region's barrier whenever another process takes one of its
cores, and a served round wakes several (the scheduler, the ingress, Serve's proxy, Ray's own): measured on 2 cores,
a process busy 1 ms in 11 slowed a 2-thread in-process forward from 42 to 56 ms, and the served target on 2 threads
decoded at 11.6 tok/s against 14.1 tok/s on one (in-process: 23.4 on two, 16.0 on one). So a target worker on a CPU
uses every core its container may use but one, which it leaves to the serving processes, split between its
tensor-parallel ranks, unless its pool says otherwise; a draft worker keeps Ray's count, so drafting beside the
target does not oversubscribe the cores (on CPU a draft pass is too small to gain from more threads). Several target
replicas sharing one machine should set `threads` explicitly.

Leaving a core is not keeping it: the kernel moves the target's forward onto the core a serving process just woke
on, and the worker's own gRPC threads hop between them. So where one target worker serves on a CPU machine (a pool
of one replica and one rank, `threads` and `cpu_binding` auto), its process is bound to every CPU but the first
(`cpu_split`, `bind_process`), as vLLM's CPU backend binds its threads to cores; the serving processes stay free to
use any core. Measured (demo family, 2 cores, served speculation off at one stream, bindings toggled on the running
app, results/2026-11-28-1250-demo-cpu-binding): served overhead 6.9-7.8 ms a token unbound, 4.3-5.8 with the target
bound. Binding the serving processes to the first CPU as well cut it to 3.8-4.7 at one stream, but at four streams
they need more than one core (speculation off 0.86x, the default 0.77x of unbound): not done.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Literal

log = logging.getLogger(__name__)

Threads = int | Literal["auto"]


def cgroup_quota_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The container's CPU quota (cgroup v2 cpu.max, else v1's cfs quota) in CPUs, or None without one."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def container_cpus() -> int:
    """The CPUs this process may run on: its affinity, limited by its container's CPU quota (a Kubernetes limit),
    at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_quota_cpus()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def container_cpu_list(root: str = "/sys/fs/cgroup") -> list[int]:
    """The CPUs this container may use, by number: its cgroup's cpuset (v2 `cpuset.cpus.effective`), else every CPU
    of the machine, at most its CPU quota's count. Not this process's affinity, which a binding narrows."""
    cpus = list(range(os.cpu_count() or 1))
    try:
        with open(os.path.join(root, "cpuset.cpus.effective")) as f:
            listed = _cpu_ranges(f.read())
        cpus = listed or cpus
    except (OSError, ValueError):
        pass
    quota = cgroup_quota_cpus(root)
    return cpus[: max(1, math.ceil(quota))] if quota is not None else cpus


def _cpu_ranges(text: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_split(cpus: list[int] | None = None) -> tuple[list[int], list[int]] | None:
    """(serving, model) CPUs: the first for the serving processes (Serve's proxy, the scheduler and ingress replicas,
    draft workers, Ray's own), every other for a lone target worker's forward; None with fewer than 2."""
    cpus = container_cpu_list() if cpus is None else cpus
    return (cpus[:1], cpus[1:]) if len(cpus) >= 2 else None


def bind_process(cpus: list[int]) -> None:
    """Run every thread of this process on `cpus` (threads started later inherit it from the thread starting them).
    A no-op where the OS has no per-thread affinity (not Linux)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended; a cpuset that forbids it
            continue


def worker_threads(setting: Threads, role: str, device: str, reserved_cpus: float, tensor_parallel_size: int) -> int:
    """The torch threads of a worker (one rank of it): `setting` when a number; for "auto", a CPU target's ranks
    share the container's CPUs but one, and everything else keeps Ray's count (its whole reserved CPUs, at least 1)."""
    if setting != "auto":
        return int(setting)
    if role == "target" and device == "cpu":
        return max(1, (container_cpus() - 1) // tensor_parallel_size)
    return max(1, int(reserved_cpus))


def use_threads(n: int) -> None:
    """Run this process's torch CPU work on `n` threads."""
    import torch

    if torch.get_num_threads() != n:
        log.info("torch CPU threads: %d (was %d)", n, torch.get_num_threads())
        torch.set_num_threads(n)
