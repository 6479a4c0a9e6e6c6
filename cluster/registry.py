"""Where the scheduler finds the workers of the Serve pools.

Serve routes a deployment handle's calls to *some* replica; the scheduler needs *every* worker's own gRPC address,
because each worker holds the KV caches of specific requests. So each pool replica, once its gRPC server is up,
registers its address here, and each ingress replica polls the membership. A named Ray actor per application holds
it (`registry_actor`); the class itself is plain and unit-tested alone.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass

REGISTRY_NAMESPACE = "specserve"


@dataclass(frozen=True)
class Member:
    model: str
    kind: str  # "draft" | "target"
    worker_id: str  # the Serve replica id: stable for the replica's life, new for its replacement
    address: str  # host:port of its gRPC server


class WorkerRegistry:
    def __init__(self, ttl_s: float = 30.0, clock=time.monotonic):
        """ttl_s: a member that has not re-registered (heartbeat) for this long is dropped: its replica died
        without unregistering."""
        self.ttl_s = ttl_s
        self._clock = clock
        self._members: dict[str, Member] = {}
        self._seen: dict[str, float] = {}
        self.version = 0  # bumped on every change, so pollers can skip unchanged snapshots
        self._secret = secrets.token_urlsafe(32)

    def secret(self) -> str:
        """The app's worker secret: pool replicas require it on their gRPC ports, the ingress sends it. It lives
        only in this actor (reachable through Ray's authenticated control plane), never in a config file."""
        return self._secret

    def register(self, model: str, kind: str, worker_id: str, address: str) -> int:
        if kind not in ("draft", "target"):
            raise ValueError(f"kind must be 'draft' or 'target', got {kind!r}")
        member = Member(model, kind, worker_id, address)
        self._seen[worker_id] = self._clock()
        if self._members.get(worker_id) != member:
            self._members[worker_id] = member
            self.version += 1
        return self.version

    def unregister(self, worker_id: str) -> int:
        if self._members.pop(worker_id, None) is not None:
            self._seen.pop(worker_id, None)
            self.version += 1
        return self.version

    def _expire(self) -> None:
        now = self._clock()
        for worker_id in [w for w, t in self._seen.items() if now - t > self.ttl_s]:
            self.unregister(worker_id)

    def members(self, model: str | None = None) -> tuple[int, list[dict]]:
        """(version, members of `model` or of every model)."""
        self._expire()
        rows = [asdict(m) for m in self._members.values() if model is None or m.model == model]
        return self.version, sorted(rows, key=lambda r: (r["model"], r["kind"], r["worker_id"]))


def registry_name(app_name: str) -> str:
    return f"specserve-registry-{app_name}"


def registry_actor(app_name: str):
    """The application's registry actor, created by whichever replica asks first. Detached, so it outlives the
    replica that created it (any replica may restart); `specserve serve` kills it on shutdown."""
    import ray

    return (
        ray.remote(WorkerRegistry)
        .options(
            name=registry_name(app_name),
            namespace=REGISTRY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_restarts=-1,
        )
        .remote()
    )


def kill_registry(app_name: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE))
    except ValueError:
        pass  # never created
