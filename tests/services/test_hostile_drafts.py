"""A draft is a guest: a scripted hostile draft worker against the cache (in process, real gRPC,
real redis) and, at the end, against a running trio (entry points as subprocesses).

Against the cache:
- capacity: a worker that declares 4096 places gets --max-draft-capacity (negative control: with
  the cap at 4096 it takes nearly every session);
- drops: a dropped session goes to another worker at once, and back to the worker that dropped
  it only after --drop-cooldown-s (a drop never takes a session's draft for life);
- a bad step: a drawn child whose q underflows to 0 (the draft's logp -600 at T 0.5) ends the
  chain instead of failing the step; any step that does fail unforeseen fails only its own
  result of the StepBatch, the other sessions are answered;
- layer streams: streams of a worker end when the worker goes (its heartbeats stop), and cycles
  of register, 2 streams, expire leave no stream open (negative control: without the ending, the
  streams outlive their worker);
- pools bound to tokens: a worker registers into a pool only with its token (card-draft's link
  presents it).

Against a trio, a draft that lies about q on verify rejection requests (its favourite token
marked drawn with q = e^-600): the default target verifies them exactly (plain decoding's tokens,
seed for seed); a target started --allow-rejection never emits the favourite (the q floor);
one started --allow-rejection --rejection-q-floor 0 (negative control) emits it at every step.
The draft never receives a request's seed.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch

from card.cache_service.registry import Worker
from card.common.channels import channel
from card.common.convert import correction_to_msg, layer_to_msg, step_result_from_msg
from card.common.drafts import POOL_TOKEN_METADATA, WORKER_ID_METADATA
from card.draft_service.config import DraftConfig
from card.draft_service.link import CacheLink
from card.engine.draft.worker import DraftWorker
from card.engine.loading.models import ModelConfig
from card.engine.shared.commands import AdvanceDraft, StartDraft
from card.engine.shared.config import DrafterKind, NgramConfig, TreeParams
from card.engine.shared.tree import Correction, Layer, tier_b_probs, virtual_root_id
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.cache_helpers import (
    FP_A,
    TIMEOUT,
    Cache,
    HandDraft,
    expect_start,
    layer,
    make_config,
    rpc_error,
    start_cache,
    wait_for,
)

PROMPT = [1, 2, 3]


@pytest.fixture
def caches(redis_url: str, redis_prefix: str) -> Iterator[list[Cache]]:
    """Caches started by the test (``start``), each closed at the end."""
    started: list[Cache] = []
    yield started
    for c in started:
        c.close()


def start(caches: list[Cache], redis_url: str, redis_prefix: str, **kw: object) -> Cache:
    c = start_cache(make_config(redis_url, f"{redis_prefix}{len(caches)}:", **kw))
    caches.append(c)
    return c


def capacities(cache: Cache) -> dict[str, tuple[int, int]]:
    return {d.name: (d.capacity, d.active_sessions) for d in cache.target.status().drafts}


# ---- capacity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [4, 4096], ids=["capped", "negative-control"])
def test_a_declared_capacity_is_capped_by_the_cache(caches, redis_url, redis_prefix, cap) -> None:
    cache = start(caches, redis_url, redis_prefix, max_draft_capacity=cap)
    honest = cache.draft("honest", capacity=4)
    liar = cache.draft("liar", capacity=4096)
    for _ in range(8):
        cache.target.open(PROMPT)
    held = capacities(cache)
    if cap == 4:
        assert held == {"honest": (4, 4), "liar": (4, 4)}, held  # it gets what the cache allows
        assert cache.target.open(PROMPT).draft == ""  # both full: the ninth waits, no worker
    else:  # the least-loaded worker takes each session: 1 of 4096 is always less than 1 of 4
        assert held["liar"][0] == 4096 and held["liar"][1] >= 7, held
    assert honest.worker_id and liar.worker_id


# ---- drops ------------------------------------------------------------------------------------
def test_a_dropped_session_moves_at_once_and_comes_back_after_the_cooldown(caches, redis_url,
                                                                          redis_prefix) -> None:
    cooldown = 1.5
    cache = start(caches, redis_url, redis_prefix, drop_cooldown_s=cooldown)
    a = cache.draft("a", capacity=2)
    sid = cache.target.open(PROMPT).session_id
    assert expect_start(a).session_id == sid
    b = cache.draft("b", capacity=2)
    drop = cache_pb2.LayerMessage(worker_id=a.worker_id, session_id=sid, dropped=True)
    assert a.publish_msgs([drop]) == 1
    dropped_at = time.monotonic()  # a's cooldown began before this
    assert expect_start(b).session_id == sid  # another worker takes it at once
    drop.worker_id = b.worker_id
    assert b.publish_msgs([drop]) == 1  # both have dropped it now: it waits without a draft
    wait_for(lambda: capacities(cache) == {"a": (2, 0), "b": (2, 0)}, what="both places freed")
    assert cache.target.step(sid, 0, 5).chain.tokens == ()  # it goes on, without a draft
    # not for life: after the cooldown (the monitor's tick) a worker takes it again
    command, came_back = None, None
    deadline = time.monotonic() + cooldown + TIMEOUT
    while command is None and time.monotonic() < deadline:
        for d in (a, b):
            if not d.commands.empty():
                command, came_back = d.next_command(), d
                break
        time.sleep(0.02)
    assert isinstance(command, StartDraft) and command.session_id == sid, command
    assert time.monotonic() - dropped_at >= cooldown - 0.05, "offered again before its cooldown"
    assert came_back is a and cache.server.assignments.cooling() <= 1  # a's cooldown ran out first
    wait_for(lambda: cache.server.assignments.cooling() == 0, what="the cooldowns to be forgotten")


# ---- a bad step -------------------------------------------------------------------------------
def test_a_zero_q_draw_ends_the_chain_and_a_failing_step_fails_only_itself(caches, redis_url, redis_prefix,
                                                                            monkeypatch) -> None:
    cache = start(caches, redis_url, redis_prefix)
    draft = cache.draft("d", capacity=4)
    drawn = cache.target.open(PROMPT, draw=cache_pb2.ChainDraw(temperature=0.5, seed=1)).session_id
    other = cache.target.open(PROMPT).session_id
    root = virtual_root_id(0)
    assert {expect_start(draft).session_id for _ in range(2)} == {drawn, other}
    # below node 0 (token 10) the draft marks token 20 drawn with logp -600: at T 0.5 its q
    # underflows to exactly 0; the Step that hits node 0 draws the chain below it
    assert tier_b_probs([-600.0, 0.0], 0.5)[0] == 0.0
    for sid in (drawn, other):
        draft.publish(sid, layer([root], [0], [10], [0.6], b=[(root, 10, 0.6)]))
    lie = layer([0, 0], [1, 2], [20, 21], [0.9, 0.5], b=[(0, 20, math.exp(-600)), (0, 21, 1.0)])
    draft.publish(drawn, dataclasses.replace(lie, drawn=torch.tensor([True, False])))
    draft.publish(other, layer([0], [1], [20], [0.7], b=[(0, 20, 0.7)]))

    def batch(*sids: str) -> cache_pb2.StepBatchResponse:
        steps = [correction_to_msg(s, Correction(0, (), (), 10)) for s in sids]  # a hit on node 0
        return cache.target.stub.StepBatch(cache_pb2.StepBatchRequest(steps=steps), timeout=TIMEOUT)

    reply = batch(drawn, other)
    assert [r.WhichOneof("result") for r in reply.results] == ["ok", "ok"]
    assert step_result_from_msg(reply.results[0].ok).chain.tokens == ()  # no proposal divides by 0
    assert step_result_from_msg(reply.results[1].ok).chain.tokens == (20,)
    # any unforeseen failure of one session's step: that result says INTERNAL, the rest stand
    table = cache.server.sessions
    real_step = table.step

    def step(session_id: str, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        if session_id == drawn:
            raise ValueError("math domain error")
        return real_step(session_id, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(table, "step", step)
    reply = cache.target.stub.StepBatch(cache_pb2.StepBatchRequest(steps=[
        correction_to_msg(drawn, Correction(1, (), (), 7)),
        correction_to_msg(other, Correction(1, (), (), 8))]), timeout=TIMEOUT)
    kinds = [r.WhichOneof("result") for r in reply.results]
    assert kinds == ["error", "ok"], kinds
    assert reply.results[0].error.code == grpc.StatusCode.INTERNAL.value[0]


# ---- layer streams ----------------------------------------------------------------------------
class SilentStream:
    """A PublishLayers stream that sends nothing until closed (a hostile draft holding a thread)."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, worker_id: str) -> None:
        self.release = threading.Event()

        def quiet() -> Iterator[cache_pb2.LayerMessage]:
            self.release.wait(60.0)
            return
            yield  # a generator

        self.future = stub.PublishLayers.future(quiet(), metadata=((WORKER_ID_METADATA, worker_id),))

    def close(self) -> None:
        self.release.set()
        self.future.cancel()


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "negative-control"])
def test_layer_streams_end_with_their_worker(caches, redis_url, redis_prefix, monkeypatch, ended) -> None:
    if not ended:  # the cache as it was: nothing ends a worker's layer streams when it goes
        monkeypatch.setattr(Worker, "end_layer_streams", lambda self: 0)
    cache = start(caches, redis_url, redis_prefix, heartbeat_interval_s=0.5)  # expires after 1.5 s
    assignments = cache.server.assignments
    streams: list[SilentStream] = []
    try:
        for cycle in range(3 if ended else 1):
            hostile = HandDraft(cache.addr, f"h{cycle}")
            pair = [SilentStream(hostile.stub, hostile.worker_id) for _ in range(2)]
            streams += pair

            def both_open(h: HandDraft = hostile) -> bool:
                h.heartbeat()  # alive until both are open
                return any(w.worker_id == h.worker_id and w.publishing == 2 for w in assignments.workers())

            wait_for(both_open, what="both streams open")
            third = rpc_error(lambda h=hostile: h.publish_msgs([]))  # at most two per worker
            assert third.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            # no heartbeat: the worker expires, and its streams end with it
            wait_for(lambda h=hostile: not any(w.worker_id == h.worker_id for w in assignments.workers()),
                     what="the worker to expire")
            if ended:
                wait_for(lambda p=pair: all(s.future.done() for s in p), what="its streams to end")
                assert all(s.future.code() is grpc.StatusCode.CANCELLED for s in pair)
            else:
                hostile.stream_ended.wait(TIMEOUT)  # gone: its command stream has ended
                start_rounds = cache.server.monitor.rounds
                wait_for(lambda r=start_rounds: cache.server.monitor.rounds >= r + 5, what="monitor rounds")
                assert not any(s.future.done() for s in pair), "the streams outlive their worker"
            gone = rpc_error(lambda h=hostile: h.publish_msgs([]))  # nobody's streams are refused
            assert gone.code() is grpc.StatusCode.NOT_FOUND
            hostile.close()
    finally:
        for s in streams:
            s.close()


