"""The ingress's last step before a request leaves it: the typed `Request` an edge validated, checked against the
served model and the app's limits (cheapest first: a prompt's size before it is tokenized), tokenized with the
model's tokenizer and turned into the `Prepared` request a scheduler replica runs as it is.

Needs tokenizers only (loaded once per ingress replica): no scheduler, no workers.
"""

from __future__ import annotations

from specserve.cluster.app_config import AppConfig, LimitsConfig, ModelPairConfig
from specserve.cluster.scheduling.prepared import Prepared
from specserve.cluster.scheduling.stops import StopSpec
from specserve.cluster.scheduling.tokens import ModelTokenizer
from specserve.cluster.serve.edge import Request
from specserve.cluster.serve.generation_defaults import load_generation_defaults
from specserve.cluster.serve.openai_tools import check_auto
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatPrompt, chat_prompt_ids, takes_tools, writes_hermes_calls
from specserve.workers.runtime.worker_state import check_token_ids
from specserve.workers.speculation.eagle.config import resolve_eagle_head
from specserve.workers.speculation.methods import HEAD_DEFAULT, LOOKUP_DEFAULT, METHODS, MODEL_DEFAULT, NONE, servable
from specserve.workers.speculation.request import encode_prompt

MAX_NEW_TOKENS = 1_000_000  # SamplingParams' bound
NO_CONTEXT_MAX_NEW_TOKENS = 4096  # an unset max_tokens where neither the model's config nor the limits bound it


class RequestPreparer:
    """models: served name -> its ModelTokenizer."""

    def __init__(self, app: AppConfig, resolved_paths: dict[str, tuple[str, str | None]]):
        """resolved_paths: model name -> (target directory, draft directory or None), demo paths already resolved."""
        self.app = app
        self.models = {m.name: ModelTokenizer(resolved_paths[m.name][0]) for m in app.models}
        # Each model's generation_config.json sampling defaults, for the fields a request leaves unset.
        self.defaults = {m.name: load_generation_defaults(m.name, resolved_paths[m.name][0]) for m in app.models}
        # Models served with an EAGLE-3 head (their draft directory is the head's): "eagle" / "eagle+ngram" drafting.
        self.heads = {m.name for m in app.models if resolve_eagle_head(resolved_paths[m.name][1])}

    def tokenize(self, model: str, prompt: str | ChatPrompt) -> dict:
        """vLLM's /tokenize answer: the ids a completion would feed the model (a chat prompt through its template)."""
        cfg = self.app.model(model)
        tokens = self.models[cfg.name]
        ids = _chat_ids(tokens, prompt) if isinstance(prompt, ChatPrompt) else encode_prompt(tokens.tokenizer, prompt)
        return {"count": len(ids), "max_model_len": tokens.max_positions, "tokens": ids}

    def detokenize(self, model: str, ids: list[int]) -> dict:
        cfg = self.app.model(model)
        tokens = self.models[cfg.name]
        check_token_ids("tokens", ids, tokens.vocab_size)
        return {"prompt": tokens.tokenizer.decode(ids)}

    def prepare(self, request: Request, request_id: str = "") -> Prepared:
        """The request to run; InvalidRequestError naming the client's field when it does not fit the model or the
        app's limits."""
        cfg = self.app.model(request.model)
        model = self.models[cfg.name]
        limits = self.app.limits
        defaults = self.defaults[cfg.name]
        request = defaults.apply(request)
        cap = limits.max_new_tokens
        if request.max_new_tokens is not None and cap is not None and request.max_new_tokens > cap:
            raise InvalidRequestError(request.max_new_tokens_field, f"{request.max_new_tokens} exceeds this server's "
                                      f"limit of {cap} (limits.max_new_tokens)")  # fmt: skip
        spec = _spec(cfg, request, cfg.name in self.heads)
        ids = _prompt_ids(model, request, limits.max_prompt_tokens)
        check_auto(request, writes_hermes_calls(model.tokenizer))
        max_new_tokens = _max_new_tokens(model, request, len(ids), limits, defaults.max_new_tokens)
        params = SamplingParams(
            temperature=request.temperature,
            top_k=0 if request.top_k >= model.vocab_size else request.top_k,  # the same distribution
            top_p=request.top_p,
            max_new_tokens=max_new_tokens,
            seed=request.seed,
            stop_at_eos=not request.ignore_eos,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            response_format=request.response_format,
            **_controls(request, max_new_tokens, model.vocab_size),
        )
        return Prepared(cfg.name, ids, params, spec, request_id, _stops(request, limits, model.vocab_size))


