"""Draft and target workers behind real gRPC servers (grpc.aio, port 0) and real clients: the KV state protocol,
lossless outputs, NOT_FOUND re-sends after eviction, and status codes for bad calls."""

import asyncio

import grpc
import pytest

from specserve.cluster.worker_clients import DraftClient, TargetClient
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config import KVCacheConfig, ModelConfig, SamplingParams, SpecParams
from specserve.workers.draft_worker import DraftWorker
from specserve.workers.drafters import ModelDrafter
from specserve.workers.engine import SpecEngine
from specserve.workers.grpc_service import DraftWorkerServicer, TargetWorkerServicer, create_server
from specserve.workers.loading import load_model
from specserve.workers.request import RequestState
from specserve.workers.runner import ModelRunner
from specserve.workers.target import TargetVerifier
from specserve.workers.target_worker import TargetWorker
from specserve.workers.testing import save_perturbed_copy

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, x):", "for i in range(3):"]


@pytest.fixture(scope="module")
def models(models_dir, tiny_target):
    draft_path = save_perturbed_copy(tiny_target, models_dir / "grpc_draft", 0.05, seed=9)
    return load_model(ModelConfig(path=tiny_target)), load_model(ModelConfig(path=draft_path))


class Workers:
    """A draft and a target worker, each behind its own gRPC server, and clients of both."""

    def __init__(self, target, draft, target_capacity=100_000):
        draft_runner = ModelRunner(draft, KVCacheConfig(), vocab_size=target.vocab_size)
        self.draft = DraftWorker(ModelDrafter(draft_runner), target.vocab_size, draft.path, draft_runner.store)
        self.target = TargetWorker(
            TargetVerifier(ModelRunner(target, KVCacheConfig(capacity_tokens=target_capacity))), target.path
        )
        self.tokenizer = target.tokenizer
        self.eos = frozenset(target.eos_token_ids)

    async def __aenter__(self):
        self.draft_servicer, self.target_servicer = DraftWorkerServicer(self.draft), TargetWorkerServicer(self.target)
        self.draft_server, draft_port = await create_server(self.draft_servicer)
        self.target_server, target_port = await create_server(self.target_servicer)
        self.draft_client = DraftClient(f"127.0.0.1:{draft_port}", timeout_s=30)
        self.target_client = TargetClient(f"127.0.0.1:{target_port}", timeout_s=30)
        return self

    async def __aexit__(self, *exc):
        await self.draft_client.close()
        await self.target_client.close()
        for server in (self.draft_server, self.target_server):
            await server.stop(grace=1)
        self.draft_servicer.close()
        self.target_servicer.close()

    async def generate(self, request_id, prompt, params, k, on_round=None):
        """Sequential draft-then-verify rounds over gRPC (the scheduler's job, minus pipelining)."""
        ids = self.tokenizer(prompt)["input_ids"]
        state = RequestState(request_id, list(ids), len(ids), params.max_new_tokens, self.eos)
        while not state.finished:
            budget = state.draft_budget(k)
            drafted, weights = [], b""
            if budget:
                drafted, weights, _ = await self.draft_client.propose(request_id, state.tokens, budget, params)
            accepted, nxt = await self.target_client.verify(request_id, state.tokens, drafted, weights, params)
            state.commit_round(drafted, accepted, nxt)
            if on_round:
                await on_round(state)
        await self.draft_client.release(request_id)
        await self.target_client.release(request_id)
        return state


def test_greedy_over_grpc_is_identical_to_target_only_with_concurrent_requests(models):
    target, draft = models
    engine = SpecEngine(target)
    params = SamplingParams(max_new_tokens=20)
    expected = [engine.generate(p, params, SpecParams(method="none")).token_ids for p in PROMPTS]

    async def main():
        async with Workers(target, draft) as w:
            states = await asyncio.gather(*(w.generate(f"r{i}", p, params, k=4) for i, p in enumerate(PROMPTS * 3)))
            health = await w.target_client.health()
            return states, health

    states, health = asyncio.run(main())
    assert [s.generated for s in states] == expected * 3
    assert sum(s.stats.accepted for s in states) > 0
    assert health.healthy and health.requests == 0 and health.kv_used_tokens == 0  # all released


