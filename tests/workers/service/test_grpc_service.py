"""Draft and target workers behind real gRPC servers (grpc.aio, port 0), called with raw stubs: the KV state
protocol's status codes and bad calls. End-to-end generation through them is in
tests/cluster/scheduling/test_pipeline.py."""

import asyncio
import re

import grpc
import pytest
import torch

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config.settings import ModelConfig
from specserve.workers.service.assembly import WorkerSpec, build_worker, start_worker_server
from tests.helpers.workers import LocalWorkers


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
        (dict(request_id="a", k=2, tree=True), grpc.StatusCode.INVALID_ARGUMENT, "invalid tree"),  # a model's worker
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


def test_a_chunk_that_says_its_prompts_length_gets_a_run_for_all_of_it(models):
    """expected_len travels the wire: the worker sizes the chunk's KV run for the whole prompt (and a quarter more)
    at once, as its health's allocated bytes show; a chunk without it holds a run for what it fed."""

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                stub = pb_grpc.TargetWorkerStub(channel)
                chunk = list(range(5, 105))
                allocated = []
                for rid, expected in (("said", 400), ("unsaid", None)):
                    await stub.Verify(pb.VerifyRequest(request_id=rid, committed_len=100, new_tokens=chunk,
                                                       expected_len=expected), timeout=10)  # fmt: skip
                    health = await stub.Health(pb.HealthRequest(), timeout=10)
                    per_token = health.kv_capacity_bytes / health.kv_capacity_tokens
                    allocated.append(round(health.kv_allocated_bytes / per_token))
                    await stub.Release(pb.ReleaseRequest(request_id=rid), timeout=10)
                return allocated

    said, unsaid = asyncio.run(main())
    assert said >= 500  # 400 positions and a quarter
    assert unsaid < 200  # its 100 fed positions (and what the first, released, keeps for its prefix)


def test_a_verify_reply_splits_its_batch_into_the_forward_and_the_rest(models):
    """batch_forward_seconds travels the wire: the forward pass's host time, within its batch's seconds."""

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                stub = pb_grpc.TargetWorkerStub(channel)
                call = pb.VerifyRequest(request_id="a", committed_len=40, new_tokens=list(range(5, 45)), drafted=[7, 8])
                return await stub.Verify(call, timeout=10)

    reply = asyncio.run(main())
    assert 0 < reply.batch_forward_seconds < reply.batch_seconds


def _draft_worker(models):
    target, draft = models
    return build_worker(WorkerSpec("draft", ModelConfig(path=draft.path), vocab_size=target.vocab_size), draft)


def test_worker_with_a_secret_rejects_calls_without_it(models):
    from specserve.cluster.scheduling.worker_clients import DraftClient

    async def main():
        server, port = await start_worker_server(_draft_worker(models), "127.0.0.1:0", secret="s3cret")
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
    draft = models[1]
    assert health.healthy and health.kv_capacity_tokens > 0  # also when empty: sized from the budget
    # The budget: 4 GiB on a CPU (cpu_kv_cache_space_gib), at most 0.9 of the GPU on CUDA (gpu_memory_utilization).
    ceiling = (
        4 << 30
        if draft.device.type == "cpu"
        else int(0.9 * torch.cuda.get_device_properties(draft.device).total_memory)
    )
    assert health.kv_capacity_bytes == health.kv_capacity_tokens * draft.kv_bytes_per_token <= ceiling
    assert health.kv_allocated_bytes == 0  # nothing cached yet


def test_worker_refuses_messages_over_its_limit_before_the_secret_check_and_keeps_serving(models):
    """An oversize message is RESOURCE_EXHAUSTED from anyone (with or without the secret): a stranger cannot make
    the worker hold a large message; normal calls still work afterwards."""
    from specserve.cluster.scheduling.worker_clients import DraftClient
    from specserve.workers.service.grpc_service import DEFAULT_SERVER_MESSAGE_BYTES

    assert DEFAULT_SERVER_MESSAGE_BYTES == 4 * 1024 * 1024
    limit = 64 * 1024
    big = pb.ProposeRequest(request_id="x" * (2 * limit), committed_len=2, new_tokens=[5, 6], k=2)

    async def main():
        server, port = await start_worker_server(_draft_worker(models), "127.0.0.1:0", "s3cret", limit)
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