# ---- pools bound to tokens --------------------------------------------------------------------
def register(cache: Cache, name: str, pool: str, token: str | None) -> grpc.RpcError | str:
    with channel(cache.addr) as ch:
        stub = cache_pb2_grpc.CacheServiceStub(ch)
        try:
            return stub.RegisterDraft(cache_pb2.RegisterDraftRequest(
                name=name, model="m", tokenizer_fingerprint=FP_A, capacity=2, pool=pool), timeout=TIMEOUT,
                metadata=((POOL_TOKEN_METADATA, token),) if token is not None else None).worker_id
        except grpc.RpcError as err:
            return err


def test_pools_bound_to_tokens(caches, redis_url, redis_prefix) -> None:
    stable, canary = "stable-" + uuid.uuid4().hex, "canary-" + uuid.uuid4().hex
    cache = start(caches, redis_url, redis_prefix, pool_tokens=(("stable", stable), ("canary", canary)))
    for name, pool, token in [("n1", "stable", None), ("n2", "stable", canary), ("n3", "stable", stable[:-1]),
                              ("n4", "other", stable), ("n5", "", None)]:
        err = register(cache, name, pool, token)
        assert isinstance(err, grpc.RpcError) and err.code() is grpc.StatusCode.UNAUTHENTICATED, (name, err)
        assert stable not in err.details() and canary not in err.details()
    assert isinstance(register(cache, "s1", "stable", stable), str)
    assert isinstance(register(cache, "c1", "canary", canary), str)
    assert {d.name: d.pool for d in cache.target.status().drafts} == {"s1": "stable", "c1": "canary"}


