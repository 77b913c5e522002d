"""DraftWorker: many sessions, one thread; no state leaks (DESIGN.md §5) after finished, abandoned,
concurrent or failed sessions; the in-process runner on top of it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.inprocess.sources import LocalCard
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, Mode, StopParams, TreeParams
from card.engine.shared.tree import Advance, Layer, Outcome
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import run_alone
from tests.engine.support import (
    LockstepCard,
    LockstepRunner,
    draft_model,
    generate,
    prompt_cases,
    target_model,
    wait_until,
)
from tests.tiny_models import save_tiny_checkpoint

PARAMS = TreeParams(width=2, max_depth=4, max_chain=3)


class Hub:
    """Routes a worker's layers to the LocalCard that owns the session (what the runner does)."""

    def __init__(self) -> None:
        self.cards: list[LocalCard] = []

    def publish(self, session_id: str, layer: Layer) -> None:
        for card in list(self.cards):
            card.publish(session_id, layer)

    def card(self, worker: DraftWorker, lockstep: int = 2) -> LocalCard:
        card = LockstepCard(worker, PARAMS, depth=lockstep) if lockstep else LocalCard(worker, PARAMS)
        self.cards.append(card)
        return card


@pytest.fixture
def hub_worker():
    hub = Hub()
    worker = DraftWorker(draft_model("llama", "perturbed"), PARAMS, hub.publish, slots=8, max_len=512,
                         name="t")
    worker.start()
    yield hub, worker
    worker.close()


def idle(worker: DraftWorker) -> bool:
    return wait_until(lambda: worker.active_sessions == 0) and worker.kv_slots_held() == 0


def test_sequential_sessions_leave_nothing_behind(hub_worker) -> None:
    hub, worker = hub_worker
    card = hub.card(worker)
    target = target_model("llama")
    for prompt, budget in prompt_cases(6, seed=31, max_new=25):
        want = generate(target, NoDraft(), prompt, max_new_tokens=budget).tokens
        assert generate(target, card, prompt, max_new_tokens=budget).tokens == want
        assert idle(worker), "a finished session still holds draft state"


def test_live_session_holds_kv_until_it_stops(hub_worker) -> None:
    hub, worker = hub_worker
    layers: list[Layer] = []
    hub.cards.append(type("Spy", (), {"publish": lambda self, sid, layer: layers.append(layer)})())
    worker.start_session("s1", [1, 2, 3, 4], 0)
    assert wait_until(lambda: len(layers) >= PARAMS.max_depth)
    assert worker.active_sessions == 1 and worker.kv_slots_held() > 4
    stats = worker.session_stats("s1")
    assert stats is not None and stats.forwards >= PARAMS.max_depth
    worker.stop_session("s1")
    assert idle(worker)
    assert worker.session_stats("s1") is None


def test_abandoned_generation_is_cleaned_up(hub_worker) -> None:
    hub, worker = hub_worker
    card = hub.card(worker)
    request = GenerationRequest((5, 6, 7), stop=StopParams(50, ignore_eos=True))
    gen = Generation(request, card, eos_ids=frozenset(), decode=str, context_window=512, mode="card")
    it = iter(run_alone(target_model("llama"), gen))
    next(it)
    next(it)
    it.close()  # the caller went away mid-generation
    assert gen.result is not None and gen.result.finish_reason == "aborted"
    assert idle(worker)


def test_concurrent_sessions_on_one_worker(hub_worker) -> None:
    hub, worker = hub_worker
    target = target_model("llama")
    cases = prompt_cases(4, seed=41, max_new=30)
    want = [generate(target, NoDraft(), p, max_new_tokens=n).tokens for p, n in cases]
    got: list[list[int] | None] = [None] * len(cases)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            card = hub.card(worker, lockstep=0)
            got[i] = generate(target, card, cases[i][0], max_new_tokens=cases[i][1]).tokens
        except BaseException as exc:  # reported below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == want
    assert idle(worker)


