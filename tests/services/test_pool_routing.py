"""The rules of draft pools without a network: naming (card.common.drafts), weights and their
round robin (PoolRouter), which workers may take a session (Assignments.pick), and the bound on a
worker's command queue. The same rules through real gRPC: test_cache_service.py."""

from __future__ import annotations

import pytest

from card.cache_service.assignment import Assignments
from card.cache_service.pools import PoolRouter
from card.cache_service.registry import MIN_COMMAND_BACKLOG, DraftRegistration
from card.common.drafts import DraftEntry, Route, parse_pool_weights, pool_name, route_draft
from card.draft_service.config import default_pool, default_worker_name
from card.engine.shared.commands import StopDraft
from card.engine.shared.errors import FailedPrecondition, InvalidArgument, NotFound


def test_default_pool_names() -> None:
    assert default_pool("/models/qwen2.5-coder-0.5b.gguf", "int8") == "qwen2.5-coder-0.5b-int8"
    assert default_pool("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert default_pool("default", cascade=True) == "default-ngram"
    assert default_worker_name("default").startswith("default-")
    assert pool_name("A model / with spaces!") == "a-model-with-spaces"


@pytest.mark.parametrize("text, error", [
    ("a", "POOL=WEIGHT"), ("a=x", "not a number"), ("a=-1", ">= 0"), ("a=1,a=2", "twice"),
    ("a=0,b=0", "all 0"), ("bad name=1", "POOL=WEIGHT"), ("a=inf", ">= 0"),
])
def test_bad_pool_weights_are_refused_in_one_line(text: str, error: str) -> None:
    with pytest.raises(InvalidArgument, match=error):
        parse_pool_weights(text)


def test_weights_split_by_smooth_round_robin() -> None:
    router = PoolRouter(parse_pool_weights("a=90, b=10"))
    picks = [next(iter(router.choose({"a", "b"}))) for _ in range(100)]
    assert picks.count("b") == 10
    assert max(len(run) for run in "".join(picks).split("b")) <= 10  # spread out, not in a block
    assert router.choose({"a", "c"}) == {"a"}  # an unweighted pool only when no weighted one has room
    assert router.choose({"c", "d"}) == {"c", "d"}
    assert PoolRouter().choose({"x", "y"}) == {"x", "y"}  # no weights: every pool, least loaded


def test_route_names_a_pool_a_worker_or_nothing() -> None:
    entries = [DraftEntry("w1", "m", "fp", "p"), DraftEntry("w2", "m", "fp", "p"),
               DraftEntry("x1", "other", "fp2", "q")]
    assert route_draft("", entries, "fp", "t") == Route()
    assert route_draft("p", entries, "fp", "t") == Route("p", "")
    assert route_draft("w2", entries, "fp", "t") == Route("p", "w2")
    assert route_draft("later", entries, "fp", "t", known_pools=["later"]) == Route("later", "")
    with pytest.raises(FailedPrecondition, match="pool 'q'"):
        route_draft("q", entries, "fp", "t")
    with pytest.raises(NotFound, match="pools: p, q; workers: w1, w2, x1"):
        route_draft("nope", entries, "fp", "t")


def registered(assignments: Assignments, name: str, pool: str, capacity: int = 2, stream: bool = True):
    worker, _ = assignments.register(DraftRegistration(name, "model", "fp", capacity, pool), live_s=10.0)
    worker.streaming = stream
    return worker


def test_only_live_undrained_workers_with_room_take_sessions() -> None:
    assignments = Assignments()
    silent = registered(assignments, "silent", "p", capacity=4096, stream=False)  # heartbeats, no stream
    busy = registered(assignments, "busy", "p", capacity=1)
    busy.sessions.add("s0")
    assert assignments.pick("fp") is None  # the only one with room has no command stream
    assert silent.capacity == 4096
    free = registered(assignments, "free", "p")
    assert assignments.pick("fp") is free
    assert assignments.pick("fp", Route("p", "busy")) is free  # its named worker is full: a pool peer
    free.draining = True
    assert assignments.pick("fp", Route("p", "")) is None
    assert assignments.pick("other-fp") is None


def test_default_pool_first_then_the_weights() -> None:
    assignments = Assignments(router=PoolRouter(parse_pool_weights("a=1")))
    a, b = registered(assignments, "a1", "a"), registered(assignments, "b1", "b")
    assert assignments.pick("fp") is a
    assert assignments.pick("fp", default_pool="b") is b
    a.sessions.update({"s1", "s2"})  # full
    assert assignments.pick("fp") is b  # the weighted pool has no room: an unweighted one


def test_a_worker_that_stops_reading_commands_is_dropped() -> None:
    assignments = Assignments()
    worker = registered(assignments, "slow", "p", capacity=1)
    cancelled = []
    worker.cancel_stream = lambda: cancelled.append(True)
    for i in range(MIN_COMMAND_BACKLOG):
        worker.send(StopDraft(f"s{i}"))
    assert not worker.closed and not cancelled
    worker.send(StopDraft("one-too-many"))  # the queue is full: its stream ends, sessions move
    assert worker.closed and cancelled == [True]
    assert not worker.assignable
