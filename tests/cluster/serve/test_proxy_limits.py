"""The HTTP body limit that runs inside Serve's proxy, driven as a plain ASGI middleware: oversize bodies get 413
without reaching the app (declared) or reaching it past the limit (streamed), after the rest is read and dropped up
to a bound; others pass through untouched."""

import asyncio
import json

from specserve.cluster.serve import proxy_limits
from specserve.cluster.serve.proxy_limits import BodyLimit


class App:
    """Reads the whole body like the ingress would, then answers 200 (or whatever `status`)."""

    def __init__(self):
        self.called, self.body, self.ended = False, b"", None

    async def __call__(self, scope, receive, send):
        self.called = True
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.ended = "disconnect"
                break
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                self.ended = "complete"
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def run(body_chunks: list[bytes], headers=(), limit: int = 25):
    app, sent, reads = App(), [], [0]
    chunks = list(body_chunks)

    async def receive():
        reads[0] += 1
        body = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}
    asyncio.run(BodyLimit(app, max_bytes=limit)(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return app, status, body, reads[0], len([m for m in sent if m["type"] == "http.response.start"])


def test_a_declared_oversize_body_is_refused_before_the_app():
    app, status, body, reads, starts = run([b"x" * 50] * 2, headers=[(b"content-length", b"100")])
    assert (status, reads, app.called, starts) == (413, 2, False, 1)  # read and dropped: the client gets the 413
    error = json.loads(body)["error"]
    assert error["param"] == "body" and error["type"] == "invalid_request_error" and "100 bytes" in error["message"]


def test_a_streamed_oversize_body_is_cut_off_at_the_limit():
    app, status, body, reads, starts = run([b"x" * 10] * 100)  # chunked: no content-length
    assert status == 413 and starts == 1  # the app's own 200 after the disconnect is not sent
    assert app.ended == "disconnect" and len(app.body) == 20  # the app never sees more than the limit
    assert reads == 100  # the rest read and dropped, so the client reads the 413
    assert "limit of 25 bytes" in json.loads(body)["error"]["message"]


def test_draining_stops_at_its_bound(monkeypatch):
    monkeypatch.setattr(proxy_limits, "DRAIN_BYTES", 200)
    _, status, _, reads, _ = run([b"x" * 10] * 1000, headers=[(b"content-length", b"10000")])
    assert (status, reads) == (413, 20)
    _, status, _, reads, _ = run([b"x" * 10] * 1000)
    assert (status, reads) == (413, 20)


def test_bodies_within_the_limit_pass_through():
    app, status, body, reads, _ = run([b"x" * 10, b"y" * 15], headers=[(b"content-length", b"25")])
    assert (status, body, app.body, app.ended) == (200, b"ok", b"x" * 10 + b"y" * 15, "complete")


def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(BodyLimit(app, max_bytes=1)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_the_proxy_callback_reads_its_limit_from_the_environment(monkeypatch):
    env = proxy_limits.proxy_env(1234, 5678)
    assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == "1234"
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "specserve.cluster.serve.proxy_limits.proxy_middlewares"
    monkeypatch.setenv(proxy_limits.BODY_BYTES_ENV, env[proxy_limits.BODY_BYTES_ENV])
    (middleware,) = proxy_limits.proxy_middlewares()
    assert middleware.cls is BodyLimit and middleware.kwargs == {"max_bytes": 5678}
    monkeypatch.delenv(proxy_limits.BODY_BYTES_ENV)
    assert proxy_limits.proxy_middlewares() == []
