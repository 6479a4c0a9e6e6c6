"""Helpers for worker processes started on this machine without Ray (tensor-parallel ranks, the bench's workers):
a free port, and waiting for processes to report ready without hanging on one that died."""

from __future__ import annotations

import queue
import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
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
