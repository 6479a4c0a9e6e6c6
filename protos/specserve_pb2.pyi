from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_new_tokens", "seed", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "logprobs", "response_format")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    seed: int
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    response_format: ResponseFormat
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: str
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_logprobs", "top_token_ids", "top_logprobs", "ranks")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    def __init__(self, rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "committed_len", "new_tokens", "k", "sampling", "features", "tree", "prompt_len", "end_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed_len: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: SamplingParams
    features: bytes
    tree: bool
    prompt_len: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., features: _Optional[bytes] = ..., tree: _Optional[bool] = ..., prompt_len: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("drafted", "draft_probs", "vocab_size", "batch_seconds", "parents", "scores", "queued_seconds")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    drafted: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    vocab_size: int
    batch_seconds: float
    parents: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    queued_seconds: float
    def __init__(self, drafted: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., batch_seconds: _Optional[float] = ..., parents: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., queued_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class ProposeStreamRequest(_message.Message):
    __slots__ = ("call_id", "request")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: ProposeRequest
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[ProposeRequest, _Mapping]] = ...) -> None: ...

class ProposeStreamResponse(_message.Message):
    __slots__ = ("call_id", "response", "status")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: ProposeResponse
    status: CallStatus
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[ProposeResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "committed_len", "new_tokens", "drafted", "draft_probs", "sampling", "want_features", "parents", "prompt_len", "end_token_ids", "prompt_logprobs", "prefix_at_most", "expected_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_AT_MOST_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed_len: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    drafted: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    sampling: SamplingParams
    want_features: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    prefix_at_most: int
    expected_len: int
    def __init__(self, request_id: _Optional[str] = ..., committed_len: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., drafted: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., want_features: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., prefix_at_most: _Optional[int] = ..., expected_len: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "bonus", "batch_seconds", "batch_rows", "batch_tokens", "features", "path", "logprobs", "prompt_logprobs", "queued_seconds", "batch_forward_seconds")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    bonus: bool
    batch_seconds: float
    batch_rows: int
    batch_tokens: int
    features: bytes
    path: _containers.RepeatedScalarFieldContainer[int]
    logprobs: Logprobs
    prompt_logprobs: Logprobs
    queued_seconds: float
    batch_forward_seconds: float
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., bonus: _Optional[bool] = ..., batch_seconds: _Optional[float] = ..., batch_rows: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., features: _Optional[bytes] = ..., path: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., queued_seconds: _Optional[float] = ..., batch_forward_seconds: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("want_costs",)
    WANT_COSTS_FIELD_NUMBER: _ClassVar[int]
    want_costs: bool
    def __init__(self, want_costs: _Optional[bool] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("healthy", "requests", "kv_used_tokens", "kv_capacity_tokens", "model", "verify_seconds_by_width", "draft_fixed_seconds", "draft_step_seconds", "verify_profile_rows", "verify_seconds_by_rows", "kv_cached_tokens", "prefix_cache_queries", "prefix_cache_hits", "kv_capacity_bytes", "kv_allocated_bytes")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_BY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PROFILE_ROWS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_BY_ROWS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    requests: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    model: str
    verify_seconds_by_width: _containers.RepeatedScalarFieldContainer[float]
    draft_fixed_seconds: float
    draft_step_seconds: float
    verify_profile_rows: _containers.RepeatedScalarFieldContainer[int]
    verify_seconds_by_rows: _containers.RepeatedScalarFieldContainer[float]
    kv_cached_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_capacity_bytes: int
    kv_allocated_bytes: int
    def __init__(self, healthy: _Optional[bool] = ..., requests: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., model: _Optional[str] = ..., verify_seconds_by_width: _Optional[_Iterable[float]] = ..., draft_fixed_seconds: _Optional[float] = ..., draft_step_seconds: _Optional[float] = ..., verify_profile_rows: _Optional[_Iterable[int]] = ..., verify_seconds_by_rows: _Optional[_Iterable[float]] = ..., kv_cached_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_allocated_bytes: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("first", "steps", "end_token_ids")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first: VerifyRequest
    steps: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first: _Optional[_Union[VerifyRequest, _Mapping]] = ..., steps: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyStreamRequest(_message.Message):
    __slots__ = ("call_id", "request")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: VerifyRequest
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class VerifyStreamResponse(_message.Message):
    __slots__ = ("call_id", "response", "status")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: VerifyResponse
    status: CallStatus
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("method", "k")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    method: str
    k: int
    def __init__(self, method: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "model", "sampling", "speculation", "messages", "stop", "stop_token_ids", "include_stop_str_in_output", "n")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    sampling: SamplingParams
    speculation: SpeculationOptions
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    n: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs", "index", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: RequestStats
    logprobs: Logprobs
    index: int
    choices: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., index: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...
