"""A draft worker's health follows its link to the cache: NOT_SERVING as soon as the link is broken
(a stream ended, heartbeats stopped reaching the cache), SERVING again once it has registered anew.

Real parts: card-cache and card-draft (model-free, ``--model ngram``) as subprocesses, a real
redis-server; and, for a layer stream that fails while the command stream stays open, a real
cache (SessionTable, Assignments, servicer) whose PublishLayers refuses its first stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from card.cache_service.assignment import Assignments
from card.cache_service.monitor import Monitor
from card.cache_service.servicer import CacheServicer
from card.cache_service.sessions import SessionTable
from card.cache_service.store import RedisStore
from card.common.channels import health_status
from card.common.serving import bind, make_server
from card.draft_service.config import DraftConfig
from card.draft_service.link import CacheLink
from card.engine.draft.worker import DraftWorker
from card.engine.loading.models import ModelConfig
from card.engine.shared.config import DrafterKind, NgramConfig, TreeParams
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.cache_helpers import make_config, wait_for
from tests.services.conftest import RedisServer, free_port, stop_process
from tests.tiny_models import save_tiny_checkpoint

pytestmark = pytest.mark.timeout(240)


def _exe(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CARD_")} | {
        "TOKENIZERS_PARALLELISM": "false"}


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.stderr = open(log, "w")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=_env())

    def addr(self) -> str:
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert " listening on " in line, f"{line!r}; log:\n{self.log.read_text()[-3000:]}"
        return line.rsplit(" ", 1)[1]

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop_process(self.proc, 20)
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.stderr.close()


def start_cache(port: int, redis_server: RedisServer, prefix: str, log: Path) -> Proc:
    cache = Proc([_exe("card-cache"), "--port", str(port), "--metrics-port", "0", "--device", "cpu",
                  "--heartbeat-interval-s", "0.5", "--redis-url", redis_server.url, "--redis-prefix", prefix],
                 log)
    assert cache.addr() == f"127.0.0.1:{port}"
    return cache


def draft_health(addr: str) -> str:
    try:
        return health_status(addr, timeout_s=2.0)
    except grpc.RpcError as err:
        return f"no answer ({err.code().name})"


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return save_tiny_checkpoint(tmp_path / "target", seed=0)  # the SmolLM2 tokenizer, tiny weights


def test_draft_health_follows_its_link_to_the_cache(redis_server: RedisServer, redis_prefix: str,
                                                    tokenizer_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    procs: list[Proc] = []
    try:
        cache = start_cache(port, redis_server, redis_prefix, tmp_path / "cache-1.log")
        procs.append(cache)
        draft = Proc([_exe("card-draft"), "--cache", f"127.0.0.1:{port}", "--model", "ngram", "--tokenizer",
                      str(tokenizer_dir), "--name", "link-health", "--port", "0", "--metrics-port", "0",
                      "--threads", "1", "--nice", "0"], tmp_path / "draft.log")
        procs.append(draft)
        addr = draft.addr()

        def serving() -> bool:
            return draft_health(addr) == "SERVING"

        def not_serving() -> bool:
            return draft_health(addr) == "NOT_SERVING"

        wait_for(serving, 120.0, "the draft to register (SERVING)")

        # a stopped cache: connections stay open, nothing answers; heartbeats stop reaching it
        cache.signal(signal.SIGSTOP)
        wait_for(not_serving, 15.0, "NOT_SERVING with the cache stopped")
        cache.signal(signal.SIGCONT)
        wait_for(serving, 60.0, "SERVING once the cache answers again")

        # a dead cache: the streams end with an error; a new cache on the same address
        cache.signal(signal.SIGKILL)
        cache.proc.wait(10)
        wait_for(not_serving, 15.0, "NOT_SERVING with the cache gone")
        assert not_serving()  # and it stays so while no cache is there
        procs.append(start_cache(port, redis_server, redis_prefix, tmp_path / "cache-2.log"))
        wait_for(serving, 60.0, "SERVING with a cache back")
        log = (tmp_path / "draft.log").read_text()
        assert "link to the cache at" in log and "NOT_SERVING until registered again" in log
    finally:
        for proc in reversed(procs):
            proc.stop()


class RefusesOneLayerStream(CacheServicer):
    """The real servicer, except that its first PublishLayers stream fails once the test says so
    (as a proxy resetting one HTTP/2 stream would); the command stream stays open meanwhile."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.fail_now = threading.Event()
        self.streams = 0

    def PublishLayers(self, request_iterator: Iterator[cache_pb2.LayerMessage],
                      context: grpc.ServicerContext) -> cache_pb2.PublishLayersResponse:
        self.streams += 1
        if self.streams == 1:
            self.fail_now.wait(60.0)
            context.abort(grpc.StatusCode.INTERNAL, "layer stream reset (test)")
        return super().PublishLayers(request_iterator, context)