def test_an_assembled_draft_worker_drafts_in_the_targets_vocabulary_and_logs_its_start(models, caplog):
    target, draft = models
    assert draft.vocab_size != target.vocab_size  # the tiny draft's output layer is padded

    async def main():
        server, port = await start_worker_server(_draft_worker(models))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.DraftWorkerStub(channel)
                request = pb.ProposeRequest(request_id="a", committed_len=2, new_tokens=[5, 6], k=2)
                return port, await stub.Propose(request, timeout=10), await stub.Health(pb.HealthRequest(), timeout=10)
        finally:
            await server.stop(None)

    with caplog.at_level("INFO", logger="specserve.workers.service.assembly"):
        port, proposed, health = asyncio.run(main())
    assert proposed.vocab_size == target.vocab_size and len(proposed.drafted) == 2
    assert health.model == draft.path
    (message,) = [r.getMessage() for r in caplog.records]
    budget = "cpu_kv_cache_space_gib" if draft.device.type == "cpu" else "gpu_memory_utilization"
    assert re.fullmatch(rf"draft worker serving {draft.path} on {draft.device.type} at 127\.0\.0\.1:{port}; KV cache "
                        rf"\d+\.\d\d GiB, \d+ positions \({budget} .*\)", message)  # fmt: skip


def test_a_worker_on_transformers_own_forward_says_so_at_start(models, caplog):
    built = _draft_worker(models)
    built.runner.lean = False  # as where the lean path's probe disagreed

    async def main():
        server, _ = await start_worker_server(built)
        await server.stop(None)

    with caplog.at_level("INFO", logger="specserve.workers.service.assembly"):
        asyncio.run(main())
    assert any("runs transformers' own forward" in r.getMessage() for r in caplog.records)


def test_a_requests_sampling_is_validated_on_its_first_call_only(models, monkeypatch):
    """Later rounds of a request reuse its validated parameters; a new request, a released one coming back, or
    changed fields are validated again, and bad fields still answer INVALID_ARGUMENT naming the field."""
    from specserve.workers.service import grpc_service

    validated = []
    real = grpc_service.sampling_from_proto
    monkeypatch.setattr(grpc_service, "sampling_from_proto", lambda msg: validated.append(msg.seed) or real(msg))
    sampling = pb.SamplingParams(temperature=1.0, seed=3)

    def propose(rid, committed_len, new_tokens, params=sampling):
        return pb.ProposeRequest(
            request_id=rid, committed_len=committed_len, new_tokens=new_tokens, k=2, sampling=params
        )

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.draft_addresses["draft-0"]) as channel:
                stub = pb_grpc.DraftWorkerStub(channel)
                await stub.Propose(propose("a", 2, [5, 6]), timeout=10)
                for n in range(3, 6):  # three more rounds of the same request
                    await stub.Propose(propose("a", n, [7]), timeout=10)
                once = list(validated)
                await stub.Propose(propose("b", 2, [5, 6]), timeout=10)
                await stub.Release(pb.ReleaseRequest(request_id="a"), timeout=10)
                await stub.Propose(propose("a", 2, [5, 6]), timeout=10)
                try:
                    await stub.Propose(propose("b", 3, [7], pb.SamplingParams(temperature=-1, seed=4)), timeout=10)
                except grpc.aio.AioRpcError as e:
                    return once, list(validated), e

    once, validated_all, error = asyncio.run(main())
    assert once == [3]
    assert validated_all == [3, 3, 3, 4]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid temperature" in error.details()


def test_the_sampling_cache_is_bounded():
    from specserve.workers.service.grpc_service import SamplingCache

    cache = SamplingCache(max_requests=2)
    for rid in ("a", "b", "c"):
        cache.get(rid, pb.SamplingParams(temperature=0.5))
    assert len(cache) == 2
    cache.forget("c")
    assert len(cache) == 1
