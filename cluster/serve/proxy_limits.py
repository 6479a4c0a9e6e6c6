"""Limits applied inside Ray Serve's proxies, set through the environment they read (Serve 2.60 has no config keys for
them): the gRPC proxy's largest message, and an HTTP request-body limit in front of the HTTP proxy.

Serve's HTTP proxy forwards a body to the replica without backpressure: it reads the body as fast as the client sends
into an unbounded queue, which the replica drains into another, whether or not the app reads it. So the ingress's own
413 comes after the whole body sits in memory twice (a 256 MB chunked upload grew the proxy and the ingress by about
300 MB). `BodyLimit` runs in the proxy, ahead of that queue (Serve's RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH hook
returns it): a declared Content-Length over the limit is answered 413 before the app sees the request, and a body
without one is counted as it arrives and cut off at the limit (413 to the client, a disconnect to the app). Before the
413 it reads and drops up to DRAIN_BYTES more of the body, as nginx's lingering close does: a client that sends its
whole body before reading the answer (most do) then gets the 413 instead of a connection reset; memory stays flat.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

GRPC_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # read by Serve's gRPC proxy at import (2 GiB by default)
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # Serve calls it for the HTTP proxy's middlewares
CALLBACK = "specserve.cluster.serve.proxy_limits.proxy_middlewares"
BODY_BYTES_ENV = "SPECSERVE_PROXY_MAX_REQUEST_BYTES"
log = logging.getLogger(__name__)
DRAIN_BYTES = 128 * 1024 * 1024
DRAIN_S = 2.0  # a client that announced a body and sends none (or slowly) still gets its 413 this soon


def proxy_env(max_grpc_message_bytes: int, max_request_bytes: int) -> dict[str, str]:
    """The environment of a Serve proxy that enforces these limits."""
    return {
        GRPC_MESSAGE_ENV: str(max_grpc_message_bytes),
        CALLBACK_ENV: CALLBACK,
        BODY_BYTES_ENV: str(max_request_bytes),
    }


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback: the body limit from $SPECSERVE_PROXY_MAX_REQUEST_BYTES (none when unset)."""
    from starlette.middleware import Middleware

    limit = int(os.environ.get(BODY_BYTES_ENV) or 0)
    return [Middleware(BodyLimit, max_bytes=limit)] if limit > 0 else []


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses it before any app runs
    return None


async def _drain(receive, received: int) -> None:
    """Read and drop the rest of the body, up to DRAIN_BYTES in all and for at most DRAIN_S seconds."""
    try:
        await asyncio.wait_for(_drain_all(receive, received), DRAIN_S)
    except TimeoutError:
        pass


async def _drain_all(receive, received: int) -> None:
    while received < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        received += len(message.get("body", b""))
        if not message.get("more_body"):
            return


class BodyLimit:
    """ASGI middleware: HTTP request bodies over `max_bytes` get 413 (OpenAI's error shape) without being buffered."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.metrics = None  # made on the first refusal, inside the proxy actor

    def _count(self, path: str) -> None:
        """The ingress's refused-requests counter, for the 413s the ingress never sees."""
        try:
            if self.metrics is None:
                from specserve.cluster.serve.metrics import IngressMetrics

                self.metrics = IngressMetrics()
            self.metrics.refuse(path, "413")
        except Exception:  # noqa: BLE001 - a metrics failure must not turn a 413 into a 500
            log.exception("could not count a refused request")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, 0)
            self._count(scope.get("path", ""))
            return await self._refuse(send, declared)
        received, refused, started = 0, False, False

        async def counting_receive():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        if message.get("more_body"):
                            await _drain(receive, received)
                        self._count(scope.get("path", ""))
                        await self._refuse(send, None)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refused and not started:
                return  # the client has the 413 already
            started = True
            await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send, size: int | None) -> None:
        """size: the declared Content-Length, None for a streamed body cut off at the limit."""
        if size is None:
            message = f"invalid body: longer than the limit of {self.max_bytes} bytes"
        else:
            message = f"invalid body: {size} bytes exceed the limit of {self.max_bytes}"
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": "body", "code": None}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