@pytest.mark.parametrize("presented", [True, False], ids=["with-token", "without"])
def test_the_draft_link_presents_its_pool_token(caches, redis_url, redis_prefix, presented) -> None:
    token = "pool-" + uuid.uuid4().hex
    cache = start(caches, redis_url, redis_prefix, pool_tokens=(("p", token),))
    states: list[bool] = []
    config = DraftConfig(cache_addr=cache.addr, model=ModelConfig("ngram"), name="linked", pool="p",
                         drafter=DrafterKind.NGRAM, ngram=NgramConfig(table_mb=0.0), tokenizer="unused",
                         capacity=2, retry_initial_s=0.1, pool_token=token if presented else None)

    def build(publish, on_forward, on_drop):  # type: ignore[no-untyped-def]
        worker = DraftWorker.of_kind(DrafterKind.NGRAM, None, TreeParams(), publish,
                                     ngram_config=config.ngram, slots=2, max_len=256, vocab_size=1000,
                                     on_forward=on_forward, on_drop=on_drop, name=config.name)
        return worker, FP_A

    link = CacheLink(config, build, on_serving=states.append)
    link.start()
    try:
        if presented:
            wait_for(lambda: states[-1:] == [True], what="the link to register into its pool")
            assert [d.pool for d in cache.target.status().drafts] == ["p"]
        else:  # refused (and retried with backoff): never registered, never serving
            wait_for(lambda: len(states) >= 2, what="two refused registrations")
            assert True not in states and not cache.target.status().drafts
    finally:
        link.close()


