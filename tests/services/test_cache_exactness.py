"""The cache service between the real engine pieces: a DraftWorker feeding it over gRPC and the
engine's target loop stepping it over gRPC. Output must equal plain decoding token for token,
whatever the draft and whenever the draft worker leaves or joins."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch

from card.common.channels import channel
from card.common.convert import command_from_msg, layer_to_msg
from card.common.drafts import WORKER_ID_METADATA
from card.engine.draft.worker import DraftWorker
from card.engine.shared.commands import AdvanceDraft, StartDraft, StopDraft
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams, TreeParams
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Correction, Layer, Outcome
from card.engine.target.chain_source import ChainSource, NoDraft, SourceStats, StepResult
from card.engine.target.generation import Generation
from card.engine.target.scheduler import finish_alone
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.cache_helpers import FP_A, TIMEOUT, Cache, HandTarget, make_config, start_cache, wait_for
from tests.tiny_models import tiny_model

TREE = TreeParams(width=3, max_depth=5, max_chain=6)
PROMPT = [5, 17, 42, 8, 61, 3]


class RegisteredWorker:
    """A real DraftWorker registered with the cache: commands in, layers out, over gRPC."""

    def __init__(self, addr: str, name: str, model: torch.nn.Module) -> None:
        self.channel = channel(addr)
        stub = cache_pb2_grpc.CacheServiceStub(self.channel)
        self.worker_id = stub.RegisterDraft(cache_pb2.RegisterDraftRequest(
            name=name, model=name, tokenizer_fingerprint=FP_A, capacity=4), timeout=TIMEOUT).worker_id
        self.worker = DraftWorker(model, TREE, self._publish, slots=8, max_len=512, threads=1, name=name)
        self.layers: queue.Queue[cache_pb2.LayerMessage | None] = queue.Queue()
        self.publish = stub.PublishLayers.future(iter(self.layers.get, None),
                                                 metadata=((WORKER_ID_METADATA, self.worker_id),))
        self.commands = stub.Commands(cache_pb2.CommandsRequest(worker_id=self.worker_id))
        self.commands.initial_metadata()  # open on the cache's side: sessions come here from now
        self.worker.start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _publish(self, session_id: str, layer: Layer) -> None:
        stats = self.worker.session_stats(session_id)
        self.layers.put(layer_to_msg(session_id, layer, self.worker_id, stats.forwards if stats else 0,
                                     stats.idle_s if stats else 0.0))

    def _read(self) -> None:
        try:
            for msg in self.commands:
                match command_from_msg(msg):
                    case StartDraft(session_id, committed, epoch, draw):
                        self.worker.start_session(session_id, committed, epoch, draw)
                    case AdvanceDraft(session_id, advance):
                        self.worker.advance(session_id, advance)
                    case StopDraft(session_id):
                        self.worker.stop_session(session_id)
        except grpc.RpcError:
            pass  # cancelled by leave()

    def leave(self) -> None:
        self.commands.cancel()
        self.reader.join(TIMEOUT)
        self.layers.put(None)
        try:
            self.publish.result(TIMEOUT)
        except grpc.RpcError as exc:  # the cache ends a gone worker's layer streams: that is a leave
            if exc.code() is not grpc.StatusCode.CANCELLED:
                raise
        self.worker.close()
        self.channel.close()


class CacheSource(ChainSource):
    """The target side of the wire, as the target service's source does it."""

    def __init__(self, target: HandTarget, on_step: list | None = None) -> None:
        self.target = target
        self.on_step = on_step or []
        self.steps = 0
        self.results: list[StepResult] = []

    def open(self, prompt_ids: Sequence[int]) -> None:
        self.sid = self.target.open(prompt_ids).session_id

    def step(self, correction: Correction) -> StepResult:
        self.steps += 1
        for at, action in self.on_step:
            if at == self.steps:
                action()
        result = self.target.step(self.sid, correction.epoch, correction.next_token,
                                  correction.accepted_tokens, correction.accepted_node_ids)
        self.results.append(result)
        return result

    def close(self, stats: GenerationStats) -> SourceStats:
        resp = self.target.close_session(self.sid, stats)
        return SourceStats(resp.draft_forwards, resp.draft_idle_s)


def generate(model: torch.nn.Module, source: ChainSource, sampling: SamplingParams, n: int = 40):
    request = GenerationRequest(tuple(PROMPT), sampling, StopParams(max_new_tokens=n, ignore_eos=True))
    return finish_alone(model, Generation(request, source, eos_ids=frozenset(), decode=lambda ids: "",
                                          context_window=512, mode="card"))


@pytest.fixture(scope="module")
def target_model() -> torch.nn.Module:
    return tiny_model(seed=0)


@pytest.fixture
def cache(redis_url: str, redis_prefix: str) -> Iterator[Cache]:
    c = start_cache(make_config(redis_url, redis_prefix))
    yield c
    c.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=7)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", ["self", "perturbed", "unrelated"])
def test_output_equals_vanilla(cache: Cache, target_model: torch.nn.Module, sampling: SamplingParams,
                               draft: str) -> None:
    draft_model = {"self": target_model, "perturbed": tiny_model(seed=0, perturb=0.05),
                   "unrelated": tiny_model(seed=3)}[draft]
    vanilla = generate(target_model, NoDraft(), sampling)
    link = RegisteredWorker(cache.addr, "w", draft_model)
    try:
        card = generate(target_model, CacheSource(cache.target), sampling)
    finally:
        link.leave()
    assert card.token_ids == vanilla.token_ids
    if draft == "self" and sampling.greedy:
        # the target drafting for itself: speculation through the cache must pay off
        assert card.stats.hits > 0 and card.stats.mean_accepted_length > 1.0
        assert card.stats.draft_forwards > 0
    assert len(cache.server.sessions) == 0


def test_worker_leaves_and_another_joins_mid_generation(cache: Cache, target_model: torch.nn.Module) -> None:
    vanilla = generate(target_model, NoDraft(), SamplingParams(), n=60)
    links: list[RegisteredWorker] = [RegisteredWorker(cache.addr, "first", target_model)]

    def leave() -> None:
        links[0].leave()
        wait_for(lambda: not cache.target.status().drafts, what="the first worker to be gone")

    def join() -> None:
        links.append(RegisteredWorker(cache.addr, "second", target_model))

    source = CacheSource(cache.target, on_step=[(5, leave), (12, join)])
    try:
        card = generate(target_model, source, SamplingParams(), n=60)
    finally:
        for link in links[1:]:
            link.leave()
    assert card.token_ids == vanilla.token_ids
    # without a worker (steps 5..11) every chain is empty; the second worker brings hits back
    assert all(len(r.chain) == 0 for r in source.results[4:11])
    assert any(r.outcome is Outcome.HIT for r in source.results[12:])
