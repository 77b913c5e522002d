"""A conversation's next turn on the cache (card.cache_service.sessions.EarlierTurns): a new
session whose prompt extends a closed session's text (its prompt and its answer) takes that
session's model-free lookup and reads only the new tokens, and its n-gram tables are then exactly
those that reading the whole prompt gives; a prompt that does not extend it (another
conversation, another tokenizer) starts from scratch. The kept lookups are bounded in entries
and in tokens."""

from __future__ import annotations

from card.cache_service.assignment import Assignments
from card.cache_service.config import CacheConfig
from card.cache_service.sessions import EarlierTurns, SessionTable
from card.cache_service.store import MemoryStore
from card.engine.shared.ngram_stats import PromptLookup
from card.engine.shared.tree import Correction

VOCAB = 97


def _table() -> SessionTable:
    config = CacheConfig(redis_url="memory://", port=0, metrics_port=0)
    return SessionTable(config, MemoryStore("turns:"), Assignments())


def _answer(table: SessionTable, sid: str, tokens: list[int]) -> None:
    """The target commits ``tokens`` one Step at a time (no draft: each its own next token)."""
    for t in tokens:
        epoch = table.get(sid).card.epoch
        table.step(sid, Correction(epoch, (), (), t), worker_off=True)


def _tables(lookup: PromptLookup) -> dict[int, dict[int, int]]:
    return {k: dict(v) for k, v in lookup.proposer.own._entries.items()}


def test_the_next_turn_reads_on_from_the_earlier_one() -> None:
    table = _table()
    first = [5, 6, 7, 8, 5, 6, 7, 9, 1, 2]
    s1 = table.open(first, "tok-a", "m", vocab_size=VOCAB)
    _answer(table, s1.session_id, [5, 6, 7, 8, 3])
    text = [*first, 5, 6, 7, 8, 3]
    lookup = s1.card.lookup
    assert isinstance(lookup, PromptLookup) and lookup.text == text
    table.close(s1.session_id)
    assert len(table.earlier) == 1

    second = [*text, 4, 5, 6, 7]  # the earlier turn, its answer, the new message
    proposer, read = lookup.proposer, []
    extend = proposer.extend
    proposer.extend = lambda tokens: (read.append(len(tokens)), extend(tokens))[1]  # type: ignore[method-assign]
    s2 = table.open(second, "tok-a", "m", vocab_size=VOCAB)
    assert s2.card.lookup is lookup and lookup.proposer is proposer  # handed on, read on from its end
    assert read == [4]  # only the new message
    assert table.earlier.reused == len(text) and len(table.earlier) == 0
    fresh = PromptLookup(VOCAB)
    fresh.open(second)
    assert _tables(lookup) == _tables(fresh) and lookup.text == second
    assert lookup.continuation(4) == fresh.continuation(4) != ()
    table.close(s2.session_id)

    # another tokenizer, or a prompt that does not extend the text: a lookup of its own
    s3 = table.open(second, "tok-b", "m", vocab_size=VOCAB)
    s4 = table.open([*second[:-2], 1], "tok-a", "m", vocab_size=VOCAB)
    assert s3.card.lookup is not lookup and s4.card.lookup is not lookup
    assert s4.card.lookup is not None and s4.card.lookup.text == [*second[:-2], 1]
    assert len(table.earlier) == 1  # still kept for a turn that extends it


def test_kept_lookups_are_bounded() -> None:
    turns = EarlierTurns(entries=3, tokens=25)
    lookups = []
    for i in range(5):
        lookup = PromptLookup(VOCAB)
        lookup.open([i] * 10)
        lookups.append(lookup)
        turns.put("k", lookup)
        assert len(turns) <= 2  # 3 x 10 tokens is past 25: the oldest go
    assert turns.take("k", [0] * 12) is None  # evicted
    assert turns.take("k", [4] * 12) is lookups[4]
    big = PromptLookup(VOCAB)
    big.open(list(range(30)))
    turns.put("k", big)  # longer than the whole bound: not kept
    assert turns.take("k", list(range(31))) is None
