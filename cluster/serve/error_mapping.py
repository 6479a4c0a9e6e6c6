"""Errors on their way out of the ingress: a scheduler call's failure as the specserve error it means to a client,
and specserve errors as gRPC status details and OpenAI-shaped HTTP responses."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.edge import client_message
from specserve.cluster.serve.public_proto import http_status_for, status_for
from specserve.workers.errors import DrainingError, OverloadedError, UnavailableError


async def call_scheduler(response):
    """Await a scheduler handle call; its errors (and the scheduler replica's death) as specserve errors."""
    try:
        return await response
    except Exception as e:  # noqa: BLE001 - re-raised as what it means to the client
        raise scheduler_error(e) from None


def scheduler_error(error: BaseException) -> BaseException:
    """What a scheduler call's failure means to the client: the scheduler's own error as raised there; its replica
    dying (or none being up) as UnavailableError, which says the call did not complete and can be retried."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(error, RayTaskError) and isinstance(getattr(error, "cause", None), Exception):
        return scheduler_error(error.cause)
    if isinstance(error, RayActorError):
        return UnavailableError(f"the scheduler replica running this request stopped ({type(error).__name__}); "
                                "retry: nothing of the request is kept")  # fmt: skip
    if isinstance(error, DeploymentUnavailableError):
        return UnavailableError("no scheduler replica is up right now; retry")
    if isinstance(error, BackPressureError):
        return OverloadedError("every scheduler replica is busy", retry_after_s=1.0)
    return error


def set_grpc_error(grpc_context, error: BaseException, request_id: str | None = None) -> None:
    """The error's status and message; the request's id joins the message, since Serve's gRPC proxy sends no
    trailing metadata with an error."""
    if grpc_context is not None:
        grpc_context.set_code(status_for(error))
        suffix = f" (request {request_id})" if request_id else ""
        grpc_context.set_details(client_message(error) + suffix)


def http_error(error: BaseException) -> JSONResponse:
    status, kind = http_status_for(error)
    field = getattr(error, "field", None)
    code = "model_not_found" if field == "model" and "unknown model" in str(error) else None
    retry = isinstance(error, OverloadedError | DrainingError)
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if retry else None
    return JSONResponse(oai.error_body(client_message(error), kind, field, code), status_code=status, headers=headers)
