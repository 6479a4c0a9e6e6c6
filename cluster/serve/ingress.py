"""The ingress deployment: both public APIs, the SpecServe gRPC service (through Serve's gRPC proxy) and the
OpenAI-compatible HTTP API (FastAPI). Each request is authenticated, validated once by its edge (public_proto.py,
openai_api.py), checked against the model and tokenized here (prepare.py), and handed to a scheduler replica as a
`Prepared` request through a deployment handle: one call per request, which streams one chunk per round back."""

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from specserve.cluster.app_config import AppConfig, app_config
from specserve.cluster.scheduling.prepared import Chunk, Prepared
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.choices import after, indexed, per_choice, started
from specserve.cluster.serve.edge import REQUEST_ID_HEADER, PayloadTooLargeError, client_message, request_id
from specserve.cluster.serve.error_mapping import call_scheduler, http_error, scheduler_error, set_grpc_error
from specserve.cluster.serve.health import Readiness
from specserve.cluster.serve.ignored_fields import IgnoredFields
from specserve.cluster.serve.openai_echo import streamed, whole
from specserve.cluster.serve.openai_endpoints import parse_detokenize, parse_tokenize
from specserve.cluster.serve.openai_logprobs import LogprobsShaper, TokenTexts
from specserve.cluster.serve.openai_tools import ToolStream, with_tool_calls
from specserve.cluster.serve.public_proto import (
    choices_response,
    http_status_for,
    refused_status,
    request_from_proto,
    response,
    result_response,
)
from specserve.cluster.serve.replica_env import resolve_paths, use_serve_log_files
from specserve.workers.errors import SpecServeError, UnauthenticatedError

log = logging.getLogger(__name__)

http_app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding", docs_url=None)