def test_a_failing_session_is_dropped_and_the_worker_keeps_serving(hub_worker) -> None:
    hub, worker = hub_worker
    worker.start_session("bad", [1, 2, 3], 0)
    worker.advance("bad", Advance(5, (), (), 4, Outcome.MISS))  # skips epochs: Aborted
    worker.advance("nobody", Advance(1, (), (), 4, Outcome.MISS))  # unknown sessions are ignored
    worker.stop_session("nobody")
    assert idle(worker)
    card = hub.card(worker)
    prompt, budget = [9, 8, 7], 12
    want = generate(target_model("llama"), NoDraft(), prompt, max_new_tokens=budget).tokens
    assert generate(target_model("llama"), card, prompt, max_new_tokens=budget).tokens == want
    assert idle(worker)


# ---- the in-process runner -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return (save_tiny_checkpoint(root / "target", seed=0, dtype=torch.float64),
            save_tiny_checkpoint(root / "draft", seed=0, perturb=0.02, dtype=torch.float64))


def test_runner_card_and_sd_equal_vanilla_and_leak_nothing(tiny_checkpoints) -> None:
    target_dir, draft_dir = tiny_checkpoints
    target = load_model(ModelConfig(spec=str(target_dir), dtype="float64", device="cpu", exact=True))
    draft = load_model(ModelConfig(spec=str(draft_dir), dtype="float64", device="cpu"))
    prompts = [target.encode_prompt(p, chat=c) for p, c in [("Hello there", True), ("a", False)]]
    requests = [GenerationRequest(tuple(p), stop=StopParams(max_new_tokens=12, ignore_eos=True))
                for p in prompts]
    vanilla = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA))
    want = [vanilla.run(r).token_ids for r in requests]
    for mode in ("card", "sd"):
        runner = LockstepRunner(target, draft, RunnerConfig(mode=Mode(mode), tree=PARAMS), lockstep_depth=2)
        try:
            assert [runner.run(r).token_ids for r in requests] == want
            if mode == "card":  # the runner's one worker served every session and kept nothing
                assert runner.worker is not None and idle(runner.worker)
        finally:
            runner.close()


def test_a_session_that_breaks_is_dropped_and_the_worker_keeps_serving() -> None:
    """An exception inside one session's drafter (not a CardError) drops that session only."""
    import time

    import torch

    from card.engine.draft.worker import DraftWorker
    from card.engine.shared.config import TreeParams
    from card.engine.shared.tree import Advance, Outcome
    from tests.tiny_models import tiny_model

    layers: list[str] = []
    worker = DraftWorker(tiny_model("llama", seed=0), TreeParams(width=2, max_depth=2),
                         lambda sid, layer: layers.append(sid), slots=4, max_len=64)
    worker.start()
    try:
        worker.start_session("good", [1, 2, 3])
        worker.start_session("bad", [1, 2, 3])
        # a malformed advance (a node id that is no number): a TypeError inside the drafter,
        # not a CardError
        worker.advance("bad", Advance(1, (5,), ("x",), 5, Outcome.MISS))
        deadline = time.monotonic() + 30
        while worker.active_sessions != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.active_sessions == 1
        assert worker.session_stats("good") is not None and worker.session_stats("bad") is None
        n = len(layers)
        worker.advance("good", Advance(1, (), (), int(torch.tensor(7)), Outcome.MISS))
        while len(layers) == n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(layers) > n, "the worker stopped serving the healthy session"
    finally:
        worker.close()


