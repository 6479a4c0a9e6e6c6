"""Trees through the workers: a head's draft worker drafts trees for the calls that ask (batched: each as drafted
alone); a target worker verifies trees beside chains in one batch (each request decodes what the target decodes
alone, over rounds that switch between trees and chains), answers with the accepted path over gRPC, and refuses
malformed trees with INVALID_ARGUMENT naming the field, serving on."""

import asyncio
import random

import grpc
import pytest
import torch

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.service.draft_worker import DraftWorker, ProposeCall
from specserve.workers.service.target_worker import TargetWorker, VerifyCall
from specserve.workers.speculation.codec import feature_block
from specserve.workers.speculation.eagle.loading import load_eagle_drafter
from specserve.workers.speculation.target import TargetVerifier
from tests.helpers.eagle_heads import hf_features, random_head
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.trees import random_tree
from tests.helpers.workers import LocalWorkers, save_tiny_llama

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target(models_dir):
    path = save_tiny_llama(models_dir / "tree_workers_target", seed=4, layers=4, hidden=32)
    return load_model(ModelConfig(path=path, device="cpu"))


def test_a_batch_of_trees_and_chains_decodes_what_the_target_decodes_alone(target):
    """Three requests, each round one batch: a request drafts a random tree (one branch right for a while) or a
    chain, by turns; the KV state protocol's tails carry the committed tokens."""
    worker = TargetWorker(TargetVerifier(ModelRunner(target, KVCacheConfig())), "t")
    prompts = {"a": [1, 40, 41, 42], "b": [1, 50, 51, 52, 53, 54, 55], "c": [1, 60]}
    new = 40
    want = {rid: own_greedy_loop(target.model, ids, new, set()) for rid, ids in prompts.items()}
    tokens = {rid: list(ids) for rid, ids in prompts.items()}
    told = {rid: 0 for rid in prompts}
    rng, accepted_by_kind = random.Random(0), {"tree": 0, "chain": 0}
    for round_ in range(200):
        live = [rid for rid in prompts if len(tokens[rid]) - len(prompts[rid]) < new]
        if not live:
            break
        calls = []
        for i, rid in enumerate(live):
            truth = want[rid][len(tokens[rid]) - len(prompts[rid]) :]
            tail = tokens[rid][told[rid] :]
            if (round_ + i) % 2:
                drafted, parents = random_tree(truth, 60, rng)
            else:
                drafted, parents = truth[: rng.randint(0, 3)] + [rng.randrange(60)], None
            calls.append(VerifyCall(rid, len(tokens[rid]), tail, drafted, None, GREEDY, parents=parents))
            told[rid] = len(tokens[rid])
        for call, result in zip(calls, worker.verify_batch(calls), strict=True):
            assert not isinstance(result, Exception), result
            assert result.batch_rows == len(calls)
            if call.parents is None:
                assert result.path is None
                accepted = call.drafted[: result.accepted]
            else:
                assert len(result.path) == result.accepted
                accepted = [call.drafted[node] for node in result.path]
                for parent, node in zip([ROOT, *result.path], result.path, strict=False):
                    assert call.parents[node] == parent  # a root-down path
            accepted_by_kind["chain" if call.parents is None else "tree"] += len(accepted)
            tokens[call.request_id] += accepted + [result.next_token]
    for rid, ids in prompts.items():
        assert tokens[rid][len(ids) : len(ids) + new] == want[rid]
    assert accepted_by_kind["tree"] > 10 and accepted_by_kind["chain"] > 10


def test_tree_verify_over_grpc_names_the_path_and_refuses_bad_trees(target):
    async def main():
        async with LocalWorkers(target, []) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                stub = pb_grpc.TargetWorkerStub(channel)
                errors = []
                for fields in (
                    dict(drafted=[5, 6], parents=[ROOT]),  # one parent for two tokens
                    dict(drafted=[5, 6], parents=[ROOT, 1]),  # a node its own parent
                    dict(drafted=[5, 6], parents=[ROOT, 0], draft_probs=b"\x90"),  # probs for a tree
                    dict(drafted=[5] * 17, parents=[ROOT] * 17),  # over MAX_K nodes
                ):
                    try:
                        await stub.Verify(pb.VerifyRequest(request_id="x", committed_len=2, new_tokens=[1, 5],
                                                           **fields), timeout=10)  # fmt: skip
                    except grpc.aio.AioRpcError as e:
                        errors.append((e.code(), e.details()))
                want = own_greedy_loop(target.model, [1, 5], 3, set())
                # the right branch second, below a wrong sibling; its child is wrong: a recovered token ends it
                tree = dict(drafted=[(want[0] + 1) % 200, want[0], want[1], (want[2] + 1) % 200],
                            parents=[ROOT, ROOT, 1, 2])  # fmt: skip
                ok = await stub.Verify(pb.VerifyRequest(request_id="y", committed_len=2, new_tokens=[1, 5], **tree),
                                       timeout=10)  # fmt: skip
                leaf = await stub.Verify(pb.VerifyRequest(request_id="z", committed_len=2, new_tokens=[1, 5],
                                                          drafted=[want[0]], parents=[ROOT]), timeout=10)  # fmt: skip
                return errors, ok, leaf, want

    errors, ok, leaf, want = asyncio.run(main())
    assert [code for code, _ in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert "invalid parents" in errors[0][1] and "invalid parents" in errors[1][1]
    assert "invalid draft_probs" in errors[2][1] and "invalid drafted: at most 16" in errors[3][1]
    assert list(ok.path) == [1, 2] and ok.accepted == 2 and ok.next_token == want[2] and not ok.bonus
    assert list(leaf.path) == [0] and leaf.next_token == want[1] and leaf.bonus  # the accepted node has no children


def test_a_heads_draft_worker_drafts_each_tree_of_a_batch_as_alone(target):
    head = random_head(target.model.config, 64, seed=1, std=0.3)
    sequences = {"a": [1, 40, 41, 42, 43], "b": [1, 50, 51], "c": list(range(60, 75))}
    features = {rid: hf_features(target.model, ids)[:-1] for rid, ids in sequences.items()}

    def worker():
        return DraftWorker(load_eagle_drafter(target, head), target.vocab_size, "h")

    def call(rid, k, tree=True):
        block = feature_block(0, features[rid])
        return ProposeCall(rid, len(sequences[rid]), sequences[rid], k, GREEDY, block, tree)

    calls = [call("a", 4), call("b", 8), call("c", 3, tree=False)]
    batched = worker().propose_batch(calls)
    for c, got in zip(calls, batched, strict=True):
        alone = worker().propose_batch([c])[0]
        assert got.drafted == alone.drafted and got.parents == alone.parents
        if not c.tree:
            assert got.parents is None and len(got.drafted) == 3
            continue
        assert 0 < len(got.drafted) == len(got.parents) == len(got.scores) <= c.k and got.draft_probs == b""
        assert all(ROOT <= p < i for i, p in enumerate(got.parents))
        torch.testing.assert_close(torch.tensor(got.scores), torch.tensor(alone.scores), atol=1e-4, rtol=1e-4)