@pytest.fixture
def flaky_cache(redis_url: str, redis_prefix: str
                ) -> Iterator[tuple[str, RefusesOneLayerStream, Assignments]]:
    config = make_config(redis_url, redis_prefix, heartbeat_interval_s=0.5)
    store = RedisStore(config.redis_url, config.redis_prefix)
    assignments = Assignments()
    sessions = SessionTable(config, store, assignments)
    monitor = Monitor(config, store, assignments, sessions, lambda serving: None)
    servicer = RefusesOneLayerStream(config, store, assignments, sessions, monitor)
    server = make_server(16)
    cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0")
    server.start()
    monitor.start()
    try:
        yield f"127.0.0.1:{port}", servicer, assignments
    finally:
        servicer.fail_now.set()
        monitor.stop()
        servicer.shutdown()
        server.stop(0.5).wait()
        sessions.records.stop()
        store.close()


def test_a_failed_layer_stream_makes_the_draft_not_serving(
        flaky_cache: tuple[str, RefusesOneLayerStream, Assignments]) -> None:
    """PublishLayers fails while Commands stays open: the draft could take commands but its layers
    reach no one. It goes NOT_SERVING, registers again and is SERVING on the new registration."""
    addr, servicer, assignments = flaky_cache
    states: list[bool] = []
    config = DraftConfig(cache_addr=addr, model=ModelConfig("ngram"), name="flaky-layers",
                         drafter=DrafterKind.NGRAM, ngram=NgramConfig(table_mb=0.0), tokenizer="unused",
                         capacity=2, retry_initial_s=0.1)

    def build(publish, on_forward, on_drop):  # type: ignore[no-untyped-def]
        worker = DraftWorker.of_kind(DrafterKind.NGRAM, None, TreeParams(), publish,
                                     ngram_config=config.ngram, slots=2, max_len=256, vocab_size=1000,
                                     on_forward=on_forward, on_drop=on_drop, name=config.name)
        return worker, "fp-flaky"

    lost = REGISTRY.get_sample_value("card_draft_link_lost_total", {"cause": "layers"}) or 0.0
    link = CacheLink(config, build, on_serving=states.append)
    link.start()
    try:
        wait_for(lambda: states[-1:] == [True], what="the first registration")
        (first,) = assignments.workers()
        servicer.fail_now.set()  # the layer stream fails; the command stream is still open
        wait_for(lambda: False in states, what="NOT_SERVING after the layer stream failed")
        wait_for(lambda: states[-1:] == [True] and servicer.streams == 2,
                 what="SERVING on a new registration")
        (second,) = assignments.workers()
        assert second.worker_id != first.worker_id and second.name == "flaky-layers"
        assert states[0] is True and states.index(False) < len(states) - 1
        assert REGISTRY.get_sample_value("card_draft_link_lost_total", {"cause": "layers"}) == lost + 1
    finally:
        link.close()
    assert states[-1] is False  # closing the link: NOT_SERVING