def _spec(cfg: ModelPairConfig, request: Request, has_head: bool) -> SpecParams:
    """The request's speculation, as the methods registry says (workers/speculation/methods.py): a head's methods need
    the model served with an EAGLE-3 head, a draft model's a draft model on the draft pool. A model served with a head
    drafts with its default (methods.HEAD_DEFAULT: the head's tree, or prompt lookup's free continuation where it is
    expected to accept more) unless the request says otherwise."""
    pool_method = HEAD_DEFAULT if has_head else MODEL_DEFAULT
    default_method = pool_method if cfg.drafts_with_model else (LOOKUP_DEFAULT if cfg.draft == LOOKUP_DEFAULT else NONE)
    spec = SpecParams(method=request.method or default_method, k=cfg.k if request.k is None else request.k)
    method = METHODS[spec.method]
    use = "/".join(servable(has_head, cfg.drafts_with_model and not has_head))
    if method.needs_head and not has_head:
        raise InvalidRequestError("speculation.method", f"model {cfg.name!r} is served without an EAGLE-3 head "
                                  f"(use {use})")  # fmt: skip
    if method.needs_draft_model and has_head:
        raise InvalidRequestError("speculation.method", f"model {cfg.name!r} drafts with an EAGLE-3 head, not a draft "
                                  f"model (use {use})")  # fmt: skip
    if method.needs_draft_model and not cfg.drafts_with_model:
        raise InvalidRequestError("speculation.method", f"model {cfg.name!r} has no draft model (use {use})")
    if not method.disaggregated or (request.temperature > 0 and not method.sampling):
        raise InvalidRequestError("speculation.method", f"{spec.method!r} is not served here (use {use})")
    return spec


def _controls(request: Request, max_new_tokens: int, vocab_size: int) -> dict:
    """The request's logits controls (SamplingParams' fields), their token ids and min_tokens checked against the
    model and the request's max_new_tokens. The stop token ids are among what min_tokens holds back (vLLM's)."""
    prefix = request.controls_prefix
    bad = [t for t in request.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"{prefix}logit_bias", f"token id {bad[0]} is outside the vocabulary [0, "
                                  f"{vocab_size})")  # fmt: skip
    if request.min_tokens > max_new_tokens:
        raise InvalidRequestError(f"{prefix}min_tokens", f"{request.min_tokens} exceeds the request's "
                                  f"{max_new_tokens} new tokens at most")  # fmt: skip
    return {
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "min_p": request.min_p,
        "logit_bias": dict(request.logit_bias),
        "min_tokens": request.min_tokens,
        "end_token_ids": tuple(sorted(set(request.stop_token_ids))) if request.min_tokens else (),
    }


def _stops(request: Request, limits: LimitsConfig, vocab_size: int) -> StopSpec:
    """The request's stop sequences and stop token ids, within the app's limits."""
    if len(request.stop) > limits.max_stop_sequences:
        raise InvalidRequestError(request.stop_field, f"{len(request.stop)} stop sequences, this server's limit is "
                                  f"{limits.max_stop_sequences}")  # fmt: skip
    for i, stop in enumerate(request.stop):
        if len(stop) > limits.max_stop_chars:
            raise InvalidRequestError(f"{request.stop_field}[{i}]", f"{len(stop)} characters, this server's limit is "
                                      f"{limits.max_stop_chars}")  # fmt: skip
    check_token_ids("stop_token_ids", list(request.stop_token_ids), vocab_size)
    return StopSpec(tuple(request.stop), frozenset(request.stop_token_ids), request.include_stop_str_in_output,
                    request.min_tokens)  # fmt: skip


