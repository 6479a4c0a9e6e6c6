"""The worker registry alone: membership, versions, heartbeats and expiry."""

import pytest

from specserve.cluster.registry import WorkerRegistry


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_register_is_idempotent_and_versions_change_only_on_changes():
    reg = WorkerRegistry()
    v1 = reg.register("m", "target", "t1", "h:1")
    assert reg.register("m", "target", "t1", "h:1") == v1  # a heartbeat
    v2 = reg.register("m", "draft", "d1", "h:2")
    assert v2 > v1
    version, rows = reg.members("m")
    assert version == v2 and [r["worker_id"] for r in rows] == ["d1", "t1"]
    assert reg.members("other")[1] == []
    assert reg.unregister("d1") > v2 and [r["worker_id"] for r in reg.members()[1]] == ["t1"]
    with pytest.raises(ValueError, match="kind"):
        reg.register("m", "oracle", "x", "h:3")


def test_members_that_stop_heartbeating_expire():
    clock = Clock()
    reg = WorkerRegistry(ttl_s=30, clock=clock)
    reg.register("m", "target", "t1", "h:1")
    reg.register("m", "target", "t2", "h:2")
    clock.now = 20
    reg.register("m", "target", "t2", "h:2")
    clock.now = 40
    assert [r["worker_id"] for r in reg.members()[1]] == ["t2"]
