"""Log-probabilities on the disaggregated path, without Ray: the target worker returns them from its verify forward
(VerifyResponse.logprobs), the scheduler keeps those of the committed tokens, and a scheduler replica's ModelServing
streams them with its chunks, cut with the tokens at a stop string. Every value equals what target-only decoding
computes for the same tokens (tests/helpers/logprobs_oracle.py: ATOL in float32)."""

import asyncio

import pytest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling.model_serving import ModelServing
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from tests.helpers.eagle_disaggregated import build_pairs, prompts_of
from tests.helpers.logprobs_oracle import assert_logprobs_match, target_logprobs
from tests.helpers.pipelines import generate_all
from tests.helpers.workers import LocalWorkers

MAX_NEW = 16
PROMPT = "for i in range(3):\n    print(i)\n"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return build_pairs(tmp_path_factory.mktemp("logprobs_dis"), "cpu")


def check_all(target, requests, results) -> int:
    """Every request's logprobs against the oracle; returns the drafted tokens accepted over all of them."""
    for (prompt, params, _), req in zip(requests, results, strict=True):
        tokens = req.state.generated
        assert tokens == target_logprobs(target.model, prompt, tokens).argmax(-1).tolist()  # greedy, lossless
        assert_logprobs_match(tokens, req.state.logprobs, target_logprobs(target.model, prompt, tokens),
                              params.logprobs)  # fmt: skip
    return sum(req.state.stats.accepted for req in results)


def test_a_heads_methods_and_prompt_lookup_return_target_only_logprobs_over_grpc(pairs):
    target, head_dir = pairs["tiny_vocab"]
    requests = [
        (prompt, SamplingParams(max_new_tokens=MAX_NEW, stop_at_eos=False, logprobs=top), SpecParams(method=m, k=k))
        for m in ("eagle", "eagle+ngram", "eagle-tree", "ngram", "ngram-tree")
        for prompt, top, k in zip(prompts_of(target, "tiny_vocab"), (3, 0, 5), (3, "auto", 4), strict=True)
    ]

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:
            return (await generate_all(w, requests))[0]

    assert check_all(target, requests, asyncio.run(main())) > 0


def test_a_draft_models_rounds_return_target_only_logprobs_and_others_none(tiny_target):
    target = load_model(ModelConfig(path=tiny_target, device="cpu"))
    prompt = target.tokenizer(PROMPT)["input_ids"]
    asked = [(prompt, SamplingParams(max_new_tokens=MAX_NEW, logprobs=top), SpecParams(method="draft", k=4))
             for top in (0, 20)]  # fmt: skip
    plain = (prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="draft", k=4))

    async def main():
        async with LocalWorkers(target, [target]) as w:  # the target drafting for itself: every draft is accepted
            return (await generate_all(w, [*asked, plain]))[0]

    results = asyncio.run(main())
    assert check_all(target, asked, results[:2]) >= MAX_NEW // 2
    assert results[2].state.logprobs == [] and results[2].state.generated == results[0].state.generated


def _stop_inside_a_round(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string completed by a token in the middle of the first round (a self-drafted k=4 round commits
    tokens 0..4): its text, and the index of the token completing it."""
    text = tokenizer.decode(tokens)
    for j in (2, 1, 3):
        before = tokenizer.decode(tokens[:j])
        piece = tokenizer.decode(tokens[: j + 1])[len(before) :]
        if piece.isascii() and piece.strip() and piece.isprintable() and text.find(piece) == len(before):
            return piece, j
    raise AssertionError(f"no usable stop string in {text!r}")


def test_a_stop_string_inside_a_multi_token_round_cuts_the_logprobs_with_the_tokens(tiny_target):
    """vllm #47616 left the logprobs of tokens after a stop; here they end with the token that completes it."""
    target = load_model(ModelConfig(path=tiny_target, device="cpu"))
    app = AppConfig.model_validate({"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_target,
                                                "device": "cpu"}], "auth": {"api_key_env": None}})  # fmt: skip
    preparer = RequestPreparer(app, {"tiny": (tiny_target, None)})
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": 5,
            "speculation": {"method": "draft", "k": 4}}  # fmt: skip
    whole = preparer.prepare(oai.parse_completion(body).request)

    async def main(prepared_list):
        async with LocalWorkers(target, [target]) as w:
            serving = ModelServing(app, {"tiny": (tiny_target, tiny_target)})
            serving.sync_workers([{"model": "tiny", "kind": n.split("-")[0], "worker_id": n, "address": a}
                                  for n, a in w.addresses.items()])  # fmt: skip
            out = [[c async for c in serving.run(p)] for p in prepared_list]
            for client in (*serving.models["tiny"].pipeline.drafts.values(),
                           *serving.models["tiny"].pipeline.targets.values()):  # fmt: skip
                await client.close()
            return out

    (full,) = asyncio.run(main([whole]))
    tokens = [t for c in full for t in c.token_ids]
    stop, j = _stop_inside_a_round(target.tokenizer, tokens)
    cut = preparer.prepare(oai.parse_completion({**body, "stop": stop}).request)
    (chunks,) = asyncio.run(main([cut]))
    kept = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert kept == tokens[: j + 1] and chunks[-1].finish_reason == "stop"
    assert chunks[-1].stats["rounds"] + chunks[-1].stats["accepted"] > j + 1  # the round committed more than kept
    assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]
    assert_logprobs_match(kept, logprobs, target_logprobs(target.model, cut.prompt_ids, kept), 5)
