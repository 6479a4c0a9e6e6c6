"""A graceful stop: the app admits no new request (503 / UNAVAILABLE with a retry hint, and `/health` turns 503 so
load balancers and readiness probes route elsewhere), its running requests finish, up to a timeout, then it stops.

The app's registry actor carries the flag: every scheduler replica reads it on its next poll (each second) and
reports how many requests it runs, so one call here drains every replica. `specserve serve` drains on SIGINT/SIGTERM
(a second signal stops at once); on Kubernetes the head pod's preStop hook runs `specserve drain` before the pod is
sent SIGTERM, inside its termination grace period.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

SETTLE_S = 2.5  # every scheduler replica has polled (each second) and reported since the flag was set


def drain(app_name: str, timeout_s: float, interrupt: threading.Event | None = None) -> int:
    """Stop admitting requests to `app_name` and wait until none runs, at most `timeout_s` (or until `interrupt` is
    set). Returns how many were still running when it stopped waiting (0: drained). Needs a connected Ray."""
    import ray

    from specserve.cluster.serve.registry import REGISTRY_NAMESPACE, registry_name

    try:
        registry = ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE)
    except ValueError:
        return 0  # never started serving: nothing runs
    interrupt = interrupt or threading.Event()
    ray.get(registry.set_draining.remote(True))
    started = last_said = time.monotonic()
    running = ray.get(registry.active_requests.remote())
    log.info("draining %s: %d requests running; waiting up to %.0f s for them", app_name, running, timeout_s)
    while True:
        if interrupt.wait(0.25):
            return running
        running = ray.get(registry.active_requests.remote())
        waited = time.monotonic() - started
        if running == 0 and waited >= SETTLE_S:
            log.info("drained %s in %.1f s", app_name, waited)
            return 0
        if waited >= timeout_s:
            log.warning("%d requests still running after %.0f s of draining: stopping them", running, timeout_s)
            return running
        if time.monotonic() - last_said >= 5.0:
            log.info("draining: %d requests running", running)
            last_said = time.monotonic()
