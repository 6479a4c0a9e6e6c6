"""The light entry points stay light: `import specserve.client` loads in a fraction of a second without torch,
transformers, Ray, pydantic or yaml, and the CLI's remote generate (and `models list`) run without torch,
transformers or Ray. Each check runs in a fresh interpreter, since this one has torch loaded already (conftest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.protos.wire import APP_NAME

CLIENT_BUDGET_S = 0.3
CLIENT_HEAVY = ("torch", "transformers", "ray", "pydantic", "yaml")
CLI_HEAVY = ("torch", "transformers", "ray")

# CPU seconds, not wall-clock: on 2 cores shared with a test run's Ray processes the wall-clock time of the same
# import (0.07 s on an idle machine) reached 0.35 s, while its CPU time stayed at 0.09 s.
_TIMED_IMPORT = """
import json, sys, time
t = time.process_time()
import specserve.client
seconds = time.process_time() - t
print(json.dumps({"seconds": seconds, "modules": sorted(m.split(".")[0] for m in sys.modules)}))
"""

# Runs the CLI's main as the console script does (argparse exits for --help), then writes the exit code and the
# modules it left loaded.
_CLI = """
import json, sys
from specserve.cluster.cli.main import main
try:
    code = main(sys.argv[2:])
except SystemExit as exit:
    code = exit.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}, f)
sys.exit(code)
"""


def test_the_client_imports_fast_and_without_heavy_packages():
    runs = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _TIMED_IMPORT], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""  # no warnings either
        runs.append(json.loads(proc.stdout))
    heavy = [m for m in CLIENT_HEAVY if m in runs[0]["modules"]]
    assert heavy == [], f"import specserve.client loaded {heavy}"
    best = min(r["seconds"] for r in runs)
    assert best < CLIENT_BUDGET_S, f"import specserve.client took {best:.3f} CPU s (best of 3), over {CLIENT_BUDGET_S}"


class _FakeSpecServe(pb_grpc.SpecServeServicer):
    """Answers Generate with a canned result; fails it with INVALID_ARGUMENT for the prompt 'bad', and with
    UNAVAILABLE on the first call for the prompt 'flaky'."""

    def __init__(self):
        self.calls: list[tuple[pb.GenerateRequest, dict]] = []

    def Generate(self, request, context):  # noqa: N802 (the generated servicer's name)
        self.calls.append((request, dict(context.invocation_metadata())))
        if request.prompt == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid temperature: must be >= 0")
        if request.prompt == "flaky" and len(self.calls) == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica starting")
        stats = pb.RequestStats(rounds=2, drafted=8, accepted=4, acceptance_rate=0.5, mean_accepted_length=2.5)
        return pb.GenerateResponse(text=" world", token_ids=[7, 8, 9], finish_reason="length", stats=stats)


@pytest.fixture
def fake_server():
    servicer = _FakeSpecServe()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_SpecServeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def _run_cli(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-c", _CLI, str(report), *args], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    return proc, json.loads(report.read_text())


def test_remote_generate_calls_the_server_without_torch(tmp_path, fake_server):
    address, servicer = fake_server
    proc, report = _run_cli(tmp_path, "generate", "hello", "--address", address, "--max-new-tokens", "3", "--k", "2",
                            "--api-key", "sekret", "--json")  # fmt: skip
    assert proc.returncode == 0 and report["code"] == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "text": " world",
        "token_ids": [7, 8, 9],
        "finish_reason": "length",
        "stats": {"rounds": 2, "drafted": 8, "accepted": 4, "acceptance_rate": 0.5, "mean_accepted_length": 2.5},
    }
    ((request, metadata),) = servicer.calls
    assert request.prompt == "hello" and request.sampling.max_new_tokens == 3 and request.speculation.k == 2
    assert metadata["application"] == APP_NAME and metadata["authorization"] == "Bearer sekret"
    assert [m for m in CLI_HEAVY if m in report["modules"]] == []


def test_remote_generate_failure_is_a_clear_message_without_torch(tmp_path, fake_server):
    address, servicer = fake_server
    proc, report = _run_cli(tmp_path, "generate", "bad", "--address", address)
    assert proc.returncode == 2 and report["code"] == 2
    assert proc.stderr.strip() == f"specserve: error: {address}: INVALID_ARGUMENT: invalid temperature: must be >= 0"
    assert len(servicer.calls) == 1  # a refused request is not retried
    assert [m for m in CLI_HEAVY if m in report["modules"]] == []


def test_models_list_and_help_need_no_torch(tmp_path):
    env = {**os.environ, "SPECSERVE_HOME": str(tmp_path / "home")}  # an empty cache: nothing pulled
    proc, report = _run_cli(tmp_path, "models", "list", "--json", env=env)
    assert proc.returncode == 0 and report["code"] == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["demo"]["pulled"] and not rows["demo"]["converted"]  # packaged, not installed in this cache
    assert [m for m in CLI_HEAVY if m in report["modules"]] == []
    proc, report = _run_cli(tmp_path, "--help")
    assert report["code"] == 0 and "generate" in proc.stdout and "--log-level" in proc.stdout
    assert [m for m in CLI_HEAVY if m in report["modules"]] == []


@pytest.mark.parametrize("flags, logged", [([], False), (["--log-level", "info"], True)])
def test_a_retried_call_is_logged_at_info_only_when_asked(tmp_path, fake_server, flags, logged):
    address, servicer = fake_server
    proc, report = _run_cli(tmp_path, "generate", "flaky", "--address", address, *flags)
    assert report["code"] == 0 and proc.stdout.startswith(" world\n"), proc.stderr
    assert len(servicer.calls) == 2  # UNAVAILABLE is retried
    retry_line = f"INFO specserve.client: Generate on {address}: UNAVAILABLE (replica starting); retry 1 of 3"
    assert (retry_line in proc.stderr) == logged, proc.stderr
