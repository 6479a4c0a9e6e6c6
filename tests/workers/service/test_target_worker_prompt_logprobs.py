"""A prompt's log-probabilities on the target worker (vLLM's prompt_logprobs): the verify call that asks
(VerifyRequest.prompt_logprobs) returns those of its committed tokens 1..L-1 with their ranks, equal to a teacher-forced
forward of the target (tests/helpers/logprobs_oracle.py, no specserve code) within ATOL, whatever the request's cache
held; its verification and the other rows of its batch are what they are without it; a tree call may not ask; the
wire form carries the ranks."""

import pytest
import torch

from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.service.target_worker import TargetWorker, VerifyCall
from specserve.workers.speculation.logprobs import TokenLogprob, from_proto, to_proto
from specserve.workers.speculation.target import TargetVerifier
from tests.helpers.logprobs_oracle import assert_logprobs_match, target_logprobs
from tests.helpers.workers import save_tiny_llama

PROMPT = [1, 70, 71, 72, 40, 41, 70, 71, 9, 12, 100, 33]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(ModelConfig(path=save_tiny_llama(tmp_path_factory.mktemp("prompt_lp"), seed=5), device="cpu"))


def worker_of(target) -> TargetWorker:
    return TargetWorker(TargetVerifier(ModelRunner(target, KVCacheConfig(capacity_tokens=10_000))), "t")


def call(rid: str, tokens: list[int], drafted=(), top: int | None = None, committed_len=None, parents=None):
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False, logprobs=2)
    return VerifyCall(rid, committed_len or len(tokens), list(tokens), list(drafted), None, params, parents=parents,
                      prompt_logprobs=top)  # fmt: skip


def check_prompt(target, prompt: list[int], got, top: int) -> None:
    """Tokens 1..P-1's logprobs, alternatives and ranks against the oracle (one forward over the prompt)."""
    expected = target_logprobs(target.model, prompt[:1], prompt[1:])  # [P - 1, V]
    assert_logprobs_match(prompt[1:], got, expected, top)
    for i, (token, lp) in enumerate(zip(prompt[1:], got, strict=True)):
        row = expected[i]
        assert lp.rank == 1 + int((row > row[token]).sum()), (i, lp.rank)  # vLLM's rank: 1 + the likelier tokens


@pytest.mark.parametrize("top", [0, 5, 20])
def test_the_call_that_brings_the_prompt_returns_its_logprobs_and_ranks(target, top):
    result = worker_of(target).verify_batch([call("a", PROMPT, top=top)])[0]
    check_prompt(target, PROMPT, result.prompt_logprobs, top)


def test_asking_changes_neither_the_rows_verification_nor_its_batch_neighbours(target):
    """A chain drafted on the first call is verified as without prompt logprobs, and the batch's other rows (a
    longer prompt, a decode step) get exactly what a batch without the asking row gives them."""
    drafted = [70, 71, 9]
    other, step = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 20, 21]
    plain = worker_of(target).verify_batch([call("a", PROMPT, drafted), call("b", other), call("c", step)])
    asked = worker_of(target).verify_batch([call("a", PROMPT, drafted, top=3), call("b", other), call("c", step)])
    for p, a in zip(plain, asked, strict=True):
        assert (p.accepted, p.next_token) == (a.accepted, a.next_token)
        assert [x.logprob for x in p.logprobs] == pytest.approx([x.logprob for x in a.logprobs], abs=1e-5)
    assert plain[0].prompt_logprobs is None and asked[1].prompt_logprobs is None and asked[2].prompt_logprobs is None
    check_prompt(target, PROMPT, asked[0].prompt_logprobs, 3)
    expected = target_logprobs(target.model, PROMPT, drafted[: asked[0].accepted] + [asked[0].next_token])
    assert_logprobs_match(drafted[: asked[0].accepted] + [asked[0].next_token], asked[0].logprobs, expected, 2)


def test_a_request_whose_cache_holds_its_prefix_computes_the_whole_sequence_again(target):
    """Asked on a later call (the cache holds the prompt), every committed token's logprob is still returned, each
    computed from the whole sequence."""
    worker = worker_of(target)
    first = worker.verify_batch([call("a", PROMPT)])[0]
    sequence = [*PROMPT, first.next_token]
    later = worker.verify_batch([call("a", [first.next_token], top=4, committed_len=len(sequence))])[0]
    check_prompt(target, sequence, later.prompt_logprobs, 4)


def test_a_one_token_prompt_has_no_logprobs_and_a_tree_call_may_not_ask(target):
    assert worker_of(target).verify_batch([call("a", [1], top=2)])[0].prompt_logprobs == []
    (error,) = worker_of(target).verify_batch([call("t", PROMPT, [70, 71], top=2, parents=[-1, -1])])
    assert isinstance(error, InvalidRequestError) and error.field == "prompt_logprobs"


def test_the_wire_form_carries_ranks_and_leaves_them_out_where_none_were_computed():
    ranked = [TokenLogprob(-0.5, ((3, -0.25), (4, -0.5)), 2), TokenLogprob(-3.0, ((1, -0.125), (3, -1.0)), 7)]
    assert from_proto(pb.Logprobs.FromString(to_proto(ranked).SerializeToString())) == ranked
    plain = [TokenLogprob(-0.5, ((3, -0.25),))]
    assert to_proto(plain).ranks == [] and from_proto(to_proto(plain)) == plain
    with pytest.raises(ValueError, match="ranks"):
        from_proto(pb.Logprobs(token_logprobs=[-1.0, -2.0], ranks=[1]))


def test_slices_of_a_long_prompt_join_to_what_one_pass_computes(target, monkeypatch):
    from specserve.workers.speculation import logprobs as module

    prompt = [1] + [int(t) for t in torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(0))]
    monkeypatch.setattr(module, "SLICE_ROWS", 7)  # 40 positions in 6 slices
    check_prompt(target, prompt, worker_of(target).verify_batch([call("a", prompt, top=3)])[0].prompt_logprobs, 3)


def test_a_prompt_another_request_left_cached_is_computed_whole(target):
    """Whatever a worker keeps of other requests' prefixes (prefix caching), the asking call feeds its whole prompt."""
    worker, prompt = worker_of(target), PROMPT * 3  # longer than the shortest prefix a cache would share
    worker.verify_batch([call("a", prompt)])
    worker.release("a")
    fed = worker.verifier.runner.forward_positions
    result = worker.verify_batch([call("b", prompt, top=2)])[0]
    assert worker.verifier.runner.forward_positions - fed == len(prompt)
    check_prompt(target, prompt, result.prompt_logprobs, 2)