def test_one_forward_grows_every_session_as_it_grows_alone() -> None:
    """Sessions of different prompt lengths (one longer than a prefill chunk) share each draft
    forward, and each gets the very layers its drafter grows by itself."""
    from card.engine.draft.drafter import Drafter
    from card.engine.shared.kv_pool import PREFILL_CHUNK

    model = draft_model("llama", "perturbed")
    long = [(i * 7) % 90 + 1 for i in range(PREFILL_CHUNK + 30)]
    prompts = {"a": [5, 6, 7], "b": list(range(1, 40)), "c": long, "d": [11]}
    got: dict[str, list[Layer]] = {sid: [] for sid in prompts}
    lock = threading.Lock()

    def publish(sid: str, layer: Layer) -> None:
        with lock:
            got[sid].append(layer)

    worker = DraftWorker(model, PARAMS, publish, slots=4, max_len=512, name="batch")
    for sid, prompt in prompts.items():  # queued before the thread runs: all start together
        worker.start_session(sid, prompt)
    worker.start()
    try:
        assert wait_until(lambda: all(len(v) >= PARAMS.max_depth for v in got.values()))
        assert wait_until(lambda: worker.idle.is_set())
    finally:
        worker.close()
    session_forwards = sum(len(v) for v in got.values()) + 1  # + the long prompt's first chunk
    assert worker.forwards < session_forwards and worker.batch_rows == session_forwards
    for sid, prompt in prompts.items():
        alone = Drafter(model, PARAMS, max_len=512)
        alone.start(prompt)
        want = []
        while (layers := alone.grow()) is not None:
            want.extend(layers)
        assert [lay.tokens.tolist() for lay in got[sid]] == [lay.tokens.tolist() for lay in want]
        for g, w in zip(got[sid], want, strict=True):
            torch.testing.assert_close(g.local_logp, w.local_logp, rtol=0, atol=1e-9)
            assert g.b_tokens.tolist() == w.b_tokens.tolist()


def test_a_session_beyond_the_kv_slots_is_not_drafted_and_frees_nothing_else() -> None:
    """More sessions than slots, or a prompt longer than a slot: that session is dropped (the
    target decodes it alone), the others grow on."""
    model = draft_model("llama", "perturbed")
    seen: set[str] = set()
    worker = DraftWorker(model, PARAMS, lambda sid, layer: seen.add(sid), slots=2, max_len=32, name="full")
    dropped: list[str] = []
    worker.on_drop = dropped.append  # the cache hears of each, and frees its place (LayerMessage.dropped)
    worker.start()
    try:
        worker.start_session("long", list(range(1, 40)))  # 39 committed rows > 32
        worker.start_session("a", [1, 2, 3])
        worker.start_session("b", [4, 5, 6])
        worker.start_session("c", [7, 8, 9])  # no slot left
        assert wait_until(lambda: {"a", "b"} <= seen and worker.active_sessions == 2)
        assert seen == {"a", "b"} and worker.pool.free_slots == 0
        assert dropped == ["long", "c"]
        worker.stop_session("a")
        worker.start_session("c", [7, 8, 9])  # a slot came back
        assert wait_until(lambda: "c" in seen)
        assert dropped == ["long", "c"]  # told to stop: not a drop
    finally:
        worker.close()


def test_the_command_queue_is_bounded_and_a_full_one_makes_its_caller_wait() -> None:
    """A worker ``max_commands`` behind makes the next apply() wait for room (backpressure, not an
    unbounded queue); the room comes back as the worker takes commands, and close() still wakes it
    with a full queue (its wake-up takes no room)."""
    from card.engine.draft.worker import DraftWorker
    from card.engine.shared.commands import StopDraft
    from tests.tiny_models import tiny_model

    worker = DraftWorker(tiny_model("llama", seed=0), TreeParams(width=2, max_depth=2),
                         lambda sid, layer: None, slots=2, max_len=64, max_commands=2)
    worker.apply(StopDraft("a"))  # not started: nothing takes them yet
    worker.apply(StopDraft("b"))
    queued = threading.Event()
    third = threading.Thread(target=lambda: (worker.apply(StopDraft("c")), queued.set()), daemon=True)
    third.start()
    assert not queued.wait(0.5), "a third command went into a queue bounded at two"
    worker._drain(block=False)  # the worker takes both: room for the third
    assert queued.wait(10), "the waiting caller never got the room back"
    third.join(10)
    worker._drain(block=False)
    worker.apply(StopDraft("d"))
    worker.apply(StopDraft("e"))  # full again
    worker.start()
    worker.close()  # wakes the worker and joins it, full queue or not
    assert worker._thread is None
