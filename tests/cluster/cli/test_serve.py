"""`specserve serve` as users run it: a subprocess that starts Ray + Serve from a config file, prints its addresses,
serves, and on SIGTERM shuts everything it started down, leaving no process behind."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import yaml

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, load_serve_config, serve_config
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.service.local_processes import free_port
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.serve_process import marked_processes, wait_until_serving

pytestmark = pytest.mark.slow


def test_serve_drains_its_streams_on_ctrl_c_then_stops_quietly_leaving_nothing(tmp_path, tiny_target, tiny_draft):
    """Ctrl-C (SIGINT; SIGTERM does the same): no new requests, the streams in flight finish whole (equal to
    target-only decoding), then everything the CLI started stops, with no raylet task-failure lines on the way."""
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu",
                     "target_pool": {"num_cpus": 0.5}}], "scheduler": {"num_cpus": 0.5, "drain_timeout_s": 120}}
    )  # fmt: skip
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config(app)))
    grpc_port, http_port = free_port(), free_port()
    marker = uuid.uuid4().hex
    env = {**os.environ, "SPECSERVE_TEST_MARKER": marker, "SPECSERVE_HOME": str(tmp_path / "home")}
    ports = ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(free_port())]
    cmd = [sys.executable, "-m", "specserve.cluster.cli.main", "serve", "--config", str(config_file), *ports]
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    prompts = ["def add(a, b):", "class Stack:", "import json", "for i in range(3):"]
    try:
        line = wait_until_serving(proc, 400, stderr)
        assert f"127.0.0.1:{grpc_port}" in line and f"http://127.0.0.1:{http_port}" in line
        engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
        refs = [engine.generate(p, SamplingParams(max_new_tokens=300), SpecParams(method="none")).token_ids
                for p in prompts]  # fmt: skip
        assert len(marked_processes(marker)) > 3  # the CLI, GCS, raylet, Serve's controller, proxy and replicas
        started, outputs = threading.Barrier(len(prompts) + 1), {}

        def stream(i: int) -> None:
            with SpecServeClient(f"127.0.0.1:{grpc_port}", timeout_s=300) as client:
                tokens = []
                for n, chunk in enumerate(client.generate_stream(prompts[i], max_new_tokens=300, k=2)):
                    tokens += chunk["token_ids"]
                    if n == 0:
                        started.wait(60)
                outputs[i] = tokens

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first round
        proc.send_signal(signal.SIGINT)
        assert "draining" in proc.stdout.readline()
        for t in threads:
            t.join(300)
        assert [outputs.get(i) for i in range(len(prompts))] == refs  # none cut off
        assert proc.wait(timeout=180) == 0
        deadline = time.time() + 60
        while marked_processes(marker) and time.time() < deadline:
            time.sleep(1)
        assert [p.name() for p in marked_processes(marker)] == []
        log = stderr.read_text() + proc.stdout.read()
        assert "ray.kill" not in log and "listen_for_change" not in log and "Traceback" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in marked_processes(marker):
            p.kill()


def test_config_file_round_trips_and_rejects_bad_args(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config())  # a valid Serve config file, as serve run / RayService read it
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(serve_config(grpc_port=9100)))
    assert load_serve_config(good)["grpc_options"]["port"] == 9100
    bad = serve_config()
    bad["applications"][0]["args"] = {"models": [{"name": "m", "k": 99}]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(InvalidRequestError, match="k must be 1..16"):
        load_serve_config(tmp_path / "bad.yaml")
    (tmp_path / "notserve.yaml").write_text("models: []\n")
    with pytest.raises(InvalidRequestError, match="not a Ray Serve config"):
        load_serve_config(tmp_path / "notserve.yaml")
