"""The rule for a request that names a draft worker: one owner, used by the cache when it assigns a
session (cache_service.registry) and by card-target when it checks a request at its edge, before
the request waits for a KV slot (target_service.cache_link.DraftDirectory)."""

from __future__ import annotations

from collections.abc import Iterable

from card.engine.shared.errors import FailedPrecondition, NotFound


def check_named_draft(name: str, found: tuple[str, str] | None, known: Iterable[str], fingerprint: str,
                      target_model: str) -> None:
    """``found``: the named worker's (model, tokenizer fingerprint), None when it is not registered;
    ``known``: every registered name. NotFound / FailedPrecondition, each in one line."""
    if found is None:
        names = ", ".join(sorted(known)) or "none"
        raise NotFound(f"draft {name!r} is not registered (registered drafts: {names})")
    model, draft_fingerprint = found
    if draft_fingerprint != fingerprint:
        raise FailedPrecondition(
            f"draft {name!r} runs model {model} with tokenizer {draft_fingerprint}, but target model "
            f"{target_model} has tokenizer {fingerprint}; a draft must share the target's tokenizer"
        )
