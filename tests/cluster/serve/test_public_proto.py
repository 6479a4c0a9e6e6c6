"""The public edges without a server: GenerateRequest messages -> the typed Request (fields named by their proto
path), bytes that are no message, `RequestPreparer.prepare` against a tiny model's context and the app's limits (prompts
refused by their size before tokenizing), and which errors count as refused requests."""

from concurrent import futures

import grpc
import pytest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.edge import PayloadTooLargeError, Request
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.cluster.serve.public_proto import (
    add_servicer_to_server,
    choices_response,
    decode_request,
    refused_status,
    request_from_proto,
    status_for,
)
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.errors import (
    InvalidRequestError,
    KVCapacityError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)
from specserve.workers.models.chat import ChatMessage, ChatPrompt


def g(prompt="hi", ids=None, messages=None, method=None, k=None, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(**sampling))
    req.prompt_token_ids.extend(ids or [])
    req.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages or [])
    if method is not None or k is not None:
        req.speculation.method = method or ""
        req.speculation.k = k or 0
    return req


def test_a_generate_request_becomes_the_typed_request_with_zero_as_unset():
    assert request_from_proto(g()) == Request(model="", prompt="hi", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                                              max_new_tokens=None, method=None, k=None, prompt_field="prompt",
                                              max_new_tokens_field="sampling.max_new_tokens",
                                              controls_prefix="sampling.")  # fmt: skip
    r = request_from_proto(g(temperature=0.5, top_k=2**32 - 1, top_p=0.5, max_new_tokens=7, seed=2**63 - 1,
                             method="ngram"))  # fmt: skip
    assert (r.temperature, r.top_k, r.top_p, r.max_new_tokens, r.seed, r.method, r.k) == (
        0.5, 2**32 - 1, 0.5, 7, 2**63 - 1, "ngram", "auto")  # fmt: skip
    r = request_from_proto(g(prompt="", messages=[("system", "s"), ("user", "u")]))
    assert (
        r.prompt == ChatPrompt((ChatMessage("system", "s"), ChatMessage("user", "u"))) and r.prompt_field == "messages"
    )
    r = request_from_proto(g(prompt="", ids=[1, 2]))
    assert (r.prompt, r.prompt_field) == ((1, 2), "prompt_token_ids")
    assert [request_from_proto(pb.GenerateRequest(prompt="x", n=n)).n for n in (0, 1, 16)] == [1, 1, 16]


def test_n_choices_answer_in_choices_each_with_its_index():
    outs = [{"text": t, "token_ids": [i], "finish_reason": "length", "stats": {}} for i, t in enumerate("ab")]
    answer = choices_response(outs)
    assert not answer.text and not answer.token_ids and not answer.finish_reason  # the choices hold it all
    assert [(c.index, c.text, list(c.token_ids), c.finish_reason) for c in answer.choices] == [
        (0, "a", [0], "length"), (1, "b", [1], "length")]  # fmt: skip


BAD_GRPC = [
    (g(prompt=""), "prompt", "exactly one of"),
    (g(ids=[1]), "prompt", "exactly one of"),
    (g(messages=[("user", "x")]), "prompt", "exactly one of"),
    (g(temperature=-1.0), "sampling.temperature", "greater than or equal to 0"),
    (g(temperature=float("nan")), "sampling.temperature", "finite number"),
    (g(temperature=float("inf")), "sampling.temperature", "finite number"),
    (g(temperature=1e6), "sampling.temperature", "less than or equal to 100"),
    (g(top_p=1.5), "sampling.top_p", "less than or equal to 1"),
    (g(top_p=-0.5), "sampling.top_p", "greater than or equal to 0"),
    (g(top_p=float("nan")), "sampling.top_p", "finite number"),
    (g(seed=2**63), "sampling.seed", "less than 9223372036854775808"),
    (g(seed=2**64 - 1), "sampling.seed", "less than"),
    (g(logprobs=21), "sampling.logprobs", "less than or equal to 20"),
    (g(k=17), "speculation.k", "less than or equal to 16"),
    (g(k=2**32 - 1), "speculation.k", "less than or equal to 16"),
    (g(method="magic"), "speculation.method", "'ngram', 'ngram-tree', 'suffix' or 'none'"),
    (g(method="DRAFT"), "speculation.method", "'draft'"),
    (pb.GenerateRequest(prompt="x", model="m" * 300), "model", "at most 256 characters"),
    (g(prompt="", messages=[("tool", "x")]), "messages[0].role", "'user'"),
    (g(prompt="", messages=[("user", "x")] * 5000), "messages", "5000 messages, the limit is 4096"),
    (pb.GenerateRequest(prompt="x", n=17), "n", "less than or equal to 16"),
    (pb.GenerateRequest(prompt="x", n=2**32 - 1), "n", "less than or equal to 16"),
]


