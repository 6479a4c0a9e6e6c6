"""A Ray whose raylet misses the 30 s registration limit is started again, and the first start's processes stopped."""

import time

import psutil
import pytest
import ray
import ray._private.node as ray_node
import ray._private.services as ray_services

from specserve.cluster.serve.local_ray import init_ray

INIT = {"address": "local", "num_cpus": 1, "include_dashboard": False, "configure_logging": False,
        "log_to_driver": False}  # fmt: skip


def _ray_daemons() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")}


class _SlowRegistration:
    """Ray's node module as if its first raylet never registered: get_node fails and, once it has been asked, the
    node module's clock runs 31 s a reading (past the limit at once), for the first `failing` starts."""

    def __init__(self, failing: int):
        self.failing, self.asked = failing, False
        self.real_get_node = ray_services.get_node
        self.offset = 0.0

    def get_node(self, *args, **kwargs):
        if self.failing:
            self.asked = True
            raise RuntimeError("node not registered (test)")
        return self.real_get_node(*args, **kwargs)

    def monotonic(self) -> float:
        if self.asked and self.failing:
            self.offset += 31.0  # this start now times out: the next is asked afresh
            self.failing, self.asked = self.failing - 1, False
        return time.monotonic() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def slow_registration(monkeypatch):
    def install(failing: int) -> _SlowRegistration:
        slow = _SlowRegistration(failing)
        monkeypatch.setattr(ray_services, "get_node", slow.get_node)
        monkeypatch.setattr(ray_node, "time", slow)
        return slow

    yield install
    ray.shutdown()


@pytest.mark.slow
def test_a_start_that_times_out_is_stopped_and_started_again(slow_registration, caplog):
    before = _ray_daemons()
    slow_registration(failing=1)
    with caplog.at_level("WARNING", logger="specserve.cluster.serve.local_ray"):
        init_ray(**INIT)
    assert ray.is_initialized()
    assert ray.get(ray.remote(lambda: 7).remote()) == 7
    assert "attempt 1 of 3" in caplog.text
    # One raylet and one GCS more than before: the failed start's were stopped, not left running.
    assert len(_ray_daemons() - before) == 2


@pytest.mark.slow
def test_a_start_that_keeps_timing_out_raises_after_the_last_attempt(slow_registration):
    before = _ray_daemons()
    slow_registration(failing=10**6)
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray(attempts=2, **INIT)
    assert not ray.is_initialized()
    assert _ray_daemons() - before == set()
