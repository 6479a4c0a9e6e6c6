"""Readiness as /health and grpc.health.v1 report it, from the scheduler's status."""

from specserve.cluster.serve.health import Readiness

UP = {"targets": ["t1"], "drafts": []}
DOWN = {"targets": [], "drafts": ["d1"]}


def test_ready_needs_every_model_to_have_a_target_and_no_drain():
    ready = Readiness.of({"a": UP, "b": UP}, draining=False)
    assert ready.ready and ready.to_json()["status"] == "ok" and ready.to_json()["problems"] == []
    assert [ready.serving(s) for s in ("", "specserve.v1.SpecServe", "a", "nope")] == [True, True, True, None]

    half = Readiness.of({"a": UP, "b": DOWN}, draining=False)
    assert not half.ready and half.to_json()["status"] == "unavailable"
    assert half.problems == ("model 'b' has no healthy target worker",)
    assert [half.serving(s) for s in ("", "a", "b")] == [False, True, False]  # a model alone can still serve

    draining = Readiness.of({"a": UP}, draining=True)
    assert draining.to_json()["status"] == "draining" and not draining.serving("a") and not draining.serving("")
