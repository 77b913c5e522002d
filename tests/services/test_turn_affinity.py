"""A conversation's next turn goes back to the draft worker that drafted the earlier one
(card.cache_service.affinity, Assignments._pick): that worker's pool holds the prompt's front, so
its draft prefills only the new message. Balance still wins beyond AFFINITY_SLACK sessions, and a
worker that cannot take the session (drained, full, refused, another pool) is passed over."""

from __future__ import annotations

from card.cache_service import metrics
from card.cache_service.affinity import TurnAffinity
from card.cache_service.assignment import AFFINITY_SLACK, Assignments, Seat
from card.cache_service.config import CacheConfig
from card.cache_service.registry import DraftRegistration, Worker
from card.cache_service.sessions import SessionTable
from card.cache_service.store import MemoryStore
from card.engine.shared.config import TreeParams
from card.engine.shared.prefix_cache import PREFIX_BLOCK
from card.engine.shared.session import CardSession
from card.engine.shared.tree import Correction

VOCAB = 97


def _worker(a: Assignments, name: str, pool: str = "p", capacity: int = 8) -> Worker:
    w, _ = a.register(DraftRegistration(name, "model", "fp", capacity, pool), live_s=10.0)
    return a.open_stream(w.worker_id, cancel=lambda: None)


def _seat(a: Assignments, name: str, prefers: str = "", draft: str = "") -> Seat:
    card = CardSession(TreeParams(), "cpu")
    card.open((1, 2, 3))
    return a.join(Seat(name, "fp", card, a.route(draft, "fp"), prefers=prefers))


def _kept() -> tuple[float, float]:
    counts = metrics.TURN_AFFINITY
    return counts.labels("kept")._value.get(), counts.labels("moved")._value.get()


def test_the_longest_whole_block_prefix_names_the_worker() -> None:
    affinity = TurnAffinity()
    text = list(range(1, 1 + 2 * PREFIX_BLOCK + 5))  # two whole blocks and a part
    affinity.put("fp", text, "w1", prompt_tokens=PREFIX_BLOCK + 3)
    other = [50] * (3 * PREFIX_BLOCK)
    affinity.put("fp", other, "w2")
    assert affinity.prefer("fp", [*text, 7, 8]) == "w1"  # the next turn: the text and a new message
    # the earlier prompt, the answer re-rendered otherwise: the prompt's entry
    assert affinity.prefer("fp", [*text[:PREFIX_BLOCK + 3], 9, 9, 9]) == "w1"
    assert affinity.prefer("fp", text[:PREFIX_BLOCK - 1]) == ""  # no whole block
    assert affinity.prefer("other-tokenizer", [*text, 7]) == ""
    assert affinity.prefer("fp", [2, *text]) == ""  # another prefix
    assert affinity.prefer("fp", [*other, 1]) == "w2"
    affinity.put("fp", [*text, 7, 8, *range(20)], "w3", prompt_tokens=len(text) + 2)
    assert affinity.prefer("fp", [*text, 7, 8, *range(20), 5]) == "w3"  # the deepest match wins
    # w3's prompt ends where w1's text does: that prefix is now w3's, the latest to hold it
    assert affinity.prefer("fp", [*text[:2 * PREFIX_BLOCK], 1]) == "w3"
    assert affinity.prefer("fp", [*text[:PREFIX_BLOCK + 3], 9]) == "w1"


def test_entries_are_bounded_least_recently_used_first_out() -> None:
    affinity = TurnAffinity(entries=4)
    texts = [[i] * PREFIX_BLOCK for i in range(1, 5)]
    for i, text in enumerate(texts):
        affinity.put("fp", text, f"w{i}")
    assert affinity.prefer("fp", texts[0]) == "w0"  # used: now the most recent
    affinity.put("fp", [9] * PREFIX_BLOCK, "w9")
    assert len(affinity) == 4
    assert affinity.prefer("fp", texts[1]) == ""  # the least recently used went
    assert affinity.prefer("fp", texts[0]) == "w0"


def test_the_earlier_worker_is_kept_within_the_slack_and_balance_wins_beyond() -> None:
    a = Assignments()
    w1, w2 = _worker(a, "w1"), _worker(a, "w2")
    for i in range(AFFINITY_SLACK + 1):
        a.join(Seat(f"f{i}", "fp", CardSession(TreeParams(), "cpu"), a.route("", "fp"), prefers=w1.worker_id))
    assert len(w1.sessions) == AFFINITY_SLACK + 1 and not w2.sessions  # preferred, though busier
    kept, moved = _kept()
    s = _seat(a, "next-turn", prefers=w1.worker_id)
    assert s.worker is w2  # one more would pass the slack: the least loaded takes it
    assert _kept() == (kept, moved + 1) and s.prefers == ""
    assert _seat(a, "plain").worker is w2  # control: no preference, the least loaded


def test_a_worker_that_cannot_take_the_session_is_passed_over() -> None:
    a = Assignments()
    w1, w2 = _worker(a, "w1"), _worker(a, "w2")
    a.drain(name="w1")
    assert _seat(a, "s1", prefers=w1.worker_id).worker is w2
    a.drain(name="w1", resume=True)
    other = _worker(a, "w3", pool="q")
    assert _seat(a, "s2", prefers=other.worker_id, draft="p").worker in (w1, w2)  # not the route's pool
    assert _seat(a, "s3", prefers=w1.worker_id).worker is w1


def test_a_session_that_waits_for_a_worker_keeps_its_preference() -> None:
    """No worker has room when the next turn opens: it waits without a worker, its preference
    neither counted nor dropped, and goes back to its worker once that one has room."""
    a = Assignments()
    w1 = _worker(a, "w1", capacity=1)
    busy = _seat(a, "busy")
    assert busy.worker is w1
    kept, moved = _kept()
    s = _seat(a, "next-turn", prefers=w1.worker_id)
    assert s.worker is None and s.prefers == w1.worker_id and _kept() == (kept, moved)
    a.leave(busy)
    assert s.worker is w1 and _kept() == (kept + 1, moved) and s.prefers == ""


def test_a_conversations_next_turn_goes_back_to_its_worker_through_the_table() -> None:
    """Through the session table: turn one is served by w1 and closed; a filler session then
    makes w1 the busier worker; turn two (the earlier prompt, the answer, a new message) still
    goes to w1, while a prompt that extends nothing goes to the least loaded, w2 (the control)."""
    a = Assignments()
    table = SessionTable(CacheConfig(redis_url="memory://", port=0, metrics_port=0), MemoryStore("aff:"), a)
    w1, w2 = _worker(a, "w1"), _worker(a, "w2")
    first = list(range(5, 5 + 2 * PREFIX_BLOCK))
    s1 = table.open(first, "fp", "m", vocab_size=VOCAB)
    assert s1.seat.worker is w1
    answer = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    for t in answer:
        table.step(s1.session_id, Correction(s1.card.epoch, (), (), t))
    table.close(s1.session_id)
    filler = table.open([1] * 40, "fp", "m", vocab_size=VOCAB)
    assert filler.seat.worker is w1 and not w2.sessions  # the tie goes to the first registered
    kept, moved = _kept()
    turn2 = table.open([*first, *answer, 40, 41, 42], "fp", "m", vocab_size=VOCAB)
    assert turn2.seat.worker is w1 and _kept() == (kept + 1, moved)
    stranger = table.open([60] * 40, "fp", "m", vocab_size=VOCAB)
    assert stranger.seat.worker is w2
    for s in (filler, turn2, stranger):
        table.close(s.session_id)
    table.records.stop()