@pytest.mark.parametrize(("request_", "field", "message"), BAD_GRPC, ids=[str(i) for i in range(len(BAD_GRPC))])
def test_bad_generate_requests_name_the_proto_field(request_, field, message):
    with pytest.raises(InvalidRequestError) as e:
        request_from_proto(request_)
    assert e.value.field == field and message in e.value.message, e.value


def test_bytes_that_are_no_message_are_an_invalid_request_not_an_unknown_status():
    assert decode_request(g().SerializeToString()) == g()
    for raw, reason in ((b"\x0a\x02\xff\xfe", "String field had bad UTF-8"), (b"\xff\xff\xff\xff", "corrupt")):
        with pytest.raises(InvalidRequestError) as e:
            request_from_proto(decode_request(raw))
        assert e.value.field == "request" and reason in e.value.message and "GenerateRequest" in e.value.message


class EchoServicer:
    """Answers Generate with the prompt, or INVALID_ARGUMENT as the ingress does."""

    def Generate(self, request, context):  # noqa: N802
        try:
            return pb.GenerateResponse(text=request_from_proto(request).prompt)
        except InvalidRequestError as e:
            context.abort(status_for(e), str(e))

    def GenerateStream(self, request, context):  # noqa: N802
        yield self.Generate(request, context)


def test_the_servicer_registration_answers_undecodable_bytes_with_invalid_argument():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    add_servicer_to_server(EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert pb_grpc.SpecServeStub(channel).Generate(g(prompt="ok"), timeout=10).text == "ok"
            raw = channel.unary_unary("/specserve.v1.SpecServe/Generate")
            with pytest.raises(grpc.RpcError) as e:
                raw(b"\x0a\x02\xff\xfe", timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad UTF-8" in e.value.details()
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def service(tiny_target):
    app = AppConfig.model_validate({"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram",
                                                "device": "cpu"}], "limits": {"max_prompt_tokens": 400}})  # fmt: skip
    return RequestPreparer(app, {"tiny": (tiny_target, None)})


def completion(**body):
    return oai.parse_completion({"prompt": "def f(x):", **body}).request


def test_prepare_fills_max_tokens_to_what_fits_and_keeps_the_distribution(service):
    serving = service.models["tiny"]
    assert (serving.max_positions, serving.vocab_size) == (512, 259) and serving.max_token_chars >= 1
    p = service.prepare(completion(top_k=2**32 - 1))
    prompt = len(p.prompt_ids)  # unset max_tokens: up to the context's end, as vLLM's
    assert p.params.max_new_tokens == 512 - prompt and p.params.top_k == 0 and p.spec.method == "ngram"  # top_k: off
    p = service.prepare(completion(prompt=[5] * 400))
    assert p.params.max_new_tokens == 512 - 400  # unset: what fits, not an error
    p = service.prepare(completion(prompt=[5] * 400, max_tokens=112, top_k=3))
    assert (p.params.max_new_tokens, p.params.top_k) == (112, 3)


