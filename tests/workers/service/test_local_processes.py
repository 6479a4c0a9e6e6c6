"""free_port: the port it names is free now and lies outside the kernel's ephemeral range, which outgoing
connections draw from (a port from that range can be taken before the server binds it)."""

import socket

from specserve.workers.service import local_processes
from specserve.workers.service.local_processes import free_port


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    low, high = local_processes._ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    for port in ports:
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_named():
    low, _ = local_processes._ephemeral_range()
    held = []
    try:
        # Hold most of a narrow spare range so the draw must skip held ports.
        local_processes._SPARE_LOW, saved = low - 1000, local_processes._SPARE_LOW
        for port in range(low - 1000, low - 50):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        for _ in range(20):
            port = free_port()
            assert port not in taken
    finally:
        local_processes._SPARE_LOW = saved
        for s in held:
            s.close()
