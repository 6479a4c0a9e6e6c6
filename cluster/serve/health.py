"""Readiness as load balancers and probes read it: HTTP `/health` 200 or 503, and the standard `grpc.health.v1`
service on the public gRPC port (Serve's gRPC proxy routes it to the ingress like the SpecServe service).

Ready means: the app is not draining, and every served model has at least one healthy target worker (a model whose
draft workers are all gone still answers, decoding without drafts). The gRPC service names are "" and
"specserve.v1.SpecServe" for the whole app, or a served model's name for that model alone; any other is NOT_FOUND,
as the protocol asks.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.protos.wire import SERVICE_NAME

APP_SERVICES = ("", SERVICE_NAME)


@dataclass(frozen=True)
class Readiness:
    draining: bool
    models: dict[str, dict]  # served name -> the scheduler's status of it
    problems: tuple[str, ...]

    @classmethod
    def of(cls, status: dict[str, dict], draining: bool) -> Readiness:
        problems = ["draining: the server is stopping and admits no new request"] if draining else []
        problems += [f"model {name!r} has no healthy target worker" for name, s in status.items() if not s["targets"]]
        return cls(draining, status, tuple(problems))

    @property
    def ready(self) -> bool:
        return not self.problems

    def serving(self, service: str) -> bool | None:
        """Whether `service` (a gRPC health service name) is serving; None for a name this app does not serve."""
        if service in APP_SERVICES:
            return self.ready
        if service not in self.models:
            return None
        return not self.draining and bool(self.models[service]["targets"])

    def to_json(self) -> dict:
        status = "ok" if self.ready else ("draining" if self.draining else "unavailable")
        return {"status": status, "problems": list(self.problems), "models": self.models}
