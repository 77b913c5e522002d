"""Domain errors <-> gRPC status codes (both directions) and HTTP statuses: the one table
(DESIGN.md §7).

Servicers raise ``card.engine.shared.errors`` classes; ``grpc_errors`` turns them into a status with the
error's message. Clients turn a failed call back into the same class with ``error_from_rpc``, so
the CLI and the target service handle local and remote failures alike.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from card.engine.shared.errors import (
    Aborted,
    AlreadyExists,
    CardError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

log = logging.getLogger(__name__)

# error class: (gRPC status, HTTP status); anything else is INTERNAL / 500
_TABLE: dict[type[CardError], tuple[grpc.StatusCode, int]] = {
    InvalidArgument: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    NotFound: (grpc.StatusCode.NOT_FOUND, 404),
    FailedPrecondition: (grpc.StatusCode.FAILED_PRECONDITION, 400),
    Aborted: (grpc.StatusCode.ABORTED, 409),
    AlreadyExists: (grpc.StatusCode.ALREADY_EXISTS, 409),
    ResourceExhausted: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, 503),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
}
STATUS_CODES: dict[type[CardError], grpc.StatusCode] = {cls: codes[0] for cls, codes in _TABLE.items()}

_ERRORS: dict[grpc.StatusCode, type[CardError]] = {code: cls for cls, code in STATUS_CODES.items()}
# a peer that does not answer in time is as good as down for the caller
_ERRORS[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable


def status_code(err: BaseException) -> grpc.StatusCode:
    """The status a servicer reports for ``err``; INTERNAL for anything that is not a CardError."""
    for cls in type(err).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


def http_status(err: BaseException) -> int:
    """The HTTP status a front reports for ``err``; 500 for anything that is not a CardError."""
    for cls in type(err).__mro__:
        if cls in _TABLE:
            return _TABLE[cls][1]
    return 500


def error_from_rpc(err: grpc.RpcError, peer: str = "") -> CardError:
    """The domain error behind a failed call; ``peer`` (an address) is named for UNAVAILABLE."""
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(err)
    return error_from_status(code, details, peer)


_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_from_value(value: int) -> grpc.StatusCode:
    """The StatusCode of a google.rpc.Code number (as a batch reply carries it); UNKNOWN if none."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def error_from_status(code: grpc.StatusCode, details: str, peer: str = "") -> CardError:
    """The domain error for a status code and its message (one table, both directions)."""
    cls = _ERRORS.get(code)
    if cls is Unavailable:
        where = f" at {peer}" if peer else ""
        what = "did not answer in time" if code is grpc.StatusCode.DEADLINE_EXCEEDED else "is unavailable"
        return Unavailable(f"the service{where} {what}: {details}")
    if cls is None:
        return CardError(f"{code.name if code else 'UNKNOWN'} from {peer or 'peer'}: {details}")
    return cls(details)


F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, exc: Exception, method: str) -> None:
    if isinstance(exc, CardError):
        context.abort(status_code(exc), str(exc))
    log.exception("internal error in %s", method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


def _already_aborted(context: grpc.ServicerContext) -> bool:
    # context.abort() raises a bare Exception after setting the status; let it through unchanged
    code = context.code()
    return code is not None and code is not grpc.StatusCode.OK and code != 0


def grpc_errors(fn: F) -> F:
    """Wrap a servicer method (unary or server-streaming) so errors become gRPC statuses.

    CardError -> its code from ``STATUS_CODES`` with the error's message; any other exception ->
    INTERNAL, with the traceback logged (it is a bug).
    """
    method = fn.__qualname__
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from fn(self, request, context)
            except Exception as exc:
                if _already_aborted(context):
                    raise
                _abort(context, exc, method)

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as exc:
            if _already_aborted(context):
                raise
            _abort(context, exc, method)

    return unary  # type: ignore[return-value]