class SpecServeIngress:
    """Holds no request state, so a replica lost here loses no work that a retry would not redo."""

    def __init__(self, app_args: dict, scheduler: Any):
        from specserve.cluster.serve.metrics import IngressMetrics
        from specserve.cluster.serve.prepare import RequestPreparer

        use_serve_log_files()
        self.config: AppConfig = app_config(app_args)
        self.metrics = IngressMetrics()
        self.preparer = RequestPreparer(self.config, {m.name: resolve_paths(m) for m in self.config.models})
        self.scheduler = scheduler
        self.created = int(time.time())
        self._ignored = IgnoredFields()  # unknown request fields, said in the log (rate-limited)
        self._token_texts: dict[str, TokenTexts] = {}  # model -> its tokens' texts, for OpenAI's logprobs
        env = self.config.auth.api_key_env
        self._api_key = (os.environ.get(env) or None) if env else None
        log.info("ingress started: models %s, API key %s", ", ".join(self.preparer.models),
                 "required" if self._api_key else "not required")  # fmt: skip

    async def status(self) -> dict:
        return await call_scheduler(self.scheduler.status.remote())

    async def wait_ready(self, timeout_s: float) -> None:
        await call_scheduler(self.scheduler.wait_ready.remote(timeout_s))

    def _check_key(self, authorization: str | None) -> None:
        if self._api_key is None:
            return
        sent = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent.encode(errors="surrogatepass"), self._api_key.encode(errors="surrogatepass")):
            raise UnauthenticatedError("missing or wrong API key (send 'authorization: Bearer <key>')")

    def _check_grpc_key(self, grpc_context) -> None:
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        self._check_key(metadata.get("authorization"))

    async def _generate(self, prepared: Prepared) -> dict:
        return await call_scheduler(self.scheduler.generate.remote(prepared))

    async def _run(self, prepared: Prepared) -> AsyncIterator[Chunk]:
        chunks = self.scheduler.options(stream=True).run.remote(prepared)
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # noqa: BLE001 - a scheduler replica's error or death, as a specserve error
            raise scheduler_error(e) from None

    def _refused(self, route: str, error: BaseException, status: str | None, rid: str | None = None) -> None:
        """Count and log a request that ends in an error: refused (the client's doing) at INFO with the field it
        names, a specserve fault at WARNING; any other error is a bug, logged with its traceback by
        `client_message` as it is answered. rid: the request's id."""
        rid = (rid or "-")[:128]
        if status:
            if not getattr(error, "counted", False):
                self.metrics.refuse(route, status)
            log.info("refused %s request %s (%s, field %s): %s", route, rid, status, getattr(error, "field", None),
                     error)  # fmt: skip
        elif isinstance(error, SpecServeError):
            log.warning("%s request %s failed: %s", route, rid, _what(error))

    # -- gRPC: the public SpecServe service ------------------------------------------------------------------------

    async def Generate(self, request, grpc_context):  # noqa: N802 - gRPC method name
        rid = None
        try:
            rid = _grpc_request_id(grpc_context)
            self._check_grpc_key(grpc_context)
            typed = request_from_proto(request)
            prepared = self.preparer.prepare(typed, rid)
            if typed.n > 1:  # each choice its own request (choices.py)
                outs = await asyncio.gather(*(self._generate(p) for p in per_choice(prepared, typed.n)))
                return choices_response(outs)
            return result_response(await self._generate(prepared))
        except Exception as e:
            self._grpc_failed("Generate", grpc_context, e, rid)
            raise

    async def GenerateStream(self, request, grpc_context):  # noqa: N802 - gRPC method name
        begun, rid = False, None
        try:
            rid = _grpc_request_id(grpc_context)
            self._check_grpc_key(grpc_context)
            typed = request_from_proto(request)
            prepared = self.preparer.prepare(typed, rid)
            chunks = (await started([self._run(p) for p in per_choice(prepared, typed.n)]) if typed.n > 1
                      else indexed(self._run(prepared)))  # fmt: skip
            async for i, chunk in chunks:
                begun = True
                yield response(chunk.text, chunk.token_ids, chunk.finish_reason, chunk.stats, chunk.logprobs, i)
        except Exception as e:
            self._grpc_failed("GenerateStream", grpc_context, e, rid, refused=not begun)
            raise

    def _grpc_failed(self, method: str, grpc_context, error: BaseException, rid: str | None,
                     refused: bool = True) -> None:  # fmt: skip
        status = refused_status(error, http=False) if refused else None
        self._refused(f"/specserve.v1.SpecServe/{method}", error, status, rid)
        set_grpc_error(grpc_context, error, rid)

    # -- HTTP: OpenAI-compatible -----------------------------------------------------------------------------------

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._check_key(request.headers.get("authorization"))
        except UnauthenticatedError as e:
            return self._refuse("/v1/models", e)
        return JSONResponse(oai.models_list([m.name for m in self.config.models], self.created))

    async def _readiness(self) -> Readiness | None:
        """None when no scheduler replica answers (the app is starting or gone)."""
        try:
            return await call_scheduler(self.scheduler.readiness.remote())
        except Exception as e:  # noqa: BLE001 - not ready, whatever the reason
            log.info("readiness: no scheduler replica answered: %s", _what(e))
            return None

    @http_app.get("/v1/models/{name}")
    async def model(self, name: str, request: Request) -> JSONResponse:
        try:
            self._check_key(request.headers.get("authorization"))
            if name not in {m.name for m in self.config.models}:
                body = oai.error_body(f"unknown model {name!r}", "invalid_request_error", "model", "model_not_found")
                return JSONResponse(body, status_code=404)
            return JSONResponse(oai.model_card(name, self.created))
        except Exception as e:  # noqa: BLE001 - answered as an OpenAI error
            return self._refuse("/v1/models/{name}", e)

    @http_app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        answer = lambda body, ignored: self.preparer.tokenize(*parse_tokenize(body, ignored))  # noqa: E731
        return await self._json_call(request, "/tokenize", answer)

    @http_app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        answer = lambda body, ignored: self.preparer.detokenize(*parse_detokenize(body, ignored))  # noqa: E731
        return await self._json_call(request, "/detokenize", answer)

    async def _json_call(self, request: Request, route: str, answer) -> JSONResponse:
        """A small JSON endpoint: the key checked, the body read within the limit, `answer(body, ignored)` (unknown
        fields ignored into the list, unless strict) or an OpenAI error."""
        try:
            self._check_key(request.headers.get("authorization"))
            ignored = None if self.config.http.strict else []
            out = answer(await _json_body(request, self.config.limits.max_request_bytes), ignored)
            self._ignored.note(route, ignored, request.headers.get(REQUEST_ID_HEADER))
            return JSONResponse(out)
        except Exception as e:  # noqa: BLE001 - answered as an OpenAI error
            return self._refuse(route, e)

    @http_app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when ready; 503 while draining, while a model has no healthy target worker, or before the app is up."""
        readiness = await self._readiness()
        if readiness is None:
            body = {"status": "unavailable", "problems": ["no scheduler replica answered"], "models": {}}
            return JSONResponse(body, status_code=503)
        return JSONResponse(readiness.to_json(), status_code=200 if readiness.ready else 503)

    # -- gRPC: the standard health service (grpc.health.v1) --------------------------------------------------------

    async def Check(self, request, grpc_context):  # noqa: N802 - gRPC method name
        from grpc_health.v1 import health_pb2

        readiness = await self._readiness()
        serving = False if readiness is None else readiness.serving(request.service)
        if serving is None:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}: ask for '' or a served model's name")
            return health_pb2.HealthCheckResponse()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, grpc_context):  # noqa: N802 - gRPC method name
        """The status now, then each change (polled every second), while the client listens."""
        last = None
        while True:
            response = await self.Check(request, grpc_context)
            if grpc_context.code() == grpc.StatusCode.NOT_FOUND:
                return
            if response.status != last:
                last = response.status
                yield response
            await asyncio.sleep(1.0)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, "/v1/completions")

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, "/v1/chat/completions")

    async def _openai(self, request: Request, route: str):
        chat = route == "/v1/chat/completions"
        # Serve's HTTP proxy puts the client's x-request-id (or one it makes) in the headers and on every response.
        sent = request.headers.get(REQUEST_ID_HEADER)
        try:
            prepared_id = request_id(sent)
            self._check_key(request.headers.get("authorization"))
            body = await _json_body(request, self.config.limits.max_request_bytes)
            strict = self.config.http.strict
            parsed = oai.parse_chat(body, strict) if chat else oai.parse_completion(body, strict)
            self._ignored.note(route, parsed.ignored, prepared_id)
            prepared = self.preparer.prepare(parsed.request, prepared_id)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{prepared_id}"
            shaper = self._logprobs_shaper(prepared, chat)
            if parsed.echo:
                parsed = dataclasses.replace(parsed, echo_text=self._prompt_text(parsed, prepared))
            if parsed.n > 1:
                return await self._choices(rid, per_choice(prepared, parsed.n), parsed, chat, shaper)
            if not parsed.stream:
                out = whole(await self._generate(prepared), parsed, shaper, prepared.prompt_ids)
                return JSONResponse(_answer(parsed, oai.completion_response(rid, prepared.model, out, chat)))
            # The first round's chunk before the 200 and its headers are sent: a refusal (over capacity, no
            # workers) is still an HTTP status, with no round trip to ask for admission first.
            chunks = self._run(prepared)
            first = await anext(chunks, None)
            return StreamingResponse(self._sse(rid, prepared, indexed(after(first, chunks)), parsed, chat, shaper),
                                     media_type="text/event-stream")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-shaped error
            return self._refuse(route, e, sent)

    async def _choices(self, rid: str, prepared: list[Prepared], parsed, chat: bool, shaper: LogprobsShaper | None):
        """`n` choices: each its own request, answered together or streamed as their rounds come."""
        if not parsed.stream:
            outs = await asyncio.gather(*(self._generate(p) for p in prepared))
            outs = [whole(out, parsed, shaper, prepared[i].prompt_ids, i) for i, out in enumerate(outs)]
            return JSONResponse(_answer(parsed, oai.completion_response(rid, prepared[0].model, outs, chat)))
        chunks = await started([self._run(p) for p in prepared])  # refusals before the 200, as for one
        return StreamingResponse(self._sse(rid, prepared[0], chunks, parsed, chat, shaper),
                                 media_type="text/event-stream")  # fmt: skip

    def _logprobs_shaper(self, prepared: Prepared, chat: bool) -> LogprobsShaper | None:
        """OpenAI's shapes of the logprobs of a request that asks for them, the prompt's too (token texts by its
        model's tokenizer)."""
        if prepared.params.logprobs is None and prepared.params.prompt_logprobs is None:
            return None
        texts = self._token_texts.get(prepared.model)
        if texts is None:
            texts = self._token_texts[prepared.model] = TokenTexts(self.preparer.models[prepared.model].tokenizer)
        return LogprobsShaper(texts, chat)

    def _prompt_text(self, parsed, prepared: Prepared) -> str:
        """What `echo` puts before a completion's text: its prompt as sent, a prompt of token ids decoded (vLLM's)."""
        prompt = parsed.request.prompt
        return prompt if isinstance(prompt, str) else self.preparer.models[prepared.model].tokenizer.decode(prompt)

    def _refuse(self, route: str, error: BaseException, rid: str | None = None) -> JSONResponse:
        """The error response; counted when the client caused it (4xx)."""
        self._refused(route, error, refused_status(error, http=True), rid)
        return http_error(error)

    async def _sse(self, rid: str, prepared: Prepared, chunks: AsyncIterator[tuple[int, Chunk]], parsed, chat: bool,
                   shaper: LogprobsShaper | None) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events of one choice or several (chunks by choice index); the tool calls a chat answer makes
        parsed per choice (openai_tools.ToolStream)."""
        generated, stats, calls, sent, counts = 0, {}, {}, set(), {}
        tools = parsed.request.tool_calls
        try:
            async with contextlib.aclosing(chunks):
                async for i, chunk in chunks:
                    new = 0 if parsed.echo_only else len(chunk.token_ids)  # max_tokens 0: the prompt alone
                    chunk = streamed(chunk, parsed, prepared.prompt_ids, i not in sent)  # echo (openai_echo.py)
                    generated += new
                    counts[i] = counts.get(i, 0) + new
                    stats = chunk.stats if parsed.n == 1 else {}  # one request's
                    text, finish, tool_calls = chunk.text, chunk.finish_reason, None
                    if tools is not None:
                        text, finish, tool_calls = calls.setdefault(i, ToolStream(tools)).step(text, finish)
                    if text or finish or chunk.logprobs:  # a chunk's text may be held back
                        logprobs = shaper.shape(chunk.token_ids, chunk.logprobs, i) if shaper else None
                        usage = (len(prepared.prompt_ids), counts[i]) if parsed.continuous_usage else None
                        yield oai.stream_chunk(rid, prepared.model, text, finish, chat, i not in sent, index=i,
                                               logprobs=logprobs, tool_calls=tool_calls, usage=usage)  # fmt: skip
                        sent.add(i)  # the role goes with a choice's first event
            if parsed.include_usage:
                yield oai.usage_chunk(rid, prepared.model, len(prepared.prompt_ids), generated, stats, chat)
            yield oai.sse("[DONE]")
        except Exception as e:  # noqa: BLE001 - headers are sent: report the error as an event
            log.warning("stream %s of %s failed after its first chunk: %s", rid, prepared.model, _what(e))
            _, kind = http_status_for(e)
            yield oai.sse(oai.error_body(client_message(e), kind, getattr(e, "field", None)))


# Applied at import time in every process: Serve pickles the ingress class by reference to this module, and the
# FastAPI routes must be rebound to the class in the replica's copy of `http_app` too.
IngressDeployment = serve.ingress(http_app)(SpecServeIngress)


def _answer(parsed, response: dict) -> dict:
    """A chat answer whose tool calls (forced, or written under tool_choice "auto") become `tool_calls`
    (openai_tools.py)."""
    return response if parsed.request.tool_calls is None else with_tool_calls(response, parsed.request.tool_calls)


def _grpc_request_id(grpc_context) -> str:
    """The call's id: its x-request-id metadata, else Serve's request_id (metadata, or one Serve made); returned to
    the client in the trailing metadata, errors included."""
    metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
    sent = metadata.get(REQUEST_ID_HEADER) or (grpc_context.request_id() if grpc_context is not None else None)
    rid = request_id(sent)  # refused (INVALID_ARGUMENT) when malformed
    if grpc_context is not None:
        grpc_context.set_trailing_metadata([(REQUEST_ID_HEADER, rid)])
    return rid


def _what(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


async def _json_body(request: Request, max_bytes: int) -> Any:
    from starlette.requests import ClientDisconnect

    try:
        return await oai.read_json(request.stream(), request.headers.get("content-length"), max_bytes)
    except ClientDisconnect:  # Serve's proxy cut an oversize chunked body off: its 413 is sent and counted already
        error = PayloadTooLargeError("body", f"is longer than the limit of {max_bytes} bytes")
        error.counted = True
        raise error from None
