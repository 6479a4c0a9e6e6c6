"""What travels between an ingress replica and a scheduler replica: the request the ingress validated and tokenized
(`Prepared`, built once at the edge and never re-validated) and what each round committed (`Chunk`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specserve.cluster.scheduling.stops import StopSpec
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.speculation.logprobs import TokenLogprob


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, ready to run: the scheduler takes it as it is."""

    model: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    request_id: str = ""  # the client's x-request-id (or the ingress's): in every log line about the request
    stop: StopSpec = StopSpec()
    arrived_at: float = field(default_factory=time.time)  # prepared at the ingress: queue times count from here


@dataclass
class Chunk:
    """What one round committed. text: the new text (incrementally detokenized, so chunks concatenate to the full
    completion); stats: cumulative RequestStats so far; logprobs: one per token id, when the request asks
    (params.logprobs), cut with them at a stop; prompt_logprobs: on the first chunk of a request that asks
    (params.prompt_logprobs), those of the prompt's tokens 1..P-1 (with their ranks)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
