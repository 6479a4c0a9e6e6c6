"""Draft and target workers behind real gRPC servers (grpc.aio, port 0), called with raw stubs: the KV state
protocol's status codes and bad calls. End-to-end generation through them is in tests/cluster/test_pipeline.py."""

import asyncio

import grpc
import pytest

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config import KVCacheConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from tests.worker_helpers import LocalWorkers


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft, device):
    return load_model(ModelConfig(path=tiny_target, device=device)), load_model(
        ModelConfig(path=tiny_draft, device=device)
    )


def call_draft(models, message):
    """Send one Propose (and then a valid one) to a fresh draft worker; returns (error or None, valid response)."""

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.draft_addresses["draft-0"]) as channel:
                stub = pb_grpc.DraftWorkerStub(channel)
                error = None
                try:
                    await stub.Propose(message, timeout=10)
                except grpc.aio.AioRpcError as e:
                    error = e
                ok = await stub.Propose(
                    pb.ProposeRequest(request_id="ok", committed_len=2, new_tokens=[5, 6], k=2), timeout=10
                )
                return error, ok

    return asyncio.run(main())


@pytest.mark.parametrize(
    "fields, status, text",
    [
        (dict(request_id="", k=2), grpc.StatusCode.INVALID_ARGUMENT, "invalid request_id"),
        (dict(request_id="a", k=0), grpc.StatusCode.INVALID_ARGUMENT, "invalid k"),
        (dict(request_id="a", k=99), grpc.StatusCode.INVALID_ARGUMENT, "invalid k"),
        (dict(request_id="a", k=2, sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "invalid temperature"),
        (dict(request_id="a", k=2, sampling=pb.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
         "invalid top_p"),
        (dict(request_id="a", k=2, committed_len=10, new_tokens=[5]), grpc.StatusCode.NOT_FOUND, "re-send"),
        (dict(request_id="a", k=2, committed_len=1, new_tokens=[5, 6]), grpc.StatusCode.INVALID_ARGUMENT,
         "shorter than"),
        (dict(request_id="a", k=2, committed_len=2, new_tokens=[5, 10**6]), grpc.StatusCode.INVALID_ARGUMENT,
         "outside the vocabulary"),
    ],
)  # fmt: skip
def test_bad_propose_calls_get_status_codes_and_server_keeps_serving(models, fields, status, text):
    message = pb.ProposeRequest(**({"committed_len": 2, "new_tokens": [5, 6]} | fields))
    error, ok = call_draft(models, message)
    assert error is not None and error.code() == status, error
    assert text in error.details()
    assert len(ok.drafted) == 2


def test_verify_status_codes_and_health(models):
    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                stub = pb_grpc.TargetWorkerStub(channel)
                codes = []
                for message in (
                    pb.VerifyRequest(request_id="v", committed_len=2, new_tokens=[5, 6], drafted=[7],
                                     draft_probs=b"\x93not msgpack", sampling=pb.SamplingParams(temperature=1)),
                    pb.VerifyRequest(request_id="w", committed_len=9, new_tokens=[5]),
                ):  # fmt: skip
                    try:
                        await stub.Verify(message, timeout=10)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                ok = await stub.Verify(pb.VerifyRequest(request_id="v", committed_len=2, new_tokens=[5, 6]), timeout=10)
                health = await stub.Health(pb.HealthRequest(), timeout=10)
                released = await stub.Release(pb.ReleaseRequest(request_id="v"), timeout=10)
                after = await stub.Health(pb.HealthRequest(), timeout=10)
                return codes, ok, health, released, after

    codes, ok, health, released, after = asyncio.run(main())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND]
    assert ok.accepted == 0 and ok.bonus  # nothing drafted: the next token is the bonus token
    assert health.healthy and health.requests == 1 and health.kv_used_tokens == 2
    assert released.released and after.requests == 0 and after.kv_used_tokens == 0


def test_prefill_then_verify_sends_no_tokens_again(models):
    """Prefill caches a committed sequence; the next Verify names its length and sends no tokens, and the result
    equals a Verify that sends the whole sequence to a fresh worker."""

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                stub = pb_grpc.TargetWorkerStub(channel)
                prefill = await stub.Prefill(pb.PrefillRequest(request_id="p", tokens=[5, 6, 7, 8]), timeout=10)
                warm = await stub.Verify(
                    pb.VerifyRequest(request_id="p", committed_len=4, new_tokens=[], drafted=[9, 10]), timeout=10
                )
                cold = await stub.Verify(
                    pb.VerifyRequest(request_id="q", committed_len=4, new_tokens=[5, 6, 7, 8], drafted=[9, 10]),
                    timeout=10,
                )
                return prefill, warm, cold

    prefill, warm, cold = asyncio.run(main())
    assert prefill.cached_len == 3  # all but the last token, which the first Verify feeds
    assert (warm.accepted, warm.next_token) == (cold.accepted, cold.next_token)


def test_worker_with_a_secret_rejects_calls_without_it(models):
    from specserve.cluster.scheduling.worker_clients import DraftClient
    from specserve.workers.service.draft_worker import DraftWorker
    from specserve.workers.speculation.drafters import ModelDrafter
    from specserve.workers.service.grpc_service import DraftWorkerServicer, create_server
    from specserve.workers.runtime.runner import ModelRunner

    target, draft = models

    async def main():
        runner = ModelRunner(draft, KVCacheConfig(), vocab_size=target.vocab_size)
        worker = DraftWorker(ModelDrafter(runner), target.vocab_size, "draft", runner.store)
        server, port = await create_server(DraftWorkerServicer(worker), "127.0.0.1:0", secret="s3cret")
        address = f"127.0.0.1:{port}"
        try:
            codes = []
            for secret in (None, "wrong"):
                async with grpc.aio.insecure_channel(address) as channel:
                    metadata = (("x-specserve-secret", secret),) if secret else None
                    try:
                        await pb_grpc.DraftWorkerStub(channel).Health(pb.HealthRequest(), timeout=10, metadata=metadata)
                    except grpc.aio.AioRpcError as e:
                        codes.append((e.code(), e.details()))
            health = await DraftClient(address, 10, "s3cret").health()
            return codes, health
        finally:
            await server.stop(None)

    codes, health = asyncio.run(main())
    assert codes == [(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret")] * 2
    assert health.healthy and health.kv_capacity_tokens == KVCacheConfig().capacity_tokens  # also when empty


def test_worker_refuses_messages_over_its_limit_before_the_secret_check_and_keeps_serving(models):
    """An oversize message is RESOURCE_EXHAUSTED from anyone (with or without the secret): a stranger cannot make
    the worker hold a large message; normal calls still work afterwards."""
    from specserve.cluster.scheduling.worker_clients import DraftClient
    from specserve.workers.service.draft_worker import DraftWorker
    from specserve.workers.speculation.drafters import ModelDrafter
    from specserve.workers.service.grpc_service import DEFAULT_SERVER_MESSAGE_BYTES, DraftWorkerServicer, create_server
    from specserve.workers.runtime.runner import ModelRunner

    assert DEFAULT_SERVER_MESSAGE_BYTES == 4 * 1024 * 1024
    target, draft = models
    limit = 64 * 1024
    big = pb.ProposeRequest(request_id="x" * (2 * limit), committed_len=2, new_tokens=[5, 6], k=2)

    async def main():
        runner = ModelRunner(draft, KVCacheConfig(), vocab_size=target.vocab_size)
        worker = DraftWorker(ModelDrafter(runner), target.vocab_size, "draft", runner.store)
        server, port = await create_server(DraftWorkerServicer(worker), "127.0.0.1:0", "s3cret", limit)
        address = f"127.0.0.1:{port}"
        try:
            codes = []
            for metadata in (None, (("x-specserve-secret", "s3cret"),)):
                async with grpc.aio.insecure_channel(address) as channel:
                    try:
                        await pb_grpc.DraftWorkerStub(channel).Propose(big, timeout=10, metadata=metadata)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
            return codes, await DraftClient(address, 10, "s3cret").health()
        finally:
            await server.stop(None)

    codes, health = asyncio.run(main())
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert health.healthy
