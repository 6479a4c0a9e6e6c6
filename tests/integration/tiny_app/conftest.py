"""One Serve app for every module here (a Serve app takes ~45 s to start on 2 cores), serving three models beside one
tiny draft: "tiny" (the tiny target), "caller" (a tool caller, test_tools.py) and "compat" (sampling defaults and a
thinking template, test_vllm_compat.py); a local Ray whose processes export metrics every METRICS_REPORT_S, half a
CPU a replica. Modules run in name order and each leaves the app serving; test_app.py's first test checks the gauges
before any request reached the app."""

import openai
import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.server import start, stop
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.service.local_processes import free_port
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.generation_models import COMPAT_DEFAULTS, THINKING_TEMPLATE, save_with_defaults
from tests.helpers.serve_app import METRICS_REPORT_S, PROMPTS, N
from tests.helpers.tool_models import save_tool_caller


@pytest.fixture(scope="package")
def caller(tmp_path_factory) -> str:
    return save_tool_caller(tmp_path_factory.mktemp("tool_caller") / "model")


@pytest.fixture(scope="package")
def compat_target(tiny_target, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("compat") / "target"
    return save_with_defaults(tiny_target, path, COMPAT_DEFAULTS, THINKING_TEMPLATE)


@pytest.fixture(scope="package")
def server(tiny_target, tiny_draft, caller, compat_target):
    metrics_port = free_port()
    # Metrics leave each process every second (Ray's default: 10 s), so that the metric tests wait less for them
    init_ray(num_cpus=6, include_dashboard=False, _metrics_export_port=metrics_port, configure_logging=False,
             log_to_driver=False, _system_config={"metrics_report_interval_ms": METRICS_REPORT_S * 1000})  # fmt: skip
    pool = {"num_cpus": 0.5}
    models = [{"name": name, "target": target, "draft": tiny_draft, "device": "cpu", "target_pool": pool,
               "draft_pool": pool} for name, target in (("tiny", tiny_target), ("caller", caller),
                                                        ("compat", compat_target))]  # fmt: skip
    app = AppConfig.model_validate(
        {"models": models, "scheduler": {"num_cpus": 0.5, "call_timeout_s": 30, "worker_wait_s": 60}}
    )
    config = serve_config(app, grpc_port=free_port(), http_port=free_port())
    info = start(config, metrics_port=metrics_port, ready_timeout_s=300)
    yield info
    stop({**info, "started_ray": False})
    ray.shutdown()


@pytest.fixture(scope="package")
def reference(tiny_target):
    """PROMPTS' target-only outputs (N new tokens): token ids and text."""
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    out = {}
    for p in PROMPTS:
        r = engine.generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none"))
        out[p] = (r.token_ids, r.text)
    return out


@pytest.fixture(scope="package")
def client(server):
    with SpecServeClient(server["grpc"], timeout_s=120) as c:
        yield c


@pytest.fixture(scope="package")
def oai(server):
    return openai.OpenAI(base_url=server["http"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def target(tiny_target):
    """The tiny target, loaded in this process: what its target-only outputs are checked against (test_vllm_compat.py
    overrides it with its model's)."""
    return load_model(ModelConfig(path=tiny_target, device="cpu"))
