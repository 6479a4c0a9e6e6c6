"""gRPC servicers for draft and target workers: thin typed wrappers that map protos to the plain worker classes and
errors to status codes. Model work runs on one dedicated thread per worker, off the event loop, so the server keeps
answering (health checks, new calls) while a forward pass runs; Propose and Verify calls that arrive meanwhile are
batched into the next forward pass (workers/service/batcher.py).

A request's sampling parameters are validated once, on the first call that carries them; its later rounds reuse the
typed object (`SamplingCache`)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import grpc

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.protos.wire import GRPC_OPTIONS, MAX_MESSAGE_BYTES, SECRET_METADATA  # noqa: F401 (importable from here too)
from specserve.workers.config.request import MAX_K, SamplingParams
from specserve.workers.config.settings import BatchingConfig
from specserve.workers.errors import InvalidRequestError, KVCapacityError, RequestNotFoundError, UnavailableError
from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.runtime.worker_state import check_token_ids
from specserve.workers.service.batcher import Batcher
from specserve.workers.service.draft_worker import DraftWorker, ProposeCall
from specserve.workers.service.results import VerifyResult
from specserve.workers.service.sampling_wire import sampling_from_proto
from specserve.workers.service.target_worker import TargetWorker, VerifyCall
from specserve.workers.service.verify_wire import verify_to_proto
from specserve.workers.speculation.codec import decode_probs
from specserve.workers.speculation.logprobs import MAX_LOGPROBS
from specserve.workers.speculation.wire_format import decode_features

log = logging.getLogger(__name__)

# A worker server's default limit: its largest legitimate message (a prompt's token ids) is far smaller, and gRPC
# buffers a whole message before the secret interceptor can refuse it, so a large limit is memory for anyone to take.
DEFAULT_SERVER_MESSAGE_BYTES = 4 * 1024 * 1024


def server_options(max_message_bytes: int = DEFAULT_SERVER_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC server options: messages over `max_message_bytes` are refused with RESOURCE_EXHAUSTED, unread."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class SamplingCache:
    """Request id -> its validated SamplingParams, with the wire fields they came from. Every round of a request
    carries the same fields, so pydantic runs on the first call only; fields that differ are validated again.
    Released requests are forgotten; requests never released (their scheduler died) age out past `max_requests`."""

    def __init__(self, max_requests: int = 4096):
        self.max_requests = max_requests
        self._params: OrderedDict[str, tuple[bytes, SamplingParams]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._params)

    def get(self, request_id: str, msg: pb.SamplingParams) -> SamplingParams:
        wire = msg.SerializeToString(deterministic=True)  # every field, the map's in key order
        known = self._params.get(request_id)
        if known is not None and known[0] == wire:
            self._params.move_to_end(request_id)
            return known[1]
        params = sampling_from_proto(msg)  # raises InvalidRequestError naming the field
        self._params[request_id] = (wire, params)
        self._params.move_to_end(request_id)
        if len(self._params) > self.max_requests:
            self._params.popitem(last=False)
        return params

    def forget(self, request_id: str) -> None:
        self._params.pop(request_id, None)


# Error type -> status code, first match wins; anything else is a fault (logged, and UNKNOWN to the caller).
_STATUS_CODES = (
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # InvalidRequestError included
    (KVCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),  # e.g. a tensor-parallel rank died: try another replica
)


class _Servicer:
    def __init__(self, worker: DraftWorker | TargetWorker, batching: BatchingConfig | None = None):
        self.worker = worker
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=type(self).__name__)
        self.busy_s = 0.0  # seconds of model work done: busy fraction for autoscaling
        self.batcher = Batcher(self._executor, self._run_batch, batching or BatchingConfig(), self._count_batch,
                               pads_rows=worker.pads_rows)  # fmt: skip
        self.sampling = SamplingCache()

    def _count_batch(self, rows: int, seconds: float) -> None:
        self.busy_s += seconds

    def _run_batch(self, items: list) -> list:
        raise NotImplementedError

    async def _batched(self, context: grpc.aio.ServicerContext, key: str, item, cost: int, prefill: bool = False):
        """Queue one call for the next batch; its own error becomes its own status code."""
        try:
            return await self.batcher.submit(key, item, cost, prefill)
        except Exception as e:  # noqa: BLE001 - mapped to a status code below
            await self._abort(context, e)

    def _status(self, error: Exception) -> grpc.StatusCode:
        """The status code a call's error maps to; anything unexpected is a fault: logged, UNKNOWN."""
        for kind, code in _STATUS_CODES:
            if isinstance(error, kind):
                return code
        log.error("%s (%s) failed", type(self).__name__, self.worker.model_name, exc_info=error)
        return grpc.StatusCode.UNKNOWN

    async def _abort(self, context: grpc.aio.ServicerContext, error: Exception):
        code = self._status(error)
        if code is grpc.StatusCode.UNKNOWN:
            raise error
        await context.abort(code, str(error))

    async def _unary(self, context: grpc.aio.ServicerContext, handle, request):
        try:
            return await handle(request)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            await self._abort(context, e)

    async def _multiplexed(self, requests, context: grpc.aio.ServicerContext, handle, reply_type) -> None:
        """Serve the calls of one stream (pb.CallStatus): each call its own task, as a unary call's handler would be,
        so the calls of several requests batch together; each reply written as its call finishes, one write at a
        time. The client's closing its side ends the stream once every call it made is answered; its going away
        cancels the calls still running."""
        writing = asyncio.Lock()
        calls: set[asyncio.Task] = set()

        async def one(envelope) -> None:
            try:
                reply = reply_type(call_id=envelope.call_id, response=await handle(envelope.request))
            except Exception as e:  # noqa: BLE001 - the call's own status; the stream goes on
                code = self._status(e)
                reply = reply_type(call_id=envelope.call_id, status=pb.CallStatus(code=code.value[0], details=str(e)))
            async with writing:
                await context.write(reply)

        try:
            async for envelope in requests:
                call = asyncio.ensure_future(one(envelope))
                calls.add(call)
                call.add_done_callback(calls.discard)
            if calls:
                await asyncio.gather(*calls)
        finally:
            for call in calls:
                call.cancel()

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - start

    async def _run(self, context: grpc.aio.ServicerContext, fn, *args):
        """Run model work on the worker thread, mapping specserve errors to status codes."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._timed, fn, *args)
        except Exception as e:  # noqa: BLE001 - mapped to a status code, or re-raised
            await self._abort(context, e)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def Release(self, request, context):
        self.batcher.forget(request.request_id)
        self.sampling.forget(request.request_id)
        released = await self._run(context, self.worker.release, request.request_id)
        log.debug("request %r released (its state was %s)", request.request_id, "freed" if released else "gone")
        return pb.ReleaseResponse(released=released)

    async def Health(self, request, context):
        if request.want_costs:  # measured with forward passes: on the model thread, after the work queued there
            return pb.HealthResponse(**await self._run(context, self.worker.health, True))
        return pb.HealthResponse(**self.worker.health())


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequestError("request_id", "must not be empty")


class DraftWorkerServicer(_Servicer, pb_grpc.DraftWorkerServicer):
    def _run_batch(self, calls: list[ProposeCall]) -> list:
        return self.worker.propose_batch(calls)

    async def Propose(self, request, context):
        return await self._unary(context, self._propose, request)

    async def Proposes(self, requests, context):
        await self._multiplexed(requests, context, self._propose, pb.ProposeStreamResponse)

    async def _propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        _check_request_id(request.request_id)
        if not 0 <= request.k <= MAX_K:  # 0: the tokens (and features) cached, nothing drafted
            raise InvalidRequestError("k", f"must be in 0..{MAX_K}, got {request.k}")
        call = ProposeCall(
            request.request_id,
            request.committed_len,
            list(request.new_tokens),
            request.k,
            _with_history(self.sampling.get(request.request_id, request.sampling), request, self.worker.vocab_size),
            decode_features(request.features, self.worker.feature_size),
            request.tree,
        )
        cost = len(call.new_tokens) + call.k + (call.features.rows if call.features is not None else 0)
        proposed = await self.batcher.submit(call.request_id, call, cost, prefill=call.k == 0,  # k 0: a prompt's chunk
                                             context=call.committed_len - len(call.new_tokens))  # fmt: skip
        return pb.ProposeResponse(
            drafted=proposed.drafted,
            draft_probs=proposed.draft_probs,
            vocab_size=self.worker.vocab_size,
            batch_seconds=proposed.batch_seconds,
            queued_seconds=proposed.queued_seconds,
            parents=proposed.parents or [],
            scores=proposed.scores or [],
        )


class TargetWorkerServicer(_Servicer, pb_grpc.TargetWorkerServicer):
    def _run_batch(self, calls: list[VerifyCall]) -> list:
        return self.worker.verify_batch(calls)

    async def Verify(self, request, context):
        return await self._unary(context, self._verify, request)

    async def Verifies(self, requests, context):
        await self._multiplexed(requests, context, self._verify, pb.VerifyStreamResponse)

    async def _verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        call = self._verify_call(request)
        prefill = not call.drafted and len(call.new_tokens) > 1  # a prompt or its chunk: a decoding round feeds one
        result = await self.batcher.submit(call.request_id, call, len(call.new_tokens) + len(call.drafted) + 1,
                                           prefill)  # fmt: skip
        return verify_to_proto(result, _bonus(call, result))

    async def Decode(self, request, context):
        """Plain steps back to back: each next step is queued for the batch after this one before this step's reply
        is written, so the reply's trip to the scheduler overlaps the next step (pb.DecodeRequest)."""
        try:
            if request.steps < 1:
                raise InvalidRequestError("steps", f"must be at least 1, got {request.steps}")
            if request.first.drafted:
                raise InvalidRequestError("first.drafted", "a decoding step verifies nothing drafted")
            call = self._verify_call(request.first)
        except ValueError as e:
            await self._abort(context, e)
        ends = frozenset(request.end_token_ids)
        step = asyncio.ensure_future(self._batched(context, call.request_id, call, len(call.new_tokens) + 1,
                                                   len(call.new_tokens) > 1))  # fmt: skip
        try:
            for n in range(request.steps):
                result = await step
                last = n + 1 == request.steps or result.next_token in ends
                reply = verify_to_proto(result, _bonus(call, result))
                if not last:
                    call = _next_step(call, result.next_token)
                    step = asyncio.ensure_future(self._batched(context, call.request_id, call, 2))
                yield reply
                if last:
                    return
        finally:
            step.cancel()  # the caller went away between steps: the queued step is dropped

    def _verify_call(self, request: pb.VerifyRequest) -> VerifyCall:
        """The call a VerifyRequest asks for, checked (InvalidRequestError names the field)."""
        _check_request_id(request.request_id)
        if len(request.drafted) > MAX_K:  # a tree's mask grows with its square: bound it here
            raise InvalidRequestError("drafted", f"at most {MAX_K} tokens (a tree's nodes), got {len(request.drafted)}")
        probs = decode_probs(request.draft_probs, self.worker.vocab_size)
        if probs is not None and probs.shape[0] != len(request.drafted):
            raise InvalidRequestError("draft_probs", f"{probs.shape[0]} rows for {len(request.drafted)} drafted")
        if request.parents and len(request.parents) != len(request.drafted):
            raise InvalidRequestError("parents", f"{len(request.parents)} for {len(request.drafted)} drafted")
        return VerifyCall(
            request.request_id,
            request.committed_len,
            list(request.new_tokens),
            list(request.drafted),
            probs,
            _with_history(self.sampling.get(request.request_id, request.sampling), request, self.worker.vocab_size),
            request.want_features,
            list(request.parents) if request.parents else None,
            _prompt_logprobs(request),
            request.prefix_at_most if request.HasField("prefix_at_most") else None,
            request.expected_len if request.HasField("expected_len") else None,
        )


