"""Helpers for worker processes started on this machine without Ray (tensor-parallel ranks, the bench's workers):
a free port, and waiting for processes to report ready without hanging on one that died."""

from __future__ import annotations

import queue
import random
import socket
import time

# Above Ray's worker ports (10002-19999 by default). A port the kernel picks (a bind to port 0) comes from its
# ephemeral range, which every outgoing connection also draws from: on a machine running Ray, which opens hundreds,
# such a port can be taken between this check and the server's own bind ("Failed to bind to address").
_SPARE_LOW = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535  # IANA's range (macOS, Windows)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, outside the kernel's ephemeral range (no outgoing connection takes it)."""
    low, high = _ephemeral_range()
    spare = [(_SPARE_LOW, low)] if low - _SPARE_LOW >= 1000 else []
    spare += [(high + 1, 65536)] if 65536 - (high + 1) >= 1000 else []
    rng = random.Random()
    for _ in range(200 if spare else 0):
        start, stop = rng.choice(spare)
        port = rng.randrange(start, stop)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no spare range on this machine: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_ready(ready, processes: list, count: int, timeout_s: float = 300.0) -> list:
    """Collect `count` messages from `ready` (a multiprocessing queue); raises RuntimeError, naming the exit codes,
    as soon as one of `processes` dies first, or at the timeout."""
    messages, deadline = [], time.monotonic() + timeout_s
    while len(messages) < count:
        try:
            messages.append(ready.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in processes if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                reason = f"exit codes {dead}" if dead else f"no answer in {timeout_s:.0f} s"
                raise RuntimeError(f"local worker processes failed to start ({reason})") from None
    return messages