@pytest.mark.parametrize(
    ("request_", "field", "message"),
    [
        (completion(prompt=[5] * 400, max_tokens=113), "max_tokens", "This model's maximum context length is 512 "
         "tokens. However, you requested 513 tokens (400 in the messages, 113 in the completion)."),
        (completion(max_tokens=2**64), "max_tokens", "maximum context length is 512 tokens. However, you requested "
         f"{2**64 + 9} tokens (9 in the messages"),
        (oai.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600}).request,
         "max_completion_tokens", "This model's maximum context length is 512 tokens"),
        (request_from_proto(g(max_new_tokens=600)), "sampling.max_new_tokens", "at most 510 new tokens here"),
        (completion(prompt=[5] * 401), "prompt", "This server's maximum prompt length is 400 tokens "
         "(limits.max_prompt_tokens; the model's maximum context length is 512 tokens). However, you requested 401 "
         "tokens in the messages."),
        (completion(prompt=[10**6]), "prompt", "token id 1000000 is outside the vocabulary"),
        (request_from_proto(g(prompt="", ids=[-1])), "prompt_token_ids", "token id -1 is outside"),
        (request_from_proto(g(prompt="", ids=[5] * 9000)), "prompt_token_ids", "you requested 9000 tokens"),
        (completion(prompt="x" * 401), "prompt", "maximum prompt length is 400 tokens"),
        (completion(prompt="x" * 10_000_000), "prompt", "However, the 10000000 characters you sent cannot fit"),
        (oai.parse_chat({"messages": [{"role": "user", "content": "y" * 10_000_000}]}).request, "messages",
         "the 10000000 characters you sent cannot fit"),
        (oai.parse_chat({"messages": [{"role": "user", "content": ""}] * 401}).request, "messages",
         "the 401 messages you sent cannot fit"),
        (completion(model="nope"), "model", "unknown model 'nope'; served: tiny"),
        (completion(speculation={"method": "draft"}), "speculation.method", "has no draft model"),
    ],
)  # fmt: skip
def test_prepare_names_the_clients_field(service, request_, field, message):  # the context's: vLLM's words
    with pytest.raises(InvalidRequestError) as e:
        service.prepare(request_)
    assert e.value.field == field and message in e.value.message, e.value


def test_a_prompt_that_cannot_fit_is_refused_before_the_tokenizer_runs(service, monkeypatch):
    serving = service.models["tiny"]
    limit = 400 * serving.max_token_chars
    monkeypatch.setattr(serving, "tokenizer", None)  # any tokenizer call would fail
    chat = oai.parse_chat({"messages": [{"role": "user", "content": "z" * (limit + 1)}]}).request
    for request in (completion(prompt="z" * (limit + 1)), chat):
        with pytest.raises(InvalidRequestError) as e:
            service.prepare(request)
        assert "characters you sent cannot fit" in e.value.message


def test_refused_requests_are_the_clients_doing():
    cases = [
        (InvalidRequestError("x", "bad"), "400", "INVALID_ARGUMENT"),
        (PayloadTooLargeError("body", "big"), "413", "RESOURCE_EXHAUSTED"),
        (UnauthenticatedError("no key"), "401", "UNAUTHENTICATED"),
        (OverloadedError("busy"), "429", "RESOURCE_EXHAUSTED"),
        (KVCapacityError("full"), "429", "RESOURCE_EXHAUSTED"),
        (UnavailableError("down"), None, None),
        (RuntimeError("bug"), None, None),
    ]
    for error, http, grpc_status in cases:
        assert (refused_status(error, http=True), refused_status(error, http=False)) == (http, grpc_status), error


def test_configured_token_limits_still_cap_and_default(tiny_target):
    """Configs that set the old limits keep them: a cap on max_tokens and a default for an unset one."""
    app = AppConfig.model_validate({"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram",
                                                "device": "cpu"}],
                                    "limits": {"max_new_tokens": 100, "default_max_new_tokens": 30}})  # fmt: skip
    preparer = RequestPreparer(app, {"tiny": (tiny_target, None)})
    assert preparer.prepare(completion()).params.max_new_tokens == 30
    assert preparer.prepare(completion(prompt=[5] * 500)).params.max_new_tokens == 12  # what fits
    with pytest.raises(InvalidRequestError) as e:
        preparer.prepare(completion(max_tokens=101))
    assert e.value.field == "max_tokens" and "exceeds this server's limit of 100" in e.value.message
    assert AppConfig().limits.max_new_tokens is None and AppConfig().limits.default_max_new_tokens is None
