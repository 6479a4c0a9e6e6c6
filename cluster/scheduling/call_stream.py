"""A worker's Propose or Verify calls multiplexed on one long-lived gRPC stream (pb.CallStatus): each call is a message
with an id, each reply comes back with it. A unary call pays its own RPC's setup both ways (headers, a new HTTP/2
stream, the server's handler and the client's call objects), about half a millisecond a hop on a CPU, twice a
speculative round; on a stream a call is one message each way.

The stream opens at the first call and again after it ended. It ends when the worker goes away or the client closes
it; the calls it carried then fail with the stream's own error, as their unary calls would have. A call's own error
(the worker lost the request, an invalid field) comes back as its reply's status and is raised as the AioRpcError a
unary call would raise, so the client maps both alike."""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)


class CallStream:
    """`call(request)` -> the future of one call's response on the stream `open_stream()` opens (a stub's stream-stream
    method, bound to its metadata), each wrapped as `envelope(call_id=..., request=...)` (pb.VerifyStreamRequest,
    pb.ProposeStreamRequest)."""

    def __init__(self, open_stream: Callable[[], grpc.aio.StreamStreamCall], envelope: Callable):
        self._open = open_stream
        self._envelope = envelope
        self._ids = itertools.count(1)
        self._current: _Stream | None = None
        self._carriers: weakref.WeakKeyDictionary[asyncio.Future, _Stream] = weakref.WeakKeyDictionary()

    def call(self, request) -> asyncio.Future:
        """The future of the call's response (a protobuf message), which fails with the grpc.aio.AioRpcError a unary
        call would raise. Cancelling it leaves the stream open: the reply, when it comes, is dropped."""
        if self._current is None or self._current.ended:
            self._current = _Stream(self._open())
        reply = self._current.call(self._envelope, next(self._ids), request)
        self._carriers[reply] = self._current
        return reply

    async def close(self, carrying: asyncio.Future | None = None) -> None:
        """Cancel the stream (with `carrying`, a call's future: only the stream that carried it, if still open, so
        that a stream another caller opened since is left alone): the calls it carries fail (UNAVAILABLE)."""
        stream = self._current if carrying is None else self._carriers.get(carrying)
        if stream is not None:
            if stream is self._current:
                self._current = None
            await stream.close()


class _Stream:
    """One opened stream: its calls in flight and the task that reads their replies."""

    def __init__(self, stream: grpc.aio.StreamStreamCall):
        self.stream = stream
        self.ended = False
        self.pending: dict[int, asyncio.Future] = {}
        self.writing = asyncio.Lock()  # one write at a time on a stream
        self.writes: set[asyncio.Task] = set()  # held while they run (the loop keeps weak references only)
        self.reader = asyncio.ensure_future(self._read())

    def call(self, envelope: Callable, call_id: int, request) -> asyncio.Future:
        reply = asyncio.get_running_loop().create_future()
        self.pending[call_id] = reply
        reply.add_done_callback(lambda _: self.pending.pop(call_id, None))
        # The write runs as its own task: a write cancelled midway cancels the whole stream (grpc.aio), and a caller
        # that gives up (its client went away) must not fail every other call on it.
        self.writes.add(write := asyncio.ensure_future(self._write(envelope(call_id=call_id, request=request), reply)))
        write.add_done_callback(self.writes.discard)
        return reply

    async def _write(self, message, reply: asyncio.Future) -> None:
        try:
            async with self.writing:
                await self.stream.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            # The stream failed: its reader fails every call it carried with the stream's error, or has done so
            # already, before this call joined.
            if self.ended:
                error = e if isinstance(e, grpc.aio.AioRpcError) else _unavailable(f"the call stream ended: {e}")
                self._fail(reply, error)

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while (envelope := await self.stream.read()) is not grpc.aio.EOF:
                reply = self.pending.get(envelope.call_id)
                if reply is None or reply.done():  # its caller stopped waiting
                    continue
                if envelope.HasField("status"):
                    code = _CODES.get(envelope.status.code, grpc.StatusCode.UNKNOWN)
                    reply.set_exception(_error(code, envelope.status.details))
                else:
                    reply.set_result(envelope.response)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _unavailable("the call stream was closed")
            raise
        except Exception as e:  # noqa: BLE001 - a reply that cannot be read: the stream is no longer trusted
            log.error("a worker's call stream failed", exc_info=e)
            error = _unavailable(f"the call stream failed: {e!r}")
        finally:
            self._end(error or _unavailable("the worker ended the call stream"))

    def _end(self, error: BaseException) -> None:
        """The stream is over: cancelled, and every call still on it failed with `error`."""
        self.ended = True
        self.stream.cancel()
        for reply in list(self.pending.values()):
            self._fail(reply, error)

    @staticmethod
    def _fail(reply: asyncio.Future, error: BaseException) -> None:
        if not reply.done():
            reply.set_exception(error)

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        # A reader cancelled before it first ran never reaches its `finally`: its calls are failed here.
        self._end(_unavailable("the call stream was closed"))


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return _error(grpc.StatusCode.UNAVAILABLE, details)