# ---- a lying draft on rejection requests, through a trio ---------------------------------------
def spine(root: int, ids: Iterator[int], tokens: list[int], favourite: int) -> list[Layer]:
    """Below ``root``, the path of ``tokens`` (the target's own, foreseen), and beside each of its
    nodes the favourite: marked drawn, claimed q e^-600 (the path's token holds the rest), and the
    likelier in local logp, so it is the best path too (what an exact request's chain follows).
    Each step the target takes along the path is a hit, and the chain below it is the lie."""
    layers, parent = [], root
    for token in tokens:
        node, fav = next(ids), next(ids)
        lay = layer([parent, parent], [node, fav], [token, favourite], [0.5, 0.99],
                    b=[(parent, token, 1.0), (parent, favourite, math.exp(-600))])
        layers.append(dataclasses.replace(lay, drawn=torch.tensor([False, True])))
        parent = node
    return layers


class LyingDraft(threading.Thread):
    """Knows the target's own tokens for the request at hand (``script``: prompt and plain
    decoding's output for its seed) and lays ``spine`` below each new root while the session's
    text is still on it; records the ChainDraw each session came with."""

    def __init__(self, addr: str, fingerprint: str, favourite: int) -> None:
        super().__init__(daemon=True)
        self.hand = HandDraft(addr, "liar", fingerprint=fingerprint, capacity=16, pool="liar")
        self.favourite = favourite
        self.script: list[int] = []
        self.draws: dict[str, object] = {}
        self._committed: dict[str, list[int]] = {}
        self._ids = iter(range(10**6, 10**12))

    def run(self) -> None:
        beat = threading.Thread(target=self._beat, daemon=True)
        beat.start()
        while True:
            command = self.hand.commands.get()
            if command is None:
                return
            if isinstance(command, StartDraft):
                self.draws[command.session_id] = command.draw
                text = self._committed[command.session_id] = list(command.committed)
                root = virtual_root_id(command.epoch)
            elif isinstance(command, AdvanceDraft):
                a = command.advance
                text = self._committed.setdefault(command.session_id, [])
                text += [*a.accepted_tokens, a.next_token]
                if a.hit_node_id is not None:  # along the spine: the lie below is there already
                    continue
                root = virtual_root_id(a.epoch)
            else:
                continue
            script = self.script
            if text != script[:len(text)] or len(text) >= len(script):
                continue  # off the foreseen text: nothing to lie along
            layers = spine(root, self._ids, script[len(text):], self.favourite)
            try:
                self.hand.publish_msgs([layer_to_msg(command.session_id, lay, self.hand.worker_id)
                                        for lay in layers])
            except (grpc.RpcError, ValueError):  # the cache went, or close() closed the channel
                return

    def _beat(self) -> None:
        """Heartbeat as a worker does: a loaded machine can stretch the test past the registration's
        3 missed beats, and an expired liar serves nothing."""
        while not self.hand.stream_ended.wait(self.hand.heartbeat_interval_s / 2):
            try:
                self.hand.heartbeat()
            except (grpc.RpcError, ValueError):
                return


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lying_draft_cannot_choose_a_rejection_requests_tokens(redis_server, tmp_path) -> None:
    from card.client.remote import generate_remote
    from card.client.trio import LocalTrio
    from card.common.convert import verify_to_msg
    from card.engine.shared.config import SamplingParams, StopParams, Verify
    from card.v1 import target_pb2, target_pb2_grpc
    from tests.tiny_models import save_tiny_checkpoint

    # idle layers: the same logits at a dearer step, so the liar (a Python thread beside pytest)
    # mostly wins its race with the target's steps even on a loaded machine
    model = str(save_tiny_checkpoint(tmp_path / "target", seed=0, idle_layers=96))
    prompt, favourite, seeds = [1, 2, 3, 4, 5], 12345, (3, 4, 5)
    no_adapt = ["--no-adaptive-chains"]  # verify every lying chain, whatever its acceptance
    with LocalTrio(speculation="always", target_model=model, draft_model=model, draft_name="honest",
                   target_threads=1, draft_threads=1, dtype="float64", log_dir=tmp_path / "logs",
                   redis_url=redis_server.url, start_timeout_s=240,
                   extra_args={"cache": ["--redis-prefix", f"lying-{uuid.uuid4().hex[:8]}:"],
                               "target": no_adapt}) as trio:
        more = {}
        for label, flags in [("allowed", ["--allow-rejection"]),
                             ("unfloored", ["--allow-rejection", "--rejection-q-floor", "0"])]:
            more[label] = trio._spawn("card-target", [
                "--model", model, "--cache", trio.cache_addr, "--port", "0", "--no-http", "--threads", "1",
                "--dtype", "float64", "--device", "cpu", "--speculation", "always", *no_adapt, *flags],
                label=f"card-target-{label}")
        addrs = {"default": trio.target_addr, **{k: p.wait_listening(240) for k, p in more.items()}}
        for p in more.values():
            p.wait_serving(240)
        with channel(trio.target_addr) as ch:
            fingerprint = target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.InfoRequest(),
                                                                     timeout=10).tokenizer_fingerprint
        liar = LyingDraft(trio.cache_addr, fingerprint, favourite)
        liar.start()
        try:
            stop = StopParams(12, ignore_eos=True)
            # the target itself never draws the favourite (its p ~ 1e-48 under the bias; unbiased, a
            # tiny random model's flat p, 2e-5, over 36 draws, put it in an honest output by chance
            # about once in 1,400 runs): every favourite in an output is one the rule kept
            unlikely = ((favourite, -100.0),)

            def run(addr: str, seed: int, **kw: object):  # type: ignore[no-untyped-def]
                sampling = SamplingParams(1.0, seed=seed, logit_bias=unlikely)
                return generate_remote(addr, prompt, sampling=sampling, stop=stop,
                                       timeout_s=120, **kw)  # type: ignore[arg-type]

            plain = {s: run(addrs["default"], s, mode="vanilla").token_ids for s in seeds}
            assert all(favourite not in p for p in plain.values())
            runs: dict[str, list] = {label: [] for label in addrs}
            seeded: dict[str, list[int]] = {label: [] for label in addrs}  # each run's seed
            for s in seeds:
                liar.script = [*prompt, *plain[s]]  # one request at a time: the liar knows its text
                for label, addr in addrs.items():
                    # the liar races the target's steps (nothing waits for a draft); on a loaded
                    # machine it can lose every step of a request: ask again until a lie was judged
                    for _ in range(8):
                        r = run(addr, s, draft="liar", verify=verify_to_msg(Verify.REJECTION))
                        runs[label].append(r)
                        seeded[label].append(s)
                        if r.stats.draft_tokens:
                            break
            assert all(r.draft == "liar" for rs in runs.values() for r in rs), \
                str([(label, r.draft, r.stats.draft_tokens) for label, rs in runs.items() for r in rs])
            # default: verified exactly, plain decoding's tokens seed for seed, no drawn chain asked
            assert [r.token_ids for r in runs["default"]] == [plain[s] for s in seeded["default"]]
            assert {r.stats.verify for r in runs["default"]} == {"exact"}
            assert sum(r.stats.draft_tokens for r in runs["default"]) >= len(seeds), "the lies were verified"
            # allowed, with the floor: the rule runs on the lies (no fallback) and keeps none
            allowed = runs["allowed"]
            assert {r.stats.verify for r in allowed} == {"rejection"}
            assert sum(r.stats.draft_tokens for r in allowed) > 0
            assert sum(r.stats.rejection_fallbacks for r in allowed) == 0
            assert sum(r.stats.accepted_draft_tokens for r in allowed) == 0
            assert all(favourite not in r.token_ids for r in allowed), \
                str([(r.token_ids, r.stats) for r in allowed])
            # negative control, no floor: every verified lie is kept
            unfloored = runs["unfloored"]
            kept = sum(r.stats.accepted_draft_tokens for r in unfloored)
            assert kept > 0 and kept == sum(r.stats.draft_tokens for r in unfloored)
            assert sum(r.token_ids.count(favourite) for r in unfloored) >= kept
            # the seed never reached the draft: exact sessions draw nothing, drawn ones have their own
            draws = list(liar.draws.values())
            drawn = [d.seed for d in draws if d is not None]  # type: ignore[attr-defined]
            assert draws.count(None) >= len(seeds) and len(drawn) >= 2 * len(seeds)
            assert not set(drawn) & set(seeds) and len(set(drawn)) == len(drawn)
        finally:
            liar.hand.close()
            liar.join(10)
