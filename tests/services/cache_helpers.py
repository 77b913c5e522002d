"""A hand-driven draft worker and target for the cache-service tests (real gRPC clients, no model),
and an in-process cache server to drive them against."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import grpc
import pytest
import torch

from card.cache_service.config import CacheConfig
from card.cache_service.server import CacheServer, create_server
from card.common.channels import channel, wait_serving
from card.common.convert import (
    chain_policy_to_msg,
    command_from_msg,
    correction_to_msg,
    layer_to_msg,
    stats_to_msg,
    step_result_from_msg,
)
from card.common.drafts import WORKER_ID_METADATA
from card.common.tensors import ids_to_msg
from card.engine.shared.commands import AdvanceDraft, DraftCommand, StartDraft
from card.engine.shared.config import ChainPolicy
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Advance, Correction, Layer
from card.engine.target.chain_source import StepResult
from card.v1 import cache_pb2, cache_pb2_grpc

FP_A = "fp-aaaa"
FP_B = "fp-bbbb"
TIMEOUT = 10.0


def layer(parents: Sequence[int], ids: Sequence[int], tokens: Sequence[int], probs: Sequence[float],
          b: Sequence[tuple[int, int, float]] = (), epoch: int = 0) -> Layer:
    """A layer from plain lists; ``b`` holds (parent id, token, prob) secondary entries."""
    return Layer(
        parent_ids=torch.tensor(list(parents), dtype=torch.int64),
        node_ids=torch.tensor(list(ids), dtype=torch.int64),
        tokens=torch.tensor(list(tokens), dtype=torch.int64),
        local_logp=torch.tensor([math.log(p) for p in probs], dtype=torch.float32),
        b_parent_ids=torch.tensor([p for p, _, _ in b], dtype=torch.int64),
        b_tokens=torch.tensor([t for _, t, _ in b], dtype=torch.int64),
        b_logp=torch.tensor([math.log(q) for _, _, q in b], dtype=torch.float32),
        epoch=epoch,
    )


def wait_for(predicate: Callable[[], bool], timeout_s: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


class HandDraft:
    """A draft worker driven by the test: registers, reads its command stream (decoded as the draft
    service does, with ``command_from_msg``), publishes layers."""

    def __init__(self, addr: str, name: str, fingerprint: str = FP_A, model: str = "draft-model",
                 capacity: int = 4, token: str | None = None, pool: str = "") -> None:
        self.channel = channel(addr, token)
        self.stub = cache_pb2_grpc.CacheServiceStub(self.channel)
        self.name = name
        resp = self.stub.RegisterDraft(cache_pb2.RegisterDraftRequest(
            name=name, model=model, tokenizer_fingerprint=fingerprint, capacity=capacity, pool=pool),
            timeout=TIMEOUT)
        self.worker_id = resp.worker_id
        self.heartbeat_interval_s = resp.heartbeat_interval_s
        self.commands: queue.Queue[DraftCommand | None] = queue.Queue()
        self.stream = self.stub.Commands(cache_pb2.CommandsRequest(worker_id=self.worker_id))
        self.stream.initial_metadata()  # the cache has the stream open: it assigns sessions here now
        self.stream_error: grpc.RpcError | None = None
        self.stream_ended = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for command in self.stream:
                self.commands.put(command_from_msg(command))
        except grpc.RpcError as err:
            self.stream_error = err
        finally:
            self.stream_ended.set()
            self.commands.put(None)

    def next_command(self, timeout_s: float = TIMEOUT) -> DraftCommand:
        command = self.commands.get(timeout=timeout_s)
        assert command is not None, "the command stream ended"
        return command

    def no_command(self, wait_s: float = 0.3) -> bool:
        try:
            command = self.commands.get(timeout=wait_s)
        except queue.Empty:
            return True
        raise AssertionError(f"unexpected command {command}")

    def publish(self, session_id: str, lay: Layer, draft_forwards: int = 0, draft_idle_s: float = 0.0,
                worker_id: str | None = None) -> int:
        """Publish one layer on its own client stream; returns once the cache has applied it."""
        msg = layer_to_msg(session_id, lay, worker_id or self.worker_id, draft_forwards, draft_idle_s)
        return self.publish_msgs([msg])

    def publish_msgs(self, msgs: Sequence[cache_pb2.LayerMessage]) -> int:
        """Publish raw layer messages on one client stream; returns the count the cache received."""
        return self.stub.PublishLayers(iter(msgs), timeout=TIMEOUT,
                                       metadata=((WORKER_ID_METADATA, self.worker_id),)).layers_received

    def heartbeat(self, active: int = 0, draining: bool = False) -> None:
        self.stub.Heartbeat(cache_pb2.HeartbeatRequest(worker_id=self.worker_id, active_sessions=active,
                                                       draining=draining), timeout=TIMEOUT)

    def leave(self) -> None:
        """Close the command stream the way a stopped worker does."""
        self.stream.cancel()
        self.stream_ended.wait(TIMEOUT)

    def close(self) -> None:
        self.stream.cancel()
        self.stream_ended.wait(TIMEOUT)
        self.channel.close()


class HandTarget:
    """The target side: OpenSession / Step / CloseSession with hand-made corrections."""

    def __init__(self, addr: str, token: str | None = None) -> None:
        self.channel = channel(addr, token)
        self.stub = cache_pb2_grpc.CacheServiceStub(self.channel)

    def open(self, prompt: Sequence[int], fingerprint: str = FP_A, draft: str = "",
             target_model: str = "target-model", chain: ChainPolicy | None = None, vocab_size: int = 0,
             context_window: int = 0, idle_timeout_ms: int = 0,
             draw: cache_pb2.ChainDraw | None = None, default_pool: str = ""
             ) -> cache_pb2.OpenSessionResponse:
        return self.stub.OpenSession(cache_pb2.OpenSessionRequest(
            prompt_ids=ids_to_msg(prompt), tokenizer_fingerprint=fingerprint, target_model=target_model,
            draft=draft, chain=chain_policy_to_msg(chain) if chain is not None else None,
            vocab_size=vocab_size, context_window=context_window, idle_timeout_ms=idle_timeout_ms,
            draw=draw, default_pool=default_pool), timeout=TIMEOUT)

    def keepalive(self, *session_ids: str) -> None:
        self.stub.StepBatch(cache_pb2.StepBatchRequest(keepalive_session_ids=session_ids), timeout=TIMEOUT)

    def step(self, session_id: str, epoch: int, next_token: int, accepted: Sequence[int] = (),
             accepted_ids: Sequence[int] = ()) -> StepResult:
        correction = Correction(epoch, tuple(accepted), tuple(accepted_ids), next_token)
        msg = correction_to_msg(session_id, correction)
        return step_result_from_msg(self.stub.Step(msg, timeout=TIMEOUT))

    def close_session(self, session_id: str, stats: GenerationStats | None = None
                      ) -> cache_pb2.CloseSessionResponse:
        req = cache_pb2.CloseSessionRequest(session_id=session_id)
        if stats is not None:
            req.stats.CopyFrom(stats_to_msg(stats))
        return self.stub.CloseSession(req, timeout=TIMEOUT)

    def status(self) -> cache_pb2.StatusResponse:
        return self.stub.Status(cache_pb2.StatusRequest(), timeout=TIMEOUT)

    def close(self) -> None:
        self.channel.close()


def make_config(redis_url: str, prefix: str, **kw: object) -> CacheConfig:
    base = CacheConfig(host="127.0.0.1", port=0, redis_url=redis_url, redis_prefix=prefix, metrics_port=0,
                       heartbeat_interval_s=30.0, health_check_interval_s=0.1, session_ttl_s=600)
    return replace(base, **kw)


class Cache:
    def __init__(self, server: CacheServer, port: int) -> None:
        self.server = server
        self.addr = f"127.0.0.1:{port}"
        self.drafts: list[HandDraft] = []
        self.target = HandTarget(self.addr)

    def draft(self, name: str, **kw: object) -> HandDraft:
        d = HandDraft(self.addr, name, **kw)  # type: ignore[arg-type]
        self.drafts.append(d)
        return d

    def close(self) -> None:
        for d in self.drafts:
            d.close()
        self.target.close()
        self.server.stop(1.0).wait()


def start_cache(config: CacheConfig) -> Cache:
    server, port = create_server(config.addr, config)
    server.start()
    cache = Cache(server, port)
    wait_serving(cache.addr, TIMEOUT)
    return cache


def wait_rounds(cache: Cache, n: int) -> None:
    """Until the cache's monitor has run ``n`` more rounds (``Monitor.rounds``, so at least n - 1
    whole ones): what an assertion that the monitor did NOT do something waits for, not a sleep."""
    start = cache.server.monitor.rounds
    wait_for(lambda: cache.server.monitor.rounds >= start + n, what=f"{n} monitor rounds")


def expect_advance(draft: HandDraft, sid: str) -> Advance:
    cmd = draft.next_command()
    assert isinstance(cmd, AdvanceDraft), cmd
    assert cmd.session_id == sid
    return cmd.advance


def expect_start(draft: HandDraft) -> StartDraft:
    cmd = draft.next_command()
    assert isinstance(cmd, StartDraft), cmd
    return cmd


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    return info.value
