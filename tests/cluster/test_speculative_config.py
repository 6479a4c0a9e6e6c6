"""vLLM's speculative_config and `specserve serve`'s model flags, translated into a model's own config."""

from __future__ import annotations

import argparse

import pytest

from specserve.cluster.app_config import ModelPairConfig, app_config
from specserve.cluster.cli import serve as serve_cli
from specserve.cluster.serve.server import prepare_config
from specserve.workers.config.strict import validate
from specserve.workers.errors import InvalidRequestError, SpecServeError


def model(**fields) -> ModelPairConfig:
    return validate(ModelPairConfig, {"target": "demo", **fields})


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 3}, {"draft": "/heads/h", "max_k": 3}),
        ({"method": "eagle3"}, {"draft": "eagle"}),
        ({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
         {"draft": "ngram", "ngram": {"min_ngram": 2, "max_ngram": 5}}),
        ({"method": "ngram", "prompt_lookup_max": 3}, {"draft": "ngram", "ngram": {"min_ngram": 3, "max_ngram": 3}}),
        ({"method": "draft_model", "model": "demo", "draft_tensor_parallel_size": 2},
         {"draft": "demo", "draft_pool": {"tensor_parallel_size": 2}}),
        ({"model": "/some/draft"}, {"draft": "/some/draft"}),
    ],
)  # fmt: skip
def test_vllm_keys_become_specserves_own(block, expected):
    config = model(speculative_config=block)
    dumped = config.model_dump()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert {k: dumped[key][k] for k in value} == value
        else:
            assert dumped[key] == value
    assert config.k == "auto"  # num_speculative_tokens caps the planner; it does not fix k
    assert "speculative_config" not in dumped
    assert validate(ModelPairConfig, dumped) == config  # replicas read the dump back unchanged


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"speculative_config": {"method": "eagle3", "disable_by_batch_size": 4}},
         "speculative_config.disable_by_batch_size"),
        ({"speculative_config": {"method": "medusa"}}, "speculative_config.method: 'medusa'"),
        ({"speculative_config": {"method": "ngram", "model": "x"}}, "speculative_config.model"),
        ({"speculative_config": {"method": "draft_model"}}, "speculative_config.model"),
        ({"speculative_config": {"num_speculative_tokens": 0}}, "speculative_config.num_speculative_tokens"),
        ({"speculative_config": {"prompt_lookup_min": 5, "prompt_lookup_max": 2}},
         "speculative_config.prompt_lookup_min"),
        ({"speculative_config": "eagle3"}, "speculative_config must be an object"),
        ({"draft": "ngram", "speculative_config": {"method": "eagle3"}}, "draft: set both"),
        ({"max_k": 2, "speculative_config": {"num_speculative_tokens": 3}}, "max_k: set both"),
        ({"draft_pool": {"tensor_parallel_size": 1}, "speculative_config": {"draft_tensor_parallel_size": 2}},
         "draft_pool.tensor_parallel_size: set both"),
    ],
)  # fmt: skip
def test_what_specserve_cannot_take_is_refused_by_name(fields, named):
    with pytest.raises(InvalidRequestError, match="^invalid .*" + named.replace(".", r"\.")):
        model(**fields)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parsers(parser.add_subparsers(), [])
    return parser.parse_args(["serve", *argv])


def test_serve_flags_set_the_served_models_fields():
    args = _serve_args("--model", "demo", "--device", "cpu", "--dtype", "bfloat16", "--tensor-parallel-size", "2",
                       "--k", "3", "--speculative-config", '{"num_speculative_tokens": 4}')  # fmt: skip
    config = prepare_config(None, None, None, args.model, args.draft, None, serve_cli._model_overrides(args))
    (served,) = app_config(config["applications"][0]["args"]).models
    assert (served.name, served.device, served.dtype, served.k, served.max_k) == ("demo", "cpu", "bfloat16", 3, 4)
    assert served.target_pool.tensor_parallel_size == 2 and served.draft == "demo"
    assert serve_cli._model_overrides(_serve_args("--k", "auto")) == {"k": "auto"}
    default = app_config(prepare_config(None, None, None)["applications"][0]["args"]).models[0]
    assert default.dtype == "auto"  # bfloat16 on CUDA, float32 on a CPU


def test_serve_flags_with_vllms_names_set_the_kv_cache_and_chunked_prefill():
    args = _serve_args(
        "--model",
        "x",
        "--gpu-memory-utilization",
        "0.8",
        "--kv-cache-memory-bytes",
        "1000000",
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        "512",
        "--tensor-parallel-size",
        "2",
    )
    (served,) = app_config(
        prepare_config(None, None, None, args.model, args.draft, None, serve_cli._model_overrides(args))[
            "applications"
        ][0]["args"]
    ).models
    for pool in (served.target_pool, served.draft_pool):
        assert (pool.kv_cache.gpu_memory_utilization, pool.kv_cache.kv_cache_memory_bytes) == (0.8, 1_000_000)
        assert pool.kv_cache.prefix_caching is False
    assert served.target_pool.tensor_parallel_size == 2 and served.prefill_chunk_tokens == 512
    off = serve_cli._model_overrides(_serve_args("--no-enable-chunked-prefill", "--max-num-batched-tokens", "64"))
    assert off == {"prefill_chunk_tokens": None}
    assert serve_cli._model_overrides(_serve_args("--enable-chunked-prefill")) == {"prefill_chunk_tokens": 256}
    assert serve_cli._model_overrides(_serve_args("--num-scheduler-steps", "1")) == {"decode_steps": 1}
    assert served.decode_steps == 32  # unset: the default, plain steps streamed 32 a call


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--k", "three"], "--k: 'three' is not an integer"),
        (["--speculative-config", "{method: eagle3}"], "--speculative-config: not JSON"),
        (["--config", "app.yaml", "--device", "cuda"], "apply without --config"),
    ],
)
def test_bad_serve_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SpecServeError, match=message):
        serve_cli._serve(_serve_args(*argv))


def test_a_bad_value_reaching_the_model_config_names_its_field():
    with pytest.raises(InvalidRequestError, match="k"):
        prepare_config(None, None, None, "demo", None, None, {"k": 99})
    with pytest.raises(InvalidRequestError, match="device"):
        prepare_config("app.yaml", None, None, overrides={"device": "cuda"})
