"""Errors of the speculative core. Servers map them to status codes (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)."""


class SpecServeError(Exception):
    """Base class of every error specserve raises on purpose."""


class InvalidRequestError(SpecServeError, ValueError):
    """A request field is invalid. `field` names it so clients can fix it."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"invalid {field}: {message}")

    def __reduce__(self):  # picklable across Ray processes (Serve's proxy re-raises it)
        return type(self), (self.field, self.message)


class ModelLoadError(SpecServeError):
    """A model path is missing, is not a causal LM, or a draft/target pair is incompatible."""


class KVCapacityError(SpecServeError):
    """A worker's KV cache would exceed its configured capacity."""


class RequestNotFoundError(SpecServeError, KeyError):
    """A worker does not hold state for the request (never seen, released or evicted)."""

    def __str__(self) -> str:  # KeyError's repr-style message is unhelpful
        return str(self.args[0]) if self.args else "request not found"


class UnavailableError(SpecServeError):
    """No worker can serve the request right now (pools starting, or every worker of a pool failed): retry later."""


class DrainingError(UnavailableError):
    """The server is stopping: it finishes the requests it runs and admits none (gRPC UNAVAILABLE, HTTP 503 with
    Retry-After): retry, and a load balancer sends the retry elsewhere."""

    def __init__(self, message: str = "this server is draining (stopping)", retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        self.message = message
        super().__init__(f"{message}; retry after {retry_after_s:g} s")

    def __reduce__(self):
        return type(self), (self.message, self.retry_after_s)


class UnauthenticatedError(SpecServeError):
    """A public call without the configured API key (gRPC UNAUTHENTICATED, HTTP 401)."""


class OverloadedError(SpecServeError):
    """The server is at its configured capacity: retry after `retry_after_s` (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        self.message = message
        super().__init__(f"{message}; retry after {retry_after_s:g} s")

    def __reduce__(self):
        return type(self), (self.message, self.retry_after_s)
