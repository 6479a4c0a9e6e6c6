"""What one request asks for: how its tokens are sampled (`SamplingParams`, with structured output's
`ResponseFormat`) and how it is speculated (`SpecParams`), with the limits the edges enforce. Validated where a
request enters (CLI, gRPC, HTTP: `strict.validate`); the scheduler and the workers only ever see these objects."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from specserve.workers.config.strict import StrictModel
from specserve.workers.speculation.methods import DEFAULT_METHOD, NAMES, described

MAX_K = 16
MAX_LOGIT_BIAS = 1024  # entries of one logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's and vLLM's range: [-100, 100]
MAX_REPETITION_PENALTY = 1e6
MAX_SCHEMA_CHARS = 1 << 20  # a response_format's JSON schema, as text


class ResponseFormat(StrictModel):
    """Structured output (workers/speculation/grammar.py): the output is a JSON object (json_object), or JSON valid
    against a schema (json_schema), enforced on the target's distribution at every verified position."""

    type: Literal["json_object", "json_schema"] = Field(..., description="json_object: any JSON object; json_schema: "
                                                        "JSON valid against json_schema.")  # fmt: skip
    json_schema: str = Field("", max_length=MAX_SCHEMA_CHARS, description="The JSON schema as JSON text (json_schema "
                             "only).")  # fmt: skip


class SamplingParams(StrictModel):
    """How the target's distribution is turned into tokens. temperature == 0 means greedy."""

    temperature: float = Field(
        0.0, ge=0.0, le=100.0, allow_inf_nan=False, description="Softmax temperature; 0 selects greedy decoding."
    )
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 disables top-k.")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass in (0, 1]; 1 disables top-p."
    )
    max_new_tokens: int = Field(64, gt=0, le=1_000_000, description="Generate at most this many new tokens.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed for reproducible sampling; None = random.")
    stop_at_eos: bool = Field(True, description="Stop when the tokenizer's EOS token is generated.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Also return the target's log-probability of every generated token (raw: "
        "before temperature and every other control) and this many most likely alternatives; None = none."
    )  # fmt: skip
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="Also return the target's log-probability of the prompt's tokens 1..P-1 (raw, "
        "with their ranks) and this many most likely alternatives, from the forward that prefills the prompt (vLLM's "
        "prompt_logprobs); None = none. Asked of the target on the request's first verify call only."
    )  # fmt: skip
    # Controls applied to the target's logits at every verified position (workers/speculation/logits_controls.py),
    # with vLLM's ranges and semantics.
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="Subtracted from the logit of every token generated so "
        "far (OpenAI's presence penalty, counting generated tokens only); 0 disables it."
    )  # fmt: skip
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="Subtracted once per earlier occurrence in the "
        "generated tokens (OpenAI's frequency penalty); 0 disables it."
    )  # fmt: skip
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False, description="Divides the positive logits (and "
        "multiplies the negative ones) of every token in the prompt or generated so far (vLLM's and transformers' "
        "repetition penalty); 1 disables it."
    )  # fmt: skip
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="Sampling: drop tokens less likely than min_p times the "
        "likeliest (after temperature); 0 disables it."
    )  # fmt: skip
    logit_bias: dict[int, float] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS, description="Token id -> a bias in [-100, 100] added to "
        "its logit (OpenAI's logit_bias)."
    )  # fmt: skip
    min_tokens: int = Field(0, ge=0, description="Mask the tokens that end the request (end_token_ids) until this "
                            "many tokens are generated (vLLM's min_tokens).")  # fmt: skip
    # Set by whoever starts the request (the engine, the scheduler: `for_request`), not by clients: where the
    # generated tokens begin, and the tokens min_tokens masks (EOS unless ignore_eos, stop token ids).
    prompt_len: int = Field(0, ge=0, description="Committed tokens before the generated ones (penalties, min_tokens).")
    end_token_ids: tuple[int, ...] = Field((), description="Tokens that end the request: masked before min_tokens.")
    response_format: ResponseFormat | None = Field(None, description="Structured output: the grammar masks the "
                                                   "target's distribution at every verified position.")  # fmt: skip

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float]) -> dict[int, float]:
        for token, value in bias.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE or value != value:
                raise ValueError(f"the bias of token {token} is {value}, outside [-100, 100]")
        return bias

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_fit(cls, min_tokens: int, info: ValidationInfo) -> int:
        most = info.data.get("max_new_tokens")
        if most is not None and min_tokens > most:
            raise ValueError(f"{min_tokens} exceeds max_new_tokens ({most})")
        return min_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logits_controls(self) -> bool:
        """Whether any control reshapes the raw logits (penalties, bias, min_tokens): min_p is applied with
        temperature (sampling.logits_to_probs)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.min_tokens
        )  # fmt: skip

    @property
    def counts_prompt(self) -> bool:
        """Whether verification needs to know where the generated tokens begin (prompt_len): the logits controls count
        from there, a response_format's grammar starts there."""
        return self.has_logits_controls or self.response_format is not None

    def for_request(self, prompt_len: int, eos_token_ids: frozenset[int] | set[int] = frozenset()) -> SamplingParams:
        """These params for one request: the prompt's length, and EOS (unless ignore_eos) among the tokens min_tokens
        masks. Unchanged where nothing needs them."""
        if not self.counts_prompt:
            return self
        ends = set(self.end_token_ids) | (set(eos_token_ids) if self.stop_at_eos else set())
        return self.model_copy(update={"prompt_len": prompt_len, "end_token_ids": tuple(sorted(ends))})


SpecMethod = Literal[NAMES]  # the registry's (workers/speculation/methods.py)


class SpecParams(StrictModel):
    """Speculation options for one request."""

    method: SpecMethod = Field(DEFAULT_METHOD, description=described())
    k: Annotated[int, Field(ge=1, le=MAX_K)] | Literal["auto"] = Field(
        "auto", description=f"Tokens drafted per round, 1..{MAX_K}, or 'auto': the goodput planner's per round."
    )