def test_seeded_sampling_over_grpc_matches_in_process_engine(models):
    target, draft = models
    engine = SpecEngine(target, draft)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=42)
    expected = engine.generate(PROMPTS[0], params, SpecParams(k=3))

    async def main():
        async with Workers(target, draft) as w:
            return await w.generate("s", PROMPTS[0], params, k=3)

    state = asyncio.run(main())
    assert state.generated == expected.token_ids
    assert state.stats == expected.stats


def test_lost_cache_is_re_sent_and_output_unchanged(models):
    """A worker that loses a request (eviction, restart) answers NOT_FOUND; the client re-sends the prefix."""
    target, draft = models
    params = SamplingParams(max_new_tokens=20)
    expected = SpecEngine(target).generate(PROMPTS[1], params, SpecParams(method="none")).token_ids

    async def main():
        async with Workers(target, draft) as w:

            async def forget(state):
                if state.stats.rounds in (2, 4):
                    w.draft.release("x")
                    w.target.release("x")

            state = await w.generate("x", PROMPTS[1], params, k=4, on_round=forget)
            return state, w.draft_client.resends, w.target_client.resends

    state, draft_resends, target_resends = asyncio.run(main())
    assert state.generated == expected
    assert draft_resends >= 1 and target_resends >= 1


def test_full_kv_cache_evicts_idle_requests_without_losing_any(models):
    target, draft = models
    params = SamplingParams(max_new_tokens=16)
    engine = SpecEngine(target)
    expected = [engine.generate(p, params, SpecParams(method="none")).token_ids for p in PROMPTS]

    async def main():
        # Room for about one and a half requests: interleaved requests keep evicting each other.
        async with Workers(target, draft, target_capacity=60) as w:
            states = await asyncio.gather(*(w.generate(f"e{i}", p, params, k=2) for i, p in enumerate(PROMPTS)))
            return states, w.target_client.resends

    states, resends = asyncio.run(main())
    assert [s.generated for s in states] == expected
    assert resends >= 1


@pytest.mark.parametrize(
    "request_fields, status, text",
    [
        (dict(request_id="", k=2), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (dict(request_id="a", k=0), grpc.StatusCode.INVALID_ARGUMENT, "invalid k"),
        (dict(request_id="a", k=99), grpc.StatusCode.INVALID_ARGUMENT, "invalid k"),
        (dict(request_id="a", k=2, sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "invalid temperature"),
        (dict(request_id="a", k=2, committed_len=10, new_tokens=[5]), grpc.StatusCode.NOT_FOUND, "re-send"),
        (dict(request_id="a", k=2, committed_len=1, new_tokens=[5, 6]), grpc.StatusCode.INVALID_ARGUMENT,
         "shorter than"),
    ],
)  # fmt: skip
def test_bad_propose_calls_get_status_codes_and_server_keeps_serving(models, request_fields, status, text):
    target, draft = models
    fields = {"committed_len": 2, "new_tokens": [5, 6]} | request_fields

    async def main():
        async with Workers(target, draft) as w:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await w.draft_client.stub.Propose(pb.ProposeRequest(**fields), timeout=10)
            ok = await w.draft_client.stub.Propose(
                pb.ProposeRequest(request_id="ok", committed_len=2, new_tokens=[5, 6], k=2), timeout=10
            )
            return info.value, ok

    error, ok = asyncio.run(main())
    assert error.code() == status
    assert text in error.details()
    assert len(ok.drafted) == 2


def test_malformed_draft_probs_are_invalid_argument(models):
    target, draft = models

    async def main():
        async with Workers(target, draft) as w:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await w.target_client.stub.Verify(
                    pb.VerifyRequest(request_id="v", committed_len=2, new_tokens=[5, 6], drafted=[7],
                                     draft_probs=b"\x93not msgpack", sampling=pb.SamplingParams(temperature=1)),
                    timeout=10,
                )  # fmt: skip
            return info.value

    assert asyncio.run(main()).code() == grpc.StatusCode.INVALID_ARGUMENT
