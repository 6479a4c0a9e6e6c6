"""The TLS gateway in front of a SpecServe gRPC server (here a small upstream servicer in the test, standing in for
Serve's proxy; tests/integration/served/test_security.py runs the gateway in front of the real app): messages and
status codes pass
through unchanged, metadata and deadlines are forwarded, plaintext and untrusted clients are refused, mutual TLS
requires a client certificate, and an upstream that is down answers UNAVAILABLE."""

import asyncio
import threading

import grpc
import pytest

from specserve.client import SpecServeClient
from specserve.cluster.serve.tls_gateway import GatewayConfig, GatewayThread
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config.strict import validate
from specserve.workers.errors import InvalidRequestError
from tests.helpers.tls_certs import CertAuthority


class Upstream(pb_grpc.SpecServeServicer):
    """Echoes the prompt's characters as tokens; remembers what each call carried."""

    def __init__(self):
        self.seen: list[dict] = []
        self.stream_cancelled = threading.Event()

    def _record(self, context):
        self.seen.append({"metadata": dict(context.invocation_metadata()), "remaining": context.time_remaining()})

    async def Generate(self, request, context):  # noqa: N802
        self._record(context)
        if request.prompt == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be 'bad'")
        return pb.GenerateResponse(text=request.prompt, token_ids=[ord(c) for c in request.prompt],
                                   finish_reason="length")  # fmt: skip

    async def GenerateStream(self, request, context):  # noqa: N802
        self._record(context)
        finished = False
        try:
            for i, c in enumerate(request.prompt):
                yield pb.GenerateResponse(text=c, token_ids=[ord(c)],
                                          finish_reason="length" if i == len(request.prompt) - 1 else "")  # fmt: skip
            if request.prompt == "forever":
                await asyncio.sleep(3600)
            finished = True
        finally:  # cancelled while writing (GeneratorExit) or while waiting (CancelledError)
            if not finished:
                self.stream_cancelled.set()


@pytest.fixture(scope="module")
def upstream():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = Upstream()

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_SpecServeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield servicer, f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(1), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CertAuthority(tmp_path_factory.mktemp("pki"))
    other = CertAuthority(tmp_path_factory.mktemp("other"), name="another CA")
    return {"ca": ca, "server": ca.issue("gateway"), "client": ca.issue("alice", client=True),
            "stranger": other.issue("mallory", client=True), "other_ca": other.cert_file}  # fmt: skip


def _gateway(pki, upstream_addr: str, **kw) -> GatewayThread:
    key, cert = pki["server"]
    return GatewayThread(GatewayConfig(listen="127.0.0.1:0", upstream=upstream_addr, certfile=cert, keyfile=key, **kw))


@pytest.fixture(scope="module")
def gateway(pki, upstream):
    gw = _gateway(pki, upstream[1])
    yield f"127.0.0.1:{gw.port}"
    gw.stop()


def test_unary_and_stream_pass_through_over_tls(gateway, pki, upstream):
    servicer, _ = upstream
    with SpecServeClient(gateway, timeout_s=30, token="k-1", ca_file=pki["ca"].cert_file) as client:
        out = client.generate("abc")
        chunks = list(client.generate_stream("xyz"))
    assert out["text"] == "abc" and out["token_ids"] == [97, 98, 99] and out["finish_reason"] == "length"
    assert [c["token_ids"] for c in chunks] == [[120], [121], [122]] and chunks[-1]["finish_reason"] == "length"
    for call in servicer.seen[-2:]:
        assert call["metadata"]["authorization"] == "Bearer k-1"
        assert call["metadata"]["application"] == "specserve"  # the gateway names the app when the client did not
        assert 0 < call["remaining"] < 31  # the caller's 30 s deadline travels upstream (not the 3600 s default)


def test_upstream_status_codes_pass_through(gateway, pki):
    with SpecServeClient(gateway, timeout_s=30, ca_file=pki["ca"].cert_file) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("bad")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must not be 'bad'" in err.value.details()
        assert client.generate("ok")["text"] == "ok"  # and the gateway keeps serving


def test_plaintext_and_untrusted_clients_are_refused(gateway, pki):
    with SpecServeClient(gateway, timeout_s=10, retries=0) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.generate("abc")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with SpecServeClient(gateway, timeout_s=10, retries=0, ca_file=pki["other_ca"]) as wrong_ca:
        with pytest.raises(grpc.RpcError) as err:
            wrong_ca.generate("abc")  # the gateway's certificate is not signed by the CA this client trusts
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_cancelled_stream_cancels_the_upstream_call(gateway, pki, upstream):
    servicer, _ = upstream
    servicer.stream_cancelled.clear()
    with SpecServeClient(gateway, timeout_s=30, ca_file=pki["ca"].cert_file) as client:
        stream = client.stub.GenerateStream(client.request("forever"), timeout=30, metadata=client.metadata)
        assert next(stream).token_ids or next(stream).token_ids
        stream.cancel()
    assert servicer.stream_cancelled.wait(10)


def test_mutual_tls_requires_a_certificate_from_the_client_ca(pki, upstream):
    gw = _gateway(pki, upstream[1], client_ca=pki["ca"].cert_file)
    addr, ca = f"127.0.0.1:{gw.port}", pki["ca"].cert_file
    try:
        key, cert = pki["client"]
        with SpecServeClient(addr, timeout_s=30, ca_file=ca, client_cert_file=cert, client_key_file=key) as client:
            assert client.generate("hi")["text"] == "hi"
        for creds in ({}, dict(zip(("client_key_file", "client_cert_file"), pki["stranger"], strict=True))):
            with SpecServeClient(addr, timeout_s=10, retries=0, ca_file=ca, **creds) as client:
                with pytest.raises(grpc.RpcError) as err:
                    client.generate("hi")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gw.stop()


def test_an_upstream_that_is_down_answers_unavailable(pki):
    from specserve.workers.service.local_processes import free_port

    gw = _gateway(pki, f"127.0.0.1:{free_port()}")
    try:
        with SpecServeClient(f"127.0.0.1:{gw.port}", timeout_s=10, retries=0, ca_file=pki["ca"].cert_file) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.generate("abc")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gw.stop()


def test_bad_gateway_config_names_the_field(pki, tmp_path):
    key, cert = pki["server"]
    with pytest.raises(InvalidRequestError, match="keyfile"):
        validate(GatewayConfig, {"certfile": cert, "keyfile": str(tmp_path / "missing.key")})
    with pytest.raises(InvalidRequestError, match="default_timeout_s"):
        validate(GatewayConfig, {"certfile": cert, "keyfile": key, "default_timeout_s": 0})