def _next_step(call: VerifyCall, token: int) -> VerifyCall:
    """A decoding step's next one: it feeds the token the step sampled (the prompt's one-off fields dropped)."""
    return dataclasses.replace(call, committed_len=call.committed_len + 1, new_tokens=[token], prompt_logprobs=None,
                               prefix_at_most=None, expected_len=None)  # fmt: skip


def _prompt_logprobs(request: pb.VerifyRequest) -> int | None:
    """The call's prompt_logprobs (0..MAX_LOGPROBS alternatives), or None when it asks none."""
    if not request.HasField("prompt_logprobs"):
        return None
    if request.prompt_logprobs > MAX_LOGPROBS:
        raise InvalidRequestError("prompt_logprobs", f"at most {MAX_LOGPROBS}, got {request.prompt_logprobs}")
    return request.prompt_logprobs


def _with_history(
    params: SamplingParams, request: pb.VerifyRequest | pb.ProposeRequest, vocab_size: int
) -> SamplingParams:
    """The request's params with what its penalties and min_tokens count from (the request's prompt_len and
    end_token_ids; a response_format's grammar starts at prompt_len); unchanged for requests without either."""
    if not params.counts_prompt:
        return params
    check_token_ids("end_token_ids", request.end_token_ids, vocab_size)
    check_token_ids("sampling.logit_bias", list(params.logit_bias), vocab_size)
    if request.prompt_len > request.committed_len:
        raise InvalidRequestError("prompt_len", f"{request.prompt_len} exceeds committed_len {request.committed_len}")
    return params.model_copy(update={"prompt_len": request.prompt_len, "end_token_ids": tuple(request.end_token_ids)})


