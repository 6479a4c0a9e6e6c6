"""What the traffic workloads share (cluster/bench/traffic.py): documents of about the asked length, the same for the
same arguments and different from another start; a stream's gaps; an arm's settings merged into the app's model."""

from transformers import AutoTokenizer

from specserve.cluster.bench.burst import percentiles
from specserve.cluster.bench.traffic import Timed, _merge, document


def test_documents_are_about_as_long_as_asked_and_differ_by_start(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    a, b = document(tokenizer, 1500), document(tokenizer, 1500, start=3)
    assert a == document(tokenizer, 1500) and a != b and a[:200] != b[:200]
    assert abs(count(a) - 1500) < 30 and abs(count(b) - 1500) < 30  # cut at the word that fits
    assert abs(count(document(tokenizer, 6000)) - 6000) < 300  # long ones wrap around the docstrings


def test_a_streams_gaps_and_percentiles():
    timed = Timed(0.0, arrivals=[0.5, 0.6, 0.9, 1.0])
    assert timed.ttft_s == 0.5 and timed.latency_s == 1.0
    assert [round(g, 6) for g in timed.gaps()] == [0.1, 0.3, 0.1]
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["max"]) == (50.5, 90.0, 99.0, 100.0) and percentiles([]) == {}


def test_an_arms_settings_merge_into_the_models_nested_fields():
    model = {"target": "x", "target_pool": {"num_cpus": 0.5, "kv_cache": {"capacity_tokens": 8}}}
    _merge(model, {"target_pool": {"kv_cache": {"prefix_caching": False}}, "prefill_chunk_tokens": None})
    assert model == {
        "target": "x",
        "prefill_chunk_tokens": None,
        "target_pool": {"num_cpus": 0.5, "kv_cache": {"capacity_tokens": 8, "prefix_caching": False}},
    }
