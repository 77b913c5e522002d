"""Draft names and pools: one owner for the rule a request's ``draft`` follows, used by the cache
when it assigns a session (cache_service.assignment) and by card-target when it checks a request at
its edge, before the request waits for a KV slot (target_service.cache_link.DraftDirectory).

A request names a pool (every worker started with that ``card-draft --pool``), or one worker by its
name (the session then prefers that worker and falls back to its pool), or nothing.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from card.engine.shared.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated

POOL_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
# a PublishLayers stream names its worker in this metadata key, so that the cache can refuse a
# stream of no registered worker before it holds a server thread for long
WORKER_ID_METADATA = "card-worker-id"
SAME_TOKENIZER = "a draft must share the target's tokenizer"
# RegisterDraft carries the worker's pool token in this metadata key (card-draft --pool-token)
# where the cache binds pools to credentials (card-cache --pool-tokens): a draft that holds the
# draft token but not a pool's cannot serve in that pool, so it cannot take the sessions that
# requests route to it by name
POOL_TOKEN_METADATA = "card-pool-token"


def pool_name(text: str) -> str:
    """``text`` as a pool name: lower case, runs of other characters as '-', at most 128."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:128].strip("-.")
    return name or "draft"


@dataclass(frozen=True)
class DraftEntry:
    """A registered worker as the rule needs it."""

    name: str
    model: str
    fingerprint: str
    pool: str


@dataclass(frozen=True)
class Route:
    """Where a session's draft comes from: ``pool`` ("" = any pool whose tokenizer matches) and,
    when the request named one worker, ``worker`` (preferred while it is there)."""

    pool: str = ""
    worker: str = ""


ANY = Route()  # an unnamed session's


def route_draft(name: str, entries: Iterable[DraftEntry], fingerprint: str, target_model: str,
                known_pools: Iterable[str] = ()) -> Route:
    """The route of a request whose draft is ``name``. ``known_pools``: pools the cache knows
    without a worker now (its --pool-weights), which a request may name and wait for.
    NotFound: neither a worker nor a pool. FailedPrecondition: its tokenizer differs. Each in one
    line."""
    if not name:
        return Route()
    entries = list(entries)
    worker = next((e for e in entries if e.name == name), None)
    if worker is not None:
        if worker.fingerprint != fingerprint:
            raise FailedPrecondition(
                f"draft {name!r} runs model {worker.model} with tokenizer {worker.fingerprint}, but target "
                f"model {target_model} has tokenizer {fingerprint}; {SAME_TOKENIZER}")
        return Route(worker.pool, worker.name)
    members = [e for e in entries if e.pool == name]
    if members:
        if not any(e.fingerprint == fingerprint for e in members):
            models = ", ".join(sorted({e.model for e in members}))
            raise FailedPrecondition(
                f"draft pool {name!r} runs {models} with tokenizer {members[0].fingerprint}, but target "
                f"model {target_model} has tokenizer {fingerprint}; {SAME_TOKENIZER}")
        return Route(name, "")
    if name in set(known_pools):
        return Route(name, "")
    pools = ", ".join(sorted({e.pool for e in entries} | set(known_pools))) or "none"
    workers = ", ".join(sorted(e.name for e in entries)) or "none"
    raise NotFound(f"draft {name!r} is neither a pool nor a registered worker (pools: {pools}; "
                   f"workers: {workers})")


def parse_pool_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``"a=90,b=10"`` -> (("a", 90.0), ("b", 10.0)); "" -> () (no weights: the least-loaded worker
    of any pool). InvalidArgument on a bad name, a negative or non-numeric weight, a repeated pool,
    or weights that are all 0."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not POOL_NAME.fullmatch(name):
            raise InvalidArgument(f"pool weights are POOL=WEIGHT,...; got {item!r}")
        try:
            weight = float(value)
        except ValueError:
            raise InvalidArgument(f"pool weight of {name!r} is not a number: {value!r}") from None
        if not 0 <= weight < float("inf"):
            raise InvalidArgument(f"pool weight of {name!r} must be >= 0, got {value}")
        if name in weights:
            raise InvalidArgument(f"pool {name!r} is weighted twice")
        weights[name] = weight
    if weights and not any(weights.values()):
        raise InvalidArgument("pool weights are all 0: no pool would take unnamed sessions")
    return tuple(weights.items())


def parse_pool_tokens(text: str) -> tuple[tuple[str, str], ...]:
    """``"stable=TOKEN1,canary=TOKEN2"`` -> (("stable", "TOKEN1"), ("canary", "TOKEN2")); "" -> ()
    (pools open to every holder of the draft token). InvalidArgument on a bad pool name, an empty
    token or one with whitespace, a repeated pool, or one token for two pools (then either pool's
    worker could claim the other). The message never holds a token."""
    tokens: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, token = item.partition("=")
        name = name.strip()
        if not sep or not POOL_NAME.fullmatch(name):
            raise InvalidArgument(f"pool tokens are POOL=TOKEN,...; got an entry for {name[:40]!r}")
        if not token or any(c.isspace() for c in token):
            raise InvalidArgument(f"the token of pool {name!r} is empty or holds whitespace")
        if name in tokens:
            raise InvalidArgument(f"pool {name!r} has two tokens")
        if token in tokens.values():
            raise InvalidArgument(f"pool {name!r} shares its token with another pool: give each its own")
        tokens[name] = token
    return tuple(tokens.items())


def check_pool_token(tokens: Iterable[tuple[str, str]], pool: str, presented: str) -> None:
    """Unauthenticated unless a worker may register into ``pool`` with the token it ``presented``:
    with no pool tokens every pool is open (the draft token alone guards the cache); with any, a
    worker registers only into a listed pool, with that pool's token (compared in constant time)."""
    table = dict(tokens)
    if not table:
        return
    expected = table.get(pool)
    if expected is None:
        raise Unauthenticated(f"pool {pool!r} takes no workers: this cache binds pools to tokens "
                              "(card-cache --pool-tokens) and lists no token for it")
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthenticated(f"pool {pool!r} is bound to a token: register with its token "
                              f"(card-draft --pool-token, metadata {POOL_TOKEN_METADATA!r})")