def _bonus(call: VerifyCall, result: VerifyResult) -> bool:
    """Whether next_token is the bonus token: every drafted token accepted, or for a tree the deepest accepted node
    (the root when none was) has no children."""
    if call.parents is None:
        return result.accepted == len(call.drafted)
    deepest = result.path[-1] if result.path else ROOT
    return deepest not in call.parents


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call that does not carry the cluster's shared secret (UNAUTHENTICATED): worker ports accept
    only the scheduler, never a stray client on the network."""

    def __init__(self, secret: str):
        self._secret = secret.encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA, "")
        if hmac.compare_digest(str(sent).encode(), self._secret):
            return await continuation(handler_call_details)
        return self._deny


async def create_server(
    servicer: _Servicer,
    address: str = "127.0.0.1:0",
    secret: str | None = None,
    max_message_bytes: int = DEFAULT_SERVER_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server for a draft or target servicer; returns (server, bound port). Port 0 picks a free one.
    With `secret`, calls without it are rejected (UNAUTHENTICATED); messages over `max_message_bytes` are refused
    (RESOURCE_EXHAUSTED)."""
    interceptors = [SecretInterceptor(secret)] if secret else []
    server = grpc.aio.server(options=server_options(max_message_bytes), interceptors=interceptors)
    if isinstance(servicer, DraftWorkerServicer):
        pb_grpc.add_DraftWorkerServicer_to_server(servicer, server)
    else:
        pb_grpc.add_TargetWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind a gRPC server to {address}")
    await server.start()
    return server, port