def _max_new_tokens(model: ModelTokenizer, request: Request, prompt_tokens: int, limits: LimitsConfig,
                    model_default: int | None = None) -> int:  # fmt: skip
    """The request's own, when it fits the model's context after the prompt. Unset (vLLM's default): up to the
    context's end, within the server's `limits` and the model's generation_config.json `max_new_tokens` when they
    set one; never an error."""
    room = None if model.max_positions is None else model.max_positions - prompt_tokens
    if request.max_new_tokens is None:
        caps = [c for c in (limits.default_max_new_tokens, limits.max_new_tokens, model_default, room) if c is not None]
        return min(min(caps, default=NO_CONTEXT_MAX_NEW_TOKENS), MAX_NEW_TOKENS)
    if room is not None and request.max_new_tokens > room:
        raise InvalidRequestError(request.max_new_tokens_field, f"This model's maximum context length is "
                                  f"{model.max_positions} tokens. However, you requested "
                                  f"{prompt_tokens + request.max_new_tokens} tokens ({prompt_tokens} in the messages, "
                                  f"{request.max_new_tokens} in the completion). Please reduce the length of the "
                                  f"messages or completion (at most {room} new tokens here; leave it unset for up to "
                                  "the context's end).")  # fmt: skip
    return request.max_new_tokens


def _prompt_ids(model: ModelTokenizer, request: Request, max_prompt_tokens: int) -> list[int]:
    """The prompt's token ids, refused by its length in characters (or messages) before the tokenizer runs when it
    cannot fit: a token spans at most `max_token_chars` characters, so that many per allowed token is a bound that
    never refuses a prompt that would fit. The refusals say "maximum context length" with the counts, as vLLM's."""
    prompt, field = request.prompt, request.prompt_field
    limit, head = max_prompt_tokens, f"This server's maximum prompt length is {max_prompt_tokens} tokens"
    context = model.max_positions
    if context is not None:
        if context - 1 < limit:
            limit, head = context - 1, f"This model's maximum context length is {context} tokens"
        else:
            head += f" (limits.max_prompt_tokens; the model's maximum context length is {context} tokens)"
    else:
        head += " (limits.max_prompt_tokens)"
    reduce = "Please reduce the length of the messages."
    if isinstance(prompt, tuple):
        ids = list(prompt[: limit + 1])
    else:
        chars = len(prompt) if isinstance(prompt, str) else sum(
            len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in prompt.messages)  # fmt: skip
        if chars > limit * model.max_token_chars:
            raise InvalidRequestError(field, f"{head}. However, the {chars} characters you sent cannot fit in "
                                      f"{limit} tokens (at most {limit * model.max_token_chars} characters can). "
                                      f"{reduce}")  # fmt: skip
        if isinstance(prompt, ChatPrompt):
            if len(prompt.messages) > limit:  # each message renders to a token at least
                raise InvalidRequestError(field, f"{head}. However, the {len(prompt.messages)} messages you sent "
                                          f"cannot fit in {limit} tokens. {reduce}")  # fmt: skip
            ids = _chat_ids(model, prompt)
        else:
            ids = encode_prompt(model.tokenizer, prompt)
    if len(ids) > limit:
        size = len(prompt) if isinstance(prompt, tuple) else len(ids)
        room = " (at least one more is needed for the answer)" if limit < max_prompt_tokens else ""
        raise InvalidRequestError(field, f"{head}. However, you requested {size} tokens in the messages{room}. "
                                  f"{reduce}")  # fmt: skip
    check_token_ids(field, ids, model.vocab_size)
    return ids


def _chat_ids(model: ModelTokenizer, prompt: ChatPrompt) -> list[int]:
    """A conversation's ids, through the model's chat template; its tools and tool turns refused where the template
    renders none (naming `tools`, or the message)."""
    if prompt.tools and not takes_tools(model.tokenizer):
        raise InvalidRequestError("tools", "this model's chat template takes no tools (omit them, or serve a "
                                  "model whose template renders tools)")  # fmt: skip
    return chat_prompt_ids(model.tokenizer, prompt.messages, prompt.tools, prompt.template_kwargs)
