"""Starting a Ray of this process's own, tolerant of a slow raylet.

Ray gives a new node's raylet a fixed 30 s to register with its GCS (ray/_private/node.py, not configurable in 2.60).
On a busy 2-core machine (another Ray winding down, models loading) a raylet can miss it, and `ray.init` raises a bare
Exception while the GCS and raylet it started keep running. Starting again after stopping those is what works."""

import logging
from typing import Any

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = "timed out during startup"


def init_ray(attempts: int = 3, **init: Any) -> None:
    """`ray.init(**init)`, started again (up to `attempts` in all) when the node misses Ray's registration limit; the
    processes a timed-out start left are stopped, the last one's too. Any other error is raised as it is."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**init)
            return
        except Exception as err:  # noqa: BLE001  (Ray raises a bare Exception for this timeout)
            if STARTUP_TIMEOUT not in str(err):
                raise
            _stop_started_node(err)
            if attempt == attempts:
                raise
            log.warning("Ray's node missed its 30 s start-up limit (attempt %d of %d): starting it again", attempt,
                        attempts)  # fmt: skip


def _stop_started_node(err: BaseException) -> None:
    """Kill the processes of the node whose construction raised `err`: ray.init never got to keep it, so
    ray.shutdown() cannot reach it."""
    from ray._private.node import Node

    tb = err.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return
        tb = tb.tb_next
