"""TLS for the public gRPC API.

Serve's gRPC proxy (ray 2.60) listens in plaintext only: `add_insecure_port` on every node, no TLS option. The
gateway terminates TLS (optionally requiring client certificates) and forwards each SpecServe call to that proxy
byte for byte: it neither parses nor re-encodes messages, so auth, validation and status codes stay the app's own.
Run it beside the proxy (`specserve serve --grpc-tls-cert/--grpc-tls-key` starts one in-process; `specserve gateway`
is the same thing as a sidecar container) and keep the proxy's plaintext port private.

Every forwarded call carries the caller's deadline (or `default_timeout_s` when it sent none) and its metadata
(`authorization` included); `application` defaults to the configured app. An upstream that is down answers
UNAVAILABLE; a caller that goes away cancels the upstream call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from pydantic import Field, FilePath, model_validator

from specserve.cluster.app_config import APP_NAME
from specserve.protos.wire import SERVICE_NAME
from specserve.workers.config.strict import StrictModel

SERVICE = SERVICE_NAME
_DROPPED = ("user-agent", "content-type", "te", "grpc-", ":")  # transport headers: the upstream call sets its own


class GatewayConfig(StrictModel):
    """One TLS gateway in front of Serve's gRPC proxy."""

    listen: str = Field("0.0.0.0:9443", min_length=1, description="host:port the TLS server binds (port 0: any).")
    upstream: str = Field("127.0.0.1:9000", min_length=1, description="host:port of Serve's gRPC proxy.")
    certfile: FilePath = Field(description="PEM certificate chain the gateway presents.")
    keyfile: FilePath = Field(description="PEM private key of the certificate.")
    client_ca: FilePath | None = Field(None, description="PEM CA bundle; when set, clients must present a "
                                       "certificate it signed (mutual TLS).")  # fmt: skip
    app_name: str = Field(APP_NAME, min_length=1, description="Serve application for calls that name none.")
    default_timeout_s: float = Field(3600.0, gt=0, description="Deadline of forwarded calls that arrive without one.")
    max_message_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest request or response message, as the app's "
        "limits.max_grpc_message_bytes (larger ones are refused, not buffered)."
    )  # fmt: skip

    @model_validator(mode="after")
    def _readable(self):
        for f in (self.certfile, self.keyfile, self.client_ca):
            if f is not None:
                Path(f).read_bytes()  # fails here, naming the file, rather than at the first handshake
        return self


def server_credentials(config: GatewayConfig) -> grpc.ServerCredentials:
    ca = Path(config.client_ca).read_bytes() if config.client_ca else None
    pair = (Path(config.keyfile).read_bytes(), Path(config.certfile).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class Forwarder:
    """The two SpecServe methods, forwarded as raw bytes over one upstream channel."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", config.max_message_bytes)]  # fmt: skip
        self.channel = grpc.aio.insecure_channel(config.upstream, options=options)
        self._unary = self.channel.unary_unary(f"/{SERVICE}/Generate")  # no (de)serializers: bytes pass through
        self._stream = self.channel.unary_stream(f"/{SERVICE}/GenerateStream")

    def _call_args(self, context: grpc.aio.ServicerContext) -> dict:
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if not k.startswith(_DROPPED)]
        if not any(k == "application" for k, _ in metadata):
            metadata.append(("application", self.config.app_name))
        remaining = context.time_remaining()
        timeout = self.config.default_timeout_s if remaining is None else max(0.001, remaining)
        return {"metadata": metadata, "timeout": timeout}

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await self._unary(request, **self._call_args(context))
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")

    async def generate_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        call = self._stream(request, **self._call_args(context))
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")
        finally:
            call.cancel()  # a no-op once it finished; stops the upstream call if our caller went away

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_unary_rpc_method_handler(self.generate),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(self.generate_stream),
        })  # fmt: skip

    async def close(self) -> None:
        await self.channel.close()


async def create_gateway(config: GatewayConfig) -> tuple[grpc.aio.Server, int, Forwarder]:
    """A started TLS gateway: (server, bound port, forwarder); stop with `server.stop(grace)`, `forwarder.close()`."""
    forwarder = Forwarder(config)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_message_bytes),
                                      ("grpc.max_send_message_length", config.max_message_bytes)])  # fmt: skip
    server.add_generic_rpc_handlers((forwarder.handler(),))
    port = server.add_secure_port(config.listen, server_credentials(config))
    if port == 0:
        raise OSError(f"gateway could not bind {config.listen}")
    await server.start()
    return server, port, forwarder


class GatewayThread:
    """A gateway on its own event loop thread, for processes that are not asyncio (`specserve serve`)."""

    def __init__(self, config: GatewayConfig):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="specserve-tls-gateway", daemon=True)
        self._thread.start()
        self.server, self.port, self.forwarder = asyncio.run_coroutine_threadsafe(
            create_gateway(config), self.loop
        ).result(timeout=30)

    def stop(self, grace_s: float = 5.0) -> None:
        async def _stop():
            await self.server.stop(grace_s)
            await self.forwarder.close()

        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(timeout=grace_s + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def serve_gateway(config: GatewayConfig, stop: asyncio.Event) -> None:
    """`specserve gateway`: serve until `stop` is set, then drain for up to 5 s."""
    server, port, forwarder = await create_gateway(config)
    print(f"specserve TLS gateway on port {port} -> {config.upstream} ({SERVICE})", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(5.0)
        await forwarder.close()
