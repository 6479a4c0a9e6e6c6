"""Python client of the public SpecServe gRPC service (through Ray Serve's gRPC proxy).

    with SpecServeClient("localhost:9000") as client:
        out = client.generate("def fib(n):", max_new_tokens=32)          # dict: text, token_ids, finish_reason, stats
        out = client.generate(messages=[{"role": "user", "content": "Hi!"}])  # chat, with the model's template
        for chunk in client.generate_stream("def fib(n):"):               # one chunk per round
            print(chunk["text"], end="")

Over TLS (a `specserve gateway` in front of the proxy): `SpecServeClient("host:9443", tls=True, ca_file="ca.pem")`
(omit ca_file to trust the system's roots; add client_cert_file/client_key_file for mutual TLS).

Every call has a deadline. Generate is idempotent (a request holds no server-side state once it fails), so UNAVAILABLE
answers and ingress replicas dying mid-call are retried with backoff; streams are never retried (they may have
delivered chunks already): they end with an error status instead.

Imports only grpc, protobuf and the generated stubs (no torch, pydantic or Ray): an application embedding the client
loads in a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import grpc

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.protos.wire import APP_NAME, GRPC_OPTIONS

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
# Serve's proxy reports an ingress replica that died mid-call as INTERNAL naming Ray's actor error: the call did not
# complete, so an idempotent Generate is retried like UNAVAILABLE.
_DIED = ("ActorDiedError", "RayActorError", "ActorUnavailableError")


def _retryable(error: grpc.RpcError) -> bool:
    if error.code() in _RETRYABLE:
        return True
    return error.code() == grpc.StatusCode.INTERNAL and any(m in (error.details() or "") for m in _DIED)


class SpecServeClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 300.0,
        retries: int = 3,
        app_name: str = APP_NAME,
        token: str | None = None,
        tls: bool = False,
        ca_file: str | None = None,
        client_cert_file: str | None = None,
        client_key_file: str | None = None,
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.metadata = [("application", app_name)]
        if token:
            self.metadata.append(("authorization", f"Bearer {token}"))
        if tls or ca_file or client_cert_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(ca_file), private_key=_read(client_key_file),
                certificate_chain=_read(client_cert_file),
            )  # fmt: skip
            self.channel = grpc.secure_channel(address, creds, options=GRPC_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.SpecServeStub(self.channel)

    def __enter__(self) -> SpecServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def request(
        prompt: str | list[int] | None = None,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        method: str = "",
        k: int | str | None = None,
        model: str = "",
        messages: list[dict] | None = None,
        stop: list[str] | tuple[str, ...] = (),
        stop_token_ids: list[int] | tuple[int, ...] = (),
        include_stop_str_in_output: bool = False,
        ignore_eos: bool = False,
        controls: dict | None = None,
        logprobs: int | None = None,
        response_format: dict | None = None,
        n: int = 1,
    ) -> pb.GenerateRequest:
        """A GenerateRequest: a raw `prompt` (text or token ids), or chat `messages` ([{"role", "content"}, ...])
        that the server renders with the model's chat template; `stop` sequences and `stop_token_ids` end it.
        `controls`: SamplingParams' logits controls by name (presence_penalty, frequency_penalty, repetition_penalty,
        min_p, min_tokens, and logit_bias as {token id: bias}). `logprobs`: also return the target's log-probability of
        every token and this many alternatives (0..20; the dicts' "logprobs": [{"logprob", "top": [[id, logprob]]}]).
        `response_format`: OpenAI's ({"type": "json_object"}, or {"type": "json_schema", "json_schema": {"schema":
        {...}}}): the output is JSON, valid against the schema. `n`: choices (1..16, each its own request, seeded
        seed + index): `generate` then returns {"choices": [result, ...]}, each result with its "index", and
        `generate_stream`'s chunks interleave, each saying its choice's "index"."""
        sampling = pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                     ignore_eos=ignore_eos, **(controls or {}))  # fmt: skip
        if seed is not None:
            sampling.seed = seed
        if logprobs is not None:
            sampling.logprobs = logprobs
        if response_format is not None:
            schema = (response_format.get("json_schema") or {}).get("schema")
            text = "" if schema is None else json.dumps(schema)
            sampling.response_format.CopyFrom(pb.ResponseFormat(type=response_format["type"], json_schema=text))
        req = pb.GenerateRequest(model=model, sampling=sampling, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                 include_stop_str_in_output=include_stop_str_in_output,
                                 n=0 if n == 1 else n)  # fmt: skip
        if messages is not None:
            req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        if isinstance(prompt, str):
            req.prompt = prompt
        elif prompt is not None:
            req.prompt_token_ids.extend(prompt)
        if method or k is not None:
            req.speculation.method = method
            req.speculation.k = 0 if k in (None, "auto") else int(k)
        return req

    def generate(self, prompt: str | list[int] | None = None, **kw) -> dict:
        req = self.request(prompt, **kw)
        delay = 0.5
        for attempt in range(self.retries + 1):
            try:
                out = self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata)
                if out.choices:
                    return {"choices": [{**_to_dict(c), "index": c.index} for c in out.choices]}
                return _to_dict(out)
            except grpc.RpcError as e:
                if not _retryable(e) or attempt == self.retries:
                    raise
                log.info("Generate on %s: %s (%s); retry %d of %d in %.1f s", self.address, e.code().name,
                         e.details(), attempt + 1, self.retries, delay)  # fmt: skip
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def generate_stream(self, prompt: str | list[int] | None = None, **kw) -> Iterator[dict]:
        req = self.request(prompt, **kw)
        for chunk in self.stub.GenerateStream(req, timeout=self.timeout_s, metadata=self.metadata):
            if chunk.token_ids or chunk.finish_reason:  # Serve may send an empty first message
                yield {**_to_dict(chunk), "index": chunk.index}


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _logprobs(msg: pb.Logprobs) -> list[dict]:
    """GenerateResponse.logprobs' columns -> one {"logprob", "top": [[id, logprob], ...]} per token."""
    n = len(msg.top_token_ids) // len(msg.token_logprobs) if msg.token_logprobs else 0
    ids, values = list(msg.top_token_ids), list(msg.top_logprobs)
    rows = [(ids[i * n : i * n + n], values[i * n : i * n + n]) for i in range(len(msg.token_logprobs))]
    return [{"logprob": v, "top": [list(pair) for pair in zip(*row, strict=True)]}
            for v, row in zip(msg.token_logprobs, rows, strict=True)]  # fmt: skip


def _to_dict(msg: pb.GenerateResponse) -> dict:
    s = msg.stats
    out = {
        "text": msg.text,
        "token_ids": list(msg.token_ids),
        "finish_reason": msg.finish_reason or None,
        "stats": {
            "rounds": s.rounds,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
        },
    }
    if msg.HasField("logprobs"):
        out["logprobs"] = _logprobs(msg.logprobs)
    return out
