"""Hostile peers against a running trio (entry points as subprocesses, tokens on):

- a rogue draft worker holding a stolen draft token: it cannot take the real worker's name, and
  the sessions it is handed get layers with tokens outside the vocabulary, repeated node ids,
  NaN log-probabilities, oversized layers and plausible wrong tokens. Every user's output stays
  exact (greedy and seeded sampling) and no request fails;
- a fuzzer holding both tokens: 10 RPCs x 300 mutated messages. Afterwards no session is left
  live and no service log holds a traceback.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from card.client.remote import build_request, generate_remote
from card.client.trio import LocalTrio
from card.common.channels import channel
from card.common.convert import layer_to_msg
from card.common.tensors import ids_to_msg
from card.engine.shared.commands import AdvanceDraft, StartDraft
from card.engine.shared.config import SamplingParams, StopParams
from card.engine.shared.tree import MAX_LAYER_NODES, Layer, virtual_root_id
from card.v1 import cache_pb2, cache_pb2_grpc, target_pb2, target_pb2_grpc
from tests.services.cache_helpers import HandDraft
from tests.tiny_models import SMOLLM2_VOCAB

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DRAFT_TOKEN = "draft-" + uuid.uuid4().hex
TARGET_TOKEN = "target-" + uuid.uuid4().hex
PROMPTS = ["Name three colours.", "Count to five.", "Write a haiku about rain.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def trio(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTrio]:
    from tests.tiny_models import save_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("hostile")
    model = str(save_tiny_checkpoint(tmp / "target", seed=0))
    with LocalTrio(speculation="always",
                   target_model=model, draft_model=model, draft_name="same", target_threads=1,
                   draft_threads=1, dtype="float64", log_dir=tmp / "logs", redis_url=redis_server.url,
                   draft_token=DRAFT_TOKEN, target_token=TARGET_TOKEN, start_timeout_s=240,
                   extra_args={"cache": ["--redis-prefix", f"hostile-{uuid.uuid4().hex[:8]}:",
                                         "--session-idle-timeout-s", "2"]}) as t:
        yield t


def info(trio: LocalTrio) -> target_pb2.InfoResponse:
    with channel(trio.target_addr) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.InfoRequest(), timeout=10)


# ---- the rogue draft --------------------------------------------------------------------------
def _layer(parents: list[int], ids: list[int], tokens: list[int], logp: list[float]) -> Layer:
    empty_i, empty_f = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    return Layer(torch.tensor(parents, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
                 torch.tensor(tokens, dtype=torch.int64), torch.tensor(logp, dtype=torch.float32),
                 empty_i, empty_i, empty_f)


def poisoned_layers(epoch: int, vocab: int, rng: random.Random, next_id: Iterator[int]) -> list[Layer]:
    root = virtual_root_id(epoch)
    a, b = next(next_id), next(next_id)
    n = MAX_LAYER_NODES + 1
    return [
        _layer([root], [a], [vocab + 10**9], [-0.1]),  # outside the vocabulary
        _layer([root, root], [a, a], [1, 2], [-0.1, -0.2]),  # a repeated node id
        _layer([root], [a], [3], [math.nan]),  # NaN log-probability
        _layer([root] * n, [next(next_id) for _ in range(n)], [4] * n, [-7.0] * n),  # oversized
        # plausible, in the vocabulary, confident and wrong: verified and rejected by the target
        _layer([root, a], [a, b], [rng.randrange(vocab), rng.randrange(vocab)], [-0.01, -0.01]),
    ]


class RogueDraft(threading.Thread):
    def __init__(self, addr: str, fingerprint: str, vocab: int) -> None:
        super().__init__(daemon=True)
        self.hand = HandDraft(addr, "rogue", fingerprint=fingerprint, capacity=64, token=DRAFT_TOKEN)
        self.vocab = vocab
        self.served: set[str] = set()
        self.published = 0
        self._ids = iter(range(10**6, 10**12))
        self._rng = random.Random(7)

    def run(self) -> None:
        while True:
            command = self.hand.commands.get()
            if command is None:
                return
            if isinstance(command, StartDraft):
                epoch = command.epoch
            elif isinstance(command, AdvanceDraft):
                epoch = command.advance.epoch
            else:
                continue
            self.served.add(command.session_id)
            msgs = [layer_to_msg(command.session_id, lay, self.hand.worker_id)
                    for lay in poisoned_layers(epoch, self.vocab, self._rng, self._ids)]
            try:
                self.published += self.hand.publish_msgs(msgs)
            except grpc.RpcError:
                return


def test_a_rogue_draft_with_a_stolen_token_wastes_speculation_but_never_fails_or_changes_output(trio):
    meta = info(trio)
    with pytest.raises(grpc.RpcError) as err:  # the live worker's name is not for the taking
        HandDraft(trio.cache_addr, "same", fingerprint=meta.tokenizer_fingerprint, token=DRAFT_TOKEN)
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
    rogue = RogueDraft(trio.cache_addr, meta.tokenizer_fingerprint, SMOLLM2_VOCAB)
    rogue.start()
    try:
        stop = StopParams(24, ignore_eos=True)
        seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i) for i in range(2)]
        cases = [(p, SamplingParams()) for p in PROMPTS[:2]] + list(zip(PROMPTS[2:4], seeded, strict=True))

        def served(case: tuple[str, SamplingParams], mode: str):
            return generate_remote(trio.target_addr, case[0], sampling=case[1], stop=stop, mode=mode,
                                   timeout_s=120)

        with ThreadPoolExecutor(4) as pool:  # four at once: the least-loaded worker is the rogue
            card = list(pool.map(lambda c: served(c, "card"), cases))
        plain = [served(c, "vanilla") for c in cases]
        assert [r.token_ids for r in card] == [r.token_ids for r in plain]
        assert {r.draft for r in card} >= {"rogue"} and rogue.served and rogue.published
    finally:
        rogue.hand.close()
        rogue.join(10)


# ---- the fuzzer -------------------------------------------------------------------------------
def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 and b:  # flip a few bytes
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1 and b:  # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 2:  # insert garbage
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 3:  # an unknown or mistyped field
        b += bytes([rng.randrange(1, 32) << 3 | rng.randrange(6)])
        b += bytes(rng.randrange(256) for _ in range(8))
    elif kind == 4:  # huge varints where lengths and ids go
        b += b"\x08" + b"\xff" * 9 + b"\x01"
    else:  # noise
        b = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(b)


def seeds(fingerprint: str, worker_id: str) -> dict[str, tuple[str, bytes]]:
    """One valid message per RPC (kind: uu unary, us server stream, su client stream)."""
    prompt = ids_to_msg([1, 2, 3, 4])
    return {
        "/card.v1.CacheService/OpenSession": ("uu", cache_pb2.OpenSessionRequest(
            prompt_ids=prompt, tokenizer_fingerprint=fingerprint, target_model="m", vocab_size=256,
            context_window=512).SerializeToString()),
        "/card.v1.CacheService/Step": ("uu", cache_pb2.StepRequest(
            session_id=uuid.uuid4().hex, epoch=0, accepted_tokens=ids_to_msg([5]),
            accepted_node_ids=ids_to_msg([0]), next_token=6).SerializeToString()),
        "/card.v1.CacheService/StepBatch": ("uu", cache_pb2.StepBatchRequest(
            steps=[cache_pb2.StepRequest(session_id="x", next_token=1)],
            keepalive_session_ids=["y"]).SerializeToString()),
        "/card.v1.CacheService/CloseSession": ("uu", cache_pb2.CloseSessionRequest(
            session_id=uuid.uuid4().hex).SerializeToString()),
        "/card.v1.CacheService/Status": ("uu", cache_pb2.StatusRequest().SerializeToString()),
        "/card.v1.CacheService/RegisterDraft": ("uu", cache_pb2.RegisterDraftRequest(
            name="fuzz", model="m", tokenizer_fingerprint=fingerprint, capacity=2).SerializeToString()),
        "/card.v1.CacheService/Heartbeat": ("uu", cache_pb2.HeartbeatRequest(
            worker_id=worker_id, active_sessions=1).SerializeToString()),
        "/card.v1.CacheService/Commands": ("us", cache_pb2.CommandsRequest(
            worker_id=uuid.uuid4().hex).SerializeToString()),
        "/card.v1.CacheService/PublishLayers": ("su", layer_to_msg(
            uuid.uuid4().hex, _layer([virtual_root_id(0)], [0], [5], [-0.1]), worker_id).SerializeToString()),
        "/card.v1.TargetService/Generate": ("us", build_request(
            "Hello", chat=None, draft=None, sampling=SamplingParams(), stop=StopParams(4),
            mode="card").SerializeToString()),
    }


def call(ch: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.StatusCode:
    try:
        if kind == "uu":
            ch.unary_unary(method)(payload, timeout=2)
        elif kind == "su":
            ch.stream_unary(method)(iter([payload, payload]), timeout=2)
        else:
            for _ in ch.unary_stream(method)(payload, timeout=0.5):
                pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_fuzzed_messages_leave_no_session_and_no_traceback(trio):
    meta = info(trio)
    holder = HandDraft(trio.cache_addr, "fuzz-holder", fingerprint=meta.tokenizer_fingerprint,
                       token=DRAFT_TOKEN)
    rng = random.Random(1234)
    codes: dict[str, dict[str, int]] = {}
    try:
        with channel(trio.cache_addr, DRAFT_TOKEN) as draft_ch, \
                channel(trio.cache_addr, TARGET_TOKEN) as target_ch, channel(trio.target_addr) as front:
            pick: Callable[[str], grpc.Channel] = lambda m: (  # noqa: E731
                front if "TargetService" in m else
                draft_ch if m.rsplit("/", 1)[1] in ("RegisterDraft", "Heartbeat", "Commands", "PublishLayers")
                else target_ch)
            for method, (kind, seed) in seeds(meta.tokenizer_fingerprint, holder.worker_id).items():
                seen = codes.setdefault(method.rsplit("/", 1)[1], {})
                for _ in range(300):
                    code = call(pick(method), method, kind, mutate(seed, rng))
                    seen[code.name] = seen.get(code.name, 0) + 1
                    assert code is not grpc.StatusCode.INTERNAL and code is not grpc.StatusCode.UNKNOWN, \
                        (method, codes)
    finally:
        holder.close()
    assert len(codes) == 10
    # every session the fuzz opened is closed by the idle timeout (2 s here), none is left live
    with channel(trio.cache_addr, TARGET_TOKEN) as ch:
        stub = cache_pb2_grpc.CacheServiceStub(ch)
        deadline = time.monotonic() + 30
        while stub.Status(cache_pb2.StatusRequest(), timeout=10).sessions and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not stub.Status(cache_pb2.StatusRequest(), timeout=10).sessions
    for proc in trio.processes:
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log, f"{proc.name}:\n{log[log.index('Traceback') - 300:][:3000]}"
