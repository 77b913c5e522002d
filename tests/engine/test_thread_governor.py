"""Adaptive threads (card.engine.shared.thread_governor): the forwards drop to fewer torch threads
while another thread holds a core and climb back when cores idle; the count never changes a bit
of the output; and /proc really tells a busy neighbour apart."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from card.engine.loading.cpu_linear import pack_linears
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.thread_governor import (
    GovernorSettings,
    ProcCores,
    ShapeGovernors,
    ThreadGovernor,
    decoder_layers,
)
from card.engine.shared.torch_threads import name_os_thread, probe_counts, thread_ladder
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine
from tests.engine.support import generate, prompt_cases, wait_until
from tests.tiny_models import tiny_model

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


class Cores:
    """Scripted signals on ``clock``: one team thread waits for its core ``share`` of the time (as
    read at each look: the share since the previous look), ``busy`` threads run beside the team."""

    def __init__(self, clock: Clock, cpus: int = 2) -> None:
        self.clock = clock
        self.cpus = cpus
        self.busy = 0
        self.share = 0.0
        self._delay = 0.0
        self._last = clock.now

    def team_delays_ns(self) -> dict[int, int]:
        self._delay += self.share * (self.clock.now - self._last)
        self._last = self.clock.now
        return {1: 0, 2: int(self._delay * 1e9)}

    def others_running(self) -> int:
        return self.busy

    def refresh(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def governed(most: int, cores: Cores, clock: Clock, **settings: float) -> tuple[ThreadGovernor, list[int]]:
    counts: list[int] = []
    governor = ThreadGovernor(most, cores, GovernorSettings(**settings), clock=clock,  # type: ignore[arg-type]
                              set_threads=counts.append)
    return governor, counts


def test_the_ladder_holds_one_the_powers_of_two_and_the_most() -> None:
    assert thread_ladder(1) == (1,)
    assert thread_ladder(2) == (1, 2)
    assert thread_ladder(6) == (1, 2, 4, 6)
    assert thread_ladder(16) == (1, 2, 4, 8, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:  # the probes check every count the forwards of this thread may drop to
        assert probe_counts() == (1, 2, 3)
    finally:
        torch.set_num_threads(before)


def test_a_thread_that_waits_for_its_core_drops_the_count_a_rung_at_a_time() -> None:
    clock = Clock()
    cores = Cores(clock, cpus=4)
    governor, counts = governed(4, cores, clock)
    assert counts == [4]
    cores.share = 0.1  # 10 ms of every 100 ms window: a serving thread's wake-ups, no more
    for _ in range(5):
        clock.now += 0.1
        governor.check()
    assert governor.count == 4 and governor.drops == 0
    cores.share = 0.5  # half of every window: another thread holds the core
    windows = GovernorSettings().down_windows
    for _ in range(windows - 1):
        clock.now += 0.1
        governor.check()
    assert counts == [4]  # fewer windows over than down_windows could be a burst
    clock.now += 0.1
    governor.check()
    assert counts == [4, 2]  # down_windows in a row: a neighbour
    for _ in range(2 * windows):
        clock.now += 0.1
        governor.check()  # already at one thread after the next down_windows: nothing below
    assert counts == [4, 2, 1] and governor.drops == 2


def test_a_serving_threads_burst_over_four_windows_drops_nothing_by_default() -> None:
    """At 8 in flight the service's own threads (streaming each token, a client reading them)
    take a core for bursts of up to ~80 ms once per iteration: four 20 ms windows over the share
    in a row. Two threads still decode faster beside them (card-target at 8 in flight: 84-86
    tokens/s on two fixed threads against 73 after a drop to one, 2026-11-29), so the default
    needs five windows in a row, which only a neighbour that holds the core fills."""
    clock = Clock()
    cores = Cores(clock)
    governor, counts = governed(2, cores, clock)
    for _ in range(20):
        cores.share = 0.6
        for _ in range(4):
            clock.now += 0.02
            governor.check()
        cores.share = 0.0
        clock.now += 0.02
        governor.check()
    assert counts == [2] and governor.drops == 0


def test_a_burst_in_one_window_drops_nothing() -> None:
    """A request arriving preempts a team thread once (its tokenizing, a client's wake-up): windows
    over the share that are not in a row, or that an idle gap separates, leave the count."""
    clock = Clock()
    cores = Cores(clock)
    governor, counts = governed(2, cores, clock, down_windows=2)
    for _ in range(10):
        cores.share = 0.6  # one window over ...
        clock.now += 0.03
        governor.check()
        cores.share = 0.0  # ... then a clean one
        clock.now += 0.03
        governor.check()
    cores.share = 0.6
    clock.now += 0.03
    governor.check()  # over, at the end of an iteration
    clock.now += 1.0  # the engine idled: no request
    governor.before_iteration()
    clock.now += 0.03
    governor.check()  # over again, but not in a row with the last
    assert counts == [2] and governor.drops == 0
    clock.now += 0.03
    governor.check()  # in a row now
    assert counts == [2, 1]


def test_short_windows_add_up_before_they_are_judged() -> None:
    clock = Clock()
    cores = Cores(clock)
    governor, counts = governed(2, cores, clock, min_window_s=0.02, down_windows=1)
    cores.share = 0.6  # 3.3 ms waited in each 5.5 ms stretch
    for _ in range(3):
        clock.now += 0.0055
        governor.check()
    assert governor.count == 2  # 16.5 ms: too short to judge, and the mark stays where it was
    clock.now += 0.0055
    governor.check()  # 22 ms with 13.2 ms waited
    assert counts == [2, 1]


def test_idle_cores_bring_the_count_back_after_the_hold() -> None:
    clock = Clock()
    cores = Cores(clock)
    governor, counts = governed(2, cores, clock, hold_s=1.0, up_samples=3, down_windows=1)
    cores.share = 0.5
    clock.now += 0.1
    governor.check()
    assert governor.count == 1
    cores.share = 0.0
    for _ in range(5):  # within the hold: cores look idle, no climb yet
        clock.now += 0.1
        governor.before_iteration()
    assert governor.count == 1
    clock.now += 1.0
    governor.before_iteration()
    governor.before_iteration()
    cores.busy = 1  # a busy sample starts the count again
    governor.before_iteration()
    cores.busy = 0
    governor.before_iteration()
    governor.before_iteration()
    assert governor.count == 1
    governor.before_iteration()
    assert counts == [2, 1, 2] and governor.climbs == 1


def test_a_climb_into_busy_cores_doubles_the_hold_and_a_climb_that_held_resets_it() -> None:
    clock = Clock()
    cores = Cores(clock)
    governor, _ = governed(2, cores, clock, hold_s=1.0, hold_max_s=4.0, up_samples=1, settle_s=10.0,
                          down_windows=1)

    def drop() -> None:
        cores.share = 0.5
        clock.now += 0.1
        governor.check()
        cores.share = 0.0
        assert governor.count == 1

    def climb_after(seconds: float) -> bool:
        clock.now += seconds
        governor.before_iteration()
        return governor.count == 2

    drop()
    assert not climb_after(0.9) and climb_after(0.2)  # the first hold: 1 s
    drop()  # right after the climb: the neighbour is still there
    assert not climb_after(1.5) and climb_after(0.6)  # 2 s
    drop()
    assert not climb_after(3.5) and climb_after(0.6)  # 4 s
    drop()
    assert not climb_after(3.9) and climb_after(0.2)  # capped at 4 s
    clock.now += 11.0  # the climb held: the next hold is the first again
    governor.before_iteration()
    drop()
    assert climb_after(1.1)


@torch.inference_mode()
def test_a_generation_is_the_same_bits_whatever_counts_the_governor_picks() -> None:
    model = tiny_model("llama", seed=3, vocab=97, layers=4, hidden=256, dtype=torch.float32)
    pack_linears(model)
    cases = prompt_cases(3, seed=5, max_new=24)
    alone = [generate(model, NoDraft(), p, max_new_tokens=n, logprobs=3) for p, n in cases]
    rng = random.Random(0)

    clock = Clock()

    class Flipping(Cores):  # a neighbour that comes and goes at random, layer by layer
        def team_delays_ns(self) -> dict[int, int]:
            self.share = 0.9 if rng.random() < 0.5 else 0.0
            return super().team_delays_ns()

    def tick() -> float:
        clock.now += 1.0
        return clock.now

    seen: list[int] = []
    settings = GovernorSettings(hold_s=0.0, up_samples=1, min_window_s=0.0, down_windows=1)
    governor = ThreadGovernor(2, Flipping(clock), settings, clock=tick)
    # a forward starts at its first layer (the engine runs the layers itself): an iteration there
    def start(*_: object) -> None:
        governor.before_iteration()
        seen.append(torch.get_num_threads())

    hooks = [model.model.layers[0].register_forward_pre_hook(start)]
    detach = governor.attach(decoder_layers(model))
    hooks += [model.model.layers[-1].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))]
    try:
        governed_runs = [generate(model, NoDraft(), p, max_new_tokens=n, logprobs=3) for p, n in cases]
    finally:
        detach()
        for hook in hooks:
            hook.remove()
        torch.set_num_threads(1)
    for a, b in zip(alone, governed_runs, strict=True):
        assert b.result.token_ids == a.result.token_ids
        assert b.result.logprobs == a.result.logprobs
    # the counts really changed, between iterations and inside forwards
    assert governor.drops >= 5 and governor.climbs >= 5 and {1, 2} <= set(seen)


def spinners(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def on_named_thread(fn: Callable[[], object], name: str) -> object:
    """``fn()`` on a fresh thread with OS name ``name`` (its own OpenMP team), its result."""
    out: list[object] = []
    error: list[BaseException] = []

    def run() -> None:
        name_os_thread(name)
        try:
            out.append(fn())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return out[0]


@linux_only
def test_proc_sees_the_team_and_a_busy_neighbour() -> None:
    cpus = len(__import__("os").sched_getaffinity(0))

    def look() -> tuple[bool, bool]:
        cores = ProcCores.open()
        assert cores is not None and cores.cpus == cpus
        try:
            delays = cores.team_delays_ns()
            assert threading.get_native_id() in delays
            busy = spinners(cpus)
            try:
                seen = wait_until(lambda: cores.others_running() >= 1, timeout_s=20.0)
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
            me = threading.get_native_id()
            return seen, cores.team_delays_ns()[me] >= delays[me]
        finally:
            cores.close()

    seen, growing = on_named_thread(look, "gov-proc-test")  # type: ignore[misc]
    assert seen and growing


@linux_only
def test_a_busy_neighbour_drops_a_real_forward_to_one_thread() -> None:
    """Every core busy beside a two-thread forward: the team waits for its cores, and /proc shows
    it within a few forwards."""
    cpus = len(__import__("os").sched_getaffinity(0))
    model = tiny_model("llama", seed=0, vocab=97, layers=4, hidden=512, dtype=torch.float32)
    pack_linears(model)
    ids = torch.randint(0, 97, (1, 64))

    def run() -> ThreadGovernor:
        cores = ProcCores.open()
        assert cores is not None
        governor = ThreadGovernor(2, cores)
        detach = governor.attach(decoder_layers(model))
        busy = spinners(cpus)
        try:
            torch.set_grad_enabled(False)  # per thread: this one's forwards keep no graph
            for _ in range(500):
                governor.before_iteration()
                model(input_ids=ids)
                governor.after_iteration()
                if governor.count == 1:
                    break
        finally:
            for p in busy:
                p.kill()
                p.wait()
            detach()
            cores.close()
        return governor

    governor = on_named_thread(run, "gov-busy-test")
    assert isinstance(governor, ThreadGovernor)
    assert governor.count == 1 and governor.drops >= 1



def test_the_checkpoints_are_the_decoder_layers_or_none() -> None:
    model = tiny_model("llama", layers=3)
    assert list(decoder_layers(model)) == list(model.model.layers)
    assert len(decoder_layers(torch.nn.Linear(2, 2))) == 0  # checked between iterations only


def test_a_drop_in_decoding_steps_leaves_prefill_chunks_on_every_thread() -> None:
    """ShapeGovernors: a decoding step that collapses beside a draft worker drops the decoding
    count, and the next prompt's prefill chunk still runs on two threads (its own governor saw no
    contention); the decoding count comes back in force for the next decoding step. A prefill
    beside a neighbour that holds a core drops its own count by the same rule."""
    clock = Clock()
    cores = Cores(clock)
    counts: list[int] = []
    governors = ShapeGovernors(2, cores, GovernorSettings(down_windows=1), clock=clock,  # type: ignore[arg-type]
                               set_threads=counts.append)

    def iteration(prefill: bool, share: float) -> int:
        governors.before_iteration(prefill=prefill)
        count = governors.count
        cores.share = share
        clock.now += 0.05
        governors.after_iteration()
        cores.share = 0.0
        return count

    assert iteration(prefill=False, share=0.5) == 2 and governors.decode.count == 1
    assert iteration(prefill=True, share=0.0) == 2 and counts[-1] == 2
    assert iteration(prefill=False, share=0.0) == 1 and counts[-1] == 1
    assert iteration(prefill=True, share=0.5) == 2 and governors.prefill.count == 1
    assert governors.drops == 2


def test_the_engine_says_when_its_next_iteration_prefills() -> None:
    model = tiny_model("llama", seed=0)
    engine = TargetEngine(model, KVPool(model, slots=1, max_len=256))
    assert not engine.prefill_pending
    request = GenerationRequest(tuple(range(3, 40)), SamplingParams(), StopParams(max_new_tokens=3,
                                                                                  ignore_eos=True))
    engine.add(Generation(request, NoDraft(), eos_ids=frozenset(), decode=str, context_window=256,
                          mode="vanilla"))
    assert engine.prefill_pending  # a waiting prompt a free slot admits
    engine.step()  # the whole prompt in one chunk, and its first token
    assert not engine.prefill_pending  # decoding only
    engine.add(Generation(request, NoDraft(), eos_ids=frozenset(), decode=str, context_window=256,
                          mode="vanilla"))
    assert not engine.prefill_pending  # it waits: no free slot
