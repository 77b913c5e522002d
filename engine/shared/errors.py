"""Domain errors of the engine.

Each error names the failure the way DESIGN.md §7 does; the services map them onto gRPC status
codes in one table (``card.common.status``), the CLI onto one readable line and exit code 2.
"""

from __future__ import annotations


class CardError(Exception):
    """Base of every error a user or peer can cause; anything else is a bug."""

    code = "INTERNAL"


class InvalidArgument(CardError):
    """Bad input: empty prompt, prompt longer than the context window, bad sampling values."""

    code = "INVALID_ARGUMENT"


class NotFound(CardError):
    """Unknown session, draft worker or model path."""

    code = "NOT_FOUND"


class FailedPrecondition(CardError):
    """The request cannot be served as the system stands, e.g. tokenizer mismatch."""

    code = "FAILED_PRECONDITION"


class AlreadyExists(CardError):
    """A name another live party holds, e.g. a draft worker's name while its worker is connected."""

    code = "ALREADY_EXISTS"


class Aborted(CardError):
    """A message carried a stale epoch: the tree moved on since it was sent."""

    code = "ABORTED"


class ResourceExhausted(CardError):
    """No capacity left (sessions per worker, tree size)."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(CardError):
    """A peer is down or not serving yet."""

    code = "UNAVAILABLE"


class Unauthenticated(CardError):
    """A call without the credential its port requires (card-target --api-key, a cache token)."""

    code = "UNAUTHENTICATED"
