"""The worker registry alone: membership, versions, heartbeats and expiry; its restart (Ray re-running the
constructor with the same arguments) keeps the secret, and a scheduler polling it keeps its workers meanwhile; the
scheduler replicas' prefix records pass through it, so that a request finds its history from any replica."""

import asyncio

import pytest

from specserve.cluster.serve.registry import WorkerRegistry


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


def test_draining_reaches_every_poller_and_running_requests_are_counted_per_replica():
    clock = Clock()
    reg = WorkerRegistry(ttl_s=30, clock=clock)
    assert reg.snapshot("s1", 3)["draining"] is False
    reg.snapshot("s2", 2)
    assert reg.active_requests() == 5
    reg.set_draining()
    assert reg.snapshot("s1", 1)["draining"] is True and reg.active_requests() == 3
    clock.now = 31  # s2 stopped reporting: its replica is gone, its requests with it
    assert reg.snapshot("s1", 0)["draining"] is True and reg.active_requests() == 0
    reg.set_draining(False)
    assert reg.snapshot()["draining"] is False


def test_a_restarted_registry_keeps_the_secret_it_was_created_with():
    first = WorkerRegistry(secret="s3cret")
    again = WorkerRegistry(secret="s3cret")  # what Ray runs on restart: the same constructor arguments
    assert first.secret() == again.secret() == "s3cret"
    assert first.incarnation != again.incarnation  # pollers can tell, since versions count again from 0
    assert WorkerRegistry().secret() != WorkerRegistry().secret()  # without one, a fresh random secret
    assert len(WorkerRegistry().secret()) >= 32


def test_registry_actor_passes_a_fresh_secret_to_the_constructor(monkeypatch):
    import ray

    from specserve.cluster.serve import registry

    created = {}

    class Options:
        def options(self, **options):
            created["options"] = options
            return self

        def remote(self, **kwargs):
            created["kwargs"] = kwargs

    monkeypatch.setattr(ray, "remote", lambda cls: Options())
    registry.registry_actor("app")
    assert created["options"]["max_restarts"] == -1 and created["options"]["get_if_exists"] is True
    assert len(created["kwargs"]["secret"]) >= 32


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class _Handle:
    """What a Ray actor handle looks like to SchedulerReplica: method.remote(...) awaitables."""

    def __init__(self, registry: WorkerRegistry):
        self.snapshot = _Method(registry.snapshot)
        self.share_prefixes = _Method(registry.share_prefixes)


def test_scheduler_keeps_its_workers_while_a_restarted_registry_relearns_them(tiny_target):
    from specserve.cluster.serve.scheduler_replica import REJOIN_S, SchedulerReplica

    clock = Clock()
    args = {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu"}]}
    replica = SchedulerReplica(args)
    addresses = replica.serving.models["tiny"].addresses

    async def main():
        before = WorkerRegistry(secret="s", clock=clock)
        clock.now = 100.0
        before.register("tiny", "target", "t1", "127.0.0.1:1")
        before.register("tiny", "target", "t2", "127.0.0.1:2")
        replica.registry = _Handle(before)
        await replica._poll_once()
        seen = [dict(addresses)]
        after = WorkerRegistry(secret="s", clock=clock)  # restarted at t=100: knows nobody yet
        replica.registry = _Handle(after)
        await replica._poll_once()
        seen.append(dict(addresses))
        after.register("tiny", "target", "t1", "127.0.0.1:1")  # heartbeats arrive; t2's replica died meanwhile
        after.register("tiny", "target", "t3", "127.0.0.1:3")  # version 2 again, as before the restart
        await replica._poll_once()
        seen.append(dict(addresses))
        clock.now = 100.0 + REJOIN_S + 1
        await replica._poll_once()
        seen.append(dict(addresses))
        return seen

    seen = asyncio.run(main())
    assert sorted(seen[0]) == ["t1", "t2"]
    assert sorted(seen[1]) == ["t1", "t2"]  # nobody dropped by an empty, just-restarted registry
    assert sorted(seen[2]) == ["t1", "t2", "t3"]  # a new worker joins at once
    assert sorted(seen[3]) == ["t1", "t3"]  # past the rejoin window the registry's view is the truth


def test_prefix_records_reach_the_other_replicas_once_and_the_log_is_bounded(monkeypatch):
    from specserve.cluster.serve import registry as module

    monkeypatch.setattr(module, "PREFIX_LOG_MAX", 3)
    reg = WorkerRegistry()
    newest, theirs = reg.share_prefixes("a", {"m": [("target", "t1", [1, 2])]}, 0)
    assert (newest, theirs) == (1, {})  # its own are not sent back
    newest, theirs = reg.share_prefixes("b", {"m": [("draft", "d1", [3])]}, 0)
    assert newest == 2 and theirs == {"m": [("target", "t1", [1, 2])]}
    assert reg.share_prefixes("b", {}, newest) == (2, {})  # nothing new since
    reg.share_prefixes("a", {"m": [("target", "t1", [4]), ("target", "t2", [5]), ("target", "t1", [6])]}, 1)
    assert reg.share_prefixes("b", {}, 0)[1]["m"] == [("target", "t1", [4]), ("target", "t2", [5]),
                                                      ("target", "t1", [6])]  # fmt: skip # the newest 3 only


def test_a_turn_routed_to_another_scheduler_replica_goes_where_its_history_is(tiny_target):
    """Replica a ran turn 1 on target t2; Serve routes turn 2 to replica b, which learnt it from a's records at
    their polls, and places it on t2 though t1 is as loaded."""
    from specserve.cluster.serve.scheduler_replica import SchedulerReplica
    from specserve.workers.config.request import SamplingParams, SpecParams

    args = {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu"}]}
    reg = WorkerRegistry(secret="s")
    reg.register("tiny", "target", "t1", "127.0.0.1:1")
    reg.register("tiny", "target", "t2", "127.0.0.1:2")
    a, b = SchedulerReplica(args), SchedulerReplica(args)
    history = [3 + (7 * i) % 200 for i in range(160)]
    spec = SpecParams(method="none")

    async def main():
        for replica in (a, b):
            replica.registry = _Handle(reg)
            await replica._poll_once()
        scheduler = a.serving.models["tiny"].scheduler
        scheduler.add([1, 2], SamplingParams(), spec, frozenset())  # t1 busy: turn 1 goes to t2
        turn_1 = scheduler.add(history, SamplingParams(), spec, frozenset())
        turn_1.told["t2"] = history + [5, 6]
        scheduler.release(turn_1)
        for replica in (a, b):
            await replica._poll_once()
        return b.serving.models["tiny"].scheduler.add(history + [5, 6, 7, 8], SamplingParams(), spec, frozenset())

    turn_2 = asyncio.run(main())
    assert turn_2.target_worker == "t2"
    assert b.serving.models["tiny"].scheduler.prefixes.affinity["target"].placed == 1
