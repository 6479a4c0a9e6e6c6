"""The model's generation_config.json sampling defaults (cluster/serve/generation_defaults.py): read once, said once in
the log, applied by `prepare` to the fields an OpenAI request leaves unset (vLLM's behaviour), OpenAI's defaults for a
model without them; gRPC requests keep the values the proto gives them."""

import json
import logging

import pytest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.generation_defaults import GenerationDefaults, read_generation_defaults
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.cluster.serve.public_proto import request_from_proto
from specserve.protos import specserve_pb2 as pb
from tests.helpers.generation_models import save_with_defaults

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "max_new_tokens": 40, "do_sample": True}  # fmt: skip


def preparer(path: str) -> RequestPreparer:
    app = AppConfig.model_validate({"models": [{"name": "m", "target": path, "draft": "ngram", "device": "cpu"}]})
    return RequestPreparer(app, {"m": (path, None)})


@pytest.fixture(scope="module")
def with_defaults(tiny_target, tmp_path_factory):
    return save_with_defaults(tiny_target, tmp_path_factory.mktemp("defaults") / "m", DEFAULTS)


def test_the_files_sampling_keys_are_read_and_bad_values_skipped(tmp_path, caplog):
    assert read_generation_defaults(str(tmp_path)) == GenerationDefaults()  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_k": -1, "top_p": 0, "min_p": "x", "repetition_penalty": True, "max_new_tokens": 0,
         "eos_token_id": 2}))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        defaults = read_generation_defaults(str(tmp_path))
    assert defaults == GenerationDefaults({"temperature": 0.7, "top_k": 0})
    assert all(f"{key} = " in caplog.text for key in ("top_p", "min_p", "repetition_penalty", "max_new_tokens"))
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults(str(tmp_path)) == GenerationDefaults()


def test_unset_fields_get_the_models_defaults_and_set_ones_stay(with_defaults, caplog):
    with caplog.at_level(logging.INFO, logger="specserve.cluster.serve.generation_defaults"):
        service = preparer(with_defaults)
    said = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert len(said) == 1 and "temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1" in said[0]
    assert "max_tokens at most 40" in said[0]
    p = service.prepare(oai.parse_completion({"prompt": "def f(x):"}).request).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_new_tokens) == (
        0.6, 0.9, 20, 0.05, 1.1, 40)  # fmt: skip
    body = {"prompt": "def f(x):", "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1,
            "max_tokens": 100}  # fmt: skip
    p = service.prepare(oai.parse_completion(body).request).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_new_tokens) == (0, 1, 0, 0, 1, 100)
    chat = oai.parse_chat({"messages": [{"role": "user", "content": "x"}], "temperature": 0}).request
    p = service.prepare(chat).params
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0, 20, 1.1)  # greedy, under the model's penalty


def test_grpc_requests_keep_the_protos_values(with_defaults):
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_new_tokens=5))
    p = preparer(with_defaults).prepare(request_from_proto(request)).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0, 1, 0, 0, 1)


def test_a_model_without_defaults_keeps_openais(tiny_target, caplog):
    with caplog.at_level(logging.INFO, logger="specserve.cluster.serve.generation_defaults"):
        service = preparer(tiny_target)
    assert "no sampling defaults" in caplog.text and "temperature=1," in caplog.text
    p = service.prepare(oai.parse_completion({"prompt": "def f(x):"}).request)
    assert (p.params.temperature, p.params.top_p, p.params.top_k, p.params.min_p, p.params.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)  # fmt: skip
    assert p.params.max_new_tokens == 512 - len(p.prompt_ids)
